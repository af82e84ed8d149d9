"""A new stage in one file: a fusion policy registered here alone trains a 2-worker job and is simulated.

This file is the README's "How to add a stage", proved: nothing else in the project names ``pairs``.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import ROOT, run_in_gloo

from kfacflow.kfac.fusion import Policy, Ready, plan_launches
from kfacflow.kfac.stages import FusionOptions, Waiting
from kfacflow.registry import COMMUNICATORS

sys.path.insert(0, str(ROOT / "tools"))
import simulate  # noqa: E402


class Pairs(Policy):
    """Factors all-reduced two at a time, as they come (an odd one out waits for the end of its pass)."""

    def close_group(self, waiting: Sequence[Waiting]) -> bool:
        """When two factors wait."""
        return len(waiting) == 2


if "pairs" not in COMMUNICATORS:  # a spawned worker imports this file again
    COMMUNICATORS.add("pairs", Pairs, "factors all-reduced two at a time (a test's own policy)")


def _train(rank: int, world: int, out: str) -> dict[str, Any]:
    from kfacflow.comm.torch_dist import TorchBackend
    from kfacflow.recipe import load
    from kfacflow.trainer import Trainer

    results: dict[str, Any] = {}
    backend = None
    try:
        for fusion in ("pairs", "after_backward"):
            cfg = load(
                [str(ROOT / "recipes" / "quickstart.yaml")],
                [
                    f"out_dir={out}",
                    "train.steps=3",
                    "train.progress=false",
                    "train.dtype=float64",
                    "kfac.variant=d",
                    f"kfac.fusion={fusion}",
                ],
            )
            backend = backend or TorchBackend(cfg.dist)
            run_dir = Path(out) / fusion
            run_dir.mkdir(parents=True, exist_ok=True)
            trainer = Trainer.from_recipe(cfg, backend, run_dir)
            trainer.fit()
            assert trainer.kfac is not None
            results[fusion] = {
                "params": [p.detach().clone() for p in trainer.model.parameters()],
                "launches": trainer.kfac.comm.launches,
            }
    finally:
        if backend is not None:
            backend.close()
    return results


@pytest.mark.slow
def test_a_policy_registered_in_a_test_file_trains_and_is_simulated(tmp_path: Path) -> None:
    results = run_in_gloo(_train, 2, str(tmp_path), timeout=240)
    for rank in range(2):
        pairs, reference = results[rank]["pairs"], results[rank]["after_backward"]
        # 4 layers: 4 A factors in 2 pairs, 4 G factors in 2 pairs, each of 3 steps.
        assert (pairs["launches"], reference["launches"]) == (3 * 4, 3 * 1)
        for a, b in zip(pairs["params"], reference["params"], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)  # the same mathematics

    # The simulator runs the same rule on a traced step's ready times.
    ready = [Ready(f"l{i}/A", float(i), 10) for i in range(3)]
    launches = plan_launches(Pairs(FusionOptions()), ready, 5.0, [], 6.0)
    assert launches == [(1.0, ["l0/A", "l1/A"]), (5.0, ["l2/A"])]
    runs = sorted((ROOT / "docs" / "results" / "resnet18_2x1gbit").glob("layers_d_*.json"))
    profile = ROOT / "docs" / "results" / "resnet18_2x1gbit" / "profile.yaml"
    out = tmp_path / "sim.json"
    args = [*map(str, runs), str(profile), "--workers", "2", "--variants", "pairs:local,d", "--json", str(out)]
    assert simulate.main(args) == 0

    simulated = {r["variant"]: r for r in json.loads(out.read_text())}
    assert simulated["pairs:local"]["total"] > 0
    assert simulated["pairs:local"]["FactorComm"] != simulated["d"]["FactorComm"]
