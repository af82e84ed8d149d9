"""Tests for kfacflow.kfac.stages.factors and kfacflow.kfac.layers against hand computations with explicit loops."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kfacflow import UserError
from kfacflow.kfac.layers import KFACLayer, find_layers
from kfacflow.kfac.packing import pack, pack_lower, packed_size, unpack, unpack_lower
from kfacflow.kfac.stages import factors
from kfacflow.kfac.stages.factors import ExpandFactors, ReduceFactors, gram_blocks, gram_packed

DT = torch.float64
SHIPPED_POSITIONS_INNER_FROM = factors.POSITIONS_INNER_FROM

pytestmark = pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel:UserWarning")


@pytest.fixture(autouse=True, params=["one block", "3-wide blocks"])
def block(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every factor here by hand twice: one product, and the upper triangle in block rows of 3."""
    if request.param == "3-wide blocks":
        monkeypatch.setattr(factors, "GRAM_BLOCK", 3)


@pytest.fixture(params=["as chosen", "positions inner at any width"])
def layout(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """A test's Conv2d factors from row-major rows where the output is narrow, and from column-major rows always."""
    if request.param != "as chosen":
        monkeypatch.setattr(factors, "POSITIONS_INNER_FROM", 1)


def close(got: Tensor, want: Tensor, rtol: float = 1e-10, atol: float = 1e-12) -> None:
    assert got.shape == want.shape, (got.shape, want.shape)
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol)


# --- hand computations ----------------------------------------------------------------------------


def outer_mean(rows: list[list[float]], denom: float) -> Tensor:
    """Return ``1/denom sum_r r r^T`` with explicit loops."""
    d = len(rows[0])
    out = torch.zeros(d, d, dtype=DT)
    for r in rows:
        for i in range(d):
            for j in range(d):
                out[i, j] += r[i] * r[j]
    return out / denom


def hand_conv_patches(conv: nn.Conv2d, x: Tensor) -> tuple[list[list[list[float]]], int, int]:
    """Return patches[n][t] (t = i * W_out + j, channel-major then kernel row then kernel column)."""
    _, _, h, w = x.shape
    kh, kw = conv.kernel_size
    sh, sw = conv.stride
    dh, dw = conv.dilation
    if conv.padding == "same":
        assert (sh, sw) == (1, 1)
        ph, pw = dh * (kh - 1) // 2, dw * (kw - 1) // 2
        h_out, w_out = h, w
    else:
        ph, pw = cast(tuple[int, int], conv.padding)
        h_out = (h + 2 * ph - dh * (kh - 1) - 1) // sh + 1
        w_out = (w + 2 * pw - dw * (kw - 1) - 1) // sw + 1
    return patches_at(conv, x, (ph, pw), (h_out, w_out)), h_out, w_out


def patches_at(conv: nn.Conv2d, x: Tensor, before: tuple[int, int], out: tuple[int, int]) -> list[list[list[float]]]:
    """Return patches[n][t] of ``out`` output positions, with ``before`` zero rows/columns padded first."""
    n_b, c_in, h, w = x.shape
    (kh, kw), (sh, sw), (dh, dw) = conv.kernel_size, conv.stride, conv.dilation
    patches = []
    for n in range(n_b):
        per_n = []
        for i in range(out[0]):
            for j in range(out[1]):
                patch = []
                for c in range(c_in):
                    for ki in range(kh):
                        for kj in range(kw):
                            row = i * sh - before[0] + ki * dh
                            col = j * sw - before[1] + kj * dw
                            inside = 0 <= row < h and 0 <= col < w
                            patch.append(float(x[n, c, row, col]) if inside else 0.0)
                per_n.append(patch)
        patches.append(per_n)
    return patches


def with_one(v: list[float], bias: bool) -> list[float]:
    return [*v, 1.0] if bias else list(v)


def capture(model: nn.Module, layer: nn.Module, x: Tensor, loss_fn: Callable[[Tensor], Tensor]) -> dict[str, Any]:
    """Run forward + backward; return the layer's input, output and output gradient."""
    store: dict[str, Any] = {}

    def fhook(mod: nn.Module, inputs: tuple[Tensor, ...], out: Tensor) -> None:
        store["x"] = inputs[0].detach().clone()
        store["out"] = out.detach().clone()

        def ghook(g: Tensor) -> None:
            store["go"] = g.detach().clone()

        out.register_hook(ghook)

    handle = layer.register_forward_hook(fhook)
    model.zero_grad()
    loss = loss_fn(model(x))
    loss.backward()
    handle.remove()
    assert "go" in store
    return store


def per_example_loss(out: Tensor, proj: Tensor) -> Tensor:
    """A nonlinear per-example loss, averaged over the batch (dim 0)."""
    z = out.tanh().reshape(out.shape[0], -1) @ proj
    return (z.pow(2).sum(1) + z.sum(1)).mean()


# --- pack / unpack --------------------------------------------------------------------------------


def test_packed_size() -> None:
    assert [packed_size(d) for d in (1, 2, 3, 5, 10)] == [1, 3, 6, 15, 55]


def test_pack_order_row_major_upper() -> None:
    m = torch.arange(9, dtype=DT).reshape(3, 3)
    # rows: [0 1 2] [3 4 5] [6 7 8] -> upper triangle row by row: 0 1 2 | 4 5 | 8
    assert pack(m).tolist() == [0.0, 1.0, 2.0, 4.0, 5.0, 8.0]
    sym = torch.tensor([[1.0, 2.0, 3.0], [2.0, 4.0, 5.0], [3.0, 5.0, 6.0]], dtype=DT)
    assert pack(sym).tolist() == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    assert unpack(torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0], dtype=DT), 3).tolist() == sym.tolist()


@pytest.mark.parametrize("d", [1, 2, 5, 300])
def test_pack_unpack_roundtrip(d: int) -> None:
    g = torch.Generator().manual_seed(d)
    b = torch.randn(d, d, generator=g, dtype=DT)
    m = b + b.T
    p = pack(m)
    assert p.shape == (packed_size(d),)
    assert torch.equal(unpack(p, d), m)
    assert torch.equal(pack(unpack(p, d)), p)


@pytest.mark.parametrize("width", [1, 2, 5, 9, 25, 40])
def test_gram_packed_is_the_packed_product(width: int) -> None:
    g = torch.Generator().manual_seed(width)
    a = torch.randn(7, width, dtype=DT, generator=g)
    right = a / 7
    for got, want in [(gram_packed(a), a.T @ a), (gram_packed(a, right), a.T @ right)]:
        close(got, pack(want))
    blocks = gram_blocks(width)
    assert blocks == (1 if factors.GRAM_BLOCK > width else min(8, -(-width // 3)))


def test_gram_blocks_by_width(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(factors, "GRAM_BLOCK", 128)
    assert [gram_blocks(w) for w in (1, 128, 129, 145, 384, 1024, 4608)] == [1, 1, 2, 2, 3, 8, 8]


def test_pack_lower_column_major_lower() -> None:
    m = torch.arange(9, dtype=DT).reshape(3, 3)
    # columns of the lower triangle: [0 3 6] [4 7] [8], the order pack gives for m.T
    assert pack_lower(m).tolist() == [0.0, 3.0, 6.0, 4.0, 7.0, 8.0]
    assert torch.equal(pack_lower(m), pack(m.T))
    assert unpack_lower(pack_lower(m), 3).tolist() == [[0.0, 0.0, 0.0], [3.0, 4.0, 0.0], [6.0, 7.0, 8.0]]


# --- Linear ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("bias", [True, False])
def test_linear_factors_match_hand(bias: bool) -> None:
    torch.manual_seed(0)
    n_b = 6
    model = nn.Sequential(nn.Linear(5, 4, bias=bias), nn.Tanh(), nn.Linear(4, 3, bias=bias)).to(DT)
    x = torch.randn(n_b, 5, dtype=DT)
    y = torch.tensor([0, 1, 2, 1, 0, 2])
    for layer in (model[0], model[2]):
        st = capture(model, layer, x, lambda out: F.cross_entropy(out, y))
        xs, go = st["x"], st["go"]
        rows_a = [with_one(xs[n].tolist(), bias) for n in range(n_b)]
        rows_g = [(n_b * go[n]).tolist() for n in range(n_b)]
        want_a = outer_mean(rows_a, n_b)
        want_g = outer_mean(rows_g, n_b)
        fac = ExpandFactors()
        close(fac.a_factor(layer, xs), want_a)
        close(fac.g_factor(layer, go, n_b), want_g)
        # reduce only differs for Conv2d
        close(ReduceFactors().a_factor(layer, xs), want_a)
        close(ReduceFactors().g_factor(layer, go, n_b), want_g)
        assert want_a.shape == (5 + bias if layer is model[0] else 4 + bias,) * 2


@pytest.mark.parametrize("bias", [True, False])
def test_linear_tokens_match_hand(bias: bool) -> None:
    torch.manual_seed(1)
    n_b, t_len, d_in, d_out = 3, 4, 4, 3
    layer = nn.Linear(d_in, d_out, bias=bias).to(DT)
    proj = torch.randn(t_len * d_out, 2, dtype=DT)
    x = torch.randn(n_b, t_len, d_in, dtype=DT)
    st = capture(layer, layer, x, lambda out: per_example_loss(out, proj))
    xs, go = st["x"], st["go"]
    rows_a = [with_one(xs[n, t].tolist(), bias) for n in range(n_b) for t in range(t_len)]
    rows_g = [(n_b * go[n, t]).tolist() for n in range(n_b) for t in range(t_len)]
    fac = ExpandFactors()
    close(fac.a_factor(layer, xs), outer_mean(rows_a, n_b * t_len))
    close(fac.g_factor(layer, go, n_b), outer_mean(rows_g, n_b))


# --- Conv2d ---------------------------------------------------------------------------------------

CONV_CONFIGS: list[dict[str, Any]] = [
    {"kernel_size": 3, "stride": 1, "padding": 1},
    {"kernel_size": 3, "stride": 2, "padding": 0},
    {"kernel_size": (2, 3), "stride": (2, 1), "padding": (1, 0), "dilation": 2},
    {"kernel_size": 3, "padding": "same"},
    {"kernel_size": (2, 3), "padding": "same", "dilation": (1, 2)},  # asymmetric height padding
]


def conv_case(cfg: dict[str, Any], bias: bool, n_b: int = 3, seed: int = 0) -> tuple[nn.Conv2d, Tensor, Tensor]:
    torch.manual_seed(seed)
    conv = nn.Conv2d(2, 3, bias=bias, **cfg).to(DT)
    x = torch.randn(n_b, 2, 6, 5, dtype=DT)
    with torch.no_grad():
        out_shape = conv(x[:1]).shape
    proj = torch.randn(out_shape[1:].numel(), 2, dtype=DT)
    return conv, x, proj


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("cfg", CONV_CONFIGS, ids=lambda c: str(c))
def test_conv_patches_match_weight_layout(cfg: dict[str, Any], bias: bool) -> None:
    conv, x, _ = conv_case(cfg, bias)
    patches, h_out, w_out = hand_conv_patches(conv, x)
    with torch.no_grad():
        out = conv(x)
    assert out.shape[2:] == (h_out, w_out)
    w_mat = conv.weight.view(conv.out_channels, -1)
    for n in range(x.shape[0]):
        for i in range(h_out):
            for j in range(w_out):
                want = w_mat @ torch.tensor(patches[n][i * w_out + j], dtype=DT)
                if bias:
                    want = want + cast(Tensor, conv.bias)
                close(out[n, :, i, j], want)


@pytest.mark.usefixtures("layout")
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("cfg", CONV_CONFIGS, ids=lambda c: str(c))
def test_conv_expand_match_hand(cfg: dict[str, Any], bias: bool) -> None:
    conv, x, proj = conv_case(cfg, bias)
    n_b = x.shape[0]
    st = capture(conv, conv, x, lambda out: per_example_loss(out, proj))
    go = st["go"]
    patches, h_out, w_out = hand_conv_patches(conv, st["x"])
    n_pos = h_out * w_out
    rows_a = [with_one(patches[n][t], bias) for n in range(n_b) for t in range(n_pos)]
    rows_g = [(n_b * go[n, :, i, j]).tolist() for n in range(n_b) for i in range(h_out) for j in range(w_out)]
    fac = ExpandFactors()
    a = fac.a_factor(conv, st["x"])
    g = fac.g_factor(conv, go, n_b)
    d_a = conv.in_channels * conv.kernel_size[0] * conv.kernel_size[1] + bias
    assert a.shape == (d_a, d_a) and g.shape == (3, 3)
    close(a, outer_mean(rows_a, n_b * n_pos))
    close(g, outer_mean(rows_g, n_b))


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("cfg", CONV_CONFIGS, ids=lambda c: str(c))
def test_conv_reduce_match_hand(cfg: dict[str, Any], bias: bool) -> None:
    conv, x, proj = conv_case(cfg, bias)
    n_b = x.shape[0]
    st = capture(conv, conv, x, lambda out: per_example_loss(out, proj))
    go = st["go"]
    patches, h_out, w_out = hand_conv_patches(conv, st["x"])
    n_pos = h_out * w_out
    rows_a, rows_g = [], []
    for n in range(n_b):
        d = len(patches[n][0])
        mean_patch = [sum(patches[n][t][k] for t in range(n_pos)) / n_pos for k in range(d)]
        rows_a.append(with_one(mean_patch, bias))
        dg = [0.0] * conv.out_channels
        for c in range(conv.out_channels):
            for i in range(h_out):
                for j in range(w_out):
                    dg[c] += n_b * float(go[n, c, i, j])
        rows_g.append(dg)
    fac = ReduceFactors()
    close(fac.a_factor(conv, st["x"]), outer_mean(rows_a, n_b))
    close(fac.g_factor(conv, go, n_b), outer_mean(rows_g, n_b))


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("cfg", CONV_CONFIGS, ids=lambda c: str(c))
def test_conv_rows_are_the_same_values_in_either_layout(
    cfg: dict[str, Any], bias: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    conv, x, proj = conv_case(cfg, bias)
    go = capture(conv, conv, x, lambda out: per_example_loss(out, proj))["go"]
    fac = ExpandFactors()
    got = {}
    for name, width in (("row-major", 2**62), ("positions inner", 1)):
        monkeypatch.setattr(factors, "POSITIONS_INNER_FROM", width)
        got[name] = (fac.a_rows(conv, x), fac.g_rows(conv, go))
    for rows_major, rows_inner in zip(got["row-major"], got["positions inner"], strict=True):
        assert rows_major.is_contiguous() and rows_inner.T.is_contiguous()  # each layout as asked for
        assert torch.equal(rows_major, rows_inner)  # a copy either way: the same values, bit for bit


def test_conv_rows_go_column_major_where_the_output_is_wide_and_channels_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(factors, "POSITIONS_INNER_FROM", SHIPPED_POSITIONS_INNER_FROM)
    assert SHIPPED_POSITIONS_INNER_FROM in range(4, 8)  # 8 px wide is wide, 3 px narrow
    conv = nn.Conv2d(4, 3, 3, padding=1)
    fac = ExpandFactors()
    wide, narrow = torch.randn(2, 4, 8, 8), torch.randn(2, 4, 3, 3)
    assert fac.a_rows(conv, wide).T.is_contiguous() and fac.g_rows(conv, conv(wide)).T.is_contiguous()
    assert fac.a_rows(conv, narrow).is_contiguous() and fac.g_rows(conv, conv(narrow)).is_contiguous()
    last = wide.to(memory_format=torch.channels_last)  # channels are read in runs row-major: kept so
    assert fac.a_rows(conv, last).is_contiguous() and torch.equal(fac.a_rows(conv, last), fac.a_rows(conv, wide))
    grad_last = torch.randn(2, 3, 8, 8).to(memory_format=torch.channels_last)
    assert fac.g_rows(conv, grad_last).is_contiguous()


# --- the distributed property: averaging halves gives the whole batch ---------------------------------


def factors_of(model: nn.Module, layers: list[nn.Module], x: Tensor, y: Tensor, fac: Any) -> list[Tensor]:
    out = []
    for layer in layers:
        st = capture(model, layer, x, lambda o: F.cross_entropy(o, y))
        out += [fac.a_factor(layer, st["x"]), fac.g_factor(layer, st["go"], x.shape[0])]
    return out


@pytest.mark.usefixtures("layout")
@pytest.mark.parametrize("kind", ["expand", "reduce"])
def test_half_batches_average_to_whole(kind: str) -> None:
    torch.manual_seed(3)
    fac = ExpandFactors() if kind == "expand" else ReduceFactors()
    conv = nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1),
        nn.Tanh(),
        nn.Conv2d(3, 2, (2, 3), stride=(2, 1), bias=False),
        nn.Tanh(),
        nn.Flatten(),
        nn.Linear(2 * 3 * 3, 4),
    ).to(DT)
    mlp = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3, bias=False)).to(DT)
    cases = [
        (conv, [conv[0], conv[2], conv[5]], torch.randn(6, 2, 6, 5, dtype=DT), torch.tensor([0, 1, 2, 3, 1, 2])),
        (mlp, [mlp[0], mlp[2]], torch.randn(6, 5, dtype=DT), torch.tensor([0, 1, 2, 1, 0, 2])),
    ]
    for model, layers, x, y in cases:
        whole = factors_of(model, layers, x, y, fac)
        first = factors_of(model, layers, x[:3], y[:3], fac)
        second = factors_of(model, layers, x[3:], y[3:], fac)
        assert len(whole) == 2 * len(layers)
        for w, f, s in zip(whole, first, second, strict=True):
            close((f + s) / 2, w)
            assert not torch.allclose(f, s)  # the halves differ, so the check means something


# --- layers ---------------------------------------------------------------------------------------


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(2, 4, 3, padding=1)
        self.grouped = nn.Conv2d(4, 4, 3, padding=1, groups=2)
        self.reflect = nn.Conv2d(4, 4, 3, padding=1, padding_mode="reflect")
        self.block = nn.Sequential(nn.Conv2d(4, 3, 3, bias=False), nn.ReLU())
        self.head = nn.Linear(3, 5)
        self.aux = nn.Linear(5, 2, bias=False)
        self.norm = nn.LayerNorm(5)


def test_find_layers_order_and_skips() -> None:
    net = Net()
    assert [lay.name for lay in find_layers(net, [])] == ["conv1", "block.0", "head", "aux"]
    assert [lay.name for lay in find_layers(net, ["block.*"])] == ["conv1", "head", "aux"]
    assert [lay.name for lay in find_layers(net, ["head", "a*"])] == ["conv1", "block.0"]
    assert [lay.name for lay in find_layers(net, ["conv?"])] == ["block.0", "head", "aux"]
    with pytest.raises(UserError, match="'Head' matches no module"):  # patterns are case-sensitive
        find_layers(net, ["Head"])
    net.head.weight.requires_grad_(False)
    assert [lay.name for lay in find_layers(net, [])] == ["conv1", "block.0", "aux"]


def test_layer_dims() -> None:
    net = Net()
    dims = {lay.name: (lay.a_dim, lay.g_dim, lay.has_bias) for lay in find_layers(net, [])}
    assert dims == {
        "conv1": (2 * 9 + 1, 4, True),
        "block.0": (4 * 9, 3, False),
        "head": (3 + 1, 5, True),
        "aux": (5, 2, False),
    }


@pytest.mark.parametrize("bias", [True, False])
def test_grad_matrix_and_set_grad(bias: bool) -> None:
    torch.manual_seed(4)
    conv = nn.Conv2d(2, 3, (2, 3), bias=bias).to(DT)
    layer = KFACLayer("c", conv)
    assert layer.grad_matrix() is None
    conv(torch.randn(2, 2, 4, 5, dtype=DT)).pow(2).sum().backward()
    mat = layer.grad_matrix()
    assert mat is not None and mat.shape == (layer.g_dim, layer.a_dim) == (3, 2 * 6 + bias)
    assert conv.weight.grad is not None
    for o in range(3):
        k = 0
        for c in range(2):
            for ki in range(2):
                for kj in range(3):
                    assert mat[o, k] == conv.weight.grad[o, c, ki, kj]
                    k += 1
        if bias:
            assert conv.bias is not None and conv.bias.grad is not None
            assert mat[o, -1] == conv.bias.grad[o]
    new = torch.randn(3, 2 * 6 + bias, dtype=DT)
    layer.set_grad(new)
    got = layer.grad_matrix()
    assert got is not None and torch.equal(got, new)
    assert torch.equal(conv.weight.grad, new[:, : 2 * 6].reshape(3, 2, 2, 3))
    if bias:
        assert conv.bias is not None and conv.bias.grad is not None
        assert torch.equal(conv.bias.grad, new[:, -1])


def test_linear_grad_matrix_bias_last() -> None:
    torch.manual_seed(5)
    lin = nn.Linear(4, 3).to(DT)
    layer = KFACLayer("l", lin)
    lin(torch.randn(5, 4, dtype=DT)).pow(3).sum().backward()
    mat = layer.grad_matrix()
    assert lin.weight.grad is not None and lin.bias.grad is not None and mat is not None
    assert torch.equal(mat, torch.cat([lin.weight.grad, lin.bias.grad[:, None]], dim=1))
