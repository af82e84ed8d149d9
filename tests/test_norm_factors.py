"""A norm's scale and shift by a diagonal Fisher (``kfac.kinds`` with ``norm``): by hand in float64, on 2 gloo ranks."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers import (
    QUICK,
    agree_with_one_process,
    double_batch_trails,
    kfac_step,
    resumed_as_uninterrupted,
)
from test_stage_equivalence import PROFILE
from torch import Tensor, nn

from kfacflow import UserError
from kfacflow.comm.torch_dist import TorchBackend
from kfacflow.configuration.recipe import load
from kfacflow.configuration.rules import kfac_section
from kfacflow.configuration.schema import DistConfig, KFACConfig
from kfacflow.kfac.layers import find_layers
from kfacflow.kfac.left_out import kinds_left
from kfacflow.kfac.preconditioner import Preconditioner
from kfacflow.kfac.sides.norms import find_norms
from kfacflow.kfac.stages.precondition import clip_scale, v_dot_g
from kfacflow.running import build

DT = torch.float64
N, S, E, C = 4, 3, 6, 3
KINDS = ["linear", "norm"]


class Normed(nn.Module):
    """A Linear, a norm over its output tokens, a head on the mean token (``seq_first``: ``(S, N, E)`` inside)."""

    def __init__(self, norm: str = "layer", seq_first: bool = False, tokens: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.seq_first, self.tokens = seq_first, tokens
        self.fc = nn.Linear(E, E)
        self.norm: nn.Module = nn.LayerNorm(E) if norm == "layer" else nn.RMSNorm(E)
        self.head = nn.Linear(E, C)
        with torch.no_grad():  # away from their start (ones, zeros), so that xhat * gamma + beta is all at work
            for p in self.norm.parameters():
                p.add_(0.3 * torch.randn(p.shape))

    def forward(self, x: Tensor) -> Tensor:  # x: (N, S, E), or (N, E) where not tokens
        h = x.transpose(0, 1) if self.seq_first else x
        h = self.norm(torch.tanh(self.fc(h)))
        if self.tokens:
            h = h.mean(dim=0 if self.seq_first else 1)
        return self.head(h)


def data(seed: int, n: int = N, tokens: bool = True) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shape = (n, S, E) if tokens else (n, E)
    return torch.randn(*shape, generator=gen, dtype=DT), torch.randint(0, C, (n,), generator=gen)


def norm_grad(model: Normed) -> Tensor:
    return torch.cat([p.grad.flatten() for p in model.norm.parameters() if p.grad is not None])


def per_example_squares(model: Normed, x: Tensor, y: Tensor) -> Tensor:
    """``(N g[n])^2`` of each example by its own backward pass: ``N g[n]`` is the gradient of its own loss."""
    rows = []
    for n in range(x.shape[0]):
        model.zero_grad()
        F.cross_entropy(model(x[n : n + 1]), y[n : n + 1]).backward()
        rows.append(norm_grad(model) ** 2)
    model.zero_grad()
    return torch.stack(rows)


@pytest.mark.parametrize(
    ("norm", "seq_first", "tokens", "keep"),
    [
        ("layer", False, True, 0),
        ("layer", True, True, 0),
        ("rms", False, True, 0),
        ("rms", False, False, 0),
        ("layer", False, False, 0),
        ("layer", True, True, 2),
    ],
)
def test_the_diagonal_is_the_mean_of_squared_per_example_gradients(
    backend: TorchBackend, norm: str, seq_first: bool, tokens: bool, keep: int
) -> None:
    model = Normed(norm, seq_first, tokens).to(DT)
    x, y = data(1, tokens=tokens)
    want = per_example_squares(model, x, y)[: keep or N].mean(dim=0)  # kfac.factor_examples: the first ones
    cfg = KFACConfig(kinds=KINDS, factor_decay=0.0, factor_examples=keep)
    pre = build.preconditioner(model, cfg, backend)
    kfac_step(model, pre, x, y)
    torch.testing.assert_close(pre.norms.running["norm"], want, rtol=1e-12, atol=1e-15)
    assert want.numel() == (2 * E if norm == "layer" else E)


def test_every_example_of_every_micro_batch_counts(backend: TorchBackend) -> None:
    model = Normed().to(DT)
    (x1, y1), (x2, y2) = data(1), data(2)
    want = torch.cat([per_example_squares(model, x1, y1), per_example_squares(model, x2, y2)]).mean(dim=0)
    pre = build.preconditioner(model, KFACConfig(kinds=KINDS, factor_decay=0.0), backend, accumulate=2)
    for x, y in ((x1, y1), (x2, y2)):  # each loss divided by the micro-batches
        out = model(x)
        pre.end_forward()
        (F.cross_entropy(out, y) / 2).backward()
    pre.step(lr=0.1)
    torch.testing.assert_close(pre.norms.running["norm"], want, rtol=1e-12, atol=1e-15)


def test_the_running_average_decays_as_the_factors_do(backend: TorchBackend) -> None:
    model, twin = Normed().to(DT), Normed().to(DT)  # the twin, unhooked, gives the per-example gradients
    pre = build.preconditioner(model, KFACConfig(kinds=KINDS, factor_decay=0.75, kl_clip=0.0), backend)
    want = None
    for seed in (1, 2, 3):
        x, y = data(seed)
        d = per_example_squares(twin, x, y).mean(dim=0)
        want = d if want is None else 0.75 * want + 0.25 * d
        kfac_step(model, pre, x, y, lr=0.0)  # lr 0 leaves the weights: every step's D is of the same model
    torch.testing.assert_close(pre.norms.running["norm"], want, rtol=1e-12, atol=1e-15)


def raw_and_updates(kl_clip: float, damping: float = 0.01, lr: float = 0.1) -> tuple[list[Tensor], list[Tensor], Any]:
    """One step's raw gradients and preconditioned ones, by parameter; the preconditioner."""
    backend = TorchBackend(DistConfig(device="cpu"))
    model = Normed().to(DT)
    pre = build.preconditioner(model, KFACConfig(kinds=KINDS, kl_clip=kl_clip, damping=damping), backend)
    x, y = data(1)
    out = model(x)
    pre.end_forward()
    F.cross_entropy(out, y).backward()
    raw = [grad_of(p) for p in model.parameters()]
    pre.step(lr=lr)
    return raw, [grad_of(p) for p in model.parameters()], pre


def grad_of(p: Tensor) -> Tensor:
    assert p.grad is not None
    return p.grad.clone()


def test_a_step_is_grad_over_d_plus_damping_and_kl_clipping_counts_the_norm(backend: TorchBackend) -> None:
    raw, free, pre = raw_and_updates(kl_clip=0.0)
    names = [name for name, _ in Normed().named_parameters()]
    d = pre.norms.running["norm"]
    by_name = dict(zip(names, zip(raw, free, strict=True), strict=True))
    (gw, vw), (gb, vb) = by_name["norm.weight"], by_name["norm.bias"]
    torch.testing.assert_close(vw, gw / (d[:E] + 0.01), rtol=1e-13, atol=0)
    torch.testing.assert_close(vb, gb / (d[E:] + 0.01), rtol=1e-13, atol=0)
    # KL clipping: one scale over every layer's v.g, the norm's among them
    lr, kl = 0.1, 1e-4
    raw2, clipped, pre2 = raw_and_updates(kl_clip=kl, lr=lr)
    dots = [v_dot_g(v, g) for v, g in zip(free, raw2, strict=True)]
    scale = clip_scale(dots, lr, kl)
    without_norm = clip_scale([dot for name, dot in zip(names, dots, strict=True) if "norm" not in name], lr, kl)
    assert float(scale) < 1 and abs(float(scale) - float(without_norm)) > 1e-3 * float(scale)
    torch.testing.assert_close(pre2.stages.precondition.scale, scale, rtol=1e-12, atol=0)
    for v, c in zip(free, clipped, strict=True):
        torch.testing.assert_close(c, v * scale, rtol=1e-12, atol=1e-15)


def test_normalize_rms_scales_the_norms_update_too(backend: TorchBackend) -> None:
    model = Normed().to(DT)
    cfg = KFACConfig(kinds=KINDS, normalize="rms", kl_clip=0.0)
    pre = build.preconditioner(model, cfg, backend)
    kfac_step(model, pre, *data(1))
    update = norm_grad(model)
    assert update.square().mean().item() == pytest.approx(1.0, rel=1e-6)  # its RMS is taken in float32


# --- which norms, and what the log says --------------------------------------------------------------------


class OwnNorm(nn.LayerNorm):
    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x) * 2


def test_which_norms_are_taken_and_what_the_log_names(backend: TorchBackend, caplog: pytest.LogCaptureFixture) -> None:
    frozen = nn.LayerNorm(E)
    frozen.requires_grad_(False)
    model = nn.Sequential(nn.Linear(E, E), nn.LayerNorm(E, elementwise_affine=False), frozen, OwnNorm(E), nn.RMSNorm(E))
    with caplog.at_level(logging.INFO, logger="kfacflow.kfac"):
        assert [norm.name for norm in find_norms(model, [], tuple(KINDS))] == ["4"]
    assert caplog.text.count("K-FAC skips") == 1 and "K-FAC skips 3 (" in caplog.text  # its own forward
    assert find_norms(model, ["4"], tuple(KINDS)) == [] and find_norms(model, [], ("linear",)) == []
    assert [layer.name for layer in find_layers(model, ["4"], tuple(KINDS), ["4"])] == ["0"]  # it may name a norm
    assert kinds_left(model, ("linear",)) == ("norm",) and kinds_left(model, tuple(KINDS)) == ()
    assert kinds_left(nn.Sequential(nn.Linear(E, E), frozen), ("linear",)) == ()  # frozen norms are nobody's
    for kinds, left in ((["linear"], "norm.weight, norm.bias"), (KINDS, None)):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="kfacflow"):
            build.preconditioner(Normed().to(DT), KFACConfig(kinds=kinds), backend).remove()
        lines = [r.getMessage() for r in caplog.records if "to the optimizer alone" in r.getMessage()]
        hint = "; kfac.kinds may add norm"
        assert lines == ([f"K-FAC leaves 2 parameter tensors to the optimizer alone: {left}{hint}"] if left else [])


def test_a_kind_misspelt_is_one_line_suggesting_norm() -> None:
    with pytest.raises(UserError, match=r"kinds: 'nrom' is not a kind .* Did you mean 'norm'\?"):
        kfac_section({"kinds": ["linear", "nrom"]}, "KFACPreconditioner")
    with pytest.raises(UserError, match=r"^kfac.kinds: 'nrom' is not a kind .*Did you mean 'norm'\?$"):
        load([QUICK], ["kfac.kinds=[linear,nrom]"])


# --- a checkpoint --------------------------------------------------------------------------------------------


def test_a_checkpoint_mid_run_resumes_as_the_uninterrupted_run(backend: TorchBackend) -> None:
    cfg = KFACConfig(kinds=KINDS, damping=0.01, kl_clip=0.01, inv_update_freq=2, factor_decay=0.8)
    batches = [data(seed) for seed in range(5)]
    saved = resumed_as_uninterrupted(backend, lambda: Normed().to(DT), cfg, batches)
    assert set(saved["kfac"]["norms"]) == {"norm"}
    saved["kfac"]["norms"] = {"norm": torch.ones(3, dtype=DT)}
    with pytest.raises(UserError, match="diagonal of the norm 'norm' does not fit"):
        build.preconditioner(Normed().to(DT), cfg, backend).load_state_dict(saved["kfac"])


# --- D, MPD, SPD and flow on two gloo ranks ------------------------------------------------------------------


class Stack(nn.Module):
    """Linear, LayerNorm, Linear, RMSNorm, head: the norms between Linears, over tokens."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(E, 2 * E), nn.LayerNorm(2 * E), nn.Tanh(), nn.Linear(2 * E, E))
        self.norm = nn.RMSNorm(E)
        self.head = nn.Linear(E, C)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.norm(self.body(x)).mean(dim=1))


VARIANTS = ("d", "mpd", "spd", "flow")


def train_variants(rank: int, world: int, variants: tuple[str, ...]) -> dict[str, Any]:
    make = lambda: Stack().to(DT)  # noqa: E731
    return double_batch_trails(rank, world, variants, make, data, N, _norms_held, PROFILE, kinds=KINDS)


def _norms_held(pre: Preconditioner) -> None:
    assert sorted(pre.norms.running) == ["body.1", "norm"]


@pytest.mark.slow
def test_d_mpd_spd_and_flow_agree_and_equal_one_process_on_the_double_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    agree_with_one_process(monkeypatch, train_variants, VARIANTS)
