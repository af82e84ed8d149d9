"""Stage *communicate* at run time: factors summed over ranks as the fusion policy groups them.

:class:`Communicator` runs a :class:`~kfacflow.kfac.stages.fusion.Grouper` on the backend during
training: each group one :class:`FusedSum` (an all-reduce, a reduction to an owner, or pieces to
several owners, as the :class:`~kfacflow.kfac.stages.fusion.Routing` of the step's plan says).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Iterator, Sequence

import torch
from torch import Tensor

from kfacflow.comm.base import Backend, Handle
from kfacflow.kfac.stages.contracts import Absent, FusionPolicy, Waiting, side_of
from kfacflow.kfac.stages.fusion import SCATTER, Grouper, Routing
from kfacflow.timing import UNTIL, StepTimer

logger = logging.getLogger(__name__)


class FusedSum:
    """One asynchronous sum over ranks of several packed factors copied into one buffer.

    With several ranks every rank also says, per factor, whether it has one (1) or sent zeros for a
    layer that did not run on it (0; :class:`~kfacflow.kfac.hooks.handover.Absent`), in one element per
    factor at the end of the buffer (of each owner's part, to owners). The averages follow what one
    process would compute on every rank's examples: an A factor (the mean over a layer's inputs) is
    the mean over the ranks that ran the layer; a G factor (a sum over the batch's examples, of which
    those that never reached the layer add nothing) is the sum over ranks divided by every rank. A
    factor no rank has is all NaN: left out of its running average, as a non-finite one is, with no
    read of the device (:attr:`present` tells the two apart).

    Args:
        backend: Where it runs (its K-FAC group).
        items: ``(key, packed factor)`` pairs; all of one dtype and device.
        timer: Records the transfer from launch to completion when tracing.
        dst: The one rank that needs the sum (a reduction), ``None`` for every rank (an all-reduce),
            or :data:`SCATTER`: each factor to its owner (``owners``; ``items`` in rank order).
        owners: With :data:`SCATTER`, the owner of each item.
        absent: The keys of ``items`` this rank has no factor of (it sends zeros).
    """

    def __init__(
        self,
        backend: Backend,
        items: list[tuple[str, Tensor]],
        timer: StepTimer | None = None,
        dst: int | None = None,
        owners: Sequence[int] = (),
        absent: Collection[str] = (),
    ) -> None:
        self.world_size = backend.world_size
        self.keys = [k for k, _ in items]
        self.sizes = [t.numel() for _, t in items]
        self.counted = backend.world_size > 1
        """Whether every factor travels with its count of ranks that have it (several ranks)."""
        self.present: dict[str, Tensor] = {}
        """After :meth:`wait`: per factor, whether any rank had it (on the device)."""
        segments = [list(range(len(items)))]
        if dst == SCATTER:
            segments = [[i for i, o in enumerate(owners) if o == r] for r in range(self.world_size)]
        parts: list[Tensor] = []
        for segment in segments:  # each owner's factors, then their counts
            parts += [items[i][1].reshape(-1) for i in segment]
            if self.counted and segment:
                parts.append(self._flags([items[i] for i in segment], set(absent)))
        self.buffer = torch.cat(parts) if len(parts) > 1 else parts[0]
        self.mine = dst is None or dst == backend.rank
        self.handle: Handle
        if dst == SCATTER:
            counts = [sum(self.sizes[i] for i in seg) + (len(seg) if self.counted else 0) for seg in segments]
            self.handle = backend.reduce_to_owners_async(self.buffer.view(-1), counts)
            self.keys = [self.keys[i] for i in segments[backend.rank]]
            self.sizes = [self.sizes[i] for i in segments[backend.rank]]
            self.mine = bool(self.keys)
        elif dst is None:
            self.handle = backend.allreduce_async(self.buffer)
        else:
            self.handle = backend.reduce_async(self.buffer, dst)
        self.scattered = dst == SCATTER
        self.timer, self.t0 = timer, time.perf_counter()
        self.name = f"{items[0][0]} +{len(items) - 1}" if len(items) > 1 else items[0][0]
        if dst is not None:
            self.name += " to owners" if dst == SCATTER else f" to {dst}"
        if timer is not None and timer.on_done(self.handle, self.name, "allreduce"):
            self.timer = None

    @staticmethod
    def _flags(items: list[tuple[str, Tensor]], absent: set[str]) -> Tensor:
        """1 per factor this rank has, 0 per factor it sends zeros for (made on the device: no copy from the host)."""
        flags = torch.ones(len(items), dtype=items[0][1].dtype, device=items[0][1].device)
        for i, (key, _) in enumerate(items):
            if key in absent:
                flags[i] = 0.0
        return flags

    def wait(self) -> dict[str, Tensor]:
        """Block until done; return the averaged factors by key (none on a rank a reduction is not for)."""
        result = self.handle.wait()
        if self.timer is not None and self.timer.tracing:  # no future to say when it ended: until taken
            self.timer.record(f"{self.name} {UNTIL}", "allreduce", self.t0, time.perf_counter())
        if not self.mine:
            return {}
        data = result if self.scattered else self.buffer
        if not self.counted:
            return dict(zip(self.keys, (data / self.world_size).split(self.sizes), strict=True))
        n = len(self.keys)
        values, counts = data[:-n].split(self.sizes), data[-n:]
        by_example = (counts > 0).to(counts.dtype) * self.world_size  # G: 0 where no rank had it, so 0 / 0
        out = {}
        for i, (key, value) in enumerate(zip(self.keys, values, strict=True)):
            out[key] = value / (counts[i] if side_of(key) == "A" else by_example[i])
            self.present[key] = counts[i] > 0
        return out


class Communicator:
    """Receives packed factors as layers produce them and returns them averaged over ranks.

    The calls each factor-update step: :meth:`push` (A factors, in the forward pass),
    :meth:`end_forward`, :meth:`push` (G factors, in the backward pass), :meth:`end_backward`,
    :meth:`wait`. The policy decides when to launch and what to fuse; for a policy that
    measures, the ready times of its first steps (after one warm-up step) are averaged over
    ranks, so that every rank plans from the same numbers.

    Args:
        backend: The communication engine.
        policy: The fusion policy.
        timer: Records each all-reduce from launch to completion when tracing.
    """

    def __init__(self, backend: Backend, policy: FusionPolicy, timer: StepTimer | None = None) -> None:
        self.backend, self.policy, self.timer = backend, policy, timer
        self.grouper = Grouper(policy)
        self.pending: dict[str, Tensor] = {}
        self.inflight: list[FusedSum] = []
        self.routing: Routing | None = None
        """With ``kfac.factor_sync=owner``: where each factor is reduced."""
        self.absent: set[str] = set()
        """The keys of this step's factors this rank has none of (it sends zeros)."""
        self.present: dict[str, Tensor] = {}
        """Per factor of the last step, whether any rank had it (on the device: :attr:`FusedSum.present`)."""
        self.launches = 0
        """Groups launched so far (for tests and logs)."""
        self.reductions = 0
        """Reductions to one owner launched so far (``kfac.factor_sync=owner``; for tests and logs)."""
        self.scattered = 0
        """Reductions to several owners at once launched so far (:data:`SCATTER`; for tests and logs)."""
        self.groups: list[list[tuple[str, int]]] = []
        """The groups of the last complete step, in launch order: ``(key, elements)``."""
        self._groups: list[list[tuple[str, int]]] = []
        self._backward = False
        self._fresh = True
        self._t0 = 0.0
        self._measured = 0
        self._order: list[list[tuple[str, int]]] = [[], []]
        self._ready: dict[str, list[float]] = {}

    @property
    def plan(self) -> list[list[str]] | None:
        """The policy's planned groups, if it plans."""
        return self.policy.plan

    def push(self, key: str, packed: Tensor | Absent) -> None:
        """Take one local packed factor (or the mark of one this rank lacks); launch what the policy says.

        Timed as ``FactorComm``.
        """
        if isinstance(packed, Absent):
            self.absent.add(key)
            packed = packed.zeros()
        if self.timer is None:
            self._push(key, packed)
            return
        with self.timer.span("FactorComm"):
            self._push(key, packed)

    def _push(self, key: str, packed: Tensor) -> None:
        if packed.is_cuda and self._measuring:  # a ready time is when the factor is computed, not queued
            torch.cuda.synchronize(packed.device)
        now = time.perf_counter()
        if self._fresh:
            self._t0, self._fresh = now, False  # the first factor of a step starts the forward clock
        self._note(key, packed.numel(), now - self._t0)
        self.pending[key] = packed
        self._launch(self.grouper.add(Waiting(key, packed.numel(), packed.numel() * packed.element_size())))

    def end_forward(self) -> None:
        """The forward pass has produced every A factor; the G clock starts."""
        self._launch(self.grouper.end_forward())
        self._backward, self._t0 = True, time.perf_counter()

    def end_backward(self) -> None:
        """The backward pass has produced every G factor."""
        self._launch(self.grouper.end_backward())

    def wait(self) -> dict[str, Tensor]:
        """Launch what is still pending, wait for all, return the averaged factors by key."""
        out: dict[str, Tensor] = {}
        for averaged in self.arrivals():
            out.update(averaged)
        return out

    def arrivals(self) -> Iterator[dict[str, Tensor]]:
        """Launch what is still pending; yield each all-reduce's averaged factors as it completes, in launch order.

        Iterate to the end: the step's bookkeeping (a measuring policy's plan) runs after the last.
        """
        self._launch(self.grouper.end_backward())
        inflight, self.inflight = self.inflight, []
        self.present = {}
        for op in inflight:
            averaged = op.wait()
            self.present.update(op.present)
            yield averaged
        self._backward, self._fresh, self.absent = False, True, set()
        self.groups, self._groups = self._groups, []
        self._after_step()

    def _launch(self, keys: list[str] | None) -> None:
        if keys:
            items = [(k, self.pending.pop(k)) for k in keys]
            self._groups.append([(k, t.numel()) for k, t in items])
            if self.routing is None or self.backend.world_size == 1:
                self.inflight.append(FusedSum(self.backend, items, self.timer, absent=self.absent))
            else:
                tensors = dict(items)
                for dst, part in self.routing.parts(keys, {k: t.numel() for k, t in items}):
                    owners = [self.routing.owners[k] for k in part] if dst == SCATTER else ()
                    part_items = [(k, tensors[k]) for k in part]
                    self.inflight.append(FusedSum(self.backend, part_items, self.timer, dst, owners, self.absent))
                    self.reductions += dst is not None and dst != SCATTER
                    self.scattered += dst == SCATTER
            self.launches += 1

    @property
    def _measuring(self) -> bool:
        """Whether this step's ready times are noted (a policy that plans from them, before its plan)."""
        return bool(self.policy.measure_steps) and self.policy.plan is None

    def _note(self, key: str, elements: int, seconds: float) -> None:
        if not self._measuring:
            return
        if self._measured == 0:  # the first step orders the keys; its times include warm-up
            self._order[int(self._backward)].append((key, elements))
        else:
            self._ready.setdefault(key, []).append(seconds)

    def _after_step(self) -> None:
        if not self.policy.measure_steps or self.policy.plan is not None:
            return
        self._measured += 1
        if self._measured <= self.policy.measure_steps:
            return
        keys = [k for order in self._order for k, _ in order]
        means = torch.tensor([sum(self._ready[k]) / len(self._ready[k]) for k in keys], dtype=torch.float64)
        means = self.backend.allreduce_sum(means) / self.backend.world_size
        ready = dict(zip(keys, means.tolist(), strict=True))
        self.policy.learn([[(k, ready[k], m) for k, m in order] for order in self._order])
