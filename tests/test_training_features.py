"""Everyday training keys: the user's own model and data (module:factory), AdamW, label smoothing, clipping."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import last_line, run_cli, run_cli_batch

import kfacflow

# A user's own module, importable from the folder the command runs in. Every sample is the same
# image of label 0 and the weights are fixed, so the first step's loss and gradient are known.
MINE = """
import torch
from torch import nn
from torch.utils.data import TensorDataset

from kfacflow.data import DataInfo

W = torch.tensor([[0.2, -0.1, 0.3, 0.0], [0.1, 0.4, -0.2, 0.1], [-0.3, 0.2, 0.1, 0.5]])


def net(num_classes, in_channels):
    model = nn.Sequential(nn.Flatten(), nn.Linear(in_channels * 4, num_classes))
    with torch.no_grad():
        model[1].weight.copy_(W)
        model[1].bias.zero_()
    return model


def data(cfg):
    x = torch.arange(1.0, 5.0).reshape(1, 1, 2, 2).repeat(64, 1, 1, 1)
    y = torch.zeros(64, dtype=torch.int64)
    return TensorDataset(x, y), TensorDataset(x[:8], y[:8]), DataInfo(num_classes=3, channels=1, image_size=2)


def broken(cfg):
    return "not datasets"
"""
X = torch.arange(1.0, 5.0)
W = torch.tensor([[0.2, -0.1, 0.3, 0.0], [0.1, 0.4, -0.2, 0.1], [-0.3, 0.2, 0.1, 0.5]])
# On the quickstart recipe: one process, one step of 16 samples, plain SGD at a constant rate.
ONE_STEP = [
    "launch.nproc=1",
    "train.steps=1",
    "train.progress=false",
    "data.batch_size=16",
    "optim.momentum=0",
    "optim.weight_decay=0",
    "schedule.name=constant",
]


@pytest.fixture
def mine(tmp_path: Path) -> Path:
    (tmp_path / "mine.py").write_text(MINE)
    return tmp_path


def run_mine(folder: Path, *overrides: str) -> subprocess.CompletedProcess[str]:
    """The quickstart on the user's model and data, one step unless ``overrides`` (which win) say otherwise."""
    return run_cli("quickstart", "model.name=mine:net", "data.name=mine:data", *ONE_STEP, *overrides, cwd=folder)


def trained(folder: Path, proc: subprocess.CompletedProcess[str]) -> tuple[dict[str, object], dict[str, torch.Tensor]]:
    """A finished run's summary.json and final weights."""
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = folder / last_line(proc)
    summary = json.loads((run / "summary.json").read_text())
    state = torch.load(sorted((run / "checkpoints").glob("*.pt"))[-1], map_location="cpu")["model"]
    return summary, state


Batch = tuple[Path, dict[str, subprocess.CompletedProcess[str]]]


def _batch(factory: pytest.TempPathFactory, runs: dict[str, list[str]]) -> Batch:
    """``runs`` (each the overrides of a one-worker run on the user's model and data), in one interpreter."""
    folder = factory.mktemp("mine")
    (folder / "mine.py").write_text(MINE)
    args = ["quickstart", "model.name=mine:net", "data.name=mine:data", *ONE_STEP]
    done = run_cli_batch([[*args, *overrides] for overrides in runs.values()], cwd=folder)
    return folder, dict(zip(runs, done, strict=True))


VARIANTS = ("sgd", "d")
MISTAKES = {
    "model.name=nowhere:net": "model.name='nowhere:net': cannot import 'nowhere' (ModuleNotFoundError",
    "model.name=mine:nothing": "model.name='mine:nothing': 'mine' has no function 'nothing'",
    "data.name=mine:broken": "data.name='mine:broken' must return (train set, validation set",
    "optim.betas=[0.9]": "optim.betas takes two numbers",
    "optim.name=adam": "Did you mean 'adamw'",
}
SLOW_RUNS = {
    **{mistake: [mistake] for mistake in MISTAKES},
    "module path": ["kfac.variant=sgd", "optim.lr=0.5"],
    "label smoothing": ["kfac.variant=sgd", "train.label_smoothing=0.3"],
    **{f"clip {v}": [f"kfac.variant={v}", "optim.lr=1", "optim.clip_grad_norm=0.001"] for v in VARIANTS},
    **{
        f"adamw {v}": [f"kfac.variant={v}", "optim.name=adamw", "optim.lr=0.01", "optim.momentum=0.9"]
        for v in ("sgd", "d")
    },
    **{
        f"muon {v}": [f"kfac.variant={v}", "optim.name=muon", "optim.momentum=0.9", "optim.lr=0.01"]
        + ["optim.muon.head=true"]
        for v in VARIANTS
    },
    "checkpoint": ["kfac.variant=d"],
    "piped": ["train.progress=true", "train.steps=4", "train.log_every=2", "train.metrics=csv"],
    "ema": ["train.steps=3", "train.ema=0.75", "train.checkpoint_every=1", "train.keep_checkpoints=0", "kfac.variant=d"]
    + ["train.metrics=jsonl", "train.log_every=1"],
}
"""The slow tests' runs: each alone would be mostly the start-up of a process."""
QUICK_RUNS = {
    "stop": ["train.steps=60", "train.eval_every_steps=1", "train.stop_at_accuracy=0.5"],
    "no stop": ["train.steps=60", "train.eval_every_steps=1"],
    "evaluations": ["train.steps=6", "train.eval_every_steps=2", "train.metrics=csv"],
}


@pytest.fixture(scope="module")
def slow_runs(tmp_path_factory: pytest.TempPathFactory) -> Batch:
    return _batch(tmp_path_factory, SLOW_RUNS)


@pytest.fixture(scope="module")
def quick_runs(tmp_path_factory: pytest.TempPathFactory) -> Batch:
    return _batch(tmp_path_factory, QUICK_RUNS)


@pytest.mark.slow
def test_the_users_model_and_data_by_module_path(slow_runs: Batch) -> None:
    summary, state = trained(slow_runs[0], slow_runs[1]["module path"])
    logits = W @ X
    assert summary["train_loss"] == pytest.approx(float(F.cross_entropy(logits[None], torch.tensor([0]))), rel=1e-5)
    # SGD: w -= lr (softmax - onehot) x^T for the one sample repeated.
    grad = torch.outer(torch.softmax(logits, 0) - torch.tensor([1.0, 0.0, 0.0]), X)
    torch.testing.assert_close(state["1.weight"], W - 0.5 * grad, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize(("override", "message"), list(MISTAKES.items()))
def test_a_mistake_is_one_line(slow_runs: Batch, override: str, message: str) -> None:
    """A module path that fails, and the optimizer's own keys."""
    proc = slow_runs[1][override]
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and lines[0].startswith("error: "), proc.stderr


@pytest.mark.slow
def test_label_smoothing_is_in_the_training_loss(slow_runs: Batch) -> None:
    summary, _ = trained(slow_runs[0], slow_runs[1]["label smoothing"])
    logp = torch.log_softmax(W @ X, 0)
    expected = 0.7 * -logp[0] + 0.3 * -logp.mean()  # (1 - e) CE + e x the mean over the 3 classes
    assert summary["train_loss"] == pytest.approx(float(expected), rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("variant", VARIANTS)
def test_clipping_bounds_the_applied_gradient(slow_runs: Batch, variant: str) -> None:
    _, state = trained(slow_runs[0], slow_runs[1][f"clip {variant}"])
    moved = torch.cat([(state["1.weight"] - W).flatten(), state["1.bias"].flatten()])
    assert float(moved.norm()) == pytest.approx(0.001, rel=1e-3)  # the gradient is far larger than 0.001


@pytest.mark.slow
@pytest.mark.parametrize("variant", VARIANTS)
def test_adamw_takes_the_preconditioned_gradient(slow_runs: Batch, variant: str) -> None:
    # Adam's first step moves each weight by lr x m / sqrt(v) = lr x sign(g), whatever g's size.
    _, state = trained(slow_runs[0], slow_runs[1][f"adamw {variant}"])
    moved = (state["1.weight"] - W).abs()
    assert torch.allclose(moved, torch.full_like(moved, 0.01), rtol=1e-3), moved
    assert not math.isnan(float(moved.sum()))


@pytest.mark.slow
@pytest.mark.parametrize("variant", VARIANTS)
def test_muon_steps_by_the_orthogonalised_preconditioned_gradient(slow_runs: Batch, variant: str) -> None:
    # One sample repeated: the (preconditioned) gradient is rank 1, and Newton-Schulz takes every singular
    # value of what it is given, bfloat16's rounding included, to between about 0.7 and 1.2: the step's
    # spectral norm is lr x sqrt(max(1, 3/4)) x about 1, whatever the gradient's size (tests/test_muon.py:
    # the same step as torch.optim.Muon's on K-FAC's preconditioned gradient).
    _, state = trained(slow_runs[0], slow_runs[1][f"muon {variant}"])
    moved = state["1.weight"] - W
    assert 0.6 < float(torch.linalg.matrix_norm(moved / 0.01, ord=2)) < 1.3, moved


@pytest.mark.slow
def test_checkpoints_open_weights_only_and_export_writes_the_model(slow_runs: Batch) -> None:
    mine, proc = slow_runs[0], slow_runs[1]["checkpoint"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = mine / last_line(proc)
    checkpoint = sorted((run / "checkpoints").glob("*.pt"))[-1]
    state = torch.load(checkpoint, weights_only=True)  # RNG states, K-FAC, optimizer: all safe types
    assert state["step"] == 1 and "rng" in state and state["kfac"]
    out = run_cli(f"export={run}", cwd=mine)
    assert out.returncode == 0, out.stderr
    exported = Path(last_line(out))
    assert exported == run / "export" / "model_step_00000001.pt"
    weights = torch.load(exported, weights_only=True)
    assert set(weights) == {"model", "step", "meta"} and weights["step"] == 1
    for key, value in state["model"].items():
        assert torch.equal(weights["model"][key], value)
    wrong = run_cli(f"export={mine}", cwd=mine)
    assert wrong.returncode == 2 and "has no checkpoint" in wrong.stderr


@pytest.mark.slow
def test_a_piped_log_gets_plain_lines_and_the_metrics_file(slow_runs: Batch) -> None:
    mine, proc = slow_runs[0], slow_runs[1]["piped"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "\r" not in proc.stderr  # no progress-bar redraws in a file
    lines = [line for line in proc.stderr.splitlines() if ": step " in line]
    assert len(lines) == 2 and "step 2/4, loss " in lines[0] and "images/s" in lines[1], proc.stderr
    run = mine / last_line(proc)
    rows = (run / "metrics.csv").read_text().splitlines()
    assert rows[0] == "step,kind,loss,acc,lr,step_s,images_per_s,seconds,kl_clip_scale"
    assert [r.split(",")[:2] for r in rows[1:]] == [["2", "train"], ["4", "train"], ["4", "val"]]
    clips = [float(r.split(",")[-1]) for r in rows[1:3]]  # the quickstart's K-FAC clips at kfac.kl_clip=0.001
    assert all(0 < c <= 1 for c in clips) and rows[3].endswith(","), rows
    versions = json.loads((run / "versions.json").read_text())
    assert versions["kfacflow"] == kfacflow.__version__ and versions["git_commit"]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run))
    events.Reload()
    assert [e.step for e in events.Scalars("time/images_per_s")] == [2, 4]
    assert [e.value for e in events.Scalars("kfac/kl_clip_scale")] == pytest.approx(clips)


@pytest.mark.slow
def test_the_moving_average_of_the_weights(slow_runs: Batch) -> None:
    mine, proc = slow_runs[0], slow_runs[1]["ema"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = mine / last_line(proc)
    states = [torch.load(p, weights_only=True) for p in sorted((run / "checkpoints").glob("*.pt"))]
    w = [s["model"]["1.weight"] for s in states]
    ema = [s["ema"]["module.1.weight"] for s in states]
    # The first update takes the weights; then ema = 0.75 ema + 0.25 w after every step.
    torch.testing.assert_close(ema[0], w[0])
    torch.testing.assert_close(ema[1], 0.75 * w[0] + 0.25 * w[1])
    torch.testing.assert_close(ema[2], 0.75 * ema[1] + 0.25 * w[2])
    summary = json.loads((run / "summary.json").read_text())
    assert 0 <= summary["val_acc_ema"] <= 1 and summary["val_loss_ema"] > 0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["kind"]) for r in rows] == [
        (1, "train"),
        (2, "train"),
        (3, "train"),
        (3, "val"),
        (3, "val_ema"),
    ]
    assert rows[-1]["acc"] == summary["val_acc_ema"] and rows[0]["images_per_s"] > 0
    exported = torch.load(Path(last_line(run_cli(f"export={run}", cwd=mine))), weights_only=True)
    assert torch.equal(exported["model_ema"]["1.weight"], ema[2])


def test_a_run_stops_at_the_first_evaluation_that_reaches_the_target_accuracy(quick_runs: Batch) -> None:
    # Every label is 0 and the model starts out predicting 2: accuracy jumps from 0 to 1 at some step.
    mine, proc = quick_runs[0], quick_runs[1]["stop"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = mine / last_line(proc)
    summary = json.loads((run / "summary.json").read_text())
    accs = [r["val_acc"] for r in summary["history"]]
    assert accs[-1] == 1.0 and set(accs[:-1]) == {0.0}, accs
    assert summary["steps"] == summary["history"][-1]["step"] == len(accs) < 60
    assert summary["stopped_at_accuracy"] == 0.5 and "train.stop_at_accuracy=0.5 reached" in proc.stderr
    assert sorted((run / "checkpoints").glob("*.pt"))[-1].name == f"step_{summary['steps']:08d}.pt"
    full = json.loads((mine / last_line(quick_runs[1]["no stop"]) / "summary.json").read_text())
    assert full["history"][: len(accs)] == [
        {**r, "seconds": f["seconds"]} for r, f in zip(summary["history"], full["history"], strict=False)
    ]
    assert full["steps"] == 60 and full["stopped_at_accuracy"] is None


def test_evaluation_every_n_steps_records_the_training_seconds(quick_runs: Batch) -> None:
    mine, proc = quick_runs[0], quick_runs[1]["evaluations"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = mine / last_line(proc)
    history = json.loads((run / "summary.json").read_text())["history"]
    # 4 steps an epoch (64 samples, 16 a step): steps 2 and 4 (the epoch's end, once), and the final one.
    assert [(r["step"], r["epoch"]) for r in history] == [(2, 0.5), (4, 1.0), (6, 1.5)]
    seconds = [r["seconds"] for r in history]
    assert 0 < seconds[0] < seconds[1] < seconds[2], seconds
    header, *lines = (run / "metrics.csv").read_text().splitlines()
    column = header.split(",").index("seconds")
    assert [float(r.split(",")[column]) for r in lines if ",val," in r] == seconds
    state = torch.load(sorted((run / "checkpoints").glob("*.pt"))[-1], map_location="cpu", weights_only=False)
    assert round(state["train_seconds"], 3) >= seconds[-1]  # the history rounds to ms
