"""The timeline of one traced step: a Chrome trace (open it in Perfetto) and a picture like the paper's Fig. 4."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kfacflow.running.rundir import write_atomic
from kfacflow.timing import LANES, UNTIL, chrome_trace

ROWS = tuple(lane for lane in LANES if lane != "compute")
"""Lanes the picture draws; the forward and backward passes (``compute``) go on their own rows."""
COLORS = {
    "precondition": "C7",
    "forward": "C0",
    "backward": "C1",
    "factor": "C2",
    "allreduce": "C3",
    "average": "C9",
    "inverse": "C4",
    "pack": "C6",
    "unpack": "C8",
    "broadcast": "C5",
}
MEANING = {
    "forward": "forward pass",
    "backward": "backward pass",
    "factor": "factor computation (hooks)",
    "allreduce": "all-reduce or reduction to an owner (factors, gradients), launch to end",
    "average": "running averages of the factors",
    "inverse": "inversion",
    "pack": "packing an inverse to send",
    "broadcast": "broadcast (inverse or update), launch to end",
    "unpack": "unpacking a received inverse",
    "precondition": "preconditioning a layer",
}
"""The legend: what each lane's bars are."""
LABELLED = ("allreduce", "inverse", "broadcast")
LABELS = 3
"""The longest bars of these lanes carry their names (the largest factors)."""


def write_timeline(events_by_rank: list[list[dict[str, Any]]], run_dir: Path, title: str) -> Any:
    """Write ``timeline.json`` and ``timeline.png`` into ``run_dir``; return the matplotlib figure.

    Args:
        events_by_rank: Each rank's events (``name``, ``lane``, ``t0``, ``t1`` in seconds from its step start).
        run_dir: The run folder.
        title: Figure title.
    """
    write_atomic(run_dir / "timeline.json", json.dumps(chrome_trace(events_by_rank)).encode())
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    used = [lane for lane in ROWS if any(_lane(e) == lane for events in events_by_rank for e in events)]
    rows = [(rank, lane) for rank in range(len(events_by_rank)) for lane in used]
    fig, ax = plt.subplots(figsize=(12, 0.35 * len(rows) + 2.0))
    longest: list[tuple[float, float, int, str]] = []
    for y, (rank, lane) in enumerate(rows):
        events = [e for e in events_by_rank[rank] if _lane(e) == lane]
        if events:
            spans = [(e["t0"], e["t1"] - e["t0"]) for e in events]
            ax.broken_barh(spans, (y - 0.4, 0.8), facecolors=COLORS[lane], edgecolors="black", linewidth=0.2)
        if lane in LABELLED:  # a transfer seen only when it was taken does not say how long it took
            longest += [(e["t1"] - e["t0"], e["t0"], y, str(e["name"])) for e in events if UNTIL not in e["name"]]
    for lane in LABELLED:  # each labelled lane's longest bars, over every rank
        mine = [x for x in longest if rows[x[2]][1] == lane]
        for width, t0, y, name in sorted(mine, reverse=True)[:LABELS]:
            ax.text(t0 + width / 2, y, name, ha="center", va="center", fontsize=6, clip_on=True)
    ax.set_yticks(range(len(rows)), [f"rank {r} {lane}" for r, lane in rows], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("seconds from the start of the step")
    ax.set_title(title, fontsize=9)
    ax.grid(axis="x", alpha=0.3)
    legend = [Patch(facecolor=COLORS[lane], edgecolor="black", label=MEANING[lane]) for lane in used]
    ax.legend(handles=legend, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=4, fontsize=7, frameon=False)
    fig.tight_layout()
    fig.savefig(run_dir / "timeline.png", dpi=110)
    return fig


def traced_steps(train: Any) -> list[int]:
    """The steps ``train.timeline``, ``train.timeline_steps`` and ``train.timeline_every`` trace (none: off)."""
    if train.timeline <= 0:
        return []
    return [train.timeline + i * train.timeline_every for i in range(train.timeline_steps)]


def mean_profile(profiles: list[dict[str, Any]], steps: list[int]) -> dict[str, Any]:
    """Several traced steps' :func:`layer_profile` in one: each time the mean over the steps that have it.

    A time a step lacks (``None``: an inverse on a step that inverts nothing, a layer's preconditioning
    on the rank that did not own it) is left out of that time's mean, so steps that differ only in
    what they measured average to what each measured; everything else is the first step's.
    """

    def mean(values: list[Any]) -> Any:
        got = [v for v in values if v is not None]
        return sum(got) / len(got) if got else None

    first = profiles[0]
    out = dict(first)
    for key in ("t_forward_total", "t_backward_total"):
        out[key] = mean([p.get(key) for p in profiles])
    parts = {k for p in profiles for k in p["breakdown"]}
    out["breakdown"] = {k: mean([p["breakdown"].get(k) for p in profiles]) for k in sorted(parts)}
    rows = [{row["name"]: row for row in p["layers"]} for p in profiles]
    out["layers"] = [
        {
            k: mean([r[row["name"]].get(k) for r in rows if row["name"] in r]) if k.startswith("t_") else v
            for k, v in row.items()
        }
        for row in first["layers"]
    ]
    return {**out, "steps": list(steps)}


def layer_profile(
    events_by_rank: list[list[dict[str, Any]]],
    layers: list[Any],
    parts: dict[str, float],
    world_size: int,
    batch: int,
    method: str | None = None,
) -> dict[str, Any]:
    """Per-layer times of one traced step (rank 0's compute, every rank's inverses), for ``tools/simulate.py``.

    Backward time per layer is not observable through hooks; the step's backward time is split
    over the layers in proportion to their forward times (``t_backward`` is that estimate).
    An inverse time is the one measured on whichever rank inverted that factor; ``t_pack`` (the
    owner packing a communicated inverse for its broadcast) and ``t_unpack`` (a rank unpacking
    the broadcast copy) are the slowest rank's, and absent for factors every rank inverted.
    ``t_precondition`` is rank 0's; ``t_precondition_elsewhere`` the slowest other rank's, for a layer
    rank 0 did not precondition (where owners precondition: ``kfac.broadcast=update``).
    ``method`` names the inverse method that was timed (the simulator rescales to another).
    """

    def spans(events: list[dict[str, Any]], lane: str) -> dict[str, float]:
        return {e["name"]: e["t1"] - e["t0"] for e in events if e["lane"] == lane}

    mine = events_by_rank[0]
    forward, factor, compute = spans(mine, "forward"), spans(mine, "factor"), spans(mine, "compute")
    precondition = spans(mine, "precondition")
    inverse: dict[str, float] = {}
    pack: dict[str, float] = {}
    elsewhere: dict[str, float] = {}  # preconditioned by another rank (its owner): rank 0's Other holds none of it
    for rank, events in enumerate(events_by_rank):
        for key, seconds in spans(events, "inverse").items():
            inverse[key] = max(inverse.get(key, 0.0), seconds)
        if rank:
            for key, seconds in spans(events, "precondition").items():
                elsewhere[key] = max(elsewhere.get(key, 0.0), seconds)
        for lane in ("pack", "unpack"):  # unpacking is "<key> unpack"
            for key, seconds in spans(events, lane).items():
                pack[key] = max(pack.get(key, 0.0), seconds)
    total_fwd = sum(forward.get(layer.name, 0.0) for layer in layers) or 1.0
    backward = compute.get("backward", 0.0)
    rows = []
    for layer in layers:
        t_fwd = forward.get(layer.name, 0.0)
        rows.append(
            {
                "name": layer.name,
                "a_dim": layer.a_dim,
                "g_dim": layer.g_dim,
                "params": sum(p.numel() for p in layer.module.parameters()),
                "t_forward": t_fwd,
                "t_backward": backward * t_fwd / total_fwd,
                "t_factor_a": factor.get(f"{layer.name}/A", 0.0),
                "t_factor_g": factor.get(f"{layer.name}/G", 0.0),
                "t_inverse_a": inverse.get(f"{layer.name}/A"),
                "t_inverse_g": inverse.get(f"{layer.name}/G"),
                "t_pack_a": pack.get(f"{layer.name}/A"),
                "t_pack_g": pack.get(f"{layer.name}/G"),
                "t_unpack_a": pack.get(f"{layer.name}/A unpack"),
                "t_unpack_g": pack.get(f"{layer.name}/G unpack"),
                "t_precondition": precondition.get(layer.name),
                "t_precondition_elsewhere": None if layer.name in precondition else elsewhere.get(layer.name),
            }
        )
    return {
        "world_size": world_size,
        "batch_size": batch,
        **({"inverse": method} if method else {}),
        "t_forward_total": compute.get("forward", 0.0),
        "t_backward_total": backward,
        "breakdown": parts,
        "layers": rows,
    }


def _lane(event: dict[str, Any]) -> str:
    lane = str(event["lane"])
    if lane == "compute":
        return "forward" if event["name"] == "forward" else "backward"
    return lane
