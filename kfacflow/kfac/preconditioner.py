"""The K-FAC orchestrator: runs factor, communicate, invert and precondition each step; knows no policy."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

from kfacflow import UserError
from kfacflow.comm.base import Backend
from kfacflow.config import KFACConfig
from kfacflow.kfac.capture import Capture
from kfacflow.kfac.checkpoint import check_factors, check_layers, restored, state_of
from kfacflow.kfac.communicator import Communicator, FusedSum
from kfacflow.kfac.exchange import LocalSums
from kfacflow.kfac.finite import FiniteFlags, blend
from kfacflow.kfac.follow import follow_model
from kfacflow.kfac.inverse import Inverse, invert_all
from kfacflow.kfac.layers import KFACLayer, find_layers
from kfacflow.kfac.measured import LayerTimes, worth_moving
from kfacflow.kfac.packing import unpack
from kfacflow.kfac.plan import EngineCaps, StepPlan, make_plan
from kfacflow.kfac.routes import describe, place
from kfacflow.kfac.rows import RowCapture
from kfacflow.kfac.schedule import Schedule
from kfacflow.kfac.stages import EVERY_RANK, FactorSlot
from kfacflow.kfac.strategies import Gradients, Sent, StageSet, choice_of
from kfacflow.kfac.watch import Claims, ForwardHooks, trained
from kfacflow.perf import Profile
from kfacflow.timing import StepTimer

logger = logging.getLogger(__name__)


def dtypes(cfg: KFACConfig, parameters: torch.dtype) -> tuple[torch.dtype, torch.dtype]:
    """Return the factors' dtype and the inverses' (``kfac.factor_dtype``, ``kfac.inverse_dtype``).

    ``auto``: factors in the parameters' dtype (float32 under mixed precision, whose activations are
    cast up), inverses in the factors' and at least float32 (half-precision Cholesky is not offered).
    """
    factor = parameters if cfg.factor_dtype == "auto" else getattr(torch, cfg.factor_dtype)
    if cfg.inverse_dtype == "auto":
        return factor, torch.promote_types(factor, torch.float32)
    return factor, getattr(torch, cfg.inverse_dtype)


def _rows_pay(stages: StageSet) -> Callable[[int, int, int], bool]:
    """The precondition stage's ``rows_pay``; a stage written before rows existed never takes them."""
    return getattr(stages.precondition, "rows_pay", lambda rows, a_dim, g_dim: False)


class Preconditioner:
    """Preconditions the gradients of a model's Linear and Conv2d layers with K-FAC.

    Call :meth:`step` between the last ``loss.backward()`` of a step and ``optimizer.step()``.
    Hooks capture the layer inputs (A) and output gradients (G) on the steps that update
    factors and hand each packed factor to the communicate stage as soon as it is complete
    (:mod:`kfacflow.kfac.capture`); a hook on the model itself tells them when a forward pass
    ends (:meth:`end_forward`, which may also be called by hand).

    Args:
        model: The network (unwrapped; hooks go on its modules).
        cfg: The ``kfac`` section of the recipe (hyperparameters and ``skip``).
        stages: The built stages (:func:`kfacflow.build.stages`).
        backend: The communication engine.
        profile: Performance models (the placement and the schedule of inversions use them).
        timer: Where stage times and (when tracing) per-layer events go.
        accumulate: Forward/backward passes (micro-batches) per step, each loss divided by it.
        batch_dim: The dimension of the model's first tensor input that counts its examples (the
            ``N`` of the batch-mean loss, which G undoes: :mod:`kfacflow.kfac.watch`).

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
        self.stages = stages
        self.backend = backend
        self.profile = profile
        # Without a training loop's timer nothing closes a step: time nothing (no spans, no CUDA events).
        self.timer = timer or StepTimer(backend.device, enabled=False)
        self.layers: list[KFACLayer] = find_layers(model, list(cfg.skip))
        if not self.layers:
            raise UserError(
                "kfac: the model has no Linear or Conv2d layer K-FAC can precondition "
                "(check kfac.skip, or use kfac.variant=sgd)."
            )
        self.claims = Claims({layer.name: layer.module for layer in self.layers})
        self.factor_dtype, self.inverse_dtype = dtypes(cfg, next(self.layers[0].module.parameters()).dtype)
        self.comm = Communicator(backend, stages.fusion, self.timer)
        self.capture = Capture(
            self.layers,
            stages.factor,
            self.comm.push,
            self.timer,
            accumulate,
            self.factor_dtype,
            keep=cfg.factor_examples,
            gather=backend.gather_objects if backend.world_size > 1 else None,
        )
        self.schedule = Schedule(cfg)
        self.local: LocalSums | None = None
        """With ``kfac.factor_exchange=inversion``: this rank's sums of its factors between exchanges."""
        self._local_sums()
        self.batch_dim = batch_dim
        self.rows = RowCapture(self.layers, backend, _rows_pay(stages), self.inverse_dtype, self.capture, self.timer)
        self.hooks = ForwardHooks(model, self, backend.device)
        self.running: dict[str, Tensor] = {}
        """Running averages of the factors, packed (upper triangles): half the memory and work."""
        self.inverses: dict[str, Inverse] = {}
        self.held: set[str] | None = None
        """With ``kfac.factor_sync=owner``: the factors whose running averages this rank keeps."""
        self.finite = FiniteFlags()
        self._clip_sum: tuple[Tensor, int] | None = None
        """The sum of the steps' KL clipping factors since :meth:`mean_clip_scale` last read it, and their count."""
        self.seconds: dict[str, float] = {}
        """Each layer's preconditioning seconds a step as measured (``kfac.placement_steps``), by name: what the
        placement weighs the layers by instead of its estimates."""
        self._measure()
        self._plan()
        describe(self.layers, stages, self.slots)

    def reconfigure(self, stages: StageSet, profile: Profile | None = None) -> None:
        """Run other stages from the next step on (between steps; the mathematics is the same).

        ``profile`` replaces the planning profile (another inverse method has other costs).
        Collective where the old stages kept each running average on its owner alone: every
        rank takes every average first, since the new placement may name other owners.
        """
        self.running = self.every_average()
        self.stages = stages
        self.rows.pays = _rows_pay(stages)
        self.profile = profile or self.profile
        self._measure()  # other stages precondition at other costs
        self._restart()

    def _measure(self) -> None:
        """Time the layers' preconditioning anew (``kfac.placement_steps``); until then place by the estimates."""
        self.seconds = {}
        self._measured: dict[str, float] | None = None
        """The means :attr:`layer_times` took, until the next period starts and they are placed by."""
        self.layer_times = LayerTimes(self.cfg.placement_steps, self.backend.device)

    def place_measured(self, seconds: dict[str, float]) -> bool:
        """Place whole layers again by each one's preconditioning ``seconds`` a step (by name; others: estimated).

        Between steps, on every rank with the same ``seconds``; collective where the placement changes and
        owners alone keep their running averages. Call it where an inverse period starts: the first step
        of the period inverts every factor on its new owner (with a staggered schedule, each rank inverts
        what it takes on at once). The layers move only where the times say a period gets shorter by
        :data:`~kfacflow.kfac.measured.GAIN` or more. Returns whether any layer changed owner.
        """
        kept, self.seconds = self.seconds, dict(seconds)
        plan = self._new_plan(self._ready)
        before, after = self.plan.owners, plan.owners
        moved = sum(before[j : j + 2] != after[j : j + 2] for j in range(0, len(after), 2))
        if plan.work is not None:  # whole layers, both factors on one owner
            old, new, taken = worth_moving(plan.work, before[::2], after[::2], self.backend.world_size)
            logger.info(
                "K-FAC: an inverse period by the layers' measured preconditioning: %.3f s as placed, %.3f s "
                "with %d of %d layers moved: %s before step %d",
                old,
                new,
                moved,
                len(after) // 2,
                "moved" if taken else "kept as placed",
                self.steps,
            )
            if not taken:
                self.seconds = kept  # nor may a later plan (new arrival times) move them
                return False
        if not moved:  # placed by something other than the layers' work
            return False
        self.running = self.every_average()
        self._local_sums(set(self.running))
        self._plan(self._ready, catch_up=self.schedule.staggered > 0 or not self.schedule.inverts())
        return True

    def _restart(self) -> None:
        """A new communicator (the fusion's groups start again) and a new plan."""
        self.comm = Communicator(self.backend, self.stages.fusion, self.timer)
        self.capture.push = self.comm.push
        self._local_sums(set(self.running))  # both callers took every average onto every rank first
        self._plan()

    def _local_sums(self, started: set[str] | None = None) -> None:
        """Route the capture's factors through this rank's sums where factors are exchanged only to invert."""
        if self.local is not None and self.local.sums:
            raise RuntimeError("K-FAC: local factor sums replaced before they were exchanged (settle() first)")
        if self.stages.factor_exchange != "inversion":
            self.local, self.capture.parts.takes_rows = None, None
            return
        decay = lambda: self.cfg.factor_decay  # noqa: E731
        self.local = LocalSums(decay, self.comm.push, self.sends_factors, started, self.timer)
        self.capture.push, self.capture.parts.takes_rows = self.local.push, self.local.takes_rows

    def sends_factors(self) -> bool:
        """Whether this step sums factors over ranks after its backward pass (what :meth:`.GradSync.for_step` is told).

        Every factor update, or only where it inverts (``kfac.factor_exchange=inversion``).
        """
        return self.schedule.factors() and (self.local is None or self.schedule.inverts())

    def rebuilt(self) -> list[Tensor]:
        """The parameters whose averages the step rebuilds from rows (:meth:`.RowCapture.leave`): none need travel."""
        if self.backend.world_size == 1:
            return []
        return [p for layer in self.layers if self.rows.chosen(layer.name) for p in layer.params]

    def _plan(self, ready: dict[str, float] | None = None, catch_up: bool = True) -> None:
        """Make a slot per factor of :attr:`layers` and the step's :class:`~kfacflow.kfac.plan.StepPlan`.

        Again only when an input of the plan changes: the layers in use (known after the first
        step), the stages, when the factors are expected (``ready``, for a pipeline that
        inverts them as they arrive), or the layers' measured costs (:meth:`place_measured`).
        ``catch_up``: invert at once what the new plan gives this rank (:meth:`_invert_given`).
        """
        self.slots = [FactorSlot(layer, side) for layer in self.layers for side in ("A", "G")]  # type: ignore[arg-type]
        self._trained = trained(self.layers)
        self._ready = ready
        self.plan = self._new_plan(ready)
        placed = place(self.plan, self.layers, self.slots, self.backend, self.profile)
        self._order, self.layer_order, self.grad_owned = placed.order, placed.layer_order, placed.grad_owned
        self.schedule.plan(self.keys, self.plan.dims, self.plan.owners, self.backend.world_size)
        self.update_buckets, self.gathered = placed.update_buckets, placed.gathered
        self.comm.routing, self.held = placed.routing, placed.held
        self._keep_held()
        if catch_up:
            self._invert_given()

    def _new_plan(self, ready: dict[str, float] | None) -> StepPlan:
        """The :class:`~kfacflow.kfac.plan.StepPlan` of :attr:`layers` as things stand (changes nothing)."""
        settled = self.capture.uses is not None
        layout = [(layer.a_dim, layer.g_dim, sum(p.numel() for p in layer.params)) for layer in self.layers]
        times = [ready.get(key, 0.0) for key in self.keys] if ready is not None else None
        world, caps, choice = self.backend.world_size, EngineCaps.of(self.backend), choice_of(self.stages)
        rows = [self.rows.planned.get(layer.name, 0) * world for layer in self.layers] if self.rows.planned else None
        every, staggered = self.cfg.inv_update_freq, self.schedule.staggered > 0
        seconds = [self.seconds.get(layer.name) for layer in self.layers] if self.seconds else None
        return make_plan(layout, choice, world, self.profile, caps, settled, times, rows, every, staggered, seconds)

    def _keep_held(self) -> None:
        if self.held is not None:  # another rank keeps the rest
            self.running = {key: avg for key, avg in self.running.items() if key in self.held}

    def _invert_given(self) -> None:
        """Invert the factors a plan made again gives this rank to invert, where it has their average but no inverse.

        The first step's plan is made again once the layers in use and those that go by rows are known
        (their rows weigh whole layers: :func:`~kfacflow.kfac.update_plan.layer_work`), after that step
        inverted by the first plan; every factor of it was averaged on every rank, so each rank can invert
        what it now owns. Before anything was inverted there is nothing to catch up.
        """
        if not self.inverses:
            return
        rank = self.backend.rank
        given = [s for s in self.slots if s.owner in (EVERY_RANK, rank) and s.key not in self.inverses]
        self.invert([s for s in given if s.key in self.running])

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

    grad_scaler: Any = None
    """The ``torch.amp.GradScaler`` of a float16 loss, or ``None``: its scale goes to the G hooks after each
    forward pass (on the device), so G is of the unscaled output gradients. Unscale gradients before :meth:`step`."""

    @property
    def steps(self) -> int:
        """Steps taken so far."""
        return self.schedule.steps

    def follow_layers(self) -> None:
        """If the trained layers changed since the plan, plan again and refresh all now (:func:`.follow_model`)."""
        if trained(self.layers) != self._trained:
            self.layers, changes = follow_model(self, self._trained)
            self._measure()
            message = "K-FAC follows the model: %s; planned again, every factor and inverse refreshed at step %d"
            logger.info(message, changes, self.steps)
            self._restart()
            self.schedule.refresh()
            self.capture.active = True

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
        if self.local is not None and self.sends_factors():
            self.local.refuse_absent(self.backend)
        self.rows.post(self.layers)  # behind the factors on the link
        sent = self.stages.pipeline.run(self, arrivals, self.schedule.inverts())
        if self.local is not None and self.sends_factors():
            self.local.exchanged()
        elif self.local is not None:
            self.local.commit()
        self._precondition(lr, sent, gradients)
        self.finite.copy()
        self._next_step()

    def skip_step(self, gradients: Gradients | None = None) -> None:
        """Drop this step's factors (the step is skipped on every rank), keeping collectives in step."""
        for _ in self._arrivals(gradients):
            pass
        if gradients is not None:
            gradients.wait()
        if self.local is not None:
            self.local.drop()
        self._next_step(refreshed=False)

    def set_intervals(self, factor_update_freq: int, inv_update_freq: int) -> None:
        """Change the update intervals from this step on (schedules of the step, as the library API takes)."""
        self.cfg.factor_update_freq, self.cfg.inv_update_freq = factor_update_freq, inv_update_freq
        self.schedule.plan(self.keys, self.plan.dims, self.plan.owners, self.backend.world_size)
        self.capture.active = self.schedule.factors()

    def _next_step(self, refreshed: bool = True) -> None:
        self.rows.reset()
        self.schedule.advance(refreshed)
        self.capture.active = self.schedule.factors()
        measured = self.layer_times.end_step(self.backend, self.layers)
        self._measured = measured or self._measured
        if self._measured is not None and self.schedule.steps % self.cfg.inv_update_freq == 0:
            self.place_measured(self._measured)
            self._measured = None

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
            self._keep_layers({layer.name for layer in self.capture.layers})
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
        ready = self.stages.pipeline.expected(self.comm.groups, self.profile, self._ready)
        # Known from the first step on, the layers in use let factors and gradients go to their owners.
        if ready != self._ready or self.plan.provisional:
            self._plan(ready)

    def _keep_layers(self, names: set[str]) -> None:
        self.layers = [layer for layer in self.layers if layer.name in names]
        self._plan()

    def average(self, averaged: dict[str, Tensor]) -> list[str]:
        """Blend arrived factors into their running averages (those this rank keeps); return their keys.

        A layer that did not run this step has no factor here (its average stays). A non-finite
        factor is left out, decided on the device and reported after the step (:mod:`~kfacflow.kfac.finite`).
        """
        with torch.no_grad(), self.timer.span("FactorComp", f"average {len(averaged)} factors", "average"):
            for key in self.keys:
                if key in averaged and (self.held is None or key in self.held):
                    finite = self.finite.check(key, self.steps, averaged[key], self.comm.present.get(key))
                    if self.local is not None:
                        self.local.blend(self.running, key, averaged[key], finite)
                    else:
                        blend(self.running, key, averaged[key], finite, self.cfg.factor_decay)
        return list(averaged)

    def settle(self) -> None:
        """Exchange the factor sums ranks hold since the last exchange now (collective; between steps).

        Only with ``kfac.factor_exchange=inversion``; afterwards the running averages are what
        ``update`` would have made by this step. Every rank holds the same keys, so every rank takes
        the same branch.
        """
        if self.local is None or not self.local.sums:
            return
        items = self.local.held(self.keys)
        self.local.refuse_absent(self.backend)
        averaged = FusedSum(self.backend, items, self.timer).wait()
        self.average(averaged)
        self.finite.copy()
        self.local.exchanged()

    def every_average(self) -> dict[str, Tensor]:
        """Every running average, up to date, on this rank (collective: :meth:`settle`, then the factor sync's)."""
        self.settle()
        return self.stages.factor_sync.every_average(self)

    @property
    def factors(self) -> dict[str, Tensor]:
        """The running averages as full symmetric matrices (for inspection; the step keeps them packed).

        With ``kfac.factor_sync=owner``, this rank's only (:meth:`state_dict` has every one); with
        ``kfac.factor_exchange=inversion``, as of the last exchange (:meth:`settle`).
        """
        dims = {slot.key: slot.dim for slot in self.slots}
        return {k: unpack(v, dims[k]) for k, v in self.running.items()}

    def invert(self, batch: list[FactorSlot]) -> None:
        """Invert the factors of ``batch`` this rank inverts (it owns them, or every rank does)."""
        mine = [slot for slot in batch if slot.owner in (EVERY_RANK, self.backend.rank)]
        if not mine:
            return
        with torch.no_grad(), self.timer.span("InverseComp", mine[0].key if len(mine) == 1 else None, "inverse"):
            factors = [unpack(self.running[slot.key], slot.dim).to(self.inverse_dtype) for slot in mine]
            inverses = invert_all(self.stages.invert, factors, self.cfg.damping)
        self.inverses.update({slot.key: inverse for slot, inverse in zip(mine, inverses, strict=True)})

    def _owned_elsewhere(self) -> set[str]:
        """The layers whose averaged gradient this rank never reads: another rank's, where gradients go to owners.

        Their owner preconditions them and sends the update and its ``v.g``; the other ranks' copies of
        such a layer's gradient are left as the backward pass made them (:class:`~kfacflow.kfac.grad_sync.ToOwners`).
        """
        if not self.grad_owned:
            return set()
        return {slot.layer.name for slot in self.slots if slot.owner not in (EVERY_RANK, self.backend.rank)}

    def precondition_layer(self, layer: KFACLayer, grad: Tensor) -> Tensor:
        """Return one layer's update from its gradient matrix and its two inverses (timed per layer)."""
        t0 = self.timer.now()
        start = self.layer_times.start() if self.layer_times.measuring else None
        a_inv, g_inv = self.inverses[f"{layer.name}/A"], self.inverses[f"{layer.name}/G"]
        rows = self.rows.get(layer.name)
        stage = self.stages.precondition
        update = stage.layer(grad, a_inv, g_inv) if rows is None else stage.layer(grad, a_inv, g_inv, rows)
        if start is not None:
            self.layer_times.note(layer.name, start)
        self.timer.record(layer.name, "precondition", t0, self.timer.now())
        return update

    def _precondition(self, lr: float, sent: list[Sent], gradients: Gradients | None) -> None:
        """Precondition every layer as the broadcast strategy does it, then what depends on all of them."""
        if gradients is not None:
            with self.timer.span("GradComm"):
                gradients.wait()
            self.rows.rebuild(gradients, self._owned_elsewhere())
        live = [(layer, g) for layer in self.layers if (g := layer.grad_matrix()) is not None]
        updates, contributions = self.stages.broadcast.precondition(self, live, sent, self.stages.pipeline.early)
        final = self.stages.precondition.finish([updates[layer.name] for layer, _ in live], contributions, lr)
        scale = getattr(self.stages.precondition, "scale", None)
        if scale is not None:  # added on the device: no synchronisation a step
            total, n = self._clip_sum or (0.0, 0)
            self._clip_sum = (scale + total, n + 1)
        for (layer, _), update in zip(live, final, strict=True):
            layer.set_grad(update)

    def mean_clip_scale(self) -> float | None:
        """The mean factor KL clipping scaled the updates by over the steps since the last call (1: none was clipped).

        None where no step was clipped by a stage that keeps its factor (``kfac.kl_clip=0``). Reads the device.
        """
        if self._clip_sum is None:
            return None
        total, n = self._clip_sum
        self._clip_sum = None
        return float(total) / n

    # --- checkpoints ------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Return factors, inverses, the step counter and the layers in use (collective: :func:`.state_of`)."""
        state = state_of(self)
        # the KL clipping factors since the metrics' last row: a resumed run's next row covers the same steps
        state["clip_sum"] = (
            None if self._clip_sum is None else (torch.as_tensor(self._clip_sum[0]).cpu(), self._clip_sum[1])
        )
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
            self._keep_layers(set(state["layers"]))
        check_factors(state, self.slots)
        self.schedule.steps = int(state["steps"])
        owners = {s.key: s.owner for s in self.slots}
        self.running, self.inverses = restored(
            state, self.backend.device, (self.factor_dtype, self.inverse_dtype),
            lambda key: self.stages.broadcast.holds(owners.get(key), self.backend.rank),
        )  # fmt: skip
        self._keep_held()
        clip = state.get("clip_sum")
        self._clip_sum = None if clip is None else (torch.as_tensor(clip[0]).to(self.backend.device), int(clip[1]))
        self.local = None
        self._local_sums(set(state["factors"]))
        self.capture.active = self.schedule.factors()

    def remove(self) -> None:
        """Remove the hooks (another preconditioner may then take the model)."""
        self.capture.remove()
        self.rows.remove()
        self.hooks.remove()
        self.claims.release()
