"""The plan's life on this rank: made at the start, made again where an input changes, laid onto the layers.

A step plan (:func:`~kfacflow.kfac.planning.plan.make_plan`) is made again only where one of its inputs
changes: the layers in use (known after the first step, or from a checkpoint), the layers trained
(a frozen layer leaves K-FAC: :func:`~kfacflow.kfac.follow.follow_model`), the stages
(:meth:`PlanLife.reconfigure`), when the factors are expected (for a pipeline that inverts them as
they arrive), or the layers' measured preconditioning (:meth:`PlanLife.place_measured`). Each plan
is laid onto the slots, the schedule's turns, the communicator's routes and the factors this rank
keeps (:func:`~kfacflow.kfac.planning.routes.place`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from torch import Tensor

from kfacflow.kfac.communicator import Communicator
from kfacflow.kfac.follow import follow_model
from kfacflow.kfac.hooks.capture import Capture
from kfacflow.kfac.hooks.rows import RowCapture
from kfacflow.kfac.hooks.watch import Claims, trained
from kfacflow.kfac.layers import KFACLayer
from kfacflow.kfac.planning.measured import LayerTimes, worth_moving
from kfacflow.kfac.planning.plan import EngineCaps, StepPlan, make_plan
from kfacflow.kfac.planning.routes import place
from kfacflow.kfac.planning.schedule import Schedule
from kfacflow.kfac.stages.contracts import EVERY_RANK, FactorSlot
from kfacflow.kfac.state import FactorState
from kfacflow.kfac.strategies.contracts import Engine, StageSet, choice_of
from kfacflow.perf import Profile

# The orchestrator's log, where re-planning was always reported (what a reader, or a filter, looks for).
logger = logging.getLogger("kfacflow.kfac.preconditioner")


def describe(layers: list[KFACLayer], stages: StageSet, slots: list[FactorSlot]) -> None:
    """Log what K-FAC runs: layers, fusion, placement, inverse method, the largest factor, the shared inverses."""
    logger.info(
        "K-FAC on %d layers (%s, %s, %s); largest factor %d; %d of %d inverses on every rank",
        len(layers),
        type(stages.fusion).__name__,
        getattr(stages.placement, "name", type(stages.placement).__name__),
        type(stages.invert).__name__,
        max(slot.dim for slot in slots),
        sum(slot.owner == EVERY_RANK for slot in slots),
        len(slots),
    )


def rows_pay(stages: StageSet) -> Callable[[int, int, int], bool]:
    """The precondition stage's ``rows_pay``; a stage written before rows existed never takes them."""
    return getattr(stages.precondition, "rows_pay", lambda rows, a_dim, g_dim: False)


class PlanLife:
    """The step plan of a preconditioner's layers as laid onto this rank, and every change of it.

    It holds what a plan decides here: the slots (who inverts each factor), the inversion order,
    the layer order, the buckets of updates, the gradients routed to owners, the communicator
    (whose routes the plan sets); strategies read them through :class:`~kfacflow.kfac.strategies.contracts.Routes`.

    Args:
        layers: The layers K-FAC preconditions.
        stages: The built stages.
        profile: Performance models (the placement and the schedule of inversions use them).
        placement_steps: Steps the layers' preconditioning is timed, to place them by (``kfac.placement_steps``).
        engine: The communication engine and the step's timer.
        schedule: The steps' schedule (its turns are given from each plan).
        state: The running state (what a new plan gives this rank to keep and to invert).
        capture: The factor hooks (the layers in use; where the factors go).
        rows: The rows of the layers preconditioned from them (they weigh the layers).
        claims: The layers this preconditioner holds (a frozen one is released).
        comm: Where the step's factors are summed.
        make: The planner (:func:`~kfacflow.kfac.planning.plan.make_plan`, as the orchestrator's module names it).
    """

    def __init__(
        self,
        layers: list[KFACLayer],
        stages: StageSet,
        profile: Profile | None,
        placement_steps: int,
        engine: Engine,
        schedule: Schedule,
        state: FactorState,
        capture: Capture,
        rows: RowCapture,
        claims: Claims,
        comm: Communicator,
        make: Callable[..., StepPlan] = make_plan,
    ) -> None:
        self.layers, self.stages, self.profile, self.placement_steps = layers, stages, profile, placement_steps
        self.engine, self.schedule, self.state = engine, schedule, state
        self.capture, self.rows, self.claims, self.comm, self.make = capture, rows, claims, comm, make
        self.measure()
        self.replan()

    def measure(self) -> None:
        """Time the layers' preconditioning anew (``kfac.placement_steps``); until then place by the estimates."""
        self.seconds: dict[str, float] = {}
        """Each layer's preconditioning seconds a step as measured, by name: what the placement weighs the layers
        by instead of its estimates."""
        self._measured: dict[str, float] | None = None
        """The means :attr:`layer_times` took, until the next period starts and they are placed by."""
        self.layer_times = LayerTimes(self.placement_steps, self.engine.backend.device)

    def replan(self, ready: dict[str, float] | None = None, catch_up: bool = True) -> None:
        """Make a slot per factor of :attr:`layers` and the step's :class:`~kfacflow.kfac.planning.plan.StepPlan`.

        Again only when an input of the plan changes: the layers in use (known after the first
        step), the stages, when the factors are expected (``ready``, for a pipeline that
        inverts them as they arrive), or the layers' measured costs (:meth:`place_measured`).
        ``catch_up``: invert at once what the new plan gives this rank (:meth:`.FactorState.invert_given`).
        """
        self.slots = self.state.slots = [FactorSlot(layer, side) for layer in self.layers for side in ("A", "G")]  # type: ignore[arg-type]
        self.trained = trained(self.layers)
        """Whether each layer's weight and bias were trained when the plan was made."""
        self.ready = ready
        """When each factor was expected to arrive as the plan was made (``None``: all at once)."""
        self.plan = self._new_plan(ready)
        placed = place(self.plan, self.layers, self.slots, self.engine.backend, self.profile)
        self._order, self.layer_order, self.grad_owned = placed.order, placed.layer_order, placed.grad_owned
        self.give_turns()
        self.update_buckets, self.gathered = placed.update_buckets, placed.gathered
        self.comm.routing, self.state.held = placed.routing, placed.held
        self.state.keep_held()
        if catch_up:
            self.state.invert_given()

    def _new_plan(self, ready: dict[str, float] | None) -> StepPlan:
        """The :class:`~kfacflow.kfac.planning.plan.StepPlan` of :attr:`layers` as things stand (changes nothing)."""
        world = self.engine.backend.world_size
        times = [ready.get(key, 0.0) for key in self.keys] if ready is not None else None
        rows = [self.rows.planned.get(layer.name, 0) * world for layer in self.layers] if self.rows.planned else None
        seconds = [self.seconds.get(layer.name) for layer in self.layers] if self.seconds else None
        return self.make(
            [(layer.a_dim, layer.g_dim, sum(p.numel() for p in layer.params)) for layer in self.layers],
            choice_of(self.stages),
            world,
            self.profile,
            EngineCaps.of(self.engine.backend),
            settled=self.capture.uses is not None,
            ready=times,
            rows=rows,
            inverse_every=self.schedule.inverse_every,
            staggered=self.schedule.staggered > 0,
            seconds=seconds,
        )

    def give_turns(self) -> None:
        """Give each factor its turn of a staggered period (from a new plan, or new intervals)."""
        self.schedule.plan(self.keys, self.plan.dims, self.plan.owners, self.engine.backend.world_size)

    def place_measured(self, seconds: dict[str, float]) -> bool:
        """Place whole layers again by each one's preconditioning ``seconds`` a step (by name; others: estimated).

        Between steps, on every rank with the same ``seconds``; collective where the placement changes and
        owners alone keep their running averages. Call it where an inverse period starts: the first step
        of the period inverts every factor on its new owner (with a staggered schedule, each rank inverts
        what it takes on at once). The layers move only where the times say a period gets shorter by
        :data:`~kfacflow.kfac.planning.measured.GAIN` or more. Returns whether any layer changed owner.
        """
        kept, self.seconds = self.seconds, dict(seconds)
        plan = self._new_plan(self.ready)
        before, after = self.plan.owners, plan.owners
        moved = sum(before[j : j + 2] != after[j : j + 2] for j in range(0, len(after), 2))
        if plan.work is not None:  # whole layers, both factors on one owner
            old, new, taken = worth_moving(plan.work, before[::2], after[::2], self.engine.backend.world_size)
            logger.info(
                "K-FAC: an inverse period by the layers' measured preconditioning: %.3f s as placed, %.3f s "
                "with %d of %d layers moved: %s before step %d",
                old,
                new,
                moved,
                len(after) // 2,
                "moved" if taken else "kept as placed",
                self.schedule.steps,
            )
            if not taken:
                self.seconds = kept  # nor may a later plan (new arrival times) move them
                return False
        if not moved:  # placed by something other than the layers' work
            return False
        self.state.running = self.every_average()
        self.state.route(self.stages.factor_exchange, self.capture, self.comm, set(self.state.running))
        self.replan(self.ready, catch_up=self.schedule.staggered > 0 or not self.schedule.inverts())
        return True

    def end_step(self) -> None:
        """Where the layers' timed steps are over, place them by those times once the next inverse period starts."""
        measured = self.layer_times.end_step(self.engine.backend, self.layers)
        self._measured = measured or self._measured
        if self._measured is not None and self.schedule.steps % self.schedule.inverse_every == 0:
            self.place_measured(self._measured)
            self._measured = None

    def arrived(self) -> None:
        """After a step's factors arrived: plan again where they are now expected at other times."""
        ready = self.stages.pipeline.expected(self.comm.groups, self.profile, self.ready)
        # Known from the first step on, the layers in use let factors and gradients go to their owners.
        if ready != self.ready or self.plan.provisional:
            self.replan(ready)

    def keep_layers(self, names: set[str]) -> None:
        """Plan for the layers named alone (those in use)."""
        self.layers = [layer for layer in self.layers if layer.name in names]
        self.replan()

    def restart(self) -> None:
        """A new communicator (the fusion's groups start again) and a new plan."""
        self.comm = Communicator(self.engine.backend, self.stages.fusion, self.engine.timer)
        self.capture.push = self.comm.push
        # Both callers took every average onto every rank first.
        self.state.route(self.stages.factor_exchange, self.capture, self.comm, set(self.state.running))
        self.replan()

    def reconfigure(self, stages: StageSet, profile: Profile | None = None) -> None:
        """Run other stages from the next step on (collective where owners alone keep running averages)."""
        self.state.running = self.every_average()
        self.stages = stages
        self.state.method = stages.invert
        self.rows.pays = rows_pay(stages)
        self.profile = profile or self.profile
        self.measure()  # other stages precondition at other costs
        self.restart()

    def follow_layers(self) -> None:
        """If the trained layers changed since the plan, plan again and refresh all now (:func:`.follow_model`)."""
        if trained(self.layers) != self.trained:
            self.layers, changes = follow_model(self, self.trained)
            self.measure()
            message = "K-FAC follows the model: %s; planned again, every factor and inverse refreshed at step %d"
            logger.info(message, changes, self.schedule.steps)
            self.restart()
            self.schedule.refresh()
            self.capture.active = True

    def every_average(self) -> dict[str, Tensor]:
        """Every running average, up to date, on this rank (collective: the sums held, then the factor sync's)."""
        self.state.settle()
        return self.stages.factor_sync.every_average(self.state, self, self.engine)

    def owned_elsewhere(self) -> set[str]:
        """The layers whose averaged gradient this rank never reads: another rank's, where gradients go to owners.

        Their owner preconditions them and sends the update and its ``v.g``; the other ranks' copies of
        such a layer's gradient are left as the backward pass made them
        (:class:`~kfacflow.kfac.strategies.grad_sync.ToOwners`).
        """
        if not self.grad_owned:
            return set()
        rank = self.engine.backend.rank
        return {slot.layer.name for slot in self.slots if slot.owner not in (EVERY_RANK, rank)}

    @property
    def order(self) -> list[FactorSlot]:
        """The plan's inversion order, of the factors this step inverts (``kfac.inverse_schedule``)."""
        return [slot for slot in self._order if self.schedule.due(slot.key)]

    @property
    def keys(self) -> list[str]:
        """The factors' keys, A1, G1, A2, G2, ..."""
        return [slot.key for slot in self.slots]

    @property
    def owners(self) -> list[int]:
        """Who inverts each factor, in the order of :attr:`keys`."""
        return [slot.owner for slot in self.slots]
