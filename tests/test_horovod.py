"""The Horovod backend under horovodrun equals the torch.distributed backend (run when Horovod is installed)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import ROOT, run_cli

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("horovod") is None or shutil.which("horovodrun") is None,
    reason="Horovod is not installed (bash tools/install_horovod.sh)",
)

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
