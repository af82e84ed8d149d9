"""The Eq. 15 fusion rule on hand-worked cases, and the fusion policies' launch counts."""

from __future__ import annotations

import pytest
import torch

from kfacflow.comm.torch_dist import TorchBackend
from kfacflow.configuration.schema import DistConfig
from kfacflow.kfac.communicator import Communicator
from kfacflow.kfac.stages.contracts import EVERY_RANK, FusionOptions
from kfacflow.kfac.stages.fusion import Routing, ThresholdOptions
from kfacflow.kfac.stages.fusion_plan import plan_groups
from kfacflow.perf import LinearModel
from kfacflow.registry import FUSIONS

# alpha = 1 s start-up, beta = 0.1 s per element: an all-reduce of m elements takes 1 + 0.1 m.
MODEL = LinearModel(alpha=1.0, beta=0.1)


def test_merge_when_next_is_ready_before_the_current_could_start() -> None:
    # Factor 0 ready at 0 -> all-reduce 0..2 (m=10). Factor 1 ready at 0.5 < 0 + alpha: joins.
    # Group {0,1} would start at 0.5; factor 2 ready at 1.2 < 0.5 + 1: joins as well.
    assert plan_groups([0.0, 0.5, 1.2], [10, 10, 10], MODEL) == [[0, 1, 2]]


def test_no_merge_when_waiting_costs_more_than_alpha() -> None:
    # Factor 1 is ready 1.5 s after factor 0: waiting would cost more than one start-up (1 s).
    assert plan_groups([0.0, 1.5], [10, 10], MODEL) == [[0], [1]]


def test_merge_when_the_link_is_still_busy() -> None:
    # Factor 0 (m=100) occupies the link from 0 to 11. Factor 1 ready at 2 is sent alone
    # (waiting for it costs 2 s > alpha), but factors 2 and 3, ready at 5 and 9, find the link
    # busy until 11: the group {1} would start at 11, so both are ready before 11 + alpha.
    assert plan_groups([0.0, 2.0, 5.0, 9.0], [100, 10, 10, 10], MODEL) == [[0], [1, 2, 3]]


def test_split_closes_a_group_once_it_has_paid_for_its_start_up() -> None:
    # The link is busy until 11 s, so Eq. 15 fuses factors 1-4. Split: a group is amortized once
    # 1 s <= 0.1 x 0.1 s x m, at m >= 100: factor 1 (100 elements) goes alone; 2 and 3 (10 + 90)
    # reach 100 together; 4 (5 elements) alone at the end.
    ready, sizes = [0.0, 2.0, 5.0, 6.0, 9.0], [100, 100, 10, 90, 5]
    assert plan_groups(ready, sizes, MODEL) == [[0], [1, 2, 3, 4]]
    assert plan_groups(ready, sizes, MODEL, split=True) == [[0], [1], [2, 3], [4]]
    # Small factors, far from paying for a start-up, fuse as under Eq. 15.
    assert plan_groups([0.0, 0.5, 1.2], [10, 10, 10], MODEL, split=True) == [[0, 1, 2]]


def test_every_factor_once_in_order() -> None:
    ready = [0.1 * i for i in range(20)]
    groups = plan_groups(ready, [5] * 20, LinearModel(alpha=0.05, beta=0.01))
    assert [i for g in groups for i in g] == list(range(20))
    assert plan_groups([], [], MODEL) == []


@pytest.mark.parametrize(
    ("policy", "after_forward", "after_backward"),
    [("after_backward", 0, 1), ("naive", 1, 2), ("layerwise", 3, 6), ("threshold", 1, 2)],
)
def test_policies_launch_when_expected(
    policy: str, after_forward: int, after_backward: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    backend = TorchBackend(DistConfig(device="cpu"))
    # threshold 2 KiB: 3 A factors of 100 float64 (2.4 KiB total) fill one buffer exactly once.
    comm = Communicator(backend, FUSIONS.get(policy)(FusionOptions(own=ThresholdOptions(mb=2 / 1024))))
    for i in range(3):
        comm.push(f"l{i}/A", torch.full((100,), float(i), dtype=torch.float64))
    comm.end_forward()
    assert comm.launches == after_forward
    for i in reversed(range(3)):
        comm.push(f"l{i}/G", torch.full((10,), float(i), dtype=torch.float64))
    comm.end_backward()
    assert comm.launches == after_backward
    out = comm.wait()
    assert sorted(out) == sorted([f"l{i}/{k}" for i in range(3) for k in "AG"])
    assert float(out["l2/A"][0]) == 2.0


def test_routing_reduces_to_owners_where_the_models_say_it_is_cheaper() -> None:
    owners = {"a": 0, "b": 1, "c": EVERY_RANK, "d": 0}
    sizes = {"a": 100, "b": 100, "c": 10, "d": 50}
    # Without models: between two ranks always (one direction each); with more, only a group of one owner.
    assert Routing(owners, 2).parts(["a", "b", "c", "d"], sizes) == [(0, ["a", "d"]), (1, ["b"]), (None, ["c"])]
    assert Routing(owners, 3).parts(["a", "b"], sizes) == [(None, ["a", "b"])]
    assert Routing(owners, 3).parts(["a", "d"], sizes) == [(0, ["a", "d"])]
    assert Routing(owners, 3).parts(["c"], sizes) == [(None, ["c"])]
    # P = 4: reductions queue. 0.5 + 0.05 s each against one all-reduce of 1 + 0.2 s: reduced;
    # with the reduction's bytes as dear as the all-reduce's (0.6 s each), one all-reduce (1.2 s, not less).
    cheap, dear = LinearModel(0.5, 0.0005), LinearModel(0.5, 0.001)
    assert Routing(owners, 4, LinearModel(1.0, 0.001), cheap).parts(["a", "b"], sizes) == [(0, ["a"]), (1, ["b"])]
    assert Routing(owners, 4, LinearModel(1.0, 0.001), dear).parts(["a", "b"], sizes) == [(None, ["a", "b"])]
    # P = 2: the two directions at once, max(1.6, 1.1) s against 2.6 s; an NCT adds its own all-reduce (1.1 s).
    two = Routing(owners, 2, LinearModel(0.1, 0.01), LinearModel(0.1, 0.01))
    assert two.parts(["a", "b", "d"], sizes) == [(0, ["a", "d"]), (1, ["b"])]
    assert Routing(owners, 2, LinearModel(1.0, 0.0), LinearModel(0.1, 0.0)).parts(["a", "c"], sizes) == [
        (None, ["a", "c"])
    ]


def _reduce_to_each_rank(rank: int, world: int) -> list[list[float]]:
    from kfacflow.comm import torch_dist

    torch_dist.P2P_CHUNK_BYTES = 16  # 4 float32 per chunk: 10 elements travel in 3 chunks
    backend = TorchBackend(DistConfig(device="cpu"))
    try:
        out = []
        for dst in range(world):
            x = torch.arange(10, dtype=torch.float32) * (rank + 1) + rank
            backend.reduce_async(x, dst).wait()
            out.append(x.tolist() if rank == dst else [])
        return out
    finally:
        backend.close()


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_gloo_reduction_sums_into_its_destination_only(world: int) -> None:
    from helpers import run_in_gloo

    results = run_in_gloo(_reduce_to_each_rank, world, timeout=120)
    expect = [sum(i * (r + 1) + r for r in range(world)) for i in range(10)]
    for dst in range(world):
        assert results[dst][dst] == expect
