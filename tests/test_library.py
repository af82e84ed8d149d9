"""The library API: kfacflow.KFACPreconditioner in the user's own loop, under the user's own process group."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import ROOT, free_port, run_in_gloo
from test_stage_equivalence import PROFILE, batches, make_model
from torch.nn.parallel import DistributedDataParallel

import kfacflow
from kfacflow import UserError

STEPS = 6
"""Fewer steps than the stage-equivalence test's: the model, profile and data are its own."""


def train(variant: str, ddp: bool, damping: Any = 0.01, **kfac: Any) -> list[torch.Tensor]:
    """The user's loop: their model, optimizer, data and (optionally) DDP; K-FAC through the library API."""
    model = make_model()
    if not ddp:  # each rank starts elsewhere: the preconditioner must start them from rank 0's parameters
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.1 * dist.get_rank())
    net = DistributedDataParallel(model) if ddp else model
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    pre = kfacflow.KFACPreconditioner(net, variant, lr=0.1, damping=damping, kl_clip=0.01, profile=PROFILE, **kfac)
    for x, y in batches(dist.get_world_size(), dist.get_rank(), STEPS):
        F.cross_entropy(net(x), y).backward()
        pre.step()
        opt.step()
        opt.zero_grad()
    pre.remove()
    return [p.detach().clone() for p in model.parameters()]


def late_damping(step: int) -> float:
    return 0.01 if step < 3 else 0.5


def every_other(step: int) -> int:
    return 1 if step < 2 else 2


def user_job(rank: int, world: int) -> dict[str, Any]:
    dist.init_process_group("gloo")  # the user's own group: the preconditioner joins it
    out: dict[str, Any] = {
        "d": train("d", ddp=True),
        "spd": train("spd", ddp=True),
        "flow": train("flow", ddp=False),  # no DDP: it averages the gradients itself
        "flow_ddp": train("flow", ddp=True),  # the preset's deferred gradients give way to DDP's
        "mpd_layer": train("mpd", ddp=True, placement="layer", broadcast="fused_update", skip=("0",)),
        "scheduled": train("spd", ddp=True, damping=lambda step: 0.01),
        "late": train("spd", ddp=True, damping=late_damping),
        "intervals": train("spd", ddp=True, factor_update_freq=every_other, inv_update_freq=every_other),
    }
    try:  # DDP averages the gradients: kfacflow cannot too
        kfacflow.KFACPreconditioner(DistributedDataParallel(make_model()), "spd", grad_sync="deferred", profile=PROFILE)
    except UserError as err:
        out["error"] = str(err)
    dist.barrier()  # the user's group outlives every preconditioner
    dist.destroy_process_group()
    return out


@pytest.mark.slow
def test_the_library_api_joins_the_users_job_and_gives_d_kfacs_parameters() -> None:
    results = run_in_gloo(user_job, 2, timeout=300)
    assert "grad_sync='deferred' averages gradients itself, but here DDP does" in results[0].pop("error")
    results[1].pop("error")
    ref = results[0]["d"]
    for name in ("spd", "flow", "flow_ddp", "scheduled"):
        for rank in range(2):
            for a, b in zip(results[rank][name], ref, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9, msg=f"{name} rank {rank}")
    for name in results[0]:  # every rank holds the same bits
        for a, b in zip(results[1][name], results[0][name], strict=True):
            assert torch.equal(a, b), name
    # A schedule is applied at its step: damping 0.5 from step 3 changes the result; factors and
    # inverses every other step from step 2 do too; skipping the conv layer does.
    for name in ("late", "intervals", "mpd_layer"):
        assert any((a - b).abs().max() > 1e-6 for a, b in zip(results[0][name], ref, strict=True)), name


def one_rank(**kwargs: Any) -> Callable[[], Any]:
    return lambda: kfacflow.KFACPreconditioner(make_model(), **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dampnig": 0.1}, "dampnig"),
        ({"damping": -1.0}, "damping"),
        ({"damping": "high"}, "damping"),
        ({"variant": "spdd"}, "Did you mean 'spd'"),
        ({"variant": "auto"}, "is for recipes"),
        ({"variant": "sgd"}, "is for recipes"),
        ({"placement": "lbq", "profile": PROFILE}, "Did you mean 'lbp'"),
        ({"factor_update_freq": 2, "inv_update_freq": 3}, "multiple of"),
        ({"accumulate": 0}, "accumulate"),
        ({"device": "gpu"}, "device='gpu'"),
        ({"backend": "mpi"}, "unknown backend 'mpi'"),
    ],
)
def test_a_bad_argument_is_one_clear_error(
    kwargs: dict[str, Any], message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(UserError, match=re.escape(message)):
        one_rank(**kwargs)()


def _frozen() -> torch.nn.Module:
    model = make_model()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


@pytest.mark.parametrize(
    ("model", "kwargs", "message"),
    [
        pytest.param(lambda: torch.nn.Sequential(torch.nn.ReLU()), {}, "it has no parameters", id="no-parameters"),
        pytest.param(_frozen, {}, "every parameter is frozen", id="all-frozen"),
        pytest.param(lambda: torch.nn.LayerNorm(3), {}, "no Linear or Conv2d layer", id="no-layer"),
        pytest.param(lambda: None, {}, "model is 'NoneType', not a torch.nn.Module", id="none"),
        pytest.param(lambda: list(make_model().parameters()), {}, "model is 'list'", id="parameters-not-model"),
        pytest.param(lambda: make_model().to("meta"), {}, "parameters are on meta, but", id="another-device"),
        pytest.param(make_model, {"device": "cuda"}, "torch sees no CUDA device", id="no-cuda"),
        pytest.param(make_model, {"backend": None}, "backend=None", id="backend-none"),
        pytest.param(make_model, {"grad_scaler": 2.0}, "not a torch.amp.GradScaler", id="grad-scaler"),
        pytest.param(make_model, {"accumulate": True}, "accumulate=True", id="accumulate-bool"),
        pytest.param(make_model, {"lr": "0.1"}, "lr at step 0 is '0.1'", id="lr-string"),
    ],
)
def test_a_model_or_argument_no_preconditioner_can_take_is_one_user_error(
    model: Callable[[], Any], kwargs: dict[str, Any], message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if kwargs.get("device") == "cuda" and torch.cuda.is_available():
        pytest.skip("CUDA is here: device='cuda' is no mistake")
    _one_process(monkeypatch)
    with pytest.raises(UserError, match=re.escape(message)):
        kfacflow.KFACPreconditioner(model(), "d", **kwargs)


def test_kl_clipping_needs_the_learning_rate(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    model = make_model()
    pre = kfacflow.KFACPreconditioner(model, "d")
    F.cross_entropy(model(torch.randn(4, 1, 8, 8, dtype=torch.float64)), torch.tensor([0, 1, 2, 0])).backward()
    with pytest.raises(UserError, match="step\\(lr=...\\)"):
        pre.step()
    pre.step(lr=0.1)
    assert pre.steps == 1
    pre.remove()


@pytest.mark.parametrize("kl_clip", [1e-6, 1e6, 0.0])
def test_the_mean_kl_clip_scale_is_what_scaled_the_updates(monkeypatch: pytest.MonkeyPatch, kl_clip: float) -> None:
    # A clipped update is u = s v with s = sqrt(c / (lr^2 v.g)), so s = c / (lr^2 u.g): from what the step left.
    _one_process(monkeypatch)
    model, lr = make_model(), 0.1
    pre = kfacflow.KFACPreconditioner(model, "d", lr=lr, kl_clip=kl_clip, damping=0.01)
    gen = torch.Generator().manual_seed(3)
    scales = []
    for _ in range(2):
        x, y = torch.randn(4, 1, 8, 8, generator=gen, dtype=torch.float64), torch.tensor([0, 1, 2, 0])
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
        raw = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
        pre.step()
        u_dot_g = sum(float((p.grad * g).sum()) for p, g in zip(model.parameters(), raw, strict=True))  # type: ignore[operator]
        scales.append(min(1.0, kl_clip / (lr * lr * u_dot_g)))
    measured = pre.mean_clip_scale()
    if kl_clip == 0:
        assert measured is None
    else:
        assert measured == pytest.approx(sum(scales) / 2, rel=1e-9)
        assert (measured < 0.1) if kl_clip < 1 else measured == 1.0
        assert pre.mean_clip_scale() is None  # read: the next call covers the steps after it
    pre.remove()


def _one_process(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)


def _loop(pre: kfacflow.KFACPreconditioner, model: torch.nn.Module, steps: range) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(7)
    batches = [
        (torch.randn(4, 1, 8, 8, generator=gen, dtype=torch.float64), torch.tensor([0, 1, 2, 0])) for _ in range(8)
    ]
    for step in steps:
        x, y = batches[step]
        F.cross_entropy(model(x), y).backward()
        pre.step()
        opt.step()
        opt.zero_grad()


def rare_after_two(step: int) -> int:
    return 1 if step < 2 else 4


@pytest.mark.parametrize("reload_at", [3, 4, 5])
def test_a_state_round_trip_continues_as_the_uninterrupted_loop_under_interval_schedules(
    monkeypatch: pytest.MonkeyPatch, reload_at: int
) -> None:
    """At the reloaded step the schedules say what is captured, not their values at step 0."""
    _one_process(monkeypatch)
    kw: dict[str, Any] = {"lr": 0.1, "damping": 0.01, "factor_update_freq": rare_after_two}
    kw["inv_update_freq"] = rare_after_two
    whole = make_model()
    pre = kfacflow.KFACPreconditioner(whole, "spd", profile=PROFILE, **kw)
    _loop(pre, whole, range(7))
    pre.remove()
    first = make_model()
    pre = kfacflow.KFACPreconditioner(first, "spd", profile=PROFILE, **kw)
    _loop(pre, first, range(reload_at))
    state, weights = pre.state_dict(), first.state_dict()
    pre.remove()
    again = make_model()
    again.load_state_dict(weights)
    pre = kfacflow.KFACPreconditioner(again, "spd", profile=PROFILE, **kw)
    pre.load_state_dict(state)
    _loop(pre, again, range(reload_at, 7))
    for a, b in zip(again.parameters(), whole.parameters(), strict=True):
        assert torch.equal(a, b)


def zero_at_two(step: int) -> float:
    return 0.01 if step < 2 else 0.0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"damping": zero_at_two}, "damping at step 2 is 0.0; it must be a finite number > 0"),
        ({"damping": lambda step: float("nan") if step == 2 else 0.01}, "damping at step 2 is nan"),
        ({"damping": lambda step: "0.01" if step == 2 else 0.01}, "damping at step 2 is '0.01'"),
        ({"lr": lambda step: -0.1 if step == 2 else 0.1}, "lr at step 2 is -0.1"),
        ({"lr": lambda step: float("inf") if step == 2 else 0.1}, "lr at step 2 is inf"),
        ({"factor_update_freq": lambda step: 2.5 if step == 2 else 1}, "factor_update_freq at step 2 is 2.5"),
        ({"inv_update_freq": lambda step: 0 if step == 2 else 1}, "inv_update_freq at step 2 is 0"),
        ({"damping": lambda step: True}, "damping at step 0 is True"),
    ],
)
def test_every_value_a_schedule_gives_is_checked(
    monkeypatch: pytest.MonkeyPatch, kwargs: dict[str, Any], message: str
) -> None:
    _one_process(monkeypatch)
    model = make_model()
    with pytest.raises(UserError, match=re.escape(message)):
        pre = kfacflow.KFACPreconditioner(model, "d", **{"lr": 0.1, **kwargs})
        _loop(pre, model, range(4))


@pytest.mark.slow
@pytest.mark.parametrize("args", [(), ("--variant", "flow", "--optimizer", "muon")], ids=["spd-sgd", "flow-muon"])
def test_the_example_trains_under_torchrun_with_two_workers(args: tuple[str, ...]) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port())]
    out = subprocess.run(
        [*cmd, str(ROOT / "examples" / "train_your_own.py"), "--epochs", "3", *args],
        cwd=ROOT,
        env={**env, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)},  # this checkout, installed or not
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    line = out.stdout.strip().splitlines()[-1]
    expected = "(flow, muon)" if args else "(spd, sgd)"  # K-FAC + Muon: Muon's step finished on the layers' owners
    assert line.startswith("test accuracy") and expected in line, out.stdout
    assert float(line.split()[2]) >= 0.9, line


HOROVOD_SCRIPT = """
import sys, torch, torch.nn.functional as F, horovod.torch as hvd
sys.path.insert(0, {root!r})
sys.path.insert(0, {tests!r})
import kfacflow
from test_library import STEPS
from test_stage_equivalence import PROFILE, batches, make_model

hvd.init()  # the user's job: the preconditioner joins it
for variant in ("spd", "flow"):
    model = make_model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt = hvd.DistributedOptimizer(sgd, model.named_parameters())
    pre = kfacflow.KFACPreconditioner(
        model, variant, backend="horovod", lr=0.1, damping=0.01, kl_clip=0.01, profile=PROFILE
    )
    for x, y in batches(hvd.size(), hvd.rank(), STEPS):
        F.cross_entropy(model(x), y).backward()
        opt.synchronize()
        pre.step()
        with opt.skip_synchronize():
            opt.step()
        opt.zero_grad()
    # Horovod has no reduction to one rank: flow's factors are all-reduced, every rank keeps every average.
    assert pre.core.comm.routing is None and len(pre.core.running) == len(pre.core.keys), variant
    torch.save([p.detach() for p in model.parameters()], {out!r} + f"/{{variant}}{{hvd.rank()}}.pt")
"""


def spd_with_ddp(rank: int, world: int) -> list[torch.Tensor]:
    dist.init_process_group("gloo")
    try:
        return train("spd", ddp=True)
    finally:
        dist.destroy_process_group()


@pytest.mark.horovod
@pytest.mark.skipif(
    importlib.util.find_spec("horovod") is None or shutil.which("horovodrun") is None,
    reason="Horovod is not installed (bash tools/install_horovod.sh)",
)
def test_the_library_api_under_horovod_equals_torch_distributed(tmp_path: Path) -> None:
    script = tmp_path / "mine.py"
    script.write_text(HOROVOD_SCRIPT.format(root=str(ROOT), tests=str(ROOT / "tests"), out=str(tmp_path)))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    cmd = ["horovodrun", "-np", "2", "-H", "localhost:2", "--gloo", sys.executable, str(script)]
    out = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    ref = run_in_gloo(spd_with_ddp, 2, timeout=300)[0]
    for variant in ("spd", "flow"):
        ranks = [torch.load(tmp_path / f"{variant}{r}.pt") for r in range(2)]
        for a, b, c in zip(ranks[0], ranks[1], ref, strict=True):
            assert torch.equal(a, b), variant
            torch.testing.assert_close(a, c, rtol=1e-6, atol=1e-9, msg=variant)
