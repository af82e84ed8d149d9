"""The step breakdown, timings.jsonl and the timeline of a traced step."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from helpers import kfac_step, last_line, run_cli
from test_norm_factors import DT, KINDS, Normed, data

from kfacflow.comm.torch_dist import TorchBackend
from kfacflow.configuration.schema import KFACConfig
from kfacflow.optim import muon
from kfacflow.running import build
from kfacflow.timing import CATEGORIES, StepTimer, chrome_trace, summarize


def test_step_timer_spans_add_up() -> None:
    timer = StepTimer(torch.device("cpu"))
    timer.begin_step(trace=True)
    with timer.span("FactorComp", "l1/A", "factor"):
        time.sleep(0.02)
    with timer.span("FactorComp"):
        time.sleep(0.01)
    timer.add("GradComm", 0.005)
    parts = timer.end_step(0.1)
    assert parts["FactorComp"] == pytest.approx(0.03, abs=0.01)
    assert parts["GradComm"] == 0.005
    assert parts["Other"] == pytest.approx(0.1 - parts["FactorComp"] - 0.005)
    assert set(parts) == {*CATEGORIES, "total"}
    assert [e["name"] for e in timer.events] == ["l1/A"]  # unnamed spans add time but no event
    untraced = StepTimer(torch.device("cpu"))
    untraced.begin_step(trace=False)
    with untraced.span("FactorComp", "x", "factor"):
        pass
    assert untraced.events == []


def test_chrome_trace_and_summary() -> None:
    trace = chrome_trace([[{"name": "a", "lane": "allreduce", "t0": 0.5, "t1": 0.75}], []])
    (ev,) = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert (ev["pid"], ev["ts"], ev["dur"], ev["cat"]) == (0, 5e5, 2.5e5, "allreduce")
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert names == {"rank 0", "rank 1"}
    steps = [{"total": 9.0}, {"total": 1.0}, {"total": 3.0}]
    assert summarize(steps, 1) == {"total": 2.0}
    assert summarize(steps[:1], 5) == {"total": 9.0}


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["spd", "flow"])
def test_breakdown_and_timeline_of_a_two_worker_run(tmp_path: Path, variant: str) -> None:
    proc = run_cli(
        "recipes/quickstart.yaml",
        f"kfac.variant={variant}",
        "train.steps=6",
        "train.timeline=4",
        "train.timeline_steps=2",
        "train.timeline_every=2",
        "train.log_every=4",
        "kfac.profile_steps=1",
        "train.progress=false",
        f"out_dir={tmp_path}",
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = Path(last_line(proc))
    summary = json.loads((run / "summary.json").read_text())
    mean = summary["breakdown_mean_s"]
    assert set(mean) == {*CATEGORIES, "total"}
    assert all(v >= 0 for v in mean.values())
    assert sum(mean[c] for c in CATEGORIES) == pytest.approx(mean["total"], rel=1e-6)
    assert mean["FactorComp"] > 0 and mean["InverseComp"] > 0 and mean["FF&BP"] > 0
    lines = [json.loads(x) for x in (run / "timings.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2, 3, 4, 5, 6]
    trace = json.loads((run / "timeline.json").read_text())
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in events} == {0, 1}
    lanes = {e["cat"] for e in events}
    assert {"forward", "factor", "allreduce", "inverse"} <= lanes
    if variant == "flow":  # factors reduced to their owners (gloo's point-to-point work: until taken)
        assert any(" to " in e["name"] and e["cat"] == "allreduce" for e in events), sorted(lanes)
    assert (run / "timeline.png").stat().st_size > 10_000
    assert json.loads((run / "layers.json").read_text())["steps"] == [4, 6]  # the mean of steps 4 and 6
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run), size_guidance={"images": 0})
    acc.Reload()
    assert "timeline" in acc.Tags()["images"]
    assert {"breakdown/FactorComm", "breakdown/InverseComp", "time/step_s"} <= set(acc.Tags()["scalars"])


def test_consecutive_steps_tile_the_wall_clock() -> None:
    timer = StepTimer(torch.device("cpu"))
    wall = time.perf_counter()
    totals = []
    for _ in range(3):
        timer.begin_step()
        with timer.span("InverseComp"):
            time.sleep(0.02)
        totals.append(timer.end_step())
        time.sleep(0.03)  # between steps: the next batch, logging ...
        with timer.outside():
            time.sleep(0.05)  # ... and an evaluation, which is no step's
    elapsed = time.perf_counter() - wall
    assert totals[0]["Between"] == 0.0
    for parts in totals[1:]:
        assert parts["Between"] == pytest.approx(0.03, abs=0.015)
        assert parts["total"] == pytest.approx(parts["Between"] + 0.02, abs=0.015)
    # Every second of the run is in a step or outside one.
    assert sum(p["total"] for p in totals) + 3 * 0.05 + 0.03 == pytest.approx(elapsed, abs=0.03)


def test_the_timeline_picture_explains_itself(tmp_path: Path) -> None:
    from kfacflow.running.timeline import MEANING, write_timeline

    def ev(name: str, lane: str, t0: float, t1: float) -> dict[str, object]:
        return {"name": name, "lane": lane, "t0": t0, "t1": t1}

    ranks = [
        [
            ev("forward", "compute", 0.0, 1.0),
            ev("l1/A", "allreduce", 0.5, 0.6),
            ev("l4/A", "allreduce", 1.0, 3.0),  # the largest factors are named on their bars
            ev("l3/A", "allreduce", 3.0, 4.0),
            ev("l2/G", "allreduce", 4.0, 4.5),
            ev("average 4 factors", "average", 4.5, 4.6),
            ev("l4/A", "inverse", 4.6, 6.0),
        ],
        [ev("forward", "compute", 0.0, 1.1), ev("l4/A unpack", "unpack", 6.0, 6.2)],
    ]
    fig = write_timeline(ranks, tmp_path, "run: step 4 of resnet50, flow, 2 workers, 6.20 s")
    ax = fig.axes[0]
    assert ax.get_title() == "run: step 4 of resnet50, flow, 2 workers, 6.20 s"
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        MEANING[lane] for lane in ("forward", "allreduce", "average", "inverse", "unpack")
    ]
    assert sorted(t.get_text() for t in ax.texts) == ["l2/G", "l3/A", "l4/A", "l4/A"]  # top 3 all-reduces, 1 inverse
    rows = [t.get_text() for t in ax.get_yticklabels()]
    assert rows[:5] == ["rank 0 forward", "rank 0 allreduce", "rank 0 average", "rank 0 inverse", "rank 0 unpack"]
    assert (tmp_path / "timeline.png").is_file()


def test_a_layer_profile_takes_each_layers_preconditioning_from_whichever_rank_did_it() -> None:
    from types import SimpleNamespace

    from torch import nn

    from kfacflow.running.timeline import layer_profile

    def ev(name: str, lane: str, t0: float, t1: float) -> dict[str, object]:
        return {"name": name, "lane": lane, "t0": t0, "t1": t1}

    layers = [SimpleNamespace(name=n, a_dim=3, g_dim=2, module=nn.Linear(2, 2)) for n in ("l1", "l2", "l3")]
    ranks = [
        [ev("forward", "compute", 0.0, 1.0), ev("l1", "forward", 0.0, 0.5), ev("l1", "precondition", 2.0, 2.1)],
        # Rank 1 owns l2 (0.2 s) and l3; where every rank preconditions a layer, rank 0's time is kept.
        [ev("l2", "precondition", 2.0, 2.2), ev("l1", "precondition", 2.2, 2.5), ev("l3", "precondition", 2.5, 2.8)],
        [ev("l3", "precondition", 2.0, 2.4)],  # the slowest owner's, as for inverses
    ]
    rows = layer_profile(ranks, layers, {"Other": 0.5}, 3, 8)["layers"]
    assert [r["t_precondition"] for r in rows] == pytest.approx([0.1, None, None])
    assert [r["t_precondition_elsewhere"] for r in rows] == pytest.approx([None, 0.2, 0.4])


def test_traced_steps_average_each_time_over_the_steps_that_measured_it() -> None:
    from types import SimpleNamespace

    from kfacflow.running.timeline import mean_profile, traced_steps

    assert traced_steps(SimpleNamespace(timeline=21, timeline_steps=3, timeline_every=10)) == [21, 31, 41]
    assert traced_steps(SimpleNamespace(timeline=5, timeline_steps=1, timeline_every=1)) == [5]
    assert traced_steps(SimpleNamespace(timeline=0, timeline_steps=3, timeline_every=1)) == []

    def step(fwd: float, inverse: float | None, other: float, extra: dict[str, float]) -> dict[str, object]:
        row = {"name": "l1", "a_dim": 3, "g_dim": 2, "t_forward": fwd, "t_inverse_a": inverse}
        return {"world_size": 2, "t_forward_total": fwd, "breakdown": {"Other": other, **extra}, "layers": [row]}

    # Step 2 inverted nothing: its inverse is left out of the mean, as is the part only step 1 has.
    profile = mean_profile([step(0.1, 0.5, 0.2, {"InverseComp": 0.6}), step(0.3, None, 0.4, {})], [1, 2])
    assert profile["steps"] == [1, 2] and profile["world_size"] == 2
    assert profile["t_forward_total"] == pytest.approx(0.2)
    assert profile["t_backward_total"] is None  # neither step has it
    assert profile["breakdown"] == pytest.approx({"InverseComp": 0.6, "Other": 0.3})
    (row,) = profile["layers"]
    assert row["name"] == "l1" and row["a_dim"] == 3
    assert row["t_forward"] == pytest.approx(0.2) and row["t_inverse_a"] == pytest.approx(0.5)


def test_the_preconditioning_and_muons_newton_schulz_are_parts_of_their_own(backend: TorchBackend) -> None:
    model = Normed().to(DT)
    timer = StepTimer(torch.device("cpu"))
    pre = build.preconditioner(model, KFACConfig(kinds=KINDS), backend, timer=timer)
    matrices, rest = muon.split(model, head=False)
    opt = muon.Muon(
        muon.groups(matrices, rest, 0.02, 0.95, True, 0.0, "original", 5, "auto", 1e-3, (0.9, 0.95), 1e-8, 0.0)
    )
    opt.timer = timer
    for seed in range(2):
        timer.begin_step()
        kfac_step(model, pre, *data(seed))
        opt.step()
        parts = timer.end_step()
        assert parts["Precondition"] > 0 and parts["NewtonSchulz"] > 0  # the fc's update and its Newton-Schulz
        assert parts["MuonComm"] == 0  # one process: nothing gathered
        assert sum(parts[c] for c in CATEGORIES) == pytest.approx(parts["total"], rel=1e-6)
    pre.remove()
