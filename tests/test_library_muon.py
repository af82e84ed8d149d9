"""K-FAC + Muon in the user's own loop: ``kfacflow.muon`` and ``KFACPreconditioner.finish_muon``.

On 2 real gloo ranks (float64): Muon's step taken by the K-FAC layers' owners gives the replicated
K-FAC + Muon's model step for step, with and without the norm clip, every rank the same bits; the
optimizer's state gathers every momentum; ``remove()`` gives every rank every momentum back and the
Muon steps on alone as the replicated one. On one process, the mistakes are one UserError each.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import run_in_gloo
from test_stage_equivalence import batches, make_model
from torch.nn.parallel import DistributedDataParallel

import kfacflow
from kfacflow import UserError
from kfacflow.optim.muon import Muon

STEPS = 6


def loop(owners: bool, clip: float, ddp: bool = False) -> dict[str, Any]:
    """The user's loop: K-FAC (flow) preconditions, Muon steps; ``owners``: finished on the layers' owners."""
    model = make_model()
    net = DistributedDataParallel(model) if ddp else model
    optimizer = kfacflow.muon(net, lr=0.05, momentum=0.9, adamw_lr=0.01, head=True)
    pre = kfacflow.KFACPreconditioner(
        net, "flow", lr=0.05, damping=0.01, kl_clip=0.01, inv_update_freq=2, placement="round_robin"
    )
    if owners:
        pre.finish_muon(optimizer, clip_grad_norm=clip)
    for step, (x, y) in enumerate(batches(dist.get_world_size(), dist.get_rank(), STEPS)):
        F.cross_entropy(net(x), y).backward()
        pre.step()
        if not owners and clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad()
        if step == STEPS // 2:
            state = optimizer.state_dict()["state"]  # collective where sharded: on every rank
            held = {i: s["momentum_buffer"].clone() for i, s in state.items() if "momentum_buffer" in s}
    sharded = optimizer.sharding is not None
    pre.remove()  # the owners go: every rank holds every momentum again
    x, y = next(batches(dist.get_world_size(), dist.get_rank(), 1))
    F.cross_entropy(model(x), y).backward()  # the Muon alone, after the preconditioner, on the averages
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()
    optimizer.step()
    return {"params": [p.detach().clone() for p in model.parameters()], "momenta": held, "sharded": sharded}


def user_job(rank: int, world: int) -> dict[str, Any]:
    dist.init_process_group("gloo")
    try:
        return {
            "replicated": loop(owners=False, clip=0.0),
            "owners": loop(owners=True, clip=0.0),
            "replicated clipped": loop(owners=False, clip=0.05),
            "owners clipped": loop(owners=True, clip=0.05),
            "owners ddp": loop(owners=True, clip=0.0, ddp=True),
        }
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_owners_steps_in_the_users_loop_are_the_replicated_kfac_muon_steps() -> None:
    results = run_in_gloo(user_job, 2, timeout=300)
    for rank in range(2):
        run = results[rank]
        assert run["owners"]["sharded"] and not run["replicated"]["sharded"]
        for owners, replicated in [("owners", "replicated"), ("owners clipped", "replicated clipped")]:
            for a, b in zip(run[owners]["params"], run[replicated]["params"], strict=True):
                torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12, msg=f"{owners} rank {rank}")
            momenta, expected = run[owners]["momenta"], run[replicated]["momenta"]
            assert momenta.keys() == expected.keys() and momenta  # every momentum, though each lived on one owner
            for i, m in momenta.items():
                torch.testing.assert_close(m, expected[i], rtol=1e-9, atol=1e-12)
        for a, b in zip(run["owners ddp"]["params"], run["replicated"]["params"], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12, msg=f"ddp rank {rank}")
    for case in results[0]:  # every rank holds the same bits
        for a, b in zip(results[0][case]["params"], results[1][case]["params"], strict=True):
            assert torch.equal(a, b), case
    clipped, unclipped = results[0]["owners clipped"]["params"], results[0]["owners"]["params"]
    assert max(float((a - b).abs().max()) for a, b in zip(clipped, unclipped, strict=True)) > 1e-6  # it binds


def test_on_one_process_the_norm_is_clipped_by_step() -> None:
    def run(finish: bool) -> list[torch.Tensor]:
        model = make_model()
        optimizer = kfacflow.muon(model, lr=0.05)
        pre = kfacflow.KFACPreconditioner(model, "flow", lr=0.05, damping=0.01, kl_clip=0.01)
        if finish:
            pre.finish_muon(optimizer, clip_grad_norm=0.05)
        x, y = next(batches(1, 0, 1))
        F.cross_entropy(model(x), y).backward()
        pre.step()
        if not finish:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        pre.remove()
        return grads

    for a, b in zip(run(True), run(False), strict=True):
        assert torch.equal(a, b)


def test_kfacflow_muon_is_the_recipes_muon() -> None:
    model = make_model()
    optimizer = kfacflow.muon(model, lr=0.03, momentum=0.8, nesterov=False, weight_decay=0.1, adamw_lr=0.002)
    assert isinstance(optimizer, Muon)
    muon_group, adamw_group = optimizer.param_groups
    assert muon_group["muon"] and (muon_group["lr"], muon_group["momentum"]) == (0.03, 0.8)
    assert not muon_group["nesterov"] and muon_group["weight_decay"] == 0.1
    assert not adamw_group["muon"] and adamw_group["lr"] == 0.002
    assert any(p is model[-1].weight for p in adamw_group["params"])  # the head is AdamW's by default


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"momentm": 0.9}, "Did you mean 'momentum'"),
        ({"momentum": 1.5}, "momentum"),
        ({"ns_dtype": "half"}, "ns_dtype"),
        ({"owners": "kfac"}, "precond.finish_muon(optimizer)"),
        ({"clip_grad_norm": 1.0}, "clip_grad_norm=..."),
        ({"lr": -1.0}, "lr"),
    ],
)
def test_a_bad_muon_keyword_is_one_clear_error(keys: dict[str, Any], message: str) -> None:
    with pytest.raises(UserError, match="kfacflow.muon") as err:
        kfacflow.muon(make_model(), **keys)
    assert message in str(err.value)


@pytest.mark.parametrize(
    ("variant", "optimizer", "clip", "message"),
    [
        ("spd", "muon", 0.0, "broadcast is"),
        ("flow", "sgd", 0.0, "give kfacflow.muon(model, ...)'s"),
        ("flow", "other", 0.0, "not this preconditioner's model's"),
        ("flow", "muon", -1.0, "clip_grad_norm=-1.0"),
        ("flow", "muon", float("nan"), "clip_grad_norm=nan"),
    ],
)
def test_finish_muon_refuses_what_it_cannot_finish(variant: str, optimizer: str, clip: float, message: str) -> None:
    model = make_model()
    opts = {
        "muon": lambda: kfacflow.muon(model),
        "sgd": lambda: torch.optim.SGD(model.parameters(), lr=0.1),
        "other": lambda: kfacflow.muon(make_model()),
    }
    pre = kfacflow.KFACPreconditioner(model, variant, lr=0.05)
    try:
        with pytest.raises(UserError, match="finish_muon") as err:
            pre.finish_muon(opts[optimizer](), clip_grad_norm=clip)
        assert message in str(err.value)
    finally:
        pre.remove()
