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
    from kfacflow.configuration.recipe import load
    from kfacflow.kfac.gradients import GradientAllreduce
    from kfacflow.kfac.preconditioner import Preconditioner
    from kfacflow.running.trainer import Trainer

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


PROFILE = """\
allreduce: {alpha: 1.0e-4, beta: 3.0e-8}
broadcast: {alpha: 5.0e-5, beta: 3.0e-8}
inverse: {kind: cubic, alpha: 1.0e-4, beta: 1.0e-10}
"""


def _route(rank: int, world: int, out: str, runs: dict[str, list[str]]) -> dict[str, Any]:
    """Train each run with a profile (so the plan may route gradients); note, per step, what went to owners."""
    from kfacflow.comm.torch_dist import TorchBackend
    from kfacflow.configuration.recipe import load
    from kfacflow.kfac.gradients import EVERY_RANK, GradientAllreduce, ToOwners
    from kfacflow.kfac.preconditioner import Preconditioner
    from kfacflow.running.trainer import Trainer

    events: list[str] = []
    sent: list[int] = []
    post, launch, step = ToOwners._post, GradientAllreduce.launch, Preconditioner.step

    def posted(self: ToOwners, key: int) -> None:
        events.append("in-backward-to-owner" if key != EVERY_RANK else "in-backward-allreduce")
        sent.append(sum(p.numel() for p in self.pending[key][0]))
        post(self, key)

    def launched(self: GradientAllreduce) -> None:
        if not self.launched:
            events.append("after-routed" if any(self.owned) else "after")
        launch(self)

    def stepped(self: Preconditioner, *args: Any, **kwargs: Any) -> None:
        step(self, *args, **kwargs)
        events.append("|")

    ToOwners._post, GradientAllreduce.launch, Preconditioner.step = posted, launched, stepped  # type: ignore[method-assign]
    profile = Path(out) / "profile.yaml"
    profile.write_text(PROFILE)
    results, backend = {}, None
    try:
        for name, overrides in runs.items():
            fixed = [f"out_dir={out}", f"train.steps={STEPS}", "train.progress=false", "train.dtype=float64"]
            # Whole layers to the least-loaded rank, from the profile (round robin plans without one).
            planned = [*STAGES, "kfac.placement=layer", f"kfac.profile={profile}"]
            cfg = load([QUICK], [*fixed, *planned, *overrides])
            backend = backend or TorchBackend(cfg.dist)
            run_dir = Path(out) / name
            run_dir.mkdir(parents=True, exist_ok=True)
            events.clear()
            sent.clear()
            trainer = Trainer.from_recipe(cfg, backend, run_dir)
            trainer.fit()
            assert trainer.kfac is not None
            results[name] = {
                "sent": sum(sent),
                "rebuilt": sum(p.numel() for p in trainer.kfac.rebuilt()),
                "params": [p.detach().clone() for p in trainer.model.parameters()],
                "steps": [set(ev.split()) for ev in " ".join(events).split("|")[:-1]],
                "routed": [len(ps) for ps in trainer.kfac.grad_owned],
                "direct": backend.direct,
            }
    finally:
        ToOwners._post, GradientAllreduce.launch, Preconditioner.step = post, launch, step  # type: ignore[method-assign]
        if backend is not None:
            backend.close()
    return results


def test_gloo_sends_owned_gradients_to_their_owners_at_two_ranks_during_backward_between_exchanges(
    tmp_path: Path,
) -> None:
    """At P = 2 gloo sends each piece straight to its owner (half an all-reduce's bytes): the plan routes.

    ``owner`` then reduces the owned layers' gradients to their owners after every backward pass;
    ``between`` does so on the steps that exchange factors and, on the others, sends them during the
    backward pass (:class:`~kfacflow.kfac.strategies.grad_sync.InBackward`). Both train as ``deferred`` (every
    gradient all-reduced after the backward pass) to round-off, every rank with the same bits.
    """
    f, i = 2, 4
    runs = {
        gs: [f"kfac.grad_sync={gs}", f"kfac.factor_update_freq={f}", f"kfac.inv_update_freq={i}"]
        for gs in ("deferred", "owner", "between")
    }
    # With rows, the layers that go by them send no gradients at all: the step rebuilds their averages
    # (fc1, 513 wide, from 2 x 8 rows a step).
    rows = ["kfac.precondition=rows", "data.batch_size=8"]
    runs |= {f"{gs}+rows": [*runs[gs], *rows] for gs in ("deferred", "between")}
    runs["between+8"] = [*runs["between"], "data.batch_size=8"]
    ranks = run_in_gloo(_route, 2, str(tmp_path), runs, timeout=300)
    for got in ranks:
        deferred, owner, between = got["deferred"], got["owner"], got["between"]
        assert owner["direct"] and deferred["routed"] == [] and owner["routed"] == between["routed"]
        assert len(owner["routed"]) == 2 and all(owner["routed"]), owner["routed"]
        # The first step routes nothing (the plan is made again once the layers in use are known).
        assert owner["steps"][0] == {"after"} and all(s == {"after-routed"} for s in owner["steps"][1:])
        exchanging = [s for s in range(STEPS) if s % i == 0]
        for s, ev in enumerate(between["steps"]):
            if s == 0:
                assert ev == {"after"}, ev  # an exchanging step, not routed yet
            elif s in exchanging:
                assert ev == {"after-routed"}, (s, ev)
            else:
                assert "in-backward-to-owner" in ev and not ev & {"after", "after-routed"}, (s, ev)
        for run in (owner, between):
            for a, b in zip(run["params"], deferred["params"], strict=True):
                torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
        rows, plain = got["between+rows"], got["between+8"]
        assert rows["rebuilt"] > 0 and plain["rebuilt"] == 0
        in_backward = len([s for s in range(1, STEPS) if s not in exchanging])  # rows are chosen on step 0
        assert rows["sent"] == plain["sent"] - in_backward * rows["rebuilt"] > 0
        for a, b in zip(rows["params"], got["deferred+rows"]["params"], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    for run in ("owner", "between", "between+rows"):
        for a, b in zip(ranks[0][run]["params"], ranks[1][run]["params"], strict=True):
            assert torch.equal(a, b)  # every rank applies the owners' updates
