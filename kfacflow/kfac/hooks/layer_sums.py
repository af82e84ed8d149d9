"""One layer's factors of a step while its calls come in, and what a factor hook reads off a call.

:class:`LayerCapture` holds a layer's A and G of the current step as weighted sums (:class:`Sum`) over
its calls and forward passes; :func:`call_input`, :func:`unscaled`, :func:`own` and
:func:`full_precision` are what the hooks of :mod:`~kfacflow.kfac.hooks.capture` and
:mod:`~kfacflow.kfac.hooks.rows` do to a call's input and output gradient before a factor is made of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from kfacflow.kfac.exchange import Contribution


@dataclass
class Sum:
    """``sum_i w_i t_i`` over packed factors; a single contribution is kept unscaled (no rounding).

    A single contribution may be a factor's rows (:class:`~kfacflow.kfac.exchange.Rows`): only one is
    handed over that way (a layer called once a step).
    """

    value: Any
    weight: float
    total_weight: float = 0.0
    parts: int = 1

    def __post_init__(self) -> None:
        self.total_weight = self.weight

    def add(self, value: Contribution, weight: float) -> None:
        """Add ``weight * value``."""
        assert isinstance(value, Tensor) and isinstance(self.value, Tensor), "rows come only from a single call"
        if self.parts == 1:
            self.value = self.value * self.weight
        self.value.add_(value, alpha=weight)
        self.total_weight += weight
        self.parts += 1


def unscaled(grad: Tensor, scale: Tensor | None, dtype: torch.dtype) -> Tensor:
    """``grad`` without the loss scale ``scale`` (``None``: not scaled), in ``dtype``.

    Unscaled first, in at least float32, then cast: a scaled gradient cast to float16 first
    overflows (65504 is float16's largest number), and the factor is then never averaged in.
    A loss scale is a power of two, so the division itself is exact.
    """
    if not isinstance(scale, Tensor):
        return grad.to(dtype)
    wide = torch.promote_types(grad.dtype, torch.float32)
    return (grad.to(wide) / scale.to(wide)).to(dtype)


@dataclass
class LayerCapture:
    """One layer's factors of the current step, while its calls come in."""

    a: Sum | None = None
    g: Sum | None = None
    examples: int = 0
    """Examples of the step: the batch of the layer's first call in each micro-batch."""
    a_calls: int = 0
    """Forward calls in the current forward pass."""
    a_total: int = 0
    """Forward calls in the step."""
    g_total: int = 0
    """Output gradients in the step."""
    sent: set[str] = field(default_factory=set)
    """The sides sent (``"A"``, ``"G"``)."""
    calls_seen: list[int] = field(default_factory=list)
    """Forward calls of every finished forward pass (the first step learns ``uses`` from it)."""

    def add(self, side: str, packed: Contribution, n: int) -> None:
        """Add a part of A (``side`` ``"A"``) of ``n`` rows, or of G of a forward pass of ``n`` examples."""
        weight = float(n) if side == "A" else 1.0 / n
        held = self.a if side == "A" else self.g
        if held is not None:
            held.add(packed, weight)
        elif side == "A":
            self.a = Sum(packed, weight)
        else:
            self.g = Sum(packed, weight)

    def a_factor(self) -> Contribution:
        """A over every row of the step."""
        assert self.a is not None
        return self.a.value if self.a.parts == 1 else self.a.value / self.a.total_weight

    def g_factor(self) -> Contribution:
        """G as one batch of all the step's examples gives it (each part was added with weight 1/N)."""
        assert self.g is not None
        return self.g.value if self.g.parts == 1 else self.g.value * self.examples


def call_input(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Tensor | None:
    """The input of a Linear or Conv2d call, by position or as ``input=`` (None: the module's forward will say)."""
    x = args[0] if args else kwargs.get("input")
    return x if isinstance(x, Tensor) else None


def own(rows: Tensor, source: Tensor) -> Tensor:
    """``rows``, copied where they view ``source``: held until an exchange, they must not follow a reused buffer."""
    return rows.clone() if rows.untyped_storage().data_ptr() == source.untyped_storage().data_ptr() else rows


def full_precision(t: Tensor) -> torch.autocast:
    """Autocast off on ``t``'s device: a factor's products are computed in its own dtype, not the forward's."""
    return torch.autocast(t.device.type, enabled=False)


def leading(t: Tensor, examples: int, keep: int) -> Tensor:
    """The leading part of ``t`` the factors are estimated from: ``keep`` of its ``examples``' share of dim 0.

    The first ``keep`` examples of a batch-first input, and the same share of the rows of any other
    (``(S, N, E)``: the first positions of every example), so G's scale ``N sum g gᵀ`` is that of
    the whole once multiplied by ``t.shape[0] / kept.shape[0]``. All of ``t`` where ``keep`` is 0.
    """
    if not keep or keep >= examples:
        return t
    return t[: max(1, -(-t.shape[0] * keep // examples))]


def examples_first(t: Tensor, examples: int, wanted: bool) -> Tensor:
    """``t`` examples first where the factor stage reduces over positions (``wanted``): ``(S, N, E)`` as ``(N, S, E)``.

    Told by ``examples`` (the model's batch), never guessed from sizes alone; where ``S`` equals ``N``
    the input is taken as examples first.
    """
    if wanted and t.dim() > 2 and t.shape[0] != examples and t.shape[1] == examples:
        return t.movedim(1, 0)
    return t
