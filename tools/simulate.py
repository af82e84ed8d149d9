"""Project one training step of D-KFAC, MPD-KFAC, SPD-KFAC and flow to P workers: an event simulation.

    python tools/simulate.py RUN/layers.json RUN/profile.yaml --workers 2,4,16,64
    python tools/simulate.py RUN1/layers.json RUN2/layers.json RUN1/profile.yaml --workers 2   # their average
    python tools/simulate.py docs/results/projections/layers_resnet50.json docs/results/projections/ib100_p64.yaml \
        --workers 4,16,64 --compute-scale 0.016 --inverse model --markdown

Inputs: the per-layer profile a real run writes at its traced step (``train.timeline=N`` writes
``layers.json``: forward, backward, factor, inverse and pack times of every layer) and a performance profile
(``kfac.profile`` format: measured by ``tools/fit_perf_models.py`` or written by hand for a
network you do not have). Compute times are per worker and do not change with P (weak scaling,
the paper's setting); communication is re-scaled from the profile's world size to P with the ring
model: an all-reduce of m elements costs 2(P-1) hops of latency and 2(P-1)/P m elements of
traffic, a broadcast (a pipelined chain, as NCCL's ring broadcast) P-1 hops and m elements.

The simulated step follows the trainer: forward with A factors (in forward pre-hooks), backward
with G factors and gradient buckets (DDP, 25 MiB), factor all-reduces grouped by the fusion
policy, all collectives sharing one link in launch order; then waiting for gradients and factors,
the factor update, inverses placed by the placement policy with communicated inverses packed and
broadcast in order as their owners finish them and unpacked by every rank in that order, and the
rest of the step (preconditioning, optimizer) as measured. The overlap keys are replayed as the
trainer runs them: inversions started as factors arrive and layers preconditioned as their
inverses arrive (``kfac.pipeline``), whole or packed inverses or the owners' updates
(``kfac.broadcast``), gradients behind the factors (``kfac.grad_sync=deferred``) or on their
owners alone (``owner``), factors to their owners (``kfac.factor_sync=owner``), several owners at
once from three ranks on where that pays. Each inverse method has its own model where the
profile measured one (``methods``). ``--intervals F/I`` simulates the recipe's update intervals:
the mean step over one inverse period (one inverting step, I/F - 1 steps that only update factors,
the rest neither), what ``kfac.variant=auto`` compares; with ``--inverse-schedule staggered`` each factor update
inverts its own turn's factors. The lower bound hides all communication and shares perfectly
balanced inverses for free; preconditioning, which every rank does for every layer, stays in it
(shared out, where owners precondition). At ``--intervals`` it is the mean over a period, the steps
that do not invert taking the work of ``--between`` traces where given (a step that updates factors
without inverting), else the traced step's own.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import every as read_intervals  # noqa: E402  (--intervals, read as bench reads it)
from tool_args import counts, in_file, number, out_file  # noqa: E402

from kfacflow import UserError, registry  # noqa: E402
from kfacflow.configuration.schema import KFACConfig  # noqa: E402
from kfacflow.kfac.planning.plan import EngineCaps  # noqa: E402
from kfacflow.kfac.stages import options  # noqa: E402
from kfacflow.kfac.strategies.contracts import OWNERS_PRECONDITION  # noqa: E402
from kfacflow.kfac.variants import Stages, resolve  # noqa: E402
from kfacflow.perf import InverseModel, Profile  # noqa: E402
from kfacflow.running import build

ENGINES = {
    "nccl": EngineCaps(reduces=True, scatters=True, gathers=True),
    "gloo": EngineCaps(reduces=True, scatters=False, gathers=True, direct=True),
    "horovod": EngineCaps(reduces=False, scatters=False, gathers=False),
}
"""``--engine``: the capabilities of the engines kfacflow runs on (:attr:`~kfacflow.comm.base.Backend.reduces` ...)."""
from kfacflow.simulation.events import PARTS, average, lower_bound, period, scale_compute  # noqa: E402

THRESHOLD_MB = KFACConfig().fusion_threshold_mb


LAYERS = "the layers.json a run writes with train.timeline=N"
ROW_COUNTS = ("a_dim", "g_dim", "params")
ROW_TIMES = ("t_forward", "t_backward", "t_factor_a", "t_factor_g")


def traced(files: list[str], compute_scale: float, arg: str) -> dict[str, Any]:
    """The average of these layer profiles (``arg``: the argument naming them), their compute times scaled.

    Raises:
        SystemExit: One ``error:`` line naming ``arg`` and the file: missing, unreadable, not JSON, not a layer
            profile, or of another model than the others.
    """
    profiles = []
    for name in files:
        in_file(Path(name), arg, LAYERS)
        try:
            data = json.loads(Path(name).read_text(encoding="utf-8"))
        except (ValueError, OSError) as err:  # not JSON, not UTF-8, or gone since it was checked
            raise SystemExit(f"error: {arg} {name}: cannot be read as JSON ({err}); give {LAYERS}") from None
        problem = layers_problem(data)
        if problem:
            raise SystemExit(f"error: {arg} {name}: {problem}; give {LAYERS}")
        profiles.append(data)
    try:
        return scale_compute(average(profiles), compute_scale)
    except ValueError as err:
        raise SystemExit(f"error: {arg} {' '.join(files)}: {err}") from None


def layers_problem(data: object) -> str | None:
    """What keeps ``data`` from being a layer profile the simulation can read (None: nothing)."""

    def seconds(value: object, optional: bool = False) -> bool:
        if value is None:
            return optional
        return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value >= 0

    if not isinstance(data, dict):
        return f"holds a JSON {type(data).__name__}, not an object with 'layers'"
    missing = [key for key in ("layers", "breakdown", "t_forward_total", "t_backward_total") if key not in data]
    if missing:
        return f"has no {', '.join(repr(key) for key in missing)}"
    if not (seconds(data["t_forward_total"]) and seconds(data["t_backward_total"])):
        return "'t_forward_total' and 't_backward_total' must be seconds (numbers >= 0)"
    if not isinstance(data["breakdown"], dict) or not all(seconds(v, True) for v in data["breakdown"].values()):
        return "'breakdown' must map each part of the step to seconds"
    rows = data["layers"]
    if not isinstance(rows, list) or not rows:
        return "'layers' must be a list of at least one layer"
    for i, row in enumerate(rows):
        if not isinstance(row, dict) or not isinstance(row.get("name"), str):
            return f"layers[{i}] has no 'name'"
        bad = [k for k in ROW_COUNTS if not (isinstance(row.get(k), int) and row[k] >= 0)]
        bad += [k for k in ROW_TIMES if not seconds(row.get(k))]
        bad += [k for k, v in row.items() if k.startswith("t_") and k not in ROW_TIMES and not seconds(v, True)]
        if bad:
            return f"layers[{i}] ({row['name']}) has no valid {', '.join(bad)}"
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "layers", nargs="+", help="layers.json written by a run with train.timeline=N (several: their average)"
    )
    p.add_argument("profile", help="performance profile (kfac.profile format)")
    p.add_argument(
        "--between",
        nargs="+",
        default=None,
        metavar="LAYERS_JSON",
        help="for the lower bound at --intervals: layers.json of a traced step that updates factors but does not "
        "invert (several: their average), whose work the period's other steps take (default: the traced step's own; "
        "trace an inverting step as the positional ones where factors are exchanged only where inverted)",
    )
    p.add_argument("--workers", type=counts(1, "2,4,16,64"), default="2,4,16,64", help="the worker counts to project")
    p.add_argument(
        "--variants",
        default="d,mpd,spd,flow",
        help="presets (d, mpd, spd, flow) or fusion:placement[:pipeline[:broadcast[:grad_sync]]] with the "
        "paper's defaults for what is left out",
    )
    p.add_argument(
        "--compute-scale",
        type=number(0, "0.01"),
        default=1.0,
        help="multiply every time measured by the run (e.g. 0.01 to project CPU-measured layers onto GPUs)",
    )
    p.add_argument(
        "--inverse",
        choices=("measured", "model"),
        default="measured",
        help="inverse times: as the traced step measured them (scaled like the rest, and the profile's inverse "
        "model with them) or from the profile's inverse model as written (a profile of the target devices)",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="MODEL.PARAM=VALUE",
        help="change one parameter of the profile, e.g. broadcast.alpha=2e-4 (repeatable; for sensitivity studies)",
    )
    p.add_argument("--markdown", action="store_true", help="also print one markdown table row per P")
    p.add_argument("--json", default=None, help="write the results to this file")
    p.add_argument(
        "--fusion-threshold-mb", type=number(0, "64"), default=THRESHOLD_MB, help="the threshold fusion's buffer"
    )
    p.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="NAME.SETTING=VALUE",
        help="a stage's own setting, as kfac.options.NAME.SETTING in a recipe (repeatable)",
    )
    p.add_argument(
        "--intervals",
        default="1/1",
        metavar="F/I",
        help="factors every F steps, inverses every I: the mean step over one inverse period (default 1/1: every step)",
    )
    p.add_argument(
        "--inverse-schedule",
        choices=("all", "staggered"),
        default="all",
        help="kfac.inverse_schedule: every factor inverted on one step of the period, or each at a turn of its own",
    )
    p.add_argument(
        "--factor-exchange",
        choices=("update", "inversion"),
        default=None,
        help="kfac.factor_exchange for every variant: factors summed over ranks at every factor update, or only at "
        "the steps that invert (default: each variant's own; flow's is inversion)",
    )
    p.add_argument(
        "--engine",
        choices=sorted(ENGINES),
        default="nccl",
        help="what the engine does besides all-reduces and broadcasts: nccl reduces to owners and gathers; "
        "gloo gathers only (its reductions to several owners are no faster than its all-reduce); horovod neither",
    )
    args = p.parse_args(argv)
    if args.json:
        out_file(Path(args.json), "--json")  # before the simulation, not after it
    build.load_plugins()
    try:
        chosen = {v: stages_of(v) for v in args.variants.split(",")}
    except UserError as e:
        raise SystemExit(f"error: --variants: {e}") from None
    try:
        kfac = KFACConfig(fusion_threshold_mb=args.fusion_threshold_mb, options=stage_options(args.option))
        options.check(kfac)
    except UserError as e:
        raise SystemExit(f"error: --option: {e}") from None
    every = read_intervals(args.intervals)
    kfac.factor_update_freq, kfac.inv_update_freq = every
    kfac.inverse_schedule = args.inverse_schedule
    if args.factor_exchange is not None:
        chosen = {v: replace(stages, factor_exchange=args.factor_exchange) for v, stages in chosen.items()}
    layers = traced(args.layers, args.compute_scale, "layers")
    between = traced(args.between, args.compute_scale, "--between") if args.between else None
    try:
        profile = Profile.load(args.profile)
    except UserError as e:
        raise SystemExit(f"error: {e} The profile is the last argument, after the layer profiles.") from None
    for change in args.set:
        override(profile, change)
    if args.compute_scale != 1.0 and args.inverse == "measured":
        # The placement plans with the profile's inverse model: keep it consistent with the scaled times.
        def scale(inv: InverseModel) -> InverseModel:
            beta = inv.beta * args.compute_scale if inv.kind == "cubic" else inv.beta
            return InverseModel(inv.kind, inv.alpha * args.compute_scale, beta, inv.error)

        profile.inverse = scale(profile.inverse)
        profile.methods = {method: scale(model) for method, model in profile.methods.items()}
    results: list[dict[str, Any]] = []
    rows: list[str] = []
    name = layers.get("model", Path(args.layers[0]).parent.name)
    print(f"{'P':>4} {'variant':<22} {'total':>8} " + " ".join(f"{c:>11}" for c in PARTS))
    for workers in args.workers:
        totals = {}
        for v, stages in chosen.items():
            caps = ENGINES[args.engine]
            measured = args.inverse == "measured"
            parts = period(layers, profile, workers, stages, measured, kfac, caps)
            results.append({"workers": workers, "variant": v, **parts})
            totals[v] = parts["total"]
            cols = " ".join(f"{parts[c]:>11.3f}" for c in PARTS)
            print(f"{workers:>4} {v:<22} {parts['total']:>8.3f} {cols}")
        # The bound of each kind of work: the inverse method (flow's Cholesky factors are cheaper to
        # compute), and whether the preconditioning is shared out (kfac.broadcast=update).
        work = {v: (stages.inverse, _shares(stages)) for v, stages in chosen.items()}
        bounds = {
            kind: lower_bound(
                layers, profile, workers, args.inverse == "measured", kind[0], kind[1], intervals=every, between=between
            )
            for kind in dict.fromkeys(work.values())
        }
        for (method, shared), bound in bounds.items():
            results.append(
                {
                    "workers": workers,
                    "variant": "lower bound",
                    "inverse": method,
                    "shared_precondition": shared,
                    "total": bound,
                }
            )
        # A profile without a model per method gives every method the same bound: show it once.
        labels = {kind: f"{kind[0]}{', shared' if kind[1] else ''}" for kind in bounds}
        shown = {labels[k]: b for k, b in bounds.items()}
        if len(set(bounds.values())) == 1:
            shown = {"": next(iter(bounds.values()))}
        for label, bound in shown.items():
            print(f"{workers:>4} {f'lower bound ({label})' if label else 'lower bound':<22} {bound:>8.3f}")
        pairs = ratio_pairs(totals)
        to_bound = {v: totals[v] / bounds[work[v]] for v in ("spd", "flow") if v in totals}
        if pairs or to_bound:
            ratios = [f"{a}/{b} {totals[a] / totals[b]:.3f}" for a, b in pairs]
            print(f"{'':>4} " + "  ".join(ratios + [f"{v}/bound {r:.3f}" for v, r in to_bound.items()]))
        rows.append(
            f"| {name} | {workers} | "
            + " | ".join(f"{totals[v]:.3f}" for v in totals)
            + " | "
            + " | ".join(f"{b:.3f}" for b in shown.values())
            + " | "
            + " | ".join(f"{totals[a] / totals[b]:.2f}" for a, b in pairs)
            + "".join(f" | {r:.2f}" for r in to_bound.values())
            + " |"
        )
    if args.markdown:
        ratio_names = [f"{a.upper()}/{b.upper()}" for a, b in ratio_pairs(totals)]
        ratio_names += [f"{v.upper()}/bound" for v in to_bound]
        bound_names = [f"bound ({m})" if m else "bound" for m in shown]
        head = [*(v.upper() for v in totals), *bound_names, *ratio_names]
        print(f"\n| model | P | {' | '.join(head)} |")
        print("|" + "---|" * (2 + len(head)))
        print("\n".join(rows))
    if args.json:
        try:
            Path(args.json).absolute().parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(results, indent=2))
        except OSError as err:  # the disk filled up, or the folder changed since it was checked
            raise SystemExit(
                f"error: --json {args.json}: cannot be written ({err}); give a file you can write"
            ) from None
    return 0


def override(profile: Profile, change: str) -> None:
    """Apply one ``--set model.param=value`` to ``profile`` (exits with a message when it is not one)."""
    key, _, value = change.partition("=")
    model_name, _, param = key.partition(".")
    model = getattr(profile, model_name, None) if model_name in ("allreduce", "broadcast", "inverse") else None
    if model is None or param not in ("alpha", "beta") or not value:
        raise SystemExit(f"error: --set {change!r}: expected allreduce|broadcast|inverse.alpha|beta=NUMBER")
    try:
        number(0, "2e-4", above=False)(value)
    except argparse.ArgumentTypeError as err:
        raise SystemExit(f"error: --set {change!r}: {err}") from None
    setattr(model, param, float(value))


def stage_options(given: list[str]) -> dict[str, dict[str, Any]]:
    """``NAME.SETTING=VALUE`` items as ``kfac.options`` (values read as YAML: numbers, booleans, strings).

    Raises:
        UserError: An item not of that form.
    """
    out: dict[str, dict[str, Any]] = {}
    for item in given:
        key, sep, value = item.partition("=")
        name, dot, setting = key.partition(".")
        if not (sep and dot and name and setting):
            raise UserError(f"{item!r} is not NAME.SETTING=VALUE (e.g. threshold.mb=32).")
        out.setdefault(name, {})[setting] = yaml.safe_load(value)
    return out


def _shares(stages: Stages) -> bool:
    """Whether the stages share the preconditioning out (owners precondition their layers alone)."""
    return OWNERS_PRECONDITION in registry.BROADCASTS.get(stages.broadcast).gives


def stages_of(variant: str) -> Stages:
    """Return the stages of a registered variant, or of ``fusion:placement[:pipeline[:broadcast[:grad_sync]]]``.

    Raises:
        UserError: Naming an unknown variant or stage.
    """
    if ":" not in variant:
        return resolve(KFACConfig(variant=variant))
    names = dict(zip(("fusion", "placement", "pipeline", "broadcast", "grad_sync"), variant.split(":"), strict=False))
    for stage, name in names.items():
        registry.ALL[stage].get(name)
    return resolve(KFACConfig(variant="d", **names))  # type: ignore[arg-type]


RATIOS = (("flow", "d"), ("flow", "spd"), ("spd", "d"), ("spd", "mpd"), ("mpd", "d"))


def ratio_pairs(totals: dict[str, float]) -> list[tuple[str, str]]:
    """Return the pairs of :data:`RATIOS` whose both variants were simulated."""
    return [(a, b) for a, b in RATIOS if a in totals and b in totals]


if __name__ == "__main__":
    sys.exit(main())
