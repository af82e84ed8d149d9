"""K-FAC reaches 95 % validation accuracy on digits in fewer epochs than tuned momentum SGD."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from helpers import last_line, run_cli

TARGET = 0.95
# 4 epochs on one process with batch 64: the same samples per step as the recipes' 2 workers x 32.
BUDGET = ["train.epochs=4", "launch.nproc=1", "data.batch_size=64", "train.progress=false", "train.eval_every=1"]


def epochs_to_target(recipe: str, tmp_path: Path, *extra: str) -> tuple[float, list[float]]:
    """Run ``recipe`` and return the first epoch with val_acc >= TARGET (inf if never) and the curve."""
    proc = run_cli(recipe, *BUDGET, f"out_dir={tmp_path}", *extra, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    history = json.loads((Path(last_line(proc)) / "summary.json").read_text())["history"]
    assert [h["epoch"] for h in history] == [1, 2, 3, 4]
    curve = [h["val_acc"] for h in history]
    reached = [h["epoch"] for h in history if h["val_acc"] >= TARGET]
    return (min(reached) if reached else math.inf), curve


@pytest.mark.slow
def test_kfac_reaches_95_percent_before_sgd(tmp_path: Path) -> None:
    kfac, kfac_curve = epochs_to_target("recipes/quickstart.yaml", tmp_path)
    sgd_runs = [epochs_to_target("recipes/digits_sgd.yaml", tmp_path, f"optim.lr={lr}") for lr in (0.1, 0.2)]
    sgd, sgd_curve = min(sgd_runs, key=lambda r: r[0])
    assert kfac < math.inf, f"K-FAC never reached {TARGET}: {kfac_curve}"
    assert kfac < sgd, f"K-FAC epoch {kfac} {kfac_curve} vs best SGD epoch {sgd} {sgd_curve}"
