"""Each layer's preconditioning seconds as the ranks measured them, to place whole layers by (``kfac.placement_steps``).

Where whole layers go to owners by their work (``kfac.placement=layer`` with a broadcast of updates, at
``kfac.inv_update_freq`` over 1) the placement weighs each layer's preconditioning by an estimate from its
shape (:func:`~kfacflow.kfac.stages.update_plan.precondition_cost`, within about 2x of traced times). Between
inversions that work is most of what a rank does beyond its forward and backward passes, so an owner
whose layers cost more than estimated keeps the other ranks waiting for its updates every step.
:class:`LayerTimes` times each layer's preconditioning on the ranks that do it for a few steps, and every
rank takes the same means (one all-reduce), so every rank places the layers again alike.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from kfacflow.comm.base import Backend
from kfacflow.kfac.stages.update_plan import LayerWork

if TYPE_CHECKING:
    from kfacflow.kfac.layers import KFACLayer

GAIN = 0.01
"""The least share of an inverse period a new placement must save to be taken: moving layers costs one exchange
of every running average, and a layer's time varies by more than that from step to step."""


def worth_moving(work: LayerWork, before: Sequence[int], after: Sequence[int], world: int) -> tuple[float, float, bool]:
    """An inverse period's seconds with each layer's owner ``before`` and ``after``, and whether to move.

    Only where ``after`` saves :data:`GAIN` of the period or more
    (:meth:`~kfacflow.kfac.stages.update_plan.LayerWork.period`).
    """
    old, new = (work.period(*work.loads(owners, world)) for owners in (before, after))
    return old, new, list(before) != list(after) and new <= old * (1 - GAIN)


class LayerTimes:
    """Times each layer's preconditioning over ``steps`` steps after a first one (its allocations, its first plan).

    Args:
        steps: Steps to time (0: none).
        device: The training device (on CUDA each layer is timed by events on the current stream, resolved
            once, when the means are taken: no synchronisation a layer).
    """

    def __init__(self, steps: int, device: torch.device) -> None:
        self.steps = steps
        self.cuda = device.type == "cuda"
        self.seen = 0
        """Steps ended since the preconditioner started (or was restored)."""
        self._host: dict[str, list[float]] = {}
        self._events: list[tuple[str, Any, Any]] = []
        self.means: dict[str, float] | None = None
        """Each layer's mean seconds over the ranks, once taken (:meth:`end_step`)."""

    @property
    def measuring(self) -> bool:
        """Whether this step's layers are timed."""
        return 1 <= self.seen <= self.steps

    def start(self) -> Any:
        """A point in time for :meth:`note` (a recorded CUDA event, else the host clock)."""
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def note(self, name: str, start: Any) -> None:
        """Count the seconds since ``start`` to layer ``name``."""
        if self.cuda:
            self._events.append((name, start, self.start()))
        else:
            self._host.setdefault(name, []).append(time.perf_counter() - start)

    def end_step(self, backend: Backend, layers: Sequence[KFACLayer]) -> dict[str, float] | None:
        """End a step; after the last timed one, every layer's mean seconds over the ranks that timed it.

        Collective on that step (every rank ends the same steps). A layer no rank timed is left out.
        """
        self.seen += 1
        if self.seen != self.steps + 1 or self.steps == 0:
            return None
        names = [layer.name for layer in layers]
        if self._events:
            torch.cuda.synchronize()
            for name, start, stop in self._events:
                self._host.setdefault(name, []).append(start.elapsed_time(stop) / 1e3)
            self._events = []
        sums = [sum(self._host.get(name, [])) for name in names]
        counts = [float(len(self._host.get(name, []))) for name in names]
        self._host = {}
        both = backend.allreduce_sum(torch.tensor(sums + counts, dtype=torch.float64))
        n = len(names)
        self.means = {name: float(both[i] / both[n + i]) for i, name in enumerate(names) if both[n + i] > 0}
        return self.means
