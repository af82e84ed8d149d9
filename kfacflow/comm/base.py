"""The small interface every communication engine implements for the trainer and K-FAC."""

from __future__ import annotations

from abc import ABC, abstractmethod
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
    last_grad_launch: float = 0.0
    """``perf_counter`` time at which the last gradient all-reduce of this step was launched."""

    @abstractmethod
    def allreduce_async(self, tensor: Tensor) -> Handle:
        """Sum ``tensor`` in place over all ranks (K-FAC group); the caller averages."""

    @abstractmethod
    def broadcast_async(self, tensor: Tensor, src: int) -> Handle:
        """Overwrite ``tensor`` in place with rank ``src``'s (K-FAC group)."""

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

    @abstractmethod
    def close(self) -> None:
        """Release process groups."""
