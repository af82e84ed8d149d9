"""Variants are presets of the stage choices: SPD-KFAC, MPD-KFAC, D-KFAC, and plain SGD for comparison."""

from __future__ import annotations

from kfacflow.configuration.schema import KFACConfig
from kfacflow.kfac.stages.contracts import Variant
from kfacflow.kfac.strategies import (  # noqa: F401
    factor_sync,
    grad_sync,
    inverse_broadcast,
    pipeline,
    update_broadcast,
)
from kfacflow.kfac.strategies.contracts import KINDS, settle
from kfacflow.registry import VARIANTS

__all__ = ["PRESETS", "Stages", "Variant", "resolve"]


Stages = Variant
"""The stage names in force once the recipe's explicit choices override the variant's (:func:`resolve`)."""


def resolve(cfg: KFACConfig) -> Stages:
    """Return the stages of ``cfg.variant`` with any explicit ``kfac.<stage>`` choice winning.

    A preset's strategy whose need the recipe's own choices leave unmet gives way to its
    fallback (:func:`~kfacflow.kfac.strategies.contracts.settle`): e.g. ``factor_sync=owner`` to
    ``allreduce`` and ``grad_sync=owner`` to ``deferred`` where the recipe chose a broadcast of
    inverses (every rank then needs every factor and every gradient); asked for by name, they are
    checked instead (:func:`kfacflow.running.build.check_stages`).
    """
    v = VARIANTS.get(cfg.variant)
    named = {kind for kind in KINDS if getattr(cfg, kind)}
    chosen = settle({kind: getattr(cfg, kind) or getattr(v, kind) for kind in KINDS}, named)
    if not v.preconditioned:
        chosen["grad_sync"] = "overlap"
    return Stages(
        fusion=cfg.fusion or v.fusion,
        placement=cfg.placement or v.placement,
        inverse=cfg.inverse or v.inverse,
        preconditioned=v.preconditioned,
        factor_exchange=cfg.factor_exchange or v.factor_exchange,
        precondition=cfg.precondition or v.precondition,
        choose=v.choose,
        **chosen,
    )


VARIANTS.add("spd", Variant("optimal", "lbp"), "SPD-KFAC: pipelined factor all-reduce with Eq. 15 fusion, LBP inverses")
VARIANTS.add("mpd", Variant("after_backward", "round_robin"), "MPD-KFAC: factors after backward, inverses round robin")
VARIANTS.add("d", Variant(), "D-KFAC: factors all-reduced after backward, every rank inverts everything")
VARIANTS.add(
    "flow",
    Variant(
        "optimal_split",
        "layer",
        "cholesky_factor",
        pipeline="arrival",
        broadcast="fused_update",
        grad_sync="between",
        factor_sync="owner",
        factor_exchange="inversion",
        precondition="rows",
    ),
    "past the paper: SPD's fusion with large factors sent alone, whole layers to owners who precondition "
    "and send the update (in buckets where start-ups dominate), each factor and gradient reduced to its owner "
    "alone, Cholesky factors, inversion as factors arrive, gradients behind the inversions where factors travel "
    "(during backward elsewhere), factors summed over ranks only where inverted, layers preconditioned from their "
    "rows where that halves the work",
)
VARIANTS.add(
    "auto",
    Variant(choose=True),
    "D-KFAC for two steps, then the preset the simulator finds fastest on the second, traced step",
)
VARIANTS.add("sgd", Variant(preconditioned=False), "no preconditioner: the first-order optimizer alone")

PRESETS = ("d", "mpd", "spd", "flow")
"""The presets ``auto`` chooses from."""
