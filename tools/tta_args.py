"""``tools/tta.py``'s command line: every argument checked, and every run's recipe checked, before any run starts.

A user's recipe overrides go to every run. tools/tta.py sets some keys itself; for each, a user's
value either wins or is refused with one ``error:`` line (never replaced without a word):

- :data:`CONTROLLED` keys decide how time to accuracy is measured and where runs are kept, the same
  for every optimizer: refused, naming the option to use instead (``train.steps`` -> ``--epochs``).
- The keys an optimizer of ``--optimizers`` is made of (:data:`tta_optimizers.OPTIMIZERS`) or its grid sweeps:
  refused, naming the ``--optimizers`` or ``--grid`` that gives the value instead.
- :data:`DEFAULTS` change no time measured: a user's value wins (``train.save=true`` keeps checkpoints).
"""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path

from tool_args import count, listed, number, out_folder

CONTROLLED = {
    "out_dir": "it keeps each run in --out, where a rerun finds it; use --out",
    "train.seed": "it repeats the chosen point of each optimizer over --seeds; use --seeds",
    "train.epochs": "every optimizer gets the same budget; use --epochs",
    "train.steps": "every optimizer gets the same budget; use --epochs, or sweep it: --grid NAME=train.steps:N",
    "train.eval_every_steps": "the time to a target is read at these evaluations, alike in every run; use --eval-every",
    "train.stop_at_accuracy": "where runs stop decides the chosen point and the table; use --stop-at (the top target)",
    "train.stop_at_loss": "where runs stop decides the chosen point and the table; use --stop-at (the lowest "
    "--loss-targets)",
}
"""Keys tools/tta.py sets on every run, and why a user's value is refused (only a grid may sweep ``train.steps``)."""
DEFAULTS = ["train.progress=false", "train.save=false"]
"""What tools/tta.py sets unless the user's overrides say otherwise: a progress bar nobody sees (a run's output is
captured) and no checkpoints (written outside the timed loop: either way the seconds measured are the same)."""
CHOOSES = ("kfac.variant", "optim.name")
"""Keys that make an optimizer of ``--optimizers`` what it is: another value makes another optimizer."""


def parse_grid(text: str) -> list[list[str]]:
    """``KEY:V1,V2;KEY2:V3`` -> every combination, as override lists (``["KEY=V1", "KEY2=V3"]``, ...)."""
    axes = []
    for part in filter(None, text.split(";")):
        key, sep, values = part.partition(":")
        items = [v.strip() for v in values.split(",")]
        if not sep or not key.strip() or not all(items):
            raise SystemExit(f"error: --grid {text!r}: each part is KEY:VALUE[,VALUE...], not {part!r}")
        axes.append([f"{key.strip()}={v}" for v in items])
    return [list(point) for point in itertools.product(*axes)] if axes else [[]]


def parse(
    argv: list[str] | None, description: str, optimizers: dict[str, list[str]], grids: dict[str, str]
) -> argparse.Namespace:
    """Parse and check tools/tta.py's arguments and the user's overrides (see the module's docstring); create --out.

    Besides the arguments, the result holds ``names`` (the optimizers, in order), ``grids`` (each one's grid),
    ``stop_at`` and ``stop_at_loss`` (the accuracy and the loss runs stop at; 0: they do not), ``targets``
    in ascending and ``loss_targets`` in descending order (``--targets`` 0.9 where neither is given).

    Raises:
        SystemExit: One ``error:`` line naming the argument or override to change (argparse's usage error for a
            value that is no number).
    """
    parser = argparse.ArgumentParser(prog="tools/tta.py", description=description)
    parser.add_argument("recipe")
    parser.add_argument(
        "overrides",
        nargs="*",
        help="recipe overrides for every run (e.g. data.root=...); one of a key tta sets itself is refused, "
        "but train.save and train.progress are the user's",
    )
    parser.add_argument("--optimizers", default="sgd,adamw,muon,recipe", help=f"of {', '.join(optimizers)}")
    parser.add_argument("--grid", action="append", default=[], metavar="NAME=KEY:V,V;KEY:V", help="a sweep")
    parser.add_argument("--epochs", type=count(1, "4"), default=4)
    parser.add_argument("--seeds", type=listed(count(0, "0", high=2**63 - 1), "0,1,2"), default="0,1,2")
    parser.add_argument("--eval-every", type=count(1, "100"), default=100, help="steps between evaluations")
    parser.add_argument(
        "--targets", type=listed(number(0, "0.9", high=1), "0.88,0.9"), default=None, help="accuracies (default 0.9)"
    )
    parser.add_argument(
        "--loss-targets",
        type=listed(number(0, "1.5"), "1.6,1.5"),
        default=[],
        help="validation losses to reach (at or below), e.g. a language model's; alone, they replace --targets",
    )
    parser.add_argument("--out", type=Path, default=Path("runs/tta"))
    parser.add_argument(
        "--stop-at", action="store_true", help="end each run once it reaches the highest target (and lowest loss)"
    )
    args = parser.parse_intermixed_args(argv)  # overrides before or after the options, as in the README
    args.names = [n.strip() for n in args.optimizers.split(",") if n.strip()]
    unknown = [n for n in args.names if n not in optimizers]
    if unknown or not args.names or len(set(args.names)) < len(args.names):
        what = f"unknown {unknown}" if unknown else "none named" if not args.names else "one named twice"
        raise SystemExit(f"error: --optimizers {args.optimizers!r}: {what}; choose from {', '.join(optimizers)}")
    given: dict[str, str] = {}
    for text in args.grid:
        name, sep, grid = text.partition("=")
        if not sep or name.strip() not in optimizers:
            raise SystemExit(f"error: --grid {text!r}: NAME=KEY:V,V with NAME one of {', '.join(optimizers)}")
        if name.strip() in given:  # the later one would replace the first without a word
            raise SystemExit(f"error: --grid {name.strip()} is given twice; give one, its parts joined by ';'")
        given[name.strip()] = grid
    args.grids = {name: given.get(name, grids[name]) for name in args.names}
    for name, grid in args.grids.items():
        parse_grid(grid)
        for axis, _ in _axes(grid):
            for fixed, why in CONTROLLED.items():
                if fixed != "train.steps" and _overlap(axis, fixed):
                    raise SystemExit(f"error: --grid {name}={grid}: tools/tta.py sets {fixed} itself: {why}")
    args.targets = sorted(args.targets if args.targets is not None else [] if args.loss_targets else [0.9])
    args.loss_targets = sorted(args.loss_targets, reverse=True)  # the easiest first, as accuracies go
    stop = args.stop_at
    args.stop_at = args.targets[-1] if stop and args.targets else 0.0
    args.stop_at_loss = args.loss_targets[-1] if stop and args.loss_targets else 0.0
    refuse(args.overrides, args.names, optimizers, args.grids)
    out_folder(args.out, "--out")
    return args


def refuse(overrides: list[str], names: list[str], optimizers: dict[str, list[str]], grids: dict[str, str]) -> None:
    """Refuse a user's override of a key tools/tta.py sets itself (see the module's docstring).

    Raises:
        SystemExit: One ``error:`` line naming the override, why it cannot be given and what to use instead.
    """
    for item in overrides:
        if "=" not in item:
            continue  # another recipe, merged as run.py merges it
        key, value = item.partition("=")[0].strip(), item.partition("=")[2].strip()
        for fixed, why in CONTROLLED.items():
            if _overlap(key, fixed):
                raise SystemExit(f"error: {item}: tools/tta.py sets {fixed} itself: {why}")
        for name in names:
            axes = _axes(grids[name])
            for axis, values in axes:
                if _overlap(key, axis):
                    mine = ";".join(f"{k}:{value if k == axis else v}" for k, v in axes)
                    raise SystemExit(
                        f"error: {item}: the grid of {name} sweeps {axis} ({axis}:{values}); "
                        f'give the values there: --grid "{name}={mine}"'
                    )
            for setting in optimizers[name]:
                setting_key = setting.partition("=")[0]
                if not _overlap(key, setting_key):
                    continue
                if setting_key in CHOOSES:
                    raise SystemExit(
                        f"error: {item}: each optimizer of --optimizers sets {setting_key} ({name}: {setting}); "
                        f"choose them there, from {', '.join(optimizers)}"
                    )
                raise SystemExit(
                    f"error: {item}: optimizer {name} is made with {setting}; to try another value, sweep it: "
                    f'--grid "{name}={grids[name]};{setting_key}:{value}" (or choose another optimizer)'
                )


def run_overrides(args: argparse.Namespace, preset: list[str], point: list[str], seed: int) -> list[str]:
    """One run's overrides: the optimizer's, the defaults, the user's (winning over both), the keys tta controls,
    the point's (its ``train.steps`` wins over ``--epochs``), the seed."""
    fixed = [f"train.epochs={args.epochs}", "train.steps=0", f"train.eval_every_steps={args.eval_every}"]
    if args.stop_at:
        fixed.append(f"train.stop_at_accuracy={args.stop_at}")
    if args.stop_at_loss:
        fixed.append(f"train.stop_at_loss={args.stop_at_loss}")
    return [*preset, *DEFAULTS, *args.overrides, *fixed, *point, f"train.seed={seed}"]


def check_runs(args: argparse.Namespace, optimizers: dict[str, list[str]]) -> None:
    """Check every run of the sweeps as run.py checks a recipe before training, so that none fails hours in.

    Raises:
        SystemExit: One ``error:`` line: the recipe's or the user's mistake as run.py says it, or naming the
            optimizer or grid whose setting it is.
    """
    from kfacflow import UserError
    from kfacflow.cli import parse as split
    from kfacflow.configuration.recipe import load
    from kfacflow.data.sets import check_data
    from kfacflow.running import build

    def problem(overrides: list[str]) -> str | None:
        items = split([args.recipe, *overrides, f"out_dir={args.out}"])
        try:
            cfg = load(items.recipes, items.overrides)
            build.check(cfg)
            check_data(cfg.data)
        except UserError as err:
            return str(err)
        return None

    seed = args.seeds[0]  # the others differ in train.seed alone, checked by --seeds
    for name in args.names:
        for point in parse_grid(args.grids[name]):
            err = problem(run_overrides(args, optimizers[name], point, seed))
            if err is None:
                continue
            if problem(run_overrides(args, [], [], seed)) is not None:
                raise SystemExit(f"error: {err}")
            if problem(run_overrides(args, optimizers[name], [], seed)) is not None:
                raise SystemExit(f"error: --optimizers {name} ({' '.join(optimizers[name])}): {err}")
            raise SystemExit(f"error: --grid {name}={args.grids[name]} at {' '.join(point)}: {err}")


def _axes(grid: str) -> list[tuple[str, str]]:
    """A grid's keys and the values each takes, as given (``KEY:V1,V2;...`` -> ``[("KEY", "V1,V2"), ...]``)."""
    return [(k.strip(), v.strip()) for k, _, v in (part.partition(":") for part in filter(None, grid.split(";")))]


def _overlap(a: str, b: str) -> bool:
    """Whether keys ``a`` and ``b`` set the same value (a section sets every key in it)."""
    return a == b or a.startswith(f"{b}.") or b.startswith(f"{a}.")
