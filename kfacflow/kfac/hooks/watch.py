"""What the preconditioner reads off the model at each forward pass: its examples, its trained layers, its owner.

- **Examples.** G undoes the batch-mean loss's ``1/N``, so it needs the ``N`` of the batch, which
  a layer's own input does not tell (``(S, N, E)`` under ``batch_first=False``, or ``(N * P, E)``
  after a reshape); the model's input does: its first tensor, along ``batch_dim``.
- **Trained layers.** Freezing a layer (fine-tuning, progressive freezing) changes what K-FAC
  preconditions; :func:`trained` is what the plan was made for, compared at each forward pass.
- **The forward pass.** :class:`ForwardHooks` hands the examples and the loss scale to the
  factor hooks, and tells the preconditioner when a pass starts and ends.
- **One preconditioner per layer.** A second one on the same modules would precondition the
  gradients twice, silently; :class:`Claims` refuses it.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import Tensor, nn

from kfacflow import UserError
from kfacflow.kfac.layers import KFACLayer, bias_preconditioned
from kfacflow.kfac.stages.inverse import warn_once

if TYPE_CHECKING:
    from kfacflow.kfac.hooks.capture import Capture


def examples(args: tuple[Any, ...], kwargs: dict[str, Any], batch_dim: int) -> int | None:
    """Return the batch size of a model call: its first tensor argument's size along ``batch_dim``.

    None where no argument is a tensor with that dimension (the layers' own inputs then count).
    """
    for value in (*args, *kwargs.values()):
        if isinstance(value, Tensor):
            return int(value.shape[batch_dim]) if value.dim() > batch_dim else None
    return None


def trained(layers: list[KFACLayer]) -> tuple[tuple[bool, bool], ...]:
    """Whether each layer's weight, and its bias, are trained (what K-FAC preconditions of it)."""
    return tuple((bool(layer.module.weight.requires_grad), bias_preconditioned(layer.module)) for layer in layers)


def fp16_autocast(device: torch.device) -> bool:
    """Whether this forward pass runs under float16 autocast on ``device``'s type."""
    kind = device.type
    return torch.is_autocast_enabled(kind) and torch.get_autocast_dtype(kind) == torch.float16


class Claims:
    """Which preconditioner hooks each module, so that no module is preconditioned twice."""

    _owners: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()

    def __init__(self, modules: dict[str, nn.Module]) -> None:
        taken = [name for name, module in modules.items() if module in self._owners]
        if taken:
            more = f" and {len(taken) - 1} more layers are" if len(taken) > 1 else " is"
            raise UserError(
                f"kfac: {taken[0]!r}{more} already preconditioned by another K-FAC preconditioner, which would "
                "precondition their gradients twice; call the other one's remove() first."
            )
        self.modules = list(modules.values())
        for module in self.modules:
            self._owners[module] = "kfacflow"

    def release(self, modules: list[nn.Module] | None = None) -> None:
        """Give the modules up (all of them by default), e.g. when their layers leave K-FAC."""
        for module in self.modules if modules is None else modules:
            self._owners.pop(module, None)


class Watcher(Protocol):
    """What :class:`ForwardHooks` reports to (the preconditioner)."""

    capture: Capture
    batch_dim: int
    grad_scaler: Any

    def follow_layers(self) -> None:
        """Plan again if the trained layers changed since the plan (:func:`trained`)."""

    def end_forward(self) -> None:
        """A forward pass is over."""


class ForwardHooks:
    """The model's own hooks: at each training forward pass, what the factor hooks need and whether layers changed.

    Before the pass: the batch's examples (:func:`examples`) for the factor hooks, and
    ``follow_layers``. After it: the loss scale of the ``grad_scaler`` (a ``torch.amp.GradScaler``,
    or ``None``) for the G hooks, then ``end_forward``.
    """

    def __init__(self, model: nn.Module, watcher: Watcher, device: torch.device) -> None:
        self.watcher, self.device = watcher, device
        self.handles = [
            model.register_forward_pre_hook(self._start, with_kwargs=True),
            model.register_forward_hook(lambda module, inputs, output: self._end(module)),
        ]

    def _start(self, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not (model.training and torch.is_grad_enabled()):
            return
        self.watcher.capture.examples = examples(args, kwargs, self.watcher.batch_dim)
        self.watcher.capture.new_pass()
        if self.watcher.grad_scaler is None and fp16_autocast(self.device):
            warn_once(
                "float16 autocast without a grad_scaler: if the loss is scaled (torch.amp.GradScaler), pass the "
                "scaler to the preconditioner (grad_scaler=), or G is taken from gradients scale^2 too large"
            )
        self.watcher.follow_layers()

    def _end(self, model: nn.Module) -> None:
        capture = self.watcher.capture
        capture.examples = None  # every hook of this pass has counted them; a layer called alone counts its own
        if model.training and torch.is_grad_enabled():
            scaler = self.watcher.grad_scaler
            if scaler is not None:  # the scale this forward's loss will be multiplied by
                capture.grad_scale = scaler.scale(torch.ones((), device=self.device))
            self.watcher.end_forward()

    def remove(self) -> None:
        """Take the hooks off the model."""
        for handle in self.handles:
            handle.remove()
