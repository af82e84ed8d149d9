"""``optim.muon.owners=auto``: Muon's matrices on owners where that is faster on this job, measured as it starts.

Owners save Newton-Schulz work and add one gather of every matrix's direction a step. Which wins
depends on the device and the link: on this project's CPU cluster the owners take 0.68x of
ResNet-50's replicated step, while a GPU that orthogonalises at 100 TFLOP/s is projected to be
faster replicated (``docs/results/projections.md``). So ``auto`` times both, once, before the first
step: every matrix's Newton-Schulz as the replicated step runs it, this rank's ``placed`` share as
the owners' step runs it, and the gather of the directions on the job's own link, each on random
matrices of the weights' shapes after one warm-up of every shape. Every rank's three times are
gathered, so all ranks take the same choice from the same numbers: the slowest rank's owned share
plus the slowest gather against the slowest replicated pass.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import torch

from kfacflow import UserError
from kfacflow.optim.muon import Muon, ns_dtype, orthogonalised_together
from kfacflow.optim.sharding import Owners
from kfacflow.timing import fastest

if TYPE_CHECKING:
    from kfacflow.comm.base import Backend

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Timed:
    """Seconds of a Muon step's matrix work, the slowest rank's each: replicated, owned (``placed``), the gather."""

    replicated: float
    owned: float
    gather: float

    def choice(self, kfac: bool = False) -> Owners:
        """``placed`` where the owners' share and the gather take less than doing every matrix.

        ``kfac`` (K-FAC's layer owners send updates): ``kfac`` on the same terms. Its step gathers nothing, but
        its owners wait for every owner's ``v.g`` before their Muon step and lose the overlap of their sends
        with the preconditioning: on this project's CPUs about one gather's time (ViT 2 ms, small CNN 2 ms).
        """
        owners: Owners = "kfac" if kfac else "placed"
        return owners if self.owned + self.gather < self.replicated else "replicated"


REPEATS = 5
"""Most timings of each rank's own Newton-Schulz: the fastest counts. Where the other rank and the link's threads
share the cores, one timing is often a preempted one, and chose by chance
(``docs/results/owner_choice_repeats_2workers``)."""
LOCAL_BUDGET_S = 1.0
"""Seconds after which a rank's own timing stops repeating (ResNet-50's replicated pass alone takes 3 s)."""
GATHERS = 5
"""Timings of the gather, the same on every rank (each is a collective)."""


def _alone() -> None:
    """No rank waits for another before its part."""


def _fastest_local(fn: Callable[[], object], device: torch.device) -> float:
    """The fastest of up to :data:`REPEATS` timings of this rank's own work, fewer where they pass the budget."""
    best, spent = math.inf, 0.0
    for _ in range(REPEATS):
        took = fastest(fn, 1, device, _alone)
        best, spent = min(best, took), spent + took
        if spent > LOCAL_BUDGET_S:
            break
    return best


def measure(optimizer: Muon, backend: Backend) -> Timed:
    """Time the three parts on every rank and gather them (collective: every rank must call it)."""
    sharding = optimizer.sharded_by(backend, "placed")
    device, mine = backend.device, [0.0, 0.0, 0.0]
    for group in optimizer.muon_groups():
        params = group["params"]
        if not params:
            continue
        dtype = ns_dtype(group.get("ns_dtype", "auto"), params[0])
        updates = [torch.randn_like(p) for p in params]
        directions = {id(p): u for p, u in zip(params, updates, strict=True) if sharding.owns(p)}
        batched = params[0].device.type == "cuda"
        ortho = partial(orthogonalised_together, steps=group["ns_steps"], dtype=dtype, batched=batched)
        first = list({tuple(u.shape): u for u in updates}.values())  # one of each shape: kernels warmed
        fastest(partial(ortho, first), 1, device, _alone)
        mine[0] += _fastest_local(partial(ortho, updates), device)
        mine[1] += _fastest_local(partial(ortho, list(directions.values())), device)
        gather = partial(sharding.exchange, params, directions, dtype)
        gather()  # the link's first use of these sizes
        mine[2] += fastest(gather, GATHERS, device, _alone)  # every rank as many: a collective
    world = backend.world_size
    every = backend.gather_async(torch.tensor(mine, dtype=torch.float64, device=device), [3] * world).wait()
    slowest = every.view(world, 3).max(dim=0).values.tolist()
    return Timed(*slowest)


def resolve(optimizer: Muon, backend: Backend, how: str, kfac_sends_updates: bool = False) -> Owners:
    """``how``, or for ``auto`` the measured choice (logged with its numbers); one process: ``replicated``.

    ``kfac_sends_updates``: whether a K-FAC preconditioner's layer owners send the updates
    (``kfac.broadcast=update`` or ``fused_update``, fixed for the run): ``auto`` then weighs ``kfac``
    (:mod:`kfacflow.on_owners.muon_step`) against ``replicated`` (:meth:`Timed.choice`).

    Raises:
        UserError: ``kfac`` where no K-FAC owner sends updates.
    """
    if how == "kfac" and not kfac_sends_updates:  # a recipe's mistake is found before (on_owners.muon_step.check)
        raise UserError("optim.muon.owners=kfac needs K-FAC's layer owners to send the updates; use placed")
    if how != "auto":
        return how  # type: ignore[return-value]  # the schema allows only the owners' names and auto
    if backend.world_size == 1 or not optimizer.muon_groups():
        return "replicated"
    timed = measure(optimizer, backend)
    choice = timed.choice(kfac_sends_updates)
    logger.info(
        "optim.muon.owners=auto: %s (the owners' Newton-Schulz %.1f ms + their gather %.1f ms, against %.1f ms "
        "replicated; the slowest rank's, measured now)",
        choice,
        1e3 * timed.owned,
        1e3 * timed.gather,
        1e3 * timed.replicated,
    )
    return choice
