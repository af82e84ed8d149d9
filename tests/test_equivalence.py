"""P workers with per-worker batch b train exactly like 1 worker with batch P*b (float64).

End to end through ``run.py`` (self-launched gloo workers, checkpoints compared), and inside a
real 2-process gloo group with the preconditioner driven by hand (different data per rank).
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import last_line, run_cli, run_cli_batch, run_in_gloo
from torch import nn

from kfacflow.comm.torch_dist import TorchBackend
from kfacflow.configuration.schema import DistConfig, KFACConfig
from kfacflow.kfac.stages.inverse import Inverse
from kfacflow.kfac.variants import PRESETS
from kfacflow.models.builtin import build_model
from kfacflow.running import build

RTOL, ATOL = 1e-8, 1e-12
STEPS = 5
BATCH = 8  # per worker with 2 workers; the single worker gets 2 * BATCH

CASES: dict[str, list[str]] = {
    "cholesky": [],
    "eigen": ["kfac.inverse=eigen"],
    "reduce": ["kfac.factor=reduce"],
    "sgd": ["kfac.variant=sgd"],
    "flow": ["kfac.variant=flow"],
    "auto": ["kfac.variant=auto"],
}
KINDS = {"eigen": "eigen", "flow": "cholesky_factor"}
"""The inverse kind each case stores (``dense`` if not named; ``auto`` stores its choice's)."""


def _common(out_dir: Path) -> list[str]:
    return [
        "recipes/quickstart.yaml",
        f"train.steps={STEPS}",
        "train.dtype=float64",
        f"train.checkpoint_every={STEPS}",
        f"out_dir={out_dir}",
        "train.progress=false",
    ]


def _sizes(nproc: int) -> list[str]:
    if nproc == 1:
        # One intra-op thread: like each of the 2 workers, and much faster on a busy 2-core machine.
        return ["launch.nproc=1", "launch.threads=1", f"data.batch_size={2 * BATCH}"]
    return ["launch.nproc=2", f"data.batch_size={BATCH}"]


def _launch(out_dir: Path, nproc: int, extra: list[str]) -> subprocess.CompletedProcess[str]:
    return run_cli(*_common(out_dir), *_sizes(nproc), *extra)


@pytest.fixture(scope="module")
def equivalence_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, int], Any]:
    """Every case with 2 workers, launched two at a time (each launch is mostly idle), beside every case with 1
    worker, one after another in one interpreter (each alone would be mostly start-up)."""
    jobs = {(case, nproc): tmp_path_factory.mktemp(f"eq-{case}-{nproc}") for case in CASES for nproc in (2, 1)}
    ones = [[*_common(jobs[(case, 1)]), *_sizes(1), *extra] for case, extra in CASES.items()]
    with ThreadPoolExecutor(max_workers=3) as pool:
        alone = pool.submit(run_cli_batch, ones)
        futures = {case: pool.submit(_launch, jobs[(case, 2)], 2, extra) for case, extra in CASES.items()}
        runs = {(case, 2): fut.result() for case, fut in futures.items()}
        return {**runs, **{(case, 1): proc for case, proc in zip(CASES, alone.result(), strict=True)}}


def _final_checkpoint(proc: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert proc.returncode == 0, f"run failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    run_dir = Path(last_line(proc))
    path = run_dir / "checkpoints" / f"step_{STEPS:08d}.pt"
    assert path.is_file(), sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    state: dict[str, Any] = torch.load(path, map_location="cpu", weights_only=False)
    return state


def _prefixed(text: str) -> Callable[[str], str]:
    """An ``assert_close`` message that puts ``text`` before torch's own."""
    return lambda m: f"{text}: {m}"


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str) -> None:
    assert a.keys() == b.keys(), what
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=RTOL, atol=ATOL, msg=_prefixed(f"{what} {key}"))


def _dense_inverses(kfac_state: dict[str, Any]) -> dict[str, torch.Tensor]:
    # Eigenvectors of (nearly) repeated eigenvalues, e.g. the null space of a low-rank factor,
    # are not unique: compare the inverse itself, which is.
    return {k: Inverse.restore(kind, ts).dense() for k, (kind, ts) in kfac_state["inverses"].items()}


def _initial_params() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)  # the trainer seeds with train.seed=0, then builds the model
    return {k: v.double() for k, v in build_model("digits_cnn", 10, 1).state_dict().items()}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_two_workers_equal_one_worker_with_double_batch(
    case: str, equivalence_runs: dict[tuple[str, int], Any]
) -> None:
    two = _final_checkpoint(equivalence_runs[(case, 2)])
    one = _final_checkpoint(equivalence_runs[(case, 1)])
    assert (two["step"], two["world_size"]) == (STEPS, 2)
    assert (one["step"], one["world_size"]) == (STEPS, 1)

    _assert_same(two["model"], one["model"], "model")
    init = _initial_params()
    assert init.keys() == two["model"].keys()
    for key, value in init.items():
        assert not torch.allclose(two["model"][key], value, rtol=1e-6, atol=1e-9), f"{key} never changed"

    mom2, mom1 = two["optimizer"]["state"], one["optimizer"]["state"]
    assert mom2.keys() == mom1.keys() and len(mom2) == len(init)
    _assert_same(
        {str(k): v["momentum_buffer"] for k, v in mom2.items()},
        {str(k): v["momentum_buffer"] for k, v in mom1.items()},
        "momentum",
    )

    if case == "sgd":
        assert two["kfac"] is None and one["kfac"] is None
        return
    assert two["kfac"]["steps"] == one["kfac"]["steps"] == STEPS
    assert len(two["kfac"]["factors"]) == 8  # conv1, conv2, fc1, fc2 x (A, G)
    _assert_same(two["kfac"]["factors"], one["kfac"]["factors"], "factor")
    kinds = {kind for kind, _ in two["kfac"]["inverses"].values()}
    same_kind = True
    if case == "auto":
        summaries = [
            json.loads((Path(last_line(equivalence_runs[(case, n)])) / "summary.json").read_text()) for n in (2, 1)
        ]
        for summary in summaries:
            assert summary["variant"] == "auto" and summary["variant_used"] in PRESETS, summary
            assert summary["stages"]["choose"] is False  # the chosen preset's stages are in force
        assert kinds == {KINDS.get(summaries[0]["variant_used"], "dense")}
        # Each run chooses from its own timed step: where they chose presets of different inverse
        # kinds, the stored tensors differ in kind (an inverse, a Cholesky factor) and only their
        # dense inverses compare.
        same_kind = {KINDS.get(s["variant_used"], "dense") for s in summaries} == kinds
    else:
        assert kinds == {KINDS.get(case, "dense")}
    _assert_same(_dense_inverses(two["kfac"]), _dense_inverses(one["kfac"]), "inverse")
    if case != "eigen" and same_kind:
        _assert_same(
            {k: ts[0] for k, (_, ts) in two["kfac"]["inverses"].items()},
            {k: ts[0] for k, (_, ts) in one["kfac"]["inverses"].items()},
            "stored inverse",
        )


@pytest.mark.slow  # the fixture's twelve runs
def test_cases_really_differ(equivalence_runs: dict[tuple[str, int], Any]) -> None:
    """``reduce`` factors and plain SGD take other paths than the default: results must differ."""
    models = {case: _final_checkpoint(equivalence_runs[(case, 1)])["model"] for case in ("cholesky", "reduce", "sgd")}
    for other in ("reduce", "sgd"):
        diff = max(float((models["cholesky"][k] - models[other][k]).abs().max()) for k in models["cholesky"])
        assert diff > 1e-8, f"cholesky and {other} gave the same parameters"


@pytest.mark.slow
def test_three_workers_with_pieces_to_owners_equal_one_worker(tmp_path: Path) -> None:
    """flow at P = 3 where the updates are gathered from several owners at once (gloo's choice)."""
    profile = tmp_path / "cheap_pieces.yaml"  # two broadcast start-ups cost less than one all-reduce's
    profile.write_text(
        "allreduce: {alpha: 1.0e-3, beta: 1.0e-9}\nbroadcast: {alpha: 1.0e-4, beta: 1.0e-10}\n"
        "inverse: {kind: cubic, alpha: 1.0e-5, beta: 1.0e-9}\nmeta: {world_size: 3}\n"
    )
    flow = ["kfac.variant=flow", f"kfac.profile={profile}"]
    sizes = {3: ["launch.nproc=3", f"data.batch_size={BATCH}"], 1: ["launch.nproc=1", f"data.batch_size={3 * BATCH}"]}
    with ThreadPoolExecutor(max_workers=2) as pool:
        runs = {n: pool.submit(run_cli, *_common(tmp_path / str(n)), *size, *flow) for n, size in sizes.items()}
        three, one = (_final_checkpoint(runs[n].result()) for n in (3, 1))
    assert "buckets of updates gathered from their owners" in runs[3].result().stderr, "nothing was gathered"
    assert three["world_size"] == 3
    _assert_same(three["model"], one["model"], "model")
    _assert_same(three["kfac"]["factors"], one["kfac"]["factors"], "factor")
    _assert_same(_dense_inverses(three["kfac"]), _dense_inverses(one["kfac"]), "inverse")


# --- inside a real 2-process gloo group ------------------------------------------------------

GLOO_STEPS = 3
GLOO_BATCH = 6
GLOO_LR = 0.1
CLASSES = 4


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, stride=2, padding=1)
        self.fc = nn.Linear(3 * 3 * 3, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.conv(x)).flatten(1))


def _tiny() -> _Tiny:
    torch.manual_seed(0)
    return _Tiny().double()


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + 10 * step + rank)
    x = torch.randn(GLOO_BATCH, 2, 5, 5, generator=g, dtype=torch.float64)
    y = torch.randint(0, CLASSES, (GLOO_BATCH,), generator=g)
    return x, y


def _union(step: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    xs, ys = zip(*(_batch(r, step) for r in range(world)), strict=True)
    return torch.cat(xs), torch.cat(ys)


def _np(d: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    return {k: v.detach().cpu().numpy().copy() for k, v in d.items()}


def _train_tiny(backend: TorchBackend, data: Any) -> dict[str, Any]:
    """Three K-FAC steps on the tiny model; ``data(step)`` gives this process's batch."""
    model = _tiny()
    net = backend.wrap_model(model)
    cfg = KFACConfig()
    pre = build.preconditioner(model, cfg, backend)
    opt = torch.optim.SGD(model.parameters(), lr=GLOO_LR)
    out: dict[str, Any] = {}
    for step in range(GLOO_STEPS):
        x, y = data(step)
        logits = net(x)
        pre.end_forward()
        F.cross_entropy(logits, y).backward()
        pre.step(GLOO_LR)
        if step == 0:
            out["first_factors"] = _np(pre.factors)
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        out["grads"] = _np(grads)
        opt.step()
        opt.zero_grad(set_to_none=True)
    out["factors"] = _np(pre.factors)
    out["inverses"] = _np({k: v.dense() for k, v in pre.inverses.items()})
    out["params"] = _np(dict(model.named_parameters()))
    out["world"] = backend.world_size
    return out


def _gloo_body(rank: int, world: int) -> dict[str, Any]:
    backend = TorchBackend(DistConfig())
    try:
        return _train_tiny(backend, lambda step: _batch(rank, step))
    finally:
        backend.close()


def _union_factors(world: int) -> dict[str, np.ndarray]:
    """A and G of the initial tiny model over the union of step 0's batches, from scratch."""
    model = _tiny()
    x, y = _union(0, world)
    n = x.shape[0]
    conv_out = model.conv(x)
    conv_out.retain_grad()
    h = torch.relu(conv_out).flatten(1)
    logits = model.fc(h)
    logits.retain_grad()
    F.cross_entropy(logits, y, reduction="sum").backward()  # gradient = per-example Dg

    ones = torch.ones
    patches = F.unfold(x, 3, padding=1, stride=2).transpose(1, 2).reshape(-1, 2 * 9)
    patches = torch.cat([patches, ones(patches.shape[0], 1, dtype=x.dtype)], 1)
    dg_conv = conv_out.grad.permute(0, 2, 3, 1).reshape(-1, 3)  # type: ignore[union-attr]
    a_fc = torch.cat([h, ones(n, 1, dtype=x.dtype)], 1).detach()
    dg_fc = logits.grad
    assert dg_fc is not None
    return _np(
        {
            "conv/A": patches.T @ patches / patches.shape[0],
            "conv/G": dg_conv.T @ dg_conv / n,
            "fc/A": a_fc.T @ a_fc / n,
            "fc/G": dg_fc.T @ dg_fc / n,
        }
    )


def _assert_np_same(a: dict[str, np.ndarray], b: dict[str, np.ndarray], rtol: float, atol: float, what: str) -> None:
    assert a.keys() == b.keys(), what
    for key in a:
        np.testing.assert_allclose(a[key], b[key], rtol=rtol, atol=atol, err_msg=f"{what} {key}")


@pytest.mark.slow
def test_kfac_in_gloo_group_ranks_agree_and_match_union(monkeypatch: pytest.MonkeyPatch) -> None:
    world = 2
    ranks = run_in_gloo(_gloo_body, world)
    assert [r["world"] for r in ranks] == [world, world]
    r0, r1 = ranks
    for part in ("first_factors", "factors", "inverses", "grads", "params"):
        assert r0[part], part
        _assert_np_same(r0[part], r1[part], 1e-12, 1e-15, f"rank 0 vs rank 1 {part}")
    assert set(r0["factors"]) == {"conv/A", "conv/G", "fc/A", "fc/G"}
    assert set(r0["grads"]) == {"conv.weight", "conv.bias", "fc.weight", "fc.bias"}

    # Step 0's factors are exactly the factors of the union of both ranks' batches.
    _assert_np_same(r0["first_factors"], _union_factors(world), 1e-10, 1e-14, "factor vs union")

    # The whole 3-step trajectory equals one process training on the union batches.
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    single = _train_tiny(TorchBackend(DistConfig()), lambda step: _union(step, world))
    assert single["world"] == 1
    for part in ("first_factors", "factors", "inverses", "grads", "params"):
        _assert_np_same(r0[part], single[part], 1e-10, 1e-13, f"2 ranks vs 1 process {part}")
    init = _np(dict(_tiny().named_parameters()))
    for key, value in init.items():
        assert not np.allclose(r0["params"][key], value, rtol=1e-6, atol=1e-9), f"{key} never changed"
