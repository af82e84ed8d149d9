"""Traced steps as the simulator takes them: the mean of several, scaled, or re-timed for another inverse."""

from __future__ import annotations

from typing import Any

from kfacflow.perf import Profile


def average(profiles: list[dict[str, Any]]) -> dict[str, Any]:
    """Return the mean of several layer profiles of one model (traced steps vary by some per cent).

    Raises:
        ValueError: If they are not of the same model.
    """

    def mean(values: list[Any]) -> Any:
        known = [v for v in values if v is not None]
        return sum(known) / len(known) if known else None

    first = profiles[0]
    if any([r["name"] for r in p["layers"]] != [r["name"] for r in first["layers"]] for p in profiles):
        raise ValueError("the layer profiles to average are not of the same model")
    if len({p.get("inverse") for p in profiles}) > 1:
        raise ValueError("the layer profiles to average timed different inverse methods: simulate them apart")
    rows = [
        {k: mean([p["layers"][i].get(k) for p in profiles]) if k.startswith("t_") else v for k, v in row.items()}
        for i, row in enumerate(first["layers"])
    ]
    breakdown = {k: mean([p["breakdown"].get(k) for p in profiles]) for k in first["breakdown"]}
    totals = {k: mean([p[k] for p in profiles]) for k in ("t_forward_total", "t_backward_total")}
    return {**first, **totals, "breakdown": breakdown, "layers": rows}


def scale_compute(layers: dict[str, Any], factor: float) -> dict[str, Any]:
    """Return ``layers`` with every measured compute time multiplied by ``factor``."""
    rows = [
        {k: v * factor if k.startswith("t_") and v is not None else v for k, v in r.items()} for r in layers["layers"]
    ]
    breakdown = {k: v * factor for k, v in layers["breakdown"].items()}
    return {
        **layers,
        "layers": rows,
        "breakdown": breakdown,
        "t_forward_total": layers["t_forward_total"] * factor,
        "t_backward_total": layers["t_backward_total"] * factor,
    }


def with_method(layers: dict[str, Any], profile: Profile, method: str) -> dict[str, Any]:
    """Return ``layers`` as if its inversions had been timed with ``method``.

    A traced step times only its own method (``layers["inverse"]``): each inversion is scaled by
    the ratio of the two methods' models in ``profile`` at that factor's size (calibration measures
    every method a run may use). Unchanged where the methods agree or the trace does not say.
    """
    traced = layers.get("inverse")
    if traced is None or traced == method:
        return layers
    mine, theirs = profile.for_method(traced).inverse, profile.for_method(method).inverse
    rows = []
    for row in layers["layers"]:
        row = dict(row)
        for key, dim in (("t_inverse_a", row["a_dim"]), ("t_inverse_g", row["g_dim"])):
            if row.get(key) is not None:
                row[key] *= theirs(dim) / mine(dim)
        rows.append(row)
    return {**layers, "layers": rows, "inverse": method}
