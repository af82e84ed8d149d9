"""How close whole layers on owners can come to the bound's perfectly shared K-FAC work, at 1/10 on 2 ranks.

From the traced windows of docs/results/bound_windows_2x1gbit (inversions from the inverting steps, each
layer's preconditioning from the steps between), a period of 10 steps is 9 x max_r P_r + max_r (P_r + V_r)
(kfacflow.kfac.update_plan.LayerWork.period); the bound shares P and V perfectly. The best placement of whole
layers: every assignment for ResNet-18 (2^20), a local search of moves and swaps from 200 random starts for
ResNet-50. Run from the repository root: python docs/results/measured_placement_2x1gbit/floor.py
"""

import json

import numpy as np

EVERY = 10
TRACES = "docs/results/bound_windows_2x1gbit/traces"


def period(P: np.ndarray, V: np.ndarray, on1: np.ndarray) -> float:
    """A period's seconds on the ranks it waits on, with the layers of ``on1`` on rank 1 and the rest on rank 0."""
    p1, v1 = P[on1].sum(), V[on1].sum()
    p0, v0 = P.sum() - p1, V.sum() - v1
    return float((EVERY - 1) * max(p0, p1) + max(p0 + v0, p1 + v1))


def local_search(P: np.ndarray, V: np.ndarray, starts: int = 200) -> float:
    """The shortest period that moves and swaps reach from ``starts`` random placements."""
    rng, best = np.random.default_rng(0), np.inf
    for _ in range(starts):
        on1 = rng.integers(0, 2, len(P)).astype(bool)
        cur, improved = period(P, V, on1), True
        while improved:
            improved = False
            changes = [(j,) for j in range(len(P))] + [
                (j, k) for j in range(len(P)) for k in range(j + 1, len(P)) if on1[j] != on1[k]
            ]
            for change in changes:
                on1[list(change)] ^= True
                value = period(P, V, on1)
                if value < cur - 1e-12:
                    cur, improved = value, True
                else:
                    on1[list(change)] ^= True
        best = min(best, cur)
    return best


for model in ("r18", "r50"):
    inv = json.load(open(f"{TRACES}/{model}_1_10_inv.json"))["layers"]
    between = {r["name"]: r for r in json.load(open(f"{TRACES}/{model}_1_10_between.json"))["layers"]}
    P = np.array(
        [between[r["name"]]["t_precondition"] or between[r["name"]]["t_precondition_elsewhere"] or 0.0 for r in inv]
    )
    V = np.array([(r["t_inverse_a"] or 0.0) + (r["t_inverse_g"] or 0.0) for r in inv])
    shared = (EVERY - 1) * P.sum() / 2 + (P.sum() + V.sum()) / 2
    if len(P) <= 22:  # the last layer on rank 0 (the ranks are interchangeable)
        masks = np.arange(2 ** (len(P) - 1), dtype=np.int64)
        on1 = np.concatenate([(masks[:, None] >> np.arange(len(P) - 1)) & 1, np.zeros((len(masks), 1), np.int64)], 1)
        p1, v1 = on1 @ P, on1 @ V
        p0, v0 = P.sum() - p1, V.sum() - v1
        best = float(((EVERY - 1) * np.maximum(p0, p1) + np.maximum(p0 + v0, p1 + v1)).min())
    else:
        best = local_search(P, V)
    print(
        f"{model}: {len(P)} layers, preconditioning {P.sum():.3f} s a step, inversions {V.sum():.3f} s a period "
        f"(largest layer {V.max():.3f} s); a period perfectly shared {shared:.3f} s, by the best whole layers "
        f"{best:.3f} s: +{(best - shared) / EVERY:.4f} s a step"
    )
