"""An embedding is a Linear on one-hot tokens: its factors, updates and skips, by hand in float64."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from helpers import kfac_step
from torch import Tensor, nn

from kfacflow import UserError
from kfacflow.comm.torch_dist import TorchBackend
from kfacflow.configuration.rules import kfac_section
from kfacflow.configuration.schema import KFACConfig
from kfacflow.kfac.layers import EMBEDDING_ROWS, find_layers
from kfacflow.kfac.left_out import kinds_left
from kfacflow.kfac.preconditioner import Preconditioner
from kfacflow.running import build

DT = torch.float64
V, D, N, S, C = 7, 4, 5, 6, 3
KINDS = ["linear", "conv2d", "embedding"]


class Tokens(nn.Module):
    """Tokens through an embedding (or the same weight as a Linear on one-hot rows), pooled, then a head."""

    def __init__(self, one_hot: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        emb, head = nn.Embedding(V, D), nn.Linear(D, C)
        self.one_hot = one_hot
        self.emb: nn.Module = nn.Linear(V, D, bias=False) if one_hot else emb
        if one_hot:
            with torch.no_grad():
                self.emb.weight.copy_(emb.weight.T)
        self.head = head

    def forward(self, x: Tensor) -> Tensor:
        h = self.emb(F.one_hot(x, V).to(DT)) if self.one_hot else self.emb(x)
        return self.head(torch.tanh(h).mean(dim=1))


def data(seed: int) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (N, S), generator=gen), torch.randint(0, C, (N,), generator=gen)


def step(model: nn.Module, pre: Preconditioner, x: Tensor, y: Tensor, lr: float = 0.1) -> None:
    kfac_step(model, pre, x, y, lr)
    with torch.no_grad():
        for p in model.parameters():
            assert p.grad is not None
            p.sub_(lr * p.grad)


@pytest.mark.parametrize("factor", ["expand", "reduce"])
def test_an_embedding_trains_as_a_linear_on_one_hot_tokens(backend: TorchBackend, factor: str) -> None:
    runs = {}
    for one_hot in (False, True):
        model = Tokens(one_hot).to(DT)
        cfg = KFACConfig(kinds=KINDS, factor=factor, damping=0.01, kl_clip=0.01, inv_update_freq=2)
        pre = build.preconditioner(model, cfg, backend)
        for seed in range(4):
            step(model, pre, *data(seed))
        runs[one_hot] = (model, {k: v.clone() for k, v in pre.factors.items()})
    (emb_model, emb_factors), (lin_model, lin_factors) = runs[False], runs[True]
    assert emb_factors.keys() == lin_factors.keys() == {"emb/A", "emb/G", "head/A", "head/G"}
    for key, value in lin_factors.items():
        torch.testing.assert_close(emb_factors[key], value, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(emb_model.emb.weight, lin_model.emb.weight.T, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(emb_model.head.weight, lin_model.head.weight, rtol=1e-10, atol=1e-12)


def test_an_embeddings_factors_by_hand(backend: TorchBackend) -> None:
    model = Tokens().to(DT)
    seen: dict[str, Tensor] = {}

    def spy(module: nn.Module, inputs: tuple[Tensor, ...], out: Tensor) -> None:
        out.register_hook(lambda g: seen.__setitem__("go", g.clone()))

    model.emb.register_forward_hook(spy)
    pre = build.preconditioner(model, KFACConfig(kinds=KINDS, factor_decay=0.0), backend)
    x, y = data(1)
    step(model, pre, x, y)
    # expand: every token a row; A = how often each token was seen, over N S rows: diagonal.
    counts = torch.bincount(x.flatten(), minlength=V).to(DT)
    torch.testing.assert_close(pre.factors["emb/A"], torch.diag(counts) / (N * S), rtol=0, atol=0)
    dg = N * seen["go"]
    torch.testing.assert_close(pre.factors["emb/G"], torch.einsum("nti,ntj->ij", dg, dg) / N, rtol=1e-12, atol=1e-14)
    layer = next(lay for lay in pre.layers if lay.name == "emb")
    assert (layer.a_dim, layer.g_dim, layer.has_bias, layer.by_rows) == (V, D, False, False)


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.lm_head = nn.Linear(D, V, bias=False)
        self.lm_head.weight = self.emb.weight


def test_embeddings_k_fac_cannot_describe_are_named_and_left_out(caplog: pytest.LogCaptureFixture) -> None:
    cases = {
        "sparse": nn.Embedding(V, D, sparse=True),
        "max_norm": nn.Embedding(V, D, max_norm=1.0),
        "scale_grad_by_freq": nn.Embedding(V, D, scale_grad_by_freq=True),
        "wider than": nn.Embedding(EMBEDDING_ROWS + 1, 2),
    }
    for words, emb in cases.items():
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="kfacflow.kfac.layers"):
            assert find_layers(nn.Sequential(emb), [], ("embedding",)) == []
        assert words in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="kfacflow.kfac.layers"):
        assert find_layers(Tied(), [], tuple(KINDS)) == []
    assert "its weight is shared with" in caplog.text and caplog.text.count("K-FAC skips") == 2


def test_kinds_left_out_are_named_once(backend: TorchBackend, caplog: pytest.LogCaptureFixture) -> None:
    assert [lay.name for lay in find_layers(Tokens(), [])] == ["head"]
    assert kinds_left(Tokens(), ("linear",)) == ("embedding",) and kinds_left(Tokens(), tuple(KINDS)) == ()
    with caplog.at_level(logging.INFO, logger="kfacflow.kfac"):
        model = Tokens().to(DT)
        pre = build.preconditioner(model, KFACConfig(), backend)
        step(model, pre, *data(1))
        step(model, pre, *data(2))
    lines = [r.getMessage() for r in caplog.records if "to the optimizer alone" in r.getMessage()]
    assert lines == ["K-FAC leaves 1 parameter tensor to the optimizer alone: emb.weight; kfac.kinds may add embedding"]


def test_a_kind_misspelt_is_one_line_naming_the_key() -> None:
    with pytest.raises(UserError, match=r"kinds: 'embeding' is not a kind .* Did you mean 'embedding'\?"):
        kfac_section({"kinds": ["linear", "embeding"]}, "KFACPreconditioner")


@pytest.mark.parametrize("factor", ["expand", "reduce"])
def test_the_padding_row_stays_as_it_was(backend: TorchBackend, factor: str) -> None:
    model = Tokens().to(DT)
    model.emb = nn.Embedding(V, D, padding_idx=0).to(DT)
    before = model.emb.weight.detach().clone()
    pre = build.preconditioner(model, KFACConfig(kinds=KINDS, factor=factor, damping=0.01), backend)
    for seed in range(3):
        step(model, pre, *data(seed))
    assert torch.equal(model.emb.weight[0], before[0])
    assert not torch.equal(model.emb.weight[1:], before[1:])  # the other rows did train
