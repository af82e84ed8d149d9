"""One K-FAC step as events, from a traced step's layer times and a performance profile: D, MPD, SPD, flow, any mix.

The replay follows the trainer and runs the same planning code it does: the registered fusion
policy (:func:`kfacflow.kfac.stages.fusion.plan_launches`), placement and inversion order
(:func:`kfacflow.kfac.stages.placement.schedule`). Forward and backward produce the A and G factors
(and, with DDP, gradient buckets); every collective crosses one link, one at a time in the
order they are posted; then each rank updates its factors, inverts what it owns in the order
the pipeline gives (after the last factor, or as each arrives), posts and receives broadcasts,
unpacks them, and preconditions (after the last inverse, or layer by layer as they arrive).
With ``kfac.broadcast=update`` no inverse travels: each rank inverts and preconditions the
layers it owns, and their updates are broadcast in the shared layer order (``fused_update``:
small ones summed in buckets, one all-reduce each); with ``kfac.factor_sync=owner`` the factors
are reduced to their owners (:class:`~kfacflow.kfac.stages.fusion.Routing`), and between two ranks a
reduction takes one direction of the link, so reductions into different ranks overlap; from
three ranks on, a group, the gradients (``kfac.grad_sync=owner``) and a bucket of updates may
go to or from several owners at once where the trainer's rule says so (the same functions).
Communication is re-scaled from the profile's world size to P with the ring model: an
all-reduce of m elements costs 2(P-1) start-ups and 2(P-1)/P m elements per worker, a broadcast
(NCCL's pipelined ring) P-1 start-ups and m elements, and so does a reduction (a broadcast
reversed); pieces to or from several owners twice a broadcast's start-ups,
(P-1)/P m elements and the largest piece (:func:`kfacflow.comm.scatter.cost`). Compute per
worker does not change with P.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from kfacflow import registry
from kfacflow.comm import scatter
from kfacflow.configuration.schema import KFACConfig
from kfacflow.kfac.packing import packed_size
from kfacflow.kfac.planning.plan import Choice, EngineCaps, StepPlan, make_plan
from kfacflow.kfac.planning.schedule import Schedule, stagger
from kfacflow.kfac.stages import options
from kfacflow.kfac.stages.contracts import FusionOptions
from kfacflow.kfac.stages.fusion import SCATTER, Ready, Routing, estimated_arrivals, plan_launches
from kfacflow.kfac.strategies.replay import (
    BUCKET_ELEMENTS,
    PARTS,
    Link,
    Replay,
    counts,
    per_element,
    precondition_costs,
)
from kfacflow.kfac.variants import Stages
from kfacflow.perf import LinearModel, Profile
from kfacflow.simulation.traced_steps import average, scale_compute, with_method

__all__ = [
    "PARTS",
    "Link",
    "average",
    "lower_bound",
    "per_element",
    "precondition_costs",
    "scale_compute",
    "scaled",
    "simulate",
    "step_plan",
    "with_method",
]


def scaled(profile: Profile, workers: int) -> Profile:
    """Return ``profile`` with its communication models re-scaled from its world size to ``workers``."""
    p0 = int(profile.meta.get("world_size", 2))
    if p0 < 2:  # one process measured no link: nothing to scale, and nothing is sent at P = 1
        if workers > 1:
            raise ValueError(f"a profile measured on one process cannot be scaled to {workers} workers")
        return replace(profile, meta={**profile.meta, "world_size": workers})
    ar, bc = profile.allreduce, profile.broadcast
    hop_a, hop_b = ar.alpha / (2 * (p0 - 1)), ar.beta / (2 * (p0 - 1) / p0)
    b_hop_a, b_hop_b = bc.alpha / max(1, p0 - 1), bc.beta
    return Profile(
        allreduce=LinearModel(2 * (workers - 1) * hop_a, 2 * (workers - 1) / workers * hop_b),
        broadcast=LinearModel((workers - 1) * b_hop_a, b_hop_b),
        inverse=profile.inverse,
        meta={**profile.meta, "world_size": workers},
        methods=profile.methods,
    )


@dataclass(frozen=True)
class Turn:
    """A factor update of a staggered inverse period: turn ``index`` of ``of`` (:func:`.schedule.stagger`)."""

    index: int
    of: int


EVERY_ROUTE = EngineCaps(reduces=True, scatters=True, gathers=True)
"""An engine that reduces to one rank and to several owners at once, and gathers (NCCL's)."""


def simulate(
    layers: dict[str, Any],
    profile: Profile,
    workers: int,
    stages: Stages,
    use_measured: bool = True,
    kfac: Any = None,
    caps: EngineCaps = EVERY_ROUTE,
    factors: bool = True,
    inverting: bool | Turn = True,
) -> dict[str, float]:
    """Return the breakdown and total of one step (seconds) of ``stages`` on ``workers`` ranks.

    Args:
        layers: A traced step's layer profile (``layers.json``; :func:`average` of several).
        profile: The performance profile (measured, or written for a cluster one does not have).
        workers: P.
        stages: The stage choices (a variant's, :func:`kfacflow.kfac.variants.resolve`).
        use_measured: Inverse times as traced, where the trace has them; else the profile's model.
        kfac: The recipe's ``kfac`` section, where stages with settings of their own take them
            (:mod:`kfacflow.kfac.stages.options`; ``None``: their defaults).
        caps: What the engine can do besides all-reduces and broadcasts (:meth:`EngineCaps.of` a backend;
            by default every route: reductions to one rank and to several owners at once, gathers).
        factors: Whether the step updates factors (``kfac.factor_update_freq``); with
            ``kfac.factor_exchange=inversion`` only a step that inverts sends them.
        inverting: Whether it inverts (``kfac.inv_update_freq``), or which turn of a staggered period it is
            (``kfac.inverse_schedule=staggered``: the factors of that turn); :func:`period` takes the mean.
    """
    prof = scaled(profile.for_method(stages.inverse), workers)
    if use_measured:
        layers = with_method(layers, profile, stages.inverse)
    sync = registry.GRAD_SYNCS.get(stages.grad_sync)
    kfac = kfac or KFACConfig()
    step, launches, elements = _passes(layers, prof, workers, stages, use_measured, kfac, caps, factors)
    if stages.factor_exchange == "inversion" and not inverting:
        launches = []  # the factors stay in each rank's sums until a step that inverts
    sync = sync.for_step(bool(launches), step.plan.grad_owners)
    if isinstance(inverting, Turn):
        turns = stagger(step.plan.dims, step.plan.owners, workers, inverting.of)
        step.inverted = frozenset(k for k, turn in zip(step.keys, turns, strict=True) if turn == inverting.index)
    else:
        step.inverted = frozenset(step.keys if inverting else ())
    step.costs = [cost if key in step.inverted else 0.0 for key, cost in zip(step.keys, step.costs, strict=True)]
    # Factors to owners (as the plan routes them): one reduction per owner of a group (a broadcast
    # reversed: its cost), in one direction of the link between two ranks; the NCTs all-reduced.
    owner = dict(zip(step.keys, step.plan.factor_owners or (), strict=True)) if step.plan.factor_owners else {}
    routing = Routing(owner, workers, prof.allreduce, prof.broadcast, caps.scatters)
    ops: list[tuple[float, int, int, list[str], int | None]] = [
        (at, 0, sum(elements[k] for k in part), part, dst)
        for at, keys in launches
        for dst, part in (routing.parts(keys, elements) if owner else [(None, keys)])
    ]
    if workers > 1:  # gradients the backward pass posts (DDP's buckets, or to owners) go before K-FAC's hooks run
        ops += [(at, -1, m, [], dst) for at, m, dst in sync.in_backward(step)]
    _on_the_link(step, ops, elements, owner)
    sync.replay(step)
    return registry.BROADCASTS.get(stages.broadcast).replay(step, registry.PIPELINES.get(stages.pipeline))


def _on_the_link(
    step: Replay,
    ops: list[tuple[float, int, int, list[str], int | None]],
    elements: dict[str, int],
    owner: dict[str, int],
) -> None:
    """Run the backward pass's collectives on the link in the order posted: when each factor arrives, the gradients."""
    prof, workers = step.prof, step.workers
    step.grads_done = step.t_bwd
    for at, kind, m, keys, dst in sorted(ops, key=lambda op: (op[0], op[1])):
        if workers == 1:
            end = at
        elif dst is None:
            end = step.link.send(at, prof.allreduce(m))
        elif dst == SCATTER:
            end = step.link.send(at, scatter.cost(prof.broadcast, counts(keys, elements, owner, workers)))
        else:
            end = step.link.send(at, prof.broadcast(m), dst if workers == 2 else None)
        if kind < 0:
            step.grads_done = max(step.grads_done, end)
        step.arrival.update(dict.fromkeys(keys, end))


def period(
    layers: dict[str, Any],
    profile: Profile,
    workers: int,
    stages: Stages,
    use_measured: bool = True,
    kfac: Any = None,
    caps: EngineCaps = EVERY_ROUTE,
) -> dict[str, float]:
    """The mean step over one inverse period of ``kfac.factor_update_freq`` F and ``kfac.inv_update_freq`` I.

    Of I steps, one updates factors and inverts, I/F - 1 update factors only, and the rest neither:
    each kind simulated once (:func:`simulate`), weighted by how often it comes. Staggered
    (``kfac.inverse_schedule``), each of the I/F factor updates inverts the factors of its turn.
    At 1/1 it is :func:`simulate`'s step.
    """
    kfac = kfac or KFACConfig()
    f, i = int(kfac.factor_update_freq), int(kfac.inv_update_freq)
    kinds: list[tuple[tuple[bool, bool | Turn], int]]
    if turns := Schedule(kfac).staggered:
        kinds = [((True, Turn(turn, turns)), 1) for turn in range(turns)]
    else:
        kinds = [((True, True), 1), ((True, False), i // f - 1)]
    kinds.append(((False, False), i - i // f))
    total: dict[str, float] = {}
    for (factors, inverting), count in kinds:
        if count:
            step = simulate(layers, profile, workers, stages, use_measured, kfac, caps, factors, inverting)
            for part, seconds in step.items():
                total[part] = total.get(part, 0.0) + seconds * count / i
    return total


def _passes(
    layers: dict[str, Any],
    prof: Profile,
    workers: int,
    stages: Stages,
    use_measured: bool,
    kfac: Any,
    caps: EngineCaps,
    factors: bool = True,
) -> tuple[Replay, list[tuple[float, list[str]]], dict[str, int]]:
    """Replay forward and backward: when each factor is ready, the fusion's launches, DDP's buckets, the plan.

    ``factors=False``: a step that updates no factor (no hooks' work, nothing launched, nothing averaged).
    """
    rows, measured = layers["layers"], layers["breakdown"]
    hooks, ffbp = measured_compute(layers)
    # Layer times come from hooks; scale them so forward + backward add up to the measured FF&BP,
    # which excludes the factor work and the communication launched inside the hooks.
    f_total, b_total = forward_backward(layers)
    f_scale = f_total / (sum(r["t_forward"] for r in rows) or 1.0)
    b_scale = b_total / (sum(r["t_backward"] for r in rows) or 1.0)
    t = 0.0
    forward: list[Ready] = []
    for r in rows:
        t += r["t_factor_a"] if factors else 0.0
        forward.append(Ready(f"{r['name']}/A", t, packed_size(r["a_dim"])))
        t += r["t_forward"] * f_scale
    t_fwd = t
    backward: list[Ready] = []
    grads, bucket, layer_grads = [], 0, []
    for j in reversed(range(len(rows))):
        r = rows[j]
        t += r["t_backward"] * b_scale
        layer_grads.append((t, j))
        bucket += r["params"]
        if bucket >= BUCKET_ELEMENTS:
            grads.append((t, bucket))
            bucket = 0
        t += r["t_factor_g"] if factors else 0.0
        backward.append(Ready(f"{r['name']}/G", t, packed_size(r["g_dim"])))
    if bucket:
        grads.append((t, bucket))
    entry = registry.FUSIONS.entry(stages.fusion)
    fusion = FusionOptions(own=options.of(entry, kfac), allreduce=prof.allreduce)
    launches = plan_launches(entry.obj(fusion), forward, t_fwd, backward, t)  # the plan is the factor steps'
    elements = {r.key: r.elements for r in (*forward, *backward)}
    expected = estimated_arrivals([[(k, elements[k]) for k in keys] for _, keys in launches], prof.allreduce)
    staggered = Schedule(kfac).staggered > 0
    plan = step_plan(rows, prof, workers, stages, caps, expected, int(kfac.inv_update_freq), staggered)
    dims = [d for r in rows for d in (r["a_dim"], r["g_dim"])]
    # Averaging a factor into its running average: the traced FactorComp beyond the hooks, by size.
    update_total = max(0.0, measured.get("FactorComp", hooks) - hooks) if factors else 0.0
    packed = [packed_size(d) for d in dims]
    update = [update_total * m / (sum(packed) or 1) for m in packed]
    costs = inverse_costs(rows, prof, use_measured)
    factor_comp = hooks + update_total if factors else 0.0
    step = Replay(rows, measured, prof, workers, plan, costs, update, factor_comp, ffbp, Link(), {}, t, grads)
    step.layer_grads, step.direct = layer_grads, caps.sends_direct
    step.updates_direct = caps.sends_updates_direct(workers)
    return step, launches if factors else [], elements


def step_plan(
    rows: list[dict[str, Any]],
    profile: Profile,
    workers: int,
    stages: Stages,
    caps: EngineCaps,
    expected: dict[str, float] | None = None,
    inverse_every: int = 1,
    staggered: bool = False,
) -> StepPlan:
    """The plan the running preconditioner makes for these layers (:func:`~kfacflow.kfac.planning.plan.make_plan`).

    ``expected``: when each factor is expected to arrive (the trainer's estimate from the fusion's groups);
    ``inverse_every``: ``kfac.inv_update_freq``; ``staggered``: inversions spread over the period. Layers
    go by their gradients (the simulator has no rows).
    """
    layout = [(r["a_dim"], r["g_dim"], r["params"]) for r in rows]
    keys = [f"{r['name']}/{side}" for r in rows for side in ("A", "G")]
    ready = [expected.get(k, 0.0) for k in keys] if expected is not None else None
    return make_plan(
        layout,
        Choice.named(stages),
        workers,
        profile,
        caps,
        settled=True,
        ready=ready,
        inverse_every=inverse_every,
        staggered=staggered,
    )


def lower_bound(
    layers: dict[str, Any],
    profile: Profile,
    workers: int,
    use_measured: bool = True,
    method: str | None = None,
    shared_precondition: bool = False,
    intervals: tuple[int, int] = (1, 1),
    between: dict[str, Any] | None = None,
) -> float:
    """All communication hidden; inverses perfectly balanced over the workers and free to share.

    ``method``: the inverse method whose work is bounded (default: the traced one).
    ``shared_precondition``: the preconditioning is shared out too (``kfac.broadcast=update``),
    perfectly balanced; otherwise every rank preconditions every layer.
    ``intervals``: factors every F steps and inverses every I, the mean over a period (as :func:`period`).
    ``between``: a traced step that updates factors without inverting, whose work the period's other
    steps take (the steps without factors: its work less its factors'); by default ``layers``' own.
    Where factors are exchanged only where inverted, an inverting step multiplies out the rows held
    since the last one (:mod:`kfacflow.kfac.exchange`): its factor work is not the other steps'.
    """
    if method is not None:
        if use_measured:
            layers = with_method(layers, profile, method)
        profile = profile.for_method(method)

    def work(traced: dict[str, Any]) -> tuple[float, float]:
        """A traced step's work without its factors, and its factors' (seconds)."""
        measured = traced["breakdown"]
        hooks, ffbp = measured_compute(traced)
        cost, rest = precondition_costs(traced["layers"], measured)
        precondition = sum(cost.values()) / (workers if shared_precondition else 1)
        return ffbp + precondition + rest, max(measured.get("FactorComp", hooks), hooks)

    every_f, every_i = intervals
    inverses = sum(inverse_costs(layers["layers"], profile, use_measured)) / workers
    base, factor_comp = work(layers)
    if between is None:
        return base + factor_comp / every_f + inverses / every_i
    other, other_factors = work(between)
    updates = every_i // every_f  # factor updates per period, the first of them inverting
    return (base + factor_comp + inverses + (every_i - 1) * other + (updates - 1) * other_factors) / every_i


def measured_compute(layers: dict[str, Any]) -> tuple[float, float]:
    """Return the traced step's factor work inside the hooks and its FF&BP (seconds)."""
    hooks = sum(r["t_factor_a"] + r["t_factor_g"] for r in layers["layers"])
    ffbp = layers["breakdown"].get("FF&BP", layers["t_forward_total"] + layers["t_backward_total"] - hooks)
    return hooks, ffbp


def forward_backward(layers: dict[str, Any]) -> tuple[float, float]:
    """The traced step's FF&BP (seconds), split as its forward and backward totals split."""
    _, ffbp = measured_compute(layers)
    share = layers["t_forward_total"] / max(layers["t_forward_total"] + layers["t_backward_total"], 1e-12)
    return ffbp * share, ffbp * (1 - share)


def inverse_costs(rows: list[dict[str, Any]], profile: Profile, use_measured: bool) -> list[float]:
    """Seconds to invert every factor, A1, G1, A2, G2, ...: as traced (``use_measured``), else the profile's model."""
    return [
        t if use_measured and t is not None else profile.inverse(d)
        for r in rows
        for d, t in ((r["a_dim"], r.get("t_inverse_a")), (r["g_dim"], r.get("t_inverse_g")))
    ]
