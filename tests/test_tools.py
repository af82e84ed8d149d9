"""The measurement tools end to end: bench (locally) and the simulator on a real run's layer profile."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT, last_line, run_cli

sys.path.insert(0, str(ROOT / "tools"))

import simulate  # noqa: E402


def test_bench_compares_variants_and_writes_table_json_and_figure(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools" / "bench.py"),
            "recipes/quickstart.yaml",
            "--steps",
            "5",
            "--warmup",
            "3",
            "--reps",
            "1",
            "--only",
            "sgd,D-KFAC,SPD-KFAC",
            "--out",
            str(tmp_path),
            "kfac.profile_steps=1",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "bench.json").read_text())
    assert list(result["results"]) == ["sgd", "D-KFAC", "SPD-KFAC"]
    for r in result["results"].values():
        assert r["steps_measured"] == 2 and r["median_step_s"] > 0
    assert result["results"]["D-KFAC"]["breakdown_s"]["InverseComp"] > 0
    assert "SPD-KFAC / D-KFAC" in proc.stdout
    assert (tmp_path / "bench.png").stat().st_size > 10_000


@pytest.fixture(scope="module")
def traced_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("traced")
    proc = run_cli(
        "recipes/quickstart.yaml",
        "train.steps=5",
        "train.timeline=5",
        "kfac.profile_steps=1",
        "train.progress=false",
        f"out_dir={out}",
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return Path(last_line(proc))


def test_simulator_projects_a_recorded_run(traced_run: Path, tmp_path: Path) -> None:
    layers = json.loads((traced_run / "layers.json").read_text())
    assert [r["name"] for r in layers["layers"]] == ["conv1", "conv2", "fc1", "fc2"]
    assert all(r["t_forward"] > 0 and r["t_factor_a"] > 0 and r["t_factor_g"] > 0 for r in layers["layers"])
    out = tmp_path / "sim.json"
    assert (
        simulate.main(
            [str(traced_run / "layers.json"), str(traced_run / "profile.yaml"), "--workers", "2,8", "--json", str(out)]
        )
        == 0
    )
    rows = json.loads(out.read_text())
    for workers in (2, 8):
        mine = {r["variant"]: r for r in rows if r["workers"] == workers}
        assert set(mine) == {"d", "mpd", "spd", "lower bound"}
        for v in ("d", "mpd", "spd"):
            assert mine[v]["total"] >= mine["lower bound"]["total"] - 1e-12
            assert mine[v]["total"] == pytest.approx(sum(mine[v][p] for p in simulate.PARTS))


def test_simulated_link_and_scaling() -> None:
    from kfacflow.perf import InverseModel, LinearModel, Profile

    link = simulate.Link()
    assert link.send(1.0, 2.0) == 3.0 and link.send(2.0, 1.0) == 4.0 and link.send(10.0, 1.0) == 11.0
    prof = Profile(LinearModel(2e-3, 1e-9), LinearModel(1e-3, 5e-10), InverseModel("cubic", 0, 1e-9), {"world_size": 2})
    same = simulate.scaled(prof, 2)
    assert same.allreduce.alpha == pytest.approx(2e-3) and same.allreduce.beta == pytest.approx(1e-9)
    big = simulate.scaled(prof, 64)
    assert big.allreduce.alpha == pytest.approx(63 * 2e-3) and big.allreduce.beta == pytest.approx(1e-9 * 63 / 32)
    assert big.broadcast.alpha == pytest.approx(6e-3) and big.broadcast.beta == pytest.approx(5e-10)
