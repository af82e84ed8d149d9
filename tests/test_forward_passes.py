"""Steps that are not one call of the model: its methods called directly (CLIP), or two passes before one backward.

A CLIP-style model is trained through ``encode_image`` and ``encode_text``, never ``model(...)``; a
SimCLR-style step runs the model on two views of the batch, then one loss and one backward pass. In
both, a step's calls of every layer are the rows of its factors, as one pass over the concatenated
inputs would give them (K-FAC-expand over the calls): the factors and the parameters equal those of
a model whose one forward pass takes everything.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kfacflow.comm.torch_dist import TorchBackend
from kfacflow.configuration.schema import KFACConfig
from kfacflow.kfac.preconditioner import Preconditioner
from kfacflow.running import build

DT = torch.float64
STEPS = 4


class TwoTowers(nn.Module):
    """CLIP in small: an image tower and a text tower; ``forward`` runs both (what the reference does)."""

    def __init__(self) -> None:
        super().__init__()
        self.image = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 4))
        self.text = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 4))

    def encode_image(self, x: Tensor) -> Tensor:
        return F.normalize(self.image(x), dim=-1)

    def encode_text(self, t: Tensor) -> Tensor:
        return F.normalize(self.text(t), dim=-1)

    def forward(self, x: Tensor, t: Tensor) -> tuple[Tensor, Tensor]:
        return self.encode_image(x), self.encode_text(t)


def _pre(backend: TorchBackend, model: nn.Module) -> Preconditioner:
    cfg = KFACConfig(factor_decay=0.9, kl_clip=0.0, damping=0.01)
    return build.preconditioner(model, cfg, backend)


def _clip_loss(image: Tensor, text: Tensor) -> Tensor:
    logits = 5.0 * image @ text.T
    labels = torch.arange(len(image))
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2


def _train(backend: TorchBackend, model: nn.Module, loss_of: Any) -> dict[str, Any]:
    pre = _pre(backend, model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(step)
        loss_of(step, gen).backward()
        pre.step(lr=0.1)
        opt.step()
        opt.zero_grad()
    factors = {k: v.clone() for k, v in pre.factors.items()}
    pre.remove()
    return {"params": {k: v.detach().clone() for k, v in model.state_dict().items()}, "factors": factors}


def _same(a: dict[str, Any], b: dict[str, Any]) -> None:
    for part in ("params", "factors"):
        assert a[part].keys() == b[part].keys()
        for key in a[part]:
            torch.testing.assert_close(a[part][key], b[part][key], rtol=1e-10, atol=1e-12)


def test_a_model_trained_through_its_methods_trains_as_through_forward(
    backend: TorchBackend, caplog: pytest.LogCaptureFixture
) -> None:
    def data(gen: torch.Generator) -> tuple[Tensor, Tensor]:
        return torch.randn(8, 6, generator=gen, dtype=DT), torch.randn(8, 3, generator=gen, dtype=DT)

    results = []
    for direct in (True, False):
        torch.manual_seed(0)
        model = TwoTowers().to(DT)

        def loss(step: int, gen: torch.Generator, model: TwoTowers = model, direct: bool = direct) -> Tensor:
            x, t = data(gen)
            image, text = (model.encode_image(x), model.encode_text(t)) if direct else model(x, t)
            return _clip_loss(image, text)

        with caplog.at_level(logging.WARNING):
            results.append(_train(backend, model, loss))
    _same(*results)
    assert sum("the model itself was not called" in r.message for r in caplog.records) == 1


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 4))

    def forward(self, x: Tensor) -> Tensor:
        return F.normalize(self.body(x), dim=-1)


def _views(gen: torch.Generator) -> tuple[Tensor, Tensor]:
    x = torch.randn(6, 6, generator=gen, dtype=DT)
    return x + 0.1 * torch.randn(6, 6, generator=gen, dtype=DT), x * 0.9


def _nt_xent(z: Tensor) -> Tensor:
    """SimCLR's loss over the 2N views: each view's positive is the other view of its example."""
    n = len(z) // 2
    sim = (z @ z.T) / 0.5 - 1e9 * torch.eye(2 * n, dtype=z.dtype)
    targets = torch.cat([torch.arange(n, 2 * n), torch.arange(n)])
    return F.cross_entropy(sim, targets)


def test_two_forward_passes_before_one_backward_train_as_one_pass_over_both(backend: TorchBackend) -> None:
    results = []
    for passes in (2, 1):
        torch.manual_seed(0)
        model = Encoder().to(DT)

        def loss(step: int, gen: torch.Generator, model: Encoder = model, passes: int = passes) -> Tensor:
            a, b = _views(gen)
            z = torch.cat([model(a), model(b)]) if passes == 2 else model(torch.cat([a, b]))
            return _nt_xent(z)

        results.append(_train(backend, model, loss))
    _same(*results)
