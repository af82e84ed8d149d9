"""The Eq. 15 fusion rule on hand-worked cases, and the fusion policies' launch counts."""

from __future__ import annotations

import pytest
import torch

from kfacflow.comm.torch_dist import TorchBackend
from kfacflow.config import DistConfig
from kfacflow.kfac.fusion import Communicator
from kfacflow.kfac.fusion_plan import plan_groups
from kfacflow.kfac.stages import FusionOptions
from kfacflow.perf import LinearModel
from kfacflow.registry import COMMUNICATORS

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
    comm = Communicator(backend, COMMUNICATORS.get(policy)(FusionOptions(threshold_bytes=2 * 1024)))
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
