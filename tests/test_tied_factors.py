"""A weight tied between an embedding and a Linear head (kind ``tied``): by hand in float64, on 2 gloo ranks."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers import agree_with_one_process, double_batch_trails, kfac_step, resumed_as_uninterrupted
from test_stage_equivalence import PROFILE
from torch import Tensor, nn

from kfacflow import UserError
from kfacflow.comm.torch_dist import TorchBackend
from kfacflow.configuration.schema import KFACConfig
from kfacflow.kfac.left_out import kinds_left
from kfacflow.kfac.preconditioner import Preconditioner
from kfacflow.kfac.sides.tied import apply_inverse, find_tied, generalized, joint_inverse
from kfacflow.running import build

DT = torch.float64
V, D, N, T = 7, 3, 4, 3
KINDS = ["linear", "tied"]


class TiedLM(nn.Module):
    """Token embedding, a Linear, the head on the embedding's weight: logits ``(N, V, T)`` for ``cross_entropy``."""

    def __init__(self, bias: bool = False, tie: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tok = nn.Embedding(V, D)
        self.fc = nn.Linear(D, D)
        self.head = nn.Linear(D, V, bias=bias)
        if tie:
            self.head.weight = self.tok.weight
        else:
            self.head.weight = nn.Parameter(self.tok.weight.detach().clone())

    def forward(self, idx: Tensor) -> Tensor:
        return self.head(torch.tanh(self.fc(self.tok(idx)))).transpose(1, 2)


def data(seed: int, n: int = N) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (n, T), generator=gen), torch.randint(0, V, (n, T), generator=gen)


SIDES = ("A_e", "G_e", "A_h", "G_h")


def running(pre: Preconditioner) -> list[Tensor]:
    """The pair's four running factors as full matrices: A_e, G_e, A_h, G_h."""
    pair = pre.tied.tied[0]
    uses = ((pair.embedding, "A"), (pair.embedding, "G"), (pair.head, "A"), (pair.head, "G"))
    return [pre.tied.factor(layer, side) for layer, side in uses]  # type: ignore[misc]


def by_hand(model: TiedLM, x: Tensor, y: Tensor) -> list[Tensor]:
    """The four factors from their definitions (expand): A the mean of every token's row, G = N sum g g^T."""
    outs: dict[str, Tensor] = {}

    def keep(key: str) -> Any:
        def hook(module: nn.Module, args: Any, out: Tensor) -> None:
            out.retain_grad()
            outs[key] = out

        return hook

    hooks = [m.register_forward_hook(keep(key)) for key, m in (("tok", model.tok), ("head", model.head))]
    inputs: dict[str, Tensor] = {}
    hooks.append(model.head.register_forward_pre_hook(lambda mod, args: inputs.__setitem__("head", args[0].detach())))
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()
    for h in hooks:
        h.remove()
    onehot = F.one_hot(x, V).to(DT).reshape(-1, V)
    h_in = inputs["head"].reshape(-1, D)
    if model.head.bias is not None:
        h_in = torch.cat([h_in, torch.ones(h_in.shape[0], 1, dtype=DT)], dim=1)
    g_e, g_h = (N * outs[k].grad.reshape(-1, outs[k].shape[-1]) for k in ("tok", "head"))  # type: ignore[union-attr]
    model.zero_grad()
    return [onehot.T @ onehot / (N * T), g_e.T @ g_e / N, h_in.T @ h_in / (N * T), g_h.T @ g_h / N]


@pytest.mark.parametrize("bias", [False, True])
def test_the_four_factors_are_the_two_uses_factors_by_hand(backend: TorchBackend, bias: bool) -> None:
    model = TiedLM(bias).to(DT)
    x, y = data(1)
    want = by_hand(TiedLM(bias).to(DT), x, y)
    pre = build.preconditioner(model, KFACConfig(kinds=KINDS, factor_decay=0.0), backend)
    kfac_step(model, pre, x, y)
    for side, got, hand in zip(SIDES, running(pre), want, strict=True):
        torch.testing.assert_close(got, hand, rtol=1e-12, atol=1e-14, msg=side)
    assert torch.count_nonzero(want[0] - torch.diag(torch.diagonal(want[0]))) == 0  # A_e counts tokens
    assert [layer.name for layer in pre.layers] == ["fc"]
    pre.remove()


@pytest.mark.parametrize(("factor", "keep", "micro"), [("expand", 0, 1), ("reduce", 0, 1), ("expand", 2, 2)])
def test_the_factors_equal_those_of_the_same_layers_untied(
    backend: TorchBackend, factor: str, keep: int, micro: int
) -> None:
    """The conventions of the Kronecker layers' own factors (reduce, factor_examples, micro-batches) hold here."""
    tied, untied = TiedLM().to(DT), TiedLM(tie=False).to(DT)
    cfg = dict(factor=factor, factor_decay=0.0, factor_examples=keep)
    pre = build.preconditioner(tied, KFACConfig(kinds=KINDS, **cfg), backend, accumulate=micro)  # type: ignore[arg-type]
    twin = build.preconditioner(untied, KFACConfig(kinds=["linear", "embedding"], **cfg), backend, accumulate=micro)  # type: ignore[arg-type]
    for model, p in ((tied, pre), (untied, twin)):
        for seed in range(micro):
            out = model(data(seed + 1)[0])
            p.end_forward()
            (F.cross_entropy(out, data(seed + 1)[1]) / micro).backward()
        p.step(lr=0.1)
    factors = twin.factors
    for side, got, key in zip(SIDES, running(pre), ("tok/A", "tok/G", "head/A", "head/G"), strict=True):
        torch.testing.assert_close(got, factors[key], rtol=1e-12, atol=1e-14, msg=side)
    pre.remove()
    twin.remove()


def test_the_joint_inverse_is_the_inverse_of_the_sum_of_the_two_kronecker_blocks() -> None:
    gen = torch.Generator().manual_seed(3)

    def spd(d: int, rank: int) -> Tensor:
        m = torch.randn(d, rank, generator=gen, dtype=DT)
        return m @ m.T / rank

    a_e, g_e, a_h, g_h = torch.diag(torch.rand(V, generator=gen, dtype=DT)), spd(D, 2), spd(D + 1, 5), spd(V, 4)
    lam = 0.05
    x, alpha = generalized(a_e + lam * torch.eye(V, dtype=DT), g_h + lam * torch.eye(V, dtype=DT))
    torch.testing.assert_close(x.T @ (a_e + lam * torch.eye(V, dtype=DT)) @ x, torch.eye(V, dtype=DT))
    torch.testing.assert_close(x.T @ (g_h + lam * torch.eye(V, dtype=DT)) @ x, torch.diag(alpha))
    grad = torch.randn(V, D + 1, generator=gen, dtype=DT)
    padded = F.pad(g_e, (0, 1, 0, 1))  # the head's bias column: the embedding never uses it
    eye = lambda d: lam * torch.eye(d, dtype=DT)  # noqa: E731
    dense = torch.kron(a_e + eye(V), padded + eye(D + 1)) + torch.kron(g_h + eye(V), a_h + eye(D + 1))
    want = torch.linalg.solve(dense, grad.flatten()).view(V, D + 1)
    got = apply_inverse(joint_inverse(a_e, g_e, a_h, g_h, lam), grad)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("bias", [False, True])
def test_a_step_applies_the_inverse_of_the_summed_blocks_to_the_shared_gradient(
    backend: TorchBackend, bias: bool
) -> None:
    lam = 0.03
    model = TiedLM(bias).to(DT)
    x, y = data(2)
    a_e, g_e, a_h, g_h = by_hand(TiedLM(bias).to(DT), x, y)
    pre = build.preconditioner(model, KFACConfig(kinds=KINDS, factor_decay=0.0, damping=lam, kl_clip=0.0), backend)
    model.zero_grad()
    out = model(x)
    pre.end_forward()
    F.cross_entropy(out, y).backward()
    raw = pre.tied.tied[0].grad_matrix()
    assert raw is not None
    raw = raw.clone()
    pre.step(lr=0.1)
    d = D + int(bias)
    eye = lambda k: lam * torch.eye(k, dtype=DT)  # noqa: E731
    g_e = F.pad(g_e, (0, d - D, 0, d - D))
    dense = torch.kron(a_e + eye(V), g_e + eye(d)) + torch.kron(g_h + eye(V), a_h + eye(d))
    want = torch.linalg.solve(dense, raw.flatten()).view(V, d)
    got = pre.tied.tied[0].grad_matrix()
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-13)
    assert model.tok.weight.grad is model.head.weight.grad  # one Parameter, one gradient, written once
    pre.remove()


# --- which pairs, and what the log says ------------------------------------------------------------------------


def test_which_pairs_are_taken_and_what_the_log_names(backend: TorchBackend, caplog: pytest.LogCaptureFixture) -> None:
    assert [pair.name for pair in find_tied(TiedLM(), [], tuple(KINDS))] == ["tok.weight"]
    assert find_tied(TiedLM(), ["head"], tuple(KINDS)) == [] and find_tied(TiedLM(), [], ("linear",)) == []
    assert find_tied(TiedLM(tie=False), [], tuple(KINDS)) == []
    big = TiedLM()
    big.tok = nn.Embedding(9000, D)
    big.head = nn.Linear(D, 9000)
    big.head.weight = big.tok.weight
    with caplog.at_level(logging.INFO, logger="kfacflow.kfac"):
        assert find_tied(big, [], tuple(KINDS)) == []
    assert "K-FAC skips the tied tok and head: its 9000 rows" in caplog.text
    assert kinds_left(TiedLM(), ("linear",)) == ("tied",) and kinds_left(TiedLM(), tuple(KINDS)) == ()
    for kinds, left in ((["linear"], "tok.weight"), (KINDS, None)):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="kfacflow"):
            build.preconditioner(TiedLM().to(DT), KFACConfig(kinds=kinds), backend).remove()
        lines = [r.getMessage() for r in caplog.records if "to the optimizer alone" in r.getMessage()]
        want = f"K-FAC leaves 1 parameter tensor to the optimizer alone: {left}; kfac.kinds may add tied"
        assert lines == ([want] if left else [])
    assert "tied between tok and head" in caplog.text


# --- a checkpoint ------------------------------------------------------------------------------------------------


def test_a_checkpoint_mid_run_resumes_as_the_uninterrupted_run(backend: TorchBackend) -> None:
    cfg = KFACConfig(kinds=KINDS, damping=0.01, kl_clip=0.01, inv_update_freq=2, factor_decay=0.8)
    batches = [data(seed) for seed in range(5)]
    # inverses every 2 steps: the one step 2 made serves step 3 as well, across the checkpoint
    saved = resumed_as_uninterrupted(backend, lambda: TiedLM(bias=True).to(DT), cfg, batches)
    assert set(saved["kfac"]["tied"]["inverses"]) == {"tok.weight"}
    saved["kfac"]["tied"]["running"]["tok/A"] = torch.ones(3, dtype=DT)
    with pytest.raises(UserError, match="factor 'tok/A' of a tied weight does not fit"):
        build.preconditioner(TiedLM(bias=True).to(DT), cfg, backend).load_state_dict(saved["kfac"])


# --- D, MPD, SPD and flow on two gloo ranks ------------------------------------------------------------------------

VARIANTS = ("d", "mpd", "spd", "flow")


def train_variants(rank: int, world: int, variants: tuple[str, ...]) -> dict[str, Any]:
    make = lambda: TiedLM(bias=True).to(DT)  # noqa: E731
    return double_batch_trails(rank, world, variants, make, data, N, _tied, PROFILE, kinds=KINDS)


def _tied(pre: Preconditioner) -> None:
    assert sorted(pre.tied.inverses) == ["tok.weight"]


@pytest.mark.slow
def test_d_mpd_spd_and_flow_agree_and_equal_one_process_on_the_double_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    agree_with_one_process(monkeypatch, train_variants, VARIANTS)
