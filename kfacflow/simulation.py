"""One K-FAC step as events, from a traced step's layer times and a performance profile: D, MPD, SPD, flow, any mix.

The replay follows the trainer and runs the same planning code it does: the registered fusion
policy (:func:`kfacflow.kfac.fusion.plan_launches`), placement and inversion order
(:func:`kfacflow.kfac.placement.schedule`). Forward and backward produce the A and G factors
(and, with DDP, gradient buckets); every collective crosses one link, one at a time in the
order they are posted; then each rank updates its factors, inverts what it owns in the order
the pipeline gives (after the last factor, or as each arrives), posts and receives broadcasts,
unpacks them, and preconditions (after the last inverse, or layer by layer as they arrive).
With ``kfac.broadcast=update`` no inverse travels: each rank inverts and preconditions the
layers it owns, and their updates are broadcast in the shared layer order (``fused_update``:
small ones summed in buckets, one all-reduce each); with ``kfac.factor_sync=owner`` the factors
are reduced to their owners (:class:`~kfacflow.kfac.fusion.Routing`), and between two ranks a
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

from dataclasses import dataclass, field, replace
from typing import Any

from kfacflow import registry
from kfacflow.comm import scatter
from kfacflow.kfac import inverse, overlap  # noqa: F401  (they register the entries looked up below)
from kfacflow.kfac.fusion import SCATTER, Ready, Routing, estimated_arrivals, plan_launches
from kfacflow.kfac.packing import packed_size
from kfacflow.kfac.placement import EVERY_RANK
from kfacflow.kfac.plan import Choice, EngineCaps, StepPlan, make_plan
from kfacflow.kfac.stages import FusionOptions
from kfacflow.kfac.variants import Stages
from kfacflow.perf import LinearModel, Profile

BUCKET_ELEMENTS = 25 * 2**20 // 4
"""DDP's default gradient bucket (25 MiB of float32)."""
PARTS = ("FF&BP", "GradComm", "FactorComp", "FactorComm", "InverseComp", "InverseComm", "Other")


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


@dataclass
class Link:
    """One shared network link: operations run one at a time in the order they are posted.

    A reduction to one rank between two (``into``) uses one direction only: reductions to
    different ranks run at once, each after everything posted before it that uses its direction.
    """

    free: float = 0.0
    into: dict[int, float] = field(default_factory=dict)
    """When each direction (by receiving rank) is free of reductions."""

    def send(self, launch: float, seconds: float, into: int | None = None) -> float:
        """Run an operation posted at ``launch`` taking ``seconds``; return when it ends."""
        if into is None:
            self.free = max(self.free, launch, *self.into.values()) + seconds
            self.into = dict.fromkeys(self.into, self.free)
            return self.free
        self.into[into] = max(self.free, launch, self.into.get(into, 0.0)) + seconds
        return self.into[into]


@dataclass
class _Rank:
    """One rank's clock during the inverse and precondition phases, and what it waited for."""

    t: float
    inverse: float = 0.0
    waits: dict[str, float] | None = None

    def wait(self, until: float, part: str) -> None:
        if until > self.t:
            self.waits = self.waits or {}
            self.waits[part] = self.waits.get(part, 0.0) + until - self.t
            self.t = until


def simulate(
    layers: dict[str, Any],
    profile: Profile,
    workers: int,
    stages: Stages,
    use_measured: bool = True,
    threshold_mb: float = 64.0,
    scatters: bool = True,
    gathers: bool = True,
    reduces: bool = True,
) -> dict[str, float]:
    """Return the breakdown and total of one step (seconds) of ``stages`` on ``workers`` ranks.

    Args:
        layers: A traced step's layer profile (``layers.json``; :func:`average` of several).
        profile: The performance profile (measured, or written for a cluster one does not have).
        workers: P.
        stages: The stage choices (a variant's, :func:`kfacflow.kfac.variants.resolve`).
        use_measured: Inverse times as traced, where the trace has them; else the profile's model.
        threshold_mb: The ``threshold`` fusion's buffer.
        scatters: Whether the engine reduces to several owners at once (NCCL; gloo's is no faster than
            its all-reduce): :attr:`~kfacflow.comm.base.Backend.scatters`.
        gathers: Whether it gathers from several owners at once: :attr:`~kfacflow.comm.base.Backend.gathers`.
        reduces: Whether it reduces to one rank (Horovod does not, nor gloo with CUDA tensors):
            :attr:`~kfacflow.comm.base.Backend.reduces`.
    """
    prof = scaled(profile.for_method(stages.inverse), workers)
    if use_measured:
        layers = with_method(layers, profile, stages.inverse)
    rows = layers["layers"]
    measured = layers["breakdown"]
    hooks, ffbp = measured_compute(layers)
    # Layer times come from hooks; scale them so forward + backward add up to the measured FF&BP,
    # which excludes the factor work and the communication launched inside the hooks.
    share = layers["t_forward_total"] / max(layers["t_forward_total"] + layers["t_backward_total"], 1e-12)
    f_scale = ffbp * share / (sum(r["t_forward"] for r in rows) or 1.0)
    b_scale = ffbp * (1 - share) / (sum(r["t_backward"] for r in rows) or 1.0)
    deferred = workers > 1 and registry.GRAD_SYNCS.get(stages.grad_sync).deferred
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
    # One link for every collective, in the order they are posted.
    options = FusionOptions(threshold_bytes=int(threshold_mb * 2**20), allreduce=prof.allreduce)
    launches = plan_launches(registry.COMMUNICATORS.get(stages.fusion)(options), forward, t_fwd, backward, t_bwd)
    elements = {r.key: r.elements for r in (*forward, *backward)}
    groups = [[(k, elements[k]) for k in keys] for _, keys in launches]
    expected = estimated_arrivals(groups, prof.allreduce)
    plan = step_plan(rows, prof, workers, stages, EngineCaps(reduces, scatters, gathers), expected)
    # kfac.factor_sync=owner: one reduction per owner of a group (a broadcast reversed: its cost),
    # in one direction of the link between two ranks; the NCTs all-reduced.
    to_owner = plan.factor_owners is not None
    owner = dict(zip(_keys(rows), plan.factor_owners, strict=True)) if plan.factor_owners is not None else {}
    routing = Routing(owner, workers, prof.allreduce, prof.broadcast, scatters)
    ops: list[tuple[float, int, int, list[str], int | None]] = [
        (at, 0, sum(elements[k] for k in part), part, dst)
        for at, keys in launches
        for dst, part in (routing.parts(keys, elements) if to_owner else [(None, keys)])
    ]
    if workers > 1 and not deferred:
        ops += [(at, -1, m, [], None) for at, m in grads]  # DDP launches its buckets before K-FAC's hooks run
    link, arrival, grads_done = Link(), {}, t_bwd
    for at, kind, m, keys, dst in sorted(ops, key=lambda op: (op[0], op[1])):
        if workers == 1:
            end = at
        elif dst is None:
            end = link.send(at, prof.allreduce(m))
        elif dst == SCATTER:
            end = link.send(at, scatter.cost(prof.broadcast, _per_rank(keys, owner, elements, workers)))
        else:
            end = link.send(at, prof.broadcast(m), dst if workers == 2 else None)
        if kind < 0:
            grads_done = max(grads_done, end)
        for k in keys:
            arrival[k] = end
    grad_comm = 0.0 if deferred else max(0.0, grads_done - t_bwd)
    start = t_bwd + grad_comm  # DDP's backward returns when its buckets are averaged
    routed = _routed(rows, plan) if deferred else None
    if deferred:  # posted after the last factor, so they queue behind every one of them
        grads_done = start
        if routed is not None:  # one reduction to the owners; the rest all-reduced in buckets
            grads_done = link.send(max(start, link.free), scatter.cost(prof.broadcast, routed))
            grads = _buckets(sum(r["params"] for j, r in enumerate(rows) if plan.owners[2 * j] == EVERY_RANK))
        for _, m in grads:
            grads_done = link.send(max(start, link.free), prof.allreduce(m))
    backward_pass = _Backward(arrival, start, grads_done, grad_comm, link, plan, routed is not None)
    return _inverse_phase(rows, measured, prof, workers, stages, use_measured, backward_pass, hooks, ffbp)


def step_plan(
    rows: list[dict[str, Any]],
    profile: Profile,
    workers: int,
    stages: Stages,
    caps: EngineCaps,
    expected: dict[str, float] | None = None,
) -> StepPlan:
    """The plan the running preconditioner makes for these layers (:func:`~kfacflow.kfac.plan.make_plan`).

    ``expected``: when each factor is expected to arrive (the trainer's estimate from the fusion's groups).
    """
    layout = [(r["a_dim"], r["g_dim"], r["params"]) for r in rows]
    ready = [expected.get(k, 0.0) for k in _keys(rows)] if expected is not None else None
    return make_plan(layout, Choice.named(stages), workers, profile, caps, True, ready)


@dataclass
class _Backward:
    """What the forward and backward passes leave for the rest of the step."""

    arrival: dict[str, float]
    """When each factor's all-reduce ends."""
    start: float
    """When the K-FAC step starts (backward over, DDP's gradients averaged)."""
    grads_done: float
    """When the gradients are averaged."""
    grad_comm: float
    """The part of that the backward pass waited for."""
    link: Link
    plan: StepPlan
    """The trainer's plan of the step: owners, inversion and layer orders, buckets."""
    routed: bool = False
    """Whether the gradients went to their owners alone (who then send the KL clipping's ``v.g``)."""


def _inverse_phase(
    rows: list[dict[str, Any]],
    measured: dict[str, float],
    prof: Profile,
    workers: int,
    stages: Stages,
    use_measured: bool,
    bwd: _Backward,
    hooks: float,
    ffbp: float,
) -> dict[str, float]:
    """Replay updates, inversions, broadcasts and preconditioning on every rank; return the breakdown."""
    arrival, start, grads_done, grad_comm, link = bwd.arrival, bwd.start, bwd.grads_done, bwd.grad_comm, bwd.link
    keys = _keys(rows)
    dims = [d for r in rows for d in (r["a_dim"], r["g_dim"])]
    costs = inverse_costs(rows, prof, use_measured)
    # Averaging a factor into its running average: the traced FactorComp beyond the hooks, by size.
    update_total = max(0.0, measured.get("FactorComp", hooks) - hooks)
    packed = [packed_size(d) for d in dims]
    update = [update_total * m / (sum(packed) or 1) for m in packed]
    broadcast = registry.BROADCASTS.get(stages.broadcast)
    if broadcast.update:
        return _update_phase(rows, measured, prof, workers, stages, costs, update, bwd, hooks + update_total, ffbp)
    sizes = list(bwd.plan.sizes)
    # Whole matrices travel from the owner's memory and are used where they land: no (un)packing.
    pack = [0.0] * len(dims) if broadcast.full else per_element(rows, sizes, "t_pack")
    unpack = [0.0] * len(dims) if broadcast.full else per_element(rows, sizes, "t_unpack")
    owners, order = bwd.plan.owners, bwd.plan.order
    pipeline = registry.PIPELINES.get(stages.pipeline)
    owner_keeps = broadcast.owner_keeps
    ranks = [_Rank(start) for _ in range(workers)]
    # Factors in the order their all-reduces end; a rank updates every factor that has arrived.
    by_arrival = sorted(range(len(keys)), key=lambda i: (arrival.get(keys[i], start), i))
    updated = 0  # how many of by_arrival every rank has averaged in (the same on every rank)
    if not pipeline.invert_on_arrival:
        all_here = max([start, *arrival.values()])
        for rank in ranks:
            rank.wait(all_here, "FactorComm")
            rank.t += update_total
        updated = len(keys)
    sends: list[tuple[int, float]] = []  # (factor, broadcast end), in the order they are posted
    for i in order:  # the placement's order, each factor once it is here (the trainer's loop)
        here = arrival.get(keys[i], start)
        while updated < len(keys) and arrival.get(keys[by_arrival[updated]], start) <= here:
            j = by_arrival[updated]
            for rank in ranks:
                rank.wait(arrival.get(keys[j], start), "FactorComm")
                rank.t += update[j]
            updated += 1
        for r, rank in enumerate(ranks):
            if owners[i] in (EVERY_RANK, r):
                rank.t += costs[i]
                rank.inverse += costs[i]
        if owners[i] != EVERY_RANK:
            owner = ranks[owners[i]]
            owner.t += pack[i]
            sends.append((i, link.send(owner.t, prof.broadcast(sizes[i])) if workers > 1 else owner.t))
    # Preconditioning: every layer once both of its inverses are here (and the gradients).
    cost, rest = precondition_costs(rows, measured)
    for r, rank in enumerate(ranks):
        rank.wait(grads_done, "GradComm")
        waiting = {keys[i] for i, _ in sends}
        done: set[str] = set()

        def ready(rank: _Rank = rank, waiting: set[str] = waiting, done: set[str] = done) -> None:
            for row in rows:
                name = row["name"]
                if name not in done and f"{name}/A" not in waiting and f"{name}/G" not in waiting:
                    done.add(name)
                    rank.t += cost[name]

        if pipeline.precondition_on_arrival:
            ready()
        for i, end in sends:
            rank.wait(end, "InverseComm")
            if not (owner_keeps and owners[i] == r):
                rank.t += unpack[i]
                rank.waits = rank.waits or {}
                rank.waits["InverseComm"] = rank.waits.get("InverseComm", 0.0) + unpack[i]
            waiting.discard(keys[i])
            if pipeline.precondition_on_arrival:
                ready()
        ready()
    last = max(ranks, key=lambda rank: rank.t)
    packing = sum(pack[i] for i, _ in sends if owners[i] == ranks.index(last))
    return _breakdown(last, rest, ffbp, grad_comm, hooks + update_total, packing)


def _breakdown(
    last: _Rank, rest: float, ffbp: float, grad_comm: float, factor_comp: float, packing: float = 0.0
) -> dict[str, float]:
    """The step's parts as the last rank to finish saw them; ``Other`` is what no part names."""
    waits = last.waits or {}
    parts = {
        "FF&BP": ffbp,
        "GradComm": grad_comm + waits.get("GradComm", 0.0),
        "FactorComp": factor_comp,
        "FactorComm": waits.get("FactorComm", 0.0),
        "InverseComp": last.inverse,
        "InverseComm": waits.get("InverseComm", 0.0) + packing,
    }
    parts["Other"] = last.t + rest - sum(parts.values())
    parts["total"] = last.t + rest
    return parts


def _update_phase(
    rows: list[dict[str, Any]],
    measured: dict[str, float],
    prof: Profile,
    workers: int,
    stages: Stages,
    costs: list[float],
    update: list[float],
    bwd: _Backward,
    factor_comp: float,
    ffbp: float,
) -> dict[str, float]:
    """``kfac.broadcast=update``: each rank inverts and preconditions its own layers; the updates travel.

    Every rank averages each factor as it arrives and inverts the ones it holds (its layers' and
    the NCTs') in arrival order (after the last factor with the barrier pipeline). Then, after
    the gradients, it walks the shared layer order: it preconditions its own and the NCT layers,
    posting each own update's broadcast, and the link carries them in that order.
    """
    keys = _keys(rows)
    plan = bwd.plan
    sizes, owners = plan.sizes, plan.owners
    to_owner = plan.factor_owners is not None
    on_arrival = registry.PIPELINES.get(stages.pipeline).invert_on_arrival
    start = bwd.start
    here = [bwd.arrival.get(k, start) for k in keys]
    if not on_arrival:
        here = [max([start, *here])] * len(keys)
    ranks = [_Rank(start) for _ in range(workers)]
    for i in sorted(range(len(keys)), key=lambda i: (here[i], i)):
        for r, rank in enumerate(ranks):
            if to_owner and owners[i] not in (EVERY_RANK, r):
                continue  # another rank's factor: it never comes here
            rank.wait(here[i], "FactorComm")
            rank.t += update[i]
            if owners[i] in (EVERY_RANK, r):
                rank.t += costs[i]
                rank.inverse += costs[i]
    cost, rest = precondition_costs(rows, measured)
    done: dict[int, float] = {}  # communicated layers and when their owner has the update
    for rank in ranks:
        rank.wait(bwd.grads_done, "GradComm")
    for j in plan.layer_order:
        owner = owners[2 * j]
        for r, rank in enumerate(ranks):
            if owner in (EVERY_RANK, r):
                rank.t += cost[rows[j]["name"]]
        if owner != EVERY_RANK:
            done[j] = ranks[owner].t
    sends: list[tuple[float, float]] = []  # each bucket at its last layer, others alone: the trainer's order
    bucket_of = {b[-1]: k for k, b in enumerate(plan.buckets)}
    bucketed = {j for b in plan.buckets for j in b}
    for j in done:
        if j in bucket_of:  # a gather from the owners or a zero-filled all-reduce, as planned
            b = plan.buckets[bucket_of[j]]
            if bucket_of[j] in plan.gathered:
                seconds = scatter.cost(prof.broadcast, _counts(b, sizes[::2], owners[::2], workers))
            else:
                seconds = prof.allreduce(sum(sizes[2 * i] for i in b))
            sends.append((max(done[i] for i in b), seconds))
        elif j not in bucketed:
            sends.append((done[j], prof.broadcast(sizes[2 * j])))
    if bwd.routed and sends:  # each owned layer's v.g (float64: two elements), after the updates
        sends.append((max(t for t, _ in sends), prof.allreduce(2 * len(done))))
    ends = [bwd.link.send(t, seconds) if workers > 1 else t for t, seconds in sends]
    for rank in ranks:
        rank.wait(max(ends, default=0.0), "InverseComm")
    return _breakdown(max(ranks, key=lambda rank: rank.t), rest, ffbp, bwd.grad_comm, factor_comp)


def _keys(rows: list[dict[str, Any]]) -> list[str]:
    """The factors' keys, A1, G1, A2, G2, ..."""
    return [f"{r['name']}/{side}" for r in rows for side in ("A", "G")]


def _routed(rows: list[dict[str, Any]], plan: StepPlan) -> list[int] | None:
    """The gradient elements each rank receives alone (``kfac.grad_sync=owner``; ``None``: all all-reduced)."""
    if plan.grad_owners is None:
        return None
    counts = [0] * plan.world
    for r, owner in zip(rows, plan.grad_owners, strict=True):
        if owner != EVERY_RANK:
            counts[owner] += r["params"]
    return counts


def _counts(bucket: tuple[int, ...], elements: tuple[int, ...], owners: tuple[int, ...], workers: int) -> list[int]:
    """Elements of a bucket each rank owns."""
    counts = [0] * workers
    for j in bucket:
        counts[owners[j]] += elements[j]
    return counts


def _buckets(elements: int) -> list[tuple[float, int]]:
    """``elements`` of gradients in DDP-sized buckets (their times unused)."""
    return [(0.0, min(BUCKET_ELEMENTS, elements - i)) for i in range(0, elements, BUCKET_ELEMENTS)]


def _per_rank(keys: list[str], owner: dict[str, int], elements: dict[str, int], workers: int) -> list[int]:
    """Elements of ``keys`` each rank owns."""
    counts = [0] * workers
    for k in keys:
        counts[owner[k]] += elements[k]
    return counts


def precondition_costs(rows: list[dict[str, Any]], measured: dict[str, float]) -> tuple[dict[str, float], float]:
    """Seconds to precondition each layer, and the rest of the traced step's ``Other``.

    A layer the traced rank did not precondition (another rank owned it) gets the traced seconds
    per multiply-add, ``a g (a + g)``, of those it did; what the traced rank did precondition is
    taken out of ``Other``, and the remainder is the step's other work.
    """
    flops = {r["name"]: r["a_dim"] * r["g_dim"] * (r["a_dim"] + r["g_dim"]) for r in rows}
    traced = {r["name"]: r["t_precondition"] for r in rows if r.get("t_precondition") is not None}
    rate = sum(traced.values()) / (sum(flops[n] for n in traced) or 1)
    rest = max(0.0, measured.get("Other", 0.0) - sum(traced.values()))
    return {n: traced.get(n, rate * f) for n, f in flops.items()}, rest


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
    """Return the mean of several layer profiles of one model (traced steps vary by some per cent).

    Raises:
        ValueError: If they are not of the same model.
    """

    def mean(values: list[Any]) -> Any:
        known = [v for v in values if v is not None]
        return sum(known) / len(known) if known else None

    first = profiles[0]
    if any([r["name"] for r in p["layers"]] != [r["name"] for r in first["layers"]] for p in profiles):
        raise ValueError("the layer profiles to average are not of the same model")
    if len({p.get("inverse") for p in profiles}) > 1:
        raise ValueError("the layer profiles to average timed different inverse methods: simulate them apart")
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


def lower_bound(
    layers: dict[str, Any],
    profile: Profile,
    workers: int,
    use_measured: bool = True,
    method: str | None = None,
    shared_precondition: bool = False,
) -> float:
    """All communication hidden; inverses perfectly balanced over the workers and free to share.

    ``method``: the inverse method whose work is bounded (default: the traced one).
    ``shared_precondition``: the preconditioning is shared out too (``kfac.broadcast=update``),
    perfectly balanced; otherwise every rank preconditions every layer.
    """
    if method is not None:
        if use_measured:
            layers = with_method(layers, profile, method)
        profile = profile.for_method(method)
    measured = layers["breakdown"]
    hooks, ffbp = measured_compute(layers)
    factor_comp = max(measured.get("FactorComp", hooks), hooks)
    inverses = sum(inverse_costs(layers["layers"], profile, use_measured))
    cost, rest = precondition_costs(layers["layers"], measured)
    precondition = sum(cost.values()) / (workers if shared_precondition else 1)
    return ffbp + factor_comp + inverses / workers + precondition + rest


def with_method(layers: dict[str, Any], profile: Profile, method: str) -> dict[str, Any]:
    """Return ``layers`` as if its inversions had been timed with ``method``.

    A traced step times only its own method (``layers["inverse"]``): each inversion is scaled by
    the ratio of the two methods' models in ``profile`` at that factor's size (calibration measures
    every method a run may use). Unchanged where the methods agree or the trace does not say.
    """
    traced = layers.get("inverse")
    if traced is None or traced == method:
        return layers
    mine, theirs = profile.for_method(traced).inverse, profile.for_method(method).inverse
    rows = []
    for row in layers["layers"]:
        row = dict(row)
        for key, dim in (("t_inverse_a", row["a_dim"]), ("t_inverse_g", row["g_dim"])):
            if row.get(key) is not None:
                row[key] *= theirs(dim) / mine(dim)
        rows.append(row)
    return {**layers, "layers": rows, "inverse": method}


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
