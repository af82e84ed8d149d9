"""Time to accuracy: train one recipe with SGD, AdamW, Muon and K-FAC, each tuned by the same kind of sweep.

    python tools/fetch_fashion_mnist.py --out data/fashion-mnist
    python tools/tta.py recipes/fashion_cnn.yaml --epochs 4 --seeds 0,1,2 --targets 0.88,0.90 \
        --out runs/tta_fashion_cnn

By default the recipe as it is (``recipe``) races SGD, AdamW and Muon, each swept.

For every optimizer (``--optimizers``) every point of its grid (``--grid``, or its default in ``tta_optimizers.py``)
is trained with the first seed for the whole budget; the point with the best final validation
accuracy (ties: fewer training seconds) is then trained with the other seeds. Every run is a plain
``python run.py RECIPE ...`` on the recipe's workers (``launch.nproc``) with the same epochs,
evaluating every ``--eval-every`` steps; each evaluation records the training seconds so far
(``seconds`` in the run's history: wall time of the training loop, evaluations and checkpoints
left out, the same clock for every optimizer). The overrides after the recipe go to every run; one of
a key tta sets itself is refused in one line naming the option to use instead (``train.steps``: ``--epochs``,
``train.seed``: ``--seeds``, a key an optimizer or its grid sets: ``--grid``; ``tools/tta_args.py``), except
``train.save`` and ``train.progress``, where the user's value wins. Every run is checked as ``run.py`` checks
a recipe before the first starts. A run whose ``summary.json`` is already in ``--out``
is read, not trained again, so an interrupted sweep resumes where it stopped (one trained with other settings,
another ``--epochs``, overrides or recipe text, is refused in one line). A point whose run
diverges (the updates overflow: ``run.py`` exits 3) is reported in ``tta.json``'s ``diverged`` and
never chosen; a chosen point diverging on another seed ends the sweep.

The budget is a setting like the rate: a grid may sweep ``train.steps`` (it wins over ``--epochs``, and the
cosine schedule spans it), e.g. ``--grid "sgd=optim.lr:0.05;train.steps:1170,1404"``, so that each
optimizer is compared at its own best budget; the picture's legend names a chosen point's budget.

``--loss-targets 1.6,1.5`` times the runs to validation losses at or below each, as ``--targets`` to
accuracies (a language model's, ``recipes/charlm_gpt.yaml``); given alone, they replace the accuracy
targets, and the point of a sweep is then the one with the lowest final validation loss, and the picture
plots the loss.

``--stop-at`` ends each run at its first evaluation at or above the highest target
(``train.stop_at_accuracy``) and at or below the lowest loss target (``train.stop_at_loss``): the
learning-rate schedule is still the whole budget's, so the curve up to there is the full run's, and
the rest of the budget is not spent. The point of a sweep is then the one first to that target (not
the best final accuracy), and the table's accuracy is the one at the stop.

Writes ``tta.json`` (every run's history, the chosen points, the summary), ``tta.md`` (the mean step:
training seconds over steps, inversion steps and all; seconds and epochs to each target: mean and
range over the seeds that reach it, with how many did, and K-FAC's time as a ratio to the fastest
first-order optimizer that every seed of which reached it) and
``tta.png`` (validation accuracy against training seconds and against epochs, mean over seeds).
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import where
from tta_args import check_runs, parse, parse_grid, run_overrides
from tta_optimizers import FIRST_ORDER, GRIDS, OPTIMIZERS

from kfacflow.configuration.recipe import find_recipe

ROOT = Path(__file__).resolve().parents[1]


def point_name(point: list[str]) -> str:
    """A folder name for one point of a grid (``optim.lr=0.1 kfac.damping=0.03`` -> ``lr0.1_damping0.03``)."""
    return "_".join(item.split("=")[0].rsplit(".", 1)[-1] + item.split("=")[1] for item in point) or "recipe"


@dataclass(frozen=True)
class Target:
    """A validation accuracy to reach (at or above it), or with ``loss`` a validation loss (at or below it)."""

    value: float
    loss: bool = False

    def met(self, record: dict[str, Any]) -> bool:
        """Whether the evaluation ``record`` reached it."""
        return bool(record["val_loss"] <= self.value if self.loss else record["val_acc"] >= self.value)

    @property
    def key(self) -> str:
        """Its name in ``tta.json``'s rows: ``0.9``, ``loss1.5``."""
        return f"loss{self.value:g}" if self.loss else f"{self.value:g}"

    @property
    def label(self) -> str:
        """Its name in the table: ``90%``, ``loss 1.5``."""
        return f"loss {self.value:g}" if self.loss else f"{self.value:.0%}"


def targets_of(given: float | Target | Sequence[float | Target]) -> list[Target]:
    """Targets as :class:`Target` (a bare number is an accuracy; 0 is none)."""
    items = given if isinstance(given, Sequence) else [given] if given else []
    return [item if isinstance(item, Target) else Target(item) for item in items]


def reached(history: list[dict[str, Any]], target: float | Target | Sequence[Target]) -> dict[str, float] | None:
    """The first evaluation that reached ``target`` (every one of a list): its training seconds and epoch (None if
    none did)."""
    wanted = targets_of(target)
    for record in history:
        if all(t.met(record) for t in wanted):
            return {"seconds": record["seconds"], "epoch": record["epoch"]}
    return None


DIVERGED = 3
"""``run.py``'s exit code when training cannot go on (:class:`kfacflow.TrainingError`: the updates overflowed)."""


def train(recipe: str, overrides: list[str], folder: Path) -> dict[str, Any]:
    """Run ``run.py`` once (or read the summary a previous sweep left in ``folder``); return its summary.

    A run that diverged returns ``{"diverged": its last line}`` (and leaves it in ``folder/diverged.txt``,
    so that a rerun does not train it again); any other failure ends the sweep.
    """
    summary_file, diverged = folder / "summary.json", folder / "diverged.txt"
    text = Path(find_recipe(recipe)).read_bytes()  # a shipped recipe's name too
    asked = [recipe, hashlib.sha256(text).hexdigest()[:12], *overrides]  # the recipe's text too
    if diverged.is_file():
        return {"diverged": diverged.read_text().strip()}
    if not summary_file.is_file():
        folder.parent.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, str(ROOT / "run.py"), recipe, *overrides, f"out_dir={folder.parent}"]
        print("  $", " ".join(command[1:]), flush=True)
        t0 = time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        wall = time.perf_counter() - t0
        if done.returncode == DIVERGED:
            line = done.stderr.strip().splitlines()[-1]
            folder.mkdir(parents=True, exist_ok=True)
            diverged.write_text(line + "\n")
            return {"diverged": line}
        if done.returncode != 0:
            print(done.stderr[-3000:].rstrip(), file=sys.stderr)  # the run's own account, then one line
            raise SystemExit(f"error: the run above failed (exit {done.returncode}); its folder is in {folder.parent}")
        run_dir = Path(done.stdout.strip().splitlines()[-1])
        summary = json.loads((run_dir / "summary.json").read_text())
        summary["outside_wall_s"] = wall
        summary["tta_run"] = asked  # what a rerun must ask for to read it instead of training
        run_dir.rename(folder)  # a stable name, so that a rerun finds it
        summary_file.write_text(json.dumps(summary, indent=1))
    summary = json.loads(summary_file.read_text())
    if summary.get("tta_run", asked) != asked:
        raise SystemExit(
            f"error: {folder} was trained with other settings ({' '.join(summary['tta_run'])}); "
            "give another --out, or remove that folder to train it again"
        )
    return summary  # type: ignore[no-any-return]


def record(name: str, point: list[str], seed: int, summary: dict[str, Any]) -> dict[str, Any]:
    """What ``tta.json`` keeps of one run."""
    return {
        "optimizer": name,
        "point": point,
        "seed": seed,
        "val_acc": summary["val_acc"],
        "val_loss": summary.get("val_loss"),
        "train_seconds": summary["history"][-1]["seconds"],
        "steps": summary["steps"],
        "step_time_median_s": summary["step_time_median_s"],
        "outside_wall_s": summary.get("outside_wall_s"),
        "stopped_at_accuracy": summary.get("stopped_at_accuracy"),
        "stopped_at_loss": summary.get("stopped_at_loss"),
        "history": [{k: r[k] for k in ("epoch", "step", "seconds", "val_acc", "val_loss")} for r in summary["history"]],
    }


def best(runs: list[dict[str, Any]], stop_at: float | Sequence[Target] = 0.0, loss: bool = False) -> dict[str, Any]:
    """The run with the best final validation accuracy (``loss``: the lowest validation loss); ties go to fewer
    training seconds.

    With ``stop_at`` (the runs stopped there, at every target of a list): the first to reach it, then the best.
    """
    final = (lambda r: r["val_loss"]) if loss else (lambda r: -r["val_acc"])
    if targets_of(stop_at):

        def first(run: dict[str, Any]) -> float:
            hit = reached(run["history"], targets_of(stop_at))
            return hit["seconds"] if hit else float("inf")

        return min(runs, key=lambda r: (first(r), final(r)))
    return min(runs, key=lambda r: (final(r), r["train_seconds"]))


def summarize(chosen: dict[str, list[dict[str, Any]]], targets: Sequence[float | Target]) -> list[dict[str, Any]]:
    """Per optimizer and target: seconds and epochs to it over the seeds (mean, range, how many reached it)."""
    rows = []
    for name, runs in chosen.items():
        losses = [r["val_loss"] for r in runs if r.get("val_loss") is not None]
        row: dict[str, Any] = {
            "optimizer": name,
            "point": runs[0]["point"],
            "seeds": len(runs),
            "final_acc_mean": statistics.fmean(r["val_acc"] for r in runs),
            "final_acc_range": [min(r["val_acc"] for r in runs), max(r["val_acc"] for r in runs)],
            "final_loss_mean": statistics.fmean(losses) if losses else None,
            "step_ms": 1000 * statistics.fmean(r["train_seconds"] / r["steps"] for r in runs),
            "median_step_ms": 1000 * statistics.fmean(r["step_time_median_s"] for r in runs),
            "budget_seconds": statistics.fmean(r["train_seconds"] for r in runs),
            "stopped": sum(1 for r in runs if r.get("stopped_at_accuracy") or r.get("stopped_at_loss")),
        }
        for target in targets_of(targets):
            hits = [h for r in runs if (h := reached(r["history"], target)) is not None]
            entry: dict[str, Any] = {"reached": len(hits)}
            for unit in ("seconds", "epoch"):
                values = [h[unit] for h in hits]
                entry[unit] = statistics.fmean(values) if values else None
                entry[f"{unit}_range"] = [min(values), max(values)] if values else None
            row[target.key] = entry
        rows.append(row)
    return rows


def markdown(rows: list[dict[str, Any]], given: Sequence[float | Target]) -> str:
    """The table of ``tta.md``: a K-FAC row's seconds also as a ratio to the fastest first-order optimizer."""
    targets = targets_of(given)
    losses = any(t.loss for t in targets)  # a final loss column beside the accuracy
    head = "| optimizer (chosen point) | final val acc |" + (" final val loss |" if losses else "")
    head += " ms/step (mean) |"
    head += "".join(f" to {t.label}: s (range) | epochs |" for t in targets)
    lines = [head, "|" + "---|" * (3 + losses + 2 * len(targets))]
    fastest = {}  # per target: the fewest mean seconds of a first-order optimizer whose every seed reached it
    for target in targets:
        key = target.key
        times = [r[key]["seconds"] for r in rows if r["optimizer"] in FIRST_ORDER and r[key]["reached"] == r["seeds"]]
        fastest[target] = min(times) if times else None
    for row in rows:
        acc = row["final_acc_mean"]
        stopped = f" ({row['stopped']} stopped at the target)" if row.get("stopped") else ""
        cells = [f"{row['optimizer']} ({' '.join(row['point']) or 'recipe'})", f"{acc:.3f}{stopped}"]
        if losses:
            cells.append("-" if row.get("final_loss_mean") is None else f"{row['final_loss_mean']:.3f}")
        cells.append(f"{row['step_ms']:.1f}")
        for target in targets:
            entry = row[target.key]
            if not entry["reached"]:
                cells += [f"not in {row['budget_seconds']:.0f} s ({_seeds(row['seeds'])})", "-"]
                continue
            lo, hi = entry["seconds_range"]
            share = "" if entry["reached"] == row["seeds"] else f", {entry['reached']}/{row['seeds']} seeds"
            ratio = ""
            if fastest[target] and row["optimizer"] not in FIRST_ORDER:
                ratio = f" = {entry['seconds'] / fastest[target]:.2f}x"
            cells += [f"{_s(entry['seconds'])} ({_s(lo)}-{_s(hi)}){ratio}{share}", f"{entry['epoch']:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _budget(run: dict[str, Any]) -> str:
    """``, budget 2.5 epochs`` where the run's point sets ``train.steps`` (else the title's epochs hold)."""
    steps = [int(item.split("=", 1)[1]) for item in run["point"] if item.startswith("train.steps=")]
    first = run["history"][0]
    if not steps or not steps[-1] or not first["step"]:
        return ""
    return f", budget {steps[-1] * first['epoch'] / first['step']:.3g} epochs"


def _seeds(n: int) -> str:
    return f"{n} seed" if n == 1 else f"{n} seeds"


def _s(seconds: float) -> str:
    return f"{seconds:.1f}" if seconds < 100 else f"{seconds:.0f}"


def picture(chosen: dict[str, list[dict[str, Any]]], given: Sequence[float | Target], path: Path, title: str) -> None:
    """Validation accuracy (with loss targets: loss) against training seconds and against epochs, the mean over
    seeds of each optimizer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loss = any(t.loss for t in targets_of(given))
    targets = [t.value for t in targets_of(given) if t.loss == loss]
    metric = "val_loss" if loss else "val_acc"
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for name, runs in chosen.items():
        n = min(len(r["history"]) for r in runs)  # the same evaluations in every seed's run
        label = f"{name} ({_seeds(len(runs))}{_budget(runs[0])})"
        for ax, unit in zip(axes, ("seconds", "epoch"), strict=True):
            x = [statistics.fmean(r["history"][i][unit] for r in runs) for i in range(n)]
            y = [statistics.fmean(r["history"][i][metric] for r in runs) for i in range(n)]
            ax.plot(x, y, marker=".", label=label)
    values = [h[metric] for runs in chosen.values() for r in runs for h in r["history"]]
    for ax, unit in zip(axes, ("training seconds", "epochs"), strict=True):
        for target in targets:
            ax.axhline(target, color="grey", lw=0.6, ls="--")
        ax.set_xlabel(unit)
        if loss:  # the first evaluations' losses would squeeze the targets' part of the curves
            ax.set_ylim(None, min(max(values), max(targets) + 1.0))
        else:
            ax.set_ylim(max(min(values), min(targets) - 0.08), None)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("validation loss" if loss else "validation accuracy")
    axes[0].legend(loc="upper right" if loss else "lower right")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """Sweep, choose, repeat over seeds, summarize."""
    args = parse(argv, __doc__.splitlines()[0], OPTIMIZERS, GRIDS)
    check_runs(args, OPTIMIZERS)
    names, grids, seeds = args.names, args.grids, args.seeds
    targets = [*targets_of(args.targets), *(Target(value, loss=True) for value in args.loss_targets)]
    stop_at = [Target(args.stop_at)] if args.stop_at else []
    stop_at += [Target(args.stop_at_loss, loss=True)] if args.stop_at_loss else []
    tail = "".join(f"_to{t.key}" for t in stop_at)  # a stopped run is no full run to reuse, nor the other way
    everything: list[dict[str, Any]] = []
    diverged: list[dict[str, Any]] = []
    chosen: dict[str, list[dict[str, Any]]] = {}
    for name in names:
        print(f"{name}: sweep {grids[name]} (seed {seeds[0]})", flush=True)
        sweep = []
        for point in parse_grid(grids[name]):
            folder = args.out / "runs" / name / point_name(point) / f"seed{seeds[0]}{tail}"
            overrides = run_overrides(args, OPTIMIZERS[name], point, seeds[0])
            summary = train(args.recipe, overrides, folder)
            if "diverged" in summary:  # a point too aggressive to train: reported, never chosen
                diverged.append({"optimizer": name, "point": point, "seed": seeds[0], **summary})
                print(f"  {' '.join(point)}: diverged: {summary['diverged']}", flush=True)
                continue
            sweep.append(record(name, point, seeds[0], summary))
            loss = f", val loss {sweep[-1]['val_loss']:.4f}" if sweep[-1]["val_loss"] is not None else ""
            print(f"  {' '.join(point)}: val acc {sweep[-1]['val_acc']:.4f}{loss}", flush=True)
        if not sweep:
            raise SystemExit(f"error: {name}: every point of its sweep diverged ({grids[name]})")
        top = best(sweep, stop_at, loss=bool(args.loss_targets))
        chosen[name] = [top]
        for seed in seeds[1:]:
            folder = args.out / "runs" / name / point_name(top["point"]) / f"seed{seed}{tail}"
            overrides = run_overrides(args, OPTIMIZERS[name], top["point"], seed)
            summary = train(args.recipe, overrides, folder)
            if "diverged" in summary:
                raise SystemExit(f"error: {name} {' '.join(top['point'])} seed {seed} diverged: {summary['diverged']}")
            chosen[name].append(record(name, top["point"], seed, summary))
        everything += sweep + chosen[name][1:]
    rows = summarize(chosen, targets)
    table = markdown(rows, targets)
    command = "python tools/tta.py " + " ".join(argv if argv is not None else sys.argv[1:])
    result = {
        "command": command,
        "recipe": args.recipe,
        "epochs": args.epochs,
        "seeds": seeds,
        "targets": args.targets,
        "loss_targets": args.loss_targets,
        "stop_at": args.stop_at or None,
        "stop_at_loss": args.stop_at_loss or None,
        "cpus": os.cpu_count(),
        "grids": {n: grids[n] for n in names},
        "summary": rows,
        "runs": everything,
        "diverged": diverged,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "tta.json").write_text(json.dumps(result, indent=1))
    where.record(args.out)
    (args.out / "tta.md").write_text(f"`{command}`\n\n{table}")
    swept = " or the legend's budget" if any(_budget(runs[0]) for runs in chosen.values()) else ""
    picture(
        chosen, targets, args.out / "tta.png", f"{Path(args.recipe).stem}, {args.epochs} epochs{swept}, mean over seeds"
    )
    print(table, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
