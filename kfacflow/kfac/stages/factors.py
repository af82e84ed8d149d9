"""Stage *factor*: Kronecker factors A and G of a layer, and their packed upper triangles.

Conventions (the paper's, with a batch-mean loss over the local batch of ``N`` examples):

- ``a`` is the layer input as the weight sees it (``KFACLayer.layer_input``: TF-same
  convolutions pad it first) with a ones column appended when the bias is preconditioned
  with the weight (it exists and is trained), so the bias is the last column of the weight
  matrix; a frozen bias gets no column.
- ``Dg = N * grad_output`` is the per-example gradient w.r.t. the layer output (the
  ``N`` undoes the 1/N of the batch-mean loss).
- Linear: ``A = 1/N sum_n a_n a_n^T`` and ``G = 1/N sum_n Dg_n Dg_n^T``. Extra leading
  dimensions (tokens) are treated as the spatial positions of a convolution.
- Conv2d, ``expand`` (KFC, Grosse & Martens 2016): each of the ``L`` output positions ``t``
  contributes the patch ``a_{n,t}`` it was computed from (``F.unfold`` order, channel-major,
  matching ``weight.view(C_out, -1)``) and its output gradient ``Dg_{n,t}``:
  ``A = 1/(N L) sum_{n,t} a a^T`` and ``G = 1/N sum_{n,t} Dg Dg^T``, so that
  ``A kron G`` equals KFC's ``Omega kron Gamma``.
- Conv2d, ``reduce`` (K-FAC-reduce, Eschenhagen et al. 2023): positions are reduced first,
  ``a_n = 1/L sum_t a_{n,t}``, ``Dg_n = sum_t Dg_{n,t}``, then as for Linear. A Linear's tokens
  (the positions of a sequence, ``(N, S, E)`` inputs) are reduced the same way: the weight is
  shared across the sequence as a convolution's across the image, and its factors then come from
  ``N`` rows instead of ``N S``. Capture hands this stage each input examples first. A layer
  called ``R`` times in one forward pass is reduced over all its uses alike: ``a_n`` the mean of
  its inputs over every call and position (each call weighted by its positions), ``Dg_n`` the sum
  of its output gradients over them (capture combines the calls' rows, :meth:`ReduceFactors.uses`).

Averaging these factors over ``P`` workers with ``N`` examples each gives exactly the
factors of one worker with ``P N`` examples.

What is averaged, sent and kept is the packed upper triangle (:mod:`kfacflow.kfac.packing`), so a
factor is computed as that triangle only (:func:`gram_packed`): block row by block row, about
``(k + 1) / 2k`` of the full product's multiplications for ``k`` blocks.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kfacflow.kfac.layers import bias_preconditioned
from kfacflow.kfac.packing import pack, unpack
from kfacflow.registry import FACTORS

GRAM_BLOCK = 128
"""Widest block row of :func:`gram_packed` (at most 8 blocks): narrower blocks skip more of the lower
triangle but multiply less efficiently. On one CPU thread (``tools/bench_gram.py``, batch 32 at 32 px;
the small CNN at 28 px, batch 64) a step's factor products take 0.74x the whole products' time on
ResNet-50, 0.78x on ResNet-18 and 0.88x on the small CNN (0.78x, 0.80x, 0.99x with 384). Not measured
on a GPU, where the blocks' extra kernel launches may weigh more than the half product they save."""


def gram_blocks(width: int) -> int:
    """Return how many block rows :func:`gram_packed` splits a ``width``-wide product into."""
    return max(1, min(8, -(-width // GRAM_BLOCK)))


def gram_packed(a: Tensor, right: Tensor | None = None) -> Tensor:
    """Return ``pack(a.T @ right)`` (``right`` defaults to ``a``; it is ``a`` scaled) from the upper triangle alone.

    Block row ``[r0, r1)`` of the product is ``a[:, r0:r1].T @ right[:, r0:]``, written in place into
    a square buffer whose lower triangle is never computed and never read (``pack`` reads the upper
    one); only the diagonal blocks' lower halves are multiplied in vain.
    """
    right = a if right is None else right
    width = a.shape[1]
    k = gram_blocks(width)
    if k == 1:
        return pack(a.T @ right)
    out = a.new_empty(width, width)
    for i in range(k):
        r0, r1 = width * i // k, width * (i + 1) // k
        torch.mm(a[:, r0:r1].T, right[:, r0:], out=out[r0:r1, r0:])
    return pack(out)


def conv_windows(module: nn.Conv2d, x: Tensor) -> Tensor:
    """Return the input windows of ``module`` as a view ``(N, H_out, W_out, C_in, kh, kw)`` of the padded input.

    Padding is applied as the module applies it (``_reversed_padding_repeated_twice`` covers
    integer, tuple and ``"same"`` padding). A view, not ``F.unfold``'s copy: the patches are then
    copied once, straight into the matrix the factor is made from (or, for ``reduce``, averaged
    without any copy).
    """
    x = F.pad(x, module._reversed_padding_repeated_twice)
    (kh, kw), (sh, sw), (dh, dw) = module.kernel_size, module.stride, module.dilation
    windows = x.unfold(2, dh * (kh - 1) + 1, sh).unfold(3, dw * (kw - 1) + 1, sw)[..., ::dh, ::dw]
    return windows.permute(0, 2, 3, 1, 4, 5)


POSITIONS_INNER_FROM = 4
"""Narrowest output width whose Conv2d rows are copied with the positions innermost (:func:`positions_inner`).

On one CPU thread (``tools/bench_gram.py --rows``) the 145-wide patches of the small CNN's second
convolution (64 examples at 28 px) copy in 2.4 instead of 21.7 ms, ResNet-18's first-stage ones
(8 px wide at 32 px) in 0.8 instead of 3.6 ms; at output widths of 2 or 1 the copy is slower
that way (0.9 against 0.4 ms at 2)."""


def positions_inner(width_step: int, channel_step: int, width: int) -> bool:
    """Whether a Conv2d's rows are copied column-major: output positions innermost, read in runs along the width.

    Where the input steps along its width by less than along its channels (the default, channels-first
    layout) and the output is at least :data:`POSITIONS_INNER_FROM` wide, the copy then reads and
    writes long runs instead of one kernel row (``kw`` elements) at a time. A channels-last input
    keeps the row-major copy, which reads its channels in runs.
    """
    return width >= POSITIONS_INNER_FROM and width_step < channel_step


def row_matrix(a: Tensor, bias: bool) -> Tensor:
    """``a`` as a matrix of rows, with a ones column where the bias is preconditioned with the weight.

    ``a`` is ``(rows, width)`` or conv windows ``(N, H_out, W_out, C_in, kh, kw)`` (rows: the first three
    dimensions). The rows are copied at most once, into a matrix that already holds the ones column;
    conv windows into a column-major one where that copies faster (:func:`positions_inner`): the same
    values, which every product takes as they are.
    """
    lead = 3 if a.dim() == 6 else 1
    n, width = a.shape[:lead].numel(), a.shape[lead:].numel()
    if lead == 3 and positions_inner(a.stride(2), a.stride(3), a.shape[2]):
        by_column = a.permute(3, 4, 5, 0, 1, 2)
        out = a.new_empty(width + bias, n)
        out[:width].view(by_column.shape).copy_(by_column)
        if bias:
            out[width] = 1
        return out.T
    if not bias:
        return a.reshape(n, width)
    out = a.new_empty(n, width + 1)
    out[:, :width].view(a.shape).copy_(a)
    out[:, width] = 1
    return out


class ExpandFactors:
    """KFC factors: every spatial position of a Conv2d output counts as a sample."""

    def a_factor(self, module: nn.Module, x: Tensor) -> Tensor:
        """Return A for ``module`` from its input ``x``."""
        return self.a_factor_rows(module, x)[0]

    def a_factor_rows(self, module: nn.Module, x: Tensor) -> tuple[Tensor, int]:
        """Return A and the number of rows ``a`` it averages (examples, times positions for ``expand``).

        The row count weighs A when several calls or micro-batches make up one step.
        """
        packed, n = self.a_factor_packed(module, x)
        return unpack(packed, _side(packed)), n

    def a_factor_packed(self, module: nn.Module, x: Tensor) -> tuple[Tensor, int]:
        """Return A's packed upper triangle and its row count (what capture sums and sends)."""
        return self.a_packed_of_rows(self.a_rows(module, x))

    def a_packed_of_rows(self, a: Tensor) -> tuple[Tensor, int]:
        """Return the packed triangle of ``aᵀa / n`` for the ``n`` rows ``a``, and ``n``."""
        n = a.shape[0]
        if a.dtype.itemsize < 4:  # float16's 65504 would overflow in the sum: scale the rows first
            return gram_packed(a, a / n), n
        return gram_packed(a).div_(n), n  # one division of the triangle, not of the (much larger) rows

    def g_factor(self, module: nn.Module, grad_out: Tensor, batch: int) -> Tensor:
        """Return G for ``module`` from the gradient of its output and the local batch size."""
        packed = self.g_factor_packed(module, grad_out, batch)
        return unpack(packed, _side(packed))

    def g_factor_packed(self, module: nn.Module, grad_out: Tensor, batch: int) -> Tensor:
        """Return G's packed upper triangle."""
        return self.g_packed_of_rows(self.g_rows(module, grad_out), batch)

    def g_packed_of_rows(self, g: Tensor, batch: int) -> Tensor:
        """Return the packed triangle of ``batch gᵀg`` for the output gradient's rows ``g``."""
        return gram_packed(g).mul_(batch)

    def a_rows(self, module: nn.Module, x: Tensor) -> Tensor:
        """The rows ``a`` that A is the mean of: ``(rows, a_dim)``, the ones column of a preconditioned bias last."""
        a = self._conv_a(module, x) if isinstance(module, nn.Conv2d) else self._tokens_a(x)
        return row_matrix(a, bias_preconditioned(module))

    def g_rows(self, module: nn.Module, grad_out: Tensor) -> Tensor:
        """The rows ``g`` of the output gradient that G sums: ``(rows, g_dim)``."""
        return self._conv_g(grad_out) if isinstance(module, nn.Conv2d) else self._tokens_g(grad_out)

    def _tokens_a(self, x: Tensor) -> Tensor:
        """A Linear's inputs as rows: every token of every example one row."""
        return x.reshape(-1, x.shape[-1])

    def _tokens_g(self, grad_out: Tensor) -> Tensor:
        return grad_out.reshape(-1, grad_out.shape[-1])

    def _conv_a(self, module: nn.Conv2d, x: Tensor) -> Tensor:
        """The patches, as windows ``(N, H_out, W_out, C_in, kh, kw)`` (``row_matrix`` copies them once)."""
        return conv_windows(module, x)

    def _conv_g(self, grad_out: Tensor) -> Tensor:
        """The output gradients by position, ``(N H_out W_out, C_out)``: column-major where that copies faster."""
        if positions_inner(grad_out.stride(3), grad_out.stride(1), grad_out.shape[3]):
            return grad_out.transpose(0, 1).reshape(grad_out.shape[1], -1).T
        return grad_out.flatten(2).transpose(1, 2).reshape(-1, grad_out.shape[1])


class ReduceFactors(ExpandFactors):
    """K-FAC-reduce factors: every use of the weight in one example reduced, inputs averaged, output gradients summed.

    The uses are a Conv2d's positions and a Linear's tokens within one call, and the calls of one
    forward pass (a weight shared ``R`` times): capture combines the rows of a layer's calls
    (``a_rows`` weighted by :meth:`uses`, ``g_rows`` summed) before the product is taken.
    """

    examples_first = True
    """Inputs with positions come examples first (``(N, S, E)``; capture turns ``(S, N, E)`` round)."""
    reduces_calls = True
    """A layer called several times in one forward pass has its calls reduced as its positions are."""

    def uses(self, module: nn.Module, x: Tensor) -> int:
        """How many uses of the weight each row of ``a_rows(module, x)`` averages: tokens, output positions, or 1."""
        if isinstance(module, nn.Conv2d):
            pads = module._reversed_padding_repeated_twice  # (left, right, top, bottom): width's first
            sizes = [
                (size + pads[2 - 2 * i] + pads[3 - 2 * i] - d * (k - 1) - 1) // s + 1
                for i, (size, k, s, d) in enumerate(
                    zip(x.shape[-2:], module.kernel_size, module.stride, module.dilation, strict=True)
                )
            ]
            return sizes[0] * sizes[1]
        return x.shape[1:-1].numel() if x.dim() > 2 else 1

    def _tokens_a(self, x: Tensor) -> Tensor:
        return x.flatten(1, -2).mean(dim=1) if x.dim() > 2 else x.reshape(-1, x.shape[-1])

    def _tokens_g(self, grad_out: Tensor) -> Tensor:
        return grad_out.flatten(1, -2).sum(dim=1) if grad_out.dim() > 2 else grad_out.reshape(-1, grad_out.shape[-1])

    def _conv_a(self, module: nn.Conv2d, x: Tensor) -> Tensor:
        return conv_windows(module, x).mean(dim=(1, 2)).flatten(1)

    def _conv_g(self, grad_out: Tensor) -> Tensor:
        return grad_out.sum(dim=(2, 3))


def _side(packed: Tensor) -> int:
    """The side ``d`` of the square a packed triangle of ``d (d + 1) / 2`` elements came from."""
    return math.isqrt(2 * packed.numel())


FACTORS.add("expand", ExpandFactors, "KFC: each Conv2d output position is a sample (Grosse & Martens 2016)")
FACTORS.add(
    "reduce",
    ReduceFactors,
    "K-FAC-reduce: a weight's uses in one example (positions, tokens, calls) reduced first (Eschenhagen et al. 2023)",
)
