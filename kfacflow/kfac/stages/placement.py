"""Which rank inverts which factor: every rank (NCT) or one owner whose result is broadcast (CT)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kfacflow import UserError
from kfacflow.kfac.stages.contracts import EVERY_RANK
from kfacflow.kfac.stages.update_plan import (
    LayerWork,
    by_layer,
    gathers,
    layer_order,
    precondition_cost,
    update_buckets,
)
from kfacflow.perf import Profile
from kfacflow.registry import PLACEMENTS

__all__ = [
    "EVERY_RANK",
    "Rule",
    "by_layer",
    "gathers",
    "inverse_phase",
    "layer",
    "layer_order",
    "lbp",
    "link",
    "local",
    "precondition_cost",
    "round_robin",
    "schedule",
    "update_buckets",
]


def local(dims: Sequence[int], sizes: Sequence[int], world_size: int, profile: Profile | None) -> list[int]:
    """Every rank inverts every factor (D-KFAC): no inverse traffic.

    Args:
        dims: Side of each factor, in the preconditioner's order (A1, G1, A2, G2, ...).
        sizes: Elements each inverse sends when broadcast.
        world_size: Number of ranks.
        profile: Fitted performance models (unused here).

    Returns:
        The owner of each factor: :data:`EVERY_RANK` or a rank.
    """
    return [EVERY_RANK] * len(dims)


def round_robin(dims: Sequence[int], sizes: Sequence[int], world_size: int, profile: Profile | None) -> list[int]:
    """Factor ``i`` goes to rank ``i mod P`` and every result is broadcast (MPD-KFAC, refs. [13, 22, 20])."""
    if world_size == 1:
        return local(dims, sizes, world_size, profile)
    return [i % world_size for i in range(len(dims))]


def lbp(dims: Sequence[int], sizes: Sequence[int], world_size: int, profile: Profile | None) -> list[int]:
    """Load-balancing placement (the paper's Algorithm 1).

    Factors are taken largest first. A factor whose estimated inverse time is below its
    estimated broadcast time is an NCT: every rank inverts it (its time is added to every
    rank's load). Otherwise it is a CT, given to the rank with the least estimated load
    (inverse plus broadcast time); ties go to the lowest rank. With more ranks than factors
    some ranks simply get none.

    Raises:
        UserError: Without performance models to estimate the times.
    """
    if profile is None:
        raise UserError("kfac.placement=lbp needs performance models: set kfac.profile or let the run calibrate.")
    if world_size == 1:
        return [EVERY_RANK] * len(dims)
    work = [profile.inverse(d) for d in dims]
    comms = [profile.broadcast(m) for m in sizes]
    return _balance(sorted(range(len(dims)), key=lambda i: (-dims[i], i)), work, comms, world_size)


def _balance(order: Sequence[int], work: Sequence[float], comms: Sequence[float], world_size: int) -> list[int]:
    """Algorithm 1's loop: the owner of each item, taken in ``order``, or :data:`EVERY_RANK`.

    An item whose work costs less than its broadcast is done by every rank (its work added to
    every rank's load); otherwise the least-loaded rank (ties to the lowest) owns it, its load
    growing by the work and the broadcast.
    """
    owners = [EVERY_RANK] * len(work)
    load = [0.0] * world_size
    for i in order:
        if work[i] < comms[i]:
            load = [x + work[i] for x in load]
        else:
            rank = min(range(world_size), key=lambda r: (load[r], r))
            owners[i] = rank
            load[rank] += work[i] + comms[i]
    return owners


def schedule(
    dims: Sequence[int],
    owners: Sequence[int],
    world_size: int,
    profile: Profile | None,
    ready: Sequence[float] | None = None,
) -> list[int]:
    """Return the order in which every rank walks the factors when inverting (the same on all ranks).

    Communicated tensors come first, ordered by their estimated finish time; then the
    non-communicated ones. So broadcasts start as early as possible and overlap the inversions
    that follow, and every rank posts its broadcasts in the same order (collectives on a group
    run in the order they are posted). Each owner takes its own largest first when every factor
    is there from the start; given ``ready`` (when each factor is estimated to arrive, for a
    pipeline that inverts as factors arrive), it takes them as they arrive, largest first among
    those that arrive together, and the estimated finish counts the wait.
    """
    cost = profile.inverse if profile is not None else (lambda d: float(d) ** 3)
    arrive = list(ready) if ready is not None else [0.0] * len(dims)
    busy = [0.0] * world_size
    finish: dict[int, float] = {}
    communicated = (i for i, o in enumerate(owners) if o != EVERY_RANK)
    for i in sorted(communicated, key=lambda i: (arrive[i], -dims[i], i)):
        busy[owners[i]] = max(busy[owners[i]], arrive[i]) + cost(dims[i])
        finish[i] = busy[owners[i]]
    cts = sorted(finish, key=lambda i: (finish[i], owners[i], i))
    return cts + sorted((i for i, o in enumerate(owners) if o == EVERY_RANK), key=lambda i: (arrive[i], i))


def inverse_phase(
    costs: Sequence[float], comms: Sequence[float], owners: Sequence[int], order: Sequence[int], world_size: int
) -> tuple[list[float], list[float]]:
    """Replay an inverse phase on one shared link: when each rank ends its inversions, when each broadcast arrives.

    Every rank walks ``order`` and inverts what it owns and every NCT. A communicated factor's
    broadcast is posted when its owner has inverted it, and the link carries one broadcast at a
    time in ``order`` (collectives on a group run in the order they are posted), so a broadcast
    waits for the ones before it. The simulator and :func:`link` both use this.

    Args:
        costs: Seconds to invert each factor.
        comms: Seconds to broadcast each factor's inverse.
        owners: The owner of each factor, or :data:`EVERY_RANK`.
        order: The order of :func:`schedule`.
        world_size: Number of ranks.

    Returns:
        Each rank's compute end, and the arrival time of each broadcast, in ``order`` (0 for NCTs).
    """
    own = [0.0] * world_size  # each rank's communicated inversions so far
    shared = 0.0  # the NCTs so far, which every rank inverts: O(1) per factor, not O(P)
    link_free = 0.0
    arrivals = [0.0] * len(order)
    for k, i in enumerate(order):
        owner = owners[i]
        if owner == EVERY_RANK:
            shared += costs[i]
            continue
        own[owner] += costs[i]
        link_free = max(link_free, own[owner] + shared) + comms[i]
        arrivals[k] = link_free
    return [x + shared for x in own], arrivals


def link(dims: Sequence[int], sizes: Sequence[int], world_size: int, profile: Profile | None) -> list[int]:
    """Link-aware placement: Algorithm 1's start, refined against a link that carries one broadcast at a time.

    Algorithm 1 adds a broadcast to its owner's load as if broadcasts from different owners ran
    in parallel; on one network they queue. Starting from :func:`lbp`'s owners, each
    communicated factor (largest first) is tried as an NCT and on each of the two least-loaded
    other ranks; a change is kept when the inverse phase replayed by :func:`inverse_phase` (the
    last rank to finish its inversions, or the last broadcast to arrive) ends sooner. A
    factor therefore stays communicated only when its broadcast fits into the link's idle time.

    Raises:
        UserError: Without performance models to estimate the times.
    """
    if profile is None:
        raise UserError("kfac.placement=link needs performance models: set kfac.profile or let the run calibrate.")
    owners = lbp(dims, sizes, world_size, profile)
    if world_size == 1:
        return owners
    costs = [profile.inverse(d) for d in dims]
    comms = [profile.broadcast(m) for m in sizes]

    def span(candidate: list[int]) -> float:
        order = schedule(list(dims), candidate, world_size, profile)
        busy, arrivals = inverse_phase(costs, comms, candidate, order, world_size)
        return max([*busy, *arrivals])

    best = span(owners)
    for _ in range(3):  # a few sweeps; each keeps only improvements, so the span never grows
        improved = False
        loads = [0.0] * world_size
        for j, o in enumerate(owners):
            if o != EVERY_RANK:
                loads[o] += costs[j]
        for i in sorted((i for i, o in enumerate(owners) if o != EVERY_RANK), key=lambda i: (-dims[i], i)):
            others = sorted((r for r in range(world_size) if r != owners[i]), key=lambda r: (loads[r], r))[:2]
            for option in (EVERY_RANK, *others):
                candidate = [*owners[:i], option, *owners[i + 1 :]]
                value = span(candidate)
                if value < best - 1e-12:
                    loads[owners[i]] -= costs[i]
                    if option != EVERY_RANK:
                        loads[option] += costs[i]
                    owners, best, improved = candidate, value, True
                    break
        if not improved:
            break
    return owners


def layer(
    dims: Sequence[int],
    sizes: Sequence[int],
    world_size: int,
    profile: Profile | None,
    work: LayerWork | None = None,
) -> list[int]:
    """Whole layers to owners, for ``kfac.broadcast=update`` (the owner preconditions and sends the update).

    Layers are taken costliest first (both inversions and the preconditioning, estimated). A layer
    that costs less than broadcasting its update is an NCT: every rank inverts and preconditions it.
    Otherwise the least-loaded rank owns both of its factors; its load grows by the work and the
    broadcast, as in Algorithm 1, applied to layers. Given each layer's work between and at
    inversions, the updates travel while the owners compute instead (:func:`_overlapped`).

    Args:
        dims: Sides of the factors, A1, G1, A2, G2, ... (a layer's two factors are adjacent).
        sizes: Elements the layer's update sends (given for each of its two factors).
        world_size: Number of ranks.
        profile: Fitted performance models.
        work: Each layer's preconditioning and inverting seconds on its owner
            (:func:`~kfacflow.kfac.stages.update_plan.layer_work`: from its rows where it goes by them, at the
            recipe's intervals).

    Raises:
        UserError: Without performance models to estimate the times.
    """
    if profile is None:
        raise UserError("kfac.placement=layer needs performance models: set kfac.profile or let the run calibrate.")
    if world_size == 1:
        return [EVERY_RANK] * len(dims)
    comms = [profile.broadcast(m) for m in sizes[::2]]
    if work is None:
        layers = list(zip(dims[::2], dims[1::2], strict=True))  # (A side, G side)
        each = [profile.inverse(a) + profile.inverse(g) + precondition_cost(a, g, profile) for a, g in layers]
        owners = _balance(sorted(range(len(each)), key=lambda j: (-each[j], j)), each, comms, world_size)
    else:
        owners = _overlapped(work, comms, world_size)
    return [owner for owner in owners for _ in (0, 1)]


def _overlapped(work: LayerWork, comms: Sequence[float], world_size: int) -> list[int]:
    """Whole layers by their work, each owner's updates leaving while it computes the next.

    A step's updates travel while the owners precondition, so owning a layer costs its owner the work
    alone, and a layer done by every rank costs every rank its work: every layer is owned, costliest
    first (by its work a step, averaged over the period) by the least-loaded rank, then moved or
    swapped between ranks while that shortens the period (:func:`_rebalance`), unless the link is
    what bounds the step. While the sends take longer than the busiest rank's work (at P = 2 each
    owner's go their own way, point to point; beyond, all of them share one link), the busiest
    owner's layer that sends the most for the least work goes to every rank instead (no update sent).
    """
    steps = work.per_step()
    owners = [EVERY_RANK] * len(steps)
    load = [0.0] * world_size
    for j in sorted(range(len(steps)), key=lambda j: (-steps[j], j)):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        owners[j] = rank
        load[rank] += steps[j]
    owners = _rebalance(owners, work, world_size)
    pre, inv = work.loads(owners, world_size)
    load = [p + v / work.every for p, v in zip(pre, inv, strict=True)]
    sends = [sum(comms[j] for j in range(len(steps)) if owners[j] == r) for r in range(world_size)]
    while True:
        busiest = max(range(world_size), key=lambda r: (sends[r], -r))
        if (sends[busiest] if world_size == 2 else sum(sends)) <= max(load):
            return owners
        mine = [j for j in range(len(steps)) if owners[j] == busiest]
        j = max(mine, key=lambda j: (comms[j] / max(steps[j], 1e-12), -j))
        owners[j] = EVERY_RANK
        sends[busiest] -= comms[j]
        load = [x + steps[j] if r != busiest else x for r, x in enumerate(load)]


def _rebalance(owners: list[int], work: LayerWork, world_size: int) -> list[int]:
    """Move a layer to another rank, or swap two, while that shortens the period (:meth:`LayerWork.period`).

    Only a change that takes work off a rank the period waits on can shorten it
    (:meth:`LayerWork.busiest`), so those ranks' layers are the ones tried: each to every other rank,
    or swapped with each layer there; the first change that shortens the period is kept, until none does.
    """
    owners = list(owners)
    pre, inv = work.loads(owners, world_size)
    best = work.period(pre, inv)
    p, v = work.precondition, work.invert
    for _ in range(4 * len(owners) + 1):  # each pass shortens the period; bounded all the same
        busy = work.busiest(pre, inv)
        found = None
        for j in (j for j in range(len(owners)) if owners[j] in busy):
            a = owners[j]
            changes: list[tuple[int, int | None]] = [(b, None) for b in range(world_size) if b != a]
            changes += [(owners[k], k) for k in range(len(owners)) if owners[k] not in (a, EVERY_RANK)]
            for b, k in changes:
                dp, dv = p[j] - (p[k] if k is not None else 0.0), v[j] - (v[k] if k is not None else 0.0)
                new_pre, new_inv = list(pre), list(inv)
                new_pre[a] -= dp
                new_inv[a] -= dv
                new_pre[b] += dp
                new_inv[b] += dv
                value = work.period(new_pre, new_inv)
                if value < best * (1 - 1e-9):
                    found = (j, a, b, k, new_pre, new_inv, value)
                    break
            if found:
                break
        if found is None:
            return owners
        j, a, b, k, pre, inv, best = found
        owners[j] = b
        if k is not None:
            owners[k] = a
    return owners


@dataclass(frozen=True)
class Rule:
    """A placement rule (who inverts each factor) with the shared inversion order, :func:`schedule`."""

    owners: Callable[..., list[int]]
    weighs_layers: bool = False
    """Whether :attr:`owners` places whole layers by each one's work (its ``work`` argument)."""

    @property
    def name(self) -> str:
        """The rule's name (for logs)."""
        return self.owners.__name__

    def __call__(
        self,
        dims: Sequence[int],
        sizes: Sequence[int],
        world_size: int,
        profile: Profile | None,
        work: LayerWork | None = None,
    ) -> list[int]:
        """The rule's owners (``work``: each layer's work on its owner, for a rule that weighs layers)."""
        if work is None:
            return self.owners(dims, sizes, world_size, profile)
        return self.owners(dims, sizes, world_size, profile, work)

    def order(
        self,
        dims: Sequence[int],
        owners: Sequence[int],
        world_size: int,
        profile: Profile | None,
        ready: Sequence[float] | None,
    ) -> list[int]:
        """:func:`schedule`."""
        return schedule(dims, owners, world_size, profile, ready)


PLACEMENTS.add("local", Rule(local), "every rank inverts every factor; no inverse traffic (D-KFAC)")
PLACEMENTS.add("round_robin", Rule(round_robin), "factor i inverted by rank i mod P, every result broadcast (MPD-KFAC)")
PLACEMENTS.add(
    "lbp",
    Rule(lbp),
    "Algorithm 1: largest first to the least-loaded rank; NCT where inverting beats sending",
    needs_profile=True,
)
PLACEMENTS.add(
    "link",
    Rule(link),
    "Algorithm 1 refined against one shared link: a factor stays communicated only where its broadcast fits",
    needs_profile=True,
)
PLACEMENTS.add(
    "layer",
    Rule(layer, weighs_layers=True),
    "whole layers to the least-loaded rank (for kfac.broadcast=update); NCT where computing beats sending",
    needs_profile=True,
)
