"""Gradients averaged over ranks by kfacflow itself: dense ones written back from a bucket, sparse ones gathered.

A sparse gradient (``nn.Embedding(sparse=True)``) cannot lie end to end with dense ones in a bucket,
and each rank's rows are others, so :func:`average_sparse` gathers every rank's indices and values
(their counts first, one small gather for every such gradient) and each rank sums the same rows in
the same order: the same bits on every rank, and a sparse gradient still (``torch.optim.SparseAdam``
takes no other), whose values are the average a dense all-reduce would give.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from kfacflow.comm.base import Backend


def flagged(params: Sequence[Tensor]) -> Tensor:
    """``params``' gradients end to end (zeros for one this rank has none of), then 1 per gradient it has, 0 per other.

    Ranks sum buffers by position, so every rank sends every parameter's place, and a parameter whose
    layer did not run on this rank (an expert no token went to) adds nothing; the flags tell, after the
    sum, whether any rank had a gradient (:func:`write_back`).
    """
    parts = [p.grad.reshape(-1) if p.grad is not None else p.new_zeros(p.numel()) for p in params]
    flags = params[0].new_ones(len(params))
    for i, p in enumerate(params):
        if p.grad is None:
            flags[i] = 0.0  # a fill on the device: no copy from the host
    return torch.cat([*parts, flags])


def write_back(params: Sequence[Tensor], flat: Tensor, world_size: int) -> None:
    """Write the averages of a summed :func:`flagged` buffer into ``params``' gradients.

    Each gradient is the sum over ranks divided by every rank (as DDP averages; one process over every
    rank's examples gives the same). Where this rank had no gradient, it gets one if some rank had it,
    and none if no rank did (the optimizer then skips the parameter, as one process would): the flags
    are read from the device only then.
    """
    n = len(params)
    values, flags = flat[:-n], flat[-n:]
    values.div_(world_size)
    lacking = [i for i, p in enumerate(params) if p.grad is None]
    had = dict(zip(lacking, flags[lacking].tolist(), strict=True)) if lacking else {}
    offset = 0
    for i, p in enumerate(params):
        piece = values[offset : offset + p.numel()].view_as(p)
        offset += p.numel()
        if p.grad is not None:
            p.grad.copy_(piece)
        elif had[i] > 0:
            p.grad = piece.clone()


def average_sparse(backend: Backend, params: Sequence[Tensor]) -> None:
    """Replace each parameter's sparse gradient by its average over ranks (blocking; every rank calls it alike).

    Args:
        backend: The engine (its K-FAC group carries the gathers).
        params: Parameters whose gradients are sparse, the same ones in the same order on every rank.
    """
    if backend.world_size == 1 or not params:
        return
    world = backend.world_size
    grads = [p.grad.coalesce() for p in params if p.grad is not None]
    assert len(grads) == len(params), "average_sparse is given the parameters that have a sparse gradient"
    nnz = torch.tensor([g._nnz() for g in grads], dtype=torch.int64, device=grads[0].device)
    rows = backend.gather_async(nnz, [len(grads)] * world).wait().view(world, len(grads)).T.tolist()
    for param, grad, counts in zip(params, grads, rows, strict=True):
        dims, dense = grad.sparse_dim(), grad.shape[grad.sparse_dim() :]
        per_row = math.prod(dense)
        indices = backend.gather_async(grad.indices().T.reshape(-1), [n * dims for n in counts]).wait()
        values = backend.gather_async(grad.values().reshape(-1), [n * per_row for n in counts]).wait()
        summed = torch.sparse_coo_tensor(
            indices.view(-1, dims).T, values.view(-1, *dense), grad.shape, check_invariants=False
        )
        param.grad = summed.coalesce() / world
