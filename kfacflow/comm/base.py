"""The small interface every communication engine implements for the trainer and K-FAC."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Protocol

import torch
from torch import Tensor, nn


class Handle(Protocol):
    """An asynchronous operation in flight."""

    def wait(self) -> Any:
        """Block until the operation has finished."""


class Done:
    """A handle of an operation that finished when it was launched (one worker)."""

    def wait(self) -> None:
        """Return at once."""


class Piece:
    """A collective in flight whose ``wait()`` returns a tensor it fills (or part of it)."""

    def __init__(self, handle: Handle, result: Tensor) -> None:
        self.handle, self.result = handle, result

    def wait(self) -> Tensor:
        """Block until done; return the result."""
        self.handle.wait()
        return self.result

    def __getattr__(self, name: str) -> Any:
        if name == "get_future":  # a trace times the collective where the engine gives a future
            return self.__dict__["handle"].get_future
        raise AttributeError(name)


class Backend(ABC):
    """Rank, world size, device and the collectives K-FAC and the trainer use.

    K-FAC traffic (factor all-reduces, inverse broadcasts) goes through the ``*_async``
    methods on a process group of its own, so it never queues behind gradient all-reduces.
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    device: torch.device = torch.device("cpu")
    reduces: bool = False
    """Whether :meth:`reduce_async` sums into one rank alone (else it all-reduces: routing gains nothing)."""
    scatters: bool = False
    """Whether :meth:`reduce_to_owners_async` moves each rank's piece alone, with about half an
    all-reduce's traffic (else it all-reduces the buffer: reducing to several owners gains nothing)."""
    gathers: bool = False
    """Whether :meth:`gather_async` moves each rank's piece alone, likewise (else a zero-filled all-reduce)."""
    direct: bool = False
    """Whether :meth:`reduce_to_owners_async` sends each piece straight to its owner, point to point: each rank
    sends what it does not own and each owner receives P - 1 copies of its piece (half an all-reduce's
    traffic at P = 2, where a reduce-scatter and an all-to-all move no less; gloo), and whether :meth:`send_async`
    and :meth:`recv_async` move tensors point to point (with the tags of :meth:`reserve`)."""
    last_grad_launch: Any = 0.0
    """When the last gradient all-reduce of this step was launched: a :attr:`clock` reading."""
    clock: Callable[[], Any] = staticmethod(time.perf_counter)
    """What :attr:`last_grad_launch` is read from (the trainer's :meth:`~kfacflow.timing.StepTimer.mark`)."""

    @abstractmethod
    def allreduce_async(self, tensor: Tensor) -> Handle:
        """Sum ``tensor`` in place over all ranks (K-FAC group); the caller averages."""

    @abstractmethod
    def broadcast_async(self, tensor: Tensor, src: int) -> Handle:
        """Overwrite ``tensor`` in place with rank ``src``'s (K-FAC group)."""

    def reduce_async(self, tensor: Tensor, dst: int) -> Handle:
        """Sum ``tensor`` over all ranks into rank ``dst``'s copy (K-FAC group); the others' copies are undefined.

        By default an all-reduce (the sum lands on every rank; engines with a reduce override this).
        """
        return self.allreduce_async(tensor)

    def reduce_to_owners_async(self, flat: Tensor, counts: Sequence[int]) -> Handle:
        """Sum ``flat`` over ranks; each rank's ``wait()`` returns its own piece of the sum (K-FAC group).

        ``flat`` holds ``counts[r]`` elements for rank ``r``, in rank order. By default an
        all-reduce of the whole buffer (engines that move pieces alone override this).
        """
        start = sum(counts[: self.rank])
        return Piece(self.allreduce_async(flat), flat[start : start + counts[self.rank]])

    def gather_async(self, piece: Tensor, counts: Sequence[int]) -> Handle:
        """Every rank's piece (``counts[r]`` elements of rank ``r``), in rank order, on every rank (K-FAC group).

        ``wait()`` returns the whole buffer, each piece its owner's bits. By default an all-reduce
        of a zero-filled buffer into which each rank wrote its piece (``x + 0 == x`` exactly).
        """
        flat = piece.new_zeros(sum(counts))
        start = sum(counts[: self.rank])
        flat[start : start + counts[self.rank]].copy_(piece)
        return Piece(self.allreduce_async(flat), flat)

    def reserve(self, tensor: Tensor) -> int:
        """The tags of one point-to-point transfer of ``tensor``, reserved on every rank in turn (:attr:`direct`)."""
        raise NotImplementedError(f"{type(self).__name__} sends nothing point to point")

    def send_async(self, tensor: Tensor, dst: int, tag: int) -> Handle:
        """Send ``tensor`` to rank ``dst`` with the tags :meth:`reserve` gave (K-FAC group; :attr:`direct`)."""
        raise NotImplementedError(f"{type(self).__name__} sends nothing point to point")

    def recv_async(self, tensor: Tensor, src: int, tag: int) -> Handle:
        """Receive into ``tensor`` what rank ``src`` sent with ``tag`` (K-FAC group; :attr:`direct`)."""
        raise NotImplementedError(f"{type(self).__name__} sends nothing point to point")

    def broadcast_state(self, tensors: Sequence[Tensor]) -> None:
        """Overwrite ``tensors`` on every rank with rank 0's bits: one blocking broadcast per device.

        Their bytes travel end to end whatever their dtypes (float statistics, integer counters),
        so a model's buffers take one collective, as in DDP's coalesced broadcast.
        """
        if self.world_size == 1:
            return
        by_device: dict[torch.device, list[Tensor]] = {}
        for tensor in tensors:
            by_device.setdefault(tensor.device, []).append(tensor)
        for group in by_device.values():
            # Widest elements first: each piece then starts at a multiple of its element size, as a view needs.
            group.sort(key=lambda t: -t.element_size())
            flat = torch.cat([t.detach().reshape(-1).view(torch.uint8) for t in group])
            self._broadcast_from_rank0(flat)
            offset = 0
            with torch.no_grad():
                for tensor in group:
                    nbytes = tensor.numel() * tensor.element_size()
                    tensor.copy_(flat[offset : offset + nbytes].view(tensor.dtype).view(tensor.shape))
                    offset += nbytes

    def _broadcast_from_rank0(self, flat: Tensor) -> None:
        """Overwrite ``flat`` with rank 0's, blocking (K-FAC's group, unless the engine has a better one)."""
        self.broadcast_async(flat, 0).wait()

    def sync_buffers(self, model: nn.Module) -> None:
        """Give every rank rank 0's buffers (BatchNorm's running statistics): DDP's semantics, after every step.

        DDP broadcasts them only at a forward pass that follows a backward pass it averaged, and
        Horovod and a plain model in the library API never do: where kfacflow averages the gradients
        after a backward pass run under ``no_sync``, each rank's statistics would drift apart on
        their own data, and each rank would evaluate (and the checkpoint hold) another model.
        """
        self.broadcast_state(list(model.buffers()))

    @abstractmethod
    def wrap_model(self, model: nn.Module) -> nn.Module:
        """Return ``model`` set up so that ``backward()`` leaves gradients averaged over ranks."""

    def wrap_optimizer(
        self, optimizer: torch.optim.Optimizer, model: nn.Module, accumulate: int = 1
    ) -> torch.optim.Optimizer:
        """Return the optimizer to train with (engines that average gradients in the optimizer wrap it).

        ``accumulate`` backward passes make one step; their gradients are averaged over ranks once.
        """
        return optimizer

    def no_sync(self, net: nn.Module) -> AbstractContextManager[Any]:
        """Return a context in which a backward pass only accumulates gradients (not the step's last)."""
        return nullcontext()

    def finish_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        """Block until this step's gradients are averaged over ranks (before K-FAC reads them)."""
        return None  # DDP's backward pass itself waits for its all-reduces

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Apply the (preconditioned) gradients."""
        optimizer.step()

    @abstractmethod
    def allreduce_sum(self, tensor: Tensor) -> Tensor:
        """Return the sum of ``tensor`` over ranks (blocking; metrics)."""

    @abstractmethod
    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Return rank ``src``'s picklable ``obj`` on every rank."""

    @abstractmethod
    def gather_objects(self, obj: Any) -> list[Any]:
        """Return every rank's picklable ``obj``, indexed by rank, on every rank."""

    @abstractmethod
    def barrier(self) -> None:
        """Wait for every rank."""

    def await_rank0(self) -> None:
        """Wait for every rank, however long rank 0 takes to get here (it writes a checkpoint; storage may be slow).

        No collective's timeout applies (where the engine has one). By default :meth:`barrier`.
        """
        self.barrier()

    @abstractmethod
    def close(self) -> None:
        """Release process groups."""
