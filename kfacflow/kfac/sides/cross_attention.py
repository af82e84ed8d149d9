"""A MultiheadAttention's packed ``in_proj`` in cross-attention: its query, key and value rows as three layers.

Called for cross-attention (query, key and value not one tensor), a MultiheadAttention K-FAC holds computes its
queries, keys and values with three :class:`~kfacflow.kfac.multihead.RowBlock` modules, each an ``E x E``
Linear (its share of ``in_proj_bias`` as its bias) on its own input. Each is a layer of K-FAC: its A from its
input, its G from its output's gradient, made and averaged as every layer's
(:class:`~kfacflow.kfac.sides.factors.SideFactors`), and its block of the gradient preconditioned as
``(G + damping I)^-1 grad (A + damping I)^-1``, as the pipelines' layers are. They are kept beside the
pipelines because the routes of gradients to their owners and the rows of ``kfac.precondition=rows`` take a
Parameter whole, and the three blocks are one Parameter. A module called for self-attention never runs its
blocks, and its packed ``in_proj`` stays one layer of the pipelines.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, cast

import torch
from torch import Tensor, nn

from kfacflow.kfac.layers import KFACLayer
from kfacflow.kfac.sides.factors import SideFactors, SideParts
from kfacflow.kfac.stages.inverse import eigen_inverse

if TYPE_CHECKING:
    from kfacflow.kfac.multihead import RowBlock

logger = logging.getLogger(__name__)

BLOCKS = ("q", "k", "v")
"""The last part of each row block's layer name (``dec.multihead_attn.in_proj.q``)."""


class CrossProjections(SideFactors):
    """The row blocks' factors, inverses and updates, one ``(update, gradient)`` pair a module.

    Its :attr:`inverses`: each block's ``(A + damping I)^-1`` and ``(G + damping I)^-1``, by its layer name.

    Args:
        blocks: Each held module's row blocks, by its in_proj's layer name
            (:attr:`~kfacflow.kfac.multihead.HeldAttention.blocks`).
        parts: What a side block is handed (:class:`~kfacflow.kfac.sides.factors.SideParts`).
    """

    what = "a cross-attention block"

    def __init__(self, blocks: dict[str, tuple[RowBlock, ...]], parts: SideParts) -> None:
        self.groups = {
            name: [KFACLayer(f"{name}.{b}", block) for b, block in zip(BLOCKS, held, strict=True)]
            for name, held in blocks.items()
        }
        layers = [layer for group in self.groups.values() for layer in group]
        super().__init__(layers, parts)
        self._live: list[str] = []

    def _module(self, name: str) -> nn.MultiheadAttention:
        block = cast("RowBlock", self.groups[name][0].module)
        return block.held[0]

    def _crossed(self, name: str) -> bool:
        """Whether the module was called for cross-attention (its blocks ran; none of a module that did not has)."""
        return getattr(vars(self._module(name)).get("forward"), "mode", None) == "cross"

    def _param_list(self, name: str) -> list[Tensor]:
        module = self._module(name)
        bias = module.in_proj_bias
        return [module.in_proj_weight, *([bias] if bias is not None and bias.requires_grad else [])]

    @property
    def params(self) -> list[Tensor]:
        """The packed projections whose blocks have factors (called for cross-attention)."""
        return [p for name in self.groups if self._crossed(name) for p in self._param_list(name)]

    def _invert(self) -> None:
        """Every block's two inverses from its running factors (on rank 0, broadcast)."""
        damping = self.schedule.damping
        for layer in (layer for name, group in self.groups.items() if self._crossed(name) for layer in group):
            a, g = self.factor(layer, "A"), self.factor(layer, "G")
            if a is None or g is None:
                continue

            def make(a: Tensor = a, g: Tensor = g) -> list[Tensor]:
                return [eigen_inverse(a, damping).dense(), eigen_inverse(g, damping).dense()]

            shapes = [(layer.a_dim, layer.a_dim), (layer.g_dim, layer.g_dim)]
            self.inverses[layer.name] = self.from_rank0(make, shapes)

    def _grad(self, name: str) -> Tensor | None:
        """The packed projection's gradient as ``(3E, E)``, its bias's as a last column where it is trained."""
        grads = [p.grad for p in self._param_list(name)]
        if grads[0] is None or (len(grads) == 2 and grads[1] is None):
            return None
        return torch.cat([grads[0], grads[1][:, None]], dim=1) if grads[1:] and grads[1] is not None else grads[0]

    def pairs(self) -> list[tuple[Tensor, Tensor]]:
        """Each module's ``(update, gradient)``, flat, where all three blocks have inverses and it has a gradient."""
        self.blend_arrived()
        crossed = sum(len(group) for name, group in self.groups.items() if self._crossed(name))
        if crossed and (self.schedule.inverts() or len(self.inverses) < crossed):
            self._invert()
        self._live, out = [], []
        with torch.no_grad():
            for name, group in self.groups.items():
                grad = self._grad(name) if self._crossed(name) else None
                if grad is None or any(layer.name not in self.inverses for layer in group):
                    continue
                wide = torch.promote_types(self.dtype, grad.dtype)
                rows = grad.to(wide).chunk(3)
                parts = [self.inverses[layer.name] for layer in group]
                update = torch.cat([g_inv @ r @ a_inv for r, (a_inv, g_inv) in zip(rows, parts, strict=True)])
                out.append((update.to(grad.dtype).flatten(), grad.flatten()))
                self._live.append(name)
        return out

    def set_grads(self, updates: list[Tensor]) -> None:
        """Write :meth:`pairs`' final updates into the packed projections' gradients."""
        with torch.no_grad():
            for name, update in zip(self._live, updates, strict=True):
                params = self._param_list(name)
                mat = update.view(params[0].shape[0], -1)
                params[0].grad.copy_(mat[:, : params[0].shape[1]])  # type: ignore[union-attr]
                if len(params) == 2:
                    params[1].grad.copy_(mat[:, -1])  # type: ignore[union-attr]
        self._live = []
