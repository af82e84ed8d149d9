"""tools/gpu_check.py's machinery, on any machine: a run past its time goes with its whole process group,
one deadline for the whole check, and the report of runs that failed or did not fit."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
from helpers import ROOT

sys.path.insert(0, str(ROOT / "tools"))

import gpu_check  # noqa: E402


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie no longer does: it only waits to be reaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.slow
def test_a_run_past_its_time_is_stopped_with_everything_it_started(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    # A launcher whose worker, and the worker's own child, outlive it unless the whole group is stopped.
    script = f"sleep 300 & echo $! >> {pids}; (sleep 300 & echo $! >> {pids}; wait) & wait"
    t0 = time.monotonic()
    code, out, wall = gpu_check.run(["bash", "-c", script], timeout=2)
    assert code == 124 and "timed out" in out and wall < 30 and time.monotonic() - t0 < 30
    started = [int(line) for line in pids.read_text().split()]
    assert len(started) == 2
    deadline = time.monotonic() + 5
    while any(_alive(pid) for pid in started) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in started), "a worker outlived its run"


def test_a_finished_run_reports_its_output_and_leaves_nothing_behind(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    code, out, _ = gpu_check.run(["bash", "-c", f"(sleep 300 & echo $! > {pid_file}) ; echo fine"], timeout=30)
    assert code == 0 and out.strip() == "fine"
    time.sleep(0.2)
    assert not _alive(int(pid_file.read_text()))


def test_one_deadline_for_the_whole_check(tmp_path: Path) -> None:
    assert 69 < gpu_check.Deadline(100).allows(120) <= 70  # what is left, less the report's and a kill's share
    assert gpu_check.Deadline(500).allows(120) == 120
    assert gpu_check.Deadline(50).allows(120) == 0  # too little to be worth starting
    row = gpu_check.train(tmp_path, "late", ["recipes/quickstart.yaml"], 0.0, "sgd")
    assert row["skipped"] and row["exit"] is None and not (tmp_path / "runs").exists()
    on_cpu = {name: extra for name, extra, _ in gpu_check.cases("cpu", cupy=True)}
    assert "spd_fp16" not in on_cpu and "spd_cupy" not in on_cpu  # CUDA only
    assert gpu_check.CPU_SKIP in on_cpu["spd"] and gpu_check.CPU_SKIP not in on_cpu["sgd"]
    on_gpu = {name: extra for name, extra, _ in gpu_check.cases("cuda", cupy=False)}
    assert "spd_cupy" not in on_gpu and not any(gpu_check.CPU_SKIP in extra for extra in on_gpu.values())


def test_the_report_names_every_run_and_what_it_is_compared_with() -> None:
    parts = {p: 0.01 for p in gpu_check.PARTS}
    ok = {"exit": 0, "wall_s": 9.0, "images_per_s": 64.0, "peak_gpu_memory_gib": 3.5, "breakdown_s": parts}
    result = {
        "versions": {k: "x" for k in ("device_name", "torch", "cuda", "cudnn", "nccl", "driver", "cupy")},
        "seconds": 400.0,
        "budget_s": 480.0,
        "image_size": 224,
        "tests": {"summary": "9 passed"},
        "quickstart": [{"name": "quickstart_1rank", "exit": 0, "val_acc": 0.98}],
        "bench": [
            {"name": "spd", "base": None, "step_s": 0.5, **ok},
            {"name": "spd_bf16", "base": "spd", "step_s": 0.25, **ok},
            {"name": "spd_fp16", "base": "spd", "exit": 1, "error": "boom"},
            {"name": "flow_bf16", "base": "flow", "exit": None, "skipped": "no time left"},
        ],
        "batched_inverses": [{"count": 64, "size": 64, "each_s": 0.01, "batched_s": 0.001}],
    }
    text = gpu_check.table(result)
    assert "| spd_bf16 | 0.250 | 64.0 | 2.00x spd | 3.50 |" in text
    assert "| spd_fp16 | failed (exit 1) |" in text and "| flow_bf16 | skipped: no time left |" in text
    widths = {line.count("|") for line in text.splitlines() if line.startswith("| spd") or line.startswith("| flow")}
    assert len(widths) == 1, text  # every row has every column
