"""The blocks preconditioned beside the Kronecker pipelines: the norms' diagonals and the tied weights.

Each is small enough that every rank holds all of it: one all-reduce per factor update carries a block's
factors (:meth:`SideBlocks.launch`, after the backward pass), and its updates join the layers' where KL
clipping and ``kfac.normalize`` see every update (:meth:`SideBlocks.pairs`, :meth:`SideBlocks.set_grads`).
"""

from __future__ import annotations

from typing import Any, Protocol

from torch import Tensor


class SideBlock(Protocol):
    """What a block beside the pipelines does (``NormDiagonals``, ``TiedWeights``)."""

    @property
    def params(self) -> list[Tensor]:
        """Every parameter it preconditions."""

    def launch(self) -> None:
        """On a factor update, start summing its factors over ranks."""

    def pairs(self) -> list[tuple[Tensor, Tensor]]:
        """Its ``(update, gradient)`` pairs, flat, once the gradients are averaged."""

    def set_grads(self, updates: list[Tensor]) -> None:
        """Write the final updates of :meth:`pairs` into the gradients."""

    def reset(self) -> None:
        """Forget this step's sums."""

    def saved(self) -> Any:
        """Its running state, copied (for a checkpoint)."""

    def restore(self, saved: Any) -> None:
        """Take :meth:`saved`'s state back (``None``: a checkpoint made without it)."""

    def remove(self) -> None:
        """Take its hooks off the model."""


class SideBlocks:
    """The side blocks, by the checkpoint key each is saved under, called together."""

    def __init__(self, blocks: dict[str, SideBlock]) -> None:
        self.blocks = blocks
        self._counts: list[int] = []

    @property
    def params(self) -> list[Tensor]:
        """Every parameter the blocks precondition."""
        return [p for block in self.blocks.values() for p in block.params]

    def launch(self) -> None:
        """Start every block's all-reduce of a factor update."""
        for block in self.blocks.values():
            block.launch()

    def pairs(self) -> list[tuple[Tensor, Tensor]]:
        """Every block's ``(update, gradient)`` pairs, in the blocks' order."""
        each = [block.pairs() for block in self.blocks.values()]
        self._counts = [len(pairs) for pairs in each]
        return [pair for pairs in each for pair in pairs]

    def set_grads(self, updates: list[Tensor]) -> None:
        """Hand each block its share of the final updates of :meth:`pairs`."""
        start = 0
        for block, n in zip(self.blocks.values(), self._counts, strict=True):
            block.set_grads(updates[start : start + n])
            start += n

    def reset(self) -> None:
        """Forget every block's sums of this step (a step skipped on every rank)."""
        for block in self.blocks.values():
            block.reset()

    def saved(self) -> dict[str, Any]:
        """Every block's state, by its key."""
        return {key: block.saved() for key, block in self.blocks.items()}

    def restore(self, state: dict[str, Any]) -> None:
        """Give every block its state from a checkpoint's ``state`` (``None`` where it has none)."""
        for key, block in self.blocks.items():
            block.restore(state.get(key))

    def remove(self) -> None:
        """Take every block's hooks off."""
        for block in self.blocks.values():
            block.remove()
