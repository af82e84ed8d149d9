"""Side-by-side benchmark of D-KFAC, MPD-KFAC, SPD-KFAC, flow (and SGD) on one recipe: the paper's Table III and Fig. 9.

    python tools/bench.py recipes/resnet50_spd.yaml data.image_size=32 --cluster --nodes 2 --rate 1gbit
    python tools/bench.py recipes/quickstart.yaml --nproc 2 --reps 3
    python tools/bench.py recipes/resnet50_spd.yaml --ablation table4 --cluster    # +-pipelining, +-LBP (Fig. 13)
    python tools/bench.py recipes/resnet50_spd.yaml --ablation fig10 --cluster     # fusion policies (Fig. 10)
    python tools/bench.py recipes/resnet18_synthetic.yaml --ablation flow --cluster  # SPD to flow, one option at a time
    python tools/bench.py recipes/resnet18_synthetic.yaml --ablation rare --intervals 10/100 --cluster  # 10/100 options
    python tools/bench.py recipes/resnet18_synthetic.yaml --intervals 1/10 --cluster   # inverses every 10 steps
    python tools/bench.py recipes/resnet18_synthetic.yaml --ablation libraries --intervals 1/10 --cluster  # libraries
    python tools/bench.py recipes/resnet18_synthetic.yaml --ablation exchange --intervals 1/10 --cluster  # exchange
    python tools/bench.py recipes/resnet18_synthetic.yaml --ablation measured --intervals 1/10 --cluster  # measured
    python tools/bench.py recipes/charlm_gpt.yaml --ablation kinds --intervals 10/100   # each kind of layer's cost
    python tools/bench.py recipes/fashion_cnn.yaml --ablation owners --intervals 10/100  # Muon's Newton-Schulz owners

Each configuration runs ``--steps`` steps; the first ``--warmup`` (which must cover the optimal
fusion's profiling) are discarded and the median of the rest is the step time. With
``--intervals F/I`` (factors every F steps, inverses every I: ``kfac.factor_update_freq`` and
``kfac.inv_update_freq``) the window is whole inverse periods, each from an inversion step on
(warm-up and steps are rounded up to multiples of I), and the step time is their **mean**: a
median would hide the inversion steps. An outside clock
checks it: every configuration also runs once with twice the steps, and the difference of the two
runs' wall times (start-up, calibration and warm-up cancel) over the extra steps ("outside") is
printed beside the same difference of the runs' step times ("inside"), with the gap: time the step
timer misses shows there. No run evaluates or checkpoints before its end (a run twice as long would
otherwise cross an epoch's end the short one does not, and count its evaluation and checkpoint as steps).
Repetitions are interleaved (d, mpd, spd, d, mpd, spd, ...) so that slow
drifts of the machine hit every variant alike. One performance profile is measured first (or given
with ``--profile``) and shared by all runs, so plans and placements are the same in every
repetition. Timing claims about pipelining belong on the emulated cluster (``--cluster``): on plain
loopback the workers and the communication threads fight over the same cores and overlap looks slower than serial.

A configuration whose first item is a script (``tools/bench_loop.py``: one hand-written DDP loop
around kfacflow's library, kfac-pytorch's, or none) runs that script instead of ``run.py``, with
its ``--options`` before the recipe; its steps are timed as a whole, without the breakdown.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_configs import CONFIGS, LOOP  # noqa: E402 - the ablations' configurations, beside this file
from where import record as record_where  # noqa: E402 - tools/, beside this file

from kfacflow.timing import CATEGORIES  # noqa: E402


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("recipe")
    p.add_argument("overrides", nargs="*", help="recipe overrides applied to every run")
    p.add_argument("--ablation", choices=sorted(CONFIGS), default="variants")
    p.add_argument("--only", default="", help="comma-separated subset of the configurations")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=4, help="steps discarded (>= kfac.profile_steps + 2)")
    p.add_argument(
        "--intervals",
        default=None,
        metavar="F/I",
        help="factors every F steps, inverses every I, on every run; the mean over whole inverse periods",
    )
    p.add_argument("--nproc", type=int, default=2, help="workers (per node with --cluster)")
    p.add_argument("--backend", choices=["torch", "horovod"], default="torch", help="dist.backend of every run")
    p.add_argument("--cluster", action="store_true", help="run on the emulated cluster (tools/cluster.py; root)")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--rate", default="1gbit")
    p.add_argument("--delay", default="0ms")
    p.add_argument("--profile", default=None, help="performance profile to share (default: measure one first)")
    p.add_argument("--no-outside-clock", action="store_true", help="skip the runs of twice the steps")
    p.add_argument("--out", default="bench", help="folder for runs, bench.json and bench.png")
    return p.parse_intermixed_args(argv)


def script(config: list[str]) -> tuple[str, list[str], list[str]]:
    """A configuration as its script (``run.py`` unless its first item names one), the script's options, overrides."""
    name, rest = ("run.py", config) if not config or not config[0].endswith(".py") else (config[0], config[1:])
    return name, [c for c in rest if c.startswith("--")], [c for c in rest if not c.startswith("--")]


def run_one(
    args: argparse.Namespace, config: list[str], common: list[str], out_dir: Path, cluster: Any
) -> tuple[int, float]:
    """Run one configuration with the overrides ``common`` to every run; return its exit code and wall seconds."""
    start = time.perf_counter()
    rc = _run(args, config, common, out_dir, cluster)
    return rc, time.perf_counter() - start


def _run(args: argparse.Namespace, config: list[str], common: list[str], out_dir: Path, cluster: Any) -> int:
    path, options, extra = script(config)
    argv = [path, *options, args.recipe, *args.overrides, *common, *extra, f"out_dir={out_dir}", "name=run"]
    argv += ["train.progress=false", f"dist.backend={args.backend}"]
    if cluster is not None:
        return int(cluster.run(argv, nproc_per_node=args.nproc))
    if path != "run.py":  # a loop of its own: started as torchrun starts it
        launch = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.nproc)]
        return subprocess.run([*launch, *argv], cwd=ROOT).returncode
    if args.backend == "horovod":
        hosts = ["horovodrun", "-np", str(args.nproc), "-H", f"localhost:{args.nproc}", "--gloo"]
        return subprocess.run([*hosts, sys.executable, *argv], cwd=ROOT).returncode
    argv.append(f"launch.nproc={args.nproc}")
    return subprocess.run([sys.executable, *argv], cwd=ROOT).returncode


def measure_profile(args: argparse.Namespace, out: Path, cluster: Any) -> Path:
    path = out / "profile.yaml"
    tool = ["tools/fit_perf_models.py", "--dims", "128,256,512,1024,1536,2048", "--out", str(path)]
    rc = (
        cluster.run(tool, nproc_per_node=args.nproc)
        if cluster
        else subprocess.run([sys.executable, *tool, "--nproc", str(args.nproc)], cwd=ROOT).returncode
    )
    if rc != 0:
        raise SystemExit(f"error: measuring the performance profile failed (exit {rc})")
    return path


def collect(run_root: Path, warmup: int) -> dict[str, Any]:
    run_dir = max((p for p in (run_root / "run").iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime)
    steps = [json.loads(line) for line in (run_dir / "timings.jsonl").read_text().splitlines()]
    kept = steps[warmup:]
    # Nothing reads a bench run's checkpoints again, and with K-FAC state they are large (0.5 GB for
    # ResNet-50): a comparison of a dozen runs would otherwise fill a small disk.
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    return {"run_dir": str(run_dir), "steps": kept, "sum_s": sum(s["total"] for s in steps)}


def every(text: str) -> tuple[int, int]:
    """``F/I`` (``--intervals``) as factor and inverse intervals.

    Raises:
        SystemExit: Not two integers >= 1, or I no multiple of F.
    """
    try:
        factor, inverse = (int(v) for v in text.split("/"))
    except ValueError:
        raise SystemExit(f"error: --intervals {text!r}: give F/I, e.g. 1/10 or 10/100") from None
    if factor < 1 or inverse < 1 or inverse % factor:
        raise SystemExit(f"error: --intervals {text}: both >= 1, and I a multiple of F")
    return factor, inverse


NEVER = 10**9
"""An interval (steps, epochs) no benchmark run reaches."""


def intervals(text: str | None, steps: int, warmup: int) -> tuple[list[str], int, int]:
    """``F/I`` as recipe overrides, and ``steps`` and ``warmup`` rounded up to whole inverse periods.

    Steps are counted from 0 and inverses updated where ``step % I == 0``, so a warm-up of a multiple
    of I starts the window on an inversion step, and a window of a multiple of I holds whole periods.

    Raises:
        SystemExit: ``text`` is not two integers >= 1, or I is no multiple of F.
    """
    if text is None:
        return [], steps, warmup
    factor, inverse = every(text)
    warmup = -(-warmup // inverse) * inverse
    window = max(inverse, -(-(steps - warmup) // inverse) * inverse)
    overrides = [f"kfac.factor_update_freq={factor}", f"kfac.inv_update_freq={inverse}"]
    return overrides, warmup + window, warmup


def summarize(
    runs: list[dict[str, Any]], long: dict[str, Any] | None, extra_steps: int, mean: bool = False
) -> dict[str, Any]:
    """The step time of a configuration's runs: the median, or with ``mean`` the mean (whole inverse periods)."""
    steps = [s for r in runs for s in r["steps"]]
    median, average = statistics.median(s["total"] for s in steps), statistics.mean(s["total"] for s in steps)
    out = {
        "median_step_s": median,
        "mean_step_s": average,
        "step_s": average if mean else median,
        # A loop of its own (tools/bench_loop.py) times whole steps: no breakdown to show.
        "breakdown_s": {c: statistics.mean(s.get(c, 0.0) for s in steps) for c in CATEGORIES}
        if any(c in s for s in steps for c in CATEGORIES)
        else None,
        "steps_measured": len(steps),
        "runs": [r["run_dir"] for r in runs],
        "outside_step_s": None,
    }
    if long is not None:
        # The same difference by both clocks: the runs' wall times, and the sums of their step times.
        out["outside_step_s"] = (long["wall_s"] - statistics.mean(r["wall_s"] for r in runs)) / extra_steps
        out["inside_step_s"] = (long["sum_s"] - statistics.mean(r["sum_s"] for r in runs)) / extra_steps
    return out


def table(results: dict[str, dict[str, Any]], ablation: str) -> str:
    names = list(results)
    base = {
        "variants": ("D-KFAC", "MPD-KFAC"),
        "table4": ("-Pipe-LBP", None),
        "fig10": ("Naive", None),
        "flow": ("SPD-KFAC", None),
        "rare": ("flow+rows", None),
        "libraries": ("flow+rows", "loop flow+rows"),
        "exchange": ("flow+rows", None),
        "measured": ("flow+rows", None),
        "kinds": ("optimizer", None),
        "owners": ("muon replicated", None),
    }[ablation]
    wide = max(12, *(len(n) for n in names))
    head = f"{'config':<{wide}} {'s/step':>8} {'inside':>8} {'outside':>8} {'gap':>6} "
    lines = [head + " ".join(f"{c:>12}" for c in CATEGORIES)]
    for name in names:
        r = results[name]
        parts = " ".join(f"{r['breakdown_s'][c]:>12.3f}" if r["breakdown_s"] else f"{'-':>12}" for c in CATEGORIES)
        inside, outside, gap = "-", "-", "-"
        if r.get("outside_step_s") is not None:
            inside, outside = f"{r['inside_step_s']:.3f}", f"{r['outside_step_s']:.3f}"
            gap = f"{100 * (r['outside_step_s'] / r['inside_step_s'] - 1):+.1f}%"
        lines.append(f"{name:<{wide}} {r['step_s']:>8.3f} {inside:>8} {outside:>8} {gap:>6} {parts}")
    lines.append(
        "(inside and outside: the extra time per extra step of a run twice as long, by the step timer and by the wall)"
    )
    lines.append("")
    pairs = [("SPD-KFAC", ref) for ref in base if ref] if ablation == "variants" else []
    pairs = [("flow", ref) for ref in ("D-KFAC", "SPD-KFAC")] + pairs if ablation == "variants" else pairs
    if ablation == "libraries":  # kfacflow against each of kfac-pytorch's configurations
        pairs = [(ours, theirs) for ours in base if ours for theirs in names if theirs.startswith("kfac-pytorch")]
    elif ablation == "exchange":
        ours = [n for n in names if n != "sgd" and not n.startswith("kfac-pytorch")]
        theirs = [n for n in names if n.startswith("kfac-pytorch")]
        pairs = [("+exchange", "flow+rows")] + [(a, b) for a in ours for b in theirs]
    elif ablation != "variants":
        pairs += [(names[-1], ref) for ref in base if ref]
    for best, ref in pairs:
        if ref in results and best in results and ref != best:
            ratio = results[best]["step_s"] / results[ref]["step_s"]
            lines.append(f"{best} / {ref}: {ratio:.3f} of the time (speedup {1 / ratio:.2f}x)")
    first = "sgd" if "sgd" in results else "optimizer" if "optimizer" in results else None
    if first:  # what a K-FAC step costs over the first-order optimizer's
        for name in names:
            if name != first:
                ratio = results[name]["step_s"] / results[first]["step_s"]
                lines.append(f"{name} / {first}: {ratio:.2f}x the step")
    return "\n".join(lines)


def plot(results: dict[str, dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, ax = plt.subplots(figsize=(1.6 * len(names) + 2, 4))
    bottom = [0.0] * len(names)
    for i, cat in enumerate(CATEGORIES):
        vals = [results[n]["breakdown_s"][cat] if results[n]["breakdown_s"] else 0.0 for n in names]
        ax.bar(names, vals, bottom=bottom, label=cat, color=f"C{i}")
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    whole = [0.0 if results[n]["breakdown_s"] else results[n]["step_s"] for n in names]
    if any(whole):
        ax.bar(names, whole, bottom=bottom, label="not broken down", color="0.7")
    ax.set_ylabel("seconds per step (mean after warm-up)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, bbox_to_anchor=(1.02, 1), loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _terminate(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds through the finally that removes the cluster


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    steps = args.steps
    # --intervals rounds the window up to a whole inverse period, so only a plain --steps can leave none
    every, args.steps, args.warmup = intervals(args.intervals, args.steps, args.warmup)
    if args.steps <= args.warmup:
        print(f"error: --steps {steps} counts the --warmup {args.warmup} steps it discards: give more", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _terminate)
    if args.cluster and args.backend == "horovod":
        print("error: --backend horovod runs locally only (horovodrun reaches other nodes over ssh)", file=sys.stderr)
        return 2
    configs = CONFIGS[args.ablation]
    if args.only:
        configs = {k: v for k, v in configs.items() if k in args.only.split(",")}
    if args.backend == "horovod" and any(script(c)[0] != "run.py" for c in configs.values()):
        print(f"error: --backend horovod: {LOOP} runs under torchrun only; leave --backend out", file=sys.stderr)
        return 2
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    record_where(out)
    # Neither run stops at an epoch's end (an evaluation, a K-FAC checkpoint of hundreds of MB): a run twice
    # as long would cross one where the short run does not, and the outside clock would count it as steps.
    # Each run still evaluates and checkpoints once, at its end.
    common = [f"train.timing_warmup={args.warmup}", f"train.checkpoint_every={NEVER}", f"train.eval_every={NEVER}"]
    common += ["train.eval_every_steps=0", *every]
    cluster = None
    if args.cluster:
        sys.path.insert(0, str(ROOT / "tools"))
        from cluster import Cluster

        cluster = Cluster(nodes=args.nodes, rate=args.rate, delay=args.delay).__enter__()
    try:
        profile = Path(args.profile).resolve() if args.profile else measure_profile(args, out, cluster)
        common.append(f"kfac.profile={profile}")
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in configs}
        longs: dict[str, dict[str, Any]] = {}
        plan = [(rep, name) for rep in range(args.reps) for name in configs]
        if not args.no_outside_clock:
            plan += [(-1, name) for name in configs]  # the outside clock's runs of twice the steps
        for rep, name in plan:
            steps = [f"train.steps={args.steps if rep >= 0 else 2 * args.steps}"]
            run_root = out / "runs" / f"{name.replace('/', '_').replace(' ', '_')}-{rep if rep >= 0 else 'long'}"
            what = f"repetition {rep + 1}/{args.reps}" if rep >= 0 else f"{2 * args.steps} steps, for the outside clock"
            print(f"== {name} ({what})", flush=True)
            rc, wall = run_one(args, configs[name], [*common, *steps], run_root, cluster)
            if rc != 0:
                print(f"error: {name} failed with exit code {rc}", file=sys.stderr)
                return rc
            run = {**collect(run_root, args.warmup), "wall_s": wall}
            if rep >= 0:
                runs[name].append(run)
            else:
                longs[name] = run
    finally:
        if cluster is not None:
            cluster.__exit__(None, None, None)
    mean = args.intervals is not None
    results = {name: summarize(r, longs.get(name), args.steps, mean) for name, r in runs.items()}
    where = f"{args.nodes} nodes x {args.nproc} at {args.rate}" if args.cluster else f"{args.nproc} local workers"
    where += f", {args.backend}"
    meta = {
        "recipe": args.recipe,
        "overrides": args.overrides,
        "where": where,
        "steps": args.steps,
        "warmup": args.warmup,
        "reps": args.reps,
        "ablation": args.ablation,
        "intervals": args.intervals,
        "step_s": "mean over whole inverse periods" if mean else "median",
    }
    (out / "bench.json").write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    text = table(results, args.ablation)
    (out / "bench.txt").write_text(text + "\n")
    plot(results, out / "bench.png", f"{Path(args.recipe).stem} {' '.join(args.overrides)} — {where}")
    print(text)
    print(f"\nwrote {out / 'bench.json'}, {out / 'bench.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
