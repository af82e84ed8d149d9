"""The step plan: one pure function, consumed alike by the running preconditioner and the simulator."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers import run_in_gloo
from test_stage_equivalence import PROFILE, batches, make_model

from kfacflow import build
from kfacflow.comm.torch_dist import TorchBackend
from kfacflow.config import DistConfig, KFACConfig
from kfacflow.kfac import preconditioner as orchestration
from kfacflow.kfac.plan import EngineCaps
from kfacflow.kfac.variants import PRESETS, resolve
from kfacflow.perf import Profile
from kfacflow.simulation import scaled, step_plan

NO_ROUTES = EngineCaps(reduces=False, scatters=False, gathers=False)
"""An engine without reductions to owners (Horovod's; gloo's with CUDA tensors)."""


def _profile(world: int) -> Profile:
    return Profile(PROFILE.allreduce, PROFILE.broadcast, PROFILE.inverse, meta={"world_size": world})


def _plans(rank: int, world: int, engine: str) -> dict[str, Any]:
    """Each preset's plan after three steps on this rank, and the simulator's for the same layers."""
    backend = TorchBackend(DistConfig(device="cpu"))
    if engine == "none":
        backend.reduces = backend.scatters = backend.gathers = backend.direct = False
    out = {}
    for preset in PRESETS:
        model = make_model()
        cfg = KFACConfig(variant=preset, kl_clip=0.0, damping=0.01)
        pre = build.preconditioner(model, cfg, backend, _profile(world))
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
        prof = scaled(_profile(world).for_method(names.inverse), world)  # what simulate() plans with
        simulated = step_plan(rows, prof, world, names, EngineCaps.of(backend), pre._ready)
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
