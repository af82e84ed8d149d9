"""The run folder of a 2-worker quickstart run, and reproducing a run from its saved config.yaml."""

from __future__ import annotations

import json
import re
import subprocess
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import last_line, run_cli

STEPS = 3


def _prefixed(text: str) -> Callable[[str], str]:
    """An ``assert_close`` message that puts ``text`` before torch's own."""
    return lambda m: f"{text}: {m}"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    proc = run_cli(*args)
    assert proc.returncode == 0, f"run failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    return proc


@pytest.fixture(scope="module")
def first(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("rundir")
    started = time.time()
    proc = _run(
        "recipes/quickstart.yaml",
        "launch.nproc=2",
        f"train.steps={STEPS}",
        "train.dtype=float64",
        f"out_dir={out}",
        "train.progress=false",
    )
    return {"proc": proc, "out": out, "started": started, "ended": time.time()}


def _final_model(run_dir: Path) -> dict[str, torch.Tensor]:
    path = run_dir / "checkpoints" / f"step_{STEPS:08d}.pt"
    assert path.is_file(), list(run_dir.rglob("*"))
    state = torch.load(path, map_location="cpu", weights_only=False)
    assert state["step"] == STEPS
    model: dict[str, torch.Tensor] = state["model"]
    return model


@pytest.mark.slow
def test_run_folder_layout(first: dict[str, Any]) -> None:
    run_dir = Path(last_line(first["proc"]))
    assert run_dir.is_dir()
    assert run_dir.parent == first["out"] / "quickstart"
    assert re.fullmatch(r"\d{8}-\d{6}", run_dir.name), run_dir.name
    stamp = datetime.strptime(run_dir.name, "%Y%m%d-%H%M%S").timestamp()
    assert first["started"] - 2 <= stamp <= first["ended"] + 1
    assert [p.name for p in first["out"].iterdir()] == ["quickstart"]
    assert [p.name for p in (first["out"] / "quickstart").iterdir()] == [run_dir.name]

    names = {p.name for p in run_dir.iterdir()}
    assert {"config.yaml", "command.txt", "versions.json", "summary.json", "checkpoints"} <= names

    config = (run_dir / "config.yaml").read_text()
    assert "nproc: 2" in config and f"steps: {STEPS}" in config and "dtype: float64" in config
    assert re.search(r"^resume: null$", config, re.M), "the saved config must not point at a resume folder"
    command = (run_dir / "command.txt").read_text()
    assert "recipes/quickstart.yaml" in command and f"train.steps={STEPS}" in command
    versions = json.loads((run_dir / "versions.json").read_text())
    assert versions["torch"] == torch.__version__ and versions["python"]

    summary = json.loads((run_dir / "summary.json").read_text())
    for key in ("train_loss", "val_loss", "val_acc", "steps", "epochs", "world_size", "variant", "seconds"):
        assert key in summary, key
    assert summary["world_size"] == 2
    assert summary["steps"] == STEPS
    assert summary["variant"] == "spd"
    assert 0 < summary["epochs"] < 1
    assert 0 <= summary["val_acc"] <= 1 and summary["val_loss"] > 0 and summary["train_loss"] > 0
    assert summary["seconds"] > 0


def test_tensorboard_events(first: dict[str, Any]) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = Path(last_line(first["proc"]))
    events = list(run_dir.glob("events.out.tfevents.*"))
    assert events, sorted(p.name for p in run_dir.iterdir())
    acc = EventAccumulator(str(run_dir))
    acc.Reload()
    scalars = acc.Tags()["scalars"]
    assert {"train/loss", "val/acc"} <= set(scalars), scalars
    assert [e.step for e in acc.Scalars("train/loss")][-1] == STEPS
    assert [e.step for e in acc.Scalars("val/acc")] == [STEPS]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert acc.Scalars("val/acc")[-1].value == pytest.approx(summary["val_acc"], rel=1e-6)


@pytest.mark.slow
def test_saved_config_reproduces_the_run(first: dict[str, Any], tmp_path: Path) -> None:
    run_dir = Path(last_line(first["proc"]))
    again = Path(last_line(_run(str(run_dir / "config.yaml"), f"out_dir={tmp_path}", "train.progress=false")))
    assert again.parent == tmp_path / "quickstart", "the saved name and the new out_dir decide the folder"
    a, b = _final_model(run_dir), _final_model(again)
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == torch.float64
        torch.testing.assert_close(a[key], b[key], rtol=1e-12, atol=0, msg=_prefixed(key))
    ja = json.loads((run_dir / "summary.json").read_text())
    jb = json.loads((again / "summary.json").read_text())
    assert (jb["steps"], jb["world_size"]) == (ja["steps"], ja["world_size"])
    assert jb["val_loss"] == pytest.approx(ja["val_loss"], rel=1e-12)


# What an earlier life of a run logged: steps 1 to 6 (evaluations at 4 and 6), then a row cut short by a crash.
EARLIER = [(2, "train"), (4, "train"), (4, "val"), (6, "train"), (6, "val")]


def _earlier_life(run_dir: Path) -> None:
    timings = "".join(json.dumps({"step": s, "total": 0.5}) + "\n" for s in range(1, 7))
    (run_dir / "timings.jsonl").write_text(timings + '{"step": 7, "to')
    rows = [{"step": s, "kind": k, "loss": 1.0, "acc": 0.5} for s, k in EARLIER]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 7')
    csv = ["step,kind,loss,acc,lr,step_s,images_per_s", *(f"{s},{k},1.0,0.5,,," for s, k in EARLIER), "7,tr"]
    (run_dir / "metrics.csv").write_text("\n".join(csv))


def _evaluation(step: int) -> dict[str, float]:
    return {"epoch": step / 4, "step": step, "seconds": 1.0, "val_loss": 0.75, "val_acc": 0.5}


def _rows(path: Path) -> list[tuple[int, str]]:
    """The (step, kind) of every row of metrics.csv (after its header) or metrics.jsonl."""
    lines = path.read_text().splitlines()
    if path.suffix == ".csv":
        assert lines[0] == "step,kind,loss,acc,lr,step_s,images_per_s"  # an earlier version's columns stay
        assert all(len(line.split(",")) == 7 for line in lines), lines  # and the rows appended follow them
        return [(int(line.split(",")[0]), line.split(",")[1]) for line in lines[1:]]
    return [(json.loads(line)["step"], json.loads(line)["kind"]) for line in lines]


@pytest.mark.parametrize("kind", ["csv", "jsonl"])
@pytest.mark.parametrize("evaluated", [True, False])
def test_a_resume_drops_the_rows_logged_after_its_checkpoint(tmp_path: Path, kind: str, evaluated: bool) -> None:
    from kfacflow.configuration.recipe import load
    from kfacflow.running.runlog import RunLog

    _earlier_life(tmp_path)
    cfg = load(["recipes/quickstart.yaml"], [f"train.metrics={kind}", "train.progress=false"])
    log = RunLog(cfg, tmp_path, rank=0)
    log.open(4, 10, [_evaluation(4)] if evaluated else [])  # resumed from the checkpoint of step 4
    log.step_timed(5, {"total": 0.25})
    log.train_scalars(5, 0.75, 0.625, 0.1)
    log.close()
    # The evaluation at step 4 stays only if the checkpoint holds it (else the run may log it again).
    kept = [(2, "train"), (4, "train"), *([(4, "val")] if evaluated else [])]
    assert _rows(tmp_path / f"metrics.{kind}") == [*kept, (5, "train")]
    other = "jsonl" if kind == "csv" else "csv"  # an earlier life may have written the other kind
    assert _rows(tmp_path / f"metrics.{other}") == kept
    # The run's own step numbers go on from the checkpoint: 5 follows 4.
    timed = [json.loads(line)["step"] for line in (tmp_path / "timings.jsonl").read_text().splitlines()]
    assert timed == [1, 2, 3, 4, 5]
    assert not [p.name for p in tmp_path.iterdir() if ".tmp" in p.name]


def test_a_resume_drops_a_training_row_its_checkpoint_goes_on_from(tmp_path: Path) -> None:
    # The process stopped after step 4 between two training rows: it wrote one for its last steps, which the
    # checkpoint still counts towards the next row (logged=False). Its timing rows stay.
    from kfacflow.configuration.recipe import load
    from kfacflow.running.runlog import RunLog

    _earlier_life(tmp_path)
    log = RunLog(load(["recipes/quickstart.yaml"], ["train.metrics=jsonl", "train.progress=false"]), tmp_path, rank=0)
    log.open(4, 10, [_evaluation(4)], logged=False)
    log.close()
    assert _rows(tmp_path / "metrics.jsonl") == [(2, "train"), (4, "val")]
    assert [json.loads(line)["step"] for line in (tmp_path / "timings.jsonl").read_text().splitlines()] == [1, 2, 3, 4]


def test_a_resume_keeps_in_tensorboard_what_its_checkpoint_holds_at_its_step(tmp_path: Path) -> None:
    # TensorBoard hides every event from a resume's purge_step on: the training row and the evaluation of the
    # checkpoint's own step are written again.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from kfacflow.configuration.recipe import load
    from kfacflow.running.runlog import RunLog

    cfg = load(["recipes/quickstart.yaml"], ["train.progress=false"])
    log = RunLog(cfg, tmp_path, rank=0)
    log.open(0, 10, [])
    for step in (3, 4):
        log.step_timed(step, {"total": 0.5})
    log.train_scalars(4, 0.5, 0.25, 0.1)
    log.evaluation(_evaluation(4))
    state = log.state_dict()  # the checkpoint of step 4; the process went on, then died
    log.train_scalars(6, 0.25, 0.5, 0.1)
    log.close()
    resumed = RunLog(cfg, tmp_path, rank=0)
    resumed.load_state_dict(state)
    resumed.open(4, 10, [_evaluation(4)])
    resumed.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(4, 0.5)]
    assert [(e.step, e.value) for e in events.Scalars("val/acc")] == [(4, 0.5)]
    assert [e.step for e in events.Scalars("time/step_s")] == [4]
