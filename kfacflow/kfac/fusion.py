"""Stage *communicate*: when local factors are all-reduced, and how they are fused."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
from torch import Tensor

from kfacflow.dist.base import Backend, Handle
from kfacflow.kfac.fusion_plan import plan_groups
from kfacflow.perf import Profile
from kfacflow.registry import COMMUNICATORS
from kfacflow.timing import StepTimer

logger = logging.getLogger(__name__)


@dataclass
class CommOptions:
    """What the policies may need beyond the backend."""

    threshold_bytes: int = 64 * 2**20
    """Fusion buffer size of the ``threshold`` policy (Horovod's default, 64 MiB)."""
    profile: Profile | None = None
    """All-reduce model of the ``optimal`` policy."""
    profile_steps: int = 5
    """Factor-update steps the ``optimal`` policy measures before it fixes its plan."""
    timer: StepTimer | None = None
    """Records each all-reduce from launch to completion when tracing."""


class FusedAllreduce:
    """One asynchronous all-reduce of several packed factors copied into one buffer.

    Args:
        backend: Where the all-reduce runs (its K-FAC group).
        items: ``(key, packed factor)`` pairs; all of one dtype and device.
    """

    def __init__(self, backend: Backend, items: list[tuple[str, Tensor]], timer: StepTimer | None = None) -> None:
        self.world_size = backend.world_size
        self.keys = [k for k, _ in items]
        self.sizes = [t.numel() for _, t in items]
        self.buffer = torch.cat([t.reshape(-1) for _, t in items]) if len(items) > 1 else items[0][1]
        self.handle: Handle = backend.allreduce_async(self.buffer)
        if timer is not None:
            name = self.keys[0] if len(items) == 1 else f"{self.keys[0]} +{len(items) - 1}"
            timer.on_done(self.handle, name, "allreduce")

    def wait(self) -> dict[str, Tensor]:
        """Block until done; return the averaged factors by key."""
        self.handle.wait()
        avg = self.buffer / self.world_size
        return dict(zip(self.keys, avg.split(self.sizes), strict=True))


class Communicator:
    """Receives packed factors as layers produce them and returns them averaged over ranks.

    The preconditioner's calls each factor-update step are: ``push`` (A factors, in the
    forward pre-hooks), ``end_forward``, ``push`` (G factors, in the backward hooks),
    ``end_backward``, ``wait``. Policies differ only in when they launch all-reduces and
    what they fuse; this base class launches everything at ``wait``.

    Args:
        backend: The communication engine.
        options: Policy parameters.
    """

    def __init__(self, backend: Backend, options: CommOptions) -> None:
        self.backend = backend
        self.options = options
        self.pending: list[tuple[str, Tensor]] = []
        self.inflight: list[FusedAllreduce] = []
        self.launches = 0
        """All-reduces launched so far (for tests and logs)."""

    def push(self, key: str, packed: Tensor) -> None:
        """Take one local packed factor (``key`` ends in ``/A`` or ``/G``)."""
        self.pending.append((key, packed))

    def end_forward(self) -> None:
        """Called once the forward pass has produced every A factor."""

    def end_backward(self) -> None:
        """Called once the backward pass has produced every G factor."""

    def flush(self) -> None:
        """Launch one fused all-reduce of everything pending."""
        if self.pending:
            self.inflight.append(FusedAllreduce(self.backend, self.pending, self.options.timer))
            self.launches += 1
            self.pending = []

    def wait(self) -> dict[str, Tensor]:
        """Launch what is still pending, wait for all, return the averaged factors by key."""
        self.flush()
        out: dict[str, Tensor] = {}
        for op in self.inflight:
            out.update(op.wait())
        self.inflight = []
        return out


class AfterBackward(Communicator):
    """All factors in one all-reduce after the backward pass (D-KFAC; the paper's ref. [22])."""

    def end_backward(self) -> None:
        """Launch the single fused all-reduce."""
        self.flush()


class Naive(Communicator):
    """A factors fused after the forward pass (overlapping backward), G factors after backward (ref. [20])."""

    def end_forward(self) -> None:
        """Launch the A all-reduce."""
        self.flush()

    def end_backward(self) -> None:
        """Launch the G all-reduce."""
        self.flush()


class Layerwise(Naive):
    """Each factor all-reduced as soon as it is computed, no fusion ("LW w/o TF")."""

    def push(self, key: str, packed: Tensor) -> None:
        """Launch this factor's all-reduce at once."""
        super().push(key, packed)
        self.flush()


class Threshold(Naive):
    """Layer-wise, consecutive factors fused until the buffer reaches a byte threshold ("LW w/ TTF")."""

    def push(self, key: str, packed: Tensor) -> None:
        """Add to the buffer; launch it once it holds ``threshold_bytes``."""
        super().push(key, packed)
        if sum(t.numel() * t.element_size() for _, t in self.pending) >= self.options.threshold_bytes:
            self.flush()


class Optimal(Naive):
    """Layer-wise with the fusion of the paper's Eq. 15 (SP w/ OTF), planned from measured times.

    For the first ``profile_steps`` factor-update steps it all-reduces layer by layer and
    records when each factor became ready (relative to the first A of the forward pass, and to
    the end of the forward pass for G). The mean ready times are then averaged over ranks, so
    every rank computes the same plan from the same numbers (:func:`plan_groups`), separately
    for the A factors (forward) and the G factors (backward).
    """

    def __init__(self, backend: Backend, options: CommOptions) -> None:
        super().__init__(backend, options)
        self.t0 = 0.0
        self.fresh = True
        self.ready: dict[str, list[float]] = {}
        self.sizes: dict[str, int] = {}
        self.order: list[str] = []
        self.measured = 0
        self.group_of: dict[str, int] | None = None
        self.group_len: list[int] = []
        self.plan: list[list[str]] = []

    def push(self, key: str, packed: Tensor) -> None:
        """Record the ready time; launch when the planned group is complete."""
        now = time.perf_counter()
        if self.fresh:
            self.t0, self.fresh = now, False  # the first factor of a step starts the forward clock
        if self.group_of is None:
            if self.measured == 0:  # the first step orders the keys; its times include warm-up
                self.order.append(key)
                self.sizes[key] = packed.numel()
            else:
                self.ready.setdefault(key, []).append(now - self.t0)
            super().push(key, packed)
            self.flush()
            return
        super().push(key, packed)
        group = self.group_of.get(key)
        if group is None or sum(1 for k, _ in self.pending if self.group_of.get(k) == group) == self.group_len[group]:
            self.flush()

    def end_forward(self) -> None:
        """Launch any incomplete A group; the G clock starts here."""
        super().end_forward()
        self.t0 = time.perf_counter()

    def wait(self) -> dict[str, Tensor]:
        """Wait as usual; after the profiling steps, make the plan."""
        out = super().wait()
        self.fresh = True
        if self.group_of is None:
            self.measured += 1
            if self.measured > self.options.profile_steps:
                self._make_plan()
        return out

    def _make_plan(self) -> None:
        profile = self.options.profile
        assert profile is not None, "the optimal fusion needs an all-reduce model"
        means = torch.tensor([sum(self.ready[k]) / len(self.ready[k]) for k in self.order], dtype=torch.float64)
        means = self.backend.allreduce_sum(means) / self.backend.world_size
        ready = dict(zip(self.order, means.tolist(), strict=True))
        self.plan = []
        for kind in ("/A", "/G"):
            keys = [k for k in self.order if k.endswith(kind)]
            groups = plan_groups([ready[k] for k in keys], [self.sizes[k] for k in keys], profile.allreduce)
            self.plan += [[keys[i] for i in g] for g in groups]
        self.group_of = {k: g for g, keys in enumerate(self.plan) for k in keys}
        self.group_len = [len(keys) for keys in self.plan]
        n_a = sum(1 for g in self.plan if g[0].endswith("/A"))
        logger.info(
            "optimal fusion: %d A factors in %d all-reduces, %d G factors in %d",
            sum(len(g) for g in self.plan[:n_a]),
            n_a,
            sum(len(g) for g in self.plan[n_a:]),
            len(self.plan) - n_a,
        )


COMMUNICATORS.add("after_backward", AfterBackward, "all factors fused into one all-reduce after backward (D-KFAC)")
COMMUNICATORS.add("naive", Naive, "A factors all-reduced after forward, G factors after backward (Fig. 10 Naive)")
COMMUNICATORS.add("layerwise", Layerwise, "each factor all-reduced as soon as computed, no fusion (LW w/o TF)")
COMMUNICATORS.add("threshold", Threshold, "layer-wise, fused up to kfac.fusion_threshold_mb (LW w/ TTF)")
COMMUNICATORS.add("optimal", Optimal, "layer-wise, fused by the paper's Eq. 15 from measured times (SP w/ OTF)")
