"""The model as users change and call it: layouts, keyword calls, freezing, a second preconditioner, fp16."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import run_in_gloo
from test_stage_equivalence import PROFILE
from torch import Tensor, nn

import kfacflow
from kfacflow import UserError
from kfacflow.comm.torch_dist import TorchBackend
from kfacflow.configuration.schema import KFACConfig
from kfacflow.kfac.packing import unpack
from kfacflow.kfac.preconditioner import Preconditioner
from kfacflow.running import build

DT = torch.float64


def _pre(backend: TorchBackend, model: nn.Module, batch_dim: int = 0, **kw: Any) -> Preconditioner:
    cfg = KFACConfig(**{"factor_decay": 0.0, "kl_clip": 0.0, "damping": 0.01, **kw})
    return build.preconditioner(model, cfg, backend, batch_dim=batch_dim)


def _step(model: nn.Module, pre: Preconditioner, x: Tensor, y: Tensor) -> dict[str, Tensor]:
    """One K-FAC step; return the preconditioned gradients."""
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()
    pre.step(lr=0.1)
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


# --- the layout of a layer's input ------------------------------------------------------------------


class Tokens(nn.Module):
    """A Linear over the tokens of ``(N, S, E)`` inputs, applied batch-first or to ``(S, N, E)``."""

    def __init__(self, batch_first: bool, takes: str = "NSE") -> None:
        super().__init__()
        torch.manual_seed(3)
        self.fc = nn.Linear(5, 6)
        self.head = nn.Linear(6, 3)
        self.batch_first, self.takes = batch_first, takes

    def forward(self, x: Tensor) -> Tensor:
        if self.takes == "SNE":
            x = x.transpose(0, 1)  # the caller's (S, N, E): every layer below sees (N, S, E) again
        h = torch.tanh(self.fc(x) if self.batch_first else self.fc(x.transpose(0, 1)).transpose(0, 1))
        return self.head(h.mean(dim=1))


def test_g_and_the_update_do_not_depend_on_the_layout_of_a_layers_input(backend: TorchBackend) -> None:
    torch.manual_seed(0)
    x, y = torch.randn(4, 12, 5, dtype=DT), torch.randint(0, 3, (4,))  # N = 4 examples of S = 12 tokens
    seen = {}
    for batch_first in (True, False):
        model = Tokens(batch_first).to(DT)
        pre = _pre(backend, model)
        seen[batch_first] = (_step(model, pre, x, y), pre.factors)
        pre.remove()
    (grads, factors), (grads_t, factors_t) = seen[True], seen[False]
    for key in factors:
        torch.testing.assert_close(factors_t[key], factors[key], rtol=1e-12, atol=0)  # trace(G) was S/N = 3x
    for name in grads:
        torch.testing.assert_close(grads_t[name], grads[name], rtol=1e-10, atol=1e-14)


def test_batch_dim_names_the_examples_of_a_model_that_takes_sequence_first_inputs(backend: TorchBackend) -> None:
    torch.manual_seed(0)
    x, y = torch.randn(4, 12, 5, dtype=DT), torch.randint(0, 3, (4,))
    ref_model = Tokens(True).to(DT)
    ref = _step(ref_model, _pre(backend, ref_model), x, y)
    model = Tokens(True, takes="SNE").to(DT)
    got = _step(model, _pre(backend, model, batch_dim=1), x.transpose(0, 1).contiguous(), y)
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-10, atol=1e-14)


class Encoder(nn.Module):
    """A Transformer encoder layer, given its inputs in its own layout (PyTorch's default is ``(S, N, E)``)."""

    def __init__(self, batch_first: bool) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.enc = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0, batch_first=batch_first)
        self.head = nn.Linear(8, 3)
        self.batch_first = batch_first

    def forward(self, x: Tensor) -> Tensor:
        h = self.enc(x if self.batch_first else x.transpose(0, 1))
        return self.head((h if self.batch_first else h.transpose(0, 1)).mean(dim=1))  # type: ignore[no-any-return]


def test_a_transformer_layer_preconditions_the_same_whether_batch_first_or_not(backend: TorchBackend) -> None:
    torch.manual_seed(0)
    x, y = torch.randn(4, 12, 8, dtype=DT), torch.randint(0, 3, (4,))
    out = {}
    for batch_first in (True, False):
        model = Encoder(batch_first).to(DT)
        out[batch_first] = _step(model, _pre(backend, model), x, y)
    assert out[True].keys() == out[False].keys()
    for name in out[True]:
        torch.testing.assert_close(out[False][name], out[True][name], rtol=1e-9, atol=1e-13)


# --- how a layer is called ------------------------------------------------------------------------------


class Keyword(nn.Module):
    def __init__(self, keyword: bool) -> None:
        super().__init__()
        torch.manual_seed(2)
        self.fc, self.head, self.keyword = nn.Linear(4, 5), nn.Linear(5, 3), keyword

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc(input=x) if self.keyword else self.fc(x)
        return self.head(torch.tanh(h))  # type: ignore[no-any-return]


def test_a_layer_called_with_a_keyword_is_captured_as_one_called_by_position(backend: TorchBackend) -> None:
    torch.manual_seed(0)
    x, y = torch.randn(8, 4, dtype=DT), torch.randint(0, 3, (8,))
    got = {}
    for keyword in (False, True):
        model = Keyword(keyword).to(DT)
        pre = _pre(backend, model)
        got[keyword] = (_step(model, pre, x, y), pre.factors)
    assert got[True][1].keys() == got[False][1].keys() == {"fc/A", "fc/G", "head/A", "head/G"}
    for key in got[False][1]:
        assert torch.equal(got[True][1][key], got[False][1][key])
    for name in got[False][0]:
        assert torch.equal(got[True][0][name], got[False][0][name])


# --- freezing under the preconditioner --------------------------------------------------------------------


class Three(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.fc1, self.fc2, self.fc3 = nn.Linear(6, 7), nn.Linear(7, 5), nn.Linear(5, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc3(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))  # type: ignore[no-any-return]


def _copy(model: Three) -> Three:
    """The same weights and trained parameters, without the hooks a deepcopy would copy along."""
    twin = Three().to(DT)
    twin.load_state_dict(model.state_dict())
    for mine, theirs in zip(twin.parameters(), model.parameters(), strict=True):
        mine.requires_grad_(theirs.requires_grad)
    return twin


def _data(step: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(16, 6, generator=g, dtype=DT), torch.randint(0, 3, (16,), generator=g)


def test_freezing_a_layer_re_plans_and_preconditions_the_rest_as_a_fresh_preconditioner(
    backend: TorchBackend, caplog: pytest.LogCaptureFixture
) -> None:
    model = Three().to(DT)
    pre = _pre(backend, model, inv_update_freq=5, factor_update_freq=5)  # step 3 would reuse old inverses
    for step in range(3):
        _step(model, pre, *_data(step))
    model.fc1.requires_grad_(False)
    reference_model = _copy(model)  # frozen from the start, its factors of this step only
    reference = _pre(backend, reference_model)
    with caplog.at_level(logging.INFO, logger="kfacflow.kfac.preconditioner"):
        got = _step(model, pre, *_data(3))
    assert "fc1 frozen (left to the optimizer)" in caplog.text
    want = _step(reference_model, reference, *_data(3))
    assert got.keys() == want.keys() == {f"fc{i}.{p}" for i in (2, 3) for p in ("weight", "bias")}
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-12, atol=0)
    assert [layer.name for layer in pre.layers] == ["fc2", "fc3"] and set(pre.running) == set(reference.running)
    _step(model, pre, *_data(4))  # and on, with the intervals again
    pre.remove()
    reference.remove()


def test_a_frozen_bias_leaves_its_layers_a_factor_exactly(backend: TorchBackend) -> None:
    model = Three().to(DT)
    pre = _pre(backend, model, factor_decay=0.5)
    for step in range(2):
        _step(model, pre, *_data(step))
    old = unpack(pre.running["fc2/A"], 8)
    model.fc2.bias.requires_grad_(False)
    fresh_model = _copy(model)
    fresh = _pre(backend, fresh_model)
    _step(fresh_model, fresh, *_data(2))
    grads = _step(model, pre, *_data(2))
    assert "fc2.bias" not in grads and pre.factors["fc2/A"].shape == (7, 7)
    torch.testing.assert_close(pre.factors["fc2/A"], 0.5 * old[:-1, :-1] + 0.5 * fresh.factors["fc2/A"])
    model.fc2.bias.requires_grad_(True)  # trained again: its A factor restarts from this step's
    grads = _step(model, pre, *_data(3))
    assert "fc2.bias" in grads and pre.factors["fc2/A"].shape == (8, 8)


def test_freezing_refuses_what_it_cannot_follow(backend: TorchBackend) -> None:
    model = Three().to(DT)
    pre = build.preconditioner(model, KFACConfig(kl_clip=0.0), backend, accumulate=2)
    x, y = _data(0)
    F.cross_entropy(model(x), y).backward()
    model.fc1.requires_grad_(False)
    with pytest.raises(UserError, match="between the micro-batches of a step"):
        model(x)
    pre.remove()
    model = Three().to(DT)
    pre = _pre(backend, model)
    _step(model, pre, *_data(0))
    model.requires_grad_(False)
    with pytest.raises(UserError, match="every layer K-FAC preconditions is frozen"):
        model(x)


def _train_and_freeze(variant: str, rank: int, frozen: str | None) -> tuple[str, list[Tensor]]:
    """Five steps of ``variant`` on DDP; before the third, freeze ``frozen`` (None: a layer rank 1 inverts)."""
    model = Three().to(DT)
    net = nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    pre = kfacflow.KFACPreconditioner(net, variant, lr=0.1, damping=0.01, kl_clip=0.0, profile=PROFILE)
    if frozen is None:
        frozen = next(slot.layer.name for slot in pre.core.slots if slot.owner == 1)
    for step in range(5):
        if step == 2:
            getattr(model, frozen).requires_grad_(False)
        x, y = _data(10 * step + rank)
        F.cross_entropy(net(x), y).backward()
        pre.step()
        opt.step()
        opt.zero_grad()
    pre.remove()
    return frozen, [p.detach().clone() for p in model.parameters()]


def frozen_job(rank: int, world: int) -> dict[str, Any]:
    dist.init_process_group("gloo")
    frozen, flow = _train_and_freeze("flow", rank, None)  # flow: the other rank waits for the owner's update
    _, d = _train_and_freeze("d", rank, frozen)
    dist.destroy_process_group()
    return {"frozen": frozen, "flow": flow, "d": d}


@pytest.mark.slow
def test_freezing_on_two_ranks_re_plans_on_both_and_flow_still_gives_d_kfacs_parameters() -> None:
    results = run_in_gloo(frozen_job, 2, timeout=180)
    for rank in results:
        for a, b in zip(rank["flow"], rank["d"], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    for a, b in zip(results[0]["flow"], results[1]["flow"], strict=True):
        assert torch.equal(a, b)


# --- one preconditioner per model; float16 without its scaler -----------------------------------------------


def test_a_second_preconditioner_on_the_same_layers_is_refused_until_the_first_is_removed(
    backend: TorchBackend,
) -> None:
    model = Three().to(DT)
    first = _pre(backend, model)
    with pytest.raises(UserError, match="'fc1' and 2 more layers are already preconditioned by another"):
        _pre(backend, model)
    first.remove()
    _pre(backend, model).remove()


def test_float16_autocast_without_the_grad_scaler_is_said_once(
    backend: TorchBackend, caplog: pytest.LogCaptureFixture
) -> None:
    model = Three()
    pre = _pre(backend, model)
    x, y = _data(0)
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(model(x.float()), y)
            loss.backward()
            pre.step(lr=0.1)
    assert caplog.text.count("float16 autocast without a grad_scaler") == 1
