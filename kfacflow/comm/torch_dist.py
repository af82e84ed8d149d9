"""torch.distributed backend: gloo on CPU, NCCL on CUDA, gradients averaged by DDP."""

from __future__ import annotations

import datetime
import logging
import os
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from kfacflow import UserError
from kfacflow.comm import scatter
from kfacflow.comm.base import Backend, Done, Handle
from kfacflow.comm.launchers import LOCAL_RANK_VARS, LOCAL_SIZE_VARS, from_env
from kfacflow.configuration.schema import DistConfig
from kfacflow.registry import BACKENDS

logger = logging.getLogger(__name__)


def wants_cuda(choice: str) -> bool:
    """Whether :func:`pick_device` picks a GPU for ``dist.device``."""
    return choice == "cuda" or (choice == "auto" and torch.cuda.is_available())


def pick_device(choice: str, local_rank: int) -> torch.device:
    """Return the device for this worker: CUDA ``local_rank`` when asked for or available, else CPU."""
    if wants_cuda(choice):
        index = local_rank % torch.cuda.device_count()  # more ranks than GPUs share them (gloo only)
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def local_rank(cfg: DistConfig, rank: int, world_size: int, joined: bool) -> int:
    """This worker's index among the workers of its machine: which GPU is its own.

    Read from the launcher's variables (:data:`~kfacflow.comm.launchers.LOCAL_RANK_VARS`); with none set,
    0 where that cannot be wrong (one worker, one per machine, or the CPU) and the current GPU
    where the process group is the user's own (who chose the device).

    Raises:
        UserError: Several workers on CUDA and nothing says which GPU is whose: every one would
            take GPU 0, which NCCL refuses ("Duplicate GPU") and which would crowd gloo.
    """
    local = from_env(LOCAL_RANK_VARS)
    if local is not None:
        return local
    if world_size == 1 or from_env(LOCAL_SIZE_VARS) == 1 or not wants_cuda(cfg.device):
        return 0
    if joined:
        return torch.cuda.current_device()
    raise UserError(
        f"rank {rank} of {world_size} on CUDA cannot tell which GPU is its own: none of {', '.join(LOCAL_RANK_VARS)} "
        "is set. Start the job with torchrun (it sets LOCAL_RANK), or export LOCAL_RANK as the worker's index on "
        "its machine in the launch script (e.g. LOCAL_RANK=$SLURM_LOCALID)."
    )


def init_options(engine: str, device: torch.device, timeout: datetime.timedelta) -> dict[str, Any]:
    """``init_process_group``'s arguments: NCCL is bound to this worker's GPU (its communicator is made there, now)."""
    options: dict[str, Any] = {"timeout": timeout}
    if engine == "nccl" and device.type == "cuda":
        options["device_id"] = device
    return options


WRITE_TIMEOUT_S = 3600
"""Seconds the other ranks wait for rank 0 to write a checkpoint (:meth:`TorchBackend.await_rank0`), at least."""


def engine_for(choice: str, device: torch.device) -> str:
    """torch.distributed's engine for ``dist.engine`` on ``device``: ``auto`` is NCCL on CUDA, gloo on CPU."""
    if choice != "auto":
        return choice
    return "nccl" if device.type == "cuda" else "gloo"


P2P_CHUNK_BYTES = 2 * 2**20
"""Chunks of a reduction sent point to point (gloo)."""


class SumOnWait:
    """Point-to-point transfers of a reduction; :meth:`wait` adds the received copies into the tensor.

    The receiver adds them in rank order, so the sum does not depend on which arrived first.
    Gloo's point-to-point work has no future, so a trace can only see when it was waited for.
    """

    def __init__(self, tensor: Tensor, moves: list[Handle], parts: list[Tensor]) -> None:
        self.tensor, self.moves, self.parts = tensor, moves, parts

    def wait(self) -> None:
        """Block until every chunk has moved; then sum (once)."""
        for move in self.moves:
            move.wait()
        for part in self.parts:
            self.tensor.add_(part)
        self.moves, self.parts = [], []


class Moved:
    """Transfers that end in one tensor: chunks sent or received point to point, or every owner's reduction.

    :meth:`wait` returns the tensor (the received one, or this rank's piece of the sum) once all have moved.
    """

    def __init__(self, tensor: Tensor, works: list[Any]) -> None:
        self.tensor, self.works = tensor, works

    def wait(self) -> Tensor:
        """Block until every transfer is done."""
        for work in self.works:
            work.wait()
        self.works = []
        return self.tensor


class TorchBackend(Backend):
    """Joins the job described by the launcher's environment (``RANK``, ``WORLD_SIZE``, ...).

    Args:
        cfg: The ``dist`` section of the recipe.
    """

    reduces = True
    in_order = False
    """Whether the K-FAC group runs its collectives one after the other in posting order on the device (NCCL's
    one stream a group): a collective that reads what the one before it writes is then posted without a wait."""

    def __init__(self, cfg: DistConfig) -> None:
        self.joined = dist.is_available() and dist.is_initialized()
        """Whether the default process group was there already (the library API: the user's own job)."""
        self.rank = dist.get_rank() if self.joined else int(os.environ.get("RANK", 0))
        self.world_size = dist.get_world_size() if self.joined else int(os.environ.get("WORLD_SIZE", 1))
        self.local_rank = local_rank(cfg, self.rank, self.world_size, self.joined)
        self.local_world_size = from_env(LOCAL_SIZE_VARS) or 1
        self.device = pick_device(cfg.device, self.local_rank)
        self.find_unused = cfg.find_unused_parameters
        self._group: Any = None
        self._objects: Any = None
        self._patient: Any = None
        self._engine = ""
        self._tag = 0
        if self.world_size > 1:
            engine = engine_for(cfg.engine, self.device)
            timeout = datetime.timedelta(seconds=cfg.timeout_s)
            if self.joined:
                engine = str(dist.get_backend())
            else:
                dist.init_process_group(engine, **init_options(engine, self.device, timeout))
            # K-FAC traffic gets its own communicator so it does not queue behind DDP's buckets.
            self._group = dist.new_group(backend=engine, timeout=timeout)
            self._engine = engine
            # Gloo's point-to-point sends take CPU tensors only: on CUDA, factors stay all-reduced.
            self.reduces = not (engine == "gloo" and self.device.type == "cuda")
            # Gloo's all-to-all takes CPU tensors only. Its reduce-scatter of uneven pieces took as long as
            # its all-reduce (3 nodes at 1 Gbit/s, 40 MB: 0.51 against 0.48 s; the two steps 0.57 s), so
            # reducing to several owners is NCCL's; gathering pays on both (0.29 s).
            self.gathers = self.reduces
            self.scatters = self.reduces and engine != "gloo"
            # Gloo's point-to-point sends move only what each owner lacks: 51 MB between two nodes at 1 Gbit/s,
            # each rank's half to the other in 0.21-0.23 s against 0.43 s for the all-reduce and 0.46 s for the
            # reduce-scatter (tools/bench_comm.py, 2026-12-03).
            self.direct = self.reduces and engine == "gloo"
            self.in_order = engine == "nccl"
            self._objects = dist.new_group(backend="gloo", timeout=timeout)
            # On the host, outside any collective's timeout (NCCL's watchdog aborts the job at dist.timeout_s).
            patient = datetime.timedelta(seconds=max(cfg.timeout_s, WRITE_TIMEOUT_S))
            self._patient = dist.new_group(backend="gloo", timeout=patient)
            logger.debug("rank %d/%d joined (%s)", self.rank, self.world_size, engine)

    def allreduce_async(self, tensor: Tensor) -> Handle:
        """Sum in place on the K-FAC group; returns at once."""
        if self.world_size == 1:
            return Done()
        work = dist.all_reduce(tensor, group=self._group, async_op=True)
        assert work is not None
        return work

    def broadcast_async(self, tensor: Tensor, src: int) -> Handle:
        """Broadcast in place on the K-FAC group; returns at once."""
        if self.world_size == 1:
            return Done()
        work = dist.broadcast(tensor, src=src, group=self._group, async_op=True)
        assert work is not None
        return work

    def reduce_async(self, tensor: Tensor, dst: int) -> Handle:
        """Sum into rank ``dst``'s ``tensor`` on the K-FAC group; returns at once.

        NCCL has a reduce of its own. Gloo's moves more than an all-reduce (measured: 0.51 vs
        0.35 s for 40 MB between two nodes at 1 Gbit/s), so there every other rank sends its copy
        straight to ``dst`` in chunks (a 40 MB send each way between two nodes takes the time of
        one 40 MB all-reduce; in one piece, two opposite sends sometimes ran one after the other).
        """
        if self.world_size == 1:
            return Done()
        if self._engine != "gloo":
            work = dist.reduce(tensor, dst=dst, group=self._group, async_op=True)
            assert work is not None
            return work
        flat = tensor.view(-1)
        tag = self.reserve(flat)
        if self.rank != dst:
            return SumOnWait(flat, [self.send_async(flat, dst, tag)], [])
        parts = {src: torch.empty_like(flat) for src in range(self.world_size) if src != dst}
        return SumOnWait(flat, [self.recv_async(part, src, tag) for src, part in parts.items()], list(parts.values()))

    def reserve(self, tensor: Tensor) -> int:
        """The first of the tags one point-to-point transfer of ``tensor`` takes (one a chunk).

        Every rank reserves them in the same order (each transfer is known to every rank, as a collective is),
        so sender and receiver agree on the tags however late either posts its side.
        """
        tag = self._tag
        self._tag += max(1, -(-tensor.numel() // self._chunk(tensor)))  # an empty tensor is one empty chunk
        return tag

    def send_async(self, tensor: Tensor, dst: int, tag: int) -> Handle:
        """Send ``tensor`` to ``dst`` in chunks, with the tags :meth:`reserve` gave; returns at once."""
        flat = tensor.view(-1)
        chunks = flat.split(self._chunk(flat))
        return Moved(tensor, [dist.isend(c, dst, group=self._group, tag=tag + i) for i, c in enumerate(chunks)])

    def recv_async(self, tensor: Tensor, src: int, tag: int) -> Handle:
        """Receive ``tensor`` from ``src`` in place, as :meth:`send_async` sent it; returns at once."""
        flat = tensor.view(-1)
        chunks = flat.split(self._chunk(flat))
        return Moved(tensor, [dist.irecv(c, src, group=self._group, tag=tag + i) for i, c in enumerate(chunks)])

    @staticmethod
    def _chunk(tensor: Tensor) -> int:
        """Elements of one chunk of a point-to-point transfer."""
        return max(1, P2P_CHUNK_BYTES // tensor.element_size())

    def reduce_to_owners_async(self, flat: Tensor, counts: Sequence[int]) -> Handle:
        """Sum ``flat`` over the K-FAC group, each rank receiving its piece; returns at once on NCCL.

        NCCL (equal chunks only) runs :func:`~kfacflow.comm.scatter.reduce_to_owners`'s two steps on
        its stream. Gloo's reduce-scatter is no faster than its all-reduce, so there each piece goes
        straight to its owner (:meth:`reduce_async`'s sends, :attr:`direct`); ``flat`` is summed into
        in place on its owner.
        """
        if self.world_size == 1 or not self.reduces:
            return super().reduce_to_owners_async(flat, counts)
        if self._engine == "gloo":
            pieces = flat.split(list(counts))
            sends = [self.reduce_async(piece, r) for r, piece in enumerate(pieces) if piece.numel()]
            return Moved(pieces[self.rank], sends)
        return scatter.reduce_to_owners(flat, counts, self.rank, self._group, self.in_order)

    def gather_async(self, piece: Tensor, counts: Sequence[int]) -> Handle:
        """Every rank's piece on every rank, in :func:`~kfacflow.comm.scatter.gather_from_owners`'s two steps.

        On gloo the host waits for the first; on NCCL both are posted at once (:attr:`in_order`).
        """
        if self.world_size == 1 or not self.gathers:
            return super().gather_async(piece, counts)
        return scatter.gather_from_owners(piece, counts, self.rank, self._group, self.in_order)

    def _broadcast_from_rank0(self, flat: Tensor) -> None:
        """On the job's group, as DDP's own broadcast: nothing of K-FAC's still in flight queues ahead of it."""
        dist.broadcast(flat, src=0)

    def wrap_model(self, model: nn.Module) -> nn.Module:
        """Wrap in DDP when there is more than one worker.

        DDP's broadcast of the buffers at a forward pass is off (it starts every rank from rank 0's
        buffers all the same): it runs only after a backward pass DDP averaged, which a grad sync
        that averages after the backward pass never runs, so :meth:`sync_buffers` does it after every
        step under every grad sync, and nothing is sent twice.
        """
        if self.world_size == 1:
            return model
        ids = [self.device.index] if self.device.type == "cuda" else None
        ddp = DistributedDataParallel(
            model, device_ids=ids, forward_sync_buffers=False, find_unused_parameters=self.find_unused
        )

        def timed_allreduce(state: Any, bucket: Any) -> torch.futures.Future[Tensor]:
            self.last_grad_launch = self.clock()
            return default_hooks.allreduce_hook(state, bucket)

        # DDP compares the hook's annotations with the real classes; postponed (string) annotations
        # from ``from __future__ import annotations`` would fail that check.
        timed_allreduce.__annotations__ = {
            "state": Any,
            "bucket": dist.GradBucket,
            "return": torch.futures.Future[torch.Tensor],
        }
        # DDP's own all-reduce, with the launch time noted for the GradComm breakdown.
        ddp.register_comm_hook(None, timed_allreduce)
        return ddp

    def no_sync(self, net: nn.Module) -> AbstractContextManager[Any]:
        """DDP's ``no_sync``: this backward pass accumulates gradients without all-reducing them."""
        return net.no_sync() if isinstance(net, DistributedDataParallel) else nullcontext()

    def allreduce_sum(self, tensor: Tensor) -> Tensor:
        """Blocking sum on the default group."""
        if self.world_size == 1:
            return tensor.clone()
        out = tensor.to(self.device, copy=True)
        dist.all_reduce(out)
        return out.to(tensor.device)

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Broadcast a picklable object (over gloo, whatever the device)."""
        if self.world_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=self._objects)
        return box[0]

    def gather_objects(self, obj: Any) -> list[Any]:
        """All-gather picklable objects (over gloo)."""
        if self.world_size == 1:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self._objects)
        return out

    def barrier(self) -> None:
        """Barrier on the object group (works for gloo and NCCL jobs alike)."""
        if self.world_size > 1:
            dist.barrier(group=self._objects)

    def await_rank0(self) -> None:
        """Wait for every rank on a gloo group of its own, whose timeout is :data:`WRITE_TIMEOUT_S` (at least)."""
        if self.world_size > 1:
            dist.barrier(group=self._patient)

    def close(self) -> None:
        """Destroy the process groups (the K-FAC ones only, where the default group is the user's)."""
        if self.world_size > 1 and dist.is_initialized():
            if self.joined:
                for group in (self._group, self._objects, self._patient):
                    dist.destroy_process_group(group)
            else:
                dist.destroy_process_group()


BACKENDS.add("torch", TorchBackend, "torch.distributed: gloo on CPU, NCCL on CUDA; DDP averages gradients")
