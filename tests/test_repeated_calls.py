"""A Linear applied several times in one forward pass: K-FAC-expand and K-FAC-reduce over its calls, float64 by hand.

A weight-tied looped block applies one ``nn.Linear`` three times per forward pass, the last time to
fewer tokens. ``kfac.factor=expand`` counts every call's tokens as rows; ``reduce`` reduces every
use of the weight in one example, its tokens and its calls (Eschenhagen et al. 2023): ``a_n`` the
mean of its inputs over all uses, ``g_n`` the sum of its output gradients, factors from ``N`` rows.
The forward passes of a step stay examples of their own: two micro-batches, or two views before one
backward pass, give one batch's factors.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers import kfac_step, run_in_gloo
from test_sequence_factors import VOCAB, C, E, N, S, agree, data, train_variants, with_ones
from torch import Tensor, nn

from kfacflow import UserError
from kfacflow.comm.torch_dist import TorchBackend
from kfacflow.configuration.schema import KFACConfig
from kfacflow.kfac.preconditioner import Preconditioner
from kfacflow.kfac.stages.factors import ReduceFactors, conv_windows
from kfacflow.running import build

DT = torch.float64
TAIL = 2
"""Tokens the looped block's third call sees (the first two see all ``S``)."""


class Looped(nn.Module):
    """``fc`` applied ``loops`` times over the tokens (weights tied across the loop), then once more to the last two."""

    def __init__(self, tokens: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb: nn.Module = nn.Embedding(VOCAB, E) if tokens else nn.Identity()
        self.fc = nn.Linear(E, E)
        self.head = nn.Linear(E, C)
        self.loops = 2

    def forward(self, x: Tensor) -> Tensor:
        h = self.emb(x)
        for _ in range(self.loops):
            h = h + torch.tanh(self.fc(h))
        tail = torch.tanh(self.fc(h[:, -TAIL:]))  # the same weight on fewer tokens
        return self.head(h.mean(dim=1) + tail.mean(dim=1))


class TokenLooped(Looped):
    """The looped block with an embedding in front (the gloo test's tokens)."""

    def __init__(self) -> None:
        super().__init__(tokens=True)


def spy_calls(module: nn.Module) -> list[dict[str, Tensor]]:
    """Every call's input and output gradient, in the order of the calls."""
    seen: list[dict[str, Tensor]] = []

    def hook(mod: nn.Module, inputs: tuple[Tensor, ...], out: Tensor) -> None:
        rec = {"x": inputs[0].detach().clone()}
        seen.append(rec)
        out.register_hook(lambda g: rec.__setitem__("go", g.detach().clone()))

    module.register_forward_hook(hook)
    return seen


def by_hand(calls: list[dict[str, Tensor]], factor: str, keep: int = N) -> tuple[Tensor, Tensor]:
    """A and G of a Linear's calls (of their first ``keep`` examples): every token of every call a row (expand),
    or every use in an example reduced."""
    a = [with_ones(rec["x"][:keep]) for rec in calls]  # (keep, T_c, a_dim)
    dg = [N * rec["go"][:keep] for rec in calls]  # the per-example gradient: N undoes the batch mean's 1/N
    if factor == "expand":
        rows_a = torch.cat([t.reshape(-1, t.shape[-1]) for t in a])
        rows_g = torch.cat([t.reshape(-1, t.shape[-1]) for t in dg])
        return rows_a.T @ rows_a / rows_a.shape[0], rows_g.T @ rows_g / keep
    mean_a = sum(t.sum(dim=1) for t in a) / sum(t.shape[1] for t in a)  # each call weighed by its tokens
    sum_g = sum(t.sum(dim=1) for t in dg)
    assert isinstance(mean_a, Tensor) and isinstance(sum_g, Tensor)
    return mean_a.T @ mean_a / keep, sum_g.T @ sum_g / keep


def _pre(backend: TorchBackend, model: nn.Module, factor: str, **kw: Any) -> Preconditioner:
    cfg = KFACConfig(factor=factor, factor_decay=0.0, kl_clip=0.0, damping=0.01, **kw)
    return build.preconditioner(model, cfg, backend)


@pytest.mark.parametrize("factor", ["expand", "reduce"])
def test_a_linear_called_three_times_by_hand(backend: TorchBackend, factor: str) -> None:
    model = Looped().to(DT)
    seen = spy_calls(model.fc)
    pre = _pre(backend, model, factor)
    for seed in (1, 2, 3):  # the first step learns the calls; the later ones hand A over at the third
        seen.clear()
        kfac_step(model, pre, *data(seed))
        assert [rec["x"].shape[1] for rec in seen] == [S, S, TAIL]
        want_a, want_g = by_hand(seen, factor)
        torch.testing.assert_close(pre.factors["fc/A"], want_a, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(pre.factors["fc/G"], want_g, rtol=1e-12, atol=1e-14)
        assert pre.capture.uses == {"fc": 3, "head": 1}
    other = "reduce" if factor == "expand" else "expand"
    assert not torch.allclose(pre.factors["fc/A"], by_hand(seen, other)[0])


@pytest.mark.parametrize("factor", ["expand", "reduce"])
def test_factor_examples_keeps_the_same_examples_of_every_call(backend: TorchBackend, factor: str) -> None:
    model = Looped().to(DT)
    seen = spy_calls(model.fc)
    pre = _pre(backend, model, factor, factor_examples=2)
    for seed in (1, 2):
        seen.clear()
        kfac_step(model, pre, *data(seed))
        want_a, want_g = by_hand(seen, factor, keep=2)
        torch.testing.assert_close(pre.factors["fc/A"], want_a, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(pre.factors["fc/G"], want_g, rtol=1e-12, atol=1e-14)


def test_fewer_calls_than_the_first_step_are_reduced_too(backend: TorchBackend) -> None:
    model = Looped().to(DT)
    seen = spy_calls(model.fc)
    pre = _pre(backend, model, "reduce")
    kfac_step(model, pre, *data(1))
    model.loops = 1
    seen.clear()
    kfac_step(model, pre, *data(2))
    assert len(seen) == 2
    want_a, want_g = by_hand(seen, "reduce")
    torch.testing.assert_close(pre.factors["fc/A"], want_a, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(pre.factors["fc/G"], want_g, rtol=1e-12, atol=1e-14)


def _grad_matrix(linear: nn.Linear) -> Tensor:
    assert linear.weight.grad is not None and linear.bias.grad is not None
    return torch.cat([linear.weight.grad, linear.bias.grad[:, None]], dim=1).clone()


def test_one_preconditioned_step_is_g_inverse_grad_a_inverse(backend: TorchBackend) -> None:
    damping = 0.01
    model = Looped().to(DT)
    seen = spy_calls(model.fc)
    pre = _pre(backend, model, "reduce")
    for seed in (1, 2):
        seen.clear()
        model.zero_grad()
        x, y = data(seed)
        out = model(x)
        pre.end_forward()
        F.cross_entropy(out, y).backward()
        grad = _grad_matrix(model.fc)  # the sum over the three calls, as autograd makes it
        pre.step(lr=0.1)
        a, g = by_hand(seen, "reduce")
        want = torch.linalg.solve(g + damping * torch.eye(g.shape[0], dtype=DT), grad)
        want = torch.linalg.solve(a + damping * torch.eye(a.shape[0], dtype=DT), want.T).T
        torch.testing.assert_close(_grad_matrix(model.fc), want, rtol=1e-9, atol=1e-11)


def _passes(model: nn.Module, pre: Preconditioner, x: Tensor, y: Tensor, k: int, views: bool) -> None:
    """``k`` forward passes over the parts of a batch: each with its backward pass, or ``views``: one backward after."""
    losses = []
    for part in range(k):
        rows = slice(part * len(x) // k, (part + 1) * len(x) // k)
        out = model(x[rows])
        pre.end_forward()
        losses.append(F.cross_entropy(out, y[rows]) / k)
        if not views:
            losses.pop().backward()
    if views:
        torch.stack(losses).sum().backward()


@pytest.mark.parametrize("views", [False, True], ids=["micro-batches", "views"])
@pytest.mark.parametrize("factor", ["expand", "reduce"])
def test_two_passes_give_the_factors_and_steps_of_one_batch(backend: TorchBackend, factor: str, views: bool) -> None:
    """Two micro-batches, or two forward passes before one backward pass (two views): one batch of both."""
    cfg = KFACConfig(factor=factor, damping=0.01, kl_clip=0.01)
    models = {k: Looped().to(DT) for k in (1, 2)}
    pres = {k: build.preconditioner(m, cfg, backend, accumulate=1 if views else k) for k, m in models.items()}
    opts = {k: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for k, m in models.items()}
    for seed in (1, 2, 3):
        x, y = data(seed, 2 * N)
        for k, model in models.items():
            opts[k].zero_grad()
            _passes(model, pres[k], x, y, k, views)
            pres[k].step(lr=0.1)
            opts[k].step()
        assert pres[2].capture.passes == 2 and pres[2].capture.uses == {"fc": 3, "head": 1}
        assert pres[1].factors.keys() == pres[2].factors.keys()
        for key, value in pres[1].factors.items():
            torch.testing.assert_close(pres[2].factors[key], value, rtol=1e-10, atol=1e-12, msg=key)
        for p, q in zip(models[1].parameters(), models[2].parameters(), strict=True):
            torch.testing.assert_close(q, p, rtol=1e-10, atol=1e-12)


class OtherBatches(nn.Module):
    """``fc`` applied to the batch and to its first two examples: the calls see different examples."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(E, C)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(x).mean(dim=1) + self.fc(x[:2]).mean(dim=1).sum(dim=0)


def test_calls_that_see_other_examples_are_refused_under_reduce(backend: TorchBackend) -> None:
    model = OtherBatches().to(DT)
    pre = _pre(backend, model, "expand")
    kfac_step(model, pre, *data(1))  # every call's rows are rows: nothing to match
    pre.remove()
    with pytest.raises(UserError, match=r"'fc' saw 2 examples .* kfac\.factor=expand, or add 'fc' to kfac\.skip"):
        kfac_step(model, _pre(backend, model, "reduce"), *data(1))


class TwoSizes(nn.Module):
    """A convolution applied to the image and to the image pooled to half its size."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(2, 3, 3, padding=1)
        self.head = nn.Linear(3, C)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.conv(x)).mean(dim=(2, 3)) + torch.tanh(self.conv(F.avg_pool2d(x, 2))).mean(dim=(2, 3))
        return self.head(h)


def test_a_conv2d_on_two_image_sizes_weighs_each_call_by_its_positions(backend: TorchBackend) -> None:
    model = TwoSizes().to(DT)
    seen = spy_calls(model.conv)
    pre = _pre(backend, model, "reduce")
    x, y = torch.randn(N, 2, 6, 6, dtype=DT, generator=torch.Generator().manual_seed(1)), torch.arange(N) % C
    for _ in range(2):
        seen.clear()
        kfac_step(model, pre, x, y)
        patches = [with_ones(F.unfold(rec["x"], 3, padding=1).transpose(1, 2)) for rec in seen]  # (N, L_c, a_dim)
        assert [p.shape[1] for p in patches] == [36, 9]
        mean_a = (patches[0].sum(dim=1) + patches[1].sum(dim=1)) / 45
        sum_g = sum(N * rec["go"].sum(dim=(2, 3)) for rec in seen)
        assert isinstance(sum_g, Tensor)
        torch.testing.assert_close(pre.factors["conv/A"], mean_a.T @ mean_a / N, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(pre.factors["conv/G"], sum_g.T @ sum_g / N, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize(
    "conv",
    [
        nn.Conv2d(2, 3, 3),
        nn.Conv2d(2, 3, 3, padding=1, stride=2),
        nn.Conv2d(2, 3, (3, 2), padding=(2, 0), dilation=(2, 1)),
        nn.Conv2d(2, 3, (3, 5), padding="same", dilation=(1, 2)),
        nn.Conv2d(2, 3, 3, stride=(3, 2)),
    ],
)
def test_the_uses_of_a_conv2d_are_its_output_positions(conv: nn.Conv2d) -> None:
    x = torch.randn(2, 2, 9, 7)
    windows = conv_windows(conv, x)
    assert ReduceFactors().uses(conv, x) == windows.shape[1] * windows.shape[2] == conv(x)[0, 0].numel()


@pytest.mark.slow
def test_d_mpd_spd_and_flow_agree_step_for_step_with_a_looped_layer() -> None:
    """The looped block behind an embedding under reduce: flow's thin factors go as the calls' combined rows."""
    agree(run_in_gloo(train_variants, 2, "reduce", TokenLooped, "fc"))
