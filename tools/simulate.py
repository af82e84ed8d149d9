"""Project one training step of D-KFAC, MPD-KFAC and SPD-KFAC to P workers: an event simulation.

    python tools/simulate.py RUN/layers.json RUN/profile.yaml --workers 2,4,16,64
    python tools/simulate.py RUN/layers.json profiles/ib100.yaml --workers 4,16,64 --variants d,mpd,spd

Inputs: the per-layer profile a real run writes at its traced step (``train.timeline=N`` writes
``layers.json``: forward, backward and factor times of every layer) and a performance profile
(``kfac.profile`` format: measured by ``tools/fit_perf_models.py`` or written by hand for a
network you do not have). Compute times are per worker and do not change with P (weak scaling,
the paper's setting); communication is re-scaled from the profile's world size to P with the ring
model: an all-reduce of m elements costs 2(P-1) hops of latency and 2(P-1)/P m elements of
traffic, a broadcast ceil(log2 P) hops and m elements.

The simulated step follows the trainer: forward with A factors (in forward pre-hooks), backward
with G factors and gradient buckets (DDP, 25 MiB), factor all-reduces grouped by the fusion
policy, all collectives sharing one link in launch order; then waiting for gradients and factors,
the factor update, inverses placed by the placement policy with communicated inverses broadcast in
order as their owners finish them, and the rest of the step (preconditioning, optimizer) as
measured. The lower bound hides all communication and shares perfectly balanced inverses for free.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kfacflow.kfac.factors import packed_size  # noqa: E402
from kfacflow.kfac.fusion_plan import plan_groups  # noqa: E402
from kfacflow.kfac.placement import EVERY_RANK, lbp, local, round_robin, schedule  # noqa: E402
from kfacflow.perf import InverseModel, LinearModel, Profile  # noqa: E402

VARIANTS = {"d": ("after_backward", "local"), "mpd": ("after_backward", "round_robin"), "spd": ("optimal", "lbp")}
PLACE = {"local": local, "round_robin": round_robin, "lbp": lbp}
BUCKET_ELEMENTS = 25 * 2**20 // 4
PARTS = ("FF&BP", "GradComm", "FactorComp", "FactorComm", "InverseComp", "InverseComm", "Other")


def scaled(profile: Profile, workers: int) -> Profile:
    """Return ``profile`` with its communication models re-scaled from its world size to ``workers``."""
    p0 = int(profile.meta.get("world_size", 2))
    ar, bc = profile.allreduce, profile.broadcast
    hop_a, hop_b = ar.alpha / (2 * (p0 - 1)), ar.beta / (2 * (p0 - 1) / p0)
    b_hop_a, b_hop_b = bc.alpha / max(1, math.ceil(math.log2(p0))), bc.beta
    return Profile(
        allreduce=LinearModel(2 * (workers - 1) * hop_a, 2 * (workers - 1) / workers * hop_b),
        broadcast=LinearModel(math.ceil(math.log2(workers)) * b_hop_a, b_hop_b),
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


def factor_groups(
    policy: str, ready: list[float], sizes: list[int], end: float, prof: Profile
) -> list[tuple[float, int]]:
    """Return (launch time, elements) of the fused all-reduces of one pass (A or G) under ``policy``."""
    if not ready:
        return []
    if policy == "naive":
        return [(end, sum(sizes))]
    if policy == "layerwise":
        return list(zip(ready, sizes, strict=True))
    if policy == "threshold":
        out, acc = [], 0
        for t, m in zip(ready, sizes, strict=True):
            acc += m
            if acc * 4 >= 64 * 2**20:
                out.append((t, acc))
                acc = 0
        return out + ([(end, acc)] if acc else [])
    groups = plan_groups([r - ready[0] for r in ready], sizes, prof.allreduce)
    return [(ready[g[-1]], sum(sizes[i] for i in g)) for g in groups]


def simulate(
    layers: dict[str, Any], profile: Profile, workers: int, fusion: str, placement: str, use_measured: bool = True
) -> dict[str, float]:
    """Return the six-part breakdown and total of one step (seconds).

    Inverse times are the ones the traced step measured where it has them (``use_measured``),
    otherwise the profile's inverse model.
    """
    prof = scaled(profile, workers)
    rows = layers["layers"]
    measured = layers["breakdown"]
    hooks = sum(r["t_factor_a"] + r["t_factor_g"] for r in rows)
    # Layer times come from hooks; scale them so forward + backward add up to the measured FF&BP,
    # which excludes the factor work and the communication launched inside the hooks.
    ffbp = measured.get("FF&BP", layers["t_forward_total"] + layers["t_backward_total"] - hooks)
    share = layers["t_forward_total"] / max(layers["t_forward_total"] + layers["t_backward_total"], 1e-12)
    f_scale = ffbp * share / (sum(r["t_forward"] for r in rows) or 1.0)
    b_scale = ffbp * (1 - share) / (sum(r["t_backward"] for r in rows) or 1.0)
    t = 0.0
    ready_a, size_a = [], []
    for r in rows:
        t += r["t_factor_a"]
        ready_a.append(t)
        size_a.append(packed_size(r["a_dim"]))
        t += r["t_forward"] * f_scale
    t_fwd = t
    ready_g, size_g, grads, bucket = [], [], [], 0
    for r in reversed(rows):
        t += r["t_backward"] * b_scale
        bucket += r["params"]
        if bucket >= BUCKET_ELEMENTS:
            grads.append((t, bucket))
            bucket = 0
        t += r["t_factor_g"]
        ready_g.append(t)
        size_g.append(packed_size(r["g_dim"]))
    t_bwd = t
    if bucket:
        grads.append((t_bwd, bucket))
    if fusion == "after_backward":
        ops = [(t_bwd, sum(size_a) + sum(size_g), "factor")]
    else:
        ops = [(s, m, "factor") for s, m in factor_groups(fusion, ready_a, size_a, t_fwd, prof)]
        ops += [(s, m, "factor") for s, m in factor_groups(fusion, ready_g, size_g, t_bwd, prof)]
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
    measured_inv = [t for r in rows for t in (r.get("t_inverse_a"), r.get("t_inverse_g"))]
    sizes = [packed_size(d) for d in dims]
    owners = PLACE[placement](dims, sizes, workers, prof)
    busy = [0.0] * workers
    inv_link, inv_done = Link(), 0.0
    for i in schedule(dims, owners, workers, prof):
        d, m, owner = dims[i], sizes[i], owners[i]
        cost = measured_inv[i] if use_measured and measured_inv[i] is not None else prof.inverse(d)
        if owner == EVERY_RANK:
            busy = [b + cost for b in busy]
        else:
            busy[owner] += cost
            inv_done = inv_link.send(busy[owner], prof.broadcast(m))
    inverse_comp = max(busy)
    inverse_comm = max(0.0, inv_done - inverse_comp)
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


def scale_compute(layers: dict[str, Any], factor: float) -> dict[str, Any]:
    """Return ``layers`` with every measured compute time multiplied by ``factor``."""
    rows = [{k: v * factor if k.startswith("t_") else v for k, v in r.items()} for r in layers["layers"]]
    breakdown = {k: v * factor for k, v in layers["breakdown"].items()}
    return {
        **layers,
        "layers": rows,
        "breakdown": breakdown,
        "t_forward_total": layers["t_forward_total"] * factor,
        "t_backward_total": layers["t_backward_total"] * factor,
    }


def lower_bound(layers: dict[str, Any], profile: Profile, workers: int) -> float:
    """All communication hidden; inverses perfectly balanced over the workers and free to share."""
    rows, measured = layers["layers"], layers["breakdown"]
    hooks = sum(r["t_factor_a"] + r["t_factor_g"] for r in rows)
    ffbp = measured.get("FF&BP", layers["t_forward_total"] + layers["t_backward_total"] - hooks)
    factor_comp = max(measured.get("FactorComp", hooks), hooks)
    inverses = sum(
        t if t is not None else profile.inverse(d)
        for r in rows
        for d, t in ((r["a_dim"], r.get("t_inverse_a")), (r["g_dim"], r.get("t_inverse_g")))
    )
    return ffbp + factor_comp + inverses / workers + measured.get("Other", 0.0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("layers", help="layers.json written by a run with train.timeline=N")
    p.add_argument("profile", help="performance profile (kfac.profile format)")
    p.add_argument("--workers", default="2,4,16,64")
    p.add_argument("--variants", default="d,mpd,spd", help="d, mpd, spd or fusion:placement pairs")
    p.add_argument(
        "--compute-scale",
        type=float,
        default=1.0,
        help="multiply every compute time (e.g. 0.01 to project CPU-measured layers onto GPUs)",
    )
    p.add_argument("--json", default=None, help="write the results to this file")
    args = p.parse_args(argv)
    layers = scale_compute(json.loads(Path(args.layers).read_text()), args.compute_scale)
    profile = Profile.load(args.profile)
    if args.compute_scale != 1.0:
        inv = profile.inverse
        alpha = inv.alpha * args.compute_scale
        beta = inv.beta * args.compute_scale if inv.kind == "cubic" else inv.beta
        profile.inverse = InverseModel(inv.kind, alpha, beta, inv.error)
    results: list[dict[str, Any]] = []
    print(f"{'P':>4} {'variant':<22} {'total':>8} " + " ".join(f"{c:>11}" for c in PARTS))
    for workers in (int(w) for w in args.workers.split(",")):
        for v in args.variants.split(","):
            fusion, placement = VARIANTS[v] if v in VARIANTS else v.split(":")
            parts = simulate(layers, profile, workers, fusion, placement)
            results.append({"workers": workers, "variant": v, **parts})
            cols = " ".join(f"{parts[c]:>11.3f}" for c in PARTS)
            print(f"{workers:>4} {v:<22} {parts['total']:>8.3f} {cols}")
        bound = lower_bound(layers, profile, workers)
        results.append({"workers": workers, "variant": "lower bound", "total": bound})
        print(f"{workers:>4} {'lower bound':<22} {bound:>8.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
