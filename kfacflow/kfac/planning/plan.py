"""The plan of a K-FAC step, as data: who inverts each factor, in which order, what each exchange carries.

One pure function, :func:`make_plan`, makes a :class:`StepPlan` from the layers' sizes, the chosen
strategies, the world size, the performance profile and what the engine can do
(:class:`EngineCaps`). The running preconditioner and the simulator both consume the plan it
returns, so the two cannot drift: a rule lives here once. A plan is made again only when one of
its inputs changes (the layers in use, the strategies, the expected arrival of the factors),
never per step.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kfacflow import registry
from kfacflow.comm import scatter
from kfacflow.kfac.stages.contracts import EVERY_RANK, Inverse, Placement
from kfacflow.kfac.stages.update_plan import LayerWork, by_layer, gathers, layer_order, layer_work, update_buckets
from kfacflow.perf import Profile

if TYPE_CHECKING:
    from kfacflow.kfac.stages.contracts import Variant as Stages


@dataclass(frozen=True)
class EngineCaps:
    """What the engine does besides all-reduces and broadcasts (:class:`~kfacflow.comm.base.Backend`'s flags).

    ``reduces``: a reduction to one rank (Horovod has none; nor has gloo with CUDA tensors).
    ``scatters``: a reduction to several owners at once, each receiving its own piece (NCCL's pays).
    ``gathers``: every owner's piece to every rank at once.
    ``direct``: a reduction to several owners sent straight to each, point to point (gloo's pays from P = 2);
    tensors sent and received point to point.
    """

    reduces: bool = True
    scatters: bool = False
    gathers: bool = False
    direct: bool = False

    @property
    def sends_direct(self) -> bool:
        """Whether a reduction to owners goes straight to each owner (``direct``, where no reduce-scatter pays)."""
        return self.reduces and self.direct and not self.scatters

    def sends_updates_direct(self, world: int) -> bool:
        """Whether owners send their layers' updates point to point (``kfac.broadcast=update``; gloo, P = 2).

        Gloo runs a broadcast on one of a few worker threads, and a rank that has posted the receive of an
        update its owner has yet to compute holds a thread meanwhile: the updates of two owners then
        crossed the link one at a time (ResNet-50 at 32 px on 2 nodes at 1 Gbit/s: 0.9 s for 102 MB).
        Point to point, every receive is posted at once and each owner's sends go out as it computes them,
        both directions at once. Beyond two ranks an owner would send P - 1 copies on its own link: not measured,
        so broadcasts stay there.
        """
        return self.reduces and self.direct and world == 2

    @classmethod
    def of(cls, backend: object) -> EngineCaps:
        """The flags of ``backend`` (a :class:`~kfacflow.comm.base.Backend`)."""
        return cls(
            bool(getattr(backend, "reduces", False)),
            bool(getattr(backend, "scatters", False)),
            bool(getattr(backend, "gathers", False)),
            bool(getattr(backend, "direct", False)),
        )


@dataclass(frozen=True)
class Choice:
    """What the chosen strategies decide about a plan (the rest of them acts on it at run time).

    Args:
        placement: Who inverts each factor (``kfac.placement``).
        result: The inverse method's result type (its broadcast sizes).
        update: Whether a layer's owner sends its update instead of its inverses (``kfac.broadcast``).
        full: Whether inverses travel as whole matrices.
        fused: Whether updates travel in buckets.
        factor_to_owner: Whether factors are reduced to their owners (``kfac.factor_sync=owner``).
        grad_to_owner: Whether owned layers' gradients go to their owners (``kfac.grad_sync=owner``).
        on_arrival: Whether factors are inverted as they arrive (the pipeline orders by arrival).
    """

    placement: Placement
    result: type[Inverse]
    update: bool = False
    full: bool = False
    fused: bool = False
    factor_to_owner: bool = False
    grad_to_owner: bool = False
    on_arrival: bool = False

    @classmethod
    def shaped(cls, placement: Placement, result: type[Inverse], strategies: Iterable[Any]) -> Choice:
        """What a placement, an inverse's kind and the strategies decide: each strategy writes its own part."""
        choice = cls(placement, result)
        for strategy in strategies:
            choice = strategy.shape(choice)
        return choice

    @classmethod
    def named(cls, names: Stages) -> Choice:
        """What the stages a recipe names decide (the simulator's view: nothing is built)."""
        strategies = (
            registry.PIPELINES.get(names.pipeline),
            registry.BROADCASTS.get(names.broadcast),
            registry.FACTOR_SYNCS.get(names.factor_sync),
            registry.GRAD_SYNCS.get(names.grad_sync),
        )
        return cls.shaped(
            registry.PLACEMENTS.get(names.placement), registry.INVERSES.get(names.inverse).result, strategies
        )


@dataclass(frozen=True)
class StepPlan:
    """Every decision of a step's schedule; factors are A1, G1, A2, G2, ... and layers 0, 1, ...

    Attributes:
        world: P.
        dims: Side of each factor.
        owners: Who inverts each factor (:data:`EVERY_RANK`: every rank, nothing sent).
        sizes: Elements each factor's result takes when it travels (its inverse, or its layer's update).
        order: The factors in the order every rank inverts them (and posts their broadcasts).
        layer_order: With an update exchange, the layers in the order every rank preconditions them.
        buckets: With fused updates, the buckets of several layers (each one collective), in that order.
        gathered: Which of ``buckets`` are gathered from their owners (not all-reduced).
        factor_owners: Where each factor is reduced (``None``: all-reduced).
        grad_owners: Per layer, the rank that alone receives its gradients, or :data:`EVERY_RANK`
            (all-reduced); ``None``: every gradient all-reduced.
    """

    world: int
    dims: tuple[int, ...]
    owners: tuple[int, ...]
    sizes: tuple[int, ...]
    order: tuple[int, ...]
    layer_order: tuple[int, ...] = ()
    buckets: tuple[tuple[int, ...], ...] = ()
    gathered: tuple[int, ...] = ()
    factor_owners: tuple[int, ...] | None = None
    grad_owners: tuple[int, ...] | None = None
    provisional: bool = False
    """Made before the layers in use were known, with routes to owners to follow from them: make it again then."""
    work: LayerWork | None = None
    """What owning each layer costs, where whole layers were placed by it (at intervals over 1)."""


def make_plan(
    layers: Sequence[tuple[int, int, int]],
    choice: Choice,
    world: int,
    profile: Profile | None,
    caps: EngineCaps,
    *,
    settled: bool = True,
    ready: Sequence[float] | None = None,
    rows: Sequence[int] | None = None,
    inverse_every: int = 1,
    staggered: bool = False,
    seconds: Sequence[float | None] | None = None,
) -> StepPlan:
    """Plan a step (the inputs after ``caps`` by name: most are optional, and several alike in type).

    Args:
        layers: Each layer's ``(a_dim, g_dim, parameters)``, in the preconditioner's order.
        choice: What the strategies decide (:class:`Choice`).
        world: P.
        profile: The performance models (placements and orders that estimate times use them).
        caps: What the engine does (:class:`EngineCaps`).
        settled: Whether the layers in use are known (after the first step): factors and
            gradients go to their owners only then, since a layer dropped at the end of the first
            step changes the placement while its factors are on their way.
        ready: When each factor is expected to arrive (``choice.on_arrival``; ``None``: all at once).
        rows: Rows a step of each layer that is preconditioned from them (0: from its gradient), over every
            rank (``kfac.precondition=rows``).
        inverse_every: Steps between inversions (``kfac.inv_update_freq``). Where updates travel and it is
            over 1, whole layers are placed by their work (:func:`~kfacflow.kfac.stages.update_plan.layer_work`:
            preconditioning, from rows where a layer goes by them, and inverting, each on the steps it lands on).
        staggered: Whether inversions are spread over their period (``kfac.inverse_schedule=staggered``).
        seconds: Each layer's preconditioning seconds a step as measured (``None``, or a layer's ``None``:
            estimated from its shape), for the placement of whole layers by their work.
    """
    dims = [d for a, g, _ in layers for d in (a, g)]
    if choice.update:  # what travels is the layer's update, once for both of its factors
        sizes = [a * g for a, g, _ in layers for _ in (0, 1)]
    else:
        sizes = [choice.result.full_elements(d) if choice.full else choice.result.elements(d) for d in dims]
    cost: list[float] | None = None
    work: LayerWork | None = None
    if choice.update and profile is not None and inverse_every > 1:  # at 1/1 Algorithm 1 (inversions, then sends)
        work = layer_work(dims, profile, rows, inverse_every, staggered, seconds)
        cost = list(work.precondition)
    if work is not None and getattr(choice.placement, "weighs_layers", False):
        owners = choice.placement(dims, sizes, world, profile, work)  # type: ignore[call-arg]
    else:
        owners = choice.placement(dims, sizes, world, profile)
    order: list[int] = []
    buckets: list[tuple[int, ...]] = []
    gathered: list[int] = []
    if choice.update:
        owners = by_layer(dims, owners)
        order = layer_order(dims, owners, world, profile, cost)
        if choice.fused:
            for bucket in update_buckets(order, sizes[::2], owners[::2], profile, world, caps.gathers):
                if len(bucket) > 1:
                    if caps.gathers and profile and gathers(bucket, sizes[::2], owners[::2], profile, world):
                        gathered.append(len(buckets))
                    buckets.append(tuple(bucket))
    times = list(ready) if choice.on_arrival and ready is not None else None
    routed = settled and world > 1 and choice.factor_to_owner and caps.reduces
    return StepPlan(
        world=world,
        dims=tuple(dims),
        owners=tuple(owners),
        sizes=tuple(sizes),
        order=tuple(choice.placement.order(dims, owners, world, profile, times)),
        layer_order=tuple(order),
        buckets=tuple(buckets),
        gathered=tuple(gathered),
        factor_owners=tuple(owners) if routed else None,
        grad_owners=_grad_owners(layers, owners, choice, world, profile, caps) if settled else None,
        provisional=not settled and (choice.factor_to_owner or choice.grad_to_owner),
        work=work,
    )


def _grad_owners(
    layers: Sequence[tuple[int, int, int]],
    owners: Sequence[int],
    choice: Choice,
    world: int,
    profile: Profile | None,
    caps: EngineCaps,
) -> tuple[int, ...] | None:
    """The rank each owned layer's gradients go to alone (``kfac.grad_sync=owner``), or ``None``.

    Where the engine moves pieces to their owners alone and the models say one reduction to the
    owners costs less than all-reducing the same gradients: from three ranks on for a reduce-scatter
    (at P = 2 it moves no fewer bytes), from two where each piece goes straight to its owner.
    """
    direct = caps.sends_direct
    if not (choice.grad_to_owner and choice.update and (caps.scatters or direct) and profile is not None and world > 1):
        return None
    per_layer = tuple(owners[::2])
    counts = [0] * world
    for (_, _, params), owner in zip(layers, per_layer, strict=True):
        if owner != EVERY_RANK:
            counts[owner] += params
    return per_layer if scatter.pays(profile.allreduce, profile.broadcast, counts, direct) else None
