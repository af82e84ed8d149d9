"""The GPU path: the launch (local rank, NCCL's device), checkpoints against the watchdog, replica repair
off the engine's device, traced NCCL collectives, the recipe keys for benchmarks (channels_last, cuDNN's
autotuner, no checkpoints). What a CPU can show runs on gloo here; the rest is marked ``cuda``.
"""

from __future__ import annotations

import datetime
import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import ROOT, last_line, recipe_trainer, run_cli, run_in_gloo
from torch import Tensor, nn

from kfacflow import UserError
from kfacflow.comm.base import Backend, Handle
from kfacflow.comm.launchers import LOCAL_RANK_VARS, LOCAL_SIZE_VARS
from kfacflow.comm.torch_dist import TorchBackend, init_options, local_rank
from kfacflow.configuration.recipe import load
from kfacflow.configuration.schema import DistConfig
from kfacflow.running import rundir
from kfacflow.running.consistency import check_replicas
from kfacflow.timing import StepTimer

QUICK = str(ROOT / "recipes" / "quickstart.yaml")
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture
def no_launcher(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for var in ("RANK", "WORLD_SIZE", *LOCAL_RANK_VARS, *LOCAL_SIZE_VARS):
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


# --- the launch ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("env", "want"),
    [
        ({"SLURM_LOCALID": "3"}, 3),  # srun without LOCAL_RANK
        ({"OMPI_COMM_WORLD_LOCAL_RANK": "2"}, 2),  # mpirun (Open MPI)
        ({"MV2_COMM_WORLD_LOCAL_RANK": "1"}, 1),
        ({"MPI_LOCALRANKID": "1"}, 1),
        ({"PMI_LOCAL_RANK": "1"}, 1),
        ({"LOCAL_RANK": "1", "SLURM_LOCALID": "0"}, 1),  # torchrun under srun: torchrun's own
        ({"LOCAL_WORLD_SIZE": "1"}, 0),  # one worker on this machine: GPU 0 cannot be wrong
    ],
)
def test_the_local_rank_comes_from_the_launcher(
    no_launcher: pytest.MonkeyPatch, env: dict[str, str], want: int
) -> None:
    for var, value in env.items():
        no_launcher.setenv(var, value)
    assert local_rank(DistConfig(device="cuda"), 5, 8, joined=False) == want
    backend = TorchBackend(DistConfig(device="cpu"))  # one worker: no group to join
    assert backend.local_rank == want


def test_several_cuda_ranks_that_cannot_tell_their_gpu_are_refused(no_launcher: pytest.MonkeyPatch) -> None:
    no_launcher.setenv("RANK", "1")
    no_launcher.setenv("WORLD_SIZE", "2")
    with pytest.raises(UserError) as err:  # before any GPU is touched or any group joined
        TorchBackend(DistConfig(device="cuda"))
    line = str(err.value)
    assert "\n" not in line and "LOCAL_RANK" in line and "SLURM_LOCALID" in line and "torchrun" in line, line
    # On the CPU (and with one worker) index 0 is no mistake.
    assert local_rank(DistConfig(device="cpu"), 1, 2, joined=False) == 0
    assert local_rank(DistConfig(device="cuda"), 0, 1, joined=False) == 0


def test_nccl_is_bound_to_the_workers_gpu() -> None:
    timeout = datetime.timedelta(seconds=7)
    nccl = init_options("nccl", torch.device("cuda", 3), timeout)
    assert nccl == {"timeout": timeout, "device_id": torch.device("cuda", 3)}
    assert init_options("gloo", torch.device("cuda", 3), timeout) == {"timeout": timeout}  # gloo takes no device
    assert init_options("gloo", torch.device("cpu"), timeout) == {"timeout": timeout}


# --- checkpoints: a slow write is no failure, train.save=false writes none ----------------------------


def _slow_write(rank: int, world: int, out: str, delay: float) -> list[str]:
    from kfacflow.running.trainer import Trainer

    overrides = [f"out_dir={out}", "train.steps=1", "train.progress=false", "dist.device=cpu", "dist.timeout_s=2"]
    cfg = load([QUICK], overrides)
    backend = TorchBackend(cfg.dist)
    run_dir = Path(out) / "run"
    run_dir.mkdir(parents=True, exist_ok=True)
    real = rundir.save_checkpoint

    def slow(*args: Any, **kwargs: Any) -> Path:
        time.sleep(delay)  # storage slower than dist.timeout_s: the others must not give up
        return real(*args, **kwargs)

    rundir.save_checkpoint = slow  # type: ignore[assignment]
    try:
        trainer = Trainer.from_recipe(cfg, backend, run_dir)
        trainer.checkpoint()
        trainer.step = 1
        trainer.checkpoint()
    finally:
        rundir.save_checkpoint = real  # type: ignore[assignment]
        backend.close()
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir())


@pytest.mark.slow
def test_a_checkpoint_write_slower_than_the_collective_timeout_does_not_fail_the_job(tmp_path: Path) -> None:
    names = run_in_gloo(_slow_write, 2, str(tmp_path), 5.0, timeout=180)
    assert names[0] == names[1] == ["step_00000000.pt", "step_00000001.pt"]


@pytest.mark.slow
def test_train_save_false_writes_no_checkpoint(tmp_path: Path) -> None:
    proc = run_cli(
        QUICK, "train.steps=3", "train.save=false", "train.progress=false", "dist.device=cpu", f"out_dir={tmp_path}"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = Path(last_line(proc))
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["peak_gpu_memory_bytes"] is None  # on the CPU
    assert not list(run.rglob("*.pt"))


# --- replica repair: optimizer state off the engine's device ---------------------------------------


def _adamw_drift(rank: int, world: int) -> dict[str, Any]:
    backend = TorchBackend(DistConfig(device="cpu"))
    try:
        torch.manual_seed(0)
        model = nn.Linear(4, 3)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
        for _ in range(2):
            model(torch.ones(2, 4)).square().sum().backward()
            optimizer.step()
        state = optimizer.state[model.weight]
        step = state["step"]
        if rank == 1:  # drift: one ulp in a weight, and AdamW's moments and step count
            with torch.no_grad():
                model.weight[0, 0] = torch.nextafter(model.weight[0, 0], torch.tensor(1.0))
            state["exp_avg"] += 1.0
            step += 3
        repaired = check_replicas(model, optimizer, backend, 2)
        return {
            "repaired": repaired,
            "same_step_object": state["step"] is step,
            "step": (state["step"].item(), state["step"].device.type, state["step"].dtype),
            "state": {k: v.clone() for k, v in state.items()},
            "weight": model.weight.detach().clone(),
        }
    finally:
        backend.close()


@pytest.mark.slow
def test_adamw_state_and_its_step_are_repaired_where_they_live() -> None:
    r0, r1 = run_in_gloo(_adamw_drift, 2)
    assert r0["repaired"] == r1["repaired"] == 1
    assert torch.equal(r0["weight"], r1["weight"])
    for key, value in r0["state"].items():
        assert torch.equal(value, r1["state"][key]), key
    assert r0["step"] == r1["step"] == (2.0, "cpu", torch.float32)  # rank 0's count, on the CPU as AdamW keeps it
    assert r1["same_step_object"]


class _OneRankNCCL(Backend):
    """One rank on NCCL whose gather says that a second rank's parameters differ: the repair then runs."""

    world_size = 2
    device = torch.device("cuda", 0)

    def __init__(self) -> None:
        self.seen: list[torch.device] = []

    def broadcast_async(self, tensor: Tensor, src: int) -> Handle:
        self.seen.append(tensor.device)
        work = dist.broadcast(tensor, src, async_op=True)  # NCCL itself refuses a CPU tensor
        assert work is not None
        return work

    def gather_objects(self, obj: Any) -> list[Any]:
        sums, finite = obj
        return [obj, ([s + 1 for s in sums], finite)]

    def allreduce_async(self, tensor: Tensor) -> Handle:
        raise NotImplementedError

    def wrap_model(self, model: nn.Module) -> nn.Module:
        return model

    def allreduce_sum(self, tensor: Tensor) -> Tensor:
        return tensor

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        return obj

    def barrier(self) -> None:
        return None

    def close(self) -> None:
        return None


def _adamw_over_nccl(rank: int, world: int) -> dict[str, Any]:
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    try:
        model = nn.Linear(4, 3).to(device)
        optimizer = torch.optim.AdamW(model.parameters())
        model(torch.ones(2, 4, device=device)).sum().backward()
        optimizer.step()
        step = optimizer.state[model.weight]["step"]
        backend = _OneRankNCCL()
        repaired = check_replicas(model, optimizer, backend, 1)
        after = optimizer.state[model.weight]["step"]
        return {
            "repaired": repaired,
            "seen": sorted({str(d) for d in backend.seen}),
            "step": (after is step, after.device.type, after.dtype, float(after)),
        }
    finally:
        dist.destroy_process_group()


@pytest.mark.cuda
@cuda
def test_cuda_adamw_state_is_repaired_over_nccl_and_its_step_stays_on_the_cpu() -> None:
    (r,) = run_in_gloo(_adamw_over_nccl, 1)
    assert r["repaired"] == 2 and r["seen"] == ["cuda:0"]  # the CPU step count went through the GPU
    assert r["step"] == (True, "cpu", torch.float32, 1.0)


# --- traced NCCL collectives are timed on the stream ----------------------------------------------


def _traced_nccl(rank: int, world: int) -> dict[str, Any]:
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    try:
        x = torch.ones(2**20, device=device)
        dist.all_reduce(x)  # NCCL's first collective sets itself up on the host
        times = []
        for _ in range(3):  # the shortest of a few: the clock may still be ramping up
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch.cuda._sleep(100_000_000)
            stop.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(stop) / 1e3)
        sleep_s = min(times)
        timer = StepTimer(device)
        timer.begin_step(trace=True)
        torch.cuda._sleep(100_000_000)  # the compute stream is busy: the all-reduce, posted now, runs after it
        work = dist.all_reduce(x, async_op=True)
        assert work is not None
        posted = time.perf_counter() - timer.origin
        assert timer.on_done(work, "x", "allreduce")
        work.wait()
        timer.end_step()
        return {"sleep_s": sleep_s, "posted_s": posted, "events": timer.events}
    finally:
        dist.destroy_process_group()


@pytest.mark.cuda
@cuda
def test_cuda_a_traced_nccl_collective_ends_when_its_stream_finishes_it() -> None:
    (r,) = run_in_gloo(_traced_nccl, 1)
    assert r["posted_s"] < 0.5 * r["sleep_s"], r  # the host did not wait for the device
    (event,) = r["events"]
    # NCCL's future completed on posting: timed by it, the all-reduce would have ended at once.
    assert event["t1"] >= 0.7 * r["sleep_s"] and 0 <= event["t0"] <= event["t1"], r


# --- benchmark keys: channels_last, cuDNN's autotuner ---------------------------------------------


def _train(rank: int, world: int, out: str, extra: list[str]) -> dict[str, Any]:
    overrides = ["model.name=resnet20", "data.image_size=16", "train.steps=3", "train.dtype=float64"]
    overrides += ["train.progress=false", "train.save=false", "kfac.variant=d", "dist.device=cpu", *extra]
    with recipe_trainer(out, overrides) as trainer:
        trainer.fit()
        weights = [p for p in trainer.model.parameters() if p.dim() == 4]
        return {
            "params": [p.detach().contiguous() for p in trainer.model.parameters()],
            "channels_last": all(p.is_contiguous(memory_format=torch.channels_last) for p in weights),
            "benchmark": torch.backends.cudnn.benchmark,
        }


@pytest.mark.slow
def test_channels_last_trains_as_the_default_format(tmp_path: Path) -> None:
    (plain,) = run_in_gloo(_train, 1, str(tmp_path / "a"), [], timeout=240)
    (nhwc,) = run_in_gloo(_train, 1, str(tmp_path / "b"), ["train.channels_last=true"], timeout=240)
    assert nhwc["channels_last"] and not plain["channels_last"]
    for a, b in zip(plain["params"], nhwc["params"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def test_the_benchmark_keys_are_checked(tmp_path: Path) -> None:
    cfg = load([QUICK], ["train.channels_last=true", "train.cudnn_benchmark=false", "train.save=false"])
    assert cfg.train.channels_last and not cfg.train.cudnn_benchmark and not cfg.train.save
    for key in ("train.channels_last", "train.cudnn_benchmark", "train.save"):
        with pytest.raises(UserError, match=key.split(".")[1]):
            load([QUICK], [f"{key}=sometimes"])


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("benchmark", [True, False])
def test_cuda_the_cudnn_autotuner_follows_its_key(tmp_path: Path, benchmark: bool) -> None:
    key = f"train.cudnn_benchmark={str(benchmark).lower()}"
    extra = ["dist.device=cuda", "train.channels_last=true", "train.dtype=float32", key]
    (r,) = run_in_gloo(_train, 1, str(tmp_path), extra)
    assert r["benchmark"] is benchmark and r["channels_last"]
