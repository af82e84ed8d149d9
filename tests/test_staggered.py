"""``kfac.inverse_schedule=staggered``: each factor inverted once a period, at a turn of its own, on 2 gloo workers."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers import kfac_sgd_step, run_in_gloo
from test_stage_equivalence import batches, make_model

from kfacflow.comm.torch_dist import TorchBackend
from kfacflow.configuration.schema import DistConfig, KFACConfig
from kfacflow.kfac.packing import unpack
from kfacflow.kfac.planning.schedule import Schedule, stagger
from kfacflow.kfac.stages.contracts import EVERY_RANK
from kfacflow.kfac.stages.inverse import Inverse
from kfacflow.running import build

STEPS = 9
DAMPING = 0.01


def test_turns_by_hand() -> None:
    # One rank: largest first (65, 10, 7, 6, 4, 3), each to the least loaded turn (ties: the earlier):
    # 65 -> 0, 10 -> 1, 7 -> 2, 6 -> 3; then 4 (64) to turn 3 (216 + 64 < 343), 3 (27) to turn 3 (280 + 27 < 343).
    assert stagger([10, 4, 65, 6, 7, 3], [EVERY_RANK] * 6, 1, 4) == [1, 3, 0, 3, 2, 3]
    # Two ranks: different owners' inversions share a turn (they run side by side); one every rank
    # inverts costs both, so it goes to the turn it slows least (turn 1: 64 each, where turn 0 would be 576).
    assert stagger([8, 8, 4], [0, 1, EVERY_RANK], 2, 2) == [0, 0, 1]
    assert stagger([8, 8, 8, 8], [0, 0, 1, 1], 2, 2) == [0, 1, 0, 1]
    assert stagger([5, 5], [EVERY_RANK] * 2, 1, 1) == [0, 0]


def test_which_step_inverts_what() -> None:
    cfg = KFACConfig(factor_update_freq=2, inv_update_freq=8, inverse_schedule="staggered")
    schedule = Schedule(cfg)
    schedule.plan(["a", "b", "c", "d", "e"], [4, 3, 2, 1, 1], [EVERY_RANK] * 5, 1)
    assert schedule.staggered == 4 and schedule.turns == {"a": 0, "b": 1, "c": 2, "d": 3, "e": 3}
    due = []
    for step in range(18):
        if step == 13:
            schedule.refresh()  # the model's layers changed: everything, once
        due.append((schedule.factors(), sorted(k for k in "abcde" if schedule.due(k))))
        schedule.advance()
    everything = (True, list("abcde"))
    assert due[0] == everything and due[13] == everything
    assert [d for d in due[1:8]] == [(False, []), (True, ["b"]), (False, []), (True, ["c"]), (False, []),
                                     (True, ["d", "e"]), (False, [])]  # fmt: skip
    assert (
        due[8] == (True, ["a"]) and due[10] == (True, ["b"]) and due[14] == (True, ["d", "e"]) and due[16][1] == ["a"]
    )
    assert not Schedule(KFACConfig(inv_update_freq=4)).turns and Schedule(cfg).staggered == 4
    assert Schedule(KFACConfig(factor_update_freq=4, inv_update_freq=4, inverse_schedule="staggered")).staggered == 0


def _run(backend: TorchBackend, variant: dict[str, Any], schedule: Any) -> dict[str, Any]:
    """Train the test model STEPS steps (inverses every 4 steps); after each, every factor and inverse."""
    cfg = KFACConfig(**variant, damping=DAMPING, kl_clip=0.01, inv_update_freq=4, inverse_schedule=schedule)
    model = make_model()
    net = backend.wrap_model(model)
    pre = build.preconditioner(model, cfg, backend, None)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    dims = {slot.key: slot.dim for slot in pre.slots}
    steps = []
    for x, y in batches(backend.world_size, backend.rank, STEPS):
        kfac_sgd_step(net, pre, opt, x, y)
        state = pre.state_dict()  # collective: every rank's inverses, where owners alone hold them
        steps.append({
            "factors": {k: unpack(v, dims[k]).clone() for k, v in state["factors"].items()},
            "inverses": {k: Inverse.restore(kind, ts).dense().clone() for k, (kind, ts) in state["inverses"].items()},
        })  # fmt: skip
    pre.remove()
    turns = dict(pre.schedule.turns)
    return {"steps": steps, "turns": turns, "params": [p.detach().clone() for p in model.parameters()]}


VARIANTS: dict[str, dict[str, Any]] = {
    "d": {"fusion": "after_backward", "placement": "local", "inverse": "cholesky"},
    "owners": {"fusion": "layerwise", "placement": "round_robin", "inverse": "cholesky_factor", "broadcast": "update"},
}


def _gloo_body(rank: int, world: int) -> dict[tuple[str, str], Any]:
    backend = TorchBackend(DistConfig(device="cpu"))
    try:
        return {
            (name, schedule): _run(backend, variant, schedule)
            for name, variant in VARIANTS.items()
            for schedule in ("all", "staggered")
        }
    finally:
        backend.close()


@pytest.mark.slow
def test_each_inverse_is_its_factor_at_its_own_turn_on_two_workers() -> None:
    ranks = run_in_gloo(_gloo_body, 2, timeout=300)
    # Every rank inverts everything (local placement): the turns of the factor sides by hand (conv A 10, G 4;
    # fc1 A 65, G 6; fc2 A 7, G 3; 4 turns): the first test's.
    by_hand = {"0/A": 1, "0/G": 3, "4/A": 0, "4/G": 3, "6/A": 2, "6/G": 3}
    assert ranks[0][("d", "staggered")]["turns"] == by_hand
    for name in VARIANTS:
        run, every = ranks[0][(name, "staggered")], ranks[0][(name, "all")]
        turns = run["turns"]
        assert sorted(turns) == sorted(by_hand) and set(turns.values()) <= {0, 1, 2, 3}
        for step, record in enumerate(run["steps"]):
            for key, inverse in record["inverses"].items():
                # Refreshed at step 0 and then at the steps of its turn: at most one period (4 steps) old.
                last = max(s for s in range(step + 1) if s == 0 or s % 4 == turns[key])
                assert step - last < 4
                factor = run["steps"][last]["factors"][key]
                expected = torch.linalg.inv(factor + DAMPING * torch.eye(factor.shape[0], dtype=factor.dtype))
                torch.testing.assert_close(inverse, expected, rtol=1e-9, atol=1e-12, msg=f"{name} {key} step {step}")
        # The first step inverts everything either way; afterwards the two schedules differ.
        torch.testing.assert_close(run["steps"][0]["inverses"], every["steps"][0]["inverses"], rtol=0, atol=0)
        assert torch.equal(every["steps"][1]["inverses"]["0/A"], every["steps"][0]["inverses"]["0/A"])
        turn1 = [key for key, turn in turns.items() if turn == 1]
        assert turn1 and all(
            not torch.equal(run["steps"][1]["inverses"][k], run["steps"][0]["inverses"][k]) for k in turn1
        )
        assert any(not torch.equal(a, b) for a, b in zip(run["params"], every["params"], strict=True))
        for a, b in zip(run["params"], ranks[1][(name, "staggered")]["params"], strict=True):
            assert torch.equal(a, b), f"{name}: the ranks differ"
