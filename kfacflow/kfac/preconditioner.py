"""The K-FAC orchestrator: runs factor, communicate, invert and precondition each step."""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from kfacflow.config import KFACConfig
from kfacflow.dist.base import Backend, Handle
from kfacflow.errors import UserError
from kfacflow.kfac.factors import pack, unpack
from kfacflow.kfac.fusion import CommOptions
from kfacflow.kfac.inverse import KINDS, Inverse, warn_once
from kfacflow.kfac.layers import KFACLayer, find_layers
from kfacflow.kfac.placement import EVERY_RANK, schedule
from kfacflow.kfac.variants import Stages
from kfacflow.perf import Profile
from kfacflow.registry import COMMUNICATORS, FACTORS, INVERSES, PLACEMENTS, PRECONDITIONERS
from kfacflow.timing import StepTimer

logger = logging.getLogger(__name__)


class KFACPreconditioner:
    """Preconditions the gradients of a model's Linear and Conv2d layers with K-FAC.

    Call :meth:`step` between ``loss.backward()`` and ``optimizer.step()``. Hooks capture
    the layer inputs (forward pre-hook, A) and output gradients (tensor hook, G) on the steps
    that update factors, and hand each packed factor to the communicate stage at once.

    Args:
        model: The network (unwrapped; hooks go on its modules).
        cfg: The ``kfac`` section of the recipe.
        stages: Stage names after the variant preset was applied.
        backend: The communication engine.
        profile: Performance models (needed by the ``optimal`` fusion and ``lbp`` placement).
        timer: Where stage times and (when tracing) per-layer events go.

    Raises:
        UserError: If the model has no layer K-FAC can precondition.
    """

    def __init__(
        self,
        model: nn.Module,
        cfg: KFACConfig,
        stages: Stages,
        backend: Backend,
        profile: Profile | None = None,
        timer: StepTimer | None = None,
    ) -> None:
        self.cfg = cfg
        self.backend = backend
        self.timer = timer or StepTimer(backend.device)
        self.layers: list[KFACLayer] = find_layers(model, list(cfg.skip))
        if not self.layers:
            raise UserError(
                "kfac: the model has no Linear or Conv2d layer K-FAC can precondition "
                "(check kfac.skip, or use kfac.variant=sgd)."
            )
        self.factor_stage: Any = FACTORS.get(cfg.factor)()
        options = CommOptions(
            threshold_bytes=int(cfg.fusion_threshold_mb * 2**20),
            profile=profile,
            profile_steps=cfg.profile_steps,
            timer=self.timer,
        )
        self.comm: Any = COMMUNICATORS.get(stages.fusion)(backend, options)
        self.invert: Any = INVERSES.get(stages.inverse)
        self.inverse_kind = KINDS[stages.inverse]
        self.precondition: Any = PRECONDITIONERS.get(cfg.precondition)(cfg.kl_clip)
        self.keys = [f"{layer.name}/{ab}" for layer in self.layers for ab in ("A", "G")]
        self.dims = [d for layer in self.layers for d in (layer.a_dim, layer.g_dim)]
        sizes = [Inverse.flat_size(self.inverse_kind, d) for d in self.dims]
        self.owners: list[int] = PLACEMENTS.get(stages.placement)(self.dims, sizes, backend.world_size, profile)
        self.order = schedule(self.dims, self.owners, backend.world_size, profile)
        self.steps = 0
        self.running: dict[str, Tensor] = {}
        """Running averages of the factors, packed (upper triangles): half the memory and work."""
        self.inverses: dict[str, Inverse] = {}
        self._forward_start: dict[str, float] = {}
        self._hooks: list[RemovableHandle] = []
        for layer in self.layers:
            self._hooks.append(layer.module.register_forward_pre_hook(self._make_a_hook(layer)))
            self._hooks.append(layer.module.register_forward_hook(self._make_g_hook(layer)))
        nct = sum(o == EVERY_RANK for o in self.owners)
        logger.info(
            "K-FAC on %d layers (%s, %s, %s); largest factor %d; %d of %d inverses on every rank",
            len(self.layers),
            stages.fusion,
            stages.placement,
            stages.inverse,
            max(self.dims),
            nct,
            len(self.dims),
        )

    # --- stage: factor (in hooks) ---------------------------------------------------------

    def capturing(self, module: nn.Module) -> bool:
        """Whether this forward/backward pass updates factors."""
        return module.training and torch.is_grad_enabled() and self.steps % self.cfg.factor_update_freq == 0

    def _make_a_hook(self, layer: KFACLayer) -> Any:
        def hook(module: nn.Module, inputs: tuple[Tensor, ...]) -> None:
            if not self.capturing(module):
                return
            x = inputs[0].detach()
            with torch.no_grad(), self.timer.span("FactorComp", f"{layer.name}/A", "factor"):
                packed = pack(self.factor_stage.a_factor(module, x))
            with self.timer.span("FactorComm"):
                self.comm.push(f"{layer.name}/A", packed)
            self._forward_start[layer.name] = self.timer.now()

        return hook

    def _make_g_hook(self, layer: KFACLayer) -> Any:
        def hook(module: nn.Module, inputs: tuple[Tensor, ...], output: Tensor) -> None:
            if not self.capturing(module) or not output.requires_grad:
                return
            batch = inputs[0].shape[0]
            start = self._forward_start.pop(layer.name, None)
            if start is not None:
                self.timer.record(layer.name, "forward", start, self.timer.now())

            def grad_hook(grad: Tensor) -> None:
                with torch.no_grad(), self.timer.span("FactorComp", f"{layer.name}/G", "factor"):
                    packed = pack(self.factor_stage.g_factor(module, grad, batch))
                with self.timer.span("FactorComm"):
                    self.comm.push(f"{layer.name}/G", packed)

            output.register_hook(grad_hook)

        return hook

    def end_forward(self) -> None:
        """Tell the communicate stage the forward pass is over (the trainer calls it)."""
        if self.steps % self.cfg.factor_update_freq == 0:
            with self.timer.span("FactorComm"):
                self.comm.end_forward()

    # --- the step ------------------------------------------------------------------------------

    def step(self, lr: float) -> None:
        """Update factors and inverses when due, then precondition every layer's gradient in place.

        Args:
            lr: The learning rate the optimizer will use (for KL clipping).
        """
        if self.steps % self.cfg.factor_update_freq == 0:
            with self.timer.span("FactorComm"):
                self.comm.end_backward()
                averaged = self.comm.wait()
            with self.timer.span("FactorComp"):
                self._update_factors(averaged)
        if self.steps % self.cfg.inv_update_freq == 0:
            self._update_inverses()
        grads = [layer.grad_matrix() for layer in self.layers]
        live = [(layer, g) for layer, g in zip(self.layers, grads, strict=True) if g is not None]
        inverses = [(self.inverses[f"{layer.name}/A"], self.inverses[f"{layer.name}/G"]) for layer, _ in live]
        updates = self.precondition([g for _, g in live], inverses, lr)
        for (layer, _), update in zip(live, updates, strict=True):
            layer.set_grad(update)
        self.steps += 1

    def skip_step(self) -> None:
        """Drop this step's factors (the step is skipped on every rank), keeping collectives in step."""
        if self.steps % self.cfg.factor_update_freq == 0:
            with self.timer.span("FactorComm"):
                self.comm.end_backward()
                self.comm.wait()
        self.steps += 1

    def _update_factors(self, averaged: dict[str, Tensor]) -> None:
        missing = [k for k in self.keys if k not in averaged]
        if missing and not self.running:
            raise RuntimeError(f"K-FAC received no factor for {missing[:3]}: was the layer used in forward?")
        decay = self.cfg.factor_decay
        with torch.no_grad():
            for key in self.keys:
                if key not in averaged:
                    continue
                new, old = averaged[key], self.running.get(key)
                if not bool(torch.isfinite(new).all()):
                    # Never blend a non-finite factor into the running average; start one from zero.
                    warn_once(f"factor {key} was non-finite at step {self.steps}; it was left out")
                    if old is None:
                        self.running[key] = torch.zeros_like(new)
                    continue
                # A received factor may be a view of the fused communication buffer: copy it.
                self.running[key] = new.clone() if old is None else old.mul_(decay).add_(new, alpha=1 - decay)

    @property
    def factors(self) -> dict[str, Tensor]:
        """The running averages as full symmetric matrices (for inspection; the step keeps them packed)."""
        dims = dict(zip(self.keys, self.dims, strict=True))
        return {k: unpack(v, dims[k]) for k, v in self.running.items()}

    def _update_inverses(self) -> None:
        """Invert owned factors; broadcast each communicated result as soon as it is ready."""
        rank, damping = self.backend.rank, self.cfg.damping
        sends: list[tuple[str, int, Tensor, Handle]] = []
        with torch.no_grad():
            for i in self.order:
                key, d, owner = self.keys[i], self.dims[i], self.owners[i]
                if owner in (EVERY_RANK, rank):
                    with self.timer.span("InverseComp", key, "inverse"):
                        inv = self.invert(unpack(self.running[key], d), damping)
                    self.inverses[key] = inv
                    if owner == EVERY_RANK:
                        continue
                    with self.timer.span("InverseComm", key, "pack"):
                        flat = inv.to_flat()
                else:
                    flat = self.running[key].new_empty(Inverse.flat_size(self.inverse_kind, d))
                with self.timer.span("InverseComm"):
                    handle = self.backend.broadcast_async(flat, owner)
                self.timer.on_done(handle, f"{key} from {owner}", "broadcast")
                sends.append((key, d, flat, handle))
            for key, d, flat, handle in sends:
                with self.timer.span("InverseComm"):
                    handle.wait()
                # The owner takes the broadcast copy too, so that every rank holds the same bits.
                with self.timer.span("InverseComm", f"{key} unpack", "pack"):
                    self.inverses[key] = Inverse.from_flat(self.inverse_kind, flat, d)

    # --- checkpoints ------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Return factors, inverses and the step counter (for checkpoints)."""
        return {
            "steps": self.steps,
            "factors": dict(self.running),
            "inverses": {k: (v.kind, v.tensors) for k, v in self.inverses.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        self.steps = int(state["steps"])
        self.running = {k: v.clone() for k, v in state["factors"].items()}
        self.inverses = {k: Inverse(kind, tuple(ts)) for k, (kind, ts) in state["inverses"].items()}

    def remove(self) -> None:
        """Remove the hooks."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
