"""Each example's rows of a layer combined over its calls in one forward pass (``kfac.factor=reduce``).

K-FAC-reduce treats a weight used ``R`` times in one example as it treats a convolution's positions
(Eschenhagen et al. 2023): ``a_n`` is the mean of the example's inputs over every use, ``g_n`` the sum
of its output gradients, and the factors are made of those ``N`` rows. A layer called several times
in one forward pass therefore has its calls' reduced rows (:meth:`ReduceFactors.a_rows
<kfacflow.kfac.stages.factors.ReduceFactors>`: one row an example, its positions averaged) combined
before the product is taken: A's weighted by the uses each averages, so that calls of different
lengths count by their tokens, G's summed. :class:`PassRows` holds them until a pass's calls are in:
A's until the pass's last call (or its end), G's until the last output gradient of that pass
(the gradients of a pass's calls arrive in reverse order, and a step's passes may share one backward
pass, so each gradient is filed under the pass its call ran in).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor, nn

from kfacflow import UserError
from kfacflow.kfac.exchange import Contribution
from kfacflow.kfac.hooks.factor_parts import FactorParts
from kfacflow.kfac.hooks.layer_sums import Sum
from kfacflow.kfac.layers import KFACLayer


@dataclass
class Held:
    """One layer's combined rows of one forward pass, while its calls come in."""

    layer: KFACLayer
    module: nn.Module
    rows: Sum
    """A: ``sum_c uses_c a_c`` (a single call's rows as they are); G: ``sum_c g_c``."""
    batch: int = 0
    """G: the examples of the pass (what G's ``N`` undoes)."""
    share: float = 1.0
    """G: the output gradient's leading rows per row kept (``kfac.factor_examples``)."""
    expected: int = 0
    """G: the pass's calls whose output gradient is awaited."""
    received: int = 0
    """G: the output gradients in so far."""

    def add(self, rows: Tensor, weight: float) -> None:
        """Add a call's rows, refusing another number of examples than the pass's earlier calls had."""
        if rows.shape[0] != self.rows.value.shape[0]:
            raise other_examples(self.layer.name, rows.shape[0], self.rows.value.shape[0])
        self.rows.add(rows, weight)

    def mean(self) -> Tensor:
        """The rows averaged over the uses (A's ``a_n``)."""
        return self.rows.value if self.rows.parts == 1 else self.rows.value / self.rows.total_weight


def other_examples(layer: str, rows: int, before: int) -> UserError:
    """A layer's calls in one forward pass saw different numbers of examples."""
    return UserError(
        f"kfac: layer {layer!r} saw {rows} examples (rows) in one call and {before} in an earlier call of the same "
        "forward pass; kfac.factor=reduce reduces each example's uses over the calls, so every call must see the "
        f"same examples (use kfac.factor=expand, or add {layer!r} to kfac.skip)."
    )


class PassRows:
    """The combined rows held per layer, A's of the forward pass under way and G's per pass, and their parts.

    Args:
        parts: Makes a factor's part of the combined rows.
        add: Where a pass's part goes: ``add("A", layer, part, rows)``, ``add("G", layer, part, examples)``.
        once: Whether a pass is its step's one pass (learnt), so that its part may go as its rows.
    """

    def __init__(
        self,
        parts: FactorParts,
        add: Callable[[str, KFACLayer, Contribution, int], None],
        once: Callable[[], bool],
    ) -> None:
        self.parts, self.add, self.once = parts, add, once
        self.a: dict[str, Held] = {}
        self.g: dict[tuple[str, int], Held] = {}

    def call_a(self, layer: KFACLayer, module: nn.Module, x: Tensor, last: bool) -> None:
        """Take a call's input ``x`` (examples first, as factors take it); hand A's part over at the pass's ``last``."""
        rows, uses = self.parts.a_rows(module, x)
        held = self.a.get(layer.name)
        if held is None:
            self.a[layer.name] = Held(layer, module, Sum(rows, float(uses)))
        else:
            held.add(rows, float(uses))
        if last:
            self._hand_a(layer.name)

    def end_pass(self) -> None:
        """The forward pass is over: hand over A's parts still held."""
        for name in list(self.a):
            self._hand_a(name)

    def _hand_a(self, name: str) -> None:
        held = self.a.pop(name)
        self.add("A", held.layer, *self.parts.a_part_of_rows(held.layer, held.mean(), self.once()))

    def expect_g(self, layer: KFACLayer, module: nn.Module, pass_: int) -> None:
        """A call of forward pass ``pass_`` awaits its output gradient."""
        held = self.g.get((layer.name, pass_))
        if held is None:
            self.g[(layer.name, pass_)] = Held(layer, module, Sum(None, 1.0), expected=1)
        else:
            held.expected += 1

    def call_g(self, name: str, pass_: int, grad: Tensor, batch: int, share: float, closed: bool) -> None:
        """Take the output gradient of a call of pass ``pass_``; hand G's part over once the pass's are all in.

        Args:
            name: The layer.
            pass_: The forward pass the call ran in.
            grad: The output gradient, examples first, of the examples kept.
            batch: The examples of the pass.
            share: The output gradient's leading rows per row kept (``kfac.factor_examples``).
            closed: Whether pass ``pass_``'s forward is over (its calls are all counted).
        """
        held = self.g[(name, pass_)]
        rows = self.parts.g_rows(held.module, grad)
        if held.rows.value is None:
            held.rows.value, held.batch, held.share = rows, batch, share
        else:
            held.add(rows, 1.0)
        held.received += 1
        if closed and held.received == held.expected:
            self._hand_g((name, pass_))

    def end_step(self) -> None:
        """The step's backward passes are over: hand over G's parts still held (calls whose output got no gradient)."""
        for key in [key for key, held in self.g.items() if held.rows.value is not None]:
            self._hand_g(key)

    def _hand_g(self, key: tuple[str, int]) -> None:
        held = self.g.pop(key)
        part = self.parts.g_part_of_rows(held.layer, held.rows.value, held.batch, held.share, self.once())
        self.add("G", held.layer, part, held.batch)

    def clear(self) -> None:
        """Forget everything held (a new step)."""
        self.a.clear()
        self.g.clear()
