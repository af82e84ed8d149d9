"""``nn.MultiheadAttention``'s projections as Linear layers: its forward through module calls, its factors by hand.

K-FAC gives a MultiheadAttention it holds a forward that calls ``out_proj`` and the packed ``in_proj``
as modules (:mod:`kfacflow.kfac.multihead`); it must compute what the class's forward computes and
leave the model's parameters and ``state_dict`` as they were. The factors of both projections in an
``nn.TransformerEncoderLayer`` are checked against an explicit computation in float64, and the four
variants agree step for step on two gloo ranks.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers import run_in_gloo
from test_sequence_factors import VOCAB, C, E, N, S, agree, train_variants, with_ones
from torch import Tensor, nn

from kfacflow import UserError
from kfacflow.comm.torch_dist import TorchBackend
from kfacflow.configuration.schema import KFACConfig
from kfacflow.kfac.layers import find_layers
from kfacflow.kfac.left_out import log_left
from kfacflow.kfac.multihead import HeldAttention, PackedProjection
from kfacflow.running import build

DT = torch.float64
HEADS = 2
CAUSAL = nn.Transformer.generate_square_subsequent_mask(S, dtype=DT)


class Holder(nn.Module):
    def __init__(self, batch_first: bool, dropout: float = 0.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.attn = nn.MultiheadAttention(E, HEADS, dropout=dropout, batch_first=batch_first).to(DT)


def held(model: Holder) -> HeldAttention:
    return HeldAttention(model, {"attn.in_proj": PackedProjection(model.attn), "attn.out_proj": model.attn.out_proj})


def call(case: str, batch_first: bool, weights: str) -> tuple[tuple[Tensor, Tensor, Tensor], dict[str, Any]]:
    """The arguments of one call: self-attention (masked as ``case`` says) or cross-attention on a memory."""
    gen = torch.Generator().manual_seed(3)
    x, memory = torch.randn(N, S, E, generator=gen, dtype=DT), torch.randn(N, S + 2, E, generator=gen, dtype=DT)
    if not batch_first:
        x, memory = x.transpose(0, 1).contiguous(), memory.transpose(0, 1).contiguous()
    qkv = {"cross": (x, memory, 2 * memory), "kv": (x, memory, memory)}.get(case, (x, x, x))
    source = qkv[1].shape[1 if batch_first else 0]
    kw: dict[str, Any] = {"need_weights": weights != "none", "average_attn_weights": weights == "mean"}
    if case == "causal":
        kw |= {"attn_mask": CAUSAL, "is_causal": True}
    padding = torch.zeros(N, source, dtype=torch.bool)
    padding[0, -2:] = True  # boolean masks with boolean masks, additive ones with additive ones, as torch asks
    if case == "padding":
        hidden = torch.rand(S, source, generator=gen) < 0.3
        hidden[:, 0] = False  # every query sees a key
        kw |= {"key_padding_mask": padding, "attn_mask": hidden}
    additive = torch.zeros(N, source, dtype=DT).masked_fill(padding, float("-inf"))
    if case == "kv":
        kw |= {"key_padding_mask": additive, "attn_mask": torch.rand(S, source, generator=gen, dtype=DT)}
    if case == "per_head":
        kw |= {"attn_mask": torch.rand(N * HEADS, S, source, generator=gen, dtype=DT), "key_padding_mask": additive}
    return qkv, kw


def run(model: Holder, qkv: tuple[Tensor, Tensor, Tensor], kw: dict[str, Any]) -> list[Tensor]:
    """The output, the weights (if any) and every parameter's gradient of one call."""
    model.zero_grad()
    out, weights = model.attn(*qkv, **kw)
    (out.sin().sum() + (0 if weights is None else weights.square().sum())).backward()
    return [out.detach(), *([] if weights is None else [weights.detach()])] + [p.grad for p in model.parameters()]


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("weights", ["none", "mean", "heads"])
@pytest.mark.parametrize("case", ["self", "causal", "padding", "per_head", "cross", "kv"])
def test_the_forward_k_fac_gives_computes_what_multihead_attention_computes(
    batch_first: bool, weights: str, case: str
) -> None:
    model = Holder(batch_first)
    keys, params = list(model.state_dict()), [id(p) for p in model.parameters()]
    qkv, kw = call(case, batch_first, weights)
    want = run(model, qkv, kw)
    hold = held(model)
    assert "forward" in vars(model.attn)
    got = run(model, qkv, kw)
    assert list(model.state_dict()) == keys and [id(p) for p in model.parameters()] == params
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-13)
    hold.remove()
    assert "forward" not in vars(model.attn)


def test_unbatched_inputs_and_dropout_in_training_draw_what_multihead_attention_draws() -> None:
    for need_weights in (True, False):
        model = Holder(batch_first=True, dropout=0.3)
        x = torch.randn(S, E, dtype=DT)
        runs = []
        for hold in (False, True):
            holding = held(model) if hold else None
            torch.manual_seed(7)
            runs.append(run(model, (x, x, x), {"need_weights": need_weights}))
            if holding is not None:
                holding.remove()
        for g, w in zip(*runs, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-13)


def test_self_attention_then_cross_attention_is_an_error() -> None:
    model = Holder(batch_first=True)
    held(model)
    (x, _, _), _ = call("self", True, "none")
    (_, memory, _), _ = call("cross", True, "none")
    model.attn(x, x, x)
    with pytest.raises(UserError, match=r"attn \(MultiheadAttention\) was called as self-attention.*kfac.skip"):
        model.attn(x, memory, memory)


def test_a_second_preconditioner_on_a_held_module_is_refused_and_claims_nothing(backend: TorchBackend) -> None:
    model = nn.Sequential(nn.MultiheadAttention(E, HEADS))
    first = build.preconditioner(model, KFACConfig(skip=["0.out_proj"]), backend)
    with pytest.raises(UserError, match=r"'0' \(MultiheadAttention\) is already held by another K-FAC"):
        build.preconditioner(model, KFACConfig(skip=["0.in_proj"]), backend)
    first.remove()
    assert "forward" not in vars(model[0])
    second = build.preconditioner(model, KFACConfig(skip=["0.in_proj"]), backend)
    assert [layer.name for layer in second.layers] == ["0.out_proj"] and "forward" in vars(model[0])


class EncoderHead(nn.Module):
    """One post-norm ``nn.TransformerEncoderLayer`` (causal), mean-pooled, then a head; ``(N, S, E)`` inputs."""

    def __init__(self, batch_first: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.batch_first = batch_first
        self.layer = nn.TransformerEncoderLayer(E, HEADS, 2 * E, dropout=0.0, batch_first=batch_first)
        self.head = nn.Linear(E, C)

    def forward(self, x: Tensor) -> Tensor:
        h = self.layer(x if self.batch_first else x.transpose(0, 1), src_mask=CAUSAL, is_causal=True)
        return self.head(h.mean(dim=1 if self.batch_first else 0))  # type: ignore[no-any-return]

    def by_hand(self, x: Tensor, y: Tensor) -> tuple[Tensor, dict[str, tuple[Tensor, Tensor]]]:
        """The loss, and each projection's input and output gradient, of the same computation written out."""
        layer = self.layer
        qkv = F.linear(x, layer.self_attn.in_proj_weight, layer.self_attn.in_proj_bias)
        q, k, v = (t.unflatten(-1, (HEADS, E // HEADS)).transpose(1, 2) for t in qkv.chunk(3, dim=-1))
        heads = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2)
        o = F.linear(heads, layer.self_attn.out_proj.weight, layer.self_attn.out_proj.bias)
        h = layer.norm1(x + o)
        h = layer.norm2(h + layer.linear2(F.relu(layer.linear1(h))))
        loss = F.cross_entropy(self.head(h.mean(dim=1)), y)
        d_qkv, d_o = torch.autograd.grad(loss, [qkv, o])
        prefix = "layer.self_attn"
        return loss, {f"{prefix}.in_proj": (x, d_qkv), f"{prefix}.out_proj": (heads.detach(), d_o)}


def grad_matrix(weight: Tensor, bias: Tensor) -> Tensor:
    assert weight.grad is not None and bias.grad is not None
    return torch.cat([weight.grad, bias.grad[:, None]], dim=1).clone()


def damped_inverse(f: Tensor, damping: float) -> Tensor:
    return torch.linalg.inv(f + damping * torch.eye(f.shape[0], dtype=DT))


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("factor", ["expand", "reduce"])
def test_an_encoder_layers_projections_factors_and_update_by_hand(
    backend: TorchBackend, batch_first: bool, factor: str
) -> None:
    damping = 0.01
    model = EncoderHead(batch_first).to(DT)
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(N, S, E, generator=gen, dtype=DT), torch.randint(0, C, (N,), generator=gen)
    loss, seen = model.by_hand(x, y)
    cfg = KFACConfig(factor=factor, factor_decay=0.0, kl_clip=0.0, damping=damping)
    pre = build.preconditioner(model, cfg, backend)
    model.zero_grad()
    out = model(x)
    pre.end_forward()
    torch.testing.assert_close(F.cross_entropy(out, y), loss, rtol=1e-12, atol=0)
    F.cross_entropy(out, y).backward()
    attn = model.layer.self_attn
    params = {"in_proj": (attn.in_proj_weight, attn.in_proj_bias), "out_proj": tuple(attn.out_proj.parameters())}
    raw = {name: grad_matrix(*pair) for name, pair in params.items()}
    pre.step(lr=0.1)
    names = [layer.name for layer in pre.layers]
    assert names == ["layer.self_attn.in_proj", "layer.self_attn.out_proj", "layer.linear1", "layer.linear2", "head"]
    for name, (inputs, grad_out) in seen.items():
        a, dg = with_ones(inputs), N * grad_out  # N undoes the batch mean's 1/N
        if factor == "expand":
            want_a = torch.einsum("nti,ntj->ij", a, a) / (N * S)
            want_g = torch.einsum("nti,ntj->ij", dg, dg) / N
        else:
            mean_a, sum_g = a.mean(dim=1), dg.sum(dim=1)
            want_a, want_g = mean_a.T @ mean_a / N, sum_g.T @ sum_g / N
        torch.testing.assert_close(pre.factors[f"{name}/A"], want_a, rtol=1e-11, atol=1e-13)
        torch.testing.assert_close(pre.factors[f"{name}/G"], want_g, rtol=1e-11, atol=1e-13)
        short = name.rsplit(".", 1)[1]
        want = damped_inverse(want_g, damping) @ raw[short] @ damped_inverse(want_a, damping)
        got = grad_matrix(*params[short])
        torch.testing.assert_close(got, want, rtol=1e-8, atol=1e-12)
        assert not torch.allclose(got, raw[short])
    assert set(model.state_dict()) == set(EncoderHead(batch_first).state_dict())
    left = log_left(model, [p for layer in pre.layers for p in layer.params], ("linear", "conv2d"))
    assert left == ["layer.norm1.weight", "layer.norm1.bias", "layer.norm2.weight", "layer.norm2.bias"]


class Decoder(nn.Module):
    """An ``nn.TransformerDecoderLayer``: self-attention, then cross-attention on a memory."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.dec = nn.TransformerDecoderLayer(E, HEADS, 2 * E, dropout=0.0, batch_first=True)
        self.memory = nn.Linear(E, E)
        self.head = nn.Linear(E, C)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.dec(x, self.memory(x.flip(1))).mean(dim=1))  # type: ignore[no-any-return]


def test_cross_attentions_in_proj_leaves_the_pipelines_for_its_row_blocks_and_the_rest_trains(
    backend: TorchBackend, caplog: pytest.LogCaptureFixture
) -> None:
    model = Decoder().to(DT)
    pre = build.preconditioner(model, KFACConfig(damping=0.01), backend)
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(N, S, E, generator=gen, dtype=DT), torch.randint(0, C, (N,), generator=gen)
    with caplog.at_level(logging.INFO):
        for _ in range(2):
            model.zero_grad()
            F.cross_entropy(model(x), y).backward()
            pre.step(lr=0.1)
    names = [layer.name for layer in pre.layers]
    assert "dec.self_attn.in_proj" in names and "dec.multihead_attn.out_proj" in names
    assert "dec.multihead_attn.in_proj" not in names
    lines = [r.message for r in caplog.records if "dec.multihead_attn.in_proj" in r.message]
    assert len(lines) == 1 and "takes dec.multihead_attn.in_proj otherwise" in lines[0]
    assert set(pre.cross.inverses) == {f"dec.multihead_attn.in_proj.{b}" for b in "qkv"}
    pre.remove()
    assert not any("forward" in vars(m) for m in model.modules())


def test_a_multihead_attention_k_fac_cannot_take_keeps_its_forward(caplog: pytest.LogCaptureFixture) -> None:
    cases: dict[str, dict[str, Any]] = {
        "kdim": {"kdim": 3},
        "bias_k": {"add_bias_kv": True},
        "add_zero_attn": {"add_zero_attn": True},
    }
    for words, kw in cases.items():
        model = nn.Sequential(nn.MultiheadAttention(E, HEADS, **kw))
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="kfacflow.kfac.layers"):
            assert find_layers(model, []) == []
        assert words in caplog.text and caplog.text.count("K-FAC skips") == 1
        assert "forward" not in vars(model[0])
    frozen = nn.Sequential(nn.MultiheadAttention(E, HEADS))
    frozen[0].in_proj_weight.requires_grad_(False)
    assert [layer.name for layer in find_layers(frozen, [])] == ["0.out_proj"]
    assert [layer.name for layer in find_layers(nn.Sequential(nn.MultiheadAttention(E, HEADS)), ["0.in_*"])] == [
        "0.out_proj"
    ]


class Encoder(nn.Module):
    """Tokens through an embedding and two causal ``nn.TransformerEncoderLayer`` (sequence first), then a head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, E)
        layer = nn.TransformerEncoderLayer(E, HEADS, 2 * E, dropout=0.0)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(E, C)

    def forward(self, x: Tensor) -> Tensor:
        h = self.encoder(self.emb(x).transpose(0, 1), mask=CAUSAL, is_causal=True)
        return self.head(h.mean(dim=0))  # type: ignore[no-any-return]


@pytest.mark.slow
@pytest.mark.parametrize("factor", ["expand", "reduce"])
def test_d_mpd_spd_and_flow_agree_step_for_step_on_a_transformer_encoder(factor: str) -> None:
    agree(run_in_gloo(train_variants, 2, factor, Encoder, "encoder.layers.1.self_attn.in_proj"))
