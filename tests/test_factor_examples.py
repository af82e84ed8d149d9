"""``kfac.factor_examples``: factors estimated from the first examples of each batch, the gradient from all.

A and G from the first ``k`` of ``N`` examples are exactly the factors of a batch of those ``k``
examples alone (G's scale undoes the 1/N of the batch-mean loss with N, then counts k examples), for
a model whose examples do not see each other: the reference is kfacflow's own factors of that
smaller batch, which tests/test_factors.py checks against hand computation.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers import local_backend
from test_stage_equivalence import PROFILE
from torch import Tensor, nn

from kfacflow import UserError
from kfacflow.configuration.recipe import load
from kfacflow.configuration.schema import KFACConfig
from kfacflow.running import build

N, KEEP = 8, 3


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 3, 3), nn.ReLU(), nn.Flatten(), nn.Linear(3 * 4 * 4, 10)).double()
    for p in model.parameters():
        nn.init.normal_(p, std=0.3)
    return model


def _batch() -> tuple[Tensor, Tensor]:
    torch.manual_seed(1)
    return torch.randn(N, 2, 6, 6, dtype=torch.float64), torch.randint(0, 5, (N,))


def _factors(
    monkeypatch: pytest.MonkeyPatch, parts: list[slice | Tensor], accumulate: int = 1, steps: int = 1, **kfac: Any
) -> dict[str, Tensor]:
    """The factors after ``steps`` steps of the micro-batches ``parts`` (each loss divided by their count)."""
    model = _model()
    cfg = KFACConfig(**{"factor_decay": 0.0, **kfac})
    pre = build.preconditioner(model, cfg, local_backend(monkeypatch), PROFILE, accumulate=accumulate)
    x, y = _batch()
    for _ in range(steps):
        for part in parts:
            (F.cross_entropy(model(x[part]), y[part]) / len(parts)).backward()
        pre.step(0.1)
        model.zero_grad()
    return pre.factors


def _close(got: dict[str, Tensor], want: dict[str, Tensor]) -> None:
    assert set(got) == set(want)
    for key, factor in want.items():
        assert torch.allclose(got[key], factor, rtol=1e-10, atol=1e-12), (key, (got[key] - factor).abs().max())


@pytest.mark.parametrize("factor", ["expand", "reduce"])
@pytest.mark.parametrize("variant", ["d", "flow"])
def test_factors_of_the_first_examples_are_those_of_a_batch_of_them(
    monkeypatch: pytest.MonkeyPatch, variant: str, factor: str
) -> None:
    kept = _factors(monkeypatch, [slice(None)], variant=variant, factor=factor, factor_examples=KEEP)
    _close(kept, _factors(monkeypatch, [slice(0, KEEP)], variant=variant, factor=factor))
    whole = _factors(monkeypatch, [slice(None)], variant=variant, factor=factor)
    assert all(not torch.allclose(kept[k], whole[k]) for k in whole)  # the test can fail: the subset changed them


def test_factors_held_as_rows_between_inversions(monkeypatch: pytest.MonkeyPatch) -> None:
    # flow sums factors locally between inversions (steps 1 and 2; exchanged at 3), a thin one as its rows (the
    # Linear's A and G: 3 kept rows of 49 and 10 columns), whose weight is the kept batch's.
    kfac: dict[str, Any] = {"variant": "flow", "inv_update_freq": 3, "factor_decay": 0.5}
    kept = _factors(monkeypatch, [slice(None)], steps=4, factor_examples=KEEP, **kfac)
    _close(kept, _factors(monkeypatch, [slice(0, KEEP)], steps=4, **kfac))


def test_each_micro_batch_keeps_its_own_first_examples(monkeypatch: pytest.MonkeyPatch) -> None:
    half = N // 2
    kept = _factors(monkeypatch, [slice(0, half), slice(half, N)], accumulate=2, factor_examples=2)
    _close(kept, _factors(monkeypatch, [torch.tensor([0, 1, half, half + 1])]))


@pytest.mark.parametrize("keep", [0, N, 2 * N])
def test_a_batch_no_larger_than_the_examples_kept_is_used_whole(monkeypatch: pytest.MonkeyPatch, keep: int) -> None:
    whole = _factors(monkeypatch, [slice(None)])
    got = _factors(monkeypatch, [slice(None)], factor_examples=keep)
    assert all(torch.equal(got[k], whole[k]) for k in whole)  # the same tensors through the same code


def test_the_gradient_still_comes_from_every_example(monkeypatch: pytest.MonkeyPatch) -> None:
    # The Linear's update is (G + γI)⁻¹ ∇ (A + γI)⁻¹ with the factors of the first KEEP examples and the
    # gradient ∇ of the whole batch (bias as the last column), by hand.
    damping = 0.01
    model, plain = _model(), _model()
    cfg = KFACConfig(factor_decay=0.0, factor_examples=KEEP, damping=damping, kl_clip=0.0)
    pre = build.preconditioner(model, cfg, local_backend(monkeypatch))
    x, y = _batch()
    for m in (model, plain):
        F.cross_entropy(m(x), y).backward()
    pre.step(0.1)

    def matrix(linear: nn.Module) -> Tensor:
        assert isinstance(linear, nn.Linear) and linear.weight.grad is not None and linear.bias.grad is not None
        return torch.cat([linear.weight.grad, linear.bias.grad[:, None]], dim=1)

    grad = matrix(plain[3])
    factors = _factors(monkeypatch, [slice(0, KEEP)])
    a, g = factors["3/A"], factors["3/G"]
    want = torch.linalg.solve(g + damping * torch.eye(g.shape[0], dtype=g.dtype), grad)
    want = torch.linalg.solve(a + damping * torch.eye(a.shape[0], dtype=a.dtype), want.T).T
    got = matrix(model[3])
    assert torch.allclose(got, want, rtol=1e-8, atol=1e-10), (got - want).abs().max()


def test_a_negative_count_is_refused_by_name() -> None:
    with pytest.raises(UserError, match=r"kfac\.factor_examples=-1 must be >= 0"):
        load(["recipes/quickstart.yaml"], ["kfac.factor_examples=-1"])
