"""The step plan laid onto this preconditioner's layers: who inverts each factor, orders, buckets, routes.

:func:`~kfacflow.kfac.planning.plan.make_plan` speaks of indices; the running step speaks of slots, layers
and parameters. :func:`place` translates one into the other once per plan (never per step).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import Tensor

from kfacflow.comm.base import Backend
from kfacflow.kfac.layers import KFACLayer
from kfacflow.kfac.planning.plan import StepPlan
from kfacflow.kfac.stages.contracts import EVERY_RANK, FactorSlot
from kfacflow.kfac.stages.fusion import Routing
from kfacflow.perf import Profile

logger = logging.getLogger(__name__)


@dataclass
class Placed:
    """The plan's decisions on this rank, by slot, layer and parameter."""

    order: list[FactorSlot]
    """The inversion order."""
    layer_order: list[KFACLayer]
    """The order every rank walks to precondition and send updates."""
    update_buckets: dict[str, list[str]]
    """With ``kfac.broadcast=fused_update``: the layers of each bucket, keyed by its last layer."""
    gathered: set[str]
    """The buckets gathered from their owners (:func:`~kfacflow.kfac.stages.placement.gathers`), not all-reduced."""
    grad_owned: list[list[Tensor]]
    """The parameters whose gradients each rank receives alone (``[]``: every gradient all-reduced)."""
    routing: Routing | None
    """Where factors go to their owners alone (``None``: every factor all-reduced)."""
    held: set[str] | None
    """The factors whose running averages this rank keeps (``None``: every one)."""


def place(
    plan: StepPlan, layers: list[KFACLayer], slots: list[FactorSlot], backend: Backend, profile: Profile | None
) -> Placed:
    """Write the plan's owners and sizes into ``slots``; return the rest of its decisions for this rank.

    Factors and gradients go to their owners only where the plan says (from the second step: a
    layer dropped at the end of the first changes the placement, and factors already on their way
    went by the old one; never on an engine without a reduction to one rank, such as Horovod).
    """
    for slot, size, owner in zip(slots, plan.sizes, plan.owners, strict=True):
        slot.flat_size, slot.owner = size, owner
    names = [layer.name for layer in layers]
    gathered = {names[plan.buckets[i][-1]] for i in plan.gathered}
    if gathered:
        logger.info("%d of %d buckets of updates gathered from their owners", len(gathered), len(plan.buckets))
    grad_owned: list[list[Tensor]] = []
    if plan.grad_owners is not None:
        grad_owned = [[] for _ in range(backend.world_size)]
        for layer, owner in zip(layers, plan.grad_owners, strict=True):
            if owner != EVERY_RANK:
                grad_owned[owner] += layer.params
        logger.info(
            "the gradients of %d layers go to their owners alone", sum(o != EVERY_RANK for o in plan.grad_owners)
        )
    routing, held = None, None
    if plan.factor_owners is not None:
        owners = {slot.key: owner for slot, owner in zip(slots, plan.factor_owners, strict=True)}
        allreduce, reduce = (profile.allreduce, profile.broadcast) if profile else (None, None)
        routing = Routing(owners, backend.world_size, allreduce, reduce, backend.scatters)
        held = {key for key, owner in owners.items() if owner in (EVERY_RANK, backend.rank)}
    return Placed(
        order=[slots[i] for i in plan.order],
        layer_order=[layers[j] for j in plan.layer_order],
        update_buckets={names[b[-1]]: [names[j] for j in b] for b in plan.buckets},
        gathered=gathered,
        grad_owned=grad_owned,
        routing=routing,
        held=held,
    )


def batches(slots: list[FactorSlot], device: torch.device, tracing: bool) -> list[list[FactorSlot]]:
    """Split ``slots`` into what is inverted before the next of them is sent.

    On CUDA, outside a traced step, every factor of ``slots`` is inverted before the first
    broadcast is posted, so that the statuses of their factorizations are read once
    (:func:`~kfacflow.kfac.stages.inverse.invert_all`); elsewhere each one's broadcast follows its own
    inverse (a read costs nothing on the CPU, and a traced step times each inverse).
    """
    if device.type == "cuda" and not tracing:
        return [slots]
    return [[slot] for slot in slots]
