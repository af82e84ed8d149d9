"""Faults: non-finite steps skipped on every rank together, non-finite factors, killed workers, SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import ROOT, run_in_gloo

from kfacflow.config import DistConfig, KFACConfig, load
from kfacflow.dist.torch import TorchBackend
from kfacflow.errors import TrainingError
from kfacflow.kfac.factors import pack
from kfacflow.kfac.preconditioner import KFACPreconditioner
from kfacflow.kfac.variants import resolve

QUICK = str(ROOT / "recipes" / "quickstart.yaml")


def _train_with_nan(rank: int, world: int, out: str, bad_steps: list[int], max_nonfinite: int) -> dict[str, Any]:
    """Train 6 steps; on rank 1 the output is NaN at the given steps."""
    from kfacflow.trainer import Trainer

    cfg = load(
        [QUICK],
        [
            f"out_dir={out}",
            "train.steps=6",
            "train.progress=false",
            "train.dtype=float64",
            f"train.max_nonfinite={max_nonfinite}",
            "data.batch_size=16",
            "kfac.variant=d",
        ],
    )
    backend = TorchBackend(cfg.dist)
    run_dir = Path(out) / "run"
    run_dir.mkdir(parents=True, exist_ok=True)
    trainer = Trainer(cfg, backend, run_dir)

    def poison(module: torch.nn.Module, inputs: Any, output: torch.Tensor) -> torch.Tensor | None:
        return output * float("nan") if rank == 1 and trainer.step in bad_steps else None

    trainer.model.register_forward_hook(poison)
    try:
        summary = trainer.fit()
        error = None
    except TrainingError as err:
        summary, error = {}, str(err)
    finally:
        backend.close()
    return {
        "error": error,
        "skipped": trainer.skipped_steps,
        "step": trainer.step,
        "params": [p.detach().clone() for p in trainer.model.parameters()],
        "summary_skipped": summary.get("skipped_steps"),
    }


def test_nonfinite_step_is_skipped_on_every_rank_together(tmp_path: Path) -> None:
    results = run_in_gloo(_train_with_nan, 2, str(tmp_path), [2], 5, timeout=180)
    for r in results:
        assert r["error"] is None
        assert r["skipped"] == 1 and r["summary_skipped"] == 1 and r["step"] == 6
    for a, b in zip(results[0]["params"], results[1]["params"], strict=True):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_too_many_nonfinite_steps_in_a_row_stop_with_a_clear_message(tmp_path: Path) -> None:
    results = run_in_gloo(_train_with_nan, 2, str(tmp_path), [1, 2, 3, 4, 5], 3, timeout=180)
    for r in results:
        assert r["error"] is not None and "3 steps in a row" in r["error"] and "optim.lr" in r["error"]
        assert r["step"] == 4  # step 0 trained, steps 1-3 skipped, then the stop


def test_nonfinite_factor_never_enters_the_running_average(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    model = torch.nn.Sequential(torch.nn.Linear(3, 2)).double()
    cfg = KFACConfig(factor_decay=0.5)
    pre = KFACPreconditioner(model, cfg, resolve(cfg), TorchBackend(DistConfig(device="cpu")))
    good = torch.eye(4, dtype=torch.float64)
    bad = torch.full((4, 4), float("nan"), dtype=torch.float64)
    pre._update_factors({"0/A": pack(bad), "0/G": pack(torch.eye(2, dtype=torch.float64))})
    assert torch.equal(pre.factors["0/A"], torch.zeros(4, 4, dtype=torch.float64))  # reset, not NaN
    pre._update_factors({"0/A": pack(good), "0/G": pack(torch.eye(2, dtype=torch.float64))})
    pre._update_factors({"0/A": pack(bad), "0/G": pack(torch.eye(2, dtype=torch.float64))})
    torch.testing.assert_close(pre.factors["0/A"], 0.5 * good)  # the NaN update was left out


def _start(tmp_path: Path, *extra: str) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    return subprocess.Popen(
        [sys.executable, str(ROOT / "run.py"), QUICK, f"out_dir={tmp_path}", "train.progress=false", *extra],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def _wait_for_checkpoint(tmp_path: Path, proc: subprocess.Popen[str], timeout: float = 120) -> Path:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = list(tmp_path.glob("quickstart/*/checkpoints/step_*.pt"))
        if found:
            return found[0].parents[1]
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.2)
    raise AssertionError("no checkpoint appeared")


def _children(pid: int) -> list[int]:
    """Worker processes (spawned by multiprocessing) whose parent is ``pid``."""
    out = subprocess.run(["ps", "-ww", "-o", "pid=,args=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(line.split()[0]) for line in out.splitlines() if "spawn_main" in line]


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"  # a zombie has exited
    except OSError:
        return False


def test_a_killed_worker_ends_the_job_without_a_hang(tmp_path: Path) -> None:
    proc = _start(tmp_path, "train.epochs=200", "train.checkpoint_every=5")
    _wait_for_checkpoint(tmp_path, proc)
    workers = _children(proc.pid)
    assert len(workers) >= 2, workers
    os.kill(workers[-1], signal.SIGKILL)
    start = time.monotonic()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError("the job did not end within 60 s of a worker's death") from None
    assert proc.returncode != 0
    assert time.monotonic() - start < 60
    deadline = time.monotonic() + 10
    while any(_alive(w) for w in workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [w for w in workers if _alive(w)], "a worker was left running"


@pytest.mark.parametrize(("nproc", "sig"), [(2, signal.SIGTERM), (1, signal.SIGINT)])
def test_signal_writes_a_checkpoint_and_resume_equals_uninterrupted(tmp_path: Path, nproc: int, sig: int) -> None:
    common = [
        "train.steps=400",
        "train.checkpoint_every=100",
        "train.dtype=float64",
        "data.batch_size=16",
        f"launch.nproc={nproc}",
        "kfac.variant=d",
    ]
    proc = _start(tmp_path / "stopped", *common)
    run_dir = _wait_for_checkpoint(tmp_path / "stopped", proc)
    time.sleep(1.0)
    os.kill(proc.pid, sig)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + sig, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert f"stopped by {signal.Signals(sig).name}" in err and f"resume={run_dir}" in err
    summary = json.loads((run_dir / "summary.json").read_text())
    stopped_at = summary["steps"]
    assert 0 < stopped_at < 400 and summary["stopped_by"] == signal.Signals(sig).name
    assert (run_dir / "checkpoints" / f"step_{stopped_at:08d}.pt").is_file()

    resumed = subprocess.run(
        [sys.executable, str(ROOT / "run.py"), f"resume={run_dir}", "train.progress=false"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    straight = subprocess.run(
        [
            sys.executable,
            str(ROOT / "run.py"),
            QUICK,
            *common,
            "train.progress=false",
            f"out_dir={tmp_path / 'straight'}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert straight.returncode == 0, straight.stderr[-3000:]
    final = torch.load(run_dir / "checkpoints" / "step_00000400.pt", weights_only=False)["model"]
    (ref_dir,) = (tmp_path / "straight" / "quickstart").iterdir()
    ref = torch.load(ref_dir / "checkpoints" / "step_00000400.pt", weights_only=False)["model"]
    for key in ref:
        torch.testing.assert_close(final[key], ref[key], rtol=1e-10, atol=1e-12)
