"""Stage *factor* in the hooks: each layer's A and G from all its calls and micro-batches of a step.

A layer hands its factors to the communicate stage as soon as they are complete, which for
the usual layer called once per forward pass is at once (SPD's pipelining). Two things make a
step's factors span several captures, and both are combined here so that one all-reduce
carries the step's factors:

- **Micro-batches** (gradient accumulation): ``k`` forward/backward passes of ``N`` examples
  whose losses are each divided by ``k``. A is the mean of every row of every pass; G is
  computed as one batch of ``k N`` examples would give it: ``G = k N sum g g^T`` over the
  output gradients of all passes (each pass's hook computes ``N sum g g^T``).
- **Several calls per forward pass** (one module applied twice: shared weights): each call's
  rows count as more rows of the same examples, as K-FAC-expand treats weight sharing
  (Eschenhagen et al. 2023): A averages the rows of every call and the G of the calls add up.

How many times each layer runs per forward pass is learnt on the first capturing step, when
the factors are handed over only once the forward (A) and backward (G) passes are over; layers
whose forward never ran (e.g. ``MultiheadAttention.out_proj``, whose weight it uses directly)
or whose output got no gradient are then left to the plain optimizer. From then on a layer
that runs more often than it did is an error, never a silent mismatch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from kfacflow import UserError
from kfacflow.kfac.exchange import Contribution, Rows
from kfacflow.kfac.factors import ExpandFactors
from kfacflow.kfac.layers import KFACLayer
from kfacflow.kfac.packing import pack
from kfacflow.kfac.stages import FactorStage
from kfacflow.timing import StepTimer

logger = logging.getLogger(__name__)


@dataclass
class _Sum:
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


def _offers(stage: object, packed: str, full: str) -> bool:
    """Whether ``stage``'s ``packed`` method gives what its ``full`` one does.

    Only where ``packed`` is defined at least as far down the class tree as ``full``: a subclass of a
    shipped stage that overrides ``a_factor_rows`` alone must not have its factor replaced by the
    inherited triangle of the parent's.
    """
    packed_owner, full_owner = (next((c for c in type(stage).__mro__ if n in vars(c)), None) for n in (packed, full))
    return packed_owner is not None and full_owner is not None and issubclass(packed_owner, full_owner)


@dataclass
class _LayerCapture:
    """One layer's factors of the current step, while its calls come in."""

    a: _Sum | None = None
    g: _Sum | None = None
    examples: int = 0
    """Examples of the step: the batch of the layer's first call in each micro-batch."""
    a_calls: int = 0
    """Forward calls in the current micro-batch."""
    g_calls: int = 0
    """Output gradients in the current micro-batch."""
    a_sent: bool = False
    g_sent: bool = False
    calls_seen: list[int] = field(default_factory=list)
    """Forward calls of every finished micro-batch (the first step learns ``uses`` from it)."""

    def a_factor(self) -> Contribution:
        """A over every row of the step."""
        assert self.a is not None
        return self.a.value if self.a.parts == 1 else self.a.value / self.a.total_weight

    def g_factor(self) -> Contribution:
        """G as one batch of all the step's examples gives it (each part was added with weight 1/N)."""
        assert self.g is not None
        return self.g.value if self.g.parts == 1 else self.g.value * self.examples


def _input(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Tensor | None:
    """The input of a Linear or Conv2d call, by position or as ``input=`` (None: the module's forward will say)."""
    x = args[0] if args else kwargs.get("input")
    return x if isinstance(x, Tensor) else None


def _own(rows: Tensor, source: Tensor) -> Tensor:
    """``rows``, copied where they view ``source``: held until an exchange, they must not follow a reused buffer."""
    return rows.clone() if rows.untyped_storage().data_ptr() == source.untyped_storage().data_ptr() else rows


def _full_precision(t: Tensor) -> torch.autocast:
    """Autocast off on ``t``'s device: a factor's products are computed in its own dtype, not the forward's."""
    return torch.autocast(t.device.type, enabled=False)


class Capture:
    """Registers the factor hooks on the layers and hands complete factors to ``push``.

    The calls each factor-update step: hooks during every micro-batch's forward and backward,
    :meth:`end_forward` after each forward pass, :meth:`finish` after the last backward pass
    (before the communicate stage's ``end_backward``). :attr:`active` says whether this step
    updates factors; the preconditioner sets it.

    Args:
        layers: The candidate layers (those never used are dropped on the first step).
        factors: The factor stage (``a_factor_rows``, ``g_factor``).
        push: Where a complete packed factor goes (``"<layer>/A"`` or ``"<layer>/G"``).
        timer: Stage times and, when tracing, per-layer events.
        accumulate: Micro-batches (forward/backward passes) per step.
        dtype: What factors are computed, summed and sent in (``kfac.factor_dtype``): activations
            and output gradients of another dtype (mixed precision) are cast to it first.
        keep: Examples of each forward pass the factors are estimated from (``kfac.factor_examples``; 0: all):
            the leading ``keep / N`` of every layer input's and output gradient's first dimension.
    """

    def __init__(
        self,
        layers: list[KFACLayer],
        factors: FactorStage,
        push: Callable[[str, Any], None],
        timer: StepTimer,
        accumulate: int = 1,
        dtype: torch.dtype = torch.float32,
        keep: int = 0,
    ) -> None:
        self.layers = layers
        self.keep = keep
        self.dtype = dtype
        self.grad_scale: Tensor | None = None
        """The loss scale of this step's backward pass (fp16 mixed precision): G is of the unscaled gradients."""
        self.factors = factors
        self._packs_a = _offers(factors, "a_factor_packed", "a_factor_rows")
        """Whether the stage computes A's packed triangle itself (and ``_packs_g``, G's)."""
        self._packs_g = _offers(factors, "g_factor_packed", "g_factor")
        self._rows_are_factors = isinstance(factors, ExpandFactors) and all(
            getattr(type(factors), name) is getattr(ExpandFactors, name)
            for name in ("a_factor_packed", "g_factor_packed", "a_factor_rows", "g_factor")
        )
        """Whether the stage's factors are the Gram matrices of its ``a_rows`` and ``g_rows`` (the shipped ones)."""
        self.takes_rows: Callable[[str, int, int], bool] | None = None
        """Where ``push`` takes a factor as its rows (:class:`~kfacflow.kfac.exchange.Rows`): whether it takes
        ``rows`` more of the ``width``-wide factor ``key`` (``kfac.factor_exchange=inversion``); ``None``: never."""
        self._row_counts: dict[str, int] = {}
        """Each layer's rows at its last capture (A's and G's are as many)."""
        self.push = push
        self.timer = timer
        self.accumulate = accumulate
        self.active = True
        self.uses: dict[str, int] | None = None
        """Forward calls per pass of each layer kept, learnt on the first capturing step."""
        self.micro = 0
        """Forward passes finished in this step (``end_forward`` calls)."""
        self._open = False
        """Whether a forward pass has captured since the last ``end_forward``."""
        self.captures: dict[str, _LayerCapture] = {}
        self._a_order: list[str] = []
        self._g_order: list[str] = []
        self._forward_start: dict[str, float] = {}
        self.examples: int | None = None
        """Examples of the current forward pass (the model's batch), set by the preconditioner at its start.

        G undoes the batch-mean loss's 1/N with this N, never with a layer's own leading dimension:
        a Linear that sees ``(S, N, E)`` (``batch_first=False``) or ``(N * P, E)`` has as many
        examples as one that sees ``(N, S, E)``. ``None`` (a Capture used without a model's hook):
        each call's leading dimension.
        """
        self._hooks: dict[str, list[RemovableHandle]] = {
            layer.name: [
                layer.module.register_forward_pre_hook(self._a_hook(layer), with_kwargs=True),
                layer.module.register_forward_hook(self._g_hook(layer), with_kwargs=True),
            ]
            for layer in layers
        }

    def capturing(self, module: nn.Module) -> bool:
        """Whether this call of ``module`` contributes to the factors."""
        return self.active and module.training and torch.is_grad_enabled()

    # --- hooks ------------------------------------------------------------------------------------

    def _a_hook(self, layer: KFACLayer) -> Callable[[nn.Module, tuple[Any, ...], dict[str, Any]], None]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if not self.capturing(module):
                return
            if self.micro >= self.accumulate:
                raise UserError(
                    f"kfac: layer {layer.name!r} ran a forward pass after the last one of the step "
                    f"({self.accumulate} per step): K-FAC cannot tell a recomputation (activation "
                    "checkpointing) or an extra forward from a new micro-batch. Turn checkpointing off, or "
                    f"add {layer.name!r} to kfac.skip."
                )
            given = _input(args, kwargs)
            if given is None:
                return
            x = given.detach()
            self._open = True
            cap = self.captures.setdefault(layer.name, _LayerCapture())
            if cap.a_calls == 0:
                cap.examples += self._examples(x)
                if layer.name not in self._a_order:
                    self._a_order.append(layer.name)
            cap.a_calls += 1
            if self.uses is not None and cap.a_calls > self.uses.get(layer.name, 0):
                raise UserError(
                    f"kfac: layer {layer.name!r} ran {cap.a_calls} times in one forward pass but "
                    f"{self.uses.get(layer.name, 0)} times in the first; K-FAC needs the same calls every step "
                    f"(add {layer.name!r} to kfac.skip)."
                )
            with torch.no_grad(), _full_precision(x), self.timer.span("FactorComp", f"{layer.name}/A", "factor"):
                packed, rows = self._a_part(layer, module, layer.layer_input(self._kept(x).to(self.dtype)))
            if cap.a is None:
                cap.a = _Sum(packed, float(rows))
            else:
                cap.a.add(packed, float(rows))
            if self._last_call(layer, cap.a_calls, self.micro):
                self._send(layer, "A", cap)
            self._forward_start[layer.name] = self.timer.now()

        return hook

    def _g_hook(self, layer: KFACLayer) -> Callable[[nn.Module, tuple[Any, ...], dict[str, Any], Tensor], None]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Tensor) -> None:
            given = _input(args, kwargs)
            if not self.capturing(module) or given is None or not isinstance(output, Tensor):
                return
            if not output.requires_grad:
                return
            batch = self._examples(given)
            start = self._forward_start.pop(layer.name, None)
            if start is not None:
                self.timer.record(layer.name, "forward", start, self.timer.now())

            def grad_hook(grad: Tensor) -> None:
                cap = self.captures[layer.name]
                cap.g_calls += 1
                if layer.name not in self._g_order:
                    self._g_order.append(layer.name)
                kept = self._kept(grad, batch)
                with torch.no_grad(), _full_precision(grad), self.timer.span("FactorComp", f"{layer.name}/G", "factor"):
                    packed = self._g_part(layer, module, self._unscaled(kept), batch, grad.shape[0] / kept.shape[0])
                if cap.g is None:
                    cap.g = _Sum(packed, 1.0 / batch)
                else:
                    cap.g.add(packed, 1.0 / batch)
                if self._last_call(layer, cap.g_calls, self.micro - 1):
                    self._send(layer, "G", cap)

            output.register_hook(grad_hook)

        return hook

    def _examples(self, x: Tensor) -> int:
        return self.examples if self.examples is not None else x.shape[0]

    def _kept(self, t: Tensor, examples: int | None = None) -> Tensor:
        """The leading part of ``t`` the factors are estimated from: ``keep`` of its ``N`` examples' share of dim 0.

        The first ``keep`` examples of a batch-first input, and the same share of the rows of any other
        (``(S, N, E)``: the first positions of every example), so G's scale ``N sum g gᵀ`` is that of
        the whole once multiplied by ``t.shape[0] / kept.shape[0]``.
        """
        n = self._examples(t) if examples is None else examples
        if not self.keep or self.keep >= n:
            return t
        return t[: max(1, -(-t.shape[0] * self.keep // n))]

    def _as_rows(self, layer: KFACLayer, side: str, width: int) -> bool:
        """Whether this step hands a factor over as its rows (a layer called once, one micro-batch, 32 bits or more)."""
        rows = self._row_counts.get(layer.name)
        return (
            self.takes_rows is not None
            and self._rows_are_factors
            and rows is not None
            and self.accumulate == 1
            and self.uses is not None
            and self.uses.get(layer.name) == 1
            and self.dtype.itemsize >= 4
            and self.takes_rows(f"{layer.name}/{side}", rows, width)
        )

    def _a_part(self, layer: KFACLayer, module: nn.Module, x: Tensor) -> tuple[Contribution, int]:
        """A's packed triangle, or its rows where they are taken, and the row count."""
        if self._as_rows(layer, "A", layer.a_dim):
            a = _own(self.factors.a_rows(module, x), x)  # type: ignore[attr-defined]
            self._row_counts[layer.name] = a.shape[0]
            return Rows(a, 1.0 / a.shape[0]), a.shape[0]
        packed, rows = self._a_packed(module, x)
        self._row_counts[layer.name] = rows
        return packed, rows

    def _g_part(self, layer: KFACLayer, module: nn.Module, grad: Tensor, batch: int, share: float) -> Contribution:
        """G's packed triangle, or its rows (``batch * gᵀg``) where they are taken, times ``share``.

        ``share``: how many times more leading rows the output gradient had than ``grad`` holds
        (:meth:`_kept`); 1 where every example is kept.
        """
        if self._as_rows(layer, "G", layer.g_dim):
            return Rows(_own(self.factors.g_rows(module, grad), grad), float(batch) * share)  # type: ignore[attr-defined]
        packed = self._g_packed(module, grad, batch)
        return packed if share == 1 else packed * share

    def _a_packed(self, module: nn.Module, x: Tensor) -> tuple[Tensor, int]:
        """A's packed triangle and row count; straight from a stage that computes the triangle alone."""
        if self._packs_a:
            return self.factors.a_factor_packed(module, x)  # type: ignore[attr-defined,no-any-return]
        factor, rows = self.factors.a_factor_rows(module, x)
        return pack(factor), rows

    def _g_packed(self, module: nn.Module, grad: Tensor, batch: int) -> Tensor:
        if self._packs_g:
            return self.factors.g_factor_packed(module, grad, batch)  # type: ignore[attr-defined,no-any-return]
        return pack(self.factors.g_factor(module, grad, batch))

    def _unscaled(self, grad: Tensor) -> Tensor:
        """The output gradient without the loss scale, in the factor dtype (:func:`unscaled`)."""
        return unscaled(grad, self.grad_scale, self.dtype)

    def _last_call(self, layer: KFACLayer, calls: int, micro: int) -> bool:
        """Whether this call completes the layer's factor (known only once ``uses`` is learnt)."""
        return self.uses is not None and micro == self.accumulate - 1 and calls == self.uses[layer.name]

    def _send(self, layer: KFACLayer, side: str, cap: _LayerCapture) -> None:
        factor = cap.a_factor() if side == "A" else cap.g_factor()
        self.push(f"{layer.name}/{side}", factor)  # the communicator times its part as FactorComm
        if side == "A":
            cap.a_sent = True
        else:
            cap.g_sent = True

    # --- step boundaries ------------------------------------------------------------------------------

    def end_forward(self) -> bool:
        """Close a forward pass; return whether it was the step's last (A factors are all sent then).

        A second call for the same pass (the model's hook, then the caller) does nothing.
        """
        if not self._open:
            return False
        self._open = False
        self.micro += 1
        for cap in self.captures.values():
            cap.calls_seen.append(cap.a_calls)
            cap.a_calls = cap.g_calls = 0
        if self.micro < self.accumulate:
            return False
        self._send_rest("A")
        return True

    def finish(self) -> list[KFACLayer]:
        """Send the G factors still held, after the step's last backward pass.

        Returns:
            The layers dropped on the first step (never run, or no gradient); empty afterwards.

        Raises:
            RuntimeError: If the step had another number of forward passes than ``accumulate``.
            UserError: If no layer ran at all.
        """
        if self.micro != self.accumulate:
            raise RuntimeError(
                f"K-FAC expected {self.accumulate} forward passes (end_forward calls) before step(), got {self.micro}"
            )
        self._send_rest("G")
        return self._learn_uses() if self.uses is None else []

    def _send_rest(self, side: str) -> None:
        """Send the factors of one side not sent yet, in the order they were first captured."""
        by_name = {layer.name: layer for layer in self.layers}
        for name in self._a_order if side == "A" else self._g_order:
            cap = self.captures.get(name)
            if cap is None or name not in by_name or (cap.a if side == "A" else cap.g) is None:
                continue
            if not (cap.a_sent if side == "A" else cap.g_sent):
                self._send(by_name[name], side, cap)

    def reset(self) -> None:
        """Forget this step's captures (after the communicate stage returned them)."""
        self.micro = 0
        self.captures = {}

    def _learn_uses(self) -> list[KFACLayer]:
        kept, dropped = [], []
        for layer in self.layers:
            cap = self.captures.get(layer.name)
            if cap is None or cap.g is None:
                why = "its forward never ran (its weight is used directly, as MultiheadAttention does with out_proj)"
                if cap is not None:
                    why = "its output got no gradient"
                logger.info("K-FAC leaves %s to the optimizer: %s", layer.name, why)
                dropped.append(layer)
                continue
            kept.append(layer)
            if cap.calls_seen[-1] > 1:
                logger.info(
                    "K-FAC: %s runs %d times per forward pass (shared weights); each call's rows count in A and G",
                    layer.name,
                    cap.calls_seen[-1],
                )
        if not kept:
            raise UserError(
                "kfac: none of the model's Linear or Conv2d layers ran in the forward pass with a gradient "
                "(use kfac.variant=sgd)."
            )
        self.set_uses({layer.name: self.captures[layer.name].calls_seen[-1] for layer in kept})
        return dropped

    def set_uses(self, uses: dict[str, int]) -> None:
        """Keep only the layers in ``uses`` (learnt, or restored from a checkpoint)."""
        self.uses = dict(uses)
        for layer in self.layers:
            if layer.name not in self.uses:
                for handle in self._hooks.pop(layer.name, []):
                    handle.remove()
        self.layers = [layer for layer in self.layers if layer.name in self.uses]

    def drop(self, names: set[str]) -> None:
        """Stop capturing the layers ``names`` (they left K-FAC) and remove their hooks."""
        for name in names:
            for handle in self._hooks.pop(name, []):
                handle.remove()
        self.layers = [layer for layer in self.layers if layer.name not in names]
        if self.uses is not None:
            self.uses = {name: n for name, n in self.uses.items() if name not in names}

    def remove(self) -> None:
        """Remove the hooks."""
        for handles in self._hooks.values():
            for handle in handles:
                handle.remove()
        self._hooks = {}
