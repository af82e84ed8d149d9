"""Planning ``kfac.broadcast=update``: whole layers to one owner, the order updates are sent in, their buckets.

:func:`~kfacflow.kfac.planning.plan.make_plan` uses these where the broadcast sends layers' updates: what
owning a layer costs between inversions and at them (:func:`layer_work`), both
factors of a layer on one owner (:func:`by_layer`), the shared order every rank preconditions and
posts in (:func:`layer_order`), and the buckets of ``fused_update`` (:func:`update_buckets`, each
all-reduced or gathered: :func:`gathers`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kfacflow.comm import scatter
from kfacflow.kfac.stages.contracts import EVERY_RANK
from kfacflow.perf import Profile


def precondition_cost(a_dim: int, g_dim: int, profile: Profile | None, rows: int = 0, dense: bool = False) -> float:
    """Estimated seconds to precondition one layer: about an inversion of the same number of flops.

    Applying both inverses multiplies a ``g x a`` gradient by a ``g x g`` and an ``a x a`` matrix
    (or solves with their Cholesky factors): ``a g (a + g)`` multiply-adds, as many as inverting a
    factor of side ``(a g (a + g))^(1/3)``; from ``rows`` rows a step (``kfac.precondition=rows``,
    over every rank) ``N (a^2 + g^2 + g a)``. ``dense``: timed by the model of a dense inverse
    (``kfac.inverse=cholesky``, ``d^3`` multiply-adds as a product of that side does) rather than the
    recipe's method's (``cholesky_factor``'s is a third of it: traced preconditioning follows the dense
    one). Rough (within about 2x of traced times), which is enough to balance whole layers.
    """
    work = rows * (a_dim * a_dim + g_dim * g_dim + g_dim * a_dim) if rows else a_dim * g_dim * (a_dim + g_dim)
    side = work ** (1 / 3)
    if profile is None:
        return side**3
    return (profile.methods.get("cholesky", profile.inverse) if dense else profile.inverse)(side)


@dataclass(frozen=True)
class LayerWork:
    """What owning each layer costs its owner between and at inversions (``kfac.inv_update_freq`` = ``every``).

    A layer is preconditioned every step and its two factors inverted once a period. Where every
    factor is inverted on the same step (``kfac.inverse_schedule=all``) a period is ``every - 1`` steps
    that wait on the rank with the most preconditioning and one that waits on the rank with the most
    of both (:meth:`period`); balancing a step's average instead (:meth:`per_step`) can give one rank
    the inversions and the other the preconditioning, and both kinds of step then wait (ResNet-18 at
    1/10 traced 0.16 against 0.38 s of preconditioning between inversions). Staggered inversions
    (``staggered``) share the period's out over its steps, where the average is what each step carries.
    """

    precondition: tuple[float, ...]
    """Each layer's preconditioning seconds (a step)."""
    invert: tuple[float, ...]
    """Each layer's seconds inverting both of its factors (once a period)."""
    every: int
    staggered: bool = False

    def per_step(self) -> list[float]:
        """Each layer's seconds a step on its owner, averaged over a period."""
        return [p + v / self.every for p, v in zip(self.precondition, self.invert, strict=True)]

    def loads(self, owners: Sequence[int], world_size: int) -> tuple[list[float], list[float]]:
        """Each rank's preconditioning and inverting seconds (a layer of ``EVERY_RANK`` on every rank)."""
        pre, inv = [0.0] * world_size, [0.0] * world_size
        for j, owner in enumerate(owners):
            for r in range(world_size) if owner == EVERY_RANK else (owner,):
                pre[r] += self.precondition[j]
                inv[r] += self.invert[j]
        return pre, inv

    def period(self, pre: Sequence[float], inv: Sequence[float]) -> float:
        """Seconds of a period on the busiest ranks, given each rank's :meth:`loads`."""
        return sum(weight * max(load) for weight, load in self._steps(pre, inv))

    def busiest(self, pre: Sequence[float], inv: Sequence[float]) -> set[int]:
        """The ranks the period waits on (the lowest of those tied): only work taken off them can shorten it."""
        return {max(range(len(load)), key=lambda r: (load[r], -r)) for _, load in self._steps(pre, inv)}

    def _steps(self, pre: Sequence[float], inv: Sequence[float]) -> list[tuple[int, list[float]]]:
        """Each kind of step in a period: how many there are, and each rank's seconds on one."""
        if self.staggered or self.every == 1:
            return [(self.every, [p + v / self.every for p, v in zip(pre, inv, strict=True)])]
        return [(self.every - 1, list(pre)), (1, [p + v for p, v in zip(pre, inv, strict=True)])]


def layer_work(
    dims: Sequence[int],
    profile: Profile,
    rows: Sequence[int] | None,
    inverse_every: int,
    staggered: bool = False,
    seconds: Sequence[float | None] | None = None,
) -> LayerWork:
    """Each layer's preconditioning seconds a step and inverting seconds a period, on its owner.

    At 10/100 preconditioning is what to share out, and a layer that goes by its rows weighs what
    its rows cost. Measured seconds (``kfac.placement_steps``) replace the estimates of preconditioning;
    inversions stay the profile's (fitted to timed inversions).

    Args:
        dims: Sides of the factors, A1, G1, A2, G2, ...
        profile: Fitted performance models.
        rows: Rows a step of each layer that goes by rows (0: by its gradient; ``None``: none does).
        inverse_every: Steps between inversions.
        staggered: Whether the inversions are spread over the period (``kfac.inverse_schedule=staggered``).
        seconds: Each layer's measured preconditioning seconds a step (``None``: estimate it).
    """
    n = len(dims) // 2
    pre = [precondition_cost(dims[2 * j], dims[2 * j + 1], profile, rows[j] if rows else 0, True) for j in range(n)]
    if seconds is not None:
        pre = [estimate if measured is None else measured for estimate, measured in zip(pre, seconds, strict=True)]
    inverts = [profile.inverse(dims[2 * j]) + profile.inverse(dims[2 * j + 1]) for j in range(n)]
    return LayerWork(tuple(pre), tuple(inverts), inverse_every, staggered)


def by_layer(dims: Sequence[int], owners: Sequence[int]) -> list[int]:
    """Return ``owners`` with both factors of each layer on one owner (what ``kfac.broadcast=update`` needs).

    Where a placement split a layer, the owner of its larger communicated factor takes both;
    a layer with neither factor communicated stays with every rank.
    """
    paired = list(owners)
    for j in range(0, len(dims), 2):
        a, g = owners[j], owners[j + 1]
        if a != g:
            big, small = (a, g) if dims[j] >= dims[j + 1] else (g, a)
            paired[j] = paired[j + 1] = big if big != EVERY_RANK else small
    return paired


def layer_order(
    dims: Sequence[int],
    owners: Sequence[int],
    world_size: int,
    profile: Profile | None,
    cost: Sequence[float] | None = None,
) -> list[int]:
    """Return the order in which every rank preconditions and broadcasts layers (``kfac.broadcast=update``).

    Each owner takes its own layers costliest first (the last update it sends is then a short
    one); the owners' layers are interleaved by their estimated finish, so every rank posts the
    broadcasts in the order they are expected to be ready; layers every rank preconditions come
    last, while the updates travel. ``cost``: each layer's preconditioning seconds (default:
    :func:`precondition_cost` from its gradient).
    """
    n = len(dims) // 2
    if cost is None:
        cost = [precondition_cost(dims[2 * j], dims[2 * j + 1], profile) for j in range(n)]
    busy = [0.0] * world_size
    finish: dict[int, float] = {}
    for j in sorted((j for j in range(n) if owners[2 * j] != EVERY_RANK), key=lambda j: (-cost[j], j)):
        busy[owners[2 * j]] += cost[j]
        finish[j] = busy[owners[2 * j]]
    owned = sorted(finish, key=lambda j: (finish[j], owners[2 * j], j))
    return owned + [j for j in range(n) if owners[2 * j] == EVERY_RANK]


def update_buckets(
    order: Sequence[int],
    elements: Sequence[int],
    owners: Sequence[int],
    profile: Profile | None,
    world_size: int = 2,
    gather: bool = False,
) -> list[list[int]]:
    """Group the communicated layers of ``order`` for ``kfac.broadcast=fused_update``.

    Consecutive layers of the shared order share a bucket until it has paid for its all-reduce
    start-up (:meth:`~kfacflow.perf.LinearModel.amortized`: tenfold). A bucket of several layers is one
    collective (:func:`gathers` says which) and is kept only where that beats broadcasting its
    layers one by one (at P = 64 a broadcast start-up costs as much as a million elements and
    two hundred of them queue on the link; on a slow link an all-reduce's double traffic
    costs more than the start-ups it saves); otherwise each layer is its own bucket,
    broadcast alone as soon as its owner has it.

    Args:
        order: Layer indices in the order every rank preconditions them (:func:`layer_order`).
        elements: Elements of each layer's update.
        owners: Owner of each layer (``EVERY_RANK``: computed on every rank, not sent).
        profile: Fitted performance models (none: every layer alone).
        world_size: P.
        gather: Whether the engine can gather pieces from their owners (:func:`gathers`).
    """
    sent = [j for j in order if owners[j] != EVERY_RANK]
    if profile is None:
        return [[j] for j in sent]
    ar, bc = profile.allreduce, profile.broadcast
    buckets: list[list[int]] = []

    def close(bucket: list[int]) -> None:
        m = sum(elements[j] for j in bucket)
        cost = bucket_cost(bucket, elements, owners, profile, world_size, gather)
        if len(bucket) > 1 and cost < len(bucket) * bc.alpha + bc.beta * m:
            buckets.append(bucket)
        else:
            buckets.extend([j] for j in bucket)

    bucket: list[int] = []
    for j in sent:
        bucket.append(j)
        if ar.amortized(sum(elements[i] for i in bucket)):
            close(bucket)
            bucket = []
    close(bucket)
    return buckets


def gathers(
    bucket: Sequence[int], elements: Sequence[int], owners: Sequence[int], profile: Profile, world_size: int
) -> bool:
    """Whether a bucket of updates travels as a gather from its owners rather than a zero-filled all-reduce.

    A gather (:meth:`~kfacflow.comm.base.Backend.gather_async`: an all-to-all into equal chunks,
    then their all-gather) pays two start-ups and moves each element about once; the all-reduce
    pays one and moves each element twice; the models decide (:func:`~kfacflow.comm.scatter.pays`).
    """
    return scatter.pays(profile.allreduce, profile.broadcast, _counts(bucket, elements, owners, world_size))


def bucket_cost(
    bucket: Sequence[int],
    elements: Sequence[int],
    owners: Sequence[int],
    profile: Profile,
    world_size: int,
    gather: bool,
) -> float:
    """Seconds one bucket of updates takes on the link, in the collective it travels in."""
    if gather and gathers(bucket, elements, owners, profile, world_size):
        return scatter.cost(profile.broadcast, _counts(bucket, elements, owners, world_size))
    return profile.allreduce(sum(elements[j] for j in bucket))


def _counts(bucket: Sequence[int], elements: Sequence[int], owners: Sequence[int], world_size: int) -> list[int]:
    """Elements of the bucket each rank owns."""
    counts = [0] * max(world_size, 1, *(owners[j] + 1 for j in bucket))
    for j in bucket:
        counts[owners[j]] += elements[j]
    return counts
