"""Packed upper triangles: how symmetric factors and inverses are stored and sent (torch only)."""

from __future__ import annotations

import torch
from torch import Tensor

_INDEX: dict[tuple[int, torch.device], tuple[Tensor, Tensor]] = {}


def _triu_index(d: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """Flat positions of the upper triangle of a d x d matrix, row-major, and of its mirror image.

    Cached per size: index gathers are several times faster than boolean-mask indexing, which
    recounts the mask on every call (0.3 s per pack of a 4608-wide factor on one CPU thread).
    """
    key = (d, device)
    if key not in _INDEX:
        rows, cols = torch.triu_indices(d, d, device=device)
        _INDEX[key] = (rows * d + cols, cols * d + rows)
    return _INDEX[key]


def packed_size(d: int) -> int:
    """Return the number of elements in the upper triangle (with diagonal) of a d x d matrix."""
    return d * (d + 1) // 2


def pack(m: Tensor) -> Tensor:
    """Return the upper triangle of square ``m`` (diagonal included), row-major, as a vector."""
    upper, _ = _triu_index(m.shape[0], m.device)
    return m.reshape(-1).index_select(0, upper)


def unpack(packed: Tensor, d: int) -> Tensor:
    """Rebuild the symmetric d x d matrix whose upper triangle :func:`pack` returned."""
    upper, lower = _triu_index(d, packed.device)
    out = packed.new_empty(d * d)
    out.index_copy_(0, upper, packed)
    out.index_copy_(0, lower, packed)
    return out.view(d, d)


def pack_lower(m: Tensor) -> Tensor:
    """Return the lower triangle of square ``m`` (diagonal included), column-major: :func:`pack` of ``m.T``."""
    _, lower = _triu_index(m.shape[0], m.device)
    return m.reshape(-1).index_select(0, lower)


def unpack_lower(packed: Tensor, d: int) -> Tensor:
    """Rebuild the lower-triangular d x d matrix (zeros above) whose triangle :func:`pack_lower` returned.

    One scatter into zeros: half the passes of :func:`unpack` followed by ``tril``.
    """
    _, lower = _triu_index(d, packed.device)
    return packed.new_zeros(d * d).index_copy_(0, lower, packed).view(d, d)
