"""The precondition phase of a step: each layer's update, timed, through the broadcast; the side blocks'; KL clip."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from kfacflow.kfac.layers import KFACLayer
from kfacflow.kfac.stages.contracts import PreconditionStage

if TYPE_CHECKING:
    from kfacflow.kfac.gradients import Gradients
    from kfacflow.kfac.hooks.rows import RowCapture
    from kfacflow.kfac.plan_life import PlanLife
    from kfacflow.kfac.sides.blocks import SideBlocks
    from kfacflow.kfac.state import FactorState
    from kfacflow.kfac.strategies.contracts import Engine, OwnedWork, Sent


class LayerUpdates:
    """Each layer's update from its gradient, its two inverses and (where it goes by them) its rows.

    The broadcast strategy preconditions the layers (:meth:`precondition`), applying what this
    gives it (:class:`~kfacflow.kfac.strategies.contracts.Apply`). Each layer is timed for the trace, and for
    the placement while the plan's life measures the layers (:class:`~kfacflow.kfac.planning.measured.LayerTimes`).
    The side blocks' updates (the norms, the tied weights, cross-attention's row blocks:
    :mod:`~kfacflow.kfac.sides.blocks`) join the layers' in the stage's ``finish`` (KL clipping,
    ``kfac.normalize``), which leaves a scale a step, summed on the device until :meth:`mean_clip_scale` reads it.
    """

    def __init__(
        self, state: FactorState, life: PlanLife, rows: RowCapture, engine: Engine, sides: SideBlocks | None = None
    ) -> None:
        self.state, self.life, self.rows, self.engine, self.timer = state, life, rows, engine, engine.timer
        self.sides = sides
        self.owned: OwnedWork | None = None
        """Muon's per-layer work on the layers' owners (``optim.muon.owners=kfac``: :mod:`kfacflow.on_owners`)."""
        self.clip_sum: tuple[Tensor, int] | None = None
        """The sum of the steps' KL clipping factors since :meth:`mean_clip_scale` last read it, and their count."""

    @property
    def stage(self) -> PreconditionStage:
        """The precondition stage of the stages now run."""
        return self.life.stages.precondition

    def layer(self, layer: KFACLayer, grad: Tensor) -> Tensor:
        """Return one layer's update from its gradient matrix and its two inverses (timed per layer)."""
        times = self.life.layer_times
        inverses = self.state.inverses
        a_inv, g_inv = inverses[f"{layer.name}/A"], inverses[f"{layer.name}/G"]
        rows = self.rows.get(layer.name)
        stage = self.stage
        with self.timer.span("Precondition", layer.name, "precondition"):
            start = times.start() if times.measuring else None
            update = stage.layer(grad, a_inv, g_inv) if rows is None else stage.layer(grad, a_inv, g_inv, rows)
            if start is not None:
                times.note(layer.name, start)
        return update

    def precondition(self, lr: float, sent: list[Sent], gradients: Gradients | None) -> None:
        """Precondition every layer as the broadcast strategy does it, then what depends on all of them."""
        if gradients is not None:
            with self.timer.span("GradComm"):
                gradients.wait()
            self.rows.rebuild(gradients, self.life.owned_elsewhere())
        live = [(layer, g) for layer in self.life.layers if (g := layer.grad_matrix()) is not None]
        stages, stage, owned = self.life.stages, self.stage, self.owned
        pairs: list[tuple[Tensor, Tensor]] | None = None
        if owned is not None:  # the owners scale their updates by the side blocks' too, before they send
            with self.timer.span("Precondition"):
                pairs = self.sides.pairs() if self.sides is not None else []
            owned.prepare(lr, stage, pairs)
        updates, contributions = stages.broadcast.precondition(
            self.state, self.life, self.engine, self, live, sent, stages.pipeline.early
        )
        finished = owned.directed if owned is not None else set()
        with self.timer.span("Precondition"):  # the side blocks' updates, the clipping, the writes into the grads
            if pairs is None:
                pairs = self.sides.pairs() if self.sides is not None else []  # the gradients are averaged by now
            if stage.clips:
                contributions = [*contributions, *(stage.contribution(v, g) for v, g in pairs)]
            rest = [(layer, g) for layer, g in live if layer.name not in finished]
            final = stage.finish([updates[layer.name] for layer, _ in rest] + [v for v, _ in pairs], contributions, lr)
            scale = getattr(stage, "scale", None)
            if scale is not None:  # added on the device: no synchronisation a step
                total, n = self.clip_sum or (0.0, 0)
                self.clip_sum = (scale + total, n + 1)
            for (layer, _), update in zip(rest, final[: len(rest)], strict=True):
                layer.set_grad(update)
            for layer, _ in live:
                if layer.name in finished:  # the owner's finished direction (and the bias's clipped update)
                    layer.set_grad(updates[layer.name])
            if self.sides is not None:
                self.sides.set_grads(final[len(rest) :])
            if owned is not None:
                owned.clip_rest(finished)

    def mean_clip_scale(self) -> float | None:
        """The mean factor KL clipping scaled the updates by over the steps since the last call (1: none was clipped).

        None where no step was clipped by a stage that keeps its factor (``kfac.kl_clip=0``). Reads the device.
        """
        if self.clip_sum is None:
            return None
        total, n = self.clip_sum
        self.clip_sum = None
        return float(total) / n

    def saved(self) -> tuple[Tensor, int] | None:
        """The scales :meth:`mean_clip_scale` has yet to read, for a checkpoint: a resumed run's next row has them."""
        return None if self.clip_sum is None else (torch.as_tensor(self.clip_sum[0]).cpu(), self.clip_sum[1])

    def restore(self, saved: Any, device: torch.device) -> None:
        """Take what :meth:`saved` gave (``None`` too) back, onto ``device``."""
        self.clip_sum = None if saved is None else (torch.as_tensor(saved[0]).to(device), int(saved[1]))
