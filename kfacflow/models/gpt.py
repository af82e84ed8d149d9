"""A GPT-style language model of kfacflow's own (``model.name=gpt``): byte ids in, a logit per position out.

Pre-norm blocks (norm, causal self-attention with one fused ``qkv`` Linear; norm, a 4x MLP), a learned
position embedding and a head tied to the token embedding by default. Every weight matrix is an
``nn.Linear``, so K-FAC preconditions them all; the tied head shares the embedding's Parameter, whose
gradient sums two uses: K-FAC takes it where ``kfac.kinds`` names ``tied`` (:mod:`kfacflow.kfac.sides.tied`).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from kfacflow import UserError
from kfacflow.models.attention import Attention

NORMS = {"layer": nn.LayerNorm, "rms": nn.RMSNorm}
"""``model.kwargs.norm``: LayerNorm (GPT-2's) or RMSNorm (LLaMA's)."""


class Block(nn.Module):
    """``x + attn(norm(x))``, then ``x + mlp(norm(x))`` (pre-norm, as GPT-2).

    Args:
        d_model: Width of the residual stream.
        n_head: Attention heads.
        norm: ``layer`` or ``rms``.
        dropout: Dropout of the attention and the MLP's output, in training.
    """

    def __init__(self, d_model: int, n_head: int, norm: str, dropout: float) -> None:
        super().__init__()
        self.norm1, self.norm2 = NORMS[norm](d_model), NORMS[norm](d_model)
        self.attn = Attention(d_model, n_head, dropout, causal=True)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model), nn.Dropout(dropout)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return the block's output, (B, T, d_model) as ``x``."""
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))  # type: ignore[no-any-return]


class GPT(nn.Module):
    """A decoder-only transformer over a vocabulary of ``vocab`` tokens (bytes: 256).

    Args:
        vocab: Tokens in the vocabulary (the data's ``num_classes``).
        n_layer: Blocks.
        n_head: Attention heads per block.
        d_model: Width of the residual stream.
        seq_len: The longest context the position embedding covers.
        norm: ``layer`` (LayerNorm) or ``rms`` (RMSNorm).
        tie: Whether the head's weight is the token embedding's Parameter.
        dropout: Dropout in training (0: none, and a multi-worker run equals one worker's).
    """

    takes_tokens = True
    """Its input is token ids, not images (the model checks say so when a recipe gives it images)."""

    def __init__(
        self, vocab: int, n_layer: int, n_head: int, d_model: int, seq_len: int, norm: str, tie: bool, dropout: float
    ) -> None:
        super().__init__()
        self.seq_len = seq_len
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(d_model, n_head, norm, dropout) for _ in range(n_layer))
        blocks: list[Block] = list(self.blocks)  # type: ignore[arg-type]
        self.norm = NORMS[norm](d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        for block in blocks:  # GPT-2's: the residual stream's variance does not grow with depth
            for out in (block.attn.proj, block.mlp[2]):
                nn.init.normal_(out.weight, std=0.02 / math.sqrt(2 * n_layer))  # type: ignore[arg-type]
        if tie:
            self.head.weight = self.tok.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Return the logits (B, T, vocab) of the next token at every position of ``idx`` (B, T) token ids.

        Raises:
            ValueError: ``idx`` is not a batch of integer token ids no longer than the model's context.
        """
        if idx.ndim != 2 or idx.is_floating_point() or idx.is_complex():
            raise ValueError(
                f"gpt takes (batch, tokens) integer token ids, not a {idx.dtype} tensor of shape {tuple(idx.shape)}; "
                "give it a text data set (data.name=python_source or text_files)"
            )
        if idx.shape[1] > self.seq_len:
            raise ValueError(
                f"windows of {idx.shape[1]} tokens are longer than the model's context of {self.seq_len} "
                "(model.kwargs.seq_len)"
            )
        x = self.drop(self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device)))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))  # type: ignore[no-any-return]


def _check(key: str, value: Any, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise UserError(f"model.kwargs.{key}={value!r} must be an int >= {low} (model.name=gpt).")


def build(
    num_classes: int,
    in_channels: int,
    n_layer: int = 4,
    n_head: int = 4,
    d_model: int = 128,
    seq_len: int = 128,
    norm: str = "layer",
    tie: bool = True,
    dropout: float = 0.0,
) -> nn.Module:
    """``model.name=gpt``: a :class:`GPT` over the data's vocabulary (``num_classes``); ``in_channels`` is unused.

    The defaults (4 blocks of width 128, 4 heads, a context of 128) train a useful amount on two CPU cores
    in minutes.

    Raises:
        UserError: A ``model.kwargs`` value it cannot take, naming it.
    """
    for key, value in (("n_layer", n_layer), ("n_head", n_head), ("d_model", d_model), ("seq_len", seq_len)):
        _check(key, value, 1)
    if d_model % n_head:
        raise UserError(
            f"model.kwargs.d_model={d_model} must split evenly among model.kwargs.n_head={n_head} heads; "
            f"e.g. d_model={n_head * max(1, round(d_model / n_head))}."
        )
    if norm not in NORMS:
        raise UserError(f"model.kwargs.norm={norm!r}: gpt's norm is one of {', '.join(NORMS)}.")
    if not isinstance(tie, bool):
        raise UserError(f"model.kwargs.tie={tie!r} must be true or false (model.name=gpt).")
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        raise UserError(f"model.kwargs.dropout={dropout!r} must be a number in [0, 1) (model.name=gpt).")
    return GPT(num_classes, n_layer, n_head, d_model, seq_len, norm, tie, float(dropout))
