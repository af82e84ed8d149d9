"""Muon on several workers: each matrix's momentum and Newton-Schulz on one owner, the finished updates gathered.

``torch.optim.Muon`` is replicated: every worker keeps every matrix's momentum and orthogonalises
every matrix, the same work ``P`` times. Here (``optim.muon.owners``) each matrix has one owner, which
alone keeps its momentum (ZeRO-1's sharded state) and runs its Newton-Schulz; one gather of the owners'
finished directions brings them to every rank, and every rank then applies the same bits, so the
replicas stay identical. The direction is the one a replicated Muon computes from the same averaged
gradient: the step is ``torch.optim.Muon``'s.

Owners are ``placed`` by the Newton-Schulz cost of each matrix, largest first onto the least-loaded
rank (the longest-processing-time rule), or ``round_robin`` in model order. The gather moves the same
bytes whoever sends them (:func:`kfacflow.comm.scatter.gather_from_owners` re-cuts the pieces into
equal chunks), so only the computation needs balancing. A checkpoint still holds every momentum:
:meth:`Sharding.every_momentum` brings each owner's to every rank, and a resume keeps only the
matrices it owns, on any world size.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

import torch
from torch import Tensor

if TYPE_CHECKING:
    from kfacflow.comm.base import Backend

Owners = Literal["placed", "round_robin", "replicated", "kfac"]
"""``kfac``: each K-FAC layer's weight on the layer's owner (:mod:`kfacflow.on_owners`), the others ``placed``."""


def ns_flops(shape: Sequence[int], steps: int) -> float:
    """Floating-point operations of ``steps`` Newton-Schulz iterations on a ``shape`` matrix (filters flattened).

    With ``m <= n`` its sides, each iteration forms the ``m x m`` Gram matrix (``2 m^2 n``), squares it
    (``2 m^3``) and multiplies back (``2 m^2 n``).
    """
    rows, cols = shape[0], 1
    for side in shape[1:]:
        cols *= side
    m, n = min(rows, cols), max(rows, cols)
    return steps * (4.0 * m * m * n + 2.0 * m**3)


def place(shapes: Sequence[Sequence[int]], world: int, how: Owners, steps: int = 5) -> list[int]:
    """The owning rank of each of ``shapes``' matrices (``how``: ``placed`` or ``round_robin``).

    ``placed``: largest Newton-Schulz cost first (:func:`ns_flops`), each onto the rank with the least
    so far, the lowest rank on a tie; deterministic, so every rank places alike without a message.
    """
    if how == "round_robin":
        return [i % world for i in range(len(shapes))]
    if how not in ("placed", "kfac"):
        raise ValueError(f"no placement {how!r}")
    costs = [ns_flops(s, steps) for s in shapes]
    load, owners = [0.0] * world, [0] * len(shapes)
    for i in sorted(range(len(shapes)), key=lambda i: (-costs[i], i)):
        rank = min(range(world), key=lambda r: (load[r], r))
        owners[i] = rank
        load[rank] += costs[i]
    return owners


class Sharding:
    """Which rank owns each Muon matrix, and the two exchanges that need it: the step's and the checkpoint's.

    Args:
        params: Every Muon matrix, in the same order on every rank (the optimizer's groups).
        backend: The engine of the job (its K-FAC group carries the gathers).
        how: ``placed`` or ``round_robin`` (see :func:`place`).
        steps: The Newton-Schulz iterations (they weigh the placement).
    """

    def __init__(self, params: Sequence[Tensor], backend: Backend, how: Owners, steps: int = 5) -> None:
        self.backend, self.steps = backend, steps
        owners = place([p.shape for p in params], backend.world_size, how, steps)
        self._owner = {id(p): r for p, r in zip(params, owners, strict=True)}
        self._followed: dict[int, int] | None = None
        """What :meth:`follow` was last given."""

    def follow(self, owners: dict[int, int], params: Sequence[Tensor], state: dict[Tensor, dict[str, Tensor]]) -> bool:
        """Give the matrices ``owners`` names (by ``id``) those owners, the others re-placed among themselves.

        Where any owner changes, every momentum is gathered first and each rank keeps what it owns now
        (collective; every rank calls it with the same owners). Returns whether any owner changed.
        """
        if owners == self._followed:  # every step asks; the plan's owners rarely change
            return False
        self._followed = dict(owners)
        rest = [p for p in params if id(p) not in owners]
        placed = place([p.shape for p in rest], self.backend.world_size, "placed", self.steps)
        new = {**dict(zip(map(id, rest), placed, strict=True)), **owners}
        if new == self._owner:
            return False
        every = self.every_momentum(params, state)
        self._owner = new
        for p in params:
            if self.owns(p) and id(p) in every:
                state.setdefault(p, {})["momentum_buffer"] = every[id(p)]
            elif not self.owns(p):
                state.pop(p, None)
        return True

    def owner(self, p: Tensor) -> int:
        """The rank that keeps ``p``'s momentum and orthogonalises it."""
        return self._owner[id(p)]

    def owns(self, p: Tensor) -> bool:
        """Whether this rank owns ``p``."""
        return self._owner[id(p)] == self.backend.rank

    def by_owner(self, params: Sequence[Tensor]) -> list[list[Tensor]]:
        """``params`` split by owning rank, in their order within each."""
        out: list[list[Tensor]] = [[] for _ in range(self.backend.world_size)]
        for p in params:
            out[self.owner(p)].append(p)
        return out

    def exchange(
        self, params: Sequence[Tensor], mine: dict[int, Tensor], dtype: torch.dtype
    ) -> list[tuple[Tensor, Tensor]]:
        """Every rank's finished directions, on every rank: ``(param, direction)`` for each one its owner stepped.

        ``params``: the group's matrices, every one of them (the pieces' sizes must not depend on which
        have gradients, which only the owner looks at); ``mine``: this rank's directions by ``id``. Each
        rank's piece is one flag per matrix it owns (1: stepped) then their directions in ``dtype``.
        """
        if not params:  # every rank passes the same matrices: none means no collective on any
            return []
        owned = self.by_owner(params)
        counts = [len(ps) + sum(p.numel() for p in ps) for ps in owned]
        device = self.backend.device
        ps = owned[self.backend.rank]
        flags = torch.tensor([float(id(p) in mine) for p in ps], dtype=dtype, device=device)
        values = [
            mine[id(p)].reshape(-1).to(dtype) if id(p) in mine else p.new_zeros(p.numel(), dtype=dtype) for p in ps
        ]
        piece = torch.cat([flags, *values]) if ps else torch.zeros(0, dtype=dtype, device=device)
        flat = self.backend.gather_async(piece, counts).wait()
        starts = [sum(counts[:r]) for r in range(len(counts))]
        stepped = flat[[s + i for s, ps_r in zip(starts, owned, strict=True) for i in range(len(ps_r))]].tolist()
        out, k = [], 0
        for start, ps_r in zip(starts, owned, strict=True):
            offset = start + len(ps_r)
            for p in ps_r:
                if stepped[k]:
                    out.append((p, flat[offset : offset + p.numel()].view(p.shape)))
                offset += p.numel()
                k += 1
        return out

    def every_momentum(self, params: Sequence[Tensor], state: dict[Tensor, dict[str, Tensor]]) -> dict[int, Tensor]:
        """Each owner's momentum of ``params`` on every rank, by ``id`` (collective).

        The step's :meth:`exchange`, the momenta in place of the directions: for checkpoints. A matrix its
        owner never stepped has none (as in a replicated Muon's state).
        """
        if not params:
            return {}
        held = {id(p): state[p]["momentum_buffer"] for p in params if "momentum_buffer" in state.get(p, {})}
        wide = functools.reduce(torch.promote_types, (p.dtype for p in params))  # no momentum rounded on the way
        return {id(p): buf.to(p.dtype) for p, buf in self.exchange(params, held, wide)}
