"""``kfac.factor_exchange=inversion``: factors summed over ranks only where inverted, the same mathematics.

By hand: the decayed sums a rank keeps and the keeper's blend. On 2 gloo workers: every step's
parameters and inverses as with ``update`` (the paper's exchange at every factor update), to
float64 round-off, for a preset that all-reduces factors and for one that reduces each to its
owner; collectives only on the steps that invert; a checkpoint between exchanges settles the sums
(and training goes on as before, or resumes from it as the uninterrupted run); held rows of a reused
input buffer are those of their own step.
"""

from __future__ import annotations

import copy
from typing import Any, Literal

import pytest
import torch
from helpers import kfac_sgd_step, run_in_gloo
from test_stage_equivalence import batches, make_model

from kfacflow.comm.torch_dist import TorchBackend
from kfacflow.configuration.schema import DistConfig, KFACConfig
from kfacflow.kfac.exchange import LocalSums, Rows
from kfacflow.kfac.finite import blend
from kfacflow.kfac.stages.contracts import Absent
from kfacflow.kfac.stages.factors import gram_packed
from kfacflow.running import build

XI = 0.75


def _tensor(t: torch.Tensor | Absent) -> torch.Tensor:
    assert isinstance(t, torch.Tensor), "every rank here has every factor"
    return t


def test_local_sums_by_hand() -> None:
    sent: list[tuple[str, torch.Tensor]] = []
    exchanging = [True]
    sums = LocalSums(lambda: XI, lambda key, t: sent.append((key, _tensor(t))), lambda: exchanging[0])
    f = [torch.tensor([float(2**i)], dtype=torch.float64) for i in range(5)]
    sums.push("a", f[0])  # the first step exchanges; no average yet: the factor whole
    assert sent[-1][0] == "a" and torch.equal(sent[-1][1], f[0]) and sums.sent == {"a": 1}
    running: dict[str, torch.Tensor] = {}
    sums.blend(running, "a", sent[-1][1], torch.tensor(True))
    sums.exchanged()
    assert torch.equal(running["a"], f[0]) and sums.started == {"a"} and not sums.sums
    exchanging[0] = False
    for factor in f[1:4]:
        sums.push("a", factor)
        sums.commit()
    assert len(sent) == 1 and sums.sums["a"].k == 3
    sums.push("a", f[4])  # E = (1 - xi) (xi^3 f1 + xi^2 f2 + xi f3 + f4), four updates
    sums.drop()  # ... but the step is skipped: its factor is forgotten, the sum stays
    assert sums.sums["a"].k == 3
    exchanging[0] = True
    sums.push("a", f[4])
    mean = sent[-1][1]
    expected = (1 - XI) * (XI**3 * f[1] + XI**2 * f[2] + XI * f[3] + f[4])
    torch.testing.assert_close(mean, expected, rtol=1e-15, atol=0)
    sums.blend(running, "a", mean, torch.tensor(True))
    sums.exchanged()
    paper = {"a": f[0].clone()}  # four blends of the paper's running average
    for factor in f[1:]:
        blend(paper, "a", factor, torch.tensor(True), XI)
    torch.testing.assert_close(running["a"], paper["a"], rtol=1e-15, atol=0)
    before = running["a"].clone()
    sums.push("a", f[1])
    sums.blend(running, "a", torch.tensor([float("nan")], dtype=torch.float64), torch.tensor(False))
    assert torch.equal(running["a"], before)  # a non-finite period is left out


def test_rows_held_between_exchanges_are_the_factors_they_make() -> None:
    gen = torch.Generator().manual_seed(0)
    blocks = [torch.randn(3, 8, generator=gen, dtype=torch.float64) for _ in range(4)]
    sent: dict[str, list[torch.Tensor]] = {"rows": [], "packed": []}
    exchanging = [False]
    as_rows = LocalSums(lambda: XI, lambda k, t: sent["rows"].append(_tensor(t)), lambda: exchanging[0], started={"a"})
    as_packed = LocalSums(
        lambda: XI, lambda k, t: sent["packed"].append(_tensor(t)), lambda: exchanging[0], started={"a"}
    )
    assert as_rows.takes_rows("a", 4, 8) and not as_rows.takes_rows("a", 5, 8)  # at most half the width
    for i, r in enumerate(blocks):
        exchanging[0] = i == len(blocks) - 1
        if as_rows.takes_rows("a", 3, 8):
            as_rows.push("a", Rows(r, 0.5))
        else:
            as_rows.push("a", gram_packed(r).mul_(0.5))
        as_packed.push("a", gram_packed(r).mul_(0.5))
        if not exchanging[0]:
            as_rows.commit()
            as_packed.commit()
        if i in (1, 2):  # 3 rows held; 3 more would be past half the width, so they come multiplied out
            held = as_rows.sums["a"]
            assert [b.shape[0] for b, _ in held.blocks] == [3] and held.total is not None and held.k == i + 1
    torch.testing.assert_close(sent["rows"][0], sent["packed"][0], rtol=1e-14, atol=1e-15)
    assert as_rows.sent == as_packed.sent == {"a": 4}
    # More rows than half the width handed over after all (the batch grew): multiplied out at the commit.
    exchanging[0] = False
    as_rows.exchanged()
    as_rows.push("a", Rows(torch.cat(blocks[:2]), 1.0))
    as_rows.commit()
    held = as_rows.sums["a"]
    assert not held.blocks and held.k == 1
    torch.testing.assert_close(held.total, gram_packed(torch.cat(blocks[:2])) * (1 - XI), rtol=1e-14, atol=1e-15)


STEPS = 10


def _run(
    backend: TorchBackend, variant: dict[str, Any], exchange: Literal["update", "inversion"], intervals: tuple[int, int]
) -> dict[str, Any]:
    """Train the test model; after each step its parameters and the launches so far; a checkpoint at step 4."""
    f, i = intervals
    cfg = KFACConfig(
        **variant, damping=0.01, kl_clip=0.01, factor_update_freq=f, inv_update_freq=i, factor_exchange=exchange
    )
    model = make_model()
    net = backend.wrap_model(model)
    pre = build.preconditioner(model, cfg, backend, None)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    steps, state = [], None
    for step, (x, y) in enumerate(batches(backend.world_size, backend.rank, STEPS)):
        kfac_sgd_step(net, pre, opt, x, y)
        steps.append({"params": [p.detach().clone() for p in model.parameters()], "launches": pre.comm.launches})
        if step == 4:
            state = copy.deepcopy(pre.state_dict())  # collective; between exchanges with ``inversion``
    final = pre.state_dict()
    pre.remove()
    return {"steps": steps, "mid": state, "final": final}


VARIANTS: dict[str, dict[str, Any]] = {
    "d": {"fusion": "after_backward", "placement": "local", "inverse": "cholesky"},
    "owners": {
        "fusion": "layerwise",
        "placement": "round_robin",
        "inverse": "cholesky_factor",
        "broadcast": "update",
        "factor_sync": "owner",
    },
}


def _gloo_body(rank: int, world: int) -> dict[tuple[str, str, tuple[int, int]], Any]:
    backend = TorchBackend(DistConfig(device="cpu"))
    try:
        return {
            (name, exchange, intervals): _run(backend, variant, exchange, intervals)
            for name, variant in VARIANTS.items()
            for intervals in ((1, 3), (2, 4))
            for exchange in ("update", "inversion")
        }
    finally:
        backend.close()


def _launched(run: dict[str, Any]) -> list[int]:
    """The steps at which the communicator launched a collective."""
    counts = [0] + [step["launches"] for step in run["steps"]]
    return [s for s in range(STEPS) if counts[s + 1] > counts[s]]


def _close(a: Any, b: Any, what: str) -> None:
    torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=what)


@pytest.mark.slow
def test_exchanging_only_to_invert_trains_as_every_update_does_on_two_workers() -> None:
    ranks = run_in_gloo(_gloo_body, 2, timeout=300)
    for name in VARIANTS:
        for f, i in ((1, 3), (2, 4)):
            paper, ours = ranks[0][(name, "update", (f, i))], ranks[0][(name, "inversion", (f, i))]
            for step, (a, b) in enumerate(zip(paper["steps"], ours["steps"], strict=True)):
                _close(b["params"], a["params"], f"{name} {f}/{i} step {step}")
            for state in ("mid", "final"):
                _close(ours[state]["factors"], paper[state]["factors"], f"{name} {f}/{i} {state} factors")
                ours_inv, paper_inv = (
                    {k: ts for k, (_, ts) in run[state]["inverses"].items()} for run in (ours, paper)
                )
                _close(ours_inv, paper_inv, f"{name} {f}/{i} {state} inverses")
            # Launches only where the step inverts (the checkpoint's one all-reduce is not the communicator's),
            # where the paper launches at every factor update.
            assert _launched(ours) == [s for s in range(STEPS) if s % i == 0], (name, f, i)
            assert _launched(paper) == [s for s in range(STEPS) if s % f == 0], (name, f, i)
            other = ranks[1][(name, "inversion", (f, i))]
            for a, b in zip(ours["steps"][-1]["params"], other["steps"][-1]["params"], strict=True):
                assert torch.equal(a, b), f"{name}: the ranks differ"


def _reused_buffer_body(rank: int, world: int) -> dict[str, list[torch.Tensor]]:
    backend = TorchBackend(DistConfig(device="cpu"))
    try:
        out = {}
        for exchange in ("update", "inversion"):
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(8, 3, bias=False)).double()  # A: the input itself, held
            cfg = KFACConfig(variant="d", damping=0.01, inv_update_freq=4, factor_exchange=exchange)
            pre = build.preconditioner(model, cfg, backend, None)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            gen = torch.Generator().manual_seed(1)
            x = torch.empty(4, 8, dtype=torch.float64)  # one input buffer, refilled in place every step
            for _ in range(9):
                x.copy_(torch.randn(4, 8, generator=gen, dtype=torch.float64))
                kfac_sgd_step(model, pre, opt, x, torch.randint(0, 3, (4,), generator=gen))
            pre.remove()
            out[exchange] = [p.detach().clone() for p in model.parameters()]
        return out
    finally:
        backend.close()


@pytest.mark.slow
def test_rows_held_from_a_reused_input_buffer_are_the_ones_of_their_step() -> None:
    (run,) = run_in_gloo(_reused_buffer_body, 1, timeout=120)
    _close(run["inversion"], run["update"], "a Linear fed from one buffer")


def _resume_body(rank: int, world: int) -> dict[str, list[torch.Tensor]]:
    backend = TorchBackend(DistConfig(device="cpu"))
    cfg = dict(**VARIANTS["owners"], damping=0.01, kl_clip=0.01, inv_update_freq=4, factor_exchange="inversion")
    data = list(batches(world, rank, 9))

    def start() -> tuple[torch.nn.Module, Any, torch.optim.Optimizer]:
        model = make_model()
        return (
            model,
            build.preconditioner(model, KFACConfig(**cfg), backend, None),
            torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        )

    try:
        model, pre, opt = start()
        for x, y in data:
            kfac_sgd_step(backend.wrap_model(model), pre, opt, x, y)
        pre.remove()
        whole = [p.detach().clone() for p in model.parameters()]
        model, pre, opt = start()
        for x, y in data[:6]:  # stopped two steps after an exchange: sums held on every rank
            kfac_sgd_step(backend.wrap_model(model), pre, opt, x, y)
        saved = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict(), "kfac": pre.state_dict()})
        pre.remove()
        model, pre, opt = start()
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        pre.load_state_dict(saved["kfac"])
        for x, y in data[6:]:
            kfac_sgd_step(backend.wrap_model(model), pre, opt, x, y)
        pre.remove()
        return {"whole": whole, "resumed": [p.detach().clone() for p in model.parameters()]}
    finally:
        backend.close()


@pytest.mark.slow
def test_a_checkpoint_between_exchanges_resumes_as_the_uninterrupted_run() -> None:
    for run in run_in_gloo(_resume_body, 2, timeout=120):
        _close(run["resumed"], run["whole"], "resumed between exchanges")
