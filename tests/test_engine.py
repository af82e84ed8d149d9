"""dist.engine: NCCL or gloo for torch.distributed, and the CUDA configurations NCCL refuses, checked before start."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import last_line, run_cli

from kfacflow import UserError
from kfacflow.comm.torch_dist import engine_for
from kfacflow.configuration.recipe import load
from kfacflow.running import build

QUICK = "recipes/quickstart.yaml"


def test_auto_is_nccl_on_cuda_and_gloo_on_cpu() -> None:
    assert engine_for("auto", torch.device("cpu")) == "gloo"
    assert engine_for("auto", torch.device("cuda", 0)) == "nccl"
    assert engine_for("gloo", torch.device("cuda", 0)) == "gloo"


def test_nccl_on_the_cpu_is_refused() -> None:
    with pytest.raises(UserError, match=r"^dist.engine=nccl needs CUDA tensors.*dist.engine=auto"):
        build.check(load([QUICK], ["dist.engine=nccl", "dist.device=cpu"]))


def test_two_ranks_on_one_gpu_need_gloo(monkeypatch: pytest.MonkeyPatch) -> None:
    # The check reads what CUDA reports; the machine these tests run on may have no GPU.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    with pytest.raises(UserError, match=r"launch.nproc=2 ranks on 1 visible GPU.*dist.engine=gloo"):
        build.check(load([QUICK], ["launch.nproc=2"]))
    build.check(load([QUICK], ["launch.nproc=2", "dist.engine=gloo"]))
    build.check(load([QUICK], ["launch.nproc=1"]))


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.cuda
@needs_cuda
def test_cuda_two_ranks_over_gloo_d_equals_spd(tmp_path: Path) -> None:
    # Two ranks on one GPU (NCCL would refuse): gloo carries the CUDA tensors; float64 as the CPU tests.
    finals = {}
    for variant in ("d", "spd"):
        proc = run_cli(
            QUICK,
            f"kfac.variant={variant}",
            "dist.device=cuda",
            "dist.engine=gloo",
            "launch.nproc=2",
            "train.dtype=float64",
            "train.steps=4",
            "train.checkpoint_every=4",
            "train.progress=false",
            f"out_dir={tmp_path}/{variant}",
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        run = Path(last_line(proc))
        assert json.loads((run / "summary.json").read_text())["world_size"] == 2
        finals[variant] = torch.load(run / "checkpoints" / "step_00000004.pt", map_location="cpu")["model"]
    for key, t in finals["d"].items():
        torch.testing.assert_close(finals["spd"][key], t, rtol=1e-6, atol=1e-9)
