"""``kfac.normalize=rms``: each layer's preconditioned update scaled to RMS 1, the same under every variant."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from test_stage_equivalence import PROFILE, batches, make_model

import kfacflow
from kfacflow.kfac.precondition import KFACPrecondition, rms_normalized

LR = 0.05


def test_each_update_is_divided_by_its_own_root_mean_square() -> None:
    a, b = torch.tensor([[3.0, -4.0]]), torch.zeros(2, 2)
    out = rms_normalized([a, b])
    torch.testing.assert_close(out[0], a / (5.0 / 2**0.5))  # RMS of (3, -4) is 5 / sqrt(2)
    assert torch.equal(out[1], b)  # nothing to scale: left as it is, not NaN
    stage = KFACPrecondition(kl_clip=0.001, normalize="rms")
    assert not stage.clips  # the one scale KL clipping would apply is replaced
    done = stage.finish([10 * a], [], lr=1.0)
    torch.testing.assert_close(done[0], out[0])


def _train(variant: str, steps: int = 3, **kfac: Any) -> list[torch.Tensor]:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    pre = kfacflow.KFACPreconditioner(model, variant, lr=LR, damping=0.01, profile=PROFILE, **kfac)
    for x, y in batches(dist.get_world_size(), dist.get_rank(), steps):
        F.cross_entropy(model(x), y).backward()
        pre.step()
        opt.step()
        opt.zero_grad()
    pre.remove()
    return [p.detach().clone() for p in model.parameters()]


def _job(rank: int, world: int) -> dict[str, Any]:
    runs: dict[str, Any] = {v: _train(v, normalize="rms") for v in ("d", "mpd", "spd", "flow")}
    start = [p.detach().clone() for p in make_model().parameters()]
    runs["plain"] = _train("d", 1, kl_clip=0.0)
    runs["rms"] = _train("d", 1, normalize="rms")
    runs["start"] = start
    return runs
