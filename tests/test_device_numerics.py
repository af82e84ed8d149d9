"""K-FAC's state on its device and in its dtypes: restored checkpoints, half-precision factors, status reads."""

from __future__ import annotations

import io
import logging
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers import local_backend
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

from kfacflow.comm.torch_dist import TorchBackend
from kfacflow.configuration.schema import KFACConfig
from kfacflow.kfac.preconditioner import Preconditioner
from kfacflow.kfac.stages.inverse import cholesky_factor, cholesky_inverse, invert_all
from kfacflow.running import build

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")


def _model(dtype: torch.dtype = torch.float32, device: str = "cpu") -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(2, 4, 3), nn.Tanh(), nn.Flatten(), nn.Linear(4 * 4 * 4, 3)).to(device, dtype)


def _data(step: int, dtype: torch.dtype = torch.float32, device: str = "cpu") -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(8, 2, 6, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
    return x.to(device, dtype), y.to(device)


def _train(model: nn.Module, pre: Preconditioner, steps: range, dtype: torch.dtype, device: str = "cpu") -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in steps:
        x, y = _data(step, dtype, device)
        F.cross_entropy(model(x), y).backward()
        pre.step(lr=0.1)
        opt.step()
        opt.zero_grad()


def _pre(model: nn.Module, backend: TorchBackend, **kw: Any) -> Preconditioner:
    cfg = KFACConfig(**{"damping": 0.01, "kl_clip": 0.0, "inv_update_freq": 2, "factor_decay": 0.9, **kw})
    return build.preconditioner(model, cfg, backend)


def _widened(state: Any) -> Any:
    """Every floating tensor of a K-FAC state in float64: the same values, in another dtype than the run's."""
    if isinstance(state, Tensor):
        return state.double() if state.is_floating_point() else state
    if isinstance(state, dict):
        return {k: _widened(v) for k, v in state.items()}
    if isinstance(state, tuple | list):
        return type(state)(_widened(v) for v in state)
    return state


@pytest.mark.slow
@pytest.mark.parametrize("inverse", ["cholesky", "eigen", "cholesky_factor"])
def test_a_restored_state_continues_exactly_on_the_runs_own_dtype(
    monkeypatch: pytest.MonkeyPatch, inverse: str
) -> None:
    backend = local_backend(monkeypatch)
    whole = _model()
    pre = _pre(whole, backend, inverse=inverse)
    _train(whole, pre, range(5), torch.float32)
    pre.remove()

    first = _model()
    pre = _pre(first, backend, inverse=inverse)
    _train(first, pre, range(3), torch.float32)
    state, weights = pre.state_dict(), first.state_dict()
    pre.remove()
    resumed = _model()
    resumed.load_state_dict(weights)
    pre = _pre(resumed, backend, inverse=inverse)
    pre.load_state_dict(_widened(state))  # the checkpoint's tensors are not where the run keeps its own
    assert {t.dtype for t in pre.running.values()} == {torch.float32}
    assert {t.dtype for inv in pre.inverses.values() for t in inv.tensors} == {torch.float32}
    _train(resumed, pre, range(3, 5), torch.float32)
    for a, b in zip(resumed.parameters(), whole.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.cuda
@needs_cuda
def test_cuda_a_checkpoint_read_onto_the_cpu_resumes_on_the_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    backend = local_backend(monkeypatch, "cuda")
    whole = _model(device="cuda")
    pre = _pre(whole, backend)
    _train(whole, pre, range(5), torch.float32, "cuda")
    pre.remove()
    first = _model(device="cuda")
    pre = _pre(first, backend)
    _train(first, pre, range(3), torch.float32, "cuda")
    state = torch.load(_saved(pre.state_dict()), map_location="cpu", weights_only=False)  # as rundir reads one
    weights = first.state_dict()
    pre.remove()
    resumed = _model(device="cuda")
    resumed.load_state_dict(weights)
    pre = _pre(resumed, backend)
    pre.load_state_dict(state)
    assert {t.device.type for t in pre.running.values()} == {"cuda"}
    _train(resumed, pre, range(3, 5), torch.float32, "cuda")
    for a, b in zip(resumed.parameters(), whole.parameters(), strict=True):
        torch.testing.assert_close(a, b)


def _saved(state: dict[str, Any]) -> io.BytesIO:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return buffer


# --- half-precision factors -------------------------------------------------------------------------------


def test_a_large_finite_float16_factor_is_averaged_in(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A's entries (about 900, 19 x 19 of them) sum past float16's 65504: that is no reason to call it non-finite."""
    model = _model()
    pre = _pre(model, local_backend(monkeypatch), factor_dtype="float16", factor_decay=0.0)
    x, y = torch.full((8, 2, 6, 6), 30.0), torch.zeros(8, dtype=torch.long)
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            F.cross_entropy(model(x), y).backward()
            pre.step(lr=0.1)
            model.zero_grad()
    assert "non-finite" not in caplog.text
    a = pre.factors["0/A"]
    assert a.dtype == torch.float16 and torch.isfinite(a).all() and float(a.float().sum()) > 65504


def test_g_is_unscaled_before_it_is_cast_to_a_float16_factor(monkeypatch: pytest.MonkeyPatch) -> None:
    """Output gradients in float32 scaled by 2^24 pass float16's 65504: unscaled first, G is float32's G in float16."""
    backend = local_backend(monkeypatch)
    x, y = _data(0)
    factors = {}
    for dtype in ("float16", "float32"):
        model = _model()
        pre = _pre(model, backend, factor_dtype=dtype, factor_decay=0.0)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24)
        pre.grad_scaler = scaler
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler.scale(F.cross_entropy(model(x), y)).backward()
        scaler.unscale_(opt)
        pre.step(lr=0.1)
        factors[dtype] = pre.factors
        pre.remove()
    for key, g in factors["float16"].items():
        assert torch.isfinite(g).all(), key
        ref = factors["float32"][key]  # float16 arithmetic: within its precision of G's largest entry
        torch.testing.assert_close(g.float(), ref, rtol=1e-2, atol=2e-3 * float(ref.abs().max()))


# --- the statuses of factorizations: read once for many -----------------------------------------------------


class Reads(TorchDispatchMode):
    """Counts the operations that read a device value on the host (or check a status, which reads one)."""

    READS = ("aten._local_scalar_dense", "aten.item", "aten._linalg_check_errors", "aten.is_nonzero")

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.count += str(func).startswith(self.READS)
        return func(*args, **(kwargs or {}))


def _spd(n: int, d: int, device: str = "cpu") -> list[Tensor]:
    gen = torch.Generator().manual_seed(d)
    mats = [torch.randn(d, 2 * d, generator=gen, dtype=torch.float64) for _ in range(n)]
    return [(m @ m.T / d).to(device) for m in mats]


@pytest.mark.parametrize("invert", [cholesky_inverse, cholesky_factor], ids=["cholesky", "cholesky_factor"])
def test_many_factors_are_inverted_without_reading_a_status_each(invert: Any) -> None:
    factors = _spd(8, 16)
    with Reads() as reads:
        inverses = invert_all(invert, factors, 1e-3)
    assert reads.count == 0  # the statuses are read as one list, not one int() per factor
    for factor, inverse in zip(factors, inverses, strict=True):
        torch.testing.assert_close(inverse.dense(), invert(factor, 1e-3).dense(), rtol=0, atol=0)


def test_a_factor_that_needs_more_damping_still_gets_it_among_many() -> None:
    factors = _spd(3, 6)
    q, _ = torch.linalg.qr(factors[0])
    factors[1] = (q * torch.tensor([-0.005, 0.1, 0.5, 1, 2, 3], dtype=torch.float64)) @ q.T
    got = invert_all(cholesky_inverse, factors, 1e-3)
    for factor, inverse in zip(factors, got, strict=True):
        torch.testing.assert_close(inverse.dense(), cholesky_inverse(factor, 1e-3).dense())


@pytest.mark.cuda
@needs_cuda
def test_cuda_an_inversion_step_reads_the_device_once_for_its_statuses(monkeypatch: pytest.MonkeyPatch) -> None:
    backend = local_backend(monkeypatch, "cuda")
    model = _model(device="cuda")
    pre = _pre(model, backend, inv_update_freq=1)
    _train(model, pre, range(2), torch.float32, "cuda")  # warm up: the first step learns the layers
    x, y = _data(2, device="cuda")
    F.cross_entropy(model(x), y).backward()
    with Reads() as reads:
        pre.step(lr=0.1)
    assert reads.count == 0  # statuses as one list (tolist), flags copied without a wait
    factors = _spd(16, 64, "cuda")
    inverses = invert_all(cholesky_inverse, factors, 1e-3)
    for factor, inverse in zip(factors, inverses, strict=True):
        ref = torch.linalg.inv(factor + 1e-3 * torch.eye(64, dtype=factor.dtype, device="cuda"))
        torch.testing.assert_close(inverse.dense(), ref, rtol=1e-8, atol=1e-8)
        assert torch.equal(inverse.dense(), inverse.dense().T)
