"""Project one training step of D-KFAC, MPD-KFAC and SPD-KFAC to P workers: an event simulation.

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
rest of the step (preconditioning, optimizer) as measured. The lower bound hides all
communication and shares perfectly balanced inverses for free.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kfacflow import UserError, build, registry  # noqa: E402
from kfacflow.config import KFACConfig  # noqa: E402
from kfacflow.kfac.fusion import Ready, plan_launches  # noqa: E402
from kfacflow.kfac.packing import packed_size  # noqa: E402
from kfacflow.kfac.placement import EVERY_RANK, schedule  # noqa: E402
from kfacflow.kfac.stages import FusionOptions  # noqa: E402
from kfacflow.perf import InverseModel, LinearModel, Profile  # noqa: E402

BUCKET_ELEMENTS = 25 * 2**20 // 4
"""DDP's default gradient bucket (25 MiB of float32)."""
THRESHOLD_MB = KFACConfig().fusion_threshold_mb
PARTS = ("FF&BP", "GradComm", "FactorComp", "FactorComm", "InverseComp", "InverseComm", "Other")


def scaled(profile: Profile, workers: int) -> Profile:
    """Return ``profile`` with its communication models re-scaled from its world size to ``workers``."""
    p0 = int(profile.meta.get("world_size", 2))
    ar, bc = profile.allreduce, profile.broadcast
    hop_a, hop_b = ar.alpha / (2 * (p0 - 1)), ar.beta / (2 * (p0 - 1) / p0)
    b_hop_a, b_hop_b = bc.alpha / max(1, p0 - 1), bc.beta
    return Profile(
        allreduce=LinearModel(2 * (workers - 1) * hop_a, 2 * (workers - 1) / workers * hop_b),
        broadcast=LinearModel((workers - 1) * b_hop_a, b_hop_b),
        inverse=profile.inverse,
        meta={**profile.meta, "world_size": workers},
    )


@dataclass
class Link:
    """One shared network link: operations run one at a time in launch order."""

    free: float = 0.0

    def send(self, launch: float, seconds: float) -> float:
        """Run an operation launched at ``launch`` taking ``seconds``; return when it ends."""
        self.free = max(self.free, launch) + seconds
        return self.free


def simulate(
    layers: dict[str, Any],
    profile: Profile,
    workers: int,
    fusion: str,
    placement: str,
    use_measured: bool = True,
    threshold_mb: float = THRESHOLD_MB,
) -> dict[str, float]:
    """Return the six-part breakdown and total of one step (seconds).

    The fusion policy and the placement are the registered ones the trainer runs. Inverse times
    are the ones the traced step measured where it has them (``use_measured``), otherwise the
    profile's inverse model.
    """
    prof = scaled(profile, workers)
    options = FusionOptions(threshold_bytes=int(threshold_mb * 2**20), allreduce=prof.allreduce)
    policy = registry.COMMUNICATORS.get(fusion)(options)
    place = registry.PLACEMENTS.get(placement)
    rows = layers["layers"]
    measured = layers["breakdown"]
    hooks, ffbp = measured_compute(layers)
    # Layer times come from hooks; scale them so forward + backward add up to the measured FF&BP,
    # which excludes the factor work and the communication launched inside the hooks.
    share = layers["t_forward_total"] / max(layers["t_forward_total"] + layers["t_backward_total"], 1e-12)
    f_scale = ffbp * share / (sum(r["t_forward"] for r in rows) or 1.0)
    b_scale = ffbp * (1 - share) / (sum(r["t_backward"] for r in rows) or 1.0)
    t = 0.0
    forward: list[Ready] = []
    for r in rows:
        t += r["t_factor_a"]
        forward.append(Ready(f"{r['name']}/A", t, packed_size(r["a_dim"])))
        t += r["t_forward"] * f_scale
    t_fwd = t
    backward: list[Ready] = []
    grads, bucket = [], 0
    for r in reversed(rows):
        t += r["t_backward"] * b_scale
        bucket += r["params"]
        if bucket >= BUCKET_ELEMENTS:
            grads.append((t, bucket))
            bucket = 0
        t += r["t_factor_g"]
        backward.append(Ready(f"{r['name']}/G", t, packed_size(r["g_dim"])))
    t_bwd = t
    if bucket:
        grads.append((t_bwd, bucket))
    elements = {r.key: r.elements for r in (*forward, *backward)}
    launches = plan_launches(policy, forward, t_fwd, backward, t_bwd)
    ops = [(launch, sum(elements[k] for k in keys), "factor") for launch, keys in launches]
    ops += [(s, m, "grad") for s, m in grads] if workers > 1 else []
    link, done = Link(), {"factor": 0.0, "grad": 0.0}
    # DDP launches its buckets during backward, before K-FAC's hooks return: at a tie, gradients go first.
    for launch, m, kind in sorted(ops, key=lambda op: (op[0], op[2] != "grad")):
        end = link.send(launch, prof.allreduce(m)) if workers > 1 else launch
        done[kind] = max(done[kind], end)
    grad_comm = max(0.0, done["grad"] - t_bwd)
    t = t_bwd + grad_comm
    factor_comm = max(0.0, done["factor"] - t)
    t += factor_comm
    update = max(0.0, measured.get("FactorComp", hooks) - hooks)
    dims = [d for r in rows for d in (r["a_dim"], r["g_dim"])]
    costs = inverse_costs(rows, prof, use_measured)
    sizes = [packed_size(d) for d in dims]
    pack = per_element(rows, sizes, "t_pack")
    unpack = per_element(rows, sizes, "t_unpack")
    owners = place(dims, sizes, workers, prof)
    comp, busy = [0.0] * workers, [0.0] * workers
    inv_link, sends = Link(), []
    for i in schedule(dims, owners, workers, prof):
        cost, m, owner = costs[i], sizes[i], owners[i]
        if owner == EVERY_RANK:
            comp = [c + cost for c in comp]
            busy = [b + cost for b in busy]
        else:
            comp[owner] += cost
            busy[owner] += cost + pack[i]
            sends.append((i, inv_link.send(busy[owner], prof.broadcast(m))))
    # Every rank then waits for the broadcasts in order and unpacks each (the owner too), as the trainer does.
    finish = []
    for t in busy:
        for i, arrived in sends:
            t = max(t, arrived) + unpack[i]
        finish.append(t)
    inverse_comp = max(comp)
    inverse_comm = max(finish) - inverse_comp
    other = measured.get("Other", 0.0)
    parts = {
        "FF&BP": ffbp,
        "GradComm": grad_comm,
        "FactorComp": hooks + update,
        "FactorComm": factor_comm,
        "InverseComp": inverse_comp,
        "InverseComm": inverse_comm,
        "Other": other,
    }
    parts["total"] = sum(parts[p] for p in PARTS)
    return parts


def per_element(rows: list[dict[str, Any]], sizes: list[int], field: str) -> list[float]:
    """Seconds of ``field`` (``t_pack`` or ``t_unpack``) for every factor, A1, G1, A2, G2, ...

    Factors the traced step did not communicate get the measured seconds per element of those it
    did (none measured: free).
    """
    times = [t for r in rows for t in (r.get(f"{field}_a"), r.get(f"{field}_g"))]
    timed = [(t, m) for t, m in zip(times, sizes, strict=True) if t is not None]
    rate = sum(t for t, _ in timed) / sum(m for _, m in timed) if timed else 0.0
    return [t if t is not None else rate * m for t, m in zip(times, sizes, strict=True)]


def average(profiles: list[dict[str, Any]]) -> dict[str, Any]:
    """Return the mean of several layer profiles of one model (traced steps vary by some per cent)."""

    def mean(values: list[Any]) -> Any:
        known = [v for v in values if v is not None]
        return sum(known) / len(known) if known else None

    first = profiles[0]
    if any([r["name"] for r in p["layers"]] != [r["name"] for r in first["layers"]] for p in profiles):
        raise SystemExit("error: the layer profiles to average are not of the same model")
    rows = [
        {k: mean([p["layers"][i].get(k) for p in profiles]) if k.startswith("t_") else v for k, v in row.items()}
        for i, row in enumerate(first["layers"])
    ]
    breakdown = {k: mean([p["breakdown"].get(k) for p in profiles]) for k in first["breakdown"]}
    totals = {k: mean([p[k] for p in profiles]) for k in ("t_forward_total", "t_backward_total")}
    return {**first, **totals, "breakdown": breakdown, "layers": rows}


def scale_compute(layers: dict[str, Any], factor: float) -> dict[str, Any]:
    """Return ``layers`` with every measured compute time multiplied by ``factor``."""
    rows = [
        {k: v * factor if k.startswith("t_") and v is not None else v for k, v in r.items()} for r in layers["layers"]
    ]
    breakdown = {k: v * factor for k, v in layers["breakdown"].items()}
    return {
        **layers,
        "layers": rows,
        "breakdown": breakdown,
        "t_forward_total": layers["t_forward_total"] * factor,
        "t_backward_total": layers["t_backward_total"] * factor,
    }


def lower_bound(layers: dict[str, Any], profile: Profile, workers: int, use_measured: bool = True) -> float:
    """All communication hidden; inverses perfectly balanced over the workers and free to share."""
    measured = layers["breakdown"]
    hooks, ffbp = measured_compute(layers)
    factor_comp = max(measured.get("FactorComp", hooks), hooks)
    inverses = sum(inverse_costs(layers["layers"], profile, use_measured))
    return ffbp + factor_comp + inverses / workers + measured.get("Other", 0.0)


def measured_compute(layers: dict[str, Any]) -> tuple[float, float]:
    """Return the traced step's factor work inside the hooks and its FF&BP (seconds)."""
    hooks = sum(r["t_factor_a"] + r["t_factor_g"] for r in layers["layers"])
    ffbp = layers["breakdown"].get("FF&BP", layers["t_forward_total"] + layers["t_backward_total"] - hooks)
    return hooks, ffbp


def inverse_costs(rows: list[dict[str, Any]], profile: Profile, use_measured: bool) -> list[float]:
    """Seconds to invert every factor, A1, G1, A2, G2, ...: as traced (``use_measured``), else the profile's model."""
    return [
        t if use_measured and t is not None else profile.inverse(d)
        for r in rows
        for d, t in ((r["a_dim"], r.get("t_inverse_a")), (r["g_dim"], r.get("t_inverse_g")))
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "layers", nargs="+", help="layers.json written by a run with train.timeline=N (several: their average)"
    )
    p.add_argument("profile", help="performance profile (kfac.profile format)")
    p.add_argument("--workers", default="2,4,16,64")
    p.add_argument("--variants", default="d,mpd,spd", help="d, mpd, spd or fusion:placement pairs")
    p.add_argument(
        "--compute-scale",
        type=float,
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
    p.add_argument("--fusion-threshold-mb", type=float, default=THRESHOLD_MB, help="the threshold fusion's buffer")
    args = p.parse_args(argv)
    build.load_plugins()
    try:
        for v in args.variants.split(","):
            stages_of(v)
    except UserError as e:
        raise SystemExit(f"error: --variants: {e}") from None
    layers = scale_compute(average([json.loads(Path(f).read_text()) for f in args.layers]), args.compute_scale)
    try:
        profile = Profile.load(args.profile)
    except UserError as e:
        raise SystemExit(f"error: {e} The profile is the last argument, after the layer profiles.") from None
    for change in args.set:
        override(profile, change)
    if args.compute_scale != 1.0 and args.inverse == "measured":
        # The placement plans with the profile's inverse model: keep it consistent with the scaled times.
        inv = profile.inverse
        alpha = inv.alpha * args.compute_scale
        beta = inv.beta * args.compute_scale if inv.kind == "cubic" else inv.beta
        profile.inverse = InverseModel(inv.kind, alpha, beta, inv.error)
    results: list[dict[str, Any]] = []
    rows: list[str] = []
    name = layers.get("model", Path(args.layers[0]).parent.name)
    print(f"{'P':>4} {'variant':<22} {'total':>8} " + " ".join(f"{c:>11}" for c in PARTS))
    for workers in (int(w) for w in args.workers.split(",")):
        totals = {}
        for v in args.variants.split(","):
            fusion, placement = stages_of(v)
            parts = simulate(
                layers, profile, workers, fusion, placement, args.inverse == "measured", args.fusion_threshold_mb
            )
            results.append({"workers": workers, "variant": v, **parts})
            totals[v] = parts["total"]
            cols = " ".join(f"{parts[c]:>11.3f}" for c in PARTS)
            print(f"{workers:>4} {v:<22} {parts['total']:>8.3f} {cols}")
        bound = lower_bound(layers, profile, workers, use_measured=args.inverse == "measured")
        results.append({"workers": workers, "variant": "lower bound", "total": bound})
        print(f"{workers:>4} {'lower bound':<22} {bound:>8.3f}")
        pairs = ratio_pairs(totals)
        if pairs:
            print(f"{'':>4} " + "  ".join(f"{a}/{b} {totals[a] / totals[b]:.3f}" for a, b in pairs))
        rows.append(
            f"| {name} | {workers} | "
            + " | ".join(f"{totals[v]:.3f}" for v in totals)
            + f" | {bound:.3f} | "
            + " | ".join(f"{totals[a] / totals[b]:.2f}" for a, b in pairs)
            + " |"
        )
    if args.markdown:
        ratio_names = [f"{a.upper()}/{b.upper()}" for a, b in ratio_pairs(totals)]
        print(f"\n| model | P | {' | '.join(v.upper() for v in totals)} | bound | {' | '.join(ratio_names)} |")
        print("|" + "---|" * (3 + len(totals) + len(ratio_names)))
        print("\n".join(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


def override(profile: Profile, change: str) -> None:
    """Apply one ``--set model.param=value`` to ``profile`` (exits with a message when it is not one)."""
    key, _, value = change.partition("=")
    model_name, _, param = key.partition(".")
    model = getattr(profile, model_name, None) if model_name in ("allreduce", "broadcast", "inverse") else None
    if model is None or param not in ("alpha", "beta") or not value:
        raise SystemExit(f"error: --set {change!r}: expected allreduce|broadcast|inverse.alpha|beta=NUMBER")
    try:
        setattr(model, param, float(value))
    except ValueError:
        raise SystemExit(f"error: --set {change!r}: {value!r} is not a number") from None


def stages_of(variant: str) -> tuple[str, str]:
    """Return (fusion, placement) of a registered variant or of a ``fusion:placement`` pair (checked)."""
    if ":" in variant:
        fusion, placement = variant.split(":", 1)
    else:
        preset = registry.VARIANTS.get(variant)
        fusion, placement = preset.fusion, preset.placement
    registry.COMMUNICATORS.get(fusion)
    registry.PLACEMENTS.get(placement)
    return fusion, placement


RATIOS = (("spd", "d"), ("spd", "mpd"), ("mpd", "d"))


def ratio_pairs(totals: dict[str, float]) -> list[tuple[str, str]]:
    """Return the pairs of :data:`RATIOS` whose both variants were simulated."""
    return [(a, b) for a, b in RATIOS if a in totals and b in totals]


if __name__ == "__main__":
    sys.exit(main())
