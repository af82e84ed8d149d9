"""``train.amp``: the forward pass under autocast, and for float16 a loss scale every rank agrees on.

Parameters, gradients, the optimizer and K-FAC's factors stay in ``train.dtype``; only the forward
pass and the loss run in bfloat16 or float16 (``torch.autocast``). Float16 gradients overflow
and underflow, so its loss is scaled (``torch.amp.GradScaler``) and the gradients unscaled before
K-FAC sees them; K-FAC's G factors are computed from the unscaled output gradients
(:attr:`~kfacflow.kfac.preconditioner.Preconditioner.grad_scaler`).

The scaler's own skip decision is per rank (each sees its own gradients before they are
averaged when ``kfac.grad_sync=deferred``); the trainer's skip is agreed by every rank. So the
scale follows the agreed decision, by the scaler's own rule (back off on a skipped step, grow
after ``growth_interval`` steps without one), and every rank keeps the same scale.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import Tensor

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class MixedPrecision:
    """Autocast for the forward pass and, with ``fp16``, the loss scale.

    Args:
        mode: ``none``, ``bf16`` or ``fp16`` (``train.amp``).
        device: The training device.
        init_scale: The first loss scale (``train.loss_scale``).
    """

    def __init__(self, mode: str, device: torch.device, init_scale: float = 2.0**16) -> None:
        self.dtype = DTYPES.get(mode)
        self.device = device
        self.scaler = torch.amp.GradScaler(device.type, init_scale=init_scale) if mode == "fp16" else None
        self.good_steps = 0
        """Steps applied since the scale last changed (the scaler's growth rule counts them)."""

    def autocast(self) -> AbstractContextManager[Any]:
        """The context of the forward pass and the loss."""
        if self.dtype is None:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def scale(self, loss: Tensor) -> Tensor:
        """The loss to call ``backward()`` on."""
        return self.scaler.scale(loss) if self.scaler is not None else loss

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the gradients by the scale (exact: it is a power of two), before K-FAC and any check."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def update(self, skipped: bool) -> None:
        """Move the scale after a step every rank agreed to skip or apply (the same on every rank)."""
        if self.scaler is None:
            return
        scale = self.scaler.get_scale()
        if skipped:
            scale *= self.scaler.get_backoff_factor()
            self.good_steps = 0
        else:
            self.good_steps += 1
            if self.good_steps == self.scaler.get_growth_interval():
                scale *= self.scaler.get_growth_factor()
                self.good_steps = 0
        self.scaler.update(scale)

    def state_dict(self) -> dict[str, Any] | None:
        """The scaler's state and the growth count (``None`` without a scaler)."""
        if self.scaler is None:
            return None
        return {"scaler": self.scaler.state_dict(), "good_steps": self.good_steps}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Restore :meth:`state_dict` (a checkpoint of a run without a scaler leaves the first scale)."""
        if self.scaler is not None and state is not None:
            self.scaler.load_state_dict(state["scaler"])
            self.good_steps = int(state["good_steps"])
