"""Launching: joining a torchrun job, and running in-process with launch.nproc=1."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from helpers import ROOT, last_line, run_cli

QUICK = "recipes/quickstart.yaml"


def test_torchrun_joins_the_job(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--standalone",
            "run.py",
            QUICK,
            "train.steps=3",
            "train.progress=false",
            f"out_dir={tmp_path}",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dirs = list((tmp_path / "quickstart").iterdir())
    assert len(run_dirs) == 1, "each rank must share rank 0's run folder"
    assert Path(last_line(proc)) == run_dirs[0]
    summary = json.loads((run_dirs[0] / "summary.json").read_text())
    assert summary["world_size"] == 2
    assert summary["steps"] == 3


def test_nproc_1_runs_in_process(tmp_path: Path) -> None:
    proc = run_cli(QUICK, "launch.nproc=1", "train.steps=2", "train.progress=false", f"out_dir={tmp_path}", timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((Path(last_line(proc)) / "summary.json").read_text())
    assert summary["world_size"] == 1
    assert summary["steps"] == 2
    assert "torch.distributed.elastic" not in proc.stderr  # no launcher was involved
