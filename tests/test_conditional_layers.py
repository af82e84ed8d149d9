"""Layers that run on some ranks and not others (mixture of experts): factors stay each layer's own.

A hash-routed mixture of experts skips an expert no token goes to, as the usual MoE code does, so an
expert may run on one rank and not on the other, or on no rank at a step, or not on every rank at the
first step. Two ranks must then train exactly as one process on the double batch: a layer that did
not run on a rank adds nothing to its A (the mean of the ranks that ran it) and zero to its G (the
per-example sum the batch-mean loss defines, as one process's examples that never reach it do).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers import run_in_gloo
from torch import Tensor, nn

from kfacflow.kfac.hooks.handover import merge_orders

STEPS = int(os.environ.get("MOE_STEPS", 6))
TOKENS = 8  # per rank and step; one process takes both ranks' 16
DIM, EXPERTS, CLASSES = 5, 3, 4


class HashMoE(nn.Module):
    """Tokens routed to experts by a given route; an expert with no token is skipped (not called).

    ``backwards``: the experts run last to first (another rank's order than the others').
    """

    def __init__(self, backwards: bool = False) -> None:
        super().__init__()
        self.backwards = backwards
        self.inp = nn.Linear(DIM, DIM)
        self.experts = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(EXPERTS))
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, x: Tensor, route: Tensor) -> Tensor:
        h = torch.tanh(self.inp(x))
        out = torch.zeros_like(h)
        order = list(enumerate(self.experts))
        for e, expert in reversed(order) if self.backwards else order:
            mask = route == e
            if mask.any():
                out = out.index_put((mask.nonzero(as_tuple=True)[0],), expert(h[mask]))
        return self.head(torch.tanh(out + h))


def routes(step: int, rank: int) -> Tensor:
    """Which expert each of a rank's tokens goes to; an expert that both ranks run gets as many tokens on each.

    Rank 0 sends half its tokens to expert 0, rank 1 to expert 2, both the other half to expert 1:
    at step 0 (where the layers in use are learnt) expert 0 runs on rank 0 only and expert 2 on
    rank 1 only. At step 3 no token goes to expert 2 on any rank; at step 4 expert 1 runs on rank 1
    only (rank 0 splits its tokens between experts 0 and 2).
    """
    half = TOKENS // 2
    own = 0 if rank == 0 else 2
    if step == 3:
        return torch.tensor([0] * half + [1] * half)
    if step == 4:
        return torch.tensor([0] * half + [2] * half) if rank == 0 else torch.ones(TOKENS, dtype=torch.long)
    return torch.tensor([own] * half + [1] * half)


def batch(step: int, rank: int) -> tuple[Tensor, Tensor, Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(TOKENS, DIM, generator=gen, dtype=torch.float64)
    y = torch.randint(0, CLASSES, (TOKENS,), generator=gen)
    return x, routes(step, rank), y


def _steps(model: nn.Module, net: nn.Module, pre: Any, opt: torch.optim.Optimizer, rank: int, world: int) -> None:
    for step in range(STEPS):
        parts = [batch(step, r) for r in range(2)] if world == 1 else [batch(step, rank)]
        x, route, y = (torch.cat(t) for t in zip(*parts, strict=True))
        F.cross_entropy(model(x, route), y).backward()
        pre.step()
        opt.step()
        opt.zero_grad(set_to_none=True)


def _train(rank: int, world: int, variant: str, ddp: bool, extra: dict[str, Any]) -> dict[str, Any]:
    from kfacflow import KFACPreconditioner, UserError

    torch.manual_seed(0)
    net = HashMoE(backwards=rank == 1).double()
    model: nn.Module = nn.parallel.DistributedDataParallel(net, find_unused_parameters=True) if ddp else net
    pre = KFACPreconditioner(model, variant, lr=0.1, damping=0.01, kl_clip=0, **extra)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    try:
        _steps(model, net, pre, opt, rank, world)
    except UserError as e:
        return {"error": str(e)}
    finally:
        factors = {k: v.clone() for k, v in pre.core.factors.items()} if variant == "d" else {}
        pre.remove()
    return {"params": {k: v.detach().clone() for k, v in net.state_dict().items()}, "factors": factors}


def train(
    rank: int, world: int, cases: list[tuple[str, bool, dict[str, Any]]], gradients: bool = False
) -> dict[str, Any]:
    """Each case (variant, DDP or not, more keyword arguments) trained in turn in one process group; with
    ``gradients``, :func:`_gradients` in it first (a case that stops with an error goes last)."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:
        by_hand = _gradients() if gradients else {}
        return {"cases": [_train(rank, world, *case) for case in cases], "gradients": by_hand}
    finally:
        dist.destroy_process_group()


VARIANTS = {
    "d": {},
    "mpd": {},
    "spd": {},
    "flow": {"factor_exchange": "update"},  # inversion cannot weigh a layer some ranks skip: below
}


def _same(got: dict[str, Tensor], want: dict[str, Tensor], what: str) -> None:
    assert got.keys() == want.keys(), what
    for key, value in want.items():

        def message(m: str, key: str = key) -> str:
            return f"{what} {key}: {m}"

        torch.testing.assert_close(got[key], value, rtol=1e-9, atol=1e-12, msg=message)


CASES = [(v, ddp, extra) for ddp in (False, True) for v, extra in VARIANTS.items()]
REFUSED: tuple[str, bool, dict[str, Any]] = ("flow", False, {})
"""flow as shipped: ``kfac.factor_exchange=inversion``."""


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    """Every case, the refused one and the gradients by hand, on one 2-rank gloo group (a start-up each is 5 s)."""
    return run_in_gloo(train, 2, [*CASES, REFUSED], True, timeout=300)


@pytest.mark.slow
def test_experts_absent_on_some_ranks_train_as_one_process(two_ranks: list[dict[str, Any]]) -> None:
    """Every variant, with a plain model (kfacflow averages the gradients) and with DDP, on one gloo group each."""
    one = run_in_gloo(train, 1, [(v, False, extra) for v, extra in VARIANTS.items()])[0]["cases"]
    for rank in range(2):
        for (variant, ddp, _), got in zip(CASES, two_ranks[rank]["cases"][: len(CASES)], strict=True):
            want = one[list(VARIANTS).index(variant)]
            what = f"{variant}{' DDP' if ddp else ''} rank {rank}"
            _same(got["params"], want["params"], f"{what} parameter")
            _same(got["factors"], want["factors"], f"{what} factor")


@pytest.mark.slow
def test_exchange_at_inversion_refuses_a_layer_some_ranks_skip_on_every_rank(two_ranks: list[dict[str, Any]]) -> None:
    for result in two_ranks:
        refused = result["cases"][-1]
        assert "error" in refused, refused.keys()
        assert "'experts.0' did not run on every rank" in refused["error"]
        assert "kfac.factor_exchange=update" in refused["error"]


def test_merged_order_keeps_each_ranks_order_and_is_the_same_everywhere() -> None:
    # rank 0 ran a, e0, e1, b; rank 1 skipped e0 and ran e2 (after e1); rank 2 ran the experts backwards
    assert merge_orders([["a", "e0", "e1", "b"], ["a", "e1", "e2", "b"]]) == ["a", "e0", "e1", "e2", "b"]
    assert merge_orders([["a", "b"], ["a", "e0", "e1", "b"]]) == ["a", "e0", "e1", "b"]
    assert merge_orders([["a", "b"], ["b", "a"]]) == ["a", "b"]  # disagreement: the earliest first
    assert merge_orders([["x"], []]) == ["x"]
    assert merge_orders([]) == []


def _gradients() -> dict[str, Any]:
    """Parameters a, b, c, d: b has no gradient on rank 1, d on no rank; ToOwners sends b to rank 1 alone."""
    from kfacflow.comm.torch_dist import TorchBackend
    from kfacflow.configuration.schema import DistConfig
    from kfacflow.kfac.gradients import GradientAllreduce, ToOwners

    backend = TorchBackend(DistConfig())
    rank, out = backend.rank, {}
    for how in ("after", "in_backward"):
        params = [nn.Parameter(torch.zeros(3 + i, dtype=torch.float64)) for i in range(4)]
        for i, p in enumerate(params[:3]):
            if not (i == 1 and rank == 1):
                p.grad = torch.full_like(p, float(10 * rank + i + 1))
        if how == "after":
            sync = GradientAllreduce(backend, params)
            sync.route([[], [params[1]]])
            sync.wait()
        else:
            sending = ToOwners(backend, {id(params[1]): 1}, params)
            for p in reversed(params[:3]) if rank == 0 else params[:3]:  # another order on each rank
                if p.grad is not None:
                    sending.ready(p)
            sending.wait()
        out[how] = [None if p.grad is None else p.grad.clone() for p in params]
    backend.close()
    return out


@pytest.mark.slow
def test_a_parameter_some_ranks_have_no_gradient_of_is_averaged_over_every_rank(
    two_ranks: list[dict[str, Any]],
) -> None:
    """Zeros where a rank has none (as one process's examples that never reached it); none where no rank has one."""
    results = [r["gradients"] for r in two_ranks]
    for how in ("after", "in_backward"):
        for rank, result in enumerate(results):
            a, b, c, d = result[how]
            assert torch.equal(a, torch.full((3,), (1.0 + 11.0) / 2, dtype=torch.float64)), (how, rank)
            assert torch.equal(c, torch.full((5,), (3.0 + 13.0) / 2, dtype=torch.float64)), (how, rank)
            assert d is None, (how, rank)
            if rank == 1:  # b's owner: rank 0's gradient over both ranks, though its own had none
                assert b is not None and torch.equal(b, torch.full((4,), 2.0 / 2, dtype=torch.float64)), how
