"""``optim.muon.owners``: each matrix's momentum and Newton-Schulz on one owner, the step still torch.optim.Muon's."""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import run_in_gloo
from torch import nn

from kfacflow.comm.torch_dist import TorchBackend
from kfacflow.configuration.schema import DistConfig, MuonConfig, OptimConfig
from kfacflow.optim import muon, owner_choice, sharding
from kfacflow.optim.optimizers import build_optimizer, for_workers
from kfacflow.running.consistency import check_replicas


def test_newton_schulz_cost_counts_each_iterations_three_products() -> None:
    # 4 x 10 (m = 4, n = 10): Gram 2*4*4*10 = 320, its square 2*64 = 128, back 320: 768 an iteration
    assert sharding.ns_flops((4, 10), steps=1) == 768
    assert sharding.ns_flops((10, 4), steps=5) == 5 * 768  # a tall matrix is orthogonalised as its transpose
    assert sharding.ns_flops((4, 2, 5), steps=1) == 768  # filters flattened to 4 x 10


def test_placed_owners_balance_the_cost_and_round_robin_follows_the_order() -> None:
    # costs (steps=1, square m x m: 6 m^3): 8 -> 3072, 6 -> 1296, 5 -> 750, 4 -> 384, 4 -> 384
    shapes = [(4, 4), (8, 8), (5, 5), (6, 6), (4, 4)]
    # largest first: 8 -> rank 0; 6 -> 1; 5 -> 1 (1296 < 3072); the first 4 -> 1 (2046); the second 4 -> 1 (2430)
    assert sharding.place(shapes, 2, "placed", steps=1) == [1, 0, 1, 1, 1]
    # three ranks: 8 -> 0; 6 -> 1; 5 -> 2; the first 4 -> 2 (750 < 1296); the second 4 -> 2 (1134 < 1296)
    assert sharding.place(shapes, 3, "placed", steps=1) == [2, 0, 2, 1, 2]
    assert sharding.place(shapes, 2, "round_robin") == [0, 1, 0, 1, 0]


class Net(nn.Module):
    """Filters, matrices of one shape and of others, biases and a head: Muon's and AdamW's groups both."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 6, 3)
        self.a, self.b, self.c = nn.Linear(24, 12), nn.Linear(12, 12), nn.Linear(12, 12)
        self.head = nn.Linear(12, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.conv(x)).flatten(1)[:, :24]
        return self.head(torch.tanh(self.c(torch.tanh(self.b(torch.tanh(self.a(h)))))))


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, 2, 4, 5, generator=gen), torch.randint(0, 3, (8,), generator=gen)


def _averaged_backward(model: nn.Module, step: int, rank: int, world: int) -> None:
    x, y = _batch(step, rank)
    F.cross_entropy(model(x), y).backward()
    for p in model.parameters():
        assert p.grad is not None
        dist.all_reduce(p.grad)
        p.grad /= world


CFG = OptimConfig(name="muon", lr=0.02, weight_decay=0.01, muon=MuonConfig(ns_dtype="bfloat16"))


def _sharded_steps(
    rank: int, world: int, how: str, steps: range, start: dict[str, Any] | None = None
) -> dict[str, Any]:
    """``steps`` of sharded Muon on a real gloo group, from ``start``; the replicated reference beside it."""
    backend = TorchBackend(DistConfig(device="cpu"))
    torch.manual_seed(0)
    model = Net()
    twin = copy.deepcopy(model)
    opt = for_workers(model, replace(CFG, muon=MuonConfig(ns_dtype="bfloat16", owners=how)), backend, 1)  # type: ignore[arg-type]
    if start is not None:
        start = copy.deepcopy(start)  # its own, as read from disk: the queue shares one tensor among the processes
        model.load_state_dict(start["model"])
        opt.load_state_dict(start["optimizer"])
    # torch.optim.Muon for the matrices, torch.optim.AdamW for the rest, and for the filters (4-D: torch's Muon
    # takes none) the replicated Muon, tested equal to torch.optim.Muon on them flattened (test_muon.py)
    matrices, rest = muon.split(twin, head=False)
    reference = [
        torch.optim.Muon(matrices[1:], lr=0.02, weight_decay=0.01, momentum=0.95),
        build_optimizer(nn.Sequential(twin.conv), replace(CFG, muon=MuonConfig(ns_dtype="bfloat16", head=True))),
        torch.optim.AdamW([p for p in rest if p is not twin.conv.bias], lr=3e-3, weight_decay=0.01),
    ]
    for step in steps:
        opt.zero_grad()
        _averaged_backward(model, step, rank, world)
        opt.step()
        if start is None:
            twin.zero_grad()
            _averaged_backward(twin, step, rank, world)
            for o in reference:
                o.step()
    assert isinstance(opt, muon.Muon) and (opt.sharding is None) == (how == "replicated")
    momenta = [p for p in muon.split(model, head=False)[0] if "momentum_buffer" in opt.state.get(p, {})]
    owned = [opt.sharding is None or opt.sharding.owns(p) for p in momenta]
    out = {
        "params": [p.detach().clone() for p in model.parameters()],
        "reference": [p.detach().clone() for p in muon.split(twin, head=False)[0]],
        "matrices": [p.detach().clone() for p in muon.split(model, head=False)[0]],
        "held": len(momenta),
        "all_owned": all(owned),
        "state": opt.state_dict(),  # collective: every owner's momenta
        "model": model.state_dict(),
        "reference_momenta": [
            (reference[1] if p is twin.conv.weight else reference[0]).state[p]["momentum_buffer"].clone()
            for p in matrices
        ]
        if start is None
        else [],
    }
    # a drifted replica takes rank 0's parameters and the states every rank holds, and nothing hangs
    if rank == 1:
        with torch.no_grad():
            model.a.weight.add_(1e-3)
    out["repaired"] = check_replicas(model, opt, backend, 99)
    out["after_repair"] = [p.detach().clone() for p in model.parameters()]
    backend.close()
    return out


@pytest.mark.slow
@pytest.mark.parametrize(("world", "how"), [(2, "placed"), (3, "placed"), (3, "round_robin")])
def test_owners_step_as_torch_muon_and_every_rank_holds_the_same_model(world: int, how: str) -> None:
    ranks = run_in_gloo(_sharded_steps, world, how, range(3))
    for got in ranks:
        for a, b in zip(got["params"], ranks[0]["params"], strict=True):
            assert torch.equal(a, b)  # the same bits on every rank: one owner computed each direction
        for a, b in zip(got["matrices"], got["reference"], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)  # torch.optim.Muon's step
        assert got["all_owned"]  # each momentum on its owner alone
    assert sum(got["held"] for got in ranks) == 4  # the filters and three matrices (the head is AdamW's)
    assert all(0 < got["held"] < 4 for got in ranks)
    full = ranks[0]["state"]["state"]
    for got in ranks[1:]:
        assert got["state"]["state"].keys() == full.keys()
    # the Muon group's matrices come first in the optimizer's numbering
    for i, expected in enumerate(ranks[0]["reference_momenta"]):
        torch.testing.assert_close(full[i]["momentum_buffer"], expected, rtol=1e-6, atol=1e-7)
    assert ranks[0]["repaired"] == 1 and ranks[1]["repaired"] == 1
    for got in ranks:
        for a, b in zip(got["after_repair"], ranks[0]["after_repair"], strict=True):
            assert torch.equal(a, b)


@pytest.mark.slow
def test_a_checkpoint_holds_every_momentum_and_resumes_on_another_world_size() -> None:
    """Two steps on two ranks, a checkpoint, two more on three: as a replicated Muon's two more from that checkpoint."""
    first = run_in_gloo(_sharded_steps, 2, "placed", range(2))
    saved = {"model": first[0]["model"], "optimizer": first[0]["state"]}
    assert len([s for s in saved["optimizer"]["state"].values() if "momentum_buffer" in s]) == 4
    # three ranks: as a replicated Muon resumed from the same checkpoint, fed the same averaged gradients
    # (bfloat16's Newton-Schulz makes round-off in the gradients a difference of 1e-4, so the same bits)
    again = run_in_gloo(_sharded_steps, 3, "placed", range(2, 4), saved)
    replicated = run_in_gloo(_sharded_steps, 3, "replicated", range(2, 4), saved)
    assert replicated[0]["held"] == 4 and max(got["held"] for got in again) < 4
    for a, b in zip(again[0]["params"], replicated[0]["params"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    resumed, expected = again[0]["state"]["state"], replicated[0]["state"]["state"]
    assert resumed.keys() == expected.keys()
    for index, held in expected.items():
        assert resumed[index].keys() == held.keys()
        for name, value in held.items():
            torch.testing.assert_close(resumed[index][name], value, rtol=1e-6, atol=1e-7)


def test_auto_takes_owners_only_where_their_share_and_gather_beat_every_matrix() -> None:
    assert owner_choice.Timed(replicated=1.0, owned=0.4, gather=0.5).choice() == "placed"
    assert owner_choice.Timed(replicated=1.0, owned=0.4, gather=0.6).choice() == "replicated"  # a tie: no gather
    assert owner_choice.Timed(replicated=0.3, owned=0.1, gather=0.5).choice() == "replicated"


@pytest.mark.parametrize(("budget", "calls"), [(float("inf"), owner_choice.REPEATS), (0.0, 1)])
def test_a_ranks_own_timing_is_repeated_within_its_budget(
    monkeypatch: pytest.MonkeyPatch, budget: float, calls: int
) -> None:
    monkeypatch.setattr(owner_choice, "LOCAL_BUDGET_S", budget)
    made: list[int] = []
    best = owner_choice._fastest_local(lambda: made.append(1), torch.device("cpu"))
    assert len(made) == calls and 0 < best < 1


def _auto(rank: int, world: int) -> tuple[owner_choice.Timed, str, bool]:
    backend = TorchBackend(DistConfig(device="cpu"))
    torch.manual_seed(rank)  # unlike weights and timings on each rank: the choice must still be one
    opt = for_workers(Net(), replace(CFG, muon=MuonConfig(owners="auto")), backend, 1)
    timed = owner_choice.measure(opt, backend)  # type: ignore[arg-type]
    out = (timed, "replicated" if opt.sharding is None else "placed", opt.state == {})  # type: ignore[attr-defined]
    backend.close()
    return out


def test_auto_is_measured_once_and_every_rank_takes_the_same_choice() -> None:
    ranks = run_in_gloo(_auto, 2)
    assert ranks[0][0] == ranks[1][0]  # every rank's times gathered: the same numbers everywhere
    assert all(t > 0 for t in (ranks[0][0].replicated, ranks[0][0].owned, ranks[0][0].gather))
    assert ranks[0][1] == ranks[1][1]
    assert all(untouched for _, _, untouched in ranks)  # timing on random matrices leaves no state behind
