"""How close whole layers on owners can come to the lower bound's perfectly shared K-FAC work, on 2 ranks.

    python tools/placement_floor.py docs/results/bound_windows_2x1gbit/traces/r18_1_10_inv.json \\
        docs/results/bound_windows_2x1gbit/traces/r18_1_10_between.json --every 10

From two traced windows (``layers.json`` of ``train.timeline_steps``: one of inverting steps, one of steps
between), each layer's inversions (both factors) and its preconditioning a step; a period of ``--every``
steps then waits ``every - 1`` times on the rank with the most preconditioning and once on the rank with
the most of both (:meth:`kfacflow.kfac.stages.update_plan.LayerWork.period`), where the bound
(``tools/simulate.py``) shares both perfectly. Prints the best placement of whole layers' period: over
every assignment up to 22 layers, else the best that the placement's own moves and swaps
(``kfacflow.kfac.stages.placement._rebalance``) reach from 200 random starts.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kfacflow.kfac.stages.placement import _rebalance  # noqa: E402
from kfacflow.kfac.stages.update_plan import LayerWork  # noqa: E402

EXHAUSTIVE = 22
"""Layers up to which every assignment is tried (2^21 of them)."""


def times(inverting: Path, between: Path) -> tuple[np.ndarray, np.ndarray]:
    """Each layer's preconditioning seconds a step and its inversions' seconds, from the two traces."""
    inv = json.loads(inverting.read_text())["layers"]
    rows = {r["name"]: r for r in json.loads(between.read_text())["layers"]}
    pre = [rows[r["name"]]["t_precondition"] or rows[r["name"]]["t_precondition_elsewhere"] or 0.0 for r in inv]
    return np.array(pre), np.array([(r["t_inverse_a"] or 0.0) + (r["t_inverse_g"] or 0.0) for r in inv])


def periods(pre: np.ndarray, inv: np.ndarray, on1: np.ndarray, every: int) -> np.ndarray:
    """A period's seconds for each row of ``on1`` (1: the layer on rank 1, 0: on rank 0)."""
    p1, v1 = on1 @ pre, on1 @ inv
    p0, v0 = pre.sum() - p1, inv.sum() - v1
    return np.asarray((every - 1) * np.maximum(p0, p1) + np.maximum(p0 + v0, p1 + v1))


def best(pre: np.ndarray, inv: np.ndarray, every: int, starts: int = 200) -> float:
    """The shortest period of whole layers on 2 ranks."""
    n = len(pre)
    if n <= EXHAUSTIVE:  # the last layer on rank 0: the ranks are interchangeable
        masks = np.arange(2 ** (n - 1), dtype=np.int64)
        on1 = np.concatenate([(masks[:, None] >> np.arange(n - 1)) & 1, np.zeros((len(masks), 1), np.int64)], 1)
        return float(periods(pre, inv, on1.astype(np.float64), every).min())
    work = LayerWork(tuple(pre.tolist()), tuple(inv.tolist()), every)
    rng, found = np.random.default_rng(0), np.inf
    for _ in range(starts):  # the placement's own moves and swaps, from random owners
        owners = _rebalance(rng.integers(0, 2, n).tolist(), work, 2)
        found = min(found, work.period(*work.loads(owners, 2)))
    return float(found)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("inverting", type=Path, help="layers.json of traced inverting steps")
    p.add_argument("between", type=Path, help="layers.json of traced steps between inversions")
    p.add_argument("--every", type=int, default=10, help="kfac.inv_update_freq")
    args = p.parse_args(argv)
    for path in (args.inverting, args.between):
        if not path.is_file():
            print(f"error: no trace at {path} (a run's layers.json: train.timeline_steps)", file=sys.stderr)
            return 2
    pre, inv = times(args.inverting, args.between)
    shared = (args.every - 1) * pre.sum() / 2 + (pre.sum() + inv.sum()) / 2
    whole = best(pre, inv, args.every)
    print(
        f"{len(pre)} layers, preconditioning {pre.sum():.3f} s a step, inversions {inv.sum():.3f} s a period "
        f"(largest layer {inv.max():.3f} s); a period perfectly shared {shared:.3f} s, by the best whole layers "
        f"{whole:.3f} s: +{(whole - shared) / args.every:.4f} s a step"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
