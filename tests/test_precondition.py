"""Tests for kfacflow.kfac.stages.inverse, kfacflow.kfac.stages.precondition and Preconditioner (one process)."""

from __future__ import annotations

import io
import math
from typing import Any, cast

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kfacflow.comm.torch_dist import TorchBackend
from kfacflow.configuration.schema import KFACConfig
from kfacflow.kfac.packing import pack
from kfacflow.kfac.preconditioner import Preconditioner
from kfacflow.kfac.stages.inverse import Inverse, cholesky_inverse, eigen_inverse
from kfacflow.kfac.stages.precondition import KFACPrecondition, kl_clip_scale, precondition
from kfacflow.registry import INVERSES
from kfacflow.running import build

DT = torch.float64
KINDS = ["cholesky", "eigen"]


def spd(d: int, seed: int, shift: float = 0.1) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    b = torch.randn(d, d + 2, generator=g, dtype=DT)
    return b @ b.T / (d + 2) + shift * torch.eye(d, dtype=DT)


def rel_close(got: Tensor, want: Tensor, rel: float = 1e-10) -> None:
    assert got.shape == want.shape, (got.shape, want.shape)
    err = float((got - want).norm() / want.norm())
    assert err < rel, f"relative error {err:.3e}"


# --- inverses and the Kronecker identity -------------------------------------------------------------


def test_registry_names() -> None:
    assert INVERSES.get("cholesky") is cholesky_inverse
    assert INVERSES.get("eigen") is eigen_inverse


@pytest.mark.parametrize("name", KINDS)
@pytest.mark.parametrize("damping", [1e-3, 0.3])
def test_kronecker_identity(name: str, damping: float) -> None:
    a_dim, g_dim = 4, 3
    a, g = spd(a_dim, 1), spd(g_dim, 2)
    grad = torch.randn(g_dim, a_dim, generator=torch.Generator().manual_seed(3), dtype=DT)
    invert = INVERSES.get(name)
    got = precondition(grad, invert(a, damping), invert(g, damping))
    eye_a, eye_g = torch.eye(a_dim, dtype=DT), torch.eye(g_dim, dtype=DT)
    big = torch.kron(a + damping * eye_a, g + damping * eye_g)
    vec = torch.linalg.solve(big, grad.T.reshape(-1))
    want = vec.reshape(a_dim, g_dim).T
    rel_close(got, want)
    # and the product really solves the damped system
    rel_close(big @ got.T.reshape(-1), grad.T.reshape(-1))


@pytest.mark.parametrize("name", KINDS)
def test_dense_flat_left_right(name: str) -> None:
    d, damping = 5, 0.01
    f = spd(d, 7)
    inv = INVERSES.get(name)(f, damping)
    assert inv.kind == {"cholesky": "dense", "eigen": "eigen"}[name]
    want = torch.linalg.inv(f + damping * torch.eye(d, dtype=DT))
    rel_close(inv.dense(), want)
    flat = inv.to_flat()
    assert flat.shape == (Inverse.flat_size(inv.kind, d),)
    assert Inverse.flat_size("dense", d) == d * (d + 1) // 2 == 15
    assert Inverse.flat_size("eigen", d) == d * d + d == 30
    back = Inverse.from_flat(inv.kind, flat.clone(), d)
    assert back.kind == inv.kind
    # The broadcast carries every bit: rebuilt from the vector, the inverse holds the same numbers.
    assert torch.equal(back.to_flat(), flat)
    # Products may still round differently (the rebuilt Q is row-major where eigh's is not, and a
    # matmul's rounding depends on the memory layout on some CPUs), hence every rank, the owner
    # included, takes the broadcast copy; here only closeness is guaranteed.
    rel_close(back.dense(), inv.dense(), 1e-14)
    x = torch.randn(d, 3, generator=torch.Generator().manual_seed(8), dtype=DT)
    y = torch.randn(2, d, generator=torch.Generator().manual_seed(9), dtype=DT)
    rel_close(inv.left(x), want @ x)
    rel_close(inv.right(y), y @ want)
    rel_close(back.left(x), want @ x)


def test_eigen_clamps_negative_round_off() -> None:
    d, damping = 4, 1e-12
    q, _ = torch.linalg.qr(torch.randn(d, d, generator=torch.Generator().manual_seed(11), dtype=DT))
    evals = torch.tensor([-2e-12, 0.0, 1.0, 2.0], dtype=DT)
    f = (q * evals) @ q.T
    f = (f + f.T) / 2
    inv = eigen_inverse(f, damping)
    _, scale = inv.tensors
    assert bool((scale > 0).all())
    assert torch.isfinite(inv.dense()).all()
    # the two null directions get 1/damping (not 1/(-2e-12 + 1e-12) = -1e12)
    small = scale.sort().values[-2:]
    torch.testing.assert_close(small, torch.full((2,), 1 / damping, dtype=DT), rtol=1e-2, atol=0)
    big = scale.sort().values[:2]
    torch.testing.assert_close(big, torch.tensor([1 / 2.0, 1 / 1.0], dtype=DT), rtol=1e-9, atol=0)
    # in the non-null subspace the inverse is exact, up to round-off (1e-16) amplified by 1/damping (1e12)
    v = q[:, 2:]
    torch.testing.assert_close(inv.left(v), v / evals[2:], rtol=0, atol=1e-3)


def test_cholesky_retries_with_more_damping_then_falls_back_to_eigen(caplog: pytest.LogCaptureFixture) -> None:
    # eigenvalue -5e-8: indefinite with damping 1e-8, positive definite with 10x damping (1e-7).
    f = torch.tensor([[1.0, 0.0], [0.0, -5e-8]], dtype=DT)
    with pytest.raises(torch.linalg.LinAlgError):
        torch.linalg.cholesky(f + 1e-8 * torch.eye(2, dtype=DT))
    torch.testing.assert_close(cholesky_inverse(f, 1e-8).dense(), torch.linalg.inv(f + 1e-7 * torch.eye(2, dtype=DT)))
    # eigenvalue -1: indefinite even with 100x damping -> eigendecomposition with the eigenvalue clamped to 0.
    f = torch.tensor([[1.0, 0.0], [0.0, -1.0]], dtype=DT)
    with caplog.at_level("WARNING"):
        inv = cholesky_inverse(f, 1e-2)
    assert inv.kind == "dense"
    torch.testing.assert_close(inv.dense(), torch.diag(torch.tensor([1 / 1.01, 1 / 1e-2], dtype=DT)))
    torch.testing.assert_close(inv.dense(), eigen_inverse(f, 1e-2).dense())


# --- KL clipping ----------------------------------------------------------------------------------------


def test_kl_clip_scale_hand() -> None:
    pairs = [
        (torch.tensor([[1.0, 2.0]], dtype=DT), torch.tensor([[3.0, 4.0]], dtype=DT)),  # v.g = 11
        (torch.tensor([[0.5]], dtype=DT), torch.tensor([[2.0]], dtype=DT)),  # v.g = 1
    ]
    # lr^2 * sum v.g = 0.01 * 12 = 0.12; sqrt(0.003 / 0.12) = sqrt(0.025)
    assert float(kl_clip_scale(pairs, 0.1, 0.003)) == pytest.approx(0.15811388300841897, rel=1e-12)
    assert float(kl_clip_scale(pairs, 0.1, 1.0)) == 1.0  # sqrt(8.33) > 1 is capped
    assert kl_clip_scale(pairs, 0.1, 0.0) == 1.0
    assert kl_clip_scale([], 0.1, 0.003) == 1.0
    neg = [(torch.tensor([1.0], dtype=DT), torch.tensor([-1.0], dtype=DT))]
    assert float(kl_clip_scale(neg, 0.1, 0.003)) == 1.0
    inf = [(torch.tensor([1e308], dtype=DT), torch.tensor([1e308], dtype=DT))]
    assert float(kl_clip_scale(inf, 0.1, 0.003)) == 1.0  # overflowed: not clipped here (the step is skipped)
    for kl in (1e-6, 1e-3, 0.1, 10.0, 1e6):
        for lr in (1e-3, 0.1, 10.0):
            assert 0 < float(kl_clip_scale(pairs, lr, kl)) <= 1.0


def test_kl_clip_scale_of_float32_updates_too_large_for_float32() -> None:
    # v . g = 1e40 overflows float32; the bound must still scale the step down, not leave it alone.
    v = torch.full((2,), 1e20, dtype=torch.float32)
    g = torch.full((2,), 1e20, dtype=torch.float32)
    assert float((v * g).sum()) == float("inf")
    assert kl_clip_scale([(v, g)], 0.1, 1e-3) == pytest.approx(math.sqrt(1e-3 / (2e40 * 0.01)), rel=1e-6)


@pytest.mark.parametrize("name", KINDS)
def test_kfac_precondition_applies_clip(name: str) -> None:
    invert = INVERSES.get(name)
    shapes = [(3, 4), (2, 5)]
    grads = [torch.randn(s, generator=torch.Generator().manual_seed(20 + i), dtype=DT) for i, s in enumerate(shapes)]
    inverses = [(invert(spd(a, 30 + i), 0.01), invert(spd(g, 40 + i), 0.01)) for i, (g, a) in enumerate(shapes)]
    raw = [precondition(g, a, gi) for g, (a, gi) in zip(grads, inverses, strict=True)]
    lr, kl = 0.5, 1e-4
    vg = sum(float((v * g).sum()) for v, g in zip(raw, grads, strict=True))
    scale = min(1.0, math.sqrt(kl / (lr * lr * vg)))
    assert scale < 0.5  # clipping is active
    got = KFACPrecondition(kl)(grads, inverses, lr)
    for u, v in zip(got, raw, strict=True):
        rel_close(u, v * scale, 1e-12)
    unclipped = KFACPrecondition(0.0)(grads, inverses, lr)
    for u, v in zip(unclipped, raw, strict=True):
        assert torch.equal(u, v)


# --- the orchestrator, one process -----------------------------------------------------------------------


def make_model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 3)).to(DT)


def batch(seed: int, n: int = 8) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(100 + seed)
    return torch.randn(n, 5, generator=g, dtype=DT), torch.randint(0, 3, (n,), generator=g)


class Spy:
    """Captures every Linear's input and output gradient (registered after the preconditioner)."""

    def __init__(self, model: nn.Sequential) -> None:
        self.data: dict[int, dict[str, Tensor]] = {}
        for i, m in enumerate(model):
            if isinstance(m, nn.Linear):
                m.register_forward_hook(self._hook(i))

    def _hook(self, i: int) -> Any:
        def fhook(mod: nn.Module, inputs: tuple[Tensor, ...], out: Tensor) -> None:
            rec = self.data.setdefault(i, {})
            rec["x"] = inputs[0].detach().clone()

            def ghook(g: Tensor) -> None:
                rec["go"] = g.detach().clone()

            out.register_hook(ghook)

        return fhook


def hand_factors(x: Tensor, go: Tensor) -> tuple[Tensor, Tensor]:
    """Docstring conventions for a Linear with bias, by explicit sums over examples."""
    n = x.shape[0]
    a_rows = torch.cat([x, torch.ones(n, 1, dtype=DT)], dim=1)
    a = sum(torch.outer(a_rows[i], a_rows[i]) for i in range(n)) / n
    g = sum(torch.outer(n * go[i], n * go[i]) for i in range(n)) / n
    assert isinstance(a, Tensor) and isinstance(g, Tensor)
    return a, g


def one_step(
    model: nn.Sequential, pre: Preconditioner, spy: Spy, seed: int, lr: float = 0.1
) -> tuple[dict[int, Tensor], dict[int, tuple[Tensor, Tensor]]]:
    """Forward, backward, pre.step; return raw grad matrices and hand factors per Linear index."""
    x, y = batch(seed)
    spy.data.clear()
    model.zero_grad()
    out = model(x)
    pre.end_forward()
    F.cross_entropy(out, y).backward()
    raw = {}
    for i in spy.data:
        m = cast(nn.Linear, model[i])
        raw[i] = torch.cat([cast(Tensor, m.weight.grad), cast(Tensor, m.bias.grad)[:, None]], dim=1).clone()
    pre.step(lr=lr)
    facs = {i: hand_factors(rec["x"], rec["go"]) for i, rec in spy.data.items()}
    return raw, facs


def damped_inv(f: Tensor, damping: float) -> Tensor:
    return torch.linalg.inv(f + damping * torch.eye(f.shape[0], dtype=DT))


def new_pre(backend: TorchBackend, **kw: Any) -> tuple[nn.Sequential, Preconditioner, Spy]:
    cfg = KFACConfig(**kw)
    model = make_model()
    pre = build.preconditioner(model, cfg, backend)
    return model, pre, Spy(model)


@pytest.mark.parametrize("inverse", KINDS)
def test_step_preconditions_by_hand(backend: TorchBackend, inverse: str) -> None:
    damping = 0.01
    model, pre, spy = new_pre(backend, factor_decay=0.0, kl_clip=0.0, damping=damping, inverse=inverse)
    assert [lay.name for lay in pre.layers] == ["0", "2"]
    raw, facs = one_step(model, pre, spy, seed=0)
    assert sorted(raw) == [0, 2]
    for i, (a, g) in facs.items():
        name = str(i)
        torch.testing.assert_close(pre.factors[f"{name}/A"], a, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(pre.factors[f"{name}/G"], g, rtol=1e-12, atol=1e-14)
        want = damped_inv(g, damping) @ raw[i] @ damped_inv(a, damping)
        got = torch.cat([cast(Tensor, model[i].weight.grad), cast(Tensor, model[i].bias.grad)[:, None]], dim=1)
        rel_close(got, want, 1e-9)
        assert not torch.allclose(got, raw[i])


def test_step_with_kl_clip(backend: TorchBackend) -> None:
    damping, kl, lr = 0.01, 1e-5, 0.1
    model, pre, spy = new_pre(backend, factor_decay=0.0, kl_clip=kl, damping=damping)
    raw, facs = one_step(model, pre, spy, seed=0, lr=lr)
    nat = {i: damped_inv(g, damping) @ raw[i] @ damped_inv(a, damping) for i, (a, g) in facs.items()}
    vg = sum(float((nat[i] * raw[i]).sum()) for i in nat)
    scale = min(1.0, math.sqrt(kl / (lr * lr * vg)))
    assert scale < 1.0
    for i in nat:
        got = torch.cat([cast(Tensor, model[i].weight.grad), cast(Tensor, model[i].bias.grad)[:, None]], dim=1)
        rel_close(got, nat[i] * scale, 1e-9)


def test_running_average(backend: TorchBackend) -> None:
    damping = 0.01
    model, pre, spy = new_pre(backend, factor_decay=0.5, kl_clip=0.0, damping=damping)
    _, f1 = one_step(model, pre, spy, seed=0)
    for i, (a, g) in f1.items():
        torch.testing.assert_close(pre.factors[f"{i}/A"], a, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(pre.factors[f"{i}/G"], g, rtol=1e-12, atol=1e-14)
    raw, f2 = one_step(model, pre, spy, seed=1)
    for i in f2:
        a = 0.5 * f1[i][0] + 0.5 * f2[i][0]
        g = 0.5 * f1[i][1] + 0.5 * f2[i][1]
        assert not torch.allclose(f1[i][0], f2[i][0])
        torch.testing.assert_close(pre.factors[f"{i}/A"], a, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(pre.factors[f"{i}/G"], g, rtol=1e-12, atol=1e-14)
        got = torch.cat([cast(Tensor, model[i].weight.grad), cast(Tensor, model[i].bias.grad)[:, None]], dim=1)
        rel_close(got, damped_inv(g, damping) @ raw[i] @ damped_inv(a, damping), 1e-9)


def test_factor_update_freq(backend: TorchBackend) -> None:
    damping = 0.01
    model, pre, spy = new_pre(
        backend, factor_decay=0.5, kl_clip=0.0, damping=damping, factor_update_freq=2, inv_update_freq=2
    )
    _, f0 = one_step(model, pre, spy, seed=0)
    after0 = {k: v.clone() for k, v in pre.factors.items()}
    raw1, _ = one_step(model, pre, spy, seed=1)  # step 1: no factor update, old inverses
    for k, v in pre.factors.items():
        assert torch.equal(v, after0[k]), k
    for i, (a, g) in f0.items():
        got = torch.cat([cast(Tensor, model[i].weight.grad), cast(Tensor, model[i].bias.grad)[:, None]], dim=1)
        rel_close(got, damped_inv(g, damping) @ raw1[i] @ damped_inv(a, damping), 1e-9)
    _, f2 = one_step(model, pre, spy, seed=2)  # step 2 updates again
    for i in f2:
        want = 0.5 * f0[i][0] + 0.5 * f2[i][0]
        torch.testing.assert_close(pre.factors[f"{i}/A"], want, rtol=1e-12, atol=1e-14)
    assert pre.steps == 3


@pytest.mark.parametrize("inverse", KINDS)
def test_state_dict_roundtrip(backend: TorchBackend, inverse: str) -> None:
    model, pre, spy = new_pre(backend, factor_decay=0.7, kl_clip=0.0, inverse=inverse)
    one_step(model, pre, spy, seed=0)
    one_step(model, pre, spy, seed=1)
    buf = io.BytesIO()
    torch.save(pre.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf)

    cfg = KFACConfig(factor_decay=0.7, kl_clip=0.0, inverse=inverse)
    model2 = make_model()
    pre2 = build.preconditioner(model2, cfg, backend)
    pre2.load_state_dict(state)
    assert pre2.steps == pre.steps == 2
    assert set(pre2.factors) == set(pre.factors) == {"0/A", "0/G", "2/A", "2/G"}
    for k in pre.factors:
        assert torch.equal(pre2.factors[k], pre.factors[k]), k
        assert torch.equal(pack(pre2.factors[k]), pack(pre.factors[k]))
    assert set(pre2.inverses) == set(pre.inverses)
    for k, inv in pre.inverses.items():
        inv2 = pre2.inverses[k]
        assert inv2.kind == inv.kind
        assert len(inv2.tensors) == len(inv.tensors)
        for t2, t in zip(inv2.tensors, inv.tensors, strict=True):
            assert torch.equal(t2, t), k

    # the restored preconditioner then behaves like the original on the same step
    model2.load_state_dict(model.state_dict())
    spy2 = Spy(model2)
    one_step(model, pre, spy, seed=2)
    one_step(model2, pre2, spy2, seed=2)
    for k in pre.factors:
        torch.testing.assert_close(pre2.factors[k], pre.factors[k], rtol=0, atol=0)
    for p, p2 in zip(model.parameters(), model2.parameters(), strict=True):
        assert p.grad is not None and p2.grad is not None
        torch.testing.assert_close(p2.grad, p.grad, rtol=0, atol=0)


# --- the Cholesky factor as the inverse (applied by triangular solves) -----------------------------------


def test_cholesky_factor_applies_the_damped_inverse_by_hand() -> None:
    from kfacflow.kfac.stages.inverse import CholeskyFactorInverse, cholesky_factor

    d, damping = 5, 0.01
    f = spd(d, 7)
    inv = cholesky_factor(f, damping)
    assert isinstance(inv, CholeskyFactorInverse) and inv.kind == "cholesky_factor"
    (chol,) = inv.tensors
    assert torch.equal(chol, chol.tril()) and chol.is_contiguous()
    want = torch.linalg.inv(f + damping * torch.eye(d, dtype=DT))
    x = torch.randn(d, 3, generator=torch.Generator().manual_seed(8), dtype=DT)
    rel_close(inv.left(x), want @ x)
    rel_close(inv.right(x.T), x.T @ want)
    rel_close(inv.dense(), want)
    # It travels as its packed triangle (or whole) and comes back bit for bit.
    flat = inv.to_flat()
    assert flat.shape == (Inverse.flat_size("cholesky_factor", d),) == (15,)
    assert inv.round_trip_exact() and torch.equal(Inverse.from_flat(inv.kind, flat, d).tensors[0], chol)
    assert torch.equal(type(inv).from_full(inv.to_full(), d).tensors[0], chol)


def test_cholesky_factor_kronecker_identity() -> None:
    a_dim, g_dim, damping = 4, 3, 1e-3
    a, g = spd(a_dim, 1), spd(g_dim, 2)
    grad = torch.randn(g_dim, a_dim, generator=torch.Generator().manual_seed(3), dtype=DT)
    invert = INVERSES.get("cholesky_factor")
    got = precondition(grad, invert(a, damping), invert(g, damping))
    big = torch.kron(a + damping * torch.eye(a_dim, dtype=DT), g + damping * torch.eye(g_dim, dtype=DT))
    rel_close(big @ got.T.reshape(-1), grad.T.reshape(-1))


def test_cholesky_factor_applied_explicitly_where_its_period_repays_it() -> None:
    from kfacflow.kfac.stages.inverse import EXPLICIT_FROM_USES, EXPLICIT_UP_TO, cholesky_factor

    d, damping = 6, 0.01
    f = spd(d, 11)
    want = torch.linalg.inv(f + damping * torch.eye(d, dtype=DT))
    x = torch.randn(d, 4, generator=torch.Generator().manual_seed(12), dtype=DT)
    inv = cholesky_factor(f, damping)
    assert inv.for_uses(EXPLICIT_FROM_USES - 1) is inv and inv.explicit is None  # type: ignore[attr-defined]
    solved = (inv.left(x), inv.right(x.T))
    assert inv.for_uses(EXPLICIT_FROM_USES) is inv
    explicit = inv.explicit  # type: ignore[attr-defined]
    assert explicit is not None and torch.equal(explicit, explicit.T)
    rel_close(explicit, want)
    rel_close(inv.left(x), want @ x)
    rel_close(inv.right(x.T), x.T @ want)
    torch.testing.assert_close(inv.left(x), solved[0], rtol=1e-12, atol=0)  # the same inverse, other round-off
    assert torch.equal(inv.left(x), explicit @ x) and torch.equal(inv.right(x.T), x.T @ explicit)
    assert torch.equal(inv.dense(), explicit)
    assert torch.equal(inv.tensors[0], inv.tensors[0].tril())  # what travels and is kept is still L
    wide = cholesky_factor(spd(EXPLICIT_UP_TO + 1, 13, shift=1.0), damping)
    assert wide.for_uses(10**6).explicit is None  # type: ignore[attr-defined]


@pytest.mark.parametrize("every", [1, 20])
def test_preconditioner_applies_cholesky_factors_explicitly_only_over_long_periods(
    backend: TorchBackend, every: int
) -> None:
    """Made, and restored from a checkpoint, each inverse is applied alike: a resumed run steps as one that went on."""
    kw: dict[str, Any] = dict(factor_decay=0.7, kl_clip=0.0, inverse="cholesky_factor", inv_update_freq=every)
    model, pre, spy = new_pre(backend, **kw)
    one_step(model, pre, spy, seed=0)
    explicit = {k: getattr(inv, "explicit", None) is not None for k, inv in pre.inverses.items()}
    assert explicit == dict.fromkeys(pre.inverses, every >= 10)
    buf = io.BytesIO()
    torch.save(pre.state_dict(), buf)
    buf.seek(0)
    model2 = make_model()
    pre2 = build.preconditioner(model2, KFACConfig(**kw), backend)
    pre2.load_state_dict(torch.load(buf))
    assert {k: getattr(inv, "explicit", None) is not None for k, inv in pre2.inverses.items()} == explicit
    model2.load_state_dict(model.state_dict())
    spy2 = Spy(model2)
    one_step(model, pre, spy, seed=1)
    one_step(model2, pre2, spy2, seed=1)
    for p, p2 in zip(model.parameters(), model2.parameters(), strict=True):
        assert p.grad is not None and p2.grad is not None
        torch.testing.assert_close(p2.grad, p.grad, rtol=0, atol=0)
