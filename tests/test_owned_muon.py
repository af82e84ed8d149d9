"""``optim.muon.owners=kfac``: each K-FAC layer's owner runs its Muon step and sends the finished direction.

The model after every step is the replicated K-FAC + Muon's (``owners=replicated``), through ``run.py`` on
real gloo workers (float64): with KL clipping and the gradients' norm clipped, the owners re-placed by
measured times mid-run (the momenta follow them), on 2 and 3 workers, a checkpoint's optimizer holding
every momentum, a resume going on as the run that did not stop, every replica the same.
"""

from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import last_line, run_cli, run_in_gloo

from kfacflow.comm.torch_dist import TorchBackend
from kfacflow.configuration.schema import DistConfig
from kfacflow.optim import sharding

STEPS = 8


def _common(out_dir: Path, world: int, owners: str, clip: float) -> list[str]:
    return [
        "recipes/quickstart.yaml",
        f"train.steps={STEPS}",
        "train.dtype=float64",
        "train.checkpoint_every=4",
        "train.keep_checkpoints=0",
        "train.progress=false",
        f"out_dir={out_dir}",
        f"launch.nproc={world}",
        "data.batch_size=8",
        "kfac.variant=flow",
        "kfac.kl_clip=0.001",
        "kfac.inv_update_freq=2",
        "kfac.placement_steps=2",  # whole layers placed again by measured times at step 4: owners move
        "optim.name=muon",
        "optim.lr=0.02",
        "optim.momentum=0.9",
        f"optim.clip_grad_norm={clip}",
        f"optim.muon.owners={owners}",
    ]


CASES = {
    "replicated 2": (2, "replicated", 0.5),
    "kfac 2": (2, "kfac", 0.5),
    "replicated 2 unclipped": (2, "replicated", 0.0),
    "kfac 2 unclipped": (2, "kfac", 0.0),
    "replicated 3": (3, "replicated", 0.5),
    "kfac 3": (3, "kfac", 0.5),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    dirs = {case: tmp_path_factory.mktemp(case.replace(" ", "-")) for case in CASES}
    with ThreadPoolExecutor(max_workers=2) as pool:  # each launch is mostly waiting on its own workers
        futures = {case: pool.submit(run_cli, *_common(dirs[case], *args)) for case, args in CASES.items()}
        out = {case: fut.result() for case, fut in futures.items()}
    # the run stopped after step 4: its folder as it was then, resumed on the same world size
    stopped = tmp_path_factory.mktemp("stopped") / "run"
    shutil.copytree(Path(last_line(out["kfac 2"])), stopped)
    (stopped / "checkpoints" / f"step_{STEPS:08d}.pt").unlink()
    resumed = run_cli(*_common(tmp_path_factory.mktemp("resumed"), 2, "kfac", 0.5), f"resume={stopped}")
    return {**out, "resumed": resumed}


def _checkpoint(proc: Any, step: int = STEPS) -> dict[str, Any]:
    assert proc.returncode == 0, proc.stderr[-4000:]
    path = Path(last_line(proc)) / "checkpoints" / f"step_{step:08d}.pt"
    state: dict[str, Any] = torch.load(path, map_location="cpu", weights_only=False)
    return state


def _assert_close(a: dict[str, Any], b: dict[str, Any], exact: bool) -> None:
    assert a["model"].keys() == b["model"].keys()
    for key in a["model"]:
        if exact:  # the owner's operations on the same values; every other rank takes its bits
            assert torch.equal(a["model"][key], b["model"][key]), key
        else:  # the norm summed in float64 here, in float32 by clip_grad_norm_: round-off
            torch.testing.assert_close(a["model"][key], b["model"][key], rtol=1e-9, atol=1e-12)
    states_a, states_b = a["optimizer"]["state"], b["optimizer"]["state"]
    assert states_a.keys() == states_b.keys()
    for index, held in states_a.items():  # every momentum, though each lived on one owner
        assert held.keys() == states_b[index].keys()
        for name, value in held.items():
            torch.testing.assert_close(value, states_b[index][name], rtol=1e-9, atol=1e-12)


@pytest.mark.slow
@pytest.mark.parametrize(("world", "clip"), [(2, "unclipped"), (2, ""), (3, "")])
def test_owners_steps_are_the_replicated_kfac_muon_steps(runs: dict[str, Any], world: int, clip: str) -> None:
    suffix = f" {clip}" if clip else ""
    for step in (4, STEPS):
        kfac = _checkpoint(runs[f"kfac {world}{suffix}"], step)
        replicated = _checkpoint(runs[f"replicated {world}{suffix}"], step)
        _assert_close(kfac, replicated, exact=clip == "unclipped" and world == 2)
    assert "by the layers' measured preconditioning" in runs[f"kfac {world}{suffix}"].stderr  # placed again


@pytest.mark.slow
def test_owners_clip_the_norm_as_the_replicated_step_does(runs: dict[str, Any]) -> None:
    clipped, unclipped = _checkpoint(runs["kfac 2"]), _checkpoint(runs["kfac 2 unclipped"])
    moved = max(float((clipped["model"][k] - unclipped["model"][k]).abs().max()) for k in clipped["model"])
    assert moved > 1e-6  # the bound of 0.5 binds on this run: the clipped case tests the clipping


@pytest.mark.slow
def test_a_resumed_owners_run_goes_on_as_the_run_that_did_not_stop(runs: dict[str, Any]) -> None:
    _assert_close(_checkpoint(runs["resumed"]), _checkpoint(runs["kfac 2"]), exact=False)  # owners placed anew


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_every_replica_holds_the_same_model(runs: dict[str, Any], case: str) -> None:
    summary = Path(last_line(runs[case])) / "summary.json"
    assert '"repaired_params": 0' in summary.read_text()


def _follow(rank: int, world: int) -> dict[str, Any]:
    backend = TorchBackend(DistConfig(backend="gloo"))
    torch.manual_seed(0)
    params = [torch.randn(4, 3), torch.randn(6, 2), torch.randn(5, 5)]
    shard = sharding.Sharding(params, backend, "placed")
    state: dict[torch.Tensor, dict[str, torch.Tensor]] = {}
    for i, p in enumerate(params):
        if shard.owns(p):
            state[p] = {"momentum_buffer": torch.full_like(p, float(i))}
    before = {i: shard.owner(p) for i, p in enumerate(params)}
    moved = shard.follow({id(params[0]): 1 - shard.owner(params[0]), id(params[2]): 1}, params, state)
    again = shard.follow({id(params[0]): shard.owner(params[0]), id(params[2]): 1}, params, state)
    every = shard.every_momentum(params, state)
    out = {
        "before": before,
        "after": {i: shard.owner(p) for i, p in enumerate(params)},
        "moved": moved,
        "again": again,
        "held": sorted(i for i, p in enumerate(params) if p in state),
        "every": {i: every[id(p)].clone() for i, p in enumerate(params)},
    }
    backend.close()
    return out


@pytest.mark.slow
def test_momenta_follow_their_new_owners() -> None:
    ranks = run_in_gloo(_follow, 2)
    for rank, got in enumerate(ranks):
        assert got["moved"] and not got["again"]  # a second call with the same owners moves nothing
        assert got["after"][0] == 1 - got["before"][0] and got["after"][2] == 1
        assert got["held"] == [i for i, r in got["after"].items() if r == rank]  # each momentum on its owner alone
        for i, value in got["every"].items():
            assert torch.equal(value, torch.full_like(value, float(i)))  # moved, not lost
