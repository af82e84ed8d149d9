"""Faults: non-finite steps skipped on every rank together, non-finite factors, killed workers, SIGTERM."""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, cast

import pytest
import torch
from helpers import ROOT, last_line, recipe_trainer, run_cli, run_in_gloo

from kfacflow import TrainingError
from kfacflow.comm.torch_dist import TorchBackend
from kfacflow.configuration.recipe import load
from kfacflow.configuration.schema import DistConfig, KFACConfig
from kfacflow.kfac.packing import pack
from kfacflow.running import build

QUICK = str(ROOT / "recipes" / "quickstart.yaml")


def _train_with_nan(
    rank: int,
    world: int,
    out: str,
    bad_steps: list[int],
    max_nonfinite: int,
    extra: tuple[str, ...] = ("kfac.variant=d",),
) -> dict[str, Any]:
    """Train 6 steps; on rank 1 the output is NaN at the given steps."""
    from kfacflow.running.trainer import Trainer

    cfg = load(
        [QUICK],
        [
            f"out_dir={out}",
            "train.steps=6",
            "train.progress=false",
            "train.dtype=float64",
            f"train.max_nonfinite={max_nonfinite}",
            "data.batch_size=16",
            *extra,
        ],
    )
    backend = TorchBackend(cfg.dist)
    run_dir = Path(out) / "run"
    run_dir.mkdir(parents=True, exist_ok=True)
    trainer = Trainer.from_recipe(cfg, backend, run_dir)

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
    timings = run_dir / "timings.jsonl"
    return {
        "error": error,
        "skipped": trainer.skipped_steps,
        "step": trainer.step,
        "params": [p.detach().clone() for p in trainer.model.parameters()],
        "summary_skipped": summary.get("skipped_steps"),
        "timed": [json.loads(line)["step"] for line in timings.read_text().splitlines()] if timings.is_file() else None,
    }


OWNED_MUON = ("kfac.variant=flow", "optim.name=muon", "optim.lr=0.02", "optim.muon.owners=kfac")
"""K-FAC + Muon, each layer's Muon momentum on its owner: a skipped step must leave the owners' momenta as they were."""


@pytest.mark.slow
@pytest.mark.parametrize("extra", [("kfac.variant=d",), OWNED_MUON], ids=["d", "muon-on-owners"])
def test_nonfinite_step_is_skipped_on_every_rank_together(tmp_path: Path, extra: tuple[str, ...]) -> None:
    results = run_in_gloo(_train_with_nan, 2, str(tmp_path), [2], 5, extra, timeout=180)
    for r in results:
        assert r["error"] is None
        assert r["skipped"] == 1 and r["summary_skipped"] == 1 and r["step"] == 6
    assert results[0]["timed"] == [1, 2, 4, 5, 6], "timings.jsonl names each step by its number; 3 was skipped"
    for a, b in zip(results[0]["params"], results[1]["params"], strict=True):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.slow
def test_too_many_nonfinite_steps_in_a_row_stop_with_a_clear_message(tmp_path: Path) -> None:
    results = run_in_gloo(_train_with_nan, 2, str(tmp_path), [1, 2, 3, 4, 5], 3, timeout=180)
    for r in results:
        assert r["error"] is not None and "3 steps in a row" in r["error"] and "optim.lr" in r["error"]
        assert r["step"] == 4  # step 0 trained, steps 1-3 skipped, then the stop


def _nan_input_with_batchnorm(rank: int, world: int, out: str) -> dict[str, Any]:
    """ResNet-20 (BatchNorm) whose input is NaN at step 1: the step is skipped, its statistics put back."""
    from kfacflow.running.trainer import Trainer

    cfg = load([QUICK], [f"out_dir={out}", "model.name=resnet20", "train.steps=3", "train.progress=false"])
    backend = TorchBackend(cfg.dist)
    run_dir = Path(out) / "run"
    run_dir.mkdir(parents=True, exist_ok=True)
    trainer = Trainer.from_recipe(cfg, backend, run_dir)

    def poison(module: torch.nn.Module, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...] | None:
        return (inputs[0] * float("nan"),) if module.training and trainer.step == 1 else None

    trainer.model.register_forward_pre_hook(poison)
    try:
        summary = trainer.fit()
    finally:
        backend.close()
    return {"summary": summary, "buffers": [b.clone() for b in trainer.model.buffers() if b.is_floating_point()]}


@pytest.mark.slow
def test_a_skipped_step_leaves_no_nan_in_batchnorm_statistics(tmp_path: Path) -> None:
    (result,) = run_in_gloo(_nan_input_with_batchnorm, 1, str(tmp_path), timeout=180)
    assert result["summary"]["skipped_steps"] == 1
    assert all(torch.isfinite(b).all() for b in result["buffers"])
    assert math.isfinite(result["summary"]["val_loss"])


def test_nonfinite_factor_never_enters_the_running_average(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    model = torch.nn.Sequential(torch.nn.Linear(3, 2)).double()
    cfg = KFACConfig(factor_decay=0.5)
    pre = build.preconditioner(model, cfg, TorchBackend(DistConfig(device="cpu")))
    good = torch.eye(4, dtype=torch.float64)
    bad = torch.full((4, 4), float("nan"), dtype=torch.float64)
    pre.average({"0/A": pack(bad), "0/G": pack(torch.eye(2, dtype=torch.float64))})
    assert torch.equal(pre.factors["0/A"], torch.zeros(4, 4, dtype=torch.float64))  # reset, not NaN
    pre.average({"0/A": pack(good), "0/G": pack(torch.eye(2, dtype=torch.float64))})
    pre.average({"0/A": pack(bad), "0/G": pack(torch.eye(2, dtype=torch.float64))})
    torch.testing.assert_close(pre.factors["0/A"], 0.5 * good)  # the NaN update was left out
    pre.finite.copy()  # the end of the step: the flags start for the host, nothing waits
    with caplog.at_level(logging.WARNING):
        pre.finite.warn()  # reported at the next step, read once
    assert "factor 0/A was non-finite at step 0" in caplog.text and "0/G" not in caplog.text


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


@pytest.mark.slow
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


@pytest.mark.slow
@pytest.mark.parametrize(("nproc", "sig"), [(2, signal.SIGTERM), (1, signal.SIGINT)])
def test_signal_writes_a_checkpoint_and_resume_equals_uninterrupted(tmp_path: Path, nproc: int, sig: int) -> None:
    common = [
        "train.steps=200",
        "train.checkpoint_every=50",
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
    assert 0 < stopped_at < 200 and summary["stopped_by"] == signal.Signals(sig).name
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
    final = torch.load(run_dir / "checkpoints" / "step_00000200.pt", weights_only=False)["model"]
    (ref_dir,) = (tmp_path / "straight" / "quickstart").iterdir()
    ref = torch.load(ref_dir / "checkpoints" / "step_00000200.pt", weights_only=False)["model"]
    for key in ref:
        torch.testing.assert_close(final[key], ref[key], rtol=1e-10, atol=1e-12)


# --- one line, the right worker, the right command ---------------------------------------------------


def _error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("error:")]


@pytest.mark.slow
def test_a_killed_worker_is_named_in_the_one_error_line(tmp_path: Path) -> None:
    proc = _start(tmp_path, "train.epochs=200", "train.checkpoint_every=5", "launch.nproc=2")
    _wait_for_checkpoint(tmp_path, proc)
    victim = _children(proc.pid)[-1]
    os.kill(victim, signal.SIGKILL)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGKILL, err[-3000:]
    lines = _error_lines(err)
    assert len(lines) == 1 and lines[0].endswith(f"(pid {victim}) was killed by SIGKILL (out of memory?)."), err
    assert "Traceback" not in err, err[-3000:]


@pytest.mark.slow
def test_sigterm_to_one_worker_stops_all_with_one_line(tmp_path: Path) -> None:
    proc = _start(tmp_path, "train.epochs=200", "train.checkpoint_every=5", "launch.nproc=2")
    run_dir = _wait_for_checkpoint(tmp_path, proc)
    os.kill(_children(proc.pid)[-1], signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-3000:]
    assert not _error_lines(err) and "Traceback" not in err, err[-3000:]
    stopped = [line for line in err.splitlines() if line.startswith("stopped by SIGTERM")]
    assert len(stopped) == 1 and stopped[0].endswith(f"Continue with: python run.py resume={run_dir}"), err


@pytest.mark.slow
def test_training_error_on_every_rank_prints_one_line(tmp_path: Path) -> None:
    # A huge rate makes every update blow the loss up: the ranks agree to stop after two skipped steps.
    proc = _start(tmp_path, "launch.nproc=2", "kfac.variant=sgd", "optim.lr=1e30", "train.max_nonfinite=2")
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 3, err[-3000:]
    lines = _error_lines(err)
    assert len(lines) == 1 and "2 steps in a row" in lines[0], err
    assert "Traceback" not in err and "worker" not in lines[0], err[-3000:]


@pytest.mark.slow
def test_a_non_finite_preconditioned_gradient_is_never_applied(tmp_path: Path) -> None:
    # Damping that vanishes in float32 gives inverses of 1e30: the preconditioned gradient overflows.
    tiny = ("kfac.damping=1e-30", "kfac.kl_clip=0")
    proc = run_cli(QUICK, "launch.nproc=1", *tiny, "train.steps=20", "train.progress=false", f"out_dir={tmp_path}")
    assert proc.returncode == 3, proc.stderr[-3000:]
    lines = _error_lines(proc.stderr)
    assert len(lines) == 1 and "5 steps in a row" in lines[0] and "kfac.damping" in lines[0], proc.stderr
    assert not list(tmp_path.glob("quickstart/*/checkpoints/*.pt")), "a checkpoint of a failed run was written"


def test_continue_command_names_the_launcher(tmp_path: Path) -> None:
    # A stand-in `horovodrun` whose child asks for the command that resumes the run.
    launcher = tmp_path / "horovodrun"
    launcher.write_text(
        f"#!{sys.executable}\n"
        "import subprocess, sys\n"
        "code = 'from pathlib import Path; from kfacflow.running.launch import continue_command; "
        'print(continue_command(Path("runs/x"), []))\'\n'
        "sys.exit(subprocess.run([sys.executable, '-c', code]).returncode)\n"
    )
    launcher.chmod(0o755)
    env = {**os.environ, "HOROVOD_RANK": "0", "PYTHONPATH": str(ROOT)}
    args = [str(launcher), "-np", "2", "-H", "localhost:2", "--gloo", "python", "run.py", QUICK, "dist.backend=horovod"]
    out = subprocess.run(args, env=env, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "horovodrun -np 2 -H localhost:2 --gloo python run.py resume=runs/x"


# --- the disk fills up while checkpointing -----------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path: Path) -> Any:
    """A 5 MiB tmpfs: room for two quickstart checkpoints (2 MiB each), not three."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=5m", "tmpfs", str(disk)]).returncode:
        pytest.skip("needs root to mount a small tmpfs")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


@pytest.mark.slow
def test_disk_full_while_checkpointing_names_the_file_and_keeps_the_previous(small_disk: Path) -> None:
    every_step = ("train.checkpoint_every=1", "train.keep_checkpoints=0")
    proc = _start(small_disk, "launch.nproc=2", "train.steps=20", *every_step)
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == 4, err[-3000:]
    lines = _error_lines(err)
    assert len(lines) == 1, err
    assert "no space left on the device" in lines[0] and "step_00000003.pt" in lines[0], lines[0]
    assert "Traceback" not in err and "worker" not in lines[0], err[-3000:]
    (run_dir,) = (small_disk / "quickstart").iterdir()
    assert not [p for p in run_dir.rglob("*") if ".tmp" in p.name], "a temporary file was left behind"
    kept = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert kept == ["step_00000001.pt", "step_00000002.pt"]
    assert torch.load(run_dir / "checkpoints" / kept[-1], weights_only=False)["step"] == 2


# --- resuming: checked before the run folder is touched ----------------------------------------------


def _snapshot(run_dir: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 1-worker run of 3 steps (checkpoints at every step)."""
    out = tmp_path_factory.mktemp("finished")
    return _finish(out, "train.steps=3", "train.checkpoint_every=1")


def _finish(out: Path, *extra: str) -> Path:
    """Run a 1-worker quickstart to its end; return its run folder."""
    proc = run_cli(QUICK, "launch.nproc=1", "launch.threads=1", "train.progress=false", f"out_dir={out}", *extra)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return Path(last_line(proc))


# (extra overrides, exit code, strings the one stderr line must hold); run in this order, on one folder.
RESUMES = [
    pytest.param(["model.name=resnet20"], 2, ("model.name=digits_cnn", "model.name=resnet20"), id="other-model"),
    pytest.param(["data.batch_size=8"], 2, ("data.batch_size=32", "data.batch_size=8"), id="other-batch"),
    pytest.param(["train.accumulate=2"], 2, ("train.accumulate=1",), id="other-accumulate"),
    pytest.param(["kfac.variant=sgd"], 2, ("kfac.variant=spd", "d, mpd and spd"), id="kfac-to-sgd"),
    pytest.param(["launch.nproc=2"], 2, ("1 workers", "this run has 2", "launch.nproc=1"), id="other-world-size"),
    pytest.param(["kfac.skip=[fc2]"], 2, ("fc2", "kfac.skip"), id="other-kfac-skip"),
    pytest.param([], 0, ("finished at step 3 of 3", "nothing to do", "train.steps=6"), id="finished"),
    pytest.param(["kfac.variant=d"], 0, ("finished at step 3",), id="finished-other-variant"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("extra", "code", "must"), RESUMES)
def test_resume_is_checked_before_the_folder_is_touched(
    finished_run: Path, extra: list[str], code: int, must: tuple[str, ...]
) -> None:
    before = _snapshot(finished_run)
    proc = run_cli(f"resume={finished_run}", "train.progress=false", *extra)
    assert proc.returncode == code, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    said = [line for line in proc.stderr.splitlines() if line.startswith(("error:", "resume:"))]
    assert len(said) == 1, proc.stderr
    for text in must:
        assert text in said[0], f"{text!r} not in {said[0]!r}"
    assert _snapshot(finished_run) == before, "the run folder changed"


@pytest.mark.slow
def test_resume_of_a_run_stopped_after_its_last_step_runs_the_final_evaluation(tmp_path: Path) -> None:
    run_dir = _finish(tmp_path, "train.steps=2")
    path = run_dir / "checkpoints" / "step_00000002.pt"
    state = torch.load(path, weights_only=False)
    final = state["history"].pop()  # as a SIGTERM during the last step leaves it: no final evaluation
    torch.save(state, path)
    before = json.loads((run_dir / "summary.json").read_text())
    (run_dir / "summary.json").unlink()
    again = run_cli(f"resume={run_dir}", "train.progress=false")
    assert again.returncode == 0, again.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["val_acc"] == pytest.approx(final["val_acc"])
    # The figures over the run's steps come from the checkpoint: the resumed process trained none.
    for key in ("train_loss", "step_time_median_s", "breakdown_mean_s", "skipped_steps"):
        assert summary[key] == before[key], key
    assert torch.load(path, weights_only=False)["history"][-1]["step"] == 2


# --- replicas that drift apart -----------------------------------------------------------------------


def _drift(rank: int, world: int, out: str) -> dict[str, Any]:
    """Train 2 steps; then rank 1's parameters and momentum drift by one ulp, then become NaN."""
    with recipe_trainer(out, ["train.steps=2", "train.progress=false", "kfac.variant=d"]) as trainer:
        trainer.fit()
        weight = cast(torch.nn.Linear, trainer.model.fc1).weight
        momentum = trainer.optimizer.state[weight]["momentum_buffer"]
        if rank == 1:
            with torch.no_grad():
                weight[0, 0] = torch.nextafter(weight[0, 0], torch.tensor(float("inf")))
                momentum[0, 0] += 1.0
        trainer.checkpoint()
        repaired = [p.detach().clone() for p in trainer.model.parameters()]
        momentum_after = momentum.clone()
        if rank == 1:
            with torch.no_grad():
                weight[1, 1] = float("nan")
        try:
            trainer.step = 3  # a new checkpoint file, which must not be written
            trainer.checkpoint()
            error = None
        except TrainingError as err:
            error = str(err)
        return {"params": repaired, "momentum": momentum_after, "repaired": trainer.repaired, "error": error}


@pytest.mark.slow
def test_drifted_replicas_are_restored_and_non_finite_ones_stop(tmp_path: Path, caplog: Any) -> None:
    results = run_in_gloo(_drift, 2, str(tmp_path), timeout=180)
    for a, b in zip(results[0]["params"], results[1]["params"], strict=True):
        assert torch.equal(a, b), "the replicas still differ after the check"
    assert torch.equal(results[0]["momentum"], results[1]["momentum"])
    assert results[0]["repaired"] == results[1]["repaired"] == 1
    for r in results:
        assert r["error"] is not None and "non-finite after step 3 on rank(s) [1]" in r["error"], r["error"]
    names = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert names == ["step_00000002.pt"], names
