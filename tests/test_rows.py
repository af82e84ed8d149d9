"""``kfac.precondition=rows``: ``G^-1 grad A^-1`` from each layer's rows, by hand and on 2 gloo workers."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers import kfac_sgd_step, local_backend, run_in_gloo
from torch import nn

from kfacflow.comm.torch_dist import TorchBackend
from kfacflow.configuration.schema import DistConfig, KFACConfig
from kfacflow.kfac.stages.contracts import LayerRows
from kfacflow.kfac.stages.inverse import Cholesky, CholeskyFactor
from kfacflow.kfac.stages.precondition import RowsPrecondition, full_flops, precondition, row_flops
from kfacflow.registry import GRAD_SYNCS
from kfacflow.running import build

BATCH = 4
STEPS = 6


def make_model() -> nn.Module:
    """A conv whose output is 1x1 (its rows: the examples) and two Linears: the conv and fc1 go by rows, fc2 not."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(8, 32, 3, padding=1, stride=3),  # 3x3 input -> 1x1 output: a = 73, g = 32
        nn.Tanh(),
        nn.Flatten(),
        nn.Linear(32, 32),
        nn.Tanh(),
        nn.Linear(32, 3),
    ).double()


def test_costs_by_hand() -> None:
    assert full_flops(73, 32) == 2 * 32 * 73 * 105 and row_flops(8, 73, 32) == 2 * 8 * (73 * 73 + 32 * 32 + 32 * 73)
    stage = RowsPrecondition(0.0)
    assert stage.rows_pay(8, 73, 32)  # 139,024 <= 245,280
    assert stage.rows_pay(8, 33, 32) and not stage.rows_pay(8, 33, 3)  # fc1 by rows; fc2: 19,152 > 3,564
    assert not stage.rows_pay(64, 73, 32)  # more rows than half the width: from the gradient
    assert stage.rows_pay(64, 4609, 512)  # ResNet's 4608-wide layers on 32 px images, 2 x 32 examples
    assert not stage.rows_pay(2 * 32 * 49, 4609, 512)  # ... but not at 224 px (7 x 7 positions)


def _inverses(dim: int, seed: int, method: Any) -> Any:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(3 * dim, dim, generator=gen, dtype=torch.float64)
    return method(x.T @ x / (3 * dim), 0.1)


@pytest.mark.parametrize("method", [Cholesky(), CholeskyFactor()], ids=["dense", "cholesky_factor"])
def test_rows_give_the_update_of_the_gradient(method: Any, caplog: pytest.LogCaptureFixture) -> None:
    gen = torch.Generator().manual_seed(3)
    delta = torch.randn(10, 5, generator=gen, dtype=torch.float64)
    a = torch.randn(10, 7, generator=gen, dtype=torch.float64)
    grad = delta.T @ a / 2  # two ranks' rows stacked
    a_inv, g_inv = _inverses(7, 1, method), _inverses(5, 2, method)
    rows = LayerRows("fc", delta, a, 2, torch.finfo(torch.float64).eps)
    stage = RowsPrecondition(0.0)
    expected = g_inv.dense() @ grad @ a_inv.dense()
    torch.testing.assert_close(stage.layer(grad, a_inv, g_inv, rows), expected, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(stage.layer(grad, a_inv, g_inv), expected, rtol=1e-12, atol=1e-14)
    # A gradient the rows do not give (clipped after the backward pass): preconditioned as it is, one warning.
    with caplog.at_level(logging.WARNING):
        clipped = grad * 0.99
        out = stage.layer(clipped, a_inv, g_inv, rows)
        stage.layer(clipped, a_inv, g_inv, rows)
    assert torch.equal(out, precondition(clipped, a_inv, g_inv))
    assert [r.getMessage() for r in caplog.records].count(next(iter(caplog.messages))) == 1
    assert "the rows of fc do not give its gradient" in caplog.messages[0]


def _layer_rows_one_process(monkeypatch: pytest.MonkeyPatch, module: nn.Module, x: torch.Tensor) -> None:
    """Capture one layer's rows in a one-process run and check ``delta^T a`` against autograd's gradient."""
    backend = local_backend(monkeypatch)
    model = nn.Sequential(module, nn.Flatten(), nn.Linear(module(x).flatten(1).shape[1], 2)).double()
    cfg = KFACConfig(precondition="rows", variant="d", inv_update_freq=1)
    pre = build.preconditioner(model, cfg, backend, None)
    pre.rows.pays = lambda rows, a, g: True  # every layer, whatever it costs
    try:
        for _ in range(2):  # the first step counts the rows; the second keeps them
            out = model(x)
            pre.end_forward()
            out.square().sum().backward()
            layer = pre.layers[0]
            if pre.rows.planned is not None:
                assert pre.rows.chosen(layer.name)
                pre.rows.post(pre.layers)
                rows = pre.rows.get(layer.name)
                assert rows is not None and rows.world == 1
                grad = layer.grad_matrix()
                assert grad is not None
                torch.testing.assert_close(rows.delta.T @ rows.a, grad, rtol=1e-12, atol=1e-12)
            pre.step(lr=0.1)
            model.zero_grad()
    finally:
        pre.remove()


@pytest.mark.parametrize(
    "module",
    [
        nn.Conv2d(3, 4, 3, padding=1, stride=2),
        nn.Conv2d(3, 4, (2, 3), padding=(1, 0), dilation=(1, 2), bias=False),
        nn.Conv2d(3, 4, 3, padding="same"),
        nn.Linear(5, 4),
    ],
    ids=["strided", "dilated-no-bias", "same", "linear"],
)
def test_rows_are_the_gradient(monkeypatch: pytest.MonkeyPatch, module: nn.Module) -> None:
    gen = torch.Generator().manual_seed(0)
    shape = (3, 5) if isinstance(module, nn.Linear) else (3, 3, 6, 7)
    x = torch.randn(*shape, generator=gen, dtype=torch.float64)
    _layer_rows_one_process(monkeypatch, module.double(), x)


def _deferred_step(
    backend: TorchBackend, net: nn.Module, pre: Any, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> int:
    """A step whose gradients the preconditioner averages after backward (as the trainer's); the elements it sent."""
    sync = GRAD_SYNCS.get("deferred")
    with sync.backward(backend, net, last=True):
        out = net(x)
        pre.end_forward()
        F.cross_entropy(out, y).backward()
    gradients = sync.gradients(backend, list(net.parameters()))
    sent: list[int] = []
    post = gradients._post

    def counted(bucket: list[torch.Tensor]) -> None:
        sent.append(sum(t.numel() for t in bucket))
        post(bucket)

    gradients._post = counted  # type: ignore[method-assign]
    pre.step(lr=0.1, gradients=gradients)
    opt.step()
    opt.zero_grad()
    return sum(sent)


def _train(
    backend: TorchBackend, precondition_name: str, variant: dict[str, Any], batch: str, deferred: bool = False
) -> dict[str, Any]:
    cfg = KFACConfig(**variant, precondition=precondition_name, damping=0.01, kl_clip=0.01, inv_update_freq=2)
    model = make_model()
    net = backend.wrap_model(model)
    pre = build.preconditioner(model, cfg, backend, None)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(1)
    sent = []
    for step in range(STEPS):
        x = torch.randn(backend.world_size * BATCH + 2, 8, 3, 3, generator=gen, dtype=torch.float64)
        y = torch.randint(0, 3, (backend.world_size * BATCH + 2,), generator=gen)
        size = BATCH
        if step == 3 and backend.rank == 1:
            # A short batch on one rank: it sends zero rows for the missing ones. A long one: it cannot
            # send all its rows, and the layers go by their gradients this step.
            size = {"even": BATCH, "short": 2, "long": BATCH + 2}[batch]
        x, y = x[backend.rank * BATCH :][:size], y[backend.rank * BATCH :][:size]
        if deferred:
            sent.append(_deferred_step(backend, net, pre, opt, x, y))
        else:
            kfac_sgd_step(net, pre, opt, x, y)
    pre.remove()
    warned: set[str] = getattr(pre.stages.precondition, "warned", set())
    params = [p.detach().clone() for p in model.parameters()]
    return {"params": params, "planned": dict(pre.rows.planned or {}), "warned": warned | pre.rows.warned, "sent": sent}


VARIANTS: dict[str, dict[str, Any]] = {
    "d": {"variant": "d"},
    "owners": {"fusion": "layerwise", "placement": "round_robin", "inverse": "cholesky_factor", "broadcast": "update"},
}


BATCHES = ("even", "short", "long")


def _gloo_body(rank: int, world: int) -> dict[tuple[str, str, str], Any]:
    backend = TorchBackend(DistConfig(device="cpu"))
    try:
        return {
            (name, how, batch): _train(backend, how.removesuffix("+deferred"), variant, batch, how.endswith("deferred"))
            for name, variant in VARIANTS.items()
            for how in ("kfac", "rows", "rows+deferred")
            for batch in BATCHES
        }
    finally:
        backend.close()


@pytest.mark.slow
def test_rows_train_as_the_gradient_does_on_two_workers() -> None:
    ranks = run_in_gloo(_gloo_body, 2, timeout=300)
    for name in VARIANTS:
        for batch in BATCHES:
            rows, grads = ranks[0][(name, "rows", batch)], ranks[0][(name, "kfac", batch)]
            # Each rank sends its 4 examples' rows (1x1 output: a row an example): the conv and fc1 by rows.
            assert rows["planned"] == {"0": BATCH, "3": BATCH} and grads["planned"] == {}
            for a, b in zip(rows["params"], grads["params"], strict=True):
                torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=f"{name}, {batch}")
            assert any(not torch.equal(a, b) for a, b in zip(rows["params"], grads["params"], strict=True))
            for a, b in zip(rows["params"], ranks[1][(name, "rows", batch)]["params"], strict=True):
                assert torch.equal(a, b), f"{name}: the ranks differ"
            # Only the long batch's step falls back, on the ranks that precondition those layers.
            warned = ranks[0][(name, "rows", batch)]["warned"] | ranks[1][(name, "rows", batch)]["warned"]
            assert warned == ({"0", "3"} if batch == "long" else set()), f"{name}, {batch}"
            # Gradients averaged after backward: the conv's and fc1's do not travel once the rows are planned
            # (their averages are rebuilt from the rows); on the long batch's step, every rank's flags say so
            # and every rank averages them instead. The same parameters either way.
            for rank in ranks:
                deferred = rank[(name, "rows+deferred", batch)]
                every = sum(p.numel() for p in make_model().parameters())
                assert deferred["sent"] == [every] + [every - 32 * 73 - 32 * 33] * (STEPS - 1), f"{name}, {batch}"
                assert deferred["warned"] == ({"0", "3"} if batch == "long" else set()), f"{name}, {batch}"
                for a, b in zip(deferred["params"], grads["params"], strict=True):
                    torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=f"{name}, {batch}, deferred")
