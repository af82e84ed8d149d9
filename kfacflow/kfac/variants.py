"""Variants are presets of the stage choices: SPD-KFAC, MPD-KFAC, D-KFAC, and plain SGD for comparison."""

from __future__ import annotations

from dataclasses import dataclass

from kfacflow.config import KFACConfig
from kfacflow.kfac.stages import Variant
from kfacflow.registry import VARIANTS

__all__ = ["Stages", "Variant", "resolve"]


@dataclass(frozen=True)
class Stages:
    """The stage names in force after the recipe's explicit choices override the variant's."""

    fusion: str
    placement: str
    inverse: str
    preconditioned: bool


def resolve(cfg: KFACConfig) -> Stages:
    """Return the stages of ``cfg.variant`` with any explicit ``kfac.fusion/placement/inverse`` winning."""
    v = VARIANTS.get(cfg.variant)
    return Stages(
        fusion=cfg.fusion or v.fusion,
        placement=cfg.placement or v.placement,
        inverse=cfg.inverse or v.inverse,
        preconditioned=v.preconditioned,
    )


VARIANTS.add("spd", Variant("optimal", "lbp"), "SPD-KFAC: pipelined factor all-reduce with Eq. 15 fusion, LBP inverses")
VARIANTS.add("mpd", Variant("after_backward", "round_robin"), "MPD-KFAC: factors after backward, inverses round robin")
VARIANTS.add("d", Variant(), "D-KFAC: factors all-reduced after backward, every rank inverts everything")
VARIANTS.add("sgd", Variant(preconditioned=False), "no preconditioner: the first-order optimizer alone")
