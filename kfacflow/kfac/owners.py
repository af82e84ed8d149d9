"""What owners alone hold, brought to every rank: running averages and inverses, for checkpoints and re-plans.

Collective: every rank walks the communicated slots in the same order, each owner sending its own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from kfacflow.kfac.stages.contracts import EVERY_RANK, FactorSlot, Inverse

if TYPE_CHECKING:
    from kfacflow.comm.base import Backend

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
"""What a running average or an inverse may be held in, numbered for :func:`_from_owner`."""


def every_inverse(inverses: dict[str, Inverse], slots: list[FactorSlot], backend: Backend) -> dict[str, Inverse]:
    """Every inverse, its owner's bits on every rank (in slot order on every rank)."""
    gathered = dict(inverses)
    kinds = sorted(Inverse.kinds)
    for slot in _communicated(slots, backend):
        mine = inverses.get(slot.key) if slot.owner == backend.rank else None
        flat = mine.to_full() if mine is not None else None
        kind = kinds.index(mine.kind) if mine is not None else 0
        got = _from_owner(backend, slot, flat, kind, [Inverse.kinds[k].full_elements(slot.dim) for k in kinds])
        if got is not None and mine is None:
            gathered[slot.key] = Inverse.kinds[kinds[got[0]]].from_full(got[1], slot.dim)
    return gathered


def every_running(running: dict[str, Tensor], slots: list[FactorSlot], backend: Backend) -> dict[str, Tensor]:
    """Every running average, its owner's on every rank (in slot order on every rank)."""
    gathered = dict(running)
    for slot in _communicated(slots, backend):
        mine = running.get(slot.key) if slot.owner == backend.rank else None
        got = _from_owner(backend, slot, mine, 0, [slot.dim * (slot.dim + 1) // 2])
        if got is None:
            gathered.pop(slot.key, None)
        else:
            gathered[slot.key] = got[1]
    return gathered


def _communicated(slots: list[FactorSlot], backend: Backend) -> list[FactorSlot]:
    """The slots one rank owns (none on one process)."""
    return [slot for slot in slots if slot.owner != EVERY_RANK and backend.world_size > 1]


def _from_owner(
    backend: Backend, slot: FactorSlot, flat: Tensor | None, kind: int, elements: list[int]
) -> tuple[int, Tensor] | None:
    """Send the owner's ``flat`` (of a ``kind`` it numbers) to every rank; ``None`` where the owner has none.

    A first message says what follows: the kind and the dtype, or -1 (nothing inverted or
    averaged yet); the others then receive ``elements[kind]`` values.
    """
    head = [kind, DTYPES.index(flat.dtype)] if flat is not None else [-1, -1]
    code = torch.tensor(head, dtype=torch.int64, device=backend.device)
    backend.broadcast_async(code, slot.owner).wait()
    kind, dtype = (int(v) for v in code.tolist())
    if kind < 0:
        return None
    if flat is None:
        flat = torch.empty(elements[kind], dtype=DTYPES[dtype], device=backend.device)
    backend.broadcast_async(flat, slot.owner).wait()  # the owner's own tensor is left as it is
    return kind, flat
