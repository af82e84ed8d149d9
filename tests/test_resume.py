"""Checkpoints: resuming equals never stopping, atomic writes, retention, bad or missing checkpoints."""

from __future__ import annotations

import json
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import last_line, run_cli

from kfacflow.configuration.recipe import load, to_yaml

RTOL, ATOL = 1e-10, 1e-13
STEPS = 7
RESUME_AT = 4
# 3 steps per epoch either way (2 x 719 samples in batches of 200, or 1437 in batches of 400): the
# step-4 checkpoint is mid-epoch and the resumed run crosses the epoch boundary after step 6.
BATCH = {2: 200, 1: 400}


def _threads(nproc: int) -> list[str]:
    # One intra-op thread per process: what 2 workers get on 2 cores, and far faster when busy.
    return ["launch.threads=1"] if nproc == 1 else []


def _base_args(nproc: int, out_dir: Path) -> list[str]:
    return [
        "recipes/quickstart.yaml",
        f"train.steps={STEPS}",
        "train.checkpoint_every=1",
        "train.keep_checkpoints=10",
        "train.dtype=float64",
        f"data.batch_size={BATCH[nproc]}",
        "schedule.name=cosine",
        f"launch.nproc={nproc}",
        *_threads(nproc),
        f"out_dir={out_dir}",
        "train.progress=false",
        "train.metrics=jsonl",
        "train.log_every=2",
    ]


def _parallel(jobs: dict[str, list[str]]) -> dict[str, subprocess.CompletedProcess[str]]:
    """Run several ``run.py`` command lines, a few at a time (a launch mostly waits on imports)."""
    with ThreadPoolExecutor(max_workers=3) as pool:
        futures = {key: pool.submit(run_cli, *args) for key, args in jobs.items()}
        return {key: fut.result() for key, fut in futures.items()}


def _ok(proc: subprocess.CompletedProcess[str]) -> Path:
    assert proc.returncode == 0, f"run failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    return Path(last_line(proc))


def _ckpt(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:08d}.pt"


def _load(path: Path) -> dict[str, Any]:
    state: dict[str, Any] = torch.load(path, map_location="cpu", weights_only=False)
    return state


def _resume_folder(dst: Path, run_dir: Path, steps: list[int]) -> Path:
    """A fresh folder with ``run_dir``'s config.yaml and copies of only the given checkpoints."""
    (dst / "checkpoints").mkdir(parents=True)
    shutil.copy(run_dir / "config.yaml", dst / "config.yaml")
    for step in steps:
        shutil.copy(_ckpt(run_dir, step), _ckpt(dst, step))
    return dst


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Uninterrupted runs (1 and 2 workers), resumes built from them, and resumes without checkpoints."""
    tmp = tmp_path_factory.mktemp("resume")
    no_ckpt: dict[str, Path] = {}
    for nproc in (1, 2):
        folder = tmp / f"no-ckpt-{nproc}"
        folder.mkdir()
        cfg = load(["recipes/quickstart.yaml"], [f"launch.nproc={nproc}", "train.steps=2", *_threads(nproc)])
        (folder / "config.yaml").write_text(to_yaml(cfg))
        no_ckpt[f"no_ckpt{nproc}"] = folder
    first = _parallel(
        {
            "full2": _base_args(2, tmp / "full2"),
            "full1": _base_args(1, tmp / "full1"),
            **{key: [f"resume={folder}", "train.progress=false"] for key, folder in no_ckpt.items()},
        }
    )
    full2, full1 = _ok(first["full2"]), _ok(first["full1"])
    resume2 = _resume_folder(tmp / "resume2", full2, [RESUME_AT])
    resume1 = _resume_folder(tmp / "resume1", full1, [RESUME_AT])
    for records in ("timings.jsonl", "metrics.jsonl"):  # as if that run had logged on past its checkpoint, to 7
        shutil.copy(full1 / records, resume1 / records)
    corrupt1 = _resume_folder(tmp / "corrupt1", full1, [RESUME_AT, RESUME_AT + 1])
    newest = _ckpt(corrupt1, RESUME_AT + 1)
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 3])
    resume = ["train.progress=false"]
    second = _parallel(
        {
            "resume2": [f"resume={resume2}", *resume],
            "resume1": [f"resume={resume1}", *resume],
            # Also checks retention: steps 5, 6, 7 are written, and only the 2 newest stay.
            "corrupt1": [f"resume={corrupt1}", "train.keep_checkpoints=2", *resume],
        }
    )
    return {
        **first,
        **second,
        "dirs": {"full2": full2, "full1": full1, "resume2": resume2, "resume1": resume1, "corrupt1": corrupt1},
        "no_ckpt_dirs": no_ckpt,
    }


def _assert_tree_close(a: Any, b: Any, where: str = "") -> None:
    """Tensors to RTOL/ATOL, floats relatively, everything else exactly; recursing into containers."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        if a.is_floating_point():
            torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL, msg=lambda m: f"{where}: {m}")
        else:
            assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{where}: keys {list(a)} != {list(b)}"
        for k in a:
            _assert_tree_close(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_tree_close(x, y, f"{where}[{i}]")
    elif isinstance(a, float):
        assert b == pytest.approx(a, rel=RTOL, abs=ATOL), where
    else:
        assert a == b, where


def _assert_resumed_equals_full(runs: dict[str, Any], resumed: str, full: str, nproc: int) -> None:
    folder = runs["dirs"][resumed]
    assert _ok(runs[resumed]) == folder, "a resumed run keeps writing into the folder it resumed"
    assert f"step_{RESUME_AT:08d}.pt" in runs[resumed].stderr, "the log names the checkpoint it resumed from"
    a = _load(_ckpt(runs["dirs"][full], STEPS))
    b = _load(_ckpt(folder, STEPS))
    assert a["step"] == b["step"] == STEPS and a["world_size"] == b["world_size"] == nproc
    assert a["kfac"] is not None and a["kfac"]["steps"] == STEPS
    init = _load(_ckpt(folder, RESUME_AT))["model"]
    for key in a["model"]:
        assert not torch.allclose(init[key], a["model"][key], rtol=1e-6, atol=1e-9), f"{key}: no training after resume"
    for part in ("model", "optimizer", "scheduler", "kfac"):
        _assert_tree_close(a[part], b[part], part)
    # Each evaluation's training seconds are wall time (the clock differs between runs); the rest is exact.
    untimed = [[{k: v for k, v in r.items() if k != "seconds"} for r in h] for h in (a["history"], b["history"])]
    _assert_tree_close(untimed[0], untimed[1], "history")
    assert all(r["seconds"] > 0 for r in a["history"] + b["history"])
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["steps"] == STEPS
    assert summary["world_size"] == nproc
    full_summary = json.loads((runs["dirs"][full] / "summary.json").read_text())
    assert summary["val_loss"] == pytest.approx(full_summary["val_loss"], rel=1e-10)
    assert summary["val_acc"] == full_summary["val_acc"]
    # Every figure is the whole run's, but those of the clock (tests/test_run_records.py checks them).
    clock = {"seconds", "step_time_median_s", "breakdown_mean_s", "history"}
    assert summary.keys() == full_summary.keys()
    for key in summary.keys() - clock:
        _assert_tree_close(summary[key], full_summary[key], key)


@pytest.mark.slow
def test_resume_two_workers_equals_uninterrupted(runs: dict[str, Any]) -> None:
    _assert_resumed_equals_full(runs, "resume2", "full2", 2)


def test_resume_one_worker_equals_uninterrupted(runs: dict[str, Any]) -> None:
    _assert_resumed_equals_full(runs, "resume1", "full1", 1)


def _records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_resumed_run_keeps_the_records_of_an_uninterrupted_one(runs: dict[str, Any]) -> None:
    # resume1 held the records of all 7 steps when it resumed from step 4: the rows after 4 go, and the run logs
    # them again, numbered as the run numbers its steps.
    full, resumed = runs["dirs"]["full1"], runs["dirs"]["resume1"]
    timed = [row["step"] for row in _records(resumed / "timings.jsonl")]
    assert timed == [row["step"] for row in _records(full / "timings.jsonl")] == list(range(1, STEPS + 1))
    a, b = _records(full / "metrics.jsonl"), _records(resumed / "metrics.jsonl")
    assert [(r["step"], r["kind"]) for r in b] == [(r["step"], r["kind"]) for r in a]
    assert [r["step"] for r in a if r["kind"] == "val"] == [3, 6, 7]  # evaluations before and after step 4
    for x, y in zip(a, b, strict=True):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-10) and y["acc"] == x["acc"], (x, y)


def test_checkpoints_are_atomic_and_kept(runs: dict[str, Any]) -> None:
    for key in ("full2", "full1"):
        folder = runs["dirs"][key]
        names = sorted(p.name for p in (folder / "checkpoints").iterdir())
        assert names == [f"step_{s:08d}.pt" for s in range(1, STEPS + 1)], key
    for key, folder in runs["dirs"].items():
        _ok(runs[key])
        leftovers = [str(p) for p in folder.rglob("*") if ".tmp" in p.name]
        assert not leftovers, f"{key}: temporary files left behind: {leftovers}"
    # The corrupt1 resume ran with train.keep_checkpoints=2.
    kept = runs["dirs"]["corrupt1"] / "checkpoints"
    assert sorted(p.name for p in kept.iterdir()) == [f"step_{s:08d}.pt" for s in (STEPS - 1, STEPS)]
    assert [_load(_ckpt(kept.parent, s))["step"] for s in (STEPS - 1, STEPS)] == [STEPS - 1, STEPS]


def test_corrupt_newest_checkpoint_falls_back_to_previous(runs: dict[str, Any]) -> None:
    proc = runs["corrupt1"]
    folder = runs["dirs"]["corrupt1"]
    assert _ok(proc) == folder
    assert "Traceback" not in proc.stderr
    warnings = [line for line in proc.stderr.splitlines() if f"step_{RESUME_AT + 1:08d}.pt" in line]
    assert any("unreadable" in line for line in warnings), proc.stderr[-3000:]
    assert f"resuming from {_ckpt(folder, RESUME_AT)}" in proc.stderr
    # Falling back to step 4 and training on reproduces the uninterrupted run exactly.
    a = _load(_ckpt(runs["dirs"]["full1"], STEPS))
    b = _load(_ckpt(folder, STEPS))
    for part in ("model", "optimizer", "kfac"):
        _assert_tree_close(a[part], b[part], part)


@pytest.mark.parametrize("nproc", [1, 2])
def test_resume_without_checkpoint_is_a_user_error(runs: dict[str, Any], nproc: int) -> None:
    proc = runs[f"no_ckpt{nproc}"]
    folder = runs["no_ckpt_dirs"][f"no_ckpt{nproc}"]
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert "resume" in errors[0] and str(folder) in errors[0]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert not (folder / "summary.json").exists()
