"""What every rank holds and averages: buffers, gradients read before ``step()``, sparse gradients.

Every rank must hold the same model, parameters and buffers (BatchNorm's running statistics), after
every step and under every variant, and evaluate and save that model; where kfacflow averages the
gradients itself (a plain model in the library API), what the user's code sees of them and what
the optimizer applies must be what DDP would give. All on real gloo ranks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import QUICK, run_in_gloo
from test_stage_equivalence import PROFILE, batches, make_model
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

import kfacflow

STEPS = 3
CLIP = 0.05
"""Far below the gradients' norm: every step is clipped."""
RECIPE_PROFILE = """\
allreduce: {alpha: 1.0e-4, beta: 3.0e-8}
broadcast: {alpha: 5.0e-5, beta: 3.0e-8}
inverse: {kind: cubic, alpha: 1.0e-4, beta: 1.0e-10}
"""


def bn_cnn(num_classes: int, in_channels: int) -> nn.Module:
    """A small CNN with BatchNorm for the digits (``model.name=test_replicas:bn_cnn``)."""
    return nn.Sequential(
        nn.Conv2d(in_channels, 6, 3, padding=1, bias=False),
        nn.BatchNorm2d(6),
        nn.ReLU(),
        nn.AvgPool2d(2),
        nn.Flatten(),
        nn.Linear(6 * 16, num_classes),
    )


def _state(model: nn.Module) -> list[Tensor]:
    return [t.detach().clone() for t in model.state_dict().values()]


def _recipe_runs(rank: int, world: int, out: str) -> dict[str, Any]:
    """Train d and flow a few steps; the model after every step, and the reported validation loss."""
    from kfacflow.comm.torch_dist import TorchBackend
    from kfacflow.configuration.recipe import load
    from kfacflow.running.trainer import Trainer

    profile = Path(out) / "profile.yaml"
    if rank == 0:
        profile.write_text(RECIPE_PROFILE)
    results: dict[str, Any] = {}
    backend = None
    try:
        for variant in ("d", "flow"):
            overrides = [
                f"out_dir={out}",
                "model.name=test_replicas:bn_cnn",
                f"kfac.variant={variant}",
                f"kfac.profile={profile}",
                f"train.steps={STEPS}",
                "train.dtype=float64",
                "train.progress=false",
                "train.save=false",
            ]
            cfg = load([QUICK], overrides)
            backend = backend or TorchBackend(cfg.dist)  # one job for both runs, as a worker has
            run_dir = Path(out) / variant
            run_dir.mkdir(parents=True, exist_ok=True)
            trainer = Trainer.from_recipe(cfg, backend, run_dir)
            after: list[list[Tensor]] = []
            next_step = trainer._next_step

            def stepped(next_step: Any = next_step, trainer: Any = trainer, after: Any = after) -> None:
                next_step()
                after.append(_state(trainer.model))

            trainer._next_step = stepped  # type: ignore[method-assign]
            trainer.fit()
            results[variant] = {"after": after, "val_loss": trainer.history[-1]["val_loss"]}
    finally:
        if backend is not None:
            backend.close()
    return results


@pytest.mark.slow
def test_every_rank_holds_rank_0s_buffers_after_every_step_and_d_and_flow_report_the_same_loss(
    tmp_path: Path,
) -> None:
    ranks = run_in_gloo(_recipe_runs, 2, str(tmp_path), timeout=300)
    for variant in ("d", "flow"):
        steps = [ranks[r][variant]["after"] for r in range(2)]
        assert len(steps[0]) == STEPS
        for step, (mine, theirs) in enumerate(zip(*steps, strict=True)):
            for a, b in zip(mine, theirs, strict=True):
                assert torch.equal(a, b), f"{variant}: the ranks' models differ after step {step}"
        assert ranks[0][variant]["val_loss"] == ranks[1][variant]["val_loss"]
    # The same model, to round-off (flow's checkpoint equals d's): the same validation loss.
    assert ranks[0]["flow"]["val_loss"] == pytest.approx(ranks[0]["d"]["val_loss"], rel=1e-12)


def bn_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.AvgPool2d(2),
        nn.Flatten(),
        nn.Linear(64, 3),
    ).double()


class Bag(nn.Module):
    """Token embeddings (sparse gradients, not preconditioned) averaged, then a Linear head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(20, 4, sparse=True)
        self.head = nn.Linear(4, 3)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.head(self.embed(tokens).mean(1))  # type: ignore[no-any-return]


def image_batches(rank: int | None) -> list[tuple[Tensor, Tensor]]:
    """Rank ``rank``'s half of each step's batch on 2 ranks; ``None``: the whole double batch (one process)."""
    halves = [list(batches(2, r, STEPS)) for r in range(2)]
    if rank is not None:
        return halves[rank]
    return [(torch.cat([a[0], b[0]]), torch.cat([a[1], b[1]])) for a, b in zip(*halves, strict=True)]


def token_batches(rank: int | None) -> list[tuple[Tensor, Tensor]]:
    """As :func:`image_batches`, of token indices."""
    gen = torch.Generator().manual_seed(2)
    part = slice(0, 8) if rank is None else slice(rank * 4, (rank + 1) * 4)
    out = []
    for _ in range(STEPS):
        x, y = torch.randint(0, 20, (8, 5), generator=gen), torch.randint(0, 3, (8,), generator=gen)
        out.append((x[part], y[part]))
    return out


def clipped_loop(model: nn.Module, variant: str, ddp: bool, rank: int | None, accumulate: int = 1) -> list[Tensor]:
    """The documented loop with clipping before ``step()``: the same code whether or not DDP averages.

    With micro-batches it asks for the averages after each: the next backward pass makes them this
    rank's again, so the step's are averaged anew after the last one.
    """
    net = DistributedDataParallel(model) if ddp else model
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    pre = kfacflow.KFACPreconditioner(
        net, variant, lr=0.1, damping=0.01, kl_clip=0.01, profile=PROFILE, accumulate=accumulate
    )
    for x, y in image_batches(rank):
        for xs, ys in zip(x.chunk(accumulate), y.chunk(accumulate), strict=True):
            (F.cross_entropy(net(xs), ys) / accumulate).backward()
            pre.average_gradients()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        pre.step()
        opt.step()
        opt.zero_grad()
    pre.remove()
    return _state(model)


def sparse_loop(variant: str, rank: int | None) -> list[Tensor]:
    model = Bag().double()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    pre = kfacflow.KFACPreconditioner(model, variant, lr=0.5, damping=0.01, profile=PROFILE)
    for x, y in token_batches(rank):
        F.cross_entropy(model(x), y).backward()
        pre.step()
        opt.step()
        opt.zero_grad()
    pre.remove()
    return _state(model)


def _buffers_run(rank: int, world: int) -> list[list[Tensor]]:
    """A plain model with BatchNorm (nothing but kfacflow averages): its buffers after every step."""
    dist.init_process_group("gloo")  # the user's own job
    model = bn_model()
    pre = kfacflow.KFACPreconditioner(model, "d", lr=0.1, damping=0.01)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    after = []
    for x, y in image_batches(rank):
        F.cross_entropy(model(x), y).backward()
        pre.step()
        opt.step()
        opt.zero_grad()
        after.append([b.clone() for b in model.buffers()])
    pre.remove()
    dist.destroy_process_group()
    return after


@pytest.mark.slow
def test_the_library_gives_a_plain_model_rank_0s_buffers_after_every_step() -> None:
    ranks = run_in_gloo(_buffers_run, 2, timeout=300)
    for step, (mine, theirs) in enumerate(zip(*ranks, strict=True)):
        assert not torch.equal(mine[0], torch.zeros_like(mine[0]))  # the running mean moved
        for a, b in zip(mine, theirs, strict=True):
            assert torch.equal(a, b), f"the ranks' buffers differ after step {step}"


def _clipped_runs(rank: int, world: int) -> dict[str, list[Tensor]]:
    dist.init_process_group("gloo")
    out = {f"plain_{variant}": clipped_loop(make_model(), variant, False, rank) for variant in ("d", "flow")}
    out["ddp_d"] = clipped_loop(make_model(), "d", True, rank)
    out["micro_d"] = clipped_loop(make_model(), "d", False, rank, accumulate=2)
    dist.destroy_process_group()
    return out


@pytest.mark.slow
def test_clipping_before_step_sees_the_averaged_gradients_with_or_without_ddp(monkeypatch: pytest.MonkeyPatch) -> None:
    ranks = run_in_gloo(_clipped_runs, 2, timeout=300)
    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    alone = clipped_loop(make_model(), "d", False, None)  # one process on the double batch
    micro = clipped_loop(make_model(), "d", False, None, accumulate=2)
    for name, params in ranks[0].items():
        for a, b, c in zip(params, ranks[1][name], micro if name == "micro_d" else alone, strict=True):
            assert torch.equal(a, b), name
            torch.testing.assert_close(a, c, rtol=1e-10, atol=1e-12, msg=name)


def _sparse_runs(rank: int, world: int) -> dict[str, list[Tensor]]:
    dist.init_process_group("gloo")
    out = {variant: sparse_loop(variant, rank) for variant in ("d", "flow")}
    dist.destroy_process_group()
    return out


@pytest.mark.slow
def test_sparse_gradients_of_a_plain_model_are_averaged_as_one_process_sums_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ranks = run_in_gloo(_sparse_runs, 2, timeout=300)
    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    alone = sparse_loop("d", None)
    for name, params in ranks[0].items():
        for a, b, c in zip(params, ranks[1][name], alone, strict=True):
            assert torch.equal(a, b), name
            torch.testing.assert_close(a, c, rtol=1e-10, atol=1e-12, msg=name)
