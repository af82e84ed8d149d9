"""A run's records however it ends: summary.json, history, timings.jsonl, metrics and events, resumes included."""

from __future__ import annotations

import json
import signal
import statistics
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import QUICK, local_backend, run_cli

from kfacflow import TrainingError
from kfacflow.comm.torch_dist import TorchBackend
from kfacflow.configuration.recipe import load, to_yaml
from kfacflow.running.records import target_line

# One process, float64: two runs of the same steps are equal. 44 steps an epoch (1437 digits in batches of 32).
TINY = [
    "launch.nproc=1",
    "train.progress=false",
    "train.dtype=float64",
    "kfac.variant=d",
    "data.batch_size=32",
    "train.metrics=jsonl",
]


def _fit(
    backend: TorchBackend, run_dir: Path, *overrides: str, poison: Iterable[int] = (), stop_at: int = 0
) -> dict[str, Any]:
    """Train the tiny quickstart in this process: NaN gradients (a finite loss) at the ``poison`` steps, SIGTERM at
    ``stop_at``."""
    from kfacflow.running.trainer import Trainer

    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = load([QUICK], [*TINY, *overrides])
    if not cfg.resume:  # as the worker writes it: what resume= reads
        (run_dir / "config.yaml").write_text(to_yaml(cfg))
    trainer = Trainer.from_recipe(cfg, backend, run_dir)
    bad = set(poison)

    def hook(module: torch.nn.Module, inputs: Any, output: torch.Tensor) -> torch.Tensor | None:
        if not module.training:
            return None
        if trainer.step + 1 == stop_at:
            trainer.stop_requested = signal.SIGTERM  # as the worker's handler does
        if trainer.step + 1 in bad:
            output.register_hook(lambda grad: grad * float("nan"))
        return None

    trainer.model.register_forward_hook(hook)
    return trainer.fit()


def _rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _same(a: Any, b: Any) -> bool:
    return bool(a == pytest.approx(b, rel=1e-12)) if isinstance(a, float) else bool(a == b)


# Wall-clock figures differ between any two runs: they are checked against the run's own timings.jsonl.
MEASURED = {"seconds", "step_time_median_s", "breakdown_mean_s"}
# No field of summary.json is about one process of the run rather than the run: none is left out.
PER_PROCESS: set[str] = set()


@pytest.mark.slow
def test_a_resumed_runs_summary_equals_the_uninterrupted_ones(backend: TorchBackend, tmp_path: Path) -> None:
    # Step 2 is skipped (NaN gradients); the run stops after step 5, inside its epoch and between two training rows
    # (train.log_every=2), and is resumed.
    common = ["train.steps=6", "train.log_every=2", "train.eval_every_steps=3", "train.keep_checkpoints=0"]
    full = _fit(backend, tmp_path / "full", *common, poison=[2])
    first = _fit(backend, tmp_path / "parts", *common, poison=[2], stop_at=5)
    assert first["stopped_by"] == "SIGTERM" and first["steps"] == 5
    resumed = _fit(backend, tmp_path / "parts", *common, f"resume={tmp_path / 'parts'}")
    assert resumed.keys() == full.keys()
    for key in full.keys() - MEASURED - PER_PROCESS - {"history"}:
        assert _same(resumed[key], full[key]), (key, resumed[key], full[key])
    assert full["skipped_steps"] == 1 and full["stopped_by"] is None and full["train_loss"] > 0
    untimed = [[{k: v for k, v in r.items() if k != "seconds"} for r in s["history"]] for s in (full, resumed)]
    assert untimed[0] == untimed[1]
    # The figures over timed steps are over the whole run's, both processes' (2 warm-up steps left out).
    for folder, summary in ((tmp_path / "full", full), (tmp_path / "parts", resumed)):
        timed = _rows(folder / "timings.jsonl")
        assert [r["step"] for r in timed] == [1, 3, 4, 5, 6]  # step 2 was skipped: not timed
        assert summary["step_time_median_s"] == statistics.median(r["total"] for r in timed[2:])
        for part, mean in summary["breakdown_mean_s"].items():
            assert mean == pytest.approx(statistics.fmean(r[part] for r in timed[2:]), rel=1e-12), part
        assert summary["seconds"] > summary["history"][-1]["seconds"] > 0  # evaluations and checkpoints too
    # The training rows cover the same steps: the row the stopped process wrote at step 5 gave way.
    a, b = _rows(tmp_path / "full" / "metrics.jsonl"), _rows(tmp_path / "parts" / "metrics.jsonl")
    assert [(r["step"], r["kind"]) for r in a] == [(2, "train"), (3, "val"), (4, "train"), (6, "train"), (6, "val")]
    assert [(r["step"], r["kind"]) for r in b] == [(r["step"], r["kind"]) for r in a]
    for x, y in zip(a, b, strict=True):
        assert _same(x["loss"], y["loss"]) and x["acc"] == y["acc"], (x, y)


def _complete(run_dir: Path, summary: dict[str, Any]) -> None:
    """Every step the run trained has its timing row, and the steps since the last training row have one."""
    assert [r["step"] for r in _rows(run_dir / "timings.jsonl")] == list(range(1, summary["steps"] + 1))
    assert [r["step"] for r in _rows(run_dir / "metrics.jsonl") if r["kind"] == "train"] == [summary["steps"]]


@pytest.fixture(scope="module")
def reached(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A run stopped at train.stop_at_accuracy, and the same run with a budget that ends at that step."""
    tmp = tmp_path_factory.mktemp("target")
    # A constant rate: the run of fewer steps takes the same steps as the longer one.
    target = [
        "train.stop_at_accuracy=0.6",
        "train.eval_every_steps=1",
        "schedule.name=constant",
        "train.log_every=1000",
    ]
    with pytest.MonkeyPatch.context() as monkeypatch:
        backend = local_backend(monkeypatch)
        stopped = _fit(backend, tmp / "stopped", "train.steps=30", *target)
        budget = _fit(backend, tmp / "budget", f"train.steps={stopped['steps']}", *target)
    return {"stopped": stopped, "budget": budget, "dirs": {"stopped": tmp / "stopped", "budget": tmp / "budget"}}


@pytest.mark.slow
def test_a_target_reached_at_the_last_evaluation_is_no_stop(reached: dict[str, Any]) -> None:
    stopped, budget = reached["stopped"], reached["budget"]
    steps = stopped["steps"]
    assert 1 < steps < 30 and stopped["stopped_at_accuracy"] == 0.6, stopped["history"]
    first = stopped["history"][-1]
    assert stopped["target_reached"] == {
        "target": 0.6,
        **{k: first[k] for k in ("step", "epoch", "seconds", "val_acc")},
    }
    _complete(reached["dirs"]["stopped"], stopped)  # stopped before train.log_every: every record all the same
    assert target_line(stopped, 30) == f"train.stop_at_accuracy=0.6 reached: stopped at step {steps} of 30"
    # The same run with a budget that ends there: the target is reached at its last step, nothing is stopped.
    assert budget["steps"] == steps and budget["history"][-1]["val_acc"] == first["val_acc"]
    assert budget["stopped_at_accuracy"] is None and budget["target_reached"]["step"] == steps
    line = target_line(budget, steps)
    assert line is not None and "stopped" not in line and "finished its budget" in line and f"step {steps}" in line


def _snapshot(run_dir: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_a_run_over_resumed_says_nothing_to_do_and_writes_nothing(reached: dict[str, Any]) -> None:
    steps, dirs = reached["stopped"]["steps"], reached["dirs"]
    before = {key: _snapshot(folder) for key, folder in dirs.items()}
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {
            key: pool.submit(run_cli, f"resume={folder}", "train.progress=false") for key, folder in dirs.items()
        }
    musts = {
        "stopped": (f"stopped at step {steps} of 30", "reached train.stop_at_accuracy=0.6", "train.stop_at_accuracy=0"),
        "budget": (f"finished at step {steps} of {steps}", f"train.steps={2 * steps} train.stop_at_accuracy=0"),
    }
    for key, future in futures.items():
        proc = future.result()
        assert proc.returncode == 0, proc.stderr[-3000:]
        said = [line for line in proc.stderr.splitlines() if line.startswith(("resume:", "error:"))]
        assert len(said) == 1 and "nothing to do" in said[0], proc.stderr
        for text in musts[key]:
            assert text in said[0], (text, said[0])
        assert _snapshot(dirs[key]) == before[key], f"{key}: the run folder changed"


@pytest.mark.slow
def test_sigterm_and_errors_leave_complete_records(backend: TorchBackend, tmp_path: Path) -> None:
    stopped = _fit(backend, tmp_path / "sigterm", "train.steps=6", "train.log_every=1000", stop_at=2)
    assert stopped["stopped_by"] == "SIGTERM" and stopped["steps"] == 2
    _complete(tmp_path / "sigterm", stopped)
    # Non-finite gradients in a row stop training with an error: the steps trained before it keep their rows.
    error = ["train.steps=6", "train.log_every=1000", "train.max_nonfinite=2"]
    with pytest.raises(TrainingError):
        _fit(backend, tmp_path / "error", *error, poison=[3, 4])
    assert [r["step"] for r in _rows(tmp_path / "error" / "timings.jsonl")] == [1, 2]
    (row,) = _rows(tmp_path / "error" / "metrics.jsonl")
    assert (row["step"], row["kind"]) == (4, "train") and row["loss"] > 0
