"""Multi-head self-attention for kfacflow's own transformers (``vit``, ``gpt``), made of layers K-FAC preconditions.

One fused ``qkv`` ``nn.Linear`` and an output ``nn.Linear`` around ``F.scaled_dot_product_attention``,
called as modules. (K-FAC takes an ``nn.MultiheadAttention``'s projections too, by giving the module a
forward of its own while it holds it: :mod:`kfacflow.kfac.multihead`; these blocks need none.)
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn


class Attention(nn.Module):
    """Multi-head self-attention: one fused ``qkv`` projection, ``scaled_dot_product_attention``, ``proj``.

    Args:
        dim: Width of the tokens.
        heads: Attention heads (``dim`` must be a multiple).
        dropout: Dropout of the attention weights and of the output (training only).
        causal: Whether each token attends to itself and the tokens before it only (a language model).
    """

    def __init__(self, dim: int, heads: int, dropout: float = 0.0, causal: bool = False) -> None:
        super().__init__()
        self.heads, self.dropout, self.causal = heads, dropout, causal
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        """Return the attended tokens, ``(N, T, dim)`` as ``x``."""
        n, t, d = x.shape
        q, k, v = self.qkv(x).reshape(n, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        dropout = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal, dropout_p=dropout)
        return self.drop(self.proj(y.transpose(1, 2).reshape(n, t, d)))  # type: ignore[no-any-return]
