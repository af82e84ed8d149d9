"""The K-FAC orchestrator: runs factor, communicate, invert and precondition each step; knows no policy."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from kfacflow import UserError
from kfacflow.comm.base import Backend, GradientAllreduce, Handle, Piece
from kfacflow.config import KFACConfig
from kfacflow.kfac.capture import Capture
from kfacflow.kfac.fusion import Communicator, Routing, estimated_arrivals
from kfacflow.kfac.inverse import Inverse, invert_all, warn_once
from kfacflow.kfac.layers import KFACLayer, find_layers
from kfacflow.kfac.packing import pack, unpack
from kfacflow.kfac.plan import Choice, EngineCaps, make_plan
from kfacflow.kfac.stages import EVERY_RANK, FactorSlot, StageSet
from kfacflow.kfac.watch import Claims, examples, fp16_autocast, trained
from kfacflow.perf import Profile
from kfacflow.timing import StepTimer

logger = logging.getLogger(__name__)

_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
"""What a running average or an inverse may be held in, numbered for :meth:`KFACPreconditioner._from_owner`."""


@dataclass
class _Send:
    """A posted broadcast of one inverse: its slot, buffer, handle, and whether the owner keeps its own copy."""

    slot: FactorSlot
    flat: Tensor
    handle: Handle
    keep: bool


def _change(was: tuple[bool, bool], now: tuple[bool, bool]) -> str:
    if not now[0]:
        return "frozen (left to the optimizer)"
    return "bias frozen" if was[1] else "bias trained again (its A factor restarts)"


def dtypes(cfg: KFACConfig, parameters: torch.dtype) -> tuple[torch.dtype, torch.dtype]:
    """Return the factors' dtype and the inverses' (``kfac.factor_dtype``, ``kfac.inverse_dtype``).

    ``auto``: factors in the parameters' dtype (float32 under mixed precision, whose activations are
    cast up), inverses in the factors' and at least float32 (half-precision Cholesky is not offered).
    """
    factor = parameters if cfg.factor_dtype == "auto" else getattr(torch, cfg.factor_dtype)
    if cfg.inverse_dtype == "auto":
        return factor, torch.promote_types(factor, torch.float32)
    return factor, getattr(torch, cfg.inverse_dtype)


class KFACPreconditioner:
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
        self.capture = Capture(self.layers, stages.factor, self.comm.push, self.timer, accumulate, self.factor_dtype)
        self.batch_dim = batch_dim
        self._root_hooks = [
            model.register_forward_pre_hook(self._forward_start, with_kwargs=True),
            model.register_forward_hook(lambda module, inputs, output: self._forward_done(module)),
        ]
        self.steps = 0
        self._refresh = False
        """Update factors and invert at this step whatever the intervals say (the model's layers changed)."""
        self._gradients: GradientAllreduce | None = None
        self.running: dict[str, Tensor] = {}
        """Running averages of the factors, packed (upper triangles): half the memory and work."""
        self.inverses: dict[str, Inverse] = {}
        self.held: set[str] | None = None
        """With ``kfac.factor_sync=owner``: the factors whose running averages this rank keeps."""
        self._finite: list[tuple[str, int, Tensor]] = []
        """Whether each factor averaged in this step was finite (key, step, flag on the device)."""
        self._finite_copied: list[tuple[list[tuple[str, int]], Tensor, torch.cuda.Event | None]] = []
        """Earlier steps' flags on their way to the host: keys and steps, flags, the event after their copy."""
        self._plan()
        logger.info(
            "K-FAC on %d layers (%s, %s, %s); largest factor %d; %d of %d inverses on every rank",
            len(self.layers),
            type(stages.fusion).__name__,
            getattr(stages.placement, "__name__", type(stages.placement).__name__),
            type(stages.invert).__name__,
            max(slot.dim for slot in self.slots),
            sum(slot.owner == EVERY_RANK for slot in self.slots),
            len(self.slots),
        )

    def reconfigure(self, stages: StageSet, profile: Profile | None = None) -> None:
        """Run other stages from the next step on (between steps; the mathematics is the same).

        ``profile`` replaces the planning profile (another inverse method has other costs).
        Collective where the old stages kept each running average on its owner alone: every
        rank takes every average first, since the new placement may name other owners.
        """
        if self.stages.factor_sync.to_owner:
            self.running = self._gather_running()
        self.stages = stages
        self.profile = profile or self.profile
        self.comm = Communicator(self.backend, stages.fusion, self.timer)
        self.capture.push = self.comm.push
        self._plan()

    def _plan(self, ready: dict[str, float] | None = None) -> None:
        """Make a slot per factor of :attr:`layers` and the step's :class:`~kfacflow.kfac.plan.StepPlan`.

        Again only when an input of the plan changes: the layers in use (known after the first
        step), the stages, or when the factors are expected (``ready``, for a pipeline that
        inverts them as they arrive).
        """
        self.slots = [FactorSlot(layer, side) for layer in self.layers for side in ("A", "G")]  # type: ignore[arg-type]
        self._trained = trained(self.layers)
        self._ready = ready
        self._settled = settled = self.capture.uses is not None
        layout = [(layer.a_dim, layer.g_dim, sum(p.numel() for p in layer.params)) for layer in self.layers]
        times = [ready.get(slot.key, 0.0) for slot in self.slots] if ready is not None else None
        world, caps, self._choice = self.backend.world_size, EngineCaps.of(self.backend), Choice.of(self.stages)
        self.plan = make_plan(layout, self._choice, world, self.profile, caps, settled, times)
        plan, names = self.plan, [layer.name for layer in self.layers]
        for slot, size, owner in zip(self.slots, plan.sizes, plan.owners, strict=True):
            slot.flat_size, slot.owner = size, owner
        self.order = [self.slots[i] for i in plan.order]
        self.layer_order = [self.layers[j] for j in plan.layer_order]
        self.update_buckets = {names[b[-1]]: [names[j] for j in b] for b in plan.buckets}
        """With ``kfac.broadcast=fused_update``: the layers of each bucket, keyed by its last layer."""
        self.gathered = {names[plan.buckets[i][-1]] for i in plan.gathered}
        """The buckets gathered from their owners (:func:`~kfacflow.kfac.placement.gathers`), not all-reduced."""
        if self.gathered:
            logger.info("%d of %d buckets of updates gathered from their owners", len(self.gathered), len(plan.buckets))
        self._route()

    def _route(self) -> None:
        """Where the plan sends factors and gradients to their owners: route them, keep only this rank's averages.

        The first step all-reduces (a layer dropped at its end changes the placement, and factors
        already on their way went by the old one). An engine without a reduction (Horovod)
        all-reduces every step, as with ``allreduce``.
        """
        plan = self.plan
        self.grad_owned: list[list[Tensor]] = []
        """The parameters whose gradients each rank receives alone (``[]``: every gradient all-reduced)."""
        if plan.grad_owners is not None:
            self.grad_owned = [[] for _ in range(self.backend.world_size)]
            for layer, owner in zip(self.layers, plan.grad_owners, strict=True):
                if owner != EVERY_RANK:
                    self.grad_owned[owner] += layer.params
            logger.info(
                "the gradients of %d layers go to their owners alone", sum(o != EVERY_RANK for o in plan.grad_owners)
            )
        if plan.factor_owners is None:
            self.comm.routing, self.held = None, None
            return
        owners = {slot.key: owner for slot, owner in zip(self.slots, plan.factor_owners, strict=True)}
        allreduce, reduce = (self.profile.allreduce, self.profile.broadcast) if self.profile else (None, None)
        self.comm.routing = Routing(owners, self.backend.world_size, allreduce, reduce, self.backend.scatters)
        self.held = {key for key, owner in owners.items() if owner in (EVERY_RANK, self.backend.rank)}
        self.running = {key: avg for key, avg in self.running.items() if key in self.held}

    @property
    def keys(self) -> list[str]:
        """The factors' keys, A1, G1, A2, G2, ..."""
        return [slot.key for slot in self.slots]

    @property
    def owners(self) -> list[int]:
        """Who inverts each factor, in the order of :attr:`keys`."""
        return [slot.owner for slot in self.slots]

    grad_scaler: Any = None
    """The ``torch.amp.GradScaler`` of a float16 loss (mixed precision), or ``None``.

    At the end of each forward pass its current scale is handed to the G hooks (on the device,
    not read), so G is of the unscaled output gradients. The gradients themselves must be
    unscaled (``scaler.unscale_(optimizer)``) before :meth:`step`.
    """

    # --- stage: factor (hooks in kfacflow.kfac.capture) ------------------------------------------------

    def _updates_factors(self) -> bool:
        return self._refresh or self.steps % self.cfg.factor_update_freq == 0

    def _inverts(self) -> bool:
        return self._refresh or self.steps % self.cfg.inv_update_freq == 0

    def _forward_start(self, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not (model.training and torch.is_grad_enabled()):
            return
        self.capture.examples = examples(args, kwargs, self.batch_dim)
        if self.grad_scaler is None and fp16_autocast(self.backend.device):
            warn_once(
                "float16 autocast without a grad_scaler: if the loss is scaled (torch.amp.GradScaler), pass the "
                "scaler to the preconditioner (grad_scaler=), or G is taken from gradients scale^2 too large"
            )
        if trained(self.layers) != self._trained:
            self._follow_model()

    def _follow_model(self) -> None:
        """Re-plan for layers frozen (or whose bias was frozen or unfrozen) since the plan was made.

        A frozen layer leaves K-FAC; a frozen bias leaves its layer's A factor (the rest of the
        running average is exactly the weight's factor); a bias trained again restarts its layer's
        A factor. The placement is made again and this step updates every factor and inverts, so
        no inverse of the old plan is used. Every rank runs the same code, so every rank re-plans
        at the same forward pass (collective where running averages are kept by their owners).

        Raises:
            UserError: Between the micro-batches of a step, or when no preconditioned layer is left.
        """
        if self.capture.micro:
            raise UserError(
                "kfac: a preconditioned layer was frozen or unfrozen between the micro-batches of a step; "
                "change requires_grad between steps."
            )
        changed = [
            (layer, was, now)
            for layer, was, now in zip(self.layers, self._trained, trained(self.layers), strict=True)
            if was != now
        ]
        kept = [layer for layer in self.layers if layer.module.weight.requires_grad]
        if not kept:
            raise UserError(
                "kfac: every layer K-FAC preconditions is frozen now; remove() the preconditioner (or train some)."
            )
        if self.stages.factor_sync.to_owner:
            self.running = self._gather_running()
        for layer, (_, had_bias), (weight, bias) in changed:
            a_key = f"{layer.name}/A"
            self.inverses.pop(a_key, None)
            if not weight:
                for key in (a_key, f"{layer.name}/G"):
                    self.running.pop(key, None)
                    self.inverses.pop(key, None)
            elif a_key in self.running and had_bias and not bias:
                planned = unpack(self.running[a_key], next(slot.dim for slot in self.slots if slot.key == a_key))
                self.running[a_key] = pack(planned[:-1, :-1])
            else:
                self.running.pop(a_key, None)
        frozen = [layer for layer, _, (weight, _) in changed if not weight]
        self.claims.release([layer.module for layer in frozen])
        self.capture.drop({layer.name for layer in frozen})
        logger.info(
            "K-FAC follows the model: %s; planned again, every factor and inverse refreshed at step %d",
            ", ".join(f"{layer.name} {_change(was, now)}" for layer, was, now in changed),
            self.steps,
        )
        self.layers = kept
        self.comm = Communicator(self.backend, self.stages.fusion, self.timer)
        self.capture.push = self.comm.push
        self._plan()
        self._refresh = True
        self.capture.active = True

    def _forward_done(self, model: nn.Module) -> None:
        self.capture.examples = None  # every hook of this pass has counted them; a layer called alone counts its own
        if model.training and torch.is_grad_enabled():
            if self.grad_scaler is not None:  # the scale this forward's loss will be multiplied by
                self.capture.grad_scale = self.grad_scaler.scale(torch.ones((), device=self.backend.device))
            self.end_forward()

    def end_forward(self) -> None:
        """Tell the factor and communicate stages a forward pass is over (a hook on the model calls it).

        Calling it again for the same pass does nothing.
        """
        if self._updates_factors() and self.capture.end_forward():
            with self.timer.span("FactorComm"):
                self.comm.end_forward()

    # --- the step ------------------------------------------------------------------------------

    def step(self, lr: float, gradients: GradientAllreduce | None = None) -> None:
        """Update factors and inverses when due, then precondition every layer's gradient in place.

        Args:
            lr: The learning rate the optimizer will use (for KL clipping).
            gradients: This step's gradient all-reduce when it is deferred (``kfac.grad_sync=deferred``):
                launched once the factors are, waited for to precondition.
        """
        self._warn_nonfinite()  # the last step's factors: the device finished them long ago
        self._gradients = gradients
        if gradients is not None:
            gradients.route(self.grad_owned)
        inverting = self._inverts()
        arrivals = self._arrivals() if self._updates_factors() else iter(())
        if inverting and self.stages.pipeline.invert_on_arrival:
            sends = self._invert_on_arrival(arrivals)
        else:
            for averaged in arrivals:
                with self.timer.span("FactorComp", f"average {len(averaged)} factors", "average"):
                    self._update_factors(averaged)
            sends = self._invert(self.order) if inverting else []
        self._precondition(lr, sends, gradients)
        self._copy_finite_flags()
        self._next_step()

    def skip_step(self, gradients: GradientAllreduce | None = None) -> None:
        """Drop this step's factors (the step is skipped on every rank), keeping collectives in step."""
        self._gradients = gradients
        if gradients is not None:
            gradients.route(self.grad_owned)
        for _ in self._arrivals() if self._updates_factors() else ():
            pass
        if gradients is not None:
            gradients.wait()
        self._next_step(refreshed=False)

    def set_intervals(self, factor_update_freq: int, inv_update_freq: int) -> None:
        """Change the update intervals from this step on (schedules of the step, as the library API takes)."""
        self.cfg.factor_update_freq, self.cfg.inv_update_freq = factor_update_freq, inv_update_freq
        self.capture.active = self._updates_factors()

    def _next_step(self, refreshed: bool = True) -> None:
        self.steps += 1
        self._refresh = self._refresh and not refreshed  # a skipped step refreshed nothing: the next one does
        self.capture.active = self._updates_factors()

    def _arrivals(self) -> Iterator[dict[str, Tensor]]:
        """Hand over the factors still held; yield each all-reduce's averages as it completes, in launch order.

        On the first capturing step the layers that never ran are dropped here, before anything
        is inverted.
        """
        with self.timer.span("FactorComm"):
            dropped = self.capture.finish()
            self.comm.end_backward()
            if self._gradients is not None:
                self._gradients.launch()  # behind every factor on the link
        if dropped:
            self._keep_layers({layer.name for layer in self.capture.layers})
        groups = self.comm.arrivals()
        while True:
            with self.timer.span("FactorComm"):
                averaged = next(groups, None)
            if averaged is None:
                break
            yield averaged
        self.capture.reset()
        ready = self._ready
        if self.stages.pipeline.invert_on_arrival:  # next step, invert in the order the factors come
            ready = estimated_arrivals(self.comm.groups, self.profile.allreduce if self.profile else None)
        # Known from the first step on, the layers in use let factors and gradients go to their owners.
        if ready != self._ready or (not self._settled and (self._choice.factor_to_owner or self._choice.grad_to_owner)):
            self._plan(ready)

    def _keep_layers(self, names: set[str]) -> None:
        self.layers = [layer for layer in self.layers if layer.name in names]
        self._plan()

    def _update_factors(self, averaged: dict[str, Tensor]) -> None:
        decay = self.cfg.factor_decay
        with torch.no_grad():
            for key in self.keys:
                if key not in averaged or (self.held is not None and key not in self.held):
                    continue  # the layer did not run this step (its average stays), or another rank keeps it
                new, old = averaged[key], self.running.get(key)
                # Never blend a non-finite factor into the running average (a sum is non-finite when an
                # element is); decided on the device, reported after the step (no read of the device here).
                # Summed in at least float32: a float16 sum of a large finite factor overflows.
                finite = torch.isfinite(new.sum(dtype=torch.promote_types(new.dtype, torch.float32)))
                self._finite.append((key, self.steps, finite))
                if old is None:  # start from zero instead (where() copies: new may view the fused buffer)
                    self.running[key] = torch.where(finite, new, 0.0)
                else:  # a non-finite factor blends the average with itself: unchanged to round-off
                    blend = torch.where(finite, new, old)  # before old changes
                    old.mul_(decay).add_(blend, alpha=1 - decay)

    def _copy_finite_flags(self) -> None:
        """Start copying this step's finiteness flags to the host, behind the work that made them (no wait)."""
        checks, self._finite = self._finite, []
        if checks:
            flags, done = torch.stack([finite for _, _, finite in checks]), None
            if flags.is_cuda:  # into pinned memory, so that the copy is queued instead of waited for
                flags = torch.empty(flags.shape, dtype=flags.dtype, pin_memory=True).copy_(flags, non_blocking=True)
                done = torch.cuda.Event()
                done.record()
            self._finite_copied.append(([(key, step) for key, step, _ in checks], flags, done))

    def _warn_nonfinite(self) -> None:
        """Warn about the factors left out of their running averages at earlier steps.

        Their flags were copied at the end of their step (:meth:`_copy_finite_flags`): reading them
        waits for that copy only, not for the work queued since (this step's backward pass, on CUDA).
        """
        copied, self._finite_copied = self._finite_copied, []
        for keys, flags, done in copied:
            if done is not None:
                done.synchronize()
            for (key, step), finite in zip(keys, flags.tolist(), strict=True):
                if not finite:
                    warn_once(f"factor {key} was non-finite at step {step}; it was left out")

    @property
    def factors(self) -> dict[str, Tensor]:
        """The running averages as full symmetric matrices (for inspection; the step keeps them packed).

        With ``kfac.factor_sync=owner``, this rank's only (:meth:`state_dict` has every one).
        """
        dims = {slot.key: slot.dim for slot in self.slots}
        return {k: unpack(v, dims[k]) for k, v in self.running.items()}

    def _invert_on_arrival(self, arrivals: Iterator[dict[str, Tensor]]) -> list[_Send]:
        """Invert in the placement's order, each factor as soon as its all-reduce has completed.

        The order stays the placement's (communicated factors by estimated finish, then the rest)
        because broadcasts run one after another in the order they are posted: a factor inverted
        early but sent late would hold up every broadcast behind it. With ``kfac.broadcast=update``
        no inverse is sent, and each rank inverts what it holds of each all-reduce as it completes.
        """
        arrived: set[str] = set()

        def take(averaged: dict[str, Tensor]) -> None:
            with self.timer.span("FactorComp", f"average {len(averaged)} factors", "average"):
                self._update_factors(averaged)
            arrived.update(averaged)

        sends: list[_Send] = []
        if self.stages.broadcast.update:  # no inverse is sent, so no order binds the ranks: take what has come
            for group in arrivals:
                take(group)
                self._invert([slot for slot in self.order if slot.key in group])
            return sends
        ready: list[FactorSlot] = []
        for slot in self.order:
            if slot.key not in arrived:  # invert what has come before waiting for more
                sends += self._invert(ready)
                ready = []
            while slot.key not in arrived and (averaged := next(arrivals, None)) is not None:
                take(averaged)
            ready.append(slot)
        sends += self._invert(ready)
        for averaged in arrivals:  # the rest (and the communicator's bookkeeping after the last)
            take(averaged)
        return sends

    def _invert(self, slots: list[FactorSlot]) -> list[_Send]:
        """Invert the ``slots`` this rank owns (or every rank does); post the broadcasts of those communicated.

        On CUDA, outside a traced step, every factor of ``slots`` is inverted before the first
        broadcast is posted, so that the statuses of their factorizations are read once
        (:func:`~kfacflow.kfac.inverse.invert_all`); elsewhere each broadcast follows its own
        inverse (a read costs nothing on the CPU, and a traced step times each inverse).
        """
        if self.backend.device.type == "cuda" and not self.timer.tracing:
            return self._invert_together(slots)
        return [send for slot in slots for send in self._invert_together([slot])]

    def _invert_together(self, slots: list[FactorSlot]) -> list[_Send]:
        mine = [slot for slot in slots if slot.owner in (EVERY_RANK, self.backend.rank)]
        with torch.no_grad():
            if mine:
                with self.timer.span("InverseComp", mine[0].key if len(mine) == 1 else None, "inverse"):
                    factors = [unpack(self.running[slot.key], slot.dim).to(self.inverse_dtype) for slot in mine]
                    inverses = invert_all(self.stages.invert, factors, self.cfg.damping)
                self.inverses.update({slot.key: inverse for slot, inverse in zip(mine, inverses, strict=True)})
            if self.stages.broadcast.update:
                return []  # the owners precondition their layers and send the updates
            return [self._send(slot) for slot in slots if slot.owner != EVERY_RANK]

    def _send(self, slot: FactorSlot) -> _Send:
        """Post the broadcast of a communicated inverse: its owner's, or a buffer to receive it."""
        keep = False
        if slot.owner == self.backend.rank:
            inverse = self.inverses[slot.key]
            if self.stages.broadcast.full:
                flat, keep = inverse.to_full(), inverse.full_exact()  # the owner's own bits travel
            else:
                with self.timer.span("InverseComm", slot.key, "pack"):
                    flat = inverse.to_flat()
                    keep = self.stages.broadcast.owner_keeps and inverse.round_trip_exact()
        else:
            flat = torch.empty(slot.flat_size, dtype=self.inverse_dtype, device=self.backend.device)
        with self.timer.span("InverseComm"):
            handle = self.backend.broadcast_async(flat, slot.owner)
        self.timer.on_done(handle, f"{slot.key} from {slot.owner}", "broadcast")
        return _Send(slot, flat, handle, keep)

    def _precondition(self, lr: float, sends: list[_Send], gradients: GradientAllreduce | None) -> None:
        """Precondition every layer once its inverses are here (with the ``arrival`` pipeline, while others travel)."""
        if gradients is not None:
            with self.timer.span("GradComm"):
                gradients.wait()
        live = [(layer, g) for layer in self.layers if (g := layer.grad_matrix()) is not None]
        stage = self.stages.precondition
        if self.stages.broadcast.update:
            updates, contributions = self._precondition_owned({layer.name: g for layer, g in live})
        else:
            updates = self._precondition_local(live, sends)
            contributions = [stage.contribution(updates[layer.name], g) for layer, g in live] if stage.clips else []
        final = stage.finish([updates[layer.name] for layer, _ in live], contributions, lr)
        for (layer, _), update in zip(live, final, strict=True):
            layer.set_grad(update)

    def _precondition_local(self, live: list[tuple[KFACLayer, Tensor]], sends: list[_Send]) -> dict[str, Tensor]:
        """Precondition every layer here, each once both of its inverses are (broadcast ones as they land)."""
        waiting = {send.slot.key for send in sends}
        updates: dict[str, Tensor] = {}
        on_arrival = self.stages.pipeline.precondition_on_arrival

        def apply_ready() -> None:
            for layer, grad in live:
                a_key, g_key = f"{layer.name}/A", f"{layer.name}/G"
                if layer.name not in updates and a_key not in waiting and g_key not in waiting:
                    t0 = self.timer.now()
                    updates[layer.name] = self.stages.precondition.layer(
                        grad, self.inverses[a_key], self.inverses[g_key]
                    )
                    self.timer.record(layer.name, "precondition", t0, self.timer.now())

        if on_arrival:
            apply_ready()
        with torch.no_grad():
            for send in sends:
                with self.timer.span("InverseComm"):
                    send.handle.wait()
                if not send.keep:  # every rank holds the same bits: the broadcast copy
                    result = self.stages.invert.result
                    if self.stages.broadcast.full:
                        self.inverses[send.slot.key] = result.from_full(send.flat, send.slot.dim)
                    else:
                        with self.timer.span("InverseComm", f"{send.slot.key} unpack", "unpack"):
                            self.inverses[send.slot.key] = result.unflat(send.flat, send.slot.dim)
                waiting.discard(send.slot.key)
                if on_arrival:
                    apply_ready()
        apply_ready()
        return updates

    def _precondition_owned(self, live: dict[str, Tensor]) -> tuple[dict[str, Tensor], list[Tensor]]:
        """Precondition the layers this rank owns (and every rank's), sending each owned update.

        Every rank walks :attr:`layer_order` and posts each communicated layer's collective in it
        (collectives run in the order they are posted): a broadcast of its own update as soon as
        it is computed, a receive buffer for the others'; a bucket of :attr:`update_buckets` as
        one collective once its last layer is reached. Every rank then applies the owner's bits.
        Returns the updates and each live layer's contribution to the precondition stage's
        :meth:`finish`: where the gradients went to their owners alone (:attr:`grad_owned`), the
        owners compute theirs and send them in one all-reduce of zero-filled float64 slots.
        """
        rank = self.backend.rank
        owner = {slot.layer.name: slot.owner for slot in self.slots}
        bucketed = {name for names in self.update_buckets.values() for name in names}
        stage = self.stages.precondition
        from_owners = bool(self.grad_owned) and stage.clips
        updates: dict[str, Tensor] = {}
        mine: dict[str, Tensor] = {}
        posted: list[tuple[list[str], Handle]] = []
        with torch.no_grad():
            for layer in self.layer_order:
                grad, src = live.get(layer.name), owner[layer.name]
                if grad is not None and src in (EVERY_RANK, rank):
                    t0 = self.timer.now()
                    update = self.stages.precondition.layer(
                        grad, self.inverses[f"{layer.name}/A"], self.inverses[f"{layer.name}/G"]
                    )
                    self.timer.record(layer.name, "precondition", t0, self.timer.now())
                    updates[layer.name] = update.contiguous()
                    if from_owners and src == rank:
                        mine[layer.name] = stage.contribution(update, grad)
                if layer.name in self.update_buckets:
                    posted += self._post_bucket(layer.name, live, updates, owner)
                elif grad is not None and src != EVERY_RANK and layer.name not in bucketed:
                    if src != rank:
                        updates[layer.name] = torch.empty(grad.shape, dtype=grad.dtype, device=grad.device)
                    with self.timer.span("InverseComm"):
                        handle = self.backend.broadcast_async(updates[layer.name], src)
                    self.timer.on_done(handle, f"{layer.name} update from {src}", "broadcast")
                    posted.append(([], handle))
            sent = [name for name in live if owner[name] != EVERY_RANK]
            dots: Handle | None = None
            if from_owners and sent:  # x + 0 == x: every rank receives each owner's bits
                slots = torch.zeros(len(sent), dtype=torch.float64, device=self.backend.device)
                for i, name in enumerate(sent):
                    if name in mine:
                        slots[i] = mine[name]
                dots = Piece(self.backend.allreduce_async(slots), slots)
            for names, handle in posted:  # names: a bucket's layers, to be cut out of it
                with self.timer.span("InverseComm"):
                    buffer = handle.wait()
                offset = 0
                for name in names:
                    grad = live[name]
                    updates[name] = buffer[offset : offset + grad.numel()].view(grad.shape)
                    offset += grad.numel()
            if not stage.clips:
                return updates, []
            received = dict(zip(sent, dots.wait(), strict=True)) if dots is not None else {}
        return updates, [received[n] if n in received else stage.contribution(updates[n], g) for n, g in live.items()]

    def _post_bucket(
        self, key: str, live: dict[str, Tensor], updates: dict[str, Tensor], owner: dict[str, int]
    ) -> list[tuple[list[str], Handle]]:
        """Send the owners' updates of one bucket to every rank in one collective; return its layers in its order.

        Where the bucket gathers (:attr:`gathered`), each owner's layers are its piece, in rank
        order; otherwise every rank adds zeros to each owner's piece of an all-reduced buffer
        (``x + 0 == x`` exactly). Either way every rank (the owner too, which takes the received
        copy) ends with the owner's bits.
        """
        names = [name for name in self.update_buckets[key] if name in live]
        gather = key in self.gathered
        if not names:
            return []
        first = live[names[0]]
        with self.timer.span("InverseComm"):
            if gather:
                names = sorted(names, key=lambda name: owner[name])  # stable: the bucket's order within a rank
                counts = [sum(live[n].numel() for n in names if owner[n] == r) for r in range(self.backend.world_size)]
                own = [updates[n].reshape(-1) for n in names if owner[n] == self.backend.rank]
                piece = torch.cat(own) if own else first.new_empty(0)
                handle: Handle = self.backend.gather_async(piece, counts)
            else:
                buffer = first.new_zeros(sum(live[name].numel() for name in names))
                offset = 0
                for name in names:
                    if name in updates:
                        buffer[offset : offset + live[name].numel()].copy_(updates[name].reshape(-1))
                    offset += live[name].numel()
                handle = Piece(self.backend.allreduce_async(buffer), buffer)
        self.timer.on_done(handle, f"{len(names)} updates, {names[0]}..{names[-1]}", "broadcast")
        return [(names, handle)]

    # --- checkpoints ------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Return factors, inverses, the step counter and the layers in use (for checkpoints).

        Collective with ``kfac.broadcast=update``: each inverse lives on its owner only, and the
        owners send theirs to every rank here so that the checkpoint (rank 0's) holds them all;
        so do the running averages with ``kfac.factor_sync=owner``.
        """
        inverses = self._gather_inverses() if self.stages.broadcast.update else self.inverses
        running = self._gather_running() if self.stages.factor_sync.to_owner else self.running
        return {
            "steps": self.steps,
            "factors": dict(running),
            "inverses": {k: (v.kind, v.tensors) for k, v in inverses.items()},
            "layers": dict(self.capture.uses) if self.capture.uses is not None else None,
        }

    def _gather_inverses(self) -> dict[str, Inverse]:
        """Every inverse, its owner's bits on every rank (collective; in slot order on every rank)."""
        gathered = dict(self.inverses)
        kinds = sorted(Inverse.kinds)
        for slot in self._communicated():
            mine = self.inverses.get(slot.key) if slot.owner == self.backend.rank else None
            flat = mine.to_full() if mine is not None else None
            kind = kinds.index(mine.kind) if mine is not None else 0
            got = self._from_owner(slot, flat, kind, [Inverse.kinds[k].full_elements(slot.dim) for k in kinds])
            if got is not None and mine is None:
                gathered[slot.key] = Inverse.kinds[kinds[got[0]]].from_full(got[1], slot.dim)
        return gathered

    def _gather_running(self) -> dict[str, Tensor]:
        """Every running average, its owner's on every rank (collective; in slot order on every rank)."""
        gathered = dict(self.running)
        for slot in self._communicated():
            mine = self.running.get(slot.key) if slot.owner == self.backend.rank else None
            got = self._from_owner(slot, mine, 0, [slot.dim * (slot.dim + 1) // 2])
            if got is None:
                gathered.pop(slot.key, None)
            else:
                gathered[slot.key] = got[1]
        return gathered

    def _communicated(self) -> list[FactorSlot]:
        """The slots one rank owns (none on one process)."""
        return [slot for slot in self.slots if slot.owner != EVERY_RANK and self.backend.world_size > 1]

    def _from_owner(
        self, slot: FactorSlot, flat: Tensor | None, kind: int, elements: list[int]
    ) -> tuple[int, Tensor] | None:
        """Send the owner's ``flat`` (of a ``kind`` it numbers) to every rank; ``None`` where the owner has none.

        A first message says what follows: the kind and the dtype, or -1 (nothing inverted or
        averaged yet); the others then receive ``elements[kind]`` values.
        """
        head = [kind, _DTYPES.index(flat.dtype)] if flat is not None else [-1, -1]
        code = torch.tensor(head, dtype=torch.int64, device=self.backend.device)
        self.backend.broadcast_async(code, slot.owner).wait()
        kind, dtype = (int(v) for v in code.tolist())
        if kind < 0:
            return None
        if flat is None:
            flat = torch.empty(elements[kind], dtype=_DTYPES[dtype], device=self.backend.device)
        self.backend.broadcast_async(flat, slot.owner).wait()  # the owner's own tensor is left as it is
        return kind, flat

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned.

        Raises:
            UserError: If the checkpoint's factors belong to other layers than this model's
                (another model, or another ``kfac.skip``).
        """
        uses = state.get("layers")
        if uses is not None:
            missing = sorted(set(uses) - {layer.name for layer in self.capture.layers})
            if missing:
                raise UserError(
                    f"resume: the checkpoint preconditions layers this run does not ({', '.join(missing[:3])}); "
                    "resume with the run's own model and kfac.skip, or start a new run."
                )
            self.capture.set_uses(uses)
            self._keep_layers(set(uses))
        dims = {slot.key: slot.dim for slot in self.slots}
        for key, packed in state["factors"].items():
            if key not in dims or packed.numel() != dims[key] * (dims[key] + 1) // 2:
                raise UserError(
                    f"resume: the checkpoint's K-FAC factor {key!r} does not fit this model's layers "
                    "(model.name or kfac.skip changed?); resume with the run's own settings, or start a new run."
                )
        self.steps = int(state["steps"])
        # Onto this run's device and dtypes: a checkpoint is read onto the CPU, and may come from
        # a run that held its factors in another dtype (kfac.factor_dtype, kfac.inverse_dtype).
        device = self.backend.device
        self.running = {k: v.to(device, self.factor_dtype, copy=True) for k, v in state["factors"].items()}
        held = {s.key for s in self.slots if s.owner in (EVERY_RANK, self.backend.rank)}
        self.inverses = {
            k: Inverse.restore(kind, [t.to(device, self.inverse_dtype) for t in ts])
            for k, (kind, ts) in state["inverses"].items()
            if k in held or not self.stages.broadcast.update  # with update, each rank needs its own only
        }
        self._route()
        self.capture.active = self._updates_factors()

    def remove(self) -> None:
        """Remove the hooks (another preconditioner may then take the model)."""
        self.capture.remove()
        for hook in self._root_hooks:
            hook.remove()
        self.claims.release()
