"""Horovod backend, the paper's engine: async all-reduce and broadcast, gradients by DistributedOptimizer.

Imported only when a recipe chooses ``dist.backend=horovod``. Horovod 0.28.1 (its last release)
does not build against torch 2.14 as published; ``tools/install_horovod.sh`` builds it.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import Tensor, nn

from kfacflow import UserError
from kfacflow.comm.base import Backend, Done, Handle
from kfacflow.comm.torch_dist import pick_device
from kfacflow.configuration.schema import DistConfig
from kfacflow.registry import BACKENDS

logger = logging.getLogger(__name__)

INSTALL_HINT = "install it with `bash tools/install_horovod.sh` (builds horovod 0.28.1 for this torch)"


def _import_horovod() -> Any:
    try:
        import horovod.torch as hvd
    except ImportError as err:
        raise UserError(f"dist.backend=horovod: Horovod is not installed ({err}); {INSTALL_HINT}.") from None
    return hvd


class HorovodHandle:
    """A Horovod async operation: ``wait`` is ``hvd.synchronize``."""

    def __init__(self, hvd: Any, handle: Any) -> None:
        self.hvd, self.handle = hvd, handle

    def wait(self) -> Any:
        """Block until done."""
        return self.hvd.synchronize(self.handle)


class HorovodBackend(Backend):
    """Joins the job ``horovodrun`` (or ``mpirun``) started.

    Factor all-reduces and inverse broadcasts use ``hvd.allreduce_async_`` /
    ``hvd.broadcast_async_`` with names that every rank generates in the same order.
    Gradients are averaged by ``hvd.DistributedOptimizer`` while backward runs; the trainer
    waits for them (``finish_gradients``) before K-FAC reads them, then steps without a
    second synchronization. Parameters and optimizer state start from rank 0's.

    Args:
        cfg: The ``dist`` section of the recipe.
    """

    def __init__(self, cfg: DistConfig) -> None:
        hvd = _import_horovod()
        if not hvd.is_initialized():  # the library API joins the job the user started
            hvd.init()
        self.hvd = hvd
        self.rank, self.world_size = hvd.rank(), hvd.size()
        self.local_rank, self.local_world_size = hvd.local_rank(), hvd.local_size()
        self.device = pick_device(cfg.device, self.local_rank)
        self._count = 0

    def _name(self, kind: str) -> str:
        self._count += 1
        return f"kfacflow.{kind}.{self._count}"

    def allreduce_async(self, tensor: Tensor) -> Handle:
        """Sum in place; returns at once."""
        if self.world_size == 1:
            return Done()
        handle = self.hvd.allreduce_async_(tensor, op=self.hvd.Sum, name=self._name("allreduce"))
        return HorovodHandle(self.hvd, handle)

    def broadcast_async(self, tensor: Tensor, src: int) -> Handle:
        """Broadcast in place from rank ``src``; returns at once."""
        if self.world_size == 1:
            return Done()
        handle = self.hvd.broadcast_async_(tensor, root_rank=src, name=self._name("broadcast"))
        return HorovodHandle(self.hvd, handle)

    def wrap_model(self, model: nn.Module) -> nn.Module:
        """Start every rank from rank 0's parameters and buffers (the model itself is not wrapped)."""
        self.hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        return model

    def wrap_optimizer(
        self, optimizer: torch.optim.Optimizer, model: nn.Module, accumulate: int = 1
    ) -> torch.optim.Optimizer:
        """Return Horovod's DistributedOptimizer (gradients averaged during the step's last backward)."""
        if optimizer.state:
            # Horovod initialises empty state with a zero-gradient step, which applies weight decay
            # once; empty state is the same on every rank anyway, so it is broadcast only when set.
            self.hvd.broadcast_optimizer_state(optimizer, root_rank=0)
        wrapped: torch.optim.Optimizer = self.hvd.DistributedOptimizer(
            optimizer,
            named_parameters=model.named_parameters(),
            op=self.hvd.Average,
            backward_passes_per_step=accumulate,
        )
        return wrapped

    def finish_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        """Wait for the gradient all-reduces Horovod launched during backward."""
        optimizer.synchronize()  # type: ignore[attr-defined]

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Step without synchronizing again (:meth:`finish_gradients` did)."""
        with optimizer.skip_synchronize():  # type: ignore[attr-defined]
            optimizer.step()

    def allreduce_sum(self, tensor: Tensor) -> Tensor:
        """Blocking sum."""
        if self.world_size == 1:
            return tensor.clone()
        out: Tensor = self.hvd.allreduce(tensor.to(self.device), op=self.hvd.Sum, name=self._name("sum"))
        return out.to(tensor.device)

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Broadcast a picklable object."""
        return self.hvd.broadcast_object(obj, root_rank=src, name=self._name("object")) if self.world_size > 1 else obj

    def gather_objects(self, obj: Any) -> list[Any]:
        """All-gather picklable objects."""
        if self.world_size == 1:
            return [obj]
        return list(self.hvd.allgather_object(obj, name=self._name("gather")))

    def barrier(self) -> None:
        """Wait for every rank."""
        if self.world_size > 1:
            self.hvd.allreduce(torch.zeros(1), name=self._name("barrier"))

    def close(self) -> None:
        """Shut Horovod down."""
        self.hvd.shutdown()


BACKENDS.add("horovod", HorovodBackend, "Horovod (horovodrun): async all-reduce/broadcast, DistributedOptimizer")
