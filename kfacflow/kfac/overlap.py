"""How a step overlaps its phases: the pipeline, what a broadcast carries, where factors and gradients are summed.

None of these changes the mathematics: every combination gives the parameters of D-KFAC
(``tests/test_stage_equivalence.py``); they change when work starts and what waits for what.
"""

from __future__ import annotations

from kfacflow.kfac.stages import Broadcast, FactorSync, GradSync, Pipeline
from kfacflow.registry import BROADCASTS, FACTOR_SYNCS, GRAD_SYNCS, PIPELINES

PIPELINES.add("barrier", Pipeline(False, False), "all factors, then all inverses, then every layer (the paper)")
PIPELINES.add("invert_on_arrival", Pipeline(True, False), "each factor inverted as soon as its all-reduce completes")
PIPELINES.add(
    "arrival",
    Pipeline(True, True),
    "each factor inverted as soon as its all-reduce completes, each layer preconditioned once its inverses arrive",
)
BROADCASTS.add("packed", Broadcast(owner_keeps=False), "every rank, the owner too, unpacks the broadcast copy")
BROADCASTS.add(
    "owner_keeps", Broadcast(owner_keeps=True), "the owner keeps its inverse where the unpacked copy would be bit-equal"
)
BROADCASTS.add(
    "full",
    Broadcast(owner_keeps=True, full=True),
    "whole matrices: twice the bytes, no packing or unpacking on any rank",
)
BROADCASTS.add(
    "update",
    Broadcast(owner_keeps=True, update=True),
    "a layer's owner inverts both factors, preconditions it and broadcasts the update; no inverse travels",
)
BROADCASTS.add(
    "fused_update",
    Broadcast(owner_keeps=True, update=True, fused=True),
    "as update, the updates summed into zero-filled buckets (one all-reduce each): one start-up per bucket",
)
GRAD_SYNCS.add("overlap", GradSync(deferred=False), "gradients all-reduced during backward (DDP, Horovod)")
GRAD_SYNCS.add(
    "deferred",
    GradSync(deferred=True),
    "gradients all-reduced after backward, behind the factors, awaited to precondition",
)
GRAD_SYNCS.add(
    "owner",
    GradSync(deferred=True, to_owner=True),
    "as deferred, but each owned layer's gradients reduced to its owner alone where that costs less "
    "(kfac.broadcast=update, three ranks or more)",
)
FACTOR_SYNCS.add("allreduce", FactorSync(to_owner=False), "factors summed on every rank (the paper)")
FACTOR_SYNCS.add(
    "owner",
    FactorSync(to_owner=True),
    "each factor reduced to its owner alone, who alone keeps its running average (kfac.broadcast=update)",
)
