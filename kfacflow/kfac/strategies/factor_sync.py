"""Strategy *factor sync*: where a step's factors are summed, and who keeps their running averages.

``kfac.factor_sync`` names one. :class:`AllReduce` sums every factor on every rank, as the paper
does (every rank may invert anything). :class:`Owner` (with an exchange where owners precondition
their layers, so no other rank ever reads a layer's factors) has each factor reduced to its owner
alone, who alone keeps its running average; the plan says where (only where the engine reduces to
one rank), and the orchestrator routes by the plan. Asked for every average (a checkpoint, a new
plan), it brings each owner's to every rank.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import ClassVar

from torch import Tensor

from kfacflow.kfac.owners import every_running
from kfacflow.kfac.planning.plan import Choice
from kfacflow.kfac.strategies.contracts import OWNERS_READ_FACTORS, Engine, FactorSync, Routes, State
from kfacflow.registry import FACTOR_SYNCS


class AllReduce(FactorSync):
    """Factors summed on every rank; every rank keeps every running average."""

    def every_average(self, state: State, plan: Routes, engine: Engine) -> dict[str, Tensor]:
        """Every rank has them."""
        return state.running


class Owner(AllReduce):
    """Each factor reduced to its owner alone, who alone keeps its running average; NCTs still all-reduced."""

    needs: ClassVar[Mapping[str, str]] = {OWNERS_READ_FACTORS: "allreduce"}
    does = "leaves each factor on its owner alone"

    def shape(self, choice: Choice) -> Choice:
        """The plan reduces each factor to its owner (where the engine can)."""
        return replace(choice, factor_to_owner=True)

    def every_average(self, state: State, plan: Routes, engine: Engine) -> dict[str, Tensor]:
        """The owners' averages on every rank (collective)."""
        return every_running(state.running, plan.slots, engine.backend)


FACTOR_SYNCS.add("allreduce", AllReduce(), "factors summed on every rank (the paper)")
FACTOR_SYNCS.add(
    "owner",
    Owner(),
    "each factor reduced to its owner alone, who alone keeps its running average (kfac.broadcast=update)",
)
