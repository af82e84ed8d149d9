"""The step plan: one pure function, consumed alike by the running preconditioner and the simulator."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers import run_in_gloo
from test_stage_equivalence import PROFILE, batches, make_model

from kfacflow.comm.torch_dist import TorchBackend
from kfacflow.configuration.schema import DistConfig, KFACConfig
from kfacflow.kfac import preconditioner as orchestration
from kfacflow.kfac.planning.plan import EngineCaps
from kfacflow.kfac.stages.contracts import EVERY_RANK
from kfacflow.kfac.variants import PRESETS, resolve
from kfacflow.perf import LinearModel, Profile
from kfacflow.running import build
from kfacflow.simulation.events import scaled, step_plan

NO_ROUTES = EngineCaps(reduces=False, scatters=False, gathers=False)
"""An engine without reductions to owners (Horovod's; gloo's with CUDA tensors)."""


def _profile(world: int, broadcast: LinearModel = PROFILE.broadcast) -> Profile:
    return Profile(PROFILE.allreduce, broadcast, PROFILE.inverse, meta={"world_size": world})


def _plans(rank: int, world: int, engine: str, every: int = 1, broadcast: float | None = None) -> dict[str, Any]:
    """Each preset's plan after three steps on this rank, and the simulator's for the same layers.

    ``every``: ``kfac.inv_update_freq`` (the plan weighs a step's work between inversions);
    ``broadcast``: a broadcast's seconds, whatever its size (default: the profile's).
    """
    link = PROFILE.broadcast if broadcast is None else LinearModel(broadcast, 0.0)
    backend = TorchBackend(DistConfig(device="cpu"))
    if engine == "none":
        backend.reduces = backend.scatters = backend.gathers = backend.direct = False
    out = {}
    for preset in PRESETS:
        model = make_model()
        cfg = KFACConfig(variant=preset, kl_clip=0.0, damping=0.01, inv_update_freq=every)
        pre = build.preconditioner(model, cfg, backend, _profile(world, link))
        for x, y in batches(world, rank, 3):
            F.cross_entropy(model(x), y).backward()
            pre.step(lr=0.1)
            model.zero_grad()
        rows = [
            {
                "name": layer.name,
                "a_dim": layer.a_dim,
                "g_dim": layer.g_dim,
                "params": sum(p.numel() for p in layer.params),
            }
            for layer in pre.layers
        ]
        names = resolve(cfg)
        prof = scaled(_profile(world, link).for_method(names.inverse), world)  # what simulate() plans with
        simulated = step_plan(rows, prof, world, names, EngineCaps.of(backend), pre._ready, every)
        out[preset] = (pre.plan, simulated, pre.comm.routing is not None, bool(pre.grad_owned))
        pre.remove()
    backend.close()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("engine", ["gloo", "none"])
def test_the_running_plan_is_the_simulators_for_every_preset(world: int, engine: str) -> None:
    results = run_in_gloo(_plans, world, engine, timeout=240)
    for preset in PRESETS:
        running, simulated, routed, owned = results[0][preset]
        assert running == simulated, preset
        assert all(r[preset][0] == running for r in results), f"{preset}: ranks planned differently"
        # Factors go to their owners only where the engine reduces to one rank.
        assert routed == (preset == "flow" and engine == "gloo"), preset
        # Gradients too, where owners precondition (flow): gloo sends each piece straight to its owner.
        assert owned == (preset == "flow" and engine == "gloo"), preset
    flow = results[0]["flow"][0]
    assert (flow.factor_owners is None) == (engine == "none")
    assert flow.layer_order and any(o >= 0 for o in flow.owners)


@pytest.mark.slow
def test_the_running_plan_is_the_simulators_between_inversions() -> None:
    # 10 ms a broadcast. Every step, Algorithm 1 keeps the two small layers (2 ms of work or less) on every
    # rank; between inversions their updates travel while the owners compute: every layer is owned.
    every_step = run_in_gloo(_plans, 2, "gloo", 1, 0.01, timeout=240)[0]["flow"][0]
    assert every_step.owners == (EVERY_RANK, EVERY_RANK, 0, 0, EVERY_RANK, EVERY_RANK)
    results = run_in_gloo(_plans, 2, "gloo", 10, 0.01, timeout=240)
    for preset in PRESETS:
        running, simulated, _, _ = results[0][preset]
        assert running == simulated and all(r[preset][0] == running for r in results), preset
    assert results[0]["flow"][0].owners == (1, 1, 0, 0, 1, 1)


def _given(rank: int, world: int, swap: bool) -> dict[str, Any]:
    """flow at inverses every 10 steps; ``swap``: the plan made at the end of the first step differs from the first."""
    backend = TorchBackend(DistConfig(device="cpu"))
    model = make_model()
    cfg = KFACConfig(variant="flow", kl_clip=0.0, damping=0.01, inv_update_freq=10)
    slow = _profile(world, LinearModel(1.0, 0.0))  # a second a broadcast: the link bounds every owner
    pre = build.preconditioner(model, cfg, backend, _profile(world) if swap else slow)
    first = list(pre.plan.owners)
    pre.profile = slow  # what the first step's end plans with
    for x, y in batches(world, rank, 3):
        F.cross_entropy(model(x), y).backward()
        pre.step(lr=0.1)
        model.zero_grad()
    out = {"first": first, "owners": list(pre.plan.owners), "params": [p.detach().clone() for p in model.parameters()]}
    pre.remove()
    backend.close()
    return out


@pytest.mark.slow
def test_a_plan_made_again_after_the_first_inversion_inverts_what_it_gives_a_rank() -> None:
    # The first plan gives each rank its own layers; the one made once the first step's layers are known
    # (here: with a link so slow that every layer is done by every rank) gives each rank the others' too,
    # which it did not invert on that step: it inverts them then, from the factors every rank averaged.
    swapped, planned = run_in_gloo(_given, 2, True), run_in_gloo(_given, 2, False)
    assert EVERY_RANK not in swapped[0]["first"] and swapped[0]["owners"] == [EVERY_RANK] * 6
    assert planned[0]["first"] == planned[0]["owners"] == [EVERY_RANK] * 6
    for rank in (0, 1):
        for a, b in zip(swapped[rank]["params"], planned[rank]["params"], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("preset", ["d", "mpd", "spd"])
def test_the_papers_schemes_plan_once_per_run(preset: str, monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    calls: list[int] = []
    real = orchestration.make_plan

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(orchestration, "make_plan", counted)
    model = make_model()
    pre = build.preconditioner(model, KFACConfig(variant=preset, kl_clip=0.0), TorchBackend(DistConfig()), PROFILE)
    assert len(calls) == 1
    for x, y in batches(1, 0, 5):
        F.cross_entropy(model(x), y).backward()
        pre.step(lr=0.1)
        model.zero_grad()
    assert len(calls) == 1, f"{preset} planned {len(calls) - 1} more times in 5 steps"
    assert torch.isfinite(torch.cat([p.detach().flatten() for p in model.parameters()])).all()
