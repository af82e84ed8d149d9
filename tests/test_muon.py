"""``optim.name=muon``: torch.optim.Muon's step on matrices (filters flattened), torch.optim.AdamW's on the rest."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from helpers import run_in_gloo
from torch import nn

from kfacflow.configuration.schema import MuonConfig, OptimConfig, ScheduleConfig
from kfacflow.optim import muon
from kfacflow.optim.optimizers import build_optimizer, build_scheduler

STEPS = 4


def _train(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    for step in range(STEPS):
        opt.zero_grad()
        F.cross_entropy(model(x * (step + 1)), y).backward()
        opt.step()


def _groups(model: nn.Module, head: bool = False, **kw: object) -> list[dict[str, object]]:
    matrices, rest = muon.split(model, head)
    settings = dict(lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.01, adjust_lr="original", ns_steps=5)
    settings["ns_dtype"] = "bfloat16"  # torch.optim.Muon's, on any device
    settings.update(kw)  # type: ignore[arg-type]
    return muon.groups(matrices, rest, **settings, adamw_lr=3e-3, betas=(0.9, 0.999), eps=1e-8, adamw_weight_decay=0.01)  # type: ignore[arg-type]


def _distinct_shapes() -> tuple[nn.Module, list[tuple[int, int]]]:
    # the head (3 x 4) and the biases go to AdamW
    return nn.Sequential(nn.Linear(6, 9), nn.Tanh(), nn.Linear(9, 4), nn.Tanh(), nn.Linear(4, 3)), [(9, 6), (4, 9)]


def _repeated_shapes() -> tuple[nn.Module, list[tuple[int, int]]]:
    # matrices of one shape, orthogonalised together where the step batches (a GPU)
    layers = [nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Linear(8, 3)]
    return nn.Sequential(*layers), [(8, 6), (8, 8), (8, 8)]


@pytest.mark.parametrize("adjust_lr", ["original", "match_rms_adamw"])
@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("built", [_distinct_shapes, _repeated_shapes])
def test_matrices_step_as_torch_muon_and_the_rest_as_torch_adamw(
    adjust_lr: str, nesterov: bool, built: Callable[[], tuple[nn.Module, list[tuple[int, int]]]]
) -> None:
    torch.manual_seed(0)
    model, shapes = built()
    twin = copy.deepcopy(model)
    x, y = torch.randn(16, 6), torch.randint(0, 3, (16,))
    _train(model, muon.Muon(_groups(model, adjust_lr=adjust_lr, nesterov=nesterov)), x, y)
    matrices, rest = muon.split(twin, head=False)
    assert [p.shape for p in matrices] == shapes
    reference = [
        torch.optim.Muon(
            matrices, lr=0.02, weight_decay=0.01, momentum=0.95, nesterov=nesterov, adjust_lr_fn=adjust_lr
        ),
        torch.optim.AdamW(rest, lr=3e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01),
    ]
    for step in range(STEPS):
        for opt in reference:
            opt.zero_grad()
        F.cross_entropy(twin(x * (step + 1)), y).backward()
        for opt in reference:
            opt.step()
    for (name, a), b in zip(model.named_parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=f"{name} differs")


def test_filters_are_flattened_to_out_by_in_k_k() -> None:
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 5, 3, bias=False)
    flat = nn.Linear(27, 5, bias=False)
    with torch.no_grad():
        flat.weight.copy_(conv.weight.reshape(5, 27))
    x = torch.randn(4, 3, 3, 3)
    ours = muon.Muon(_groups(nn.Sequential(conv), head=True))
    theirs = torch.optim.Muon([flat.weight], lr=0.02, weight_decay=0.01, momentum=0.95)
    for _ in range(STEPS):
        ours.zero_grad()
        theirs.zero_grad()
        conv(x).square().sum().backward()
        flat(x.reshape(4, 27)).square().sum().backward()
        ours.step()
        theirs.step()
    torch.testing.assert_close(conv.weight.reshape(5, 27), flat.weight, rtol=1e-6, atol=1e-7)


class Mixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.conv = nn.Conv2d(1, 4, 3)
        self.norm = nn.LayerNorm(4)
        self.fc = nn.Linear(4, 4)
        self.head = nn.Linear(4, 3)


def test_matrices_and_filters_are_muons_and_biases_norms_embeddings_and_the_head_adamws() -> None:
    model = Mixed()
    matrices, rest = muon.split(model, head=False)
    assert {id(p) for p in matrices} == {id(model.conv.weight), id(model.fc.weight)}
    assert len(rest) == len(list(model.parameters())) - 2
    matrices, _ = muon.split(model, head=True)
    assert {id(p) for p in matrices} == {id(model.conv.weight), id(model.fc.weight), id(model.head.weight)}


def test_the_schedule_scales_both_rates_and_a_checkpoint_resumes_exactly() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 9), nn.Tanh(), nn.Linear(9, 3))
    cfg = OptimConfig(name="muon", lr=0.02)
    opt = build_optimizer(model, cfg)
    sched = build_scheduler(opt, ScheduleConfig(name="cosine"), 10, 10)
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    _train(model, opt, x, y)
    for _ in range(5):
        sched.step()
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.01, 0.0015])  # half way down the cosine
    saved = copy.deepcopy((model.state_dict(), opt.state_dict()))
    _train(model, opt, x, y)
    again = nn.Sequential(nn.Linear(6, 9), nn.Tanh(), nn.Linear(9, 3))
    again.load_state_dict(saved[0])
    resumed = build_optimizer(again, cfg)
    resumed.load_state_dict(saved[1])
    _train(again, resumed, x, y)
    for a, b in zip(model.parameters(), again.parameters(), strict=True):
        assert torch.equal(a, b)


def _muon_over_kfac(rank: int, world: int) -> dict[str, list[torch.Tensor]]:
    """Two steps of K-FAC (``d``) then Muon, in the user's loop on a real gloo group; what Muon was given."""
    import kfacflow

    torch.manual_seed(0)
    model = nn.Linear(6, 4)
    muon_cfg = MuonConfig(head=True, ns_dtype="bfloat16")  # torch.optim.Muon's
    opt = build_optimizer(model, OptimConfig(name="muon", lr=0.02, weight_decay=0.0, muon=muon_cfg))
    pre = kfacflow.KFACPreconditioner(model, "d", damping=0.01, kl_clip=0.0)
    seen: dict[str, list[torch.Tensor]] = {"raw": [], "preconditioned": [], "weights": []}
    generator = torch.Generator().manual_seed(1 + rank)
    for _ in range(2):
        x, y = torch.randn(16, 6, generator=generator), torch.randint(0, 4, (16,), generator=generator)
        F.cross_entropy(model(x), y).backward()
        pre.average_gradients()
        seen["raw"].append(model.weight.grad.clone())  # type: ignore[union-attr]
        pre.step()
        seen["preconditioned"].append(model.weight.grad.clone())  # type: ignore[union-attr]
        seen["weights"].append(model.weight.detach().clone())
        opt.step()
        opt.zero_grad()
    seen["weights"].append(model.weight.detach().clone())
    pre.remove()
    return seen


@pytest.mark.slow
def test_with_kfac_muon_orthogonalises_the_preconditioned_gradient() -> None:
    """``optim.name=muon`` with a K-FAC variant: K-FAC's update is what Muon's momentum and orthogonalisation take."""
    ranks = run_in_gloo(_muon_over_kfac, 2)
    for a, b in zip(ranks[0]["weights"], ranks[1]["weights"], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # every rank holds the same model
    seen = ranks[0]
    weight = nn.Parameter(seen["weights"][0].clone())
    reference = torch.optim.Muon([weight], lr=0.02, weight_decay=0.0, momentum=0.95, nesterov=True)
    for grad, after in zip(seen["preconditioned"], seen["weights"][1:], strict=True):
        weight.grad = grad.clone()
        reference.step()
        torch.testing.assert_close(weight.detach(), after, rtol=1e-5, atol=1e-6)
    # and K-FAC changed what Muon saw: its orthogonalisation of the raw gradient is another direction
    raw, pre = (muon.orthogonalised(seen[k][0]).float() for k in ("raw", "preconditioned"))
    assert float((raw - pre).norm()) > 0.1 * float(raw.norm())


def test_newton_schulz_runs_in_float32_on_a_cpu_unless_asked_for_bfloat16() -> None:
    cpu = torch.zeros(2, 2)
    assert muon.ns_dtype("auto", cpu) == torch.float32 and muon.ns_dtype("bfloat16", cpu) == torch.bfloat16
    g = torch.randn(8, 20, generator=torch.Generator().manual_seed(0))
    fine, coarse = muon.orthogonalised(g, dtype=torch.float32), muon.orthogonalised(g).float()
    assert fine.dtype == torch.float32
    torch.testing.assert_close(fine, coarse, rtol=0, atol=0.03)  # the same map, to bfloat16's rounding
    singular = torch.linalg.svdvals(fine)
    assert float(singular.min()) > 0.5 and float(singular.max()) < 1.3  # pushed towards 1, as Muon's


def test_matrices_of_one_shape_are_orthogonalised_together_as_each_alone() -> None:
    gen = torch.Generator().manual_seed(0)
    shapes = [(8, 20), (20, 8), (8, 20), (5, 2, 3, 3), (5, 18), (7, 7)]  # a tall one joins its wide twins
    updates = [torch.randn(*s, generator=gen) for s in shapes]
    together = muon.orthogonalised_together(updates, dtype=torch.float32)
    assert [t.shape for t in together] == [u.shape for u in updates]
    for u, t in zip(updates, together, strict=True):
        torch.testing.assert_close(t, muon.orthogonalised(u, dtype=torch.float32), rtol=1e-5, atol=1e-6)
    assert torch.equal(together[-1], muon.orthogonalised(updates[-1], dtype=torch.float32))  # alone: the same path
