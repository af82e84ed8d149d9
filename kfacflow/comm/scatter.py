"""Pieces of uneven size to and from their ranks: a reduction to owners and a gather from them.

K-FAC's owners each need (or each have) a different part of one buffer: a factor group's
factors, the gradients of their layers, their layers' updates. One reduction or broadcast per
owner pays P - 1 start-ups each (at P = 64 a broadcast's start-up costs as much as a million
elements); an all-reduce pays once but moves every element twice. Built from collectives
with equal parts, both directions pay two start-ups and move each element about once:

- **reduce to owners**: a reduce-scatter of the buffer in P equal chunks (padded), then an
  all-to-all that moves each chunk's pieces to the ranks that own them;
- **gather from owners**: an all-to-all that moves each owner's piece into the equal chunks,
  then an all-gather of the chunks.

The buffer is laid out in rank order: ``counts[r]`` elements for rank ``r``, back to back.
Nothing here adds anything but the reduce-scatter's sums, so a gathered piece arrives with its
owner's bits on every rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from kfacflow.perf import LinearModel


def chunk_size(total: int, world_size: int) -> int:
    """Elements of each of the P equal chunks that hold ``total`` (the last ones padded)."""
    return max(1, -(-total // world_size))


def splits(counts: Sequence[int], rank: int) -> tuple[list[int], list[int]]:
    """How the all-to-all between the rank-ordered layout and the equal chunks moves its pieces.

    Returns ``(from_chunk, to_chunk)``: ``from_chunk[r]`` elements of this rank's chunk belong to
    rank ``r`` (what it sends when reducing, receives when gathering), and ``to_chunk[r]`` of this
    rank's own piece lie in rank ``r``'s chunk (what it receives when reducing, sends when gathering).
    """
    world = len(counts)
    c = chunk_size(sum(counts), world)
    starts = [sum(counts[:r]) for r in range(world)]

    def overlap(piece: int, chunk: int) -> int:
        lo, hi = max(starts[piece], chunk * c), min(starts[piece] + counts[piece], (chunk + 1) * c)
        return max(0, hi - lo)

    return [overlap(r, rank) for r in range(world)], [overlap(rank, r) for r in range(world)]


def cost(model: LinearModel, counts: Sequence[int]) -> float:
    """Seconds to reduce ``counts`` to their owners, or gather them (the same two steps reversed).

    Each step is P - 1 hops of the reduction's (a broadcast's) start-up; the reduce-scatter moves
    (P - 1) / P of the buffer, the all-to-all the largest piece a rank receives or sends.
    """
    world, total = len(counts), sum(counts)
    return 2 * model.alpha + model.beta * (total * (world - 1) / world + max(max(counts), chunk_size(total, world)))


def direct_cost(model: LinearModel, counts: Sequence[int]) -> float:
    """Seconds to send each piece straight to its owner (gloo's point-to-point reduction, :attr:`.Backend.direct`).

    Every rank sends what it does not own and receives P - 1 copies of its own piece, at once in
    both directions: the busiest rank's larger direction, after P - 1 start-ups.
    """
    world, total = len(counts), sum(counts)
    busiest = max(max(total - c, (world - 1) * c) for c in counts)
    return (world - 1) * model.alpha + model.beta * busiest


def pays(allreduce: LinearModel, reduce: LinearModel, counts: Sequence[int], direct: bool = False) -> bool:
    """Whether reducing to the owners beats one all-reduce of the same pieces, by the models.

    The two steps (:func:`cost`) only from three ranks on: at P = 2 they move no fewer bytes
    (half the buffer, then the larger piece) and pay one start-up more. Sent straight to their
    owners (``direct``, :func:`direct_cost`) from two.
    """
    if direct:
        return len(counts) > 1 and direct_cost(reduce, counts) < allreduce(sum(counts))
    return len(counts) > 2 and cost(reduce, counts) < allreduce(sum(counts))


class Chained:
    """Two collectives, the second reading what the first writes.

    With ``in_order`` (NCCL) both are posted at once: a group's collectives run one after the
    other on its one stream, so nothing needs to wait between them, and a ``wait()`` there would
    make the compute stream wait for everything queued on the group's stream (in a backward hook:
    the rest of the backward pass behind earlier factor traffic). Otherwise (gloo, whose threads
    may run two works of a group at once) the host waits for the first before posting the second.
    Keeps every buffer alive until :meth:`wait`.
    """

    def __init__(self, result: Tensor, works: list[Any], keep: list[Tensor]) -> None:
        self.result, self.works, self.keep = result, works, keep

    def wait(self) -> Tensor:
        """Block until both are done (on NCCL: the current stream waits); return the result."""
        for work in self.works:
            work.wait()
        self.works, self.keep = [], []
        return self.result

    def get_future(self) -> Any:
        """The second collective's future (a trace times the pair until it completes)."""
        return self.works[-1].get_future()


def _then(first: Any, in_order: bool) -> list[Any]:
    """The works :class:`Chained` waits for once ``first`` is posted: on gloo the host waits for it here."""
    assert first is not None
    if in_order:
        return [first]
    first.wait()
    return []


def reduce_to_owners(flat: Tensor, counts: Sequence[int], rank: int, group: Any, in_order: bool = False) -> Chained:
    """Sum ``flat`` over the ranks of ``group``; rank ``r`` receives its piece (``counts[r]`` elements) of the sum.

    ``in_order``: the group runs its collectives in posting order (NCCL's stream): see :class:`Chained`.
    """
    world = len(counts)
    c = chunk_size(flat.numel(), world)
    padded = torch.cat([flat, flat.new_zeros(c * world - flat.numel())]) if c * world != flat.numel() else flat
    chunk = flat.new_empty(c)
    works = _then(dist.reduce_scatter_single(chunk, padded, group=group, async_op=True), in_order)
    from_chunk, to_chunk = splits(counts, rank)
    mine = flat.new_empty(counts[rank])
    sent = chunk[: sum(from_chunk)]
    works.append(dist.all_to_all_single(mine, sent, to_chunk, from_chunk, group=group, async_op=True))
    return Chained(mine, works, [padded, chunk])


def gather_from_owners(piece: Tensor, counts: Sequence[int], rank: int, group: Any, in_order: bool = False) -> Chained:
    """Return every rank's piece (``counts[r]`` elements of rank ``r``), in rank order, on every rank of ``group``.

    ``in_order``: as for :func:`reduce_to_owners`.
    """
    world, total = len(counts), sum(counts)
    c = chunk_size(total, world)
    from_chunk, to_chunk = splits(counts, rank)
    chunk = piece.new_zeros(c)
    first = dist.all_to_all_single(chunk[: sum(from_chunk)], piece, from_chunk, to_chunk, group=group, async_op=True)
    works = _then(first, in_order)
    out = piece.new_empty(c * world)
    works.append(dist.all_gather_single(out, chunk, group=group, async_op=True))
    return Chained(out[:total], works, [chunk, piece])
