"""The K-FAC orchestrator: runs factor, communicate, invert and precondition each step; knows no policy.

What a step acts on lives in rooms of its own, which the strategies are handed instead of the orchestrator:
the running state (:mod:`~kfacflow.kfac.state`), the plan's life (:mod:`~kfacflow.kfac.plan_life`), the
layers' updates (:mod:`~kfacflow.kfac.layer_updates`), the step's run-time values
(:mod:`~kfacflow.kfac.planning.schedule`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch import Tensor, nn

from kfacflow import UserError
from kfacflow.comm.base import Backend
from kfacflow.configuration.schema import KFACConfig
from kfacflow.kfac.checkpoint import check_factors, check_layers, state_of
from kfacflow.kfac.communicator import Communicator
from kfacflow.kfac.delegated import Delegated
from kfacflow.kfac.finite import FiniteFlags
from kfacflow.kfac.gradients import Gradients
from kfacflow.kfac.hooks.capture import Capture
from kfacflow.kfac.hooks.rows import RowCapture
from kfacflow.kfac.hooks.watch import Claims, ForwardHooks
from kfacflow.kfac.layer_updates import LayerUpdates
from kfacflow.kfac.layers import KFACLayer, find_layers
from kfacflow.kfac.left_out import log_left
from kfacflow.kfac.multihead import HeldAttention
from kfacflow.kfac.plan_life import PlanLife, describe, rows_pay
from kfacflow.kfac.planning.measured import LayerTimes
from kfacflow.kfac.planning.plan import StepPlan, make_plan
from kfacflow.kfac.planning.schedule import Schedule
from kfacflow.kfac.sides.blocks import SideBlocks
from kfacflow.kfac.sides.cross_attention import CrossProjections
from kfacflow.kfac.sides.factors import SideParts
from kfacflow.kfac.sides.norms import NormDiagonals, find_norms
from kfacflow.kfac.sides.tied import TiedWeights, find_tied
from kfacflow.kfac.stages.contracts import FactorSlot
from kfacflow.kfac.stages.inverse import Inverse
from kfacflow.kfac.state import FactorState, dtypes
from kfacflow.kfac.strategies.contracts import Engine, StageSet
from kfacflow.perf import Profile
from kfacflow.timing import StepTimer


class Preconditioner:
    """Preconditions the gradients of a model's Linear and Conv2d layers with K-FAC (norms: :mod:`.norms`).

    Call :meth:`step` between the last ``loss.backward()`` of a step and ``optimizer.step()``.
    Hooks capture the layer inputs (A) and output gradients (G) on the steps that update
    factors and hand each packed factor to the communicate stage as soon as it is complete
    (:mod:`kfacflow.kfac.hooks.capture`); a hook on the model itself tells them when a forward pass
    ends (:meth:`end_forward`, which may also be called by hand).

    Args:
        model: The network (unwrapped; hooks go on its modules).
        cfg: The ``kfac`` section of the recipe (hyperparameters and ``skip``).
        stages: The built stages (:func:`kfacflow.running.build.stages`).
        backend: The communication engine.
        profile: Performance models (the placement and the schedule of inversions use them).
        timer: Where stage times and (when tracing) per-layer events go.
        accumulate: Forward/backward passes (micro-batches) per step, each loss divided by it.
        batch_dim: The dimension of the model's first tensor input that counts its examples (the
            ``N`` of the batch-mean loss, which G undoes: :mod:`kfacflow.kfac.hooks.watch`).

    Raises:
        UserError: If the model has no layer K-FAC can precondition, or another preconditioner
            already hooks one of its layers.
    """

    def __init__(
        self,
        model: nn.Module,
        cfg: KFACConfig,
        stages: StageSet,
        backend: Backend,
        profile: Profile | None = None,
        timer: StepTimer | None = None,
        accumulate: int = 1,
        batch_dim: int = 0,
    ) -> None:
        self.cfg = cfg
        self.backend = backend
        # Without a training loop's timer nothing closes a step: time nothing (no spans, no CUDA events).
        self.timer = timer or StepTimer(backend.device, enabled=False)
        self.engine = Engine(backend, self.timer)
        kinds = tuple(cfg.kinds)
        norms, tied = find_norms(model, list(cfg.skip), kinds), find_tied(model, list(cfg.skip), kinds)
        beside = {norm.name: norm.module for norm in norms} | {
            layer.name: layer.module for pair in tied for layer in (pair.embedding, pair.head)
        }
        layers = find_layers(model, list(cfg.skip), kinds, beside)
        if not layers:
            raise UserError(
                "kfac: the model has no Linear or Conv2d layer K-FAC can precondition "
                "(check kfac.skip, or use kfac.variant=sgd)."
            )
        modules = {layer.name: layer.module for layer in layers}
        self.claims = Claims(modules | beside)
        try:  # MultiheadAttention modules call their projections as modules from here on (until remove())
            self.attention = HeldAttention(model, modules)
        except UserError:
            self.claims.release()
            raise
        factor_dtype, inverse_dtype = dtypes(cfg, next(layers[0].module.parameters()).dtype)
        comm = Communicator(backend, stages.fusion, self.timer)
        keep, gather = cfg.factor_examples, (backend.gather_objects if backend.world_size > 1 else None)
        self.capture = Capture(layers, stages.factor, comm.push, self.timer, accumulate, factor_dtype, keep, gather)
        self.schedule = Schedule(cfg)
        decay = lambda: cfg.factor_decay  # noqa: E731
        self.state = FactorState(self.engine, self.schedule, (factor_dtype, inverse_dtype), stages.invert, decay)
        self.state.route(stages.factor_exchange, self.capture, comm)
        self.batch_dim = batch_dim
        self.rows = RowCapture(layers, backend, rows_pay(stages), inverse_dtype, self.capture, self.timer)
        self.hooks = ForwardHooks(model, self, backend.device)
        # The planner by this module's name: what a caller wraps to count or vary the plans.
        parts = (self.engine, self.schedule, self.state, self.capture, self.rows, self.claims, comm)
        self.life = PlanLife(layers, stages, profile, cfg.placement_steps, *parts, make_plan)
        side = SideParts(self.capture, self.engine, self.schedule, self.finite, decay, inverse_dtype)
        self.norms, self.tied = NormDiagonals(norms, side), TiedWeights(tied, side)
        self.cross = CrossProjections(self.attention.blocks, side)
        self.sides = SideBlocks({"norms": self.norms, "tied": self.tied, "cross": self.cross})
        self.updates = LayerUpdates(self.state, self.life, self.rows, self.engine, self.sides)
        describe(layers, stages, self.life.slots)
        log_left(model, self.params, kinds)

    # What callers holding the orchestrator alone (the trainer, the library, tests) read of its rooms.
    running = Delegated[dict[str, Tensor]]("state")
    inverses = Delegated[dict[str, Inverse]]("state")
    finite = Delegated[FiniteFlags]("state")
    stages = Delegated[StageSet]("life")
    profile = Delegated[Profile | None]("life")
    layers = Delegated[list[KFACLayer]]("life")
    slots = Delegated[list[FactorSlot]]("life")
    plan = Delegated[StepPlan]("life")
    comm = Delegated[Communicator]("life")
    layer_times = Delegated[LayerTimes]("life")
    order = Delegated[list[FactorSlot]]("life")
    keys = Delegated[list[str]]("life")
    owners = Delegated[list[int]]("life")
    update_buckets = Delegated[dict[str, list[str]]]("life")
    gathered = Delegated[set[str]]("life")
    grad_owned = Delegated[list[list[Tensor]]]("life")
    _ready = Delegated[dict[str, float] | None]("life", "ready")
    steps = Delegated[int]("schedule")

    grad_scaler: Any = None
    """The ``torch.amp.GradScaler`` of a float16 loss, or ``None``: its scale goes to the G hooks after each
    forward pass (on the device), so G is of the unscaled output gradients. Unscale gradients before :meth:`step`."""

    @property
    def params(self) -> list[Tensor]:
        """Every parameter preconditioned: the layers' weights and trained biases, the side blocks' (norms, tied...)."""
        return [p for layer in self.layers for p in layer.params] + self.sides.params

    def reconfigure(self, stages: StageSet, profile: Profile | None = None) -> None:
        """Run other stages from the next step on (between steps; the mathematics is the same).

        ``profile`` replaces the planning profile; collective where owners alone keep their running averages.
        """
        self.life.reconfigure(stages, profile)

    def place_measured(self, seconds: dict[str, float]) -> bool:
        """Place whole layers again by their preconditioning ``seconds`` (:meth:`.PlanLife.place_measured`)."""
        return self.life.place_measured(seconds)

    def sends_factors(self) -> bool:
        """Whether this step sums factors over ranks after its backward pass (:meth:`.GradSync.for_step` is told)."""
        return self.state.sends()

    def rebuilt(self) -> list[Tensor]:
        """The parameters whose averages the step rebuilds from rows (:meth:`.RowCapture.leave`): none need travel."""
        if self.backend.world_size == 1:
            return []
        return [p for layer in self.layers if self.rows.chosen(layer.name) for p in layer.params]

    def follow_layers(self) -> None:
        """If the trained layers changed since the plan, plan again and refresh all now (:func:`.follow_model`)."""
        self.life.follow_layers()

    def end_forward(self) -> None:
        """Tell the factor and communicate stages a forward pass is over (a hook on the model calls it).

        Calling it again for the same pass does nothing.
        """
        if self.schedule.factors() and self.capture.end_forward() and self.sends_factors():
            with self.timer.span("FactorComm"):
                self.comm.end_forward()

    # --- the step ------------------------------------------------------------------------------

    def step(self, lr: float, gradients: Gradients | None = None) -> None:
        """Update factors and inverses when due, then precondition every layer's gradient in place.

        Args:
            lr: The learning rate the optimizer will use (for KL clipping).
            gradients: This step's gradient all-reduce when it is deferred (``kfac.grad_sync=deferred``):
                launched once the factors are, waited for to precondition.
        """
        self.finite.warn()  # the last step's factors: the device finished them long ago
        if gradients is not None:  # not averaged yet: the layers that go by rows rebuild theirs from them
            gradients.leave(self.rows.leave(self.layers))
        arrivals = self._arrivals(gradients)
        self.sides.launch()  # behind the factors and the gradients
        sends, exchange = self.sends_factors(), self.state.exchange
        exchange.opening(self.backend, sends)
        self.rows.post(self.layers)  # behind the factors on the link
        pipeline, broadcast = self.stages.pipeline, self.stages.broadcast
        sent = pipeline.run(broadcast, self.state, self.life, self.engine, arrivals, self.schedule.inverts())
        exchange.closing(sends)
        self.updates.precondition(lr, sent, gradients)
        self.finite.copy()
        self._next_step()

    def skip_step(self, gradients: Gradients | None = None) -> None:
        """Drop this step's factors (the step is skipped on every rank), keeping collectives in step."""
        for _ in self._arrivals(gradients):
            pass
        if gradients is not None:
            gradients.wait()
        self.state.exchange.drop()
        self.sides.reset()
        self._next_step(refreshed=False)

    def set_intervals(self, factor_update_freq: int, inv_update_freq: int) -> None:
        """Change the update intervals from this step on (schedules of the step, as the library API takes)."""
        self.schedule.set_intervals(factor_update_freq, inv_update_freq)
        self.life.give_turns()
        self.capture.active = self.schedule.factors()

    def _next_step(self, refreshed: bool = True) -> None:
        self.rows.reset()
        self.schedule.advance(refreshed)
        self.capture.active = self.schedule.factors()
        self.life.end_step()

    def _arrivals(self, gradients: Gradients | None) -> Iterator[dict[str, Tensor]]:
        """Hand over the factors still held; yield each reduction's averages as it completes, in launch order.

        The step's own gradient traffic (routed by the plan) is posted behind every factor. On the
        first capturing step the layers that never ran are dropped here, before anything is inverted.
        """
        if gradients is not None:
            gradients.route(self.grad_owned)
        if not self.schedule.factors():
            return iter(())
        exchanges = self.sends_factors()
        with self.timer.span("FactorComm"):
            if self.capture.close_forward() and exchanges:
                self.comm.end_forward()
            dropped = self.capture.finish()
            if exchanges:
                self.comm.end_backward()
            if gradients is not None:
                gradients.launch()  # behind every factor on the link
        if dropped:
            self.life.keep_layers({layer.name for layer in self.capture.layers})
        if not exchanges:  # the factors stay in this rank's sums (kfac.factor_exchange=inversion)
            self.capture.reset()
            return iter(())
        return self._averaged()

    def _averaged(self) -> Iterator[dict[str, Tensor]]:
        groups = self.comm.arrivals()
        while True:
            with self.timer.span("FactorComm"):
                averaged = next(groups, None)
            if averaged is None:
                break
            yield averaged
        self.capture.reset()
        self.life.arrived()

    def average(self, averaged: dict[str, Tensor]) -> list[str]:
        """Blend arrived factors into their running averages (:meth:`.FactorState.average`); return their keys."""
        return self.state.average(averaged)

    def settle(self) -> None:
        """Exchange the factor sums ranks hold since the last exchange now (collective; :meth:`.FactorState.settle`)."""
        self.state.settle()

    @property
    def factors(self) -> dict[str, Tensor]:
        """The running averages as full symmetric matrices, for inspection (:meth:`.FactorState.factors`)."""
        return self.state.factors()

    def mean_clip_scale(self) -> float | None:
        """The mean KL clipping scaled the updates by since the last call (:meth:`.LayerUpdates.mean_clip_scale`)."""
        return self.updates.mean_clip_scale()

    # --- checkpoints ------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Return factors, inverses, the step counter and the layers in use (collective: :func:`.state_of`)."""
        inverses = self.stages.broadcast.every_inverse(self.state, self.life, self.engine)
        state = state_of(inverses, self.life.every_average(), self.steps, self.capture)
        state["clip_sum"] = self.updates.saved()
        state.update(self.sides.saved())
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (onto this run's device and dtypes).

        Raises:
            UserError: If the checkpoint's factors belong to other layers than this model's
                (another model, or another ``kfac.skip``).
        """
        check_layers(state, {layer.name for layer in self.capture.layers})
        if state.get("layers") is not None:
            # a checkpoint without passes is from before passes were learnt: one a micro-batch then
            self.capture.set_uses(state["layers"], state.get("passes") or self.capture.accumulate)
            self.life.keep_layers(set(state["layers"]))
        check_factors(state, self.slots)
        self.schedule.steps = int(state["steps"])
        owners = {s.key: s.owner for s in self.slots}
        holds = lambda key: self.stages.broadcast.holds(owners.get(key), self.backend.rank)  # noqa: E731
        self.state.restore(state, holds, self.stages.factor_exchange, self.capture)
        self.updates.restore(state.get("clip_sum"), self.backend.device)
        self.sides.restore(state)
        self.capture.active = self.schedule.factors()

    def remove(self) -> None:
        """Remove the hooks (another preconditioner may then take the model)."""
        self.capture.remove()
        self.sides.remove()
        self.rows.remove()
        self.hooks.remove()
        self.attention.remove()
        self.claims.release()
