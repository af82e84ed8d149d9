"""One call's part of a layer's factor, as the factor stage makes it: its packed triangle, or its rows.

The capture (:mod:`~kfacflow.kfac.hooks.capture`) adds the parts of a step's calls up. A stage that
computes a factor's packed triangle itself is asked for it; a shipped stage's factor of a layer
called once a step may go as its rows instead, where the exchange holds rows between exchanges
(:class:`~kfacflow.kfac.exchange.Rows`, ``kfac.factor_exchange=inversion``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from kfacflow.kfac.exchange import Contribution, Rows
from kfacflow.kfac.hooks.layer_sums import own
from kfacflow.kfac.layers import KFACLayer
from kfacflow.kfac.packing import pack
from kfacflow.kfac.stages.contracts import FactorStage
from kfacflow.kfac.stages.factors import ExpandFactors


def _offers(stage: object, packed: str, full: str) -> bool:
    """Whether ``stage``'s ``packed`` method gives what its ``full`` one does.

    Only where ``packed`` is defined at least as far down the class tree as ``full``: a subclass of a
    shipped stage that overrides ``a_factor_rows`` alone must not have its factor replaced by the
    inherited triangle of the parent's.
    """
    packed_owner, full_owner = (next((c for c in type(stage).__mro__ if n in vars(c)), None) for n in (packed, full))
    return packed_owner is not None and full_owner is not None and issubclass(packed_owner, full_owner)


class FactorParts:
    """Makes one call's part of a layer's A or G with the factor stage.

    Args:
        factors: The factor stage (``a_factor_rows``, ``g_factor``; the packed and rows forms where it has them).
        dtype: What factors are computed in (``kfac.factor_dtype``).
    """

    def __init__(self, factors: FactorStage, dtype: torch.dtype) -> None:
        self.factors, self.dtype = factors, dtype
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
        self.examples_first: bool = getattr(factors, "examples_first", False)
        """Whether the stage reduces over positions, and so must see each input examples first."""
        self.reduces_calls: bool = (
            getattr(factors, "reduces_calls", False)
            and all(_offers(factors, "a_rows", name) for name in ("a_factor_rows", "a_factor_packed"))
            and all(_offers(factors, "g_rows", name) for name in ("g_factor", "g_factor_packed"))
        )
        """Whether a layer's calls in one forward pass are reduced (``kfac.factor=reduce``): each example's rows
        combined over the calls before the product. Not where a stage overrides the factor it makes of its rows."""
        self._row_counts: dict[str, int] = {}
        """Each layer's rows at its last capture (A's and G's are as many)."""

    def _as_rows(self, layer: KFACLayer, side: str, width: int, once: bool) -> bool:
        """Whether this step hands a factor over as its rows (a layer called once a step, 32 bits or more)."""
        rows = self._row_counts.get(layer.name)
        return (
            self.takes_rows is not None
            and self._rows_are_factors
            and rows is not None
            and once
            and self.dtype.itemsize >= 4
            and self.takes_rows(f"{layer.name}/{side}", rows, width)
        )

    def a_part(self, layer: KFACLayer, module: nn.Module, x: Tensor, once: bool) -> tuple[Contribution, int]:
        """A's packed triangle, or its rows where they are taken, and the row count (``once``: one call a step)."""
        if self._as_rows(layer, "A", layer.a_dim, once):
            a = own(self.factors.a_rows(module, x), x)  # type: ignore[attr-defined]
            self._row_counts[layer.name] = a.shape[0]
            return Rows(a, 1.0 / a.shape[0]), a.shape[0]
        packed, rows = self._a_packed(module, x)
        self._row_counts[layer.name] = rows
        return packed, rows

    def g_part(
        self, layer: KFACLayer, module: nn.Module, grad: Tensor, batch: int, share: float, once: bool
    ) -> Contribution:
        """G's packed triangle, or its rows (``batch * gᵀg``) where they are taken, times ``share``.

        ``share``: how many times more leading rows the output gradient had than ``grad`` holds
        (the examples the factors are estimated from); 1 where every example is kept.
        """
        if self._as_rows(layer, "G", layer.g_dim, once):
            return Rows(own(self.factors.g_rows(module, grad), grad), float(batch) * share)  # type: ignore[attr-defined]
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

    # --- the rows of a layer called several times in one forward pass (reduces_calls) ---------------

    def a_rows(self, module: nn.Module, x: Tensor) -> tuple[Tensor, int]:
        """A call's reduced rows (one an example) and the uses of the weight each averages."""
        return own(self.factors.a_rows(module, x), x), self.factors.uses(module, x)  # type: ignore[attr-defined]

    def g_rows(self, module: nn.Module, grad: Tensor) -> Tensor:
        """A call's output gradients summed over its positions, one row an example."""
        return own(self.factors.g_rows(module, grad), grad)  # type: ignore[attr-defined,no-any-return]

    def a_part_of_rows(self, layer: KFACLayer, a: Tensor, once: bool) -> tuple[Contribution, int]:
        """A's part from the rows ``a`` of a forward pass's calls combined (``once``: the step's one pass)."""
        self._row_counts[layer.name] = a.shape[0]
        if self._as_rows(layer, "A", layer.a_dim, once):
            return Rows(a, 1.0 / a.shape[0]), a.shape[0]
        return self.factors.a_packed_of_rows(a)  # type: ignore[attr-defined,no-any-return]

    def g_part_of_rows(self, layer: KFACLayer, g: Tensor, batch: int, share: float, once: bool) -> Contribution:
        """G's part from the output gradients ``g`` of a forward pass's calls summed, as :meth:`g_part`'s."""
        if self._as_rows(layer, "G", layer.g_dim, once):
            return Rows(g, float(batch) * share)
        packed = self.factors.g_packed_of_rows(g, batch)  # type: ignore[attr-defined]
        return packed if share == 1 else packed * share
