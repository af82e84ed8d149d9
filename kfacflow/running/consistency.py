"""Every rank must hold the same parameters: a bit checksum per tensor, compared across ranks.

Ranks apply the same averaged gradient, but what each rank computes on its own (the inverses
every rank computes, preconditioned gradients) can round differently in the last bit where
kernels differ (another CPU, another thread count, another GPU model); over a long run the
replicas would then drift apart without any error. The checksums sum the raw bit patterns, so
a one-ulp difference changes them, and one small gather compares every tensor at once.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from kfacflow import TrainingError
from kfacflow.comm.base import Backend

logger = logging.getLogger(__name__)

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int32}


def bit_checksums(tensors: Sequence[Tensor]) -> list[int]:
    """Return the sum of each tensor's bit patterns (as 16- or 32-bit integers), one per tensor."""
    if not tensors:
        return []
    sums = [t.detach().contiguous().reshape(-1).view(_BITS[t.element_size()]).sum(dtype=torch.int64) for t in tensors]
    return [int(s) for s in torch.stack(sums).cpu().tolist()]


def all_finite(tensors: Sequence[Tensor]) -> bool:
    """Whether every element of every floating-point tensor is finite.

    A sum is non-finite when an element is (16 times cheaper than ``isfinite`` on a CPU, and one
    read of each tensor); only sums beyond float32's range of finite values (~3e38) would be
    taken for non-finite, and values that large are no gradient or weight to apply anyway.
    """
    sums = [t.detach().sum(dtype=torch.float32) for t in tensors if t.is_floating_point()]
    return not sums or bool(torch.isfinite(torch.stack(sums)).all())


def gradients_finite(model: nn.Module) -> bool:
    """Whether every gradient of ``model`` is finite (:func:`all_finite`)."""
    return all_finite([p.grad for p in model.parameters() if p.grad is not None])


def check_replicas(model: nn.Module, optimizer: torch.optim.Optimizer, backend: Backend, step: int) -> int:
    """Check that every rank holds finite parameters identical to rank 0's; repair drift (collective).

    A drifted rank takes rank 0's parameters and optimizer state, with one warning naming the
    tensors; non-finite parameters (or buffers, such as BatchNorm statistics) cannot be repaired
    and stop training.

    Args:
        model: The network (unwrapped).
        optimizer: Its optimizer (its state is restored together with the parameters).
        backend: The communication engine.
        step: The step just finished (for messages).

    Returns:
        The number of parameter tensors that differed from rank 0's.

    Raises:
        TrainingError: If any rank's parameters are non-finite.
    """
    named = [(name, p) for name, p in model.named_parameters()]
    params = [p for _, p in named]
    mine = (bit_checksums(params), all_finite([*params, *model.buffers()]))
    gathered = backend.gather_objects(mine) if backend.world_size > 1 else [mine]
    bad = [rank for rank, (_, finite) in enumerate(gathered) if not finite]
    if bad:
        raise TrainingError(
            f"the parameters are non-finite after step {step} on rank(s) {bad}: an update overflowed. Lower "
            "optim.lr, raise kfac.damping or kfac.kl_clip, or check optim.weight_decay; resume from an earlier "
            "checkpoint."
        )
    reference = gathered[0][0]
    differ = [i for i in range(len(named)) if any(sums[i] != reference[i] for sums, _ in gathered[1:])]
    if not differ:
        return 0
    ranks = sorted({r for r, (sums, _) in enumerate(gathered) if any(sums[i] != reference[i] for i in differ)})
    logger.warning(
        "after step %d, %d parameter tensors differ between ranks (first: %s, on rank(s) %s): rounding that "
        "differs between workers; every rank now takes rank 0's parameters and optimizer state",
        step,
        len(differ),
        named[differ[0]][0],
        ranks,
    )
    with torch.no_grad():
        for p in params:
            take_rank0(p.data, backend)
        # a sharded optimizer's own states are one rank's each: only what every rank holds is repaired
        shared = getattr(optimizer, "replicated_states", None)
        for state in shared() if shared is not None else optimizer.state.values():
            for value in state.values():
                if isinstance(value, Tensor):
                    take_rank0(value, backend)
    return len(differ)


def take_rank0(tensor: Tensor, backend: Backend) -> None:
    """Overwrite ``tensor`` with rank 0's copy in place (collective), wherever it lives.

    A tensor off the engine's device (AdamW's ``step`` is a CPU tensor beside CUDA parameters, and
    NCCL takes CUDA tensors only) travels through a copy on that device and comes back to its own
    device and dtype: the optimizer keeps the very tensor it had.
    """
    if tensor.device == backend.device:
        backend.broadcast_async(tensor, 0).wait()
        return
    moved = tensor.to(backend.device)
    backend.broadcast_async(moved, 0).wait()
    tensor.copy_(moved)


def skipped(params: Sequence[Tensor], step: int, scaler: bool, ranks: int, in_row: int, limit: int) -> None:
    """Report a step every rank skipped; end training where skipping cannot help.

    Args:
        params: The model's parameters (non-finite already: an earlier update overflowed).
        step: The step that comes next.
        scaler: Whether the loss scale's overflow caused it (float16: the scaler backs off, no fault).
        ranks: On how many ranks the loss, gradients or update were non-finite.
        in_row: Faulty skips in a row so far.
        limit: The most allowed in a row (``train.max_nonfinite``).

    Raises:
        TrainingError: The parameters are non-finite, or too many steps in a row were.
    """
    if scaler:
        logger.info("step %d skipped on every rank: float16 gradients overflowed; the loss scale backs off", step)
    else:
        logger.warning("step %d skipped on every rank: non-finite loss, gradient or update on %d rank(s)", step, ranks)
    hint = "lower optim.lr or optim.weight_decay, raise kfac.damping or kfac.kl_clip, or check the data"
    if not all_finite(params):
        raise TrainingError(f"the parameters are non-finite before step {step}: an update overflowed; {hint}.")
    if in_row >= limit:
        raise TrainingError(
            f"the loss, gradients or update were non-finite in {in_row} steps in a row (up to "
            f"step {step}); {hint} (train.max_nonfinite sets the limit)."
        )
