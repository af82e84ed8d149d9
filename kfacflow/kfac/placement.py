"""Which rank inverts which factor: every rank (NCT) or one owner whose result is broadcast (CT)."""

from __future__ import annotations

from collections.abc import Sequence

from kfacflow import UserError
from kfacflow.kfac.stages import EVERY_RANK
from kfacflow.perf import Profile
from kfacflow.registry import PLACEMENTS

__all__ = ["EVERY_RANK", "lbp", "local", "round_robin", "schedule"]


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
    owners = [EVERY_RANK] * len(dims)
    if world_size == 1:
        return owners
    load = [0.0] * world_size
    for i in sorted(range(len(dims)), key=lambda i: (-dims[i], i)):
        comp, comm = profile.inverse(dims[i]), profile.broadcast(sizes[i])
        if comp < comm:
            load = [x + comp for x in load]
        else:
            rank = min(range(world_size), key=lambda r: (load[r], r))
            owners[i] = rank
            load[rank] += comp + comm
    return owners


def schedule(dims: list[int], owners: list[int], world_size: int, profile: Profile | None) -> list[int]:
    """Return the order in which every rank walks the factors when inverting (the same on all ranks).

    Communicated tensors come first, each owner taking its own largest first, ordered by
    their estimated finish time; then the non-communicated ones. So broadcasts start as early
    as possible and overlap the inversions that follow, and every rank posts its broadcasts in
    the same order (collectives on a group run in the order they are posted).
    """
    cost = profile.inverse if profile is not None else (lambda d: float(d) ** 3)
    busy = [0.0] * world_size
    finish: dict[int, float] = {}
    for i in sorted((i for i, o in enumerate(owners) if o != EVERY_RANK), key=lambda i: (-dims[i], i)):
        busy[owners[i]] += cost(dims[i])
        finish[i] = busy[owners[i]]
    cts = sorted(finish, key=lambda i: (finish[i], owners[i], i))
    return cts + [i for i, o in enumerate(owners) if o == EVERY_RANK]


PLACEMENTS.add("local", local, "every rank inverts every factor; no inverse traffic (D-KFAC)")
PLACEMENTS.add("round_robin", round_robin, "factor i inverted by rank i mod P, every result broadcast (MPD-KFAC)")
PLACEMENTS.add(
    "lbp",
    lbp,
    "Algorithm 1: largest first to the least-loaded rank; NCT where inverting beats sending",
    needs_profile=True,
)
