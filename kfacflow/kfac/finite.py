"""Factors that were not finite: kept out of their running averages on the device, reported a step later.

Whether a factor is finite is decided on the device (no read there); the flags are copied to the host
at the end of their step (into pinned memory behind an event, on CUDA) and read at the next, when
the device finished them long ago.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kfacflow.kfac.stages.inverse import warn_once


def blend(running: dict[str, Tensor], key: str, new: Tensor, finite: Tensor, decay: float) -> None:
    """Average ``new`` into ``running[key]`` with ``decay``, where ``finite``; else leave it as it is.

    A first factor starts the average (from zero where it is not finite). ``where`` copies: ``new``
    may view a fused buffer that the next step reuses.
    """
    old = running.get(key)
    if old is None:
        running[key] = torch.where(finite, new, 0.0)
    else:  # a non-finite factor blends the average with itself: unchanged to round-off
        mixed = torch.where(finite, new, old)  # before old changes
        old.mul_(decay).add_(mixed, alpha=1 - decay)


class FiniteFlags:
    """Each averaged factor's finiteness, on its way to the host (:meth:`check`, :meth:`copy`, :meth:`warn`)."""

    def __init__(self) -> None:
        self._checks: list[tuple[str, int, Tensor]] = []
        """This step's flags: key, step, flag on the device."""
        self._copied: list[tuple[list[tuple[str, int]], Tensor, torch.cuda.Event | None]] = []
        """Earlier steps' flags on their way to the host: keys and steps, flags, the event after their copy."""

    def check(self, key: str, step: int, new: Tensor, present: Tensor | None = None) -> Tensor:
        """Return whether ``new`` is finite, on the device (a sum is non-finite when an element is).

        Summed in at least float32: a float16 sum of a large finite factor overflows. ``present``:
        whether any rank had the factor (none: it is NaN by design, left out and not reported).
        """
        finite = torch.isfinite(new.sum(dtype=torch.promote_types(new.dtype, torch.float32)))
        self._checks.append((key, step, finite if present is None else finite | ~present))
        return finite

    def copy(self) -> None:
        """Start copying this step's flags to the host, behind the work that made them (no wait)."""
        checks, self._checks = self._checks, []
        if checks:
            flags, done = torch.stack([finite for _, _, finite in checks]), None
            if flags.is_cuda:  # into pinned memory, so that the copy is queued instead of waited for
                flags = torch.empty(flags.shape, dtype=flags.dtype, pin_memory=True).copy_(flags, non_blocking=True)
                done = torch.cuda.Event()
                done.record()
            self._copied.append(([(key, step) for key, step, _ in checks], flags, done))

    def warn(self) -> None:
        """Warn about the factors left out at earlier steps (waits for their copies only)."""
        copied, self._copied = self._copied, []
        for keys, flags, done in copied:
            if done is not None:
                done.synchronize()
            for (key, step), finite in zip(keys, flags.tolist(), strict=True):
                if not finite:
                    warn_once(f"factor {key} was non-finite at step {step}; it was left out")
