"""Launching: joining a torchrun job, and running in-process with launch.nproc=1."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT, last_line, run_cli

QUICK = "recipes/quickstart.yaml"


@pytest.mark.slow
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


@pytest.mark.slow
def test_nproc_1_runs_in_process(tmp_path: Path) -> None:
    proc = run_cli(QUICK, "launch.nproc=1", "train.steps=2", "train.progress=false", f"out_dir={tmp_path}", timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((Path(last_line(proc)) / "summary.json").read_text())
    assert summary["world_size"] == 1
    assert summary["steps"] == 2
    assert "torch.distributed.elastic" not in proc.stderr  # no launcher was involved


@pytest.mark.slow
def test_sigterm_under_torchrun_prints_the_torchrun_command_that_resumes(tmp_path: Path) -> None:
    import signal
    import time

    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone"]
    args = ["train.steps=60", "train.checkpoint_every=10", "train.progress=false", "kfac.variant=d"]
    proc = subprocess.Popen(
        [*launcher, "run.py", QUICK, *args, f"out_dir={tmp_path}"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob("quickstart/*/checkpoints/step_*.pt")):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.2)
    (run_dir,) = (tmp_path / "quickstart").iterdir()
    ps = subprocess.run(["ps", "-o", "pid=,args=", "--ppid", str(proc.pid)], capture_output=True, text=True).stdout
    workers = [int(line.split()[0]) for line in ps.splitlines() if "run.py" in line]
    assert len(workers) == 2, ps
    os.kill(workers[1], signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    lines = [line for line in err.splitlines() if line.startswith("stopped by SIGTERM")]
    assert len(lines) == 1, err[-3000:]
    command = lines[0].split("Continue with: ", 1)[1]
    assert command == f"python -m torch.distributed.run --nproc_per_node 2 --standalone run.py resume={run_dir}"
    # The printed command, run as it is, finishes the run.
    resumed = subprocess.run(command.split(), cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 60
