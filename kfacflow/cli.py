"""Command line: ``kfacflow`` or ``python run.py``, then ``RECIPE [MORE.yaml] key.sub=value ... [--list [KIND]]``."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from kfacflow import UserError, __version__, did_you_mean, registry
from kfacflow.configuration.recipe import load, shipped_recipes, to_yaml
from kfacflow.running import build
from kfacflow.running.launch import PROGRAM_VAR
from kfacflow.usercode import UserCodeError

USAGE = """Train a recipe. Recipes merge left to right, then key.sub=value overrides apply. A recipe is
a YAML file or the name of one the package ships (see --list recipe).

examples:
  kfacflow quickstart
  python run.py recipes/quickstart.yaml
  python run.py recipes/quickstart.yaml kfac.damping=0.01 launch.nproc=1
  python run.py resume=runs/quickstart/20261129-120000 train.epochs=10
  python run.py export=runs/quickstart/20261129-120000       # weights-only file of the newest checkpoint
  torchrun --nproc_per_node 4 run.py recipes/quickstart.yaml
  python run.py --list fusion
"""


def parse(argv: list[str]) -> argparse.Namespace:
    """Parse the command line (recipes and overrides are told apart by the ``=``)."""
    p = argparse.ArgumentParser(prog=program(), description=USAGE, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"kfacflow {__version__}")
    p.add_argument("items", nargs="*", metavar="RECIPE.yaml | key=value", help="recipes, then overrides")
    p.add_argument(
        "--list",
        nargs="?",
        const="all",
        metavar="KIND",
        help="print registry entries (all kinds, or one: " + ", ".join(registry.ALL) + "), or the shipped recipes",
    )
    p.add_argument("--print-config", action="store_true", help="print the resolved recipe and exit")
    args = p.parse_args(argv)
    args.overrides = [a for a in args.items if "=" in a and _is_key(a.partition("=")[0])]
    args.recipes = [a for a in args.items if a not in args.overrides]
    return args


def _is_key(text: str) -> bool:
    """Whether ``text`` (what stands before an ``=``) is a dotted recipe key rather than a file path."""
    return bool(text) and all(part.isidentifier() for part in text.split("."))


def program() -> str:
    """Return how this command was started: ``kfacflow`` (the installed command) or ``run.py``."""
    return "kfacflow" if Path(sys.argv[0]).name == "kfacflow" else "run.py"


def list_entries(kind: str) -> str:
    """Return the registry listing for ``kind`` (or every kind for ``"all"``; ``recipe``: the shipped recipes)."""
    build.load_plugins()
    kinds = [*registry.ALL, "recipe"]
    if kind not in ("all", *kinds):
        hint = did_you_mean(kind, kinds)
        raise UserError(f"--list: unknown kind {kind!r}.{hint} Kinds: {', '.join(kinds)}.")
    if kind == "recipe":
        return "\n".join(["recipes (give the name or a path):", *(f"  {name}" for name in shipped_recipes())])
    lines = []
    for name, reg in registry.ALL.items():
        if kind not in ("all", name):
            continue
        lines.append(f"{name} ({reg.key}):")
        width = max(len(e.name) for e in reg)
        lines += [f"  {e.name:<{width}}  {e.description}" for e in reg]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the command line; return the exit code (2 for a user's mistake)."""
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    if program() == "kfacflow":  # workers and the resume hint name the command that started them
        os.environ[PROGRAM_VAR] = "kfacflow"
    try:
        args = parse(argv)
        if args.list:
            print(list_entries(args.list))
            return 0
        export = next((o.partition("=")[2] for o in args.overrides if o.startswith("export=")), None)
        if export is not None and not args.recipes and len(args.overrides) == 1:
            from kfacflow.running.rundir import export_weights

            if not export.strip():  # Path("") is the working folder
                raise UserError("export= is empty; give the run folder a run printed on its last line.")
            if not Path(export).is_dir():
                raise UserError(f"export: {export!r} is not a run folder; give the folder a run printed at its end.")
            print(export_weights(Path(export)), flush=True)
            return 0
        if export is not None:
            raise UserError("export=RUN takes nothing else: `python run.py export=runs/NAME/STAMP`.")
        if not args.recipes and not any(o.startswith("resume=") for o in args.overrides):
            example = "kfacflow quickstart" if program() == "kfacflow" else "python run.py recipes/quickstart.yaml"
            raise UserError(f"give a recipe, e.g. `{example}` (or resume=<run dir>).")
        cfg = load(args.recipes, args.overrides)
        build.check(cfg)
        if args.print_config:
            print(to_yaml(cfg), end="")
            return 0
        from kfacflow.comm.launchers import launched_world_size, under_launcher
        from kfacflow.data.sets import build_datasets, check_data, check_shard
        from kfacflow.running.launch import check_environment, self_launch
        from kfacflow.running.resume import check_before_start
        from kfacflow.running.worker import worker

        check_environment()
        if cfg.resume:  # a resumed run writes into its own folder, and must fit its checkpoint
            check_before_start(cfg, launched_world_size() if under_launcher() else cfg.launch.nproc)
        else:
            build.check_out_dir(cfg.out_dir)
        check_data(cfg.data)
        if under_launcher() or cfg.launch.nproc == 1:
            worker(to_yaml(cfg), argv, announce=True)
        else:
            train_set, _, _ = build_datasets(cfg.data)  # before starting workers it could not feed
            shard = (cfg.launch.nproc, cfg.data.batch_size, cfg.train.accumulate)
            check_shard(len(train_set), *shard)  # type: ignore[arg-type]
            results = self_launch(cfg.launch.nproc, worker, (to_yaml(cfg), argv, False))
            print(results[0], flush=True)
        return 0
    except UserError as err:
        if isinstance(err, UserCodeError):
            err.print_cause()
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
