"""Muon's projected step (:mod:`kfacflow.simulation.muon_owners`, ``tools/simulate_muon.py``) by hand computation."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from helpers import ROOT

from kfacflow.perf import InverseModel, LinearModel, Profile
from kfacflow.simulation.muon_owners import NewtonSchulzModel, measured, project

sys.path.insert(0, str(ROOT / "tools"))

import simulate_muon  # noqa: E402

SHAPES = [(2, 3), (2, 3), (4, 4)]
"""Flops of one iteration (4 m^2 n + 2 m^3, m <= n): 64 for each 2 x 3, 384 for the 4 x 4."""


def _profile(alpha: float = 1e-3, beta: float = 1e-6, world: int = 2) -> Profile:
    ar, bc = LinearModel(alpha, beta), LinearModel(alpha / 2, beta)
    return Profile(ar, bc, InverseModel("cubic", 0.0, 1.0), meta={"world_size": world})


def test_newton_schulz_model_charges_launches_per_shape_when_batched() -> None:
    assert NewtonSchulzModel(launch=1.0, flops_per_s=1.0, steps=1)(SHAPES) == 3 * 2 + 64 + 64 + 384
    assert NewtonSchulzModel(launch=1.0, flops_per_s=1.0, steps=1, batched=False)(SHAPES) == 3 * 3 + 512
    assert NewtonSchulzModel(launch=0.0, flops_per_s=2.0, steps=2)(SHAPES) == 512.0


def test_replicated_muon_does_every_matrix_and_sends_nothing() -> None:
    step = project(SHAPES, "replicated", 2, _profile(), measured({(2, 3): 1.0, (4, 4): 5.0}), steps=1)
    assert (step.newton_schulz, step.gather, step.total) == (7.0, 0.0, 7.0)


def test_placed_owners_charge_the_busiest_rank_and_the_gather() -> None:
    # placed: the 4 x 4 (384 flops) onto rank 0, then both 2 x 3 onto rank 1 (64, then 128 < 384)
    seconds = measured({(2, 3): 1.0, (4, 4): 5.0})
    step = project(SHAPES, "placed", 2, _profile(), seconds, steps=1)
    # pieces: rank 0 one flag and 16 elements, rank 1 two flags and 12: 17 + 14 = 31, in chunks of 16;
    # two steps of the broadcast's start-up, (P-1)/P of the buffer and the larger of a piece and a chunk
    assert step.newton_schulz == 5.0
    assert step.gather == pytest.approx(2 * 0.5e-3 + 1e-6 * (31 / 2 + 17))
    # round_robin: (2, 3) and (4, 4) on rank 0, one (2, 3) on rank 1
    rr = project(SHAPES, "round_robin", 2, _profile(), seconds, steps=1)
    assert rr.newton_schulz == 6.0
    assert rr.gather == pytest.approx(2 * 0.5e-3 + 1e-6 * (31 / 2 + 24))
    # an engine that does not gather all-reduces the zero-filled buffer of 31
    ar = project(SHAPES, "placed", 2, _profile(), seconds, steps=1, gathers=False)
    assert ar.gather == pytest.approx(1e-3 + 1e-6 * 31)


def test_communication_is_rescaled_to_p_and_the_gradients_hide_behind_backward() -> None:
    seconds = measured({(2, 3): 1.0, (4, 4): 5.0})
    # at P = 4 the all-reduce takes 2(P-1) = 6 hops of alpha/2 and 2(P-1)/P = 1.5 of beta/1 per element
    step = project(SHAPES, "replicated", 4, _profile(), seconds, forward=0.25, backward=1e-3, gradients=1000)
    assert step.compute == pytest.approx(0.25 + 1e-3 + (3e-3 + 1.5e-3 - 1e-3))
    hidden = project(SHAPES, "replicated", 4, _profile(), seconds, forward=0.25, backward=1.0, gradients=1000)
    assert hidden.compute == pytest.approx(1.25)
    # each matrix on an owner of its own: the largest Newton-Schulz bounds the step
    assert project(SHAPES, "placed", 4, _profile(), seconds, steps=1).newton_schulz == 5.0


def test_tool_prints_every_owner_choice_at_every_p(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    profile = tmp_path / "profile.yaml"
    _profile().save(profile)
    assert simulate_muon.main(["digits_cnn", str(profile), "--workers", "1,2", "--markdown"]) == 0
    out = capsys.readouterr().out
    for how in ("replicated", "round_robin", "placed"):
        assert f"| 2 | {how} |" in out
    assert "| 1 | placed |" in out and out.count("1.000x") >= 4  # one worker: nothing placed, nothing sent
    assert simulate_muon.main(["digits_cnn", str(profile), "--workers", "2", "--measure", "--reps", "1"]) == 0
    assert capsys.readouterr().out.count("x\n") == 3  # timed here: each owner choice's row


def test_tool_names_an_unknown_model_in_one_line(tmp_path: Path) -> None:
    profile = tmp_path / "profile.yaml"
    _profile().save(profile)
    with pytest.raises(SystemExit, match="^error: .*nosuchnet"):
        simulate_muon.main(["nosuchnet", str(profile)])


def test_directions_in_bfloat16_carry_half_the_bytes_of_float32() -> None:
    seconds = measured({(2, 3): 1.0, (4, 4): 5.0})
    half = project(SHAPES, "placed", 2, _profile(), seconds, steps=1, width=0.5)
    assert half.gather == pytest.approx(2 * 0.5e-3 + 0.5e-6 * (31 / 2 + 17))
