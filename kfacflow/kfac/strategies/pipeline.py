"""Strategy *pipeline*: when a step's inversions and preconditioning start (``kfac.pipeline``).

The paper's order is a barrier after each phase: every factor arrives, then every inverse is
computed and broadcast, then every layer is preconditioned. On arrival, a factor is averaged into
its running average and inverted as soon as its own reduction completes (the broadcast keeps the
order its collectives need), and with ``arrival`` a layer is preconditioned as soon as both of its
inverses are here. None of these changes the mathematics (``tests/test_stage_equivalence.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import TYPE_CHECKING

from torch import Tensor

from kfacflow.kfac.planning.plan import Choice
from kfacflow.kfac.stages.fusion import estimated_arrivals
from kfacflow.kfac.strategies.contracts import Broadcast, Engine, Pipeline, Routes, Sent, State
from kfacflow.registry import PIPELINES

if TYPE_CHECKING:
    from kfacflow.perf import Profile


class Barrier(Pipeline):
    """All factors, then all inverses, then every layer."""

    def run(
        self,
        broadcast: Broadcast,
        state: State,
        plan: Routes,
        engine: Engine,
        arrivals: Iterator[dict[str, Tensor]],
        inverting: bool,
    ) -> list[Sent]:
        """Average every factor as it comes; then, where the step inverts, invert and post in the plan's order."""
        for averaged in arrivals:
            state.average(averaged)
        return broadcast.invert(state, engine, plan.order) if inverting else []

    def early(self, apply: Callable[[], None]) -> None:
        """Nothing before every inverse is here."""

    def expected(
        self, groups: list[list[tuple[str, int]]], profile: Profile | None, ready: dict[str, float] | None
    ) -> dict[str, float] | None:
        """When the next step's factors are expected (what the plan orders inversions by): unchanged, unused."""
        return ready

    def arrived(self, ends: list[float], start: float) -> list[float]:
        """The simulator's :meth:`run`: when each factor is taken in, given when its collective ends: at the last."""
        return [max([start, *ends])] * len(ends)


class InvertOnArrival(Barrier):
    """Each factor inverted as soon as its reduction completes."""

    def shape(self, choice: Choice) -> Choice:
        """The plan orders inversions by when the factors are expected."""
        return replace(choice, on_arrival=True)

    def expected(
        self, groups: list[list[tuple[str, int]]], profile: Profile | None, ready: dict[str, float] | None
    ) -> dict[str, float] | None:
        """Estimated from this step's groups: the next step inverts in the order the factors come."""
        return estimated_arrivals(groups, profile.allreduce if profile else None)

    def arrived(self, ends: list[float], start: float) -> list[float]:
        """Each factor as its collective ends."""
        return ends

    def run(
        self,
        broadcast: Broadcast,
        state: State,
        plan: Routes,
        engine: Engine,
        arrivals: Iterator[dict[str, Tensor]],
        inverting: bool,
    ) -> list[Sent]:
        """Invert factors as they arrive (where the step inverts)."""
        if not inverting:
            return super().run(broadcast, state, plan, engine, arrivals, inverting)
        return broadcast.invert_arriving(state, plan, engine, arrivals)


class Arrival(InvertOnArrival):
    """As invert_on_arrival, and each layer preconditioned once both of its inverses are here."""

    def early(self, apply: Callable[[], None]) -> None:
        """Precondition what can be, now."""
        apply()


PIPELINES.add("barrier", Barrier(), "all factors, then all inverses, then every layer (the paper)")
PIPELINES.add("invert_on_arrival", InvertOnArrival(), "each factor inverted as soon as its all-reduce completes")
PIPELINES.add(
    "arrival",
    Arrival(),
    "each factor inverted as soon as its all-reduce completes, each layer preconditioned once its inverses arrive",
)
