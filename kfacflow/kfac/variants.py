"""Variants are presets of the stage choices: SPD-KFAC, MPD-KFAC, D-KFAC, and plain SGD for comparison."""

from __future__ import annotations

from dataclasses import dataclass

from kfacflow.config import KFACConfig
from kfacflow.kfac import overlap  # noqa: F401  (registers the broadcasts resolve looks up)
from kfacflow.kfac.stages import Variant
from kfacflow.registry import BROADCASTS, GRAD_SYNCS, VARIANTS

__all__ = ["PRESETS", "Stages", "Variant", "resolve"]


@dataclass(frozen=True)
class Stages:
    """The stage names in force after the recipe's explicit choices override the variant's."""

    fusion: str
    placement: str
    inverse: str
    preconditioned: bool
    pipeline: str = "barrier"
    broadcast: str = "packed"
    grad_sync: str = "overlap"
    factor_sync: str = "allreduce"
    choose: bool = False


def resolve(cfg: KFACConfig) -> Stages:
    """Return the stages of ``cfg.variant`` with any explicit ``kfac.<stage>`` choice winning.

    A preset's ``factor_sync=owner`` gives way to ``allreduce``, and its ``grad_sync=owner`` to
    ``deferred``, where the recipe chose a broadcast of inverses (every rank then needs every factor
    and every gradient); asked for by name, they are checked instead.
    """
    v = VARIANTS.get(cfg.variant)
    broadcast = cfg.broadcast or v.broadcast
    update = BROADCASTS.get(broadcast).update
    factor_sync = cfg.factor_sync or (v.factor_sync if update else "allreduce")
    grad_sync = cfg.grad_sync or (v.grad_sync if update or not GRAD_SYNCS.get(v.grad_sync).to_owner else "deferred")
    return Stages(
        fusion=cfg.fusion or v.fusion,
        placement=cfg.placement or v.placement,
        inverse=cfg.inverse or v.inverse,
        preconditioned=v.preconditioned,
        pipeline=cfg.pipeline or v.pipeline,
        broadcast=broadcast,
        grad_sync=grad_sync if v.preconditioned else "overlap",
        factor_sync=factor_sync,
        choose=v.choose,
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
        grad_sync="owner",
        factor_sync="owner",
    ),
    "past the paper: SPD's fusion with large factors sent alone, whole layers to owners who precondition "
    "and send the update (in buckets where start-ups dominate), each factor and gradient reduced to its owner "
    "alone, Cholesky factors, inversion as factors arrive, gradients behind the inversions",
)
VARIANTS.add(
    "auto",
    Variant(choose=True),
    "D-KFAC for two steps, then the preset the simulator finds fastest on the second, traced step",
)
VARIANTS.add("sgd", Variant(preconditioned=False), "no preconditioner: the first-order optimizer alone")

PRESETS = ("d", "mpd", "spd", "flow")
"""The presets ``auto`` chooses from."""
