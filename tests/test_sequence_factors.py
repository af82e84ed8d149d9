"""A Linear shared across a sequence: K-FAC-expand and K-FAC-reduce (Eschenhagen et al. 2023) by hand, float64.

A transformer's Linear layers see ``(N, S, E)``: every token of every example passes the same weight,
as every position of an image passes a convolution's. ``kfac.factor=expand`` counts each token as a
row; ``reduce`` averages each example's inputs over its tokens and sums its output gradients, so the
factors come from ``N`` rows. Both agree across D, MPD, SPD and flow on two gloo ranks, an embedding in front.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers import kfac_step, run_in_gloo, variant_steps
from torch import Tensor, nn

from kfacflow.comm.torch_dist import TorchBackend
from kfacflow.configuration.schema import DistConfig, KFACConfig
from kfacflow.perf import InverseModel, LinearModel, Profile
from kfacflow.running import build

DT = torch.float64
N, S, E, C = 4, 5, 8, 3


class Block(nn.Module):
    """A pre-norm attention and MLP block over tokens, then a mean-pooled head (``seq_first``: ``(S, N, E)`` inside)."""

    def __init__(self, seq_first: bool = False) -> None:
        super().__init__()
        self.seq_first = seq_first
        self.norm = nn.LayerNorm(E)
        self.qkv = nn.Linear(E, 3 * E)
        self.out = nn.Linear(E, E)
        self.fc1 = nn.Linear(E, 2 * E)
        self.fc2 = nn.Linear(2 * E, E, bias=False)
        self.head = nn.Linear(E, C)

    def forward(self, x: Tensor) -> Tensor:  # x: (N, S, E)
        h = x.transpose(0, 1) if self.seq_first else x
        q, k, v = self.qkv(self.norm(h)).chunk(3, dim=-1)
        heads = [t.transpose(0, 1) if self.seq_first else t for t in (q, k, v)]  # (N, S, E) for attention
        q, k, v = (t.unflatten(-1, (2, E // 2)).transpose(1, 2) for t in heads)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2)
        h = h + self.out(att.transpose(0, 1) if self.seq_first else att)
        h = h + self.fc2(torch.tanh(self.fc1(h)))
        pooled = h.mean(dim=0 if self.seq_first else 1)
        return self.head(pooled)


def block(seq_first: bool = False) -> Block:
    torch.manual_seed(0)
    return Block(seq_first).to(DT)


VOCAB = 11


class TokenBlock(nn.Module):
    """Tokens through an embedding into the block (``kfac.kinds`` with ``embedding``)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, E)
        self.block = Block()

    def forward(self, x: Tensor) -> Tensor:
        return self.block(self.emb(x))


def data(seed: int, n: int = N) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, S, E, generator=gen, dtype=DT), torch.randint(0, C, (n,), generator=gen)


def spy(module: nn.Module) -> dict[str, Tensor]:
    seen: dict[str, Tensor] = {}

    def hook(mod: nn.Module, inputs: tuple[Tensor, ...], out: Tensor) -> None:
        seen["x"] = inputs[0].detach().clone()
        out.register_hook(lambda g: seen.__setitem__("go", g.detach().clone()))

    module.register_forward_hook(hook)
    return seen


def with_ones(x: Tensor) -> Tensor:
    return torch.cat([x, torch.ones(*x.shape[:-1], 1, dtype=DT)], dim=-1)


@pytest.mark.parametrize("factor", ["expand", "reduce"])
def test_a_linear_over_tokens_by_hand(backend: TorchBackend, factor: str) -> None:
    model = block()
    seen = {name: spy(getattr(model, name)) for name in ("qkv", "fc1", "fc2")}
    pre = build.preconditioner(model, KFACConfig(factor=factor, factor_decay=0.0, kl_clip=0.0, damping=0.01), backend)
    kfac_step(model, pre, *data(1))
    for name, rec in seen.items():
        a = with_ones(rec["x"]) if getattr(model, name).bias is not None else rec["x"]  # (N, S, a_dim)
        dg = N * rec["go"]  # the per-example gradient: N undoes the batch mean's 1/N
        if factor == "expand":  # every token a row: A = 1/(N S) sum a a^T, G = 1/N sum_{n,t} Dg Dg^T
            want_a = torch.einsum("nti,ntj->ij", a, a) / (N * S)
            want_g = torch.einsum("nti,ntj->ij", dg, dg) / N
        else:  # each example a row: its inputs averaged over tokens, its output gradients summed
            mean_a, sum_g = a.mean(dim=1), dg.sum(dim=1)
            want_a = mean_a.T @ mean_a / N
            want_g = sum_g.T @ sum_g / N
        torch.testing.assert_close(pre.factors[f"{name}/A"], want_a, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(pre.factors[f"{name}/G"], want_g, rtol=1e-12, atol=1e-14)


def test_reduce_and_expand_differ_and_reduce_takes_one_row_an_example(backend: TorchBackend) -> None:
    factors = {}
    for factor in ("expand", "reduce"):
        model = block()
        pre = build.preconditioner(model, KFACConfig(factor=factor, factor_decay=0.0), backend)
        kfac_step(model, pre, *data(1))
        factors[factor] = pre.factors["fc1/A"]
    assert not torch.allclose(factors["expand"], factors["reduce"])
    # The ones column of the bias: its corner is the mean of ones, whatever the rows are.
    assert factors["reduce"][-1, -1].item() == pytest.approx(1.0)


@pytest.mark.parametrize("factor", ["expand", "reduce"])
def test_sequence_first_inputs_give_the_factors_of_batch_first_ones(backend: TorchBackend, factor: str) -> None:
    """``(S, N, E)`` (``batch_first=False``) is turned examples first for ``reduce``; ``expand`` needs no order."""
    got = {}
    for seq_first in (False, True):
        model = block(seq_first)
        pre = build.preconditioner(model, KFACConfig(factor=factor, factor_decay=0.0, damping=0.01), backend)
        for seed in (1, 2):
            kfac_step(model, pre, *data(seed))
        got[seq_first] = (
            {k: v.clone() for k, v in pre.factors.items()},
            [p.detach().clone() for p in model.parameters()],
        )
    (bf_factors, bf_params), (sf_factors, sf_params) = got[False], got[True]
    assert bf_factors.keys() == sf_factors.keys() and "qkv/A" in bf_factors
    for key, value in bf_factors.items():
        torch.testing.assert_close(sf_factors[key], value, rtol=1e-10, atol=1e-12)
    for p, q in zip(bf_params, sf_params, strict=True):
        torch.testing.assert_close(q, p, rtol=1e-10, atol=1e-12)


VARIANTS = ("d", "mpd", "spd", "flow")
STEPS = 4
PROFILE = Profile(  # cheap broadcasts and costly large inverses: SPD's placement mixes owners and shared inverses
    allreduce=LinearModel(alpha=1e-3, beta=1e-9),
    broadcast=LinearModel(alpha=1e-4, beta=0.0),
    inverse=InverseModel("cubic", 0.0, 1e-6),
)


def train_variants(
    rank: int, world: int, factor: str, make: Callable[[], nn.Module] = TokenBlock, layer: str = "emb"
) -> dict[str, Any]:
    """Train ``make()`` on token ids with each variant; every step's parameters. ``layer`` must be preconditioned."""
    backend = TorchBackend(DistConfig(device="cpu"))
    out: dict[str, Any] = {}
    try:
        for variant in VARIANTS:
            cfg = KFACConfig(
                variant=variant,
                factor=factor,
                kinds=["linear", "embedding"],
                damping=0.01,
                kl_clip=0.01,
                inv_update_freq=2,
                profile_steps=2,
            )
            batches = []
            for i in range(STEPS):
                gen = torch.Generator().manual_seed(10 + i)
                x = torch.randint(0, VOCAB, (world * N, S), generator=gen)
                batches.append((x, torch.randint(0, C, (world * N,), generator=gen)))
            part = slice(rank * N, (rank + 1) * N)
            trail, pre = variant_steps(backend, make().to(DT), cfg, PROFILE, batches, part)
            assert layer in [kept.name for kept in pre.layers]
            pre.remove()
            out[variant] = trail
    finally:
        backend.close()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("factor", ["expand", "reduce"])
def test_d_mpd_spd_and_flow_agree_step_for_step_on_tokens(factor: str) -> None:
    """An embedding and Linear layers over tokens: the ranks hold one model, every variant D-KFAC's."""
    agree(run_in_gloo(train_variants, 2, factor))


def agree(ranks: list[dict[str, Any]]) -> None:
    """The ranks hold one model at every step, and every variant's is D-KFAC's; the parameters changed."""
    for variant in VARIANTS:
        for step_params, other_rank in zip(ranks[0][variant], ranks[1][variant], strict=True):
            for p, q in zip(step_params, other_rank, strict=True):
                assert torch.equal(p, q), f"{variant}: the ranks differ"
        for mine, d_kfac in zip(ranks[0][variant], ranks[0]["d"], strict=True):
            for p, q in zip(mine, d_kfac, strict=True):
                torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12)
    first, last = ranks[0]["d"][0], ranks[0]["d"][-1]
    assert any(not torch.allclose(p, q) for p, q in zip(first, last, strict=True))
