"""A new stage in one file: each registered here alone trains a 2-worker job and is simulated.

This file is the README's "How to add a stage", proved: nothing else in the project names ``pairs``,
the gradient-sync strategy ``one_bucket``, the placement ``backwards`` (with an inversion order of
its own) or the fusion policy ``chunks`` (with a setting of its own, ``kfac.options.chunks.size``).
Each gives D-KFAC's parameters (float64), as every stage must: they change when work happens, not
the mathematics.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from helpers import ROOT, run_in_gloo

from kfacflow import UserError
from kfacflow.comm.base import Backend
from kfacflow.configuration.schema import KFACConfig, at_least
from kfacflow.kfac.gradients import GradientAllreduce
from kfacflow.kfac.stages import options
from kfacflow.kfac.stages.contracts import FusionOptions, Waiting
from kfacflow.kfac.stages.fusion import Policy, Ready, plan_launches
from kfacflow.kfac.stages.placement import round_robin, schedule
from kfacflow.kfac.strategies.grad_sync import Deferred
from kfacflow.kfac.strategies.replay import Replay
from kfacflow.perf import Profile
from kfacflow.registry import FUSIONS, GRAD_SYNCS, PLACEMENTS

sys.path.insert(0, str(ROOT / "tools"))
import simulate  # noqa: E402


class Pairs(Policy):
    """Factors all-reduced two at a time, as they come (an odd one out waits for the end of its pass)."""

    def close_group(self, waiting: Sequence[Waiting]) -> bool:
        """When two factors wait."""
        return len(waiting) == 2


if "pairs" not in FUSIONS:  # a spawned worker imports this file again
    FUSIONS.add("pairs", Pairs, "factors all-reduced two at a time (a test's own policy)")


# --- a gradient-sync strategy ---------------------------------------------------------------------


class _OneBuffer(GradientAllreduce):
    BUCKET_BYTES = 2**62  # every gradient in one all-reduce


class OneBucket(Deferred):
    """Gradients averaged after the backward pass in one all-reduce, behind the factors (not DDP's buckets)."""

    def gradients(self, backend: Backend, params: list[torch.nn.Parameter]) -> GradientAllreduce | None:
        """One buffer of every gradient."""
        return _OneBuffer(backend, params) if backend.world_size > 1 else None

    def replay(self, r: Replay) -> None:
        """One all-reduce of every parameter, after the last factor's."""
        if r.workers == 1:
            return super().replay(r)
        r.start = r.t_bwd
        r.grads_done = r.link.send(max(r.start, r.link.free), r.prof.allreduce(sum(row["params"] for row in r.rows)))
        return None


if "one_bucket" not in GRAD_SYNCS:
    GRAD_SYNCS.add("one_bucket", OneBucket(), "every gradient in one all-reduce after backward (a test's own)")


# --- a placement with an inversion order of its own --------------------------------------------


class Backwards:
    """Round robin, inverting the factors in the reverse of the shared order (the same on every rank)."""

    name = "backwards"
    calls: ClassVar[list[list[int]]] = []

    def __call__(
        self, dims: Sequence[int], sizes: Sequence[int], world_size: int, profile: Profile | None
    ) -> list[int]:
        """Round robin's owners."""
        return round_robin(dims, sizes, world_size, profile)

    def order(
        self,
        dims: Sequence[int],
        owners: Sequence[int],
        world_size: int,
        profile: Profile | None,
        ready: Sequence[float] | None,
    ) -> list[int]:
        """The shared order, reversed."""
        order = schedule(dims, owners, world_size, profile, ready)[::-1]
        Backwards.calls.append(order)
        return order


if "backwards" not in PLACEMENTS:
    PLACEMENTS.add("backwards", Backwards(), "round robin, inverted in the reverse order (a test's own)")


# --- a fusion policy with a setting of its own ---------------------------------------------------


@dataclass(frozen=True)
class ChunksOptions(options.StageOptions):
    """``kfac.options.chunks``."""

    size: int = field(default=2, metadata=at_least(1, "factors per all-reduce"))
    """Factors per all-reduce."""


class Chunks(Policy):
    """Factors all-reduced ``kfac.options.chunks.size`` at a time, as they come."""

    def close_group(self, waiting: Sequence[Waiting]) -> bool:
        """When ``size`` factors wait."""
        return len(waiting) == self.own(ChunksOptions).size


if "chunks" not in FUSIONS:
    FUSIONS.add("chunks", Chunks, "factors all-reduced size at a time (a test's own)", options=ChunksOptions)


def _train(rank: int, world: int, out: str) -> dict[str, Any]:
    from kfacflow.comm.torch_dist import TorchBackend
    from kfacflow.configuration.recipe import load
    from kfacflow.running.trainer import Trainer

    results: dict[str, Any] = {}
    backend = None
    try:
        for fusion in ("pairs", "after_backward"):
            cfg = load(
                [str(ROOT / "recipes" / "quickstart.yaml")],
                [
                    f"out_dir={out}",
                    "train.steps=3",
                    "train.progress=false",
                    "train.dtype=float64",
                    "kfac.variant=d",
                    f"kfac.fusion={fusion}",
                ],
            )
            backend = backend or TorchBackend(cfg.dist)
            run_dir = Path(out) / fusion
            run_dir.mkdir(parents=True, exist_ok=True)
            trainer = Trainer.from_recipe(cfg, backend, run_dir)
            trainer.fit()
            assert trainer.kfac is not None
            results[fusion] = {
                "params": [p.detach().clone() for p in trainer.model.parameters()],
                "launches": trainer.kfac.comm.launches,
            }
    finally:
        if backend is not None:
            backend.close()
    return results


@pytest.mark.slow
def test_a_policy_registered_in_a_test_file_trains_and_is_simulated(tmp_path: Path) -> None:
    results = run_in_gloo(_train, 2, str(tmp_path), timeout=240)
    for rank in range(2):
        pairs, reference = results[rank]["pairs"], results[rank]["after_backward"]
        # 4 layers: 4 A factors in 2 pairs, 4 G factors in 2 pairs, each of 3 steps.
        assert (pairs["launches"], reference["launches"]) == (3 * 4, 3 * 1)
        for a, b in zip(pairs["params"], reference["params"], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)  # the same mathematics

    # The simulator runs the same rule on a traced step's ready times.
    ready = [Ready(f"l{i}/A", float(i), 10) for i in range(3)]
    launches = plan_launches(Pairs(FusionOptions()), ready, 5.0, [], 6.0)
    assert launches == [(1.0, ["l0/A", "l1/A"]), (5.0, ["l2/A"])]
    runs = sorted((ROOT / "docs" / "results" / "resnet18_2x1gbit").glob("layers_d_*.json"))
    profile = ROOT / "docs" / "results" / "resnet18_2x1gbit" / "profile.yaml"
    out = tmp_path / "sim.json"
    args = [*map(str, runs), str(profile), "--workers", "2", "--variants", "pairs:local,d", "--json", str(out)]
    assert simulate.main(args) == 0

    simulated = {r["variant"]: r for r in json.loads(out.read_text())}
    assert simulated["pairs:local"]["total"] > 0
    assert simulated["pairs:local"]["FactorComm"] != simulated["d"]["FactorComm"]


NEW = {
    "one_bucket": ["kfac.variant=d", "kfac.grad_sync=one_bucket"],
    "backwards": ["kfac.variant=mpd", "kfac.placement=backwards"],
    "chunks": ["kfac.variant=d", "kfac.fusion=chunks", "kfac.options.chunks.size=4"],
    "d": ["kfac.variant=d"],
}
"""Each new stage's run, and D-KFAC's."""


def _train_new(rank: int, world: int, out: str) -> dict[str, Any]:
    from kfacflow.comm.torch_dist import TorchBackend
    from kfacflow.configuration.recipe import load
    from kfacflow.running.trainer import Trainer

    results: dict[str, Any] = {}
    backend = None
    try:
        for name, overrides in NEW.items():
            common = ["train.steps=3", "train.progress=false", "train.dtype=float64", "kfac.profile=" + PROFILE]
            cfg = load([str(ROOT / "recipes" / "quickstart.yaml")], [f"out_dir={out}", *common, *overrides])
            backend = backend or TorchBackend(cfg.dist)
            run_dir = Path(out) / name
            run_dir.mkdir(parents=True, exist_ok=True)
            Backwards.calls.clear()
            trainer = Trainer.from_recipe(cfg, backend, run_dir)
            trainer.fit()
            assert trainer.kfac is not None
            results[name] = {
                "params": [p.detach().clone() for p in trainer.model.parameters()],
                "launches": trainer.kfac.comm.launches,
                "order": [slot.key for slot in trainer.kfac.order],
                "planned": [[trainer.kfac.keys[i] for i in order] for order in Backwards.calls],
                "grad_sync": type(trainer.kfac.stages.grad_sync).__name__,
            }
    finally:
        if backend is not None:
            backend.close()
    return results


PROFILE = str(ROOT / "docs" / "results" / "resnet18_2x1gbit" / "profile.yaml")


@pytest.mark.slow
def test_a_grad_sync_a_placement_and_a_fusion_with_an_option_registered_here_train_and_simulate(
    tmp_path: Path,
) -> None:
    results = run_in_gloo(_train_new, 2, str(tmp_path), timeout=300)
    for rank in range(2):
        got = results[rank]
        assert got["one_bucket"]["grad_sync"] == "OneBucket"
        # The placement's own order is the one the running step inverts in.
        assert got["backwards"]["planned"] and got["backwards"]["order"] == got["backwards"]["planned"][-1]
        assert got["backwards"]["order"] != got["d"]["order"]
        # kfac.options.chunks.size=4: the 4 A factors in one group, the 4 G factors in another, 3 steps
        # (the default, 2, would make 4 groups a step).
        assert got["chunks"]["launches"] == 3 * 2
        for name in ("one_bucket", "backwards", "chunks"):
            for a, b in zip(got[name]["params"], got["d"]["params"], strict=True):
                torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)  # the same mathematics as D-KFAC

    runs = sorted((ROOT / "docs" / "results" / "resnet18_2x1gbit").glob("layers_d_*.json"))
    out = tmp_path / "sim.json"
    variants = "d,after_backward:local:barrier:packed:one_bucket,after_backward:backwards,chunks:local"
    args = [*map(str, runs), PROFILE, "--workers", "2", "--variants", variants, "--json", str(out)]
    assert simulate.main([*args, "--option", "chunks.size=3"]) == 0
    simulated = {r["variant"]: r for r in json.loads(out.read_text())}
    d = simulated["d"]
    # One all-reduce of every gradient behind the factors: no gradient bucket waits inside backward.
    assert simulated["after_backward:local:barrier:packed:one_bucket"]["GradComm"] < d["GradComm"]
    assert simulated["after_backward:backwards"]["InverseComm"] > 0  # its inverses travel
    assert simulated["chunks:local"]["FactorComm"] != d["FactorComm"]
    assert simulate.main([*args, "--option", "chunks.size=5"]) == 0
    assert json.loads(out.read_text())[-1]["total"] != simulated["chunks:local"]["total"]


def test_a_stage_setting_is_checked_like_a_recipe_key() -> None:
    with pytest.raises(UserError, match=r"kfac.options.chunks.size=0 must be >= 1"):
        options.check(KFACConfig(options={"chunks": {"size": 0}}))
    with pytest.raises(UserError, match=r"kfac.options.chunks: unknown key 'sise'. Did you mean: 'size'"):
        options.check(KFACConfig(options={"chunks": {"sise": 3}}))
    with pytest.raises(UserError, match=r"kfac.options.chunk: no stage .* Did you mean 'chunks'"):
        options.check(KFACConfig(options={"chunk": {"size": 3}}))
    assert options.of(FUSIONS.entry("chunks"), KFACConfig()) == ChunksOptions(size=2)
