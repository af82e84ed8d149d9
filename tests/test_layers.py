"""Which modules find_layers preconditions, what their weights see, and why it leaves the others alone."""

from __future__ import annotations

import logging
import math
from typing import Any, cast

import pytest
import timm
import torch
import torch.nn.functional as F
from test_factors import DT, Net, close, hand_conv_patches, outer_mean, patches_at, with_one
from timm.layers import Conv2dSame, StdConv2d
from timm.layers import Linear as TimmLinear
from timm.layers.conv2d_same import Conv2dSameExport
from torch import Tensor, nn

from kfacflow import UserError
from kfacflow.kfac.layers import OWN_FORWARD, KFACLayer, find_layers
from kfacflow.kfac.stages.factors import ExpandFactors, ReduceFactors

LOGGER = "kfacflow.kfac.layers"


def names(layers: list[KFACLayer]) -> list[str]:
    return [lay.name for lay in layers]


def skip_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.INFO]


# --- TF "SAME" convolutions (timm's Conv2dSame, Conv2dSameExport) ------------------------------------


def hand_same_patches(conv: nn.Conv2d, x: Tensor) -> tuple[list[list[list[float]]], int, int]:
    """Patches of a TF-same conv with explicit loops: ``ceil(in / stride)`` outputs, the odd pad at the end."""
    _, _, h, w = x.shape
    (kh, kw), (sh, sw), (dh, dw) = conv.kernel_size, conv.stride, conv.dilation
    h_out, w_out = math.ceil(h / sh), math.ceil(w / sw)
    top = max((h_out - 1) * sh + (kh - 1) * dh + 1 - h, 0) // 2
    left = max((w_out - 1) * sw + (kw - 1) * dw + 1 - w, 0) // 2
    return patches_at(conv, x, (top, left), (h_out, w_out)), h_out, w_out


SAME_CASES: list[tuple[dict[str, Any], tuple[int, int]]] = [
    ({"kernel_size": 3, "stride": 2}, (8, 8)),  # pads 0 before, 1 after: 16 positions, 9 unpadded
    ({"kernel_size": 3, "stride": 2, "dilation": 2}, (8, 9)),  # pads (1, 2) rows, (2, 2) columns
    ({"kernel_size": (2, 3), "stride": (1, 2), "dilation": (2, 1)}, (5, 6)),
]


@pytest.mark.parametrize("cls", [Conv2dSame, Conv2dSameExport])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize(("cfg", "size"), SAME_CASES, ids=lambda c: str(c))
def test_tf_same_layer_input_and_factor_match_hand(
    cls: type[nn.Conv2d], bias: bool, cfg: dict[str, Any], size: tuple[int, int]
) -> None:
    torch.manual_seed(0)
    conv = cls(2, 3, bias=bias, **cfg).to(DT)
    (layer,) = find_layers(nn.Sequential(conv), [])
    x = torch.randn(3, 2, *size, dtype=DT)
    seen = layer.layer_input(x)  # before the forward, as the preconditioner's pre-hook runs
    with torch.no_grad():
        out = conv(x)
    assert torch.equal(F.conv2d(seen, conv.weight, conv.bias, conv.stride, 0, conv.dilation), out)

    patches, h_out, w_out = hand_same_patches(conv, x)
    assert out.shape[2:] == (h_out, w_out)
    if cfg == SAME_CASES[0][0]:
        assert h_out * w_out == 16 and F.unfold(x, 3, stride=2).shape[-1] == 9
    n_b, n_pos = x.shape[0], h_out * w_out
    rows = [with_one(patches[n][t], bias) for n in range(n_b) for t in range(n_pos)]
    close(ExpandFactors().a_factor(conv, layer.layer_input(x)), outer_mean(rows, n_b * n_pos))
    means = [[sum(p[k] for p in patches[n]) / n_pos for k in range(len(patches[n][0]))] for n in range(n_b)]
    close(ReduceFactors().a_factor(conv, layer.layer_input(x)), outer_mean([with_one(m, bias) for m in means], n_b))


def test_conv2d_same_export_keeps_its_first_padding() -> None:
    torch.manual_seed(1)
    conv = Conv2dSameExport(2, 3, 3, stride=2).to(DT)
    layer = KFACLayer("c", conv)
    for size in ((8, 8), (9, 9)):  # the second size is padded as the first was, in the module too
        x = torch.randn(2, 2, *size, dtype=DT)
        seen = layer.layer_input(x)
        with torch.no_grad():
            assert torch.equal(F.conv2d(seen, conv.weight, conv.bias, conv.stride), conv(x))


def test_plain_layers_see_their_input_unchanged() -> None:
    x = torch.randn(2, 2, 5, 5)
    for module in (nn.Conv2d(2, 3, 3, padding=1), nn.Linear(5, 2), TimmLinear(5, 2)):
        (layer,) = find_layers(nn.Sequential(module), [])
        assert layer.layer_input(x) is x


def test_timm_tf_model_includes_its_same_convs(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    model = timm.create_model("tf_mobilenetv3_small_minimal_100", num_classes=10).double()
    layers = find_layers(model, [])
    same = [lay for lay in layers if isinstance(lay.module, Conv2dSame)]
    assert [lay.name for lay in same] == ["conv_stem"]
    assert isinstance(model.get_submodule("classifier"), TimmLinear) and "classifier" in names(layers)
    grouped = [n for n, m in model.named_modules() if isinstance(m, nn.Conv2d) and m.groups > 1]
    assert grouped and not set(grouped) & set(names(layers))
    assert len(skip_lines(caplog)) == len(grouped)
    assert all("grouped convolution (groups=" in line for line in skip_lines(caplog))
    # Every included layer's weight sees what layer_input returns, in the real network.
    checked = []

    def check(layer: KFACLayer) -> Any:
        def hook(module: nn.Conv2d, inputs: tuple[Tensor, ...], out: Tensor) -> None:
            if isinstance(module, nn.Conv2d):
                seen = F.pad(layer.layer_input(inputs[0]), module._reversed_padding_repeated_twice)
                want = F.conv2d(seen, module.weight, module.bias, module.stride, 0, module.dilation)
                assert torch.equal(want, out), layer.name
            checked.append(layer.name)

        return hook

    handles = [lay.module.register_forward_hook(check(lay)) for lay in layers]
    with torch.no_grad():
        model.eval()(torch.randn(1, 3, 33, 33, dtype=DT))
    for h in handles:
        h.remove()
    assert checked == names(layers)


# --- modules whose forward is their own -----------------------------------------------------------


class DoubledConv(nn.Conv2d):
    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x) * 2


class OwnConvForward(nn.Conv2d):
    def _conv_forward(self, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        return super()._conv_forward(x, weight.flip(-1), bias)


class ScaledLinear(nn.Linear):
    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight * 0.5, self.bias)


class TaggedLinear(nn.Linear):
    """Inherits Linear's forward: computes what Linear computes."""


class TaggedSame(Conv2dSame):
    """Inherits Conv2dSame's forward."""


def test_own_forward_is_skipped_with_a_log_line(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    model = nn.Sequential(
        DoubledConv(2, 3, 3),
        OwnConvForward(3, 3, 3),
        ScaledLinear(3, 3),
        TaggedLinear(3, 3),
        TaggedSame(3, 3, 3, stride=2),
        StdConv2d(3, 3, 3),
        nn.Linear(3, 2),
    )
    model[6].forward = lambda x: x  # type: ignore[method-assign]
    assert names(find_layers(model, [])) == ["3", "4"]
    mod = __name__
    assert skip_lines(caplog) == [
        f"K-FAC skips 0 ({mod}.DoubledConv): {OWN_FORWARD}",
        f"K-FAC skips 1 ({mod}.OwnConvForward): {OWN_FORWARD}",
        f"K-FAC skips 2 ({mod}.ScaledLinear): {OWN_FORWARD}",
        f"K-FAC skips 5 (timm.layers.std_conv.StdConv2d): {OWN_FORWARD}",
        f"K-FAC skips 6 (Linear): {OWN_FORWARD}",
    ]
    assert OWN_FORWARD == "its forward is its own, so the factors cannot know what it computes"


# --- weights the factors do not describe ---------------------------------------------------------


def test_parametrized_and_computed_weights_are_skipped(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    no_param_bias = nn.Linear(3, 3)
    del no_param_bias.bias
    no_param_bias.register_buffer("bias", torch.zeros(3))
    with pytest.warns(FutureWarning):
        old_norm = nn.utils.weight_norm(nn.Linear(3, 3))
    model = nn.Sequential(
        nn.utils.parametrizations.weight_norm(nn.Linear(3, 3)),
        nn.utils.parametrizations.spectral_norm(nn.Conv2d(3, 3, 1)),
        old_norm,
        no_param_bias,
        nn.LazyLinear(3),
        nn.Linear(3, 3),
    )
    assert names(find_layers(model, [])) == ["5"]
    parametrized = (
        "it is parametrized (e.g. weight_norm, spectral_norm), so its weight is computed from other parameters"
    )
    assert skip_lines(caplog) == [
        f"K-FAC skips 0 (ParametrizedLinear): {parametrized}",
        f"K-FAC skips 1 (ParametrizedConv2d): {parametrized}",
        "K-FAC skips 2 (Linear): its weight is not an nn.Parameter (e.g. computed by the old weight_norm hook)",
        "K-FAC skips 3 (Linear): its bias is not an nn.Parameter",
        "K-FAC skips 4 (LazyLinear): its weight is not initialised yet (a lazy module)",
    ]


class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.body = nn.Linear(4, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight
        self.twin_a = nn.Linear(4, 4)
        self.twin_b = nn.Linear(4, 4)
        self.twin_b.bias = self.twin_a.bias
        self.pair = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
        self.pair[1].weight = self.pair[0].weight
        self.frozen_a = nn.Linear(4, 4)
        self.frozen_b = nn.Linear(4, 4)
        self.frozen_b.bias = self.frozen_a.bias
        self.frozen_a.bias.requires_grad_(False)  # not preconditioned, so sharing it does not matter
        self.alias = self.body  # the same module under a second name: one module, not tied weights


def test_tied_parameters_skip_every_user(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    layers = find_layers(TiedLM(), [])
    assert names(layers) == ["body", "frozen_a", "frozen_b"]
    assert [lay.has_bias for lay in layers] == [True, False, False]
    tail = "so its gradient sums several uses, which the factors of one module do not describe"
    assert skip_lines(caplog) == [
        f"K-FAC skips head (Linear): its weight is shared with embed.weight, {tail}",
        f"K-FAC skips twin_a (Linear): its bias is shared with twin_b.bias, {tail}",
        f"K-FAC skips twin_b (Linear): its bias is shared with twin_a.bias, {tail}",
        f"K-FAC skips pair.0 (Linear): its weight is shared with pair.1.weight, {tail}",
        f"K-FAC skips pair.1 (Linear): its weight is shared with pair.0.weight, {tail}",
    ]


def test_existing_skip_reasons_are_logged(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    assert names(find_layers(Net(), [])) == ["conv1", "block.0", "head", "aux"]
    assert skip_lines(caplog) == [
        "K-FAC skips grouped (Conv2d): grouped convolution (groups=2)",
        "K-FAC skips reflect (Conv2d): padding_mode='reflect', only zero padding is supported",
    ]


# --- frozen biases and weights -------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["linear", "conv", "same"])
def test_frozen_bias_is_left_out_of_the_factors(kind: str) -> None:
    torch.manual_seed(2)
    module: nn.Linear | nn.Conv2d
    if kind == "linear":
        module, x = nn.Linear(3, 2).to(DT), torch.randn(4, 3, dtype=DT)
    elif kind == "conv":
        module, x = nn.Conv2d(2, 3, 2, padding=1).to(DT), torch.randn(2, 2, 3, 4, dtype=DT)
    else:
        module, x = Conv2dSame(2, 3, 3, stride=2).to(DT), torch.randn(2, 2, 4, 5, dtype=DT)
    bias = cast(Tensor, module.bias)  # every case is built with a bias
    bias.requires_grad_(False)
    (layer,) = find_layers(nn.Sequential(module), [])
    weight = module.weight
    assert not layer.has_bias and layer.a_dim == weight[0].numel() and layer.g_dim == weight.shape[0]

    if kind == "linear":
        rows = [x[n].tolist() for n in range(x.shape[0])]
    else:
        hand = hand_conv_patches if kind == "conv" else hand_same_patches
        rows = [p for per_n in hand(cast(nn.Conv2d, module), x)[0] for p in per_n]  # no ones column
    close(ExpandFactors().a_factor(module, layer.layer_input(x)), outer_mean(rows, len(rows)))

    bias_before = bias.detach().clone()
    module(x).pow(2).sum().backward()
    assert bias.grad is None
    mat = layer.grad_matrix()
    assert mat is not None and torch.equal(mat, cast(Tensor, weight.grad).reshape(weight.shape[0], -1))
    new = torch.randn(layer.g_dim, layer.a_dim, dtype=DT)
    layer.set_grad(new)
    assert torch.equal(cast(Tensor, weight.grad), new.reshape(weight.shape)) and bias.grad is None
    assert torch.equal(bias, bias_before)


def test_frozen_weight_stays_skipped() -> None:
    lin = nn.Linear(3, 2)
    lin.weight.requires_grad_(False)
    model = nn.Sequential(lin, nn.Linear(2, 2))
    assert names(find_layers(model, [])) == ["1"]
    with pytest.raises(UserError, match="It matches only '0', which K-FAC leaves alone anyway"):
        find_layers(model, ["0"])


# --- kfac.skip patterns that match nothing -------------------------------------------------------


@pytest.mark.parametrize(
    ("pattern", "message"),
    [
        ("Head", "kfac.skip: 'Head' matches no module K-FAC would precondition. Did you mean 'head'?"),
        (
            "block",
            "kfac.skip: 'block' matches no module K-FAC would precondition. 'block' holds layers: use 'block.*' "
            "to skip the layers inside it. Did you mean 'block.0'?",
        ),
        (
            "grouped",
            "kfac.skip: 'grouped' matches no module K-FAC would precondition. It matches only 'grouped', which "
            "K-FAC leaves alone anyway.",
        ),
        ("zzz*", "kfac.skip: 'zzz*' matches no module K-FAC would precondition."),
    ],
)
def test_skip_pattern_matching_nothing_is_an_error(pattern: str, message: str) -> None:
    with pytest.raises(UserError) as err:
        find_layers(Net(), ["head", pattern])
    assert str(err.value) == message


def test_skip_patterns_that_match_are_fine() -> None:
    assert names(find_layers(Net(), ["block.*", "a*"])) == ["conv1", "head"]
