"""Factors handed to the exchange in one order that every rank agrees on, with a placeholder where a layer did not run.

Ranks sum their factors by position: the fused reductions of the communicate stage, like any
collective, pair the ``i``-th element of one rank with the ``i``-th of every other. That is right
only if every rank hands over the same factors in the same order, which the usual model does, and
a model with conditional computation does not: an expert of a mixture of experts that no token of
this rank's batch went to is skipped (the usual MoE code does not call it), early exit and
stochastic depth skip whole blocks. Left alone, one rank's factor of one expert is summed into
another rank's factor of another expert of the same size, or the job aborts on a size mismatch.

So with several ranks, :class:`Handover` stands between the factor hooks and the exchange:

- the first time a side (A, G) is handed over, nothing goes out before every rank's order is known:
  one all-gather of the keys in the order each rank produced them, merged into one order
  (:func:`merge_orders`: each rank's own order wherever the ranks agree), the same on every rank;
- from then on each factor goes out as soon as every factor before it in that order has, so a model
  whose layers run in the same order on every rank (nearly all) is pipelined exactly as before;
- at the end of a pass, a factor this rank did not produce goes out as :class:`~kfacflow.kfac.stages.contracts.Absent`:
  zeros that say so, which the exchange counts as no factor (:class:`~kfacflow.kfac.communicator.FusedSum`).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Mapping
from typing import Any

import torch

from kfacflow.kfac.exchange import Contribution
from kfacflow.kfac.layers import KFACLayer
from kfacflow.kfac.packing import packed_size
from kfacflow.kfac.stages.contracts import Absent

SIDES = ("A", "G")


Factor = Contribution | Absent
"""What the exchange is handed: a factor (packed, or its rows), or the mark of one this rank does not have."""


def placeholders(layers: list[KFACLayer], side: str, dtype: torch.dtype) -> dict[str, Absent]:
    """What each layer's factor of ``side`` goes out as where the layer did not run on this rank."""
    return {
        f"{layer.name}/{side}": Absent(
            packed_size(layer.a_dim if side == "A" else layer.g_dim), dtype, layer.params[0].device
        )
        for layer in layers
    }


def merge_orders(orders: list[list[str]]) -> list[str]:
    """One order of every key of ``orders`` (one list per rank) that keeps each rank's own order where they agree.

    A key comes after every key that precedes it on some rank; among the keys free to come next, the
    one seen earliest (its least position on any rank, then the lowest rank) comes first. Where ranks
    disagree (a cycle), the earliest remaining key is taken. Every rank computes the same order.
    """
    first: dict[str, tuple[int, int]] = {}
    before: dict[str, set[str]] = {}
    for rank, order in enumerate(orders):
        for i, key in enumerate(order):
            first[key] = min(first.get(key, (i, rank)), (i, rank))
            before.setdefault(key, set())
            if i:
                before[key].add(order[i - 1])
    after: dict[str, list[str]] = {key: [] for key in first}
    for key, preceding in before.items():
        for p in preceding:
            after[p].append(key)
    waiting = {key: len(preceding) for key, preceding in before.items()}
    free = [(first[key], key) for key, n in waiting.items() if n == 0]
    heapq.heapify(free)
    merged: list[str] = []
    while len(merged) < len(first):
        if not free:  # the ranks disagree: break the cycle at the earliest key left
            key = min((k for k in waiting if waiting[k] > 0), key=lambda k: first[k])
            waiting[key] = 0
            heapq.heappush(free, (first[key], key))
        _, key = heapq.heappop(free)
        if waiting.get(key, 0) < 0:
            continue  # already placed
        waiting[key] = -1
        merged.append(key)
        for nxt in after[key]:
            if waiting[nxt] > 0:
                waiting[nxt] -= 1
                if waiting[nxt] == 0:
                    heapq.heappush(free, (first[nxt], nxt))
    return merged


class Handover:
    """Hands each side's factors to ``push`` in the order every rank agreed on; a placeholder for one it lacks.

    The calls each factor update, per side: :meth:`offer` as each factor is complete, :meth:`close`
    once the pass is over (the forward pass for A, the backward pass for G); :meth:`reset` after the
    step. With one rank (``gather`` is ``None``) factors go straight to ``push``.

    Args:
        push: Where the factors go, in order (the exchange's ``push``; called as it is then).
        gather: Every rank's picklable object, by rank (collective); ``None`` with one rank.
    """

    def __init__(self, push: Callable[[str, Factor], None], gather: Callable[[Any], list[Any]] | None) -> None:
        self.push, self.gather = push, gather
        self.order: dict[str, list[str] | None] = dict.fromkeys(SIDES)
        """Each side's agreed order (``None`` until agreed: every factor waits for the pass to end)."""
        self._offered: dict[str, list[str]] = {side: [] for side in SIDES}
        self._waiting: dict[str, Factor] = {}
        self._next = dict.fromkeys(SIDES, 0)

    def offer(self, side: str, key: str, factor: Contribution) -> None:
        """Take a complete factor; hand over what the agreed order lets go now."""
        if self.gather is None:
            self.push(key, factor)
            return
        self._offered[side].append(key)
        self._waiting[key] = factor
        self._release(side)

    def close(self, side: str, absent: Mapping[str, Absent], extra: Any = None, complete: bool = True) -> list[Any]:
        """End a side's pass: agree on its order if it has none yet, then hand over every factor left.

        Args:
            side: ``"A"`` or ``"G"``.
            absent: The placeholder of every key this rank may hand over on this side.
            extra: With the order not yet agreed, a picklable object gathered with it.
            complete: Whether the agreed order takes in every key of ``absent`` (those no rank handed over
                too, after the others); else only what some rank handed over (the first step: the others
                are dropped).

        Returns:
            Every rank's ``extra``, by rank, where the order was agreed now; else ``[]``.
        """
        if self.gather is None:
            return []
        extras: list[Any] = []
        if self.order[side] is None:
            gathered = self.gather((self._offered[side], extra))
            merged = merge_orders([offered for offered, _ in gathered])
            if complete:
                merged += [key for key in absent if key not in set(merged)]
            self.order[side], extras = merged, [e for _, e in gathered]
        for key in (self.order[side] or [])[self._next[side] :]:  # what this rank lacks goes out as saying so
            if key not in self._waiting:
                self._waiting[key] = absent[key]
        self._release(side)
        return extras

    def _release(self, side: str) -> None:
        order = self.order[side]
        if order is None:
            return
        i = self._next[side]
        while i < len(order) and order[i] in self._waiting:
            self.push(order[i], self._waiting.pop(order[i]))
            i += 1
        self._next[side] = i

    def keep(self, keys: set[str]) -> None:
        """Forget the keys of layers that left (their factors are no longer handed over)."""
        for side in SIDES:
            order = self.order[side]
            if order is not None:
                self.order[side] = [key for key in order if key in keys]

    def forget(self) -> None:
        """Agree on the orders again at the next factor update (a restored run: its ranks' orders are not known)."""
        self.order = dict.fromkeys(SIDES)

    def reset(self) -> None:
        """After the step: nothing offered yet."""
        self._offered = {side: [] for side in SIDES}
        self._waiting = {}
        self._next = dict.fromkeys(SIDES, 0)
