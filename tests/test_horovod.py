"""The Horovod backend under horovodrun equals the torch.distributed backend (run when Horovod is installed)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import ROOT, run_cli

pytestmark = [
    pytest.mark.horovod,
    pytest.mark.skipif(
        importlib.util.find_spec("horovod") is None or shutil.which("horovodrun") is None,
        reason="Horovod is not installed (bash tools/install_horovod.sh)",
    ),
]

COMMON = [
    "recipes/quickstart.yaml",
    "train.steps=6",
    "train.dtype=float64",
    "data.batch_size=16",
    "train.progress=false",
    "kfac.profile_steps=2",
    "train.checkpoint_every=6",
]


def final_model(out: Path) -> dict[str, torch.Tensor]:
    (run,) = (out / "quickstart").iterdir()
    state = torch.load(run / "checkpoints" / "step_00000006.pt", weights_only=False)
    return {k: v for k, v in state["model"].items()}


def horovodrun(out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    return subprocess.run(
        [
            "horovodrun",
            "-np",
            "2",
            "-H",
            "localhost:2",
            "--gloo",
            sys.executable,
            str(ROOT / "run.py"),
            *COMMON,
            "dist.backend=horovod",
            f"out_dir={out}",
            *extra,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture(scope="module")
def torch_reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    out = tmp_path_factory.mktemp("torch")
    proc = run_cli(*COMMON, "launch.nproc=2", "kfac.variant=d", f"out_dir={out}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return final_model(out)


@pytest.mark.parametrize("variant", ["d", "mpd", "spd"])
def test_horovod_equals_torch_backend(variant: str, tmp_path: Path, torch_reference: dict[str, torch.Tensor]) -> None:
    proc = horovodrun(tmp_path, f"kfac.variant={variant}")
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-3000:])
    got = final_model(tmp_path)
    moved = [k for k in got if not torch.allclose(got[k], torch.zeros_like(got[k]))]
    assert moved, "nothing trained"
    for key, ref in torch_reference.items():
        torch.testing.assert_close(got[key], ref, rtol=1e-8, atol=1e-12, msg=f"{variant}: {key}")


def test_horovod_without_horovodrun_and_several_workers_says_how(tmp_path: Path) -> None:
    proc = run_cli(*COMMON, "dist.backend=horovod", "launch.nproc=2", f"out_dir={tmp_path}")
    assert proc.returncode == 2 and "horovodrun -np 2" in proc.stderr and "Traceback" not in proc.stderr


def test_horovod_accumulation_equals_one_larger_batch(tmp_path: Path, torch_reference: dict[str, torch.Tensor]) -> None:
    # Two micro-batches of 8 per step: Horovod averages the gradients once, after the second backward pass.
    proc = horovodrun(tmp_path, "kfac.variant=d", "data.batch_size=8", "train.accumulate=2")
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-3000:])
    got = final_model(tmp_path)
    for key, ref in torch_reference.items():
        torch.testing.assert_close(got[key], ref, rtol=1e-8, atol=1e-12, msg=key)


def test_sigterm_under_horovodrun_prints_the_horovodrun_command_that_resumes(tmp_path: Path) -> None:
    import signal
    import time

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    launcher = ["horovodrun", "-np", "2", "-H", "localhost:2", "--gloo", sys.executable, str(ROOT / "run.py")]
    args = [*COMMON, "train.steps=60", "train.checkpoint_every=10", "kfac.variant=d", "dist.backend=horovod"]
    proc = subprocess.Popen(
        [*launcher, *args, f"out_dir={tmp_path}"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob("quickstart/*/checkpoints/step_*.pt")):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.2)
    (run_dir,) = (tmp_path / "quickstart").iterdir()
    found = [_worker_pid(p, f"out_dir={tmp_path}") for p in Path("/proc").iterdir() if p.name.isdigit()]
    workers = [pid for pid in found if pid is not None]
    assert len(workers) == 2, workers
    os.kill(workers[-1], signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    said = [line for line in (out + err).splitlines() if "stopped by SIGTERM" in line]
    assert said, (out[-3000:], err[-3000:])
    command = said[0].split("Continue with: ", 1)[1]
    assert command == " ".join([*launcher, f"resume={run_dir}"])
    resumed = subprocess.run(command.split(), cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 60


def _worker_pid(proc: Path, marker: str) -> int | None:
    """The pid of a run.py worker (not the shell or horovodrun around it) whose command line holds ``marker``."""
    try:
        args = proc.joinpath("cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    text = [a.decode(errors="replace") for a in args]
    if len(text) > 1 and Path(text[0]).name.startswith("python") and text[1].endswith("run.py") and marker in text:
        return int(proc.name)
    return None
