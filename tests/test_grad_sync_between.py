"""``kfac.grad_sync=between``: gradients averaged during backward on the steps that exchange no factors.

With ``kfac.factor_exchange=inversion`` most steps send nothing after their backward pass; there the
trainer lets DDP average the gradients as backward fills its buckets, and on a step that exchanges
factors it sends them behind the factors (as ``owner``). Either way every rank applies the same
averaged, preconditioned gradients, so the run is ``owner``'s to round-off.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from helpers import QUICK, run_in_gloo

STEPS = 8
STAGES = [  # owners precondition their layers and send the updates; no profile needed
    "kfac.variant=d",
    "kfac.fusion=layerwise",
    "kfac.placement=round_robin",
    "kfac.inverse=cholesky_factor",
    "kfac.broadcast=update",
    "kfac.factor_sync=owner",
    "kfac.factor_exchange=inversion",
]


def _train(rank: int, world: int, out: str, runs: dict[str, list[str]]) -> dict[str, Any]:
    """Train each run; return its parameters and, per step, who averaged its gradients (DDP, or after backward)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from kfacflow.comm.torch_dist import TorchBackend
    from kfacflow.kfac.grad_sync import GradientAllreduce
    from kfacflow.kfac.preconditioner import Preconditioner
    from kfacflow.recipe import load
    from kfacflow.trainer import Trainer

    events: list[str] = []
    hook, launch, step = default_hooks.allreduce_hook, GradientAllreduce.launch, Preconditioner.step

    def ddp_hook(state: Any, bucket: Any) -> Any:
        events.append("ddp")
        return hook(state, bucket)

    def launched(self: GradientAllreduce) -> None:
        if not self.launched:
            events.append("after")
        launch(self)

    def stepped(self: Preconditioner, *args: Any, **kwargs: Any) -> None:
        step(self, *args, **kwargs)
        events.append("|")

    default_hooks.allreduce_hook = ddp_hook  # type: ignore[assignment]
    GradientAllreduce.launch, Preconditioner.step = launched, stepped  # type: ignore[method-assign]
    results, backend = {}, None
    try:
        for name, overrides in runs.items():
            fixed = [f"out_dir={out}", f"train.steps={STEPS}", "train.progress=false", "train.dtype=float64"]
            cfg = load([QUICK], [*fixed, *STAGES, *overrides])
            backend = backend or TorchBackend(cfg.dist)
            run_dir = Path(out) / name
            run_dir.mkdir(parents=True, exist_ok=True)
            events.clear()
            trainer = Trainer.from_recipe(cfg, backend, run_dir)
            trainer.fit()
            per_step = " ".join(events).split("|")[:-1]
            results[name] = {
                "params": [p.detach().clone() for p in trainer.model.parameters()],
                "ddp": [s for s, ev in enumerate(per_step) if "ddp" in ev],
                "after": [s for s, ev in enumerate(per_step) if "after" in ev],
            }
    finally:
        default_hooks.allreduce_hook, GradientAllreduce.launch, Preconditioner.step = hook, launch, step  # type: ignore[method-assign]
        if backend is not None:
            backend.close()
    return results


def test_between_averages_in_backward_where_no_factors_travel_and_trains_as_owner(tmp_path: Path) -> None:
    f, i = 2, 4  # steps that exchange (0, 4), that update factors only (2, 6), that update none (the odd ones)
    runs = {
        gs: [f"kfac.grad_sync={gs}", f"kfac.factor_update_freq={f}", f"kfac.inv_update_freq={i}"]
        for gs in ("owner", "between")
    }
    ranks = run_in_gloo(_train, 2, str(tmp_path), runs, timeout=300)
    for got in ranks:
        owner, between = got["owner"], got["between"]
        exchanging = [s for s in range(STEPS) if s % i == 0]
        assert owner["after"] == list(range(STEPS)) and owner["ddp"] == []
        assert between["after"] == exchanging
        assert between["ddp"] == [s for s in range(STEPS) if s not in exchanging]
        for a, b in zip(between["params"], owner["params"], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    for a, b in zip(ranks[0]["between"]["params"], ranks[1]["between"]["params"], strict=True):
        assert torch.equal(a, b)  # the same averaged update on every rank
