"""Stage *communicate*: when local factors are all-reduced, and how they are fused."""

from __future__ import annotations

import torch
from torch import Tensor

from kfacflow.dist.base import Backend, Handle
from kfacflow.registry import COMMUNICATORS


class FusedAllreduce:
    """One asynchronous all-reduce of several packed factors copied into one buffer.

    Args:
        backend: Where the all-reduce runs (its K-FAC group).
        items: ``(key, packed factor)`` pairs; all of one dtype and device.
    """

    def __init__(self, backend: Backend, items: list[tuple[str, Tensor]]) -> None:
        self.world_size = backend.world_size
        self.keys = [k for k, _ in items]
        self.sizes = [t.numel() for _, t in items]
        self.buffer = torch.cat([t.reshape(-1) for _, t in items]) if len(items) > 1 else items[0][1]
        self.handle: Handle = backend.allreduce_async(self.buffer)

    def wait(self) -> dict[str, Tensor]:
        """Block until done; return the averaged factors by key."""
        self.handle.wait()
        avg = self.buffer / self.world_size
        return dict(zip(self.keys, avg.split(self.sizes), strict=True))


class Communicator:
    """Receives packed factors as layers produce them and returns them averaged over ranks.

    The trainer's order of calls each step is: ``push`` (A factors, forward), ``end_forward``,
    ``push`` (G factors, backward), ``end_backward``, ``wait``. Policies differ only in when
    they launch all-reduces and what they fuse.

    Args:
        backend: The communication engine.
    """

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.pending: list[tuple[str, Tensor]] = []
        self.inflight: list[FusedAllreduce] = []

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
            self.inflight.append(FusedAllreduce(self.backend, self.pending))
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


COMMUNICATORS.add("after_backward", AfterBackward, "all factors fused into one all-reduce after backward")
