"""A MultiheadAttention called for cross-attention: its packed in_proj's query, key and value rows as three layers."""

from __future__ import annotations

import copy
import logging
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers import agree_with_one_process, double_batch_trails, kfac_step, resumed_as_uninterrupted
from test_stage_equivalence import PROFILE
from torch import Tensor, nn

from kfacflow.comm.torch_dist import TorchBackend
from kfacflow.configuration.schema import KFACConfig
from kfacflow.kfac.preconditioner import Preconditioner
from kfacflow.running import build

DT = torch.float64
N, S, E, HEADS, C = 4, 3, 6, 2, 3
BLOCKS = ("q", "k", "v")


class Cross(nn.Module):
    """A query from the input, keys and values from a memory made of it, through one MultiheadAttention."""

    def __init__(self, bias: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.memory = nn.Linear(E, E)
        self.attn = nn.MultiheadAttention(E, HEADS, batch_first=True, bias=bias)
        self.head = nn.Linear(E, C)

    def forward(self, x: Tensor) -> Tensor:
        m = torch.tanh(self.memory(x.flip(1)))
        h, _ = self.attn(x, m, m, need_weights=False)
        return self.head(h.mean(dim=1))  # type: ignore[no-any-return]


class Twin(nn.Module):
    """The same computation with the query, key and value projections as three nn.Linear layers."""

    def __init__(self, cross: Cross) -> None:
        super().__init__()
        self.memory, self.head = copy.deepcopy(cross.memory), copy.deepcopy(cross.head)
        self.out_proj = copy.deepcopy(cross.attn.out_proj)
        bias = cross.attn.in_proj_bias
        self.proj = nn.ModuleDict()
        for i, name in enumerate(BLOCKS):
            layer = nn.Linear(E, E, bias=bias is not None).to(DT)
            with torch.no_grad():
                layer.weight.copy_(cross.attn.in_proj_weight[i * E : (i + 1) * E])
                if bias is not None:
                    layer.bias.copy_(bias[i * E : (i + 1) * E])
            self.proj[name] = layer

    def forward(self, x: Tensor) -> Tensor:
        m = torch.tanh(self.memory(x.flip(1)))
        qkv = (self.proj["q"](x), self.proj["k"](m), self.proj["v"](m))
        q, k, v = (t.unflatten(-1, (HEADS, E // HEADS)).transpose(1, 2) for t in qkv)
        h = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2)
        return self.head(self.out_proj(h).mean(dim=1))  # type: ignore[no-any-return]


def data(seed: int, n: int = N) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, S, E, generator=gen, dtype=DT), torch.randint(0, C, (n,), generator=gen)


def grad_matrix(weight: Tensor, bias: Tensor | None) -> Tensor:
    assert weight.grad is not None
    return weight.grad if bias is None else torch.cat([weight.grad, bias.grad[:, None]], dim=1)  # type: ignore[index]


@pytest.mark.parametrize(("factor", "bias"), [("expand", True), ("reduce", True), ("expand", False)])
def test_the_blocks_factors_and_updates_are_those_of_three_linear_layers(
    backend: TorchBackend, caplog: pytest.LogCaptureFixture, factor: str, bias: bool
) -> None:
    cross = Cross(bias).to(DT)
    twin = Twin(cross)
    cfg = KFACConfig(factor=factor, factor_decay=0.0, kl_clip=0.0, damping=0.01)
    pre, pre_twin = build.preconditioner(cross, cfg, backend), build.preconditioner(twin, cfg, backend)
    x, y = data(1)
    with caplog.at_level(logging.INFO, logger="kfacflow"):
        for model, p in ((cross, pre), (twin, pre_twin)):
            kfac_step(model, p, x, y)
    blocks = pre.cross
    updated = grad_matrix(cross.attn.in_proj_weight, cross.attn.in_proj_bias).chunk(3)
    for name, update in zip(BLOCKS, updated, strict=True):
        for side in "AG":
            got = blocks.factor(blocks.groups["attn.in_proj"][BLOCKS.index(name)], side)
            torch.testing.assert_close(got, pre_twin.factors[f"proj.{name}/{side}"], rtol=1e-12, atol=1e-14)
        layer = twin.proj[name]
        assert isinstance(layer, nn.Linear)
        torch.testing.assert_close(update, grad_matrix(layer.weight, layer.bias), rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(cross.attn.out_proj.weight.grad, twin.out_proj.weight.grad, rtol=1e-9, atol=1e-12)
    assert [layer.name for layer in pre.layers] == ["memory", "attn.out_proj", "head"]
    assert "K-FAC takes attn.in_proj otherwise: attn (MultiheadAttention) is called with" in caplog.text
    assert [id(p) for p in blocks.params] == [id(p) for p in (cross.attn.in_proj_weight, cross.attn.in_proj_bias)][
        : 1 + bias
    ]
    pre.remove()
    pre_twin.remove()
    assert "forward" not in vars(cross.attn)


def test_a_checkpoint_mid_run_resumes_as_the_uninterrupted_run(backend: TorchBackend) -> None:
    cfg = KFACConfig(damping=0.01, kl_clip=0.01, inv_update_freq=2, factor_decay=0.8)
    batches = [data(seed) for seed in range(5)]
    saved = resumed_as_uninterrupted(backend, lambda: Cross().to(DT), cfg, batches)
    assert set(saved["kfac"]["cross"]["inverses"]) == {f"attn.in_proj.{b}" for b in BLOCKS}


VARIANTS = ("d", "mpd", "spd", "flow")


def train_variants(rank: int, world: int, variants: tuple[str, ...]) -> dict[str, Any]:
    return double_batch_trails(rank, world, variants, lambda: Cross().to(DT), data, N, _blocks_held, PROFILE)


def _blocks_held(pre: Preconditioner) -> None:
    assert set(pre.cross.inverses) == {f"attn.in_proj.{b}" for b in BLOCKS}


@pytest.mark.slow
def test_d_mpd_spd_and_flow_agree_and_equal_one_process_on_the_double_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    agree_with_one_process(monkeypatch, train_variants, VARIANTS)
