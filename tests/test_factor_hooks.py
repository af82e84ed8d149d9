"""The factor hooks are on the modules on factor steps only, and taking them off changes no step."""

from __future__ import annotations

import pytest
import torch
from helpers import kfac_step
from test_norm_factors import DT, KINDS, Normed, data
from torch import nn

from kfacflow.comm.torch_dist import TorchBackend
from kfacflow.configuration.schema import KFACConfig
from kfacflow.kfac.hooks.switch import FactorHooks
from kfacflow.running import build


def hooks_on(module: nn.Module) -> int:
    return len(module._forward_pre_hooks) + len(module._forward_hooks)


def test_a_hook_set_registers_while_on_and_never_after_it_is_removed() -> None:
    linear, norm = nn.Linear(2, 2), nn.LayerNorm(2)
    calls: list[str] = []
    hooks = FactorHooks()
    hooks.add("fc", linear, pre=lambda m, a, k: calls.append("pre"), post=lambda m, a, k, o: calls.append("post"))
    hooks.add("norm", norm, post=lambda m, a, k, o: calls.append("norm"))
    assert (hooks_on(linear), hooks_on(norm), hooks.registered()) == (2, 1, 3)
    hooks.switch(False)
    assert (hooks_on(linear), hooks_on(norm), hooks.registered()) == (0, 0, 0)
    norm(linear(torch.ones(1, 2)))
    assert calls == []  # off: the modules run without them
    hooks.switch(True)
    norm(linear(torch.ones(1, 2)))
    assert calls == ["pre", "post", "norm"]
    hooks.drop({"fc"})
    hooks.switch(False)
    hooks.switch(True)
    assert (hooks_on(linear), hooks_on(norm)) == (0, 1)  # a dropped key never comes back
    hooks.remove()
    hooks.switch(False)
    hooks.switch(True)
    assert (hooks_on(linear), hooks_on(norm), hooks.registered()) == (0, 0, 0)


def run(
    backend: TorchBackend, keep_hooks: bool, monkeypatch: pytest.MonkeyPatch
) -> tuple[list[int], list[torch.Tensor]]:
    """Six steps, factors every third: the hooks on the Linear and the norm before each, and the weights after."""
    if keep_hooks:  # the old way: registered once, returning early between factor steps
        monkeypatch.setattr(FactorHooks, "switch", lambda self, on: setattr(self, "on", on))
    model = Normed().to(DT)
    cfg = KFACConfig(kinds=KINDS, factor_update_freq=3, inv_update_freq=3, damping=0.01)
    pre = build.preconditioner(model, cfg, backend)
    seen = []
    for seed in range(6):
        seen.append(hooks_on(model.fc) + hooks_on(model.norm))
        x, y = data(seed)
        kfac_step(model, pre, x, y)
        with torch.no_grad():
            for p in model.parameters():
                p.sub_(0.1 * p.grad)
    pre.remove()
    assert hooks_on(model.fc) + hooks_on(model.norm) == 0
    monkeypatch.undo()
    return seen, [p.detach().clone() for p in model.parameters()]


def test_steps_without_factors_run_without_hooks_and_step_alike(
    backend: TorchBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen, weights = run(backend, keep_hooks=False, monkeypatch=monkeypatch)
    kept, same = run(backend, keep_hooks=True, monkeypatch=monkeypatch)
    # the Linear's two hooks and the norm's one on the factor steps 0 and 3 only (kept: on every step); the first
    # step also counts the Linear's rows by two more (kfacflow.kfac.hooks.rows), taken off once none pays
    assert seen == [5, 0, 0, 3, 0, 0] and kept == [5, 3, 3, 3, 3, 3]
    for a, b in zip(weights, same, strict=True):
        assert torch.equal(a, b)  # the same kernels on the same inputs: the same bits
