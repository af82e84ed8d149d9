"""Gradient accumulation: k micro-batches of b give the parameters and factors of one batch of k b."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import ROOT, run_in_gloo

QUICK = str(ROOT / "recipes" / "quickstart.yaml")
STEPS = 4


def _train(rank: int, world: int, out: str, runs: dict[str, list[str]]) -> dict[str, Any]:
    """Train each run of ``runs`` (name -> overrides) for a few float64 steps; return its end state."""
    from kfacflow.comm.torch_dist import TorchBackend
    from kfacflow.configuration.recipe import load
    from kfacflow.running.trainer import Trainer

    results = {}
    backend = None
    try:
        for name, overrides in runs.items():
            cfg = load(
                [QUICK],
                [
                    f"out_dir={out}",
                    f"train.steps={STEPS}",
                    "train.progress=false",
                    "train.dtype=float64",
                    "kfac.variant=d",
                    "kfac.fusion=layerwise",  # factors handed over one by one from the hooks
                    *overrides,
                ],
            )
            backend = backend or TorchBackend(cfg.dist)  # one process group for every run
            run_dir = Path(out) / name
            run_dir.mkdir(parents=True, exist_ok=True)
            trainer = Trainer.from_recipe(cfg, backend, run_dir)
            summary = trainer.fit()
            assert trainer.kfac is not None
            results[name] = {
                "params": [p.detach().clone() for p in trainer.model.parameters()],
                "factors": {k: v.clone() for k, v in trainer.kfac.factors.items()},
                "launches": trainer.kfac.comm.launches,
                "train_loss": summary["train_loss"],
                "steps": trainer.step,
            }
    finally:
        if backend is not None:
            backend.close()
    return results


@pytest.mark.slow
def test_micro_batches_equal_one_larger_batch_on_two_workers(tmp_path: Path) -> None:
    runs = {
        "micro": ["data.batch_size=16", "train.accumulate=3"],
        "whole": ["data.batch_size=48", "train.accumulate=1"],
    }
    results = run_in_gloo(_train, 2, str(tmp_path), runs, timeout=240)
    for rank in range(2):
        micro, whole = results[rank]["micro"], results[rank]["whole"]
        assert micro["steps"] == whole["steps"] == STEPS
        # One all-reduce per factor and step, not one per micro-batch.
        assert micro["launches"] == whole["launches"] == STEPS * 2 * 4
        for a, b in zip(micro["params"], whole["params"], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
        assert micro["factors"].keys() == whole["factors"].keys()
        for key, value in whole["factors"].items():
            torch.testing.assert_close(micro["factors"][key], value, rtol=1e-10, atol=1e-12, msg=key)
        assert micro["train_loss"] == pytest.approx(whole["train_loss"], rel=1e-12)
    for a, b in zip(results[0]["micro"]["params"], results[1]["micro"]["params"], strict=True):
        assert torch.equal(a, b), "the two ranks must hold the same parameters"
