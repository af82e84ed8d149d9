"""``kfac.normalize=rms``: each layer's preconditioned update scaled to RMS 1, the same under every variant."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import run_in_gloo
from test_stage_equivalence import PROFILE, batches, make_model

import kfacflow
from kfacflow import UserError
from kfacflow.kfac.stages.precondition import KFACPrecondition, rms_normalized

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


@pytest.mark.slow
def test_every_variant_takes_the_same_normalized_steps_on_two_ranks() -> None:
    ranks = run_in_gloo(_job, 2, timeout=300)
    for name in ranks[0]:
        for a, b in zip(ranks[0][name], ranks[1][name], strict=True):
            assert torch.equal(a, b), name  # every rank holds the same bits
    runs = ranks[0]
    for variant in ("mpd", "spd", "flow"):
        for a, b in zip(runs[variant], runs["d"], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9, msg=f"{variant} differs from d")
    # By hand, from the same first step without it: each layer (weight and bias together) moves lr x
    # the preconditioned gradient over its RMS.
    start, plain, rms = runs["start"], runs["plain"], runs["rms"]
    for layer in range(0, len(start), 2):  # (weight, bias) of each of the model's three layers
        step = torch.cat([(plain[i] - start[i]).flatten() for i in (layer, layer + 1)])
        moved = torch.cat([(rms[i] - start[i]).flatten() for i in (layer, layer + 1)])
        expected = LR * step / (step.norm() / step.numel() ** 0.5)
        torch.testing.assert_close(moved, expected, rtol=1e-6, atol=1e-9)


def test_kl_clip_set_with_normalize_is_refused() -> None:
    with pytest.raises(UserError, match=r"kl_clip=0.01 is not read with normalize=rms"):
        kfacflow.KFACPreconditioner(make_model(), "d", lr=LR, kl_clip=0.01, normalize="rms", profile=PROFILE)
