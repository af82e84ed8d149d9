"""The factor hooks: a layer called twice per forward, layers never called, and forwards K-FAC cannot place."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from kfacflow import UserError
from kfacflow.comm.torch_dist import TorchBackend
from kfacflow.configuration.schema import KFACConfig
from kfacflow.kfac.preconditioner import Preconditioner
from kfacflow.kfac.stages import factors
from kfacflow.kfac.stages.factors import ExpandFactors
from kfacflow.registry import FACTORS
from kfacflow.running import build

DT = torch.float64


class Twice(nn.Module):
    """``fc`` applied to two inputs (shared weights), then a head: fc runs twice per forward."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 4)
        self.head = nn.Linear(4, 2)
        self.calls = 2

    def forward(self, x: Tensor) -> Tensor:
        h = sum(torch.tanh(self.fc(x * (i + 1))) for i in range(self.calls))
        assert isinstance(h, Tensor)
        return self.head(h)


def _pre(backend: TorchBackend, model: nn.Module, **kw: Any) -> Preconditioner:
    cfg = KFACConfig(factor_decay=0.0, kl_clip=0.0, damping=0.01, **kw)
    return build.preconditioner(model, cfg, backend)


def _step(model: nn.Module, pre: Preconditioner, x: Tensor, y: Tensor) -> None:
    model.zero_grad()
    out = model(x)
    pre.end_forward()
    F.cross_entropy(out, y).backward()
    pre.step(lr=0.1)


def test_a_layer_called_twice_counts_every_call_in_a_and_g(backend: TorchBackend) -> None:
    torch.manual_seed(0)
    model = Twice().to(DT)
    seen: list[dict[str, Tensor]] = []

    def spy(module: nn.Module, inputs: tuple[Tensor, ...], out: Tensor) -> None:
        rec = {"x": inputs[0].detach().clone()}
        seen.append(rec)
        out.register_hook(lambda g: rec.__setitem__("go", g.detach().clone()))

    model.fc.register_forward_hook(spy)
    pre = _pre(backend, model)
    n = 5
    x = torch.randn(n, 3, dtype=DT, generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 2, (n,), generator=torch.Generator().manual_seed(2))
    _step(model, pre, x, y)
    assert len(seen) == 2
    # By hand (K-FAC-expand for weight sharing): A averages the rows of both calls, G adds their terms.
    rows = [torch.cat([rec["x"][i], torch.ones(1, dtype=DT)]) for rec in seen for i in range(n)]
    a = sum(torch.outer(r, r) for r in rows) / len(rows)
    g = sum(torch.outer(n * rec["go"][i], n * rec["go"][i]) for rec in seen for i in range(n)) / n
    torch.testing.assert_close(pre.factors["fc/A"], a, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(pre.factors["fc/G"], g, rtol=1e-12, atol=1e-14)
    assert pre.capture.uses == {"fc": 2, "head": 1}
    # Later steps hand the factor over at its second call and give the same mathematics.
    seen.clear()
    _step(model, pre, x, y)
    rows = [torch.cat([rec["x"][i], torch.ones(1, dtype=DT)]) for rec in seen for i in range(n)]
    torch.testing.assert_close(pre.factors["fc/A"], sum(torch.outer(r, r) for r in rows) / len(rows))


def test_more_calls_than_the_first_step_is_an_error(backend: TorchBackend) -> None:
    torch.manual_seed(0)
    model = Twice().to(DT)
    model.calls = 1
    pre = _pre(backend, model)
    x, y = torch.randn(4, 3, dtype=DT), torch.tensor([0, 1, 0, 1])
    _step(model, pre, x, y)
    model.calls = 2
    with pytest.raises(UserError, match=r"'fc' ran 2 times in one forward pass but 1 times in the first.*kfac.skip"):
        _step(model, pre, x, y)


def test_fewer_calls_than_the_first_step_still_hands_over_the_factors(backend: TorchBackend) -> None:
    torch.manual_seed(0)
    model = Twice().to(DT)
    pre = _pre(backend, model)
    x, y = torch.randn(4, 3, dtype=DT), torch.tensor([0, 1, 0, 1])
    _step(model, pre, x, y)
    model.calls = 1
    _step(model, pre, x, y)
    rows = torch.cat([x, torch.ones(4, 1, dtype=DT)], dim=1)
    torch.testing.assert_close(pre.factors["fc/A"], rows.T @ rows / 4)


class Direct(nn.Module):
    """A parent that hands ``proj.weight`` to ``F.linear`` itself: that Linear's forward never runs."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(F.linear(x, self.proj.weight, self.proj.bias)))


def test_a_layer_whose_forward_never_runs_is_left_to_the_optimizer(
    backend: TorchBackend, caplog: pytest.LogCaptureFixture
) -> None:
    torch.manual_seed(0)
    model = Direct().to(DT)
    pre = _pre(backend, model)
    assert [layer.name for layer in pre.layers] == ["proj", "head"]
    x, y = torch.randn(3, 4, dtype=DT), torch.tensor([0, 1, 1])
    with caplog.at_level(logging.INFO):
        _step(model, pre, x, y)
    assert [layer.name for layer in pre.layers] == ["head"]
    assert pre.keys == ["head/A", "head/G"] and len(pre.owners) == 2
    assert any("proj" in r.message and "never ran" in r.message for r in caplog.records)
    grad = model.proj.weight.grad
    assert grad is not None and torch.isfinite(grad).all()
    _step(model, pre, x, y)  # and training goes on
    state = pre.state_dict()
    assert state["layers"] == {"head": 1}


class Attention(nn.Module):
    """A MultiheadAttention: K-FAC calls its projections as modules (``attn.in_proj``, ``attn.out_proj``)."""

    def __init__(self, **kw: Any) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(4, 2, batch_first=True, **kw)
        self.head = nn.Linear(4, 2)

    def forward(self, x: Tensor) -> Tensor:
        h, _ = self.attn(x, x, x)
        return self.head(h.mean(1))


def test_a_multihead_attentions_projections_are_kept_and_one_k_fac_cannot_take_is_named(
    backend: TorchBackend, caplog: pytest.LogCaptureFixture
) -> None:
    torch.manual_seed(0)
    model = Attention().to(DT)
    pre = _pre(backend, model)
    x, y = torch.randn(3, 5, 4, dtype=DT), torch.tensor([0, 1, 1])
    for _ in range(2):
        _step(model, pre, x, y)
    assert [layer.name for layer in pre.layers] == ["attn.in_proj", "attn.out_proj", "head"]
    assert pre.state_dict()["layers"] == {"attn.in_proj": 1, "attn.out_proj": 1, "head": 1}
    pre.remove()
    assert "forward" not in vars(model.attn)
    model = Attention(add_zero_attn=True).to(DT)
    with caplog.at_level(logging.INFO):
        pre = _pre(backend, model)
    assert [layer.name for layer in pre.layers] == ["head"]
    assert "forward" not in vars(model.attn)
    line = "K-FAC skips attn (MultiheadAttention) and its projections: add_zero_attn"
    assert [r.message for r in caplog.records if "attn" in r.message][0].startswith(line)
    _step(model, pre, x, y)
    assert [layer.name for layer in pre.layers] == ["head"]


class Checkpointed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.head = nn.Linear(3, 2)

    def forward(self, x: Tensor) -> Tensor:
        h = checkpoint(lambda t: torch.tanh(self.fc(t)), x, use_reentrant=False)
        return self.head(h)


def test_activation_checkpointing_is_an_error_not_a_mismatch(backend: TorchBackend) -> None:
    torch.manual_seed(0)
    model = Checkpointed().to(DT)
    pre = _pre(backend, model)
    x = torch.randn(4, 3, dtype=DT, requires_grad=True)
    with pytest.raises(UserError, match=r"'fc' ran forward during the backward pass.*checkpointing"):
        _step(model, pre, x, torch.tensor([0, 1, 0, 1]))


class FullMatrices:
    """A factor stage with only the protocol's full-matrix methods: capture packs what it returns."""

    calls = 0

    def __init__(self) -> None:
        self.shipped = ExpandFactors()

    def a_factor_rows(self, module: nn.Module, x: Tensor) -> tuple[Tensor, int]:
        FullMatrices.calls += 1
        return self.shipped.a_factor_rows(module, x)

    def g_factor(self, module: nn.Module, grad_out: Tensor, batch: int) -> Tensor:
        FullMatrices.calls += 1
        return self.shipped.g_factor(module, grad_out, batch)


class DoubledA(ExpandFactors):
    """The shipped stage with ``a_factor_rows`` overridden alone: its own A must be used, not the parent's triangle."""

    def a_factor_rows(self, module: nn.Module, x: Tensor) -> tuple[Tensor, int]:
        factor, rows = super().a_factor_rows(module, x)
        return 2 * factor, rows


if "full_matrices" not in FACTORS:
    FACTORS.add("full_matrices", FullMatrices, "full matrices only (a test's own factor stage)")
    FACTORS.add("doubled_a", DoubledA, "the shipped stage, A doubled by an override (a test's own)")


def test_a_factor_stage_of_full_matrices_gives_the_shipped_factors(
    backend: TorchBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(factors, "GRAM_BLOCK", 4)  # the shipped stage computes triangles in block rows
    monkeypatch.setattr(FullMatrices, "calls", 0)
    got = {}
    for name in ("expand", "full_matrices", "doubled_a"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(2, 3, 3), nn.Tanh(), nn.Flatten(), nn.Linear(12, 3)).to(DT)
        pre = _pre(backend, model, factor=name)
        x = torch.randn(4, 2, 4, 4, dtype=DT, generator=torch.Generator().manual_seed(1))
        _step(model, pre, x, torch.tensor([0, 1, 2, 1]))
        got[name] = dict(pre.factors)
    assert FullMatrices.calls == 4  # A and G of both layers went through the full-matrix methods
    # (and DoubledA's G through the inherited triangle, its A through its own override: below)
    assert got["expand"].keys() == got["full_matrices"].keys() == {"0/A", "0/G", "3/A", "3/G"}
    for key, want in got["expand"].items():
        torch.testing.assert_close(got["full_matrices"][key], want, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(got["doubled_a"][key], 2 * want if key.endswith("/A") else want)
