"""Stage *factor* in the hooks: each layer's A and G from all its calls and forward passes of a step.

A layer hands its factors to the communicate stage as soon as they are complete, which for
the usual layer called once per forward pass is at once (SPD's pipelining). A step's calls of a
layer are all rows of its factors, so that one all-reduce carries the step's factors, and they are
the factors one pass over all of the step's inputs would give:

- **Several forward passes a step**: gradient accumulation's ``k`` micro-batches of ``N`` examples
  (each one forward and one backward pass, each loss divided by ``k``), or several passes before
  one backward pass (two views of each example, as SimCLR trains). A is the mean of every row of
  every pass; G is computed as one batch of all the passes' examples would give it:
  ``G = k N sum g g^T`` over the output gradients of all passes (each hook computes ``N sum g g^T``).
- **Several calls per forward pass** (one module applied twice: shared weights): under
  ``kfac.factor=expand`` each call's rows count as more rows of the same examples, as K-FAC-expand
  treats weight sharing (Eschenhagen et al. 2023): A averages the rows of every call and the G of
  the calls add up. Under ``reduce`` the calls are reduced as positions are (K-FAC-reduce): each
  example's input averaged over every use of the weight in the pass and its output gradients
  summed, so a pass's calls make one part of ``N`` rows (:mod:`~kfacflow.kfac.hooks.pass_rows`),
  held until the pass's last call (A) or last output gradient (G).
- **A model trained through its methods** (``model.encode_image``, ``model.encode_text``), which no
  hook on the model sees: the calls since the last step are one pass.

How many times each layer runs per forward pass, and how many passes a step has, is learnt on the
first capturing step (:mod:`~kfacflow.kfac.hooks.first_step`), when the factors are handed over only
once the forward (A) and backward (G) passes are over; layers whose forward never ran (a weight a
parent module uses directly; a ``MultiheadAttention``'s packed ``in_proj`` where the module is not
called as self-attention: :mod:`~kfacflow.kfac.multihead`) or whose output got no gradient
are then left to the plain optimizer. From then on a layer that runs more often than it did is
an error, never a silent mismatch. With several ranks the factors go out through a
:class:`~kfacflow.kfac.hooks.handover.Handover`, in one order every rank agrees on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from kfacflow.kfac.exchange import Contribution
from kfacflow.kfac.hooks.factor_parts import FactorParts
from kfacflow.kfac.hooks.first_step import (
    NOT_CALLED,
    learn_uses,
    merged_calls,
    more_calls,
    other_passes,
    ran_and_got,
    recomputed,
)
from kfacflow.kfac.hooks.handover import Handover, placeholders
from kfacflow.kfac.hooks.layer_sums import (
    LayerCapture,
    call_input,
    examples_first,
    full_precision,
    leading,
    unscaled,
)
from kfacflow.kfac.hooks.pass_rows import PassRows
from kfacflow.kfac.hooks.switch import FactorHooks
from kfacflow.kfac.layers import KFACLayer
from kfacflow.kfac.stages.contracts import FactorStage
from kfacflow.kfac.stages.inverse import warn_once
from kfacflow.timing import StepTimer

logger = logging.getLogger(__name__)


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
        gather: With several ranks, every rank's picklable object (collective): the ranks agree on which
            layers run and in what order their factors go out (:mod:`~kfacflow.kfac.hooks.handover`).
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
        gather: Callable[[Any], list[Any]] | None = None,
    ) -> None:
        self.layers = layers
        self.keep = keep
        self.dtype = dtype
        self.grad_scale: Tensor | None = None
        """The loss scale of this step's backward pass (fp16 mixed precision): G is of the unscaled gradients."""
        self.parts = FactorParts(factors, dtype)
        self.push = push
        self.handover = Handover(lambda key, factor: self.push(key, factor), gather)
        self.timer = timer
        self.accumulate = accumulate
        self.uses: dict[str, int] | None = None
        """Forward calls per pass of each layer kept, learnt on the first capturing step."""
        self.micro = 0
        """Forward passes finished in this step (``end_forward`` calls)."""
        self.passes: int | None = None
        """Forward passes per step, learnt on the first capturing step: ``accumulate`` micro-batches, or several
        passes before one backward pass (two views of each example): their rows count as more rows of the step."""
        self._passes = 0
        self._forward_closed = self._in_backward = self._model_called = False
        self._open = False
        """Whether a forward pass has captured since the last ``end_forward``."""
        self.captures: dict[str, LayerCapture] = {}
        self._calls: dict[str, int] = {}
        self._a_order: list[str] = []
        self._g_order: list[str] = []
        self._forward_start: dict[str, float] = {}
        self.held = PassRows(self.parts, self._add, lambda: self.passes == 1 and self.uses is not None)
        """Under ``kfac.factor=reduce``, the rows of a layer's calls until its pass's are all in (``_reduces``)."""
        self.examples: int | None = None
        """Examples of the current forward pass (the model's batch), set by the preconditioner at its start.

        G undoes the batch-mean loss's 1/N with this N, never with a layer's own leading dimension:
        a Linear that sees ``(S, N, E)`` (``batch_first=False``) or ``(N * P, E)`` has as many
        examples as one that sees ``(N, S, E)``. ``None`` (a Capture used without a model's hook):
        each call's leading dimension.
        """
        self.hooks = FactorHooks()
        """Every factor hook (the side blocks' too), on the modules only while :attr:`active`."""
        for layer in layers:
            self.hooks.add(layer.name, layer.module, self._a_hook(layer), self._g_hook(layer))

    @property
    def active(self) -> bool:
        """Whether this step updates factors (the preconditioner sets it): the factor hooks are on the modules."""
        return self.hooks.on

    @active.setter
    def active(self, on: bool) -> None:
        self.hooks.switch(on)

    def capturing(self, module: nn.Module) -> bool:
        """Whether this call of ``module`` contributes to the factors."""
        return self.active and module.training and torch.is_grad_enabled()

    # --- hooks ------------------------------------------------------------------------------------

    def _a_hook(self, layer: KFACLayer) -> Callable[[nn.Module, tuple[Any, ...], dict[str, Any]], None]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if not self.capturing(module):
                return
            if self._in_backward or (self.passes is not None and self.micro >= self.passes):
                raise recomputed(layer.name, self.passes)
            given = call_input(args, kwargs)
            if given is None:
                return
            x = examples_first(given.detach(), self._examples(given), self.parts.examples_first)
            self._open = True
            cap = self.captures.setdefault(layer.name, LayerCapture())
            if cap.a_calls == 0:
                cap.examples += self._examples(x)
                if layer.name not in self._a_order:
                    self._a_order.append(layer.name)
            cap.a_calls += 1
            cap.a_total += 1
            if self.uses is not None and cap.a_calls > self.uses.get(layer.name, 0):
                raise more_calls(layer.name, cap.a_calls, self.uses.get(layer.name, 0))
            with torch.no_grad(), full_precision(x), self.timer.span("FactorComp", f"{layer.name}/A", "factor"):
                x_in = layer.factor_input(self._kept(x), self.dtype)
                if self._reduces(layer):
                    self.held.call_a(layer, module, x_in, last=cap.a_calls == (self.uses or {}).get(layer.name))
                else:
                    self._add("A", layer, *self.parts.a_part(layer, module, x_in, self._once(layer)))
            self._forward_start[layer.name] = self.timer.now()

        return hook

    def _g_hook(self, layer: KFACLayer) -> Callable[[nn.Module, tuple[Any, ...], dict[str, Any], Tensor], None]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Tensor) -> None:
            given = call_input(args, kwargs)
            if not self.capturing(module) or given is None or not isinstance(output, Tensor):
                return
            if not output.requires_grad:
                return
            batch = self._examples(given)
            reduces, pass_ = self._reduces(layer), self.micro
            if reduces:
                self.held.expect_g(layer, module, pass_)
            start = self._forward_start.pop(layer.name, None)
            if start is not None:
                self.timer.record(layer.name, "forward", start, self.timer.now())

            def grad_hook(grad: Tensor) -> None:
                self.captures[layer.name].g_total += 1
                self._in_backward = True
                if layer.name not in self._g_order:
                    self._g_order.append(layer.name)
                grad = examples_first(grad, batch, self.parts.examples_first)
                kept = self._kept(grad, batch)
                with torch.no_grad(), full_precision(grad), self.timer.span("FactorComp", f"{layer.name}/G", "factor"):
                    g, share = unscaled(kept, self.grad_scale, self.dtype), grad.shape[0] / kept.shape[0]
                    if reduces:  # the pass's calls are all counted once its forward is over
                        self.held.call_g(layer.name, pass_, g, batch, share, closed=pass_ < self.micro)
                        return
                    packed = self.parts.g_part(layer, module, g, batch, share, self._once(layer))
                self._add("G", layer, packed, batch)

            output.register_hook(grad_hook)

        return hook

    def _add(self, side: str, layer: KFACLayer, packed: Contribution, n: int) -> None:
        """Add a part of the layer's A (of ``n`` rows) or G (of ``n`` examples); send it once the step's are in."""
        cap = self.captures[layer.name]
        cap.add(side, packed, n)
        if self._last_call(layer, cap.a_total if side == "A" else cap.g_total):
            self._send(layer, side, cap)

    def _reduces(self, layer: KFACLayer) -> bool:
        """Whether the layer's calls are combined per pass (``reduce``; a layer called once needs no holding)."""
        return self.parts.reduces_calls and (self.uses is None or self.uses.get(layer.name, 0) > 1)

    def _examples(self, x: Tensor) -> int:
        return self.examples if self.examples is not None else x.shape[0]

    def _kept(self, t: Tensor, examples: int | None = None) -> Tensor:
        return leading(t, self._examples(t) if examples is None else examples, self.keep)

    def _once(self, layer: KFACLayer) -> bool:
        """Whether the layer runs once a step (one pass, one call): its factor's rows are then its factor's."""
        return self.passes == 1 and self.uses is not None and self.uses.get(layer.name) == 1

    def _last_call(self, layer: KFACLayer, calls: int) -> bool:
        """Whether the step's ``calls`` complete the layer's factor (known only once ``uses`` is learnt)."""
        return self.uses is not None and self.passes is not None and calls == self.uses[layer.name] * self.passes

    def _send(self, layer: KFACLayer, side: str, cap: LayerCapture) -> None:
        factor = cap.a_factor() if side == "A" else cap.g_factor()
        self.handover.offer(side, f"{layer.name}/{side}", factor)  # the communicator times its part as FactorComm
        cap.sent.add(side)

    # --- step boundaries ------------------------------------------------------------------------------

    def new_pass(self) -> None:
        """The model's forward pass starts (its own hook): a forward call from now on is not a recomputation."""
        self._in_backward = False
        self._model_called = True

    def end_forward(self) -> bool:
        """Close a forward pass; return whether it was the step's last (A factors are all sent then).

        A second call for the same pass (the model's hook, then the caller) does nothing.
        """
        if not self._open:
            return False
        self._open = False
        self.micro += 1
        self.held.end_pass()  # fewer calls than the first step's, or the first step's
        for cap in self.captures.values():
            cap.calls_seen.append(cap.a_calls)
            cap.a_calls = 0
        return self.passes is not None and self.micro == self.passes and self.close_forward()

    def close_forward(self) -> bool:
        """Send every A factor of the step not sent yet; return whether this did (once a step).

        Called when the step's last forward pass ends, or else before its G factors go (the first step,
        whose passes are not known until then; a model trained through methods other than ``forward``,
        which no hook on the model sees: its calls since the last step are one pass).
        """
        if self._forward_closed:
            return False
        if self._open:  # no end_forward: the model itself was not called
            self.end_forward()
            if not self._model_called:
                warn_once(NOT_CALLED)
        self._forward_closed = True
        self._send_rest("A")
        if self.uses is not None:
            self.handover.close("A", placeholders(self.layers, "A", self.dtype))
            return True
        calls = {name: max(cap.calls_seen) for name, cap in self.captures.items() if cap.a is not None}
        absent = placeholders(self.layers, "A", self.dtype)
        extras = self.handover.close("A", absent, (calls, self.micro), complete=False)
        self._calls, self._passes = merged_calls(extras or [(calls, self.micro)])
        return True

    def finish(self) -> list[KFACLayer]:
        """Send the G factors still held, after the step's last backward pass.

        Returns:
            The layers dropped on the first step (never run, or no gradient); empty afterwards.

        Raises:
            UserError: If the step had another number of forward passes than the first, or no layer ran at all.
        """
        self.close_forward()
        if self.micro != (self.passes if self.passes is not None else self._passes):
            raise other_passes(self.micro, self.passes)
        self.held.end_step()  # the first step's, or calls whose output got no gradient
        self._send_rest("G")
        self.handover.close("G", placeholders(self.layers, "G", self.dtype), complete=self.uses is not None)
        if self.uses is not None:
            return []
        self.passes = self._passes
        return self._learn_uses()

    def _send_rest(self, side: str) -> None:
        """Send the factors of one side not sent yet, in the order they were first captured."""
        by_name = {layer.name: layer for layer in self.layers}
        for name in self._a_order if side == "A" else self._g_order:
            cap = self.captures.get(name)
            if cap is None or name not in by_name or (cap.a if side == "A" else cap.g) is None:
                continue
            if side not in cap.sent:
                self._send(by_name[name], side, cap)

    def reset(self) -> None:
        """Forget this step's captures (after the communicate stage returned them)."""
        self.micro = 0
        self.captures = {}
        self.held.clear()
        self._forward_closed = self._in_backward = self._model_called = False
        self.handover.reset()

    def _learn_uses(self) -> list[KFACLayer]:
        """Keep the layers that ran with a gradient on the first step (on some rank), with their calls per pass."""
        ran, got = ran_and_got(self.handover.order, self.captures)
        several = self.handover.order["A"] is not None
        uses, dropped = learn_uses(self.layers, ran, got, self._calls, several, self.parts.reduces_calls)
        self._keep(uses)
        return dropped

    def set_uses(self, uses: dict[str, int], passes: int) -> None:
        """Keep only the layers in ``uses``, with ``passes`` forward passes a step (restored from a checkpoint).

        The ranks agree on the order of their factors again at the next step.
        """
        self._keep(uses)
        self.passes = passes
        self.handover.forget()

    def _keep(self, uses: dict[str, int]) -> None:
        self.drop({layer.name for layer in self.layers} - set(uses))
        self.uses = dict(uses)

    def drop(self, names: set[str]) -> None:
        """Stop capturing the layers ``names`` (they left K-FAC) and remove their hooks."""
        self.hooks.drop(names)
        self.layers = [layer for layer in self.layers if layer.name not in names]
        if self.uses is not None:
            self.uses = {name: n for name, n in self.uses.items() if name not in names}
        self.handover.keep({f"{layer.name}/{side}" for layer in self.layers for side in "AG"})

    def remove(self) -> None:
        """Remove the layers' hooks for good."""
        self.hooks.drop({layer.name for layer in self.layers})
