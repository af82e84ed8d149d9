"""K-FAC's running state on this rank: running averages, inverses, the factors it keeps, the sums between exchanges."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from kfacflow.configuration.schema import KFACConfig
from kfacflow.kfac.checkpoint import restored
from kfacflow.kfac.communicator import FusedSum
from kfacflow.kfac.finite import FiniteFlags
from kfacflow.kfac.packing import unpack
from kfacflow.kfac.stages.contracts import EVERY_RANK, FactorSlot, InverseMethod
from kfacflow.kfac.stages.inverse import Inverse, invert_all
from kfacflow.kfac.strategies.factor_exchange import AtUpdate, Exchange, exchange_for

if TYPE_CHECKING:
    from kfacflow.kfac.communicator import Communicator
    from kfacflow.kfac.hooks.capture import Capture
    from kfacflow.kfac.planning.schedule import Schedule
    from kfacflow.kfac.strategies.contracts import Engine


def dtypes(cfg: KFACConfig, parameters: torch.dtype) -> tuple[torch.dtype, torch.dtype]:
    """Return the factors' dtype and the inverses' (``kfac.factor_dtype``, ``kfac.inverse_dtype``).

    ``auto``: factors in the parameters' dtype (float32 under mixed precision, whose activations are
    cast up), inverses in the factors' and at least float32 (half-precision Cholesky is not offered).
    """
    factor = parameters if cfg.factor_dtype == "auto" else getattr(torch, cfg.factor_dtype)
    if cfg.inverse_dtype == "auto":
        return factor, torch.promote_types(factor, torch.float32)
    return factor, getattr(torch, cfg.inverse_dtype)


class FactorState:
    """The factors' running averages and inverses on this rank, and how arrived factors join them.

    The slots and the factors this rank keeps (:attr:`held`) are the plan's: the plan's life sets
    them at each plan (:class:`~kfacflow.kfac.plan_life.PlanLife`). The factor exchange
    (:mod:`kfacflow.kfac.strategies.factor_exchange`) says how an arrived factor is blended, and holds this
    rank's sums between exchanges.

    Args:
        engine: The communication engine and the step's timer.
        schedule: The step counter (for the reports of non-finite factors) and the damping.
        dtypes: The factors' dtype and the inverses' (:func:`dtypes`).
        method: The inverse method (stage *invert*).
        decay: The running averages' ``kfac.factor_decay`` (read at each use).
    """

    def __init__(
        self,
        engine: Engine,
        schedule: Schedule,
        dtypes: tuple[torch.dtype, torch.dtype],
        method: InverseMethod,
        decay: Callable[[], float],
    ) -> None:
        self.engine, self.schedule, self.decay = engine, schedule, decay
        self.factor_dtype, self.inverse_dtype = dtypes
        self.method = method
        """The inverse method of the stages now run (reconfigured stages bring theirs)."""
        self.running: dict[str, Tensor] = {}
        """Running averages of the factors, packed (upper triangles): half the memory and work."""
        self.inverses: dict[str, Inverse] = {}
        self.held: set[str] | None = None
        """With ``kfac.factor_sync=owner``: the factors whose running averages this rank keeps."""
        self.finite = FiniteFlags()
        self.slots: list[FactorSlot] = []
        """The plan's slots, A1, G1, A2, G2, ..."""
        self.exchange: Exchange = AtUpdate(decay, schedule)
        """The factor exchange of the stages now run (``kfac.factor_exchange``), chosen by :meth:`route`."""
        self.comm: Communicator | None = None
        """Where the step's factors are summed (whether each rank had a factor: :meth:`average`)."""

    @property
    def keys(self) -> list[str]:
        """The factors' keys, in the plan's order."""
        return [slot.key for slot in self.slots]

    @property
    def result(self) -> type[Inverse]:
        """The inverses' type (the inverse method's)."""
        return self.method.result

    def route(self, kind: str, capture: Capture, comm: Communicator, started: set[str] | None = None) -> None:
        """Exchange the capture's factors through ``comm`` as ``kind`` says (``kfac.factor_exchange``).

        ``started``: the factors that have a running average. A new communicator, or a new plan whose
        owners keep other averages, starts the exchange again: every rank took every average first.

        Raises:
            RuntimeError: If sums are still held (:meth:`settle` first).
        """
        if self.exchange.holding:
            raise RuntimeError("K-FAC: local factor sums replaced before they were exchanged (settle() first)")
        self.comm = comm
        self.exchange = exchange_for(kind, self.decay, comm.push, self.schedule, started, self.engine.timer)
        self.exchange.route(capture)

    def sends(self) -> bool:
        """Whether this step sums factors over ranks after its backward pass."""
        return self.exchange.sends()

    def average(self, averaged: dict[str, Tensor]) -> list[str]:
        """Blend arrived factors into their running averages (those this rank keeps); return their keys.

        A layer that did not run this step has no factor here (its average stays). A non-finite
        factor is left out, decided on the device and reported after the step (:mod:`~kfacflow.kfac.finite`).
        """
        assert self.comm is not None
        timer = self.engine.timer
        with torch.no_grad(), timer.span("FactorComp", f"average {len(averaged)} factors", "average"):
            for key in self.keys:
                if key in averaged and (self.held is None or key in self.held):
                    finite = self.finite.check(key, self.schedule.steps, averaged[key], self.comm.present.get(key))
                    self.exchange.blend(self.running, key, averaged[key], finite)
        return list(averaged)

    def settle(self) -> None:
        """Exchange the factor sums ranks hold since the last exchange now (collective; between steps).

        Only with ``kfac.factor_exchange=inversion``; afterwards the running averages are what
        ``update`` would have made by this step. Every rank holds the same keys, so every rank takes
        the same branch.
        """
        if not self.exchange.holding:
            return
        items = self.exchange.held(self.keys)
        self.exchange.opening(self.engine.backend, True)
        self.average(FusedSum(self.engine.backend, items, self.engine.timer).wait())
        self.finite.copy()
        self.exchange.closing(True)

    def invert(self, batch: list[FactorSlot]) -> None:
        """Invert the factors of ``batch`` this rank inverts (it owns them, or every rank does)."""
        mine = [slot for slot in batch if slot.owner in (EVERY_RANK, self.engine.backend.rank)]
        if not mine:
            return
        with torch.no_grad(), self.engine.timer.span("InverseComp", mine[0].key if len(mine) == 1 else None, "inverse"):
            factors = [unpack(self.running[slot.key], slot.dim).to(self.inverse_dtype) for slot in mine]
            inverses = [self.to_apply(inverse) for inverse in invert_all(self.method, factors, self.schedule.damping)]
        self.inverses.update({slot.key: inverse for slot, inverse in zip(mine, inverses, strict=True)})

    def to_apply(self, inverse: Inverse) -> Inverse:
        """``inverse`` made ready for the steps of one inversion period (:meth:`Inverse.for_uses`).

        Every inverse this rank applies passes here, made, received or restored, so that each is applied alike.
        """
        return inverse.for_uses(self.schedule.inverse_every)

    def invert_given(self) -> None:
        """Invert the factors a plan made again gives this rank to invert, where it has their average but no inverse.

        The first step's plan is made again once the layers in use and those that go by rows are known
        (their rows weigh whole layers: :func:`~kfacflow.kfac.stages.update_plan.layer_work`), after that step
        inverted by the first plan; every factor of it was averaged on every rank, so each rank can invert
        what it now owns. Before anything was inverted there is nothing to catch up.
        """
        if not self.inverses:
            return
        rank = self.engine.backend.rank
        given = [s for s in self.slots if s.owner in (EVERY_RANK, rank) and s.key not in self.inverses]
        self.invert([s for s in given if s.key in self.running])

    def keep_held(self) -> None:
        """Drop the running averages another rank keeps (``kfac.factor_sync=owner``)."""
        if self.held is not None:
            self.running = {key: avg for key, avg in self.running.items() if key in self.held}

    def factors(self) -> dict[str, Tensor]:
        """The running averages as full symmetric matrices (for inspection; the step keeps them packed).

        With ``kfac.factor_sync=owner``, this rank's only (a checkpoint has every one); with
        ``kfac.factor_exchange=inversion``, as of the last exchange (:meth:`settle`).
        """
        dims = {slot.key: slot.dim for slot in self.slots}
        return {k: unpack(v, dims[k]) for k, v in self.running.items()}

    def restore(self, state: dict[str, Any], holds: Callable[[str], bool], kind: str, capture: Capture) -> None:
        """Take a checkpoint's running averages and the inverses this rank ``holds``, and exchange as ``kind`` says.

        Onto this run's device and dtypes (:func:`~kfacflow.kfac.checkpoint.restored`). The sums held
        since the last exchange are superseded: the exchange starts again from the checkpoint's factors.
        """
        dtypes = (self.factor_dtype, self.inverse_dtype)
        self.running, inverses = restored(state, self.engine.backend.device, dtypes, holds)
        self.inverses = {key: self.to_apply(inverse) for key, inverse in inverses.items()}
        self.keep_held()
        assert self.comm is not None
        self.exchange = AtUpdate(self.decay, self.schedule)  # nothing held survives the checkpoint's averages
        self.route(kind, capture, self.comm, set(state["factors"]))
