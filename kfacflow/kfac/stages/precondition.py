"""Stage *precondition*: ``G^-1 grad A^-1`` per layer (from the gradient, or from its rows), then KL clipping."""

from __future__ import annotations

import logging
import math

import torch
from torch import Tensor

from kfacflow.kfac.stages.contracts import LayerRows
from kfacflow.kfac.stages.inverse import Inverse
from kfacflow.registry import PRECONDITIONERS

logger = logging.getLogger(__name__)


def precondition(grad: Tensor, a_inv: Inverse, g_inv: Inverse) -> Tensor:
    """Return ``G^-1 @ grad @ A^-1``, i.e. ``(A kron G)^-1 vec(grad)`` reshaped (column-major vec).

    Computed in the inverses' dtype (``kfac.inverse_dtype``) and returned in the gradient's.

    Args:
        grad: The ``(g_dim, a_dim)`` gradient matrix.
        a_inv: Damped inverse of A.
        g_inv: Damped inverse of G.
    """
    return g_inv.left(a_inv.right(grad.to(a_inv.tensors[0].dtype))).to(grad.dtype)


def kl_clip_scale(pairs: list[tuple[Tensor, Tensor]], lr: float, kl_clip: float) -> Tensor | float:
    """Return ``min(1, sqrt(kl_clip / (lr^2 sum v.g)))`` over (preconditioned, raw) gradient pairs.

    A float64 tensor on the pairs' device (no read of the device: a GPU's queue is not stalled);
    1 where clipping is off, where there is nothing to clip, or where ``sum v.g`` is not positive
    and finite.

    Args:
        pairs: ``(v, g)`` per layer.
        lr: Current learning rate.
        kl_clip: The bound; 0 disables clipping.
    """
    if kl_clip <= 0 or not pairs:
        return 1.0
    return clip_scale([v_dot_g(v, g) for v, g in pairs], lr, kl_clip)


def v_dot_g(v: Tensor, g: Tensor) -> Tensor:
    """One layer's ``v.g``, in float64 (of float32 tensors it overflows long before the step is too large to clip)."""
    return torch.sum(v.to(torch.float64) * g.to(torch.float64))


def clip_scale(dots: list[Tensor], lr: float, kl_clip: float) -> Tensor:
    """Return :func:`kl_clip_scale` from each layer's ``v.g`` (float64, summed in layer order)."""
    vg = torch.stack(dots).sum() * (lr * lr)
    usable = (vg > 0) & torch.isfinite(vg)
    return torch.where(usable, torch.sqrt(kl_clip / vg).clamp(max=1.0), torch.ones_like(vg))


def rms_normalized(updates: list[Tensor]) -> list[Tensor]:
    """Each update divided by its root mean square (``kfac.normalize=rms``); an all-zero one is left as it is."""
    with torch.no_grad():
        out = []
        for u in updates:
            rms = torch.linalg.vector_norm(u.to(torch.float32)) / math.sqrt(u.numel())
            out.append(u / torch.where(rms > 0, rms, torch.ones_like(rms)).to(u.dtype))
        return out


class KFACPrecondition:
    """Kronecker-factored natural gradient with KL clipping (Martens & Grosse 2015; Ba et al. 2017).

    With ``normalize="rms"`` each layer's update is scaled to RMS 1 instead (KL clipping off).
    """

    def __init__(self, kl_clip: float, normalize: str = "none") -> None:
        self.normalize = normalize
        self.kl_clip = kl_clip if normalize == "none" else 0.0
        self.clips = self.kl_clip > 0
        self.scale: Tensor | None = None
        """The last step's clipping factor (1 where the step was not clipped), on the device; None before one."""

    def __call__(self, grads: list[Tensor], inverses: list[tuple[Inverse, Inverse]], lr: float) -> list[Tensor]:
        """Return the preconditioned and clipped gradients, one per layer.

        Args:
            grads: ``(g_dim, a_dim)`` gradients.
            inverses: ``(A^-1, G^-1)`` per layer.
            lr: Current learning rate (KL clipping bounds the step, not the direction).
        """
        updates = [self.layer(g, a, gi) for g, (a, gi) in zip(grads, inverses, strict=True)]
        dots = [self.contribution(u, g) for u, g in zip(updates, grads, strict=True)] if self.clips else []
        return self.finish(updates, dots, lr)

    def layer(self, grad: Tensor, a_inv: Inverse, g_inv: Inverse, rows: LayerRows | None = None) -> Tensor:
        """Return ``G^-1 grad A^-1`` of one layer (``rows``: never given to this stage)."""
        return precondition(grad, a_inv, g_inv)

    def rows_pay(self, rows: int, a_dim: int, g_dim: int) -> bool:
        """Whether a layer is preconditioned from its rows: never, here."""
        return False

    def contribution(self, update: Tensor, grad: Tensor) -> Tensor:
        """Return the layer's ``v.g`` (float64)."""
        return v_dot_g(update, grad)

    def finish(self, updates: list[Tensor], contributions: list[Tensor], lr: float) -> list[Tensor]:
        """Scale every layer's update by the KL clipping factor of them all (from each layer's ``v.g``)."""
        if self.normalize == "rms":
            self.scale = None
            return rms_normalized(updates)
        if not self.clips or not contributions:
            self.scale = None
            return updates
        scale = self.scale = clip_scale(contributions, lr, self.kl_clip)
        with torch.no_grad():  # x * 1 == x exactly: an unclipped step keeps its bits
            return [u * scale.to(u.dtype) for u in updates]


def full_flops(a_dim: int, g_dim: int) -> int:
    """Flops of ``G^-1 grad A^-1`` from the ``(g, a)`` gradient: ``2ga(g + a)``."""
    return 2 * g_dim * a_dim * (g_dim + a_dim)


def row_flops(rows: int, a_dim: int, g_dim: int) -> int:
    """Flops of ``(G^-1 D^T)(a A^-1)`` from ``rows`` rows: ``2N(a^2 + g^2 + ga)``."""
    return 2 * rows * (a_dim * a_dim + g_dim * g_dim + g_dim * a_dim)


def rows_give(delta: Tensor, a: Tensor, world: int, grad: Tensor, eps: float) -> Tensor:
    """Whether ``delta^T a / world`` is ``grad`` to ``sqrt(eps)`` of its norm (a boolean tensor on the device).

    ``eps``: of the least precise dtype the rows were computed in (the gradient's is taken too). NaN
    compares false: a non-finite gradient never passes.
    """
    target = grad.to(a.dtype)
    error = torch.linalg.matrix_norm(delta.T @ a / world - target)
    return error <= math.sqrt(max(eps, torch.finfo(grad.dtype).eps)) * torch.linalg.matrix_norm(target)


class RowsPrecondition(KFACPrecondition):
    """As ``kfac``, from the layer's rows where that takes at most half the flops (:mod:`~kfacflow.kfac.hooks.rows`).

    The rows must give the gradient being preconditioned: ``D^T a / P`` is checked against it
    (``2gNa`` flops and one read of the device a layer), to ``sqrt(eps)`` of the least precise dtype
    either was computed in; where they differ (the gradients were changed between the backward pass
    and the step, a rank had more rows than it could send) the layer is preconditioned from its
    gradient, and a warning names it once. Where the gradients are averaged after the backward pass,
    each rank checks its own rows against its own gradient instead, and the layer's averaged gradient
    is rebuilt from the rows rather than sent (:meth:`~kfacflow.kfac.hooks.rows.RowCapture.rebuild`).
    """

    SHARE = 0.5
    """At most this share of the flops from the gradient, or the layer goes by its gradient."""

    def __init__(self, kl_clip: float, normalize: str = "none") -> None:
        super().__init__(kl_clip, normalize)
        self.warned: set[str] = set()

    def rows_pay(self, rows: int, a_dim: int, g_dim: int) -> bool:
        """Whether ``rows`` rows a step (over every rank) cost at most :attr:`SHARE` of preconditioning the gradient."""
        return row_flops(rows, a_dim, g_dim) <= self.SHARE * full_flops(a_dim, g_dim)

    def layer(self, grad: Tensor, a_inv: Inverse, g_inv: Inverse, rows: LayerRows | None = None) -> Tensor:
        """Return ``G^-1 grad A^-1``, from ``rows`` where they give ``grad``."""
        if rows is None:
            return precondition(grad, a_inv, g_inv)
        if not rows.rebuilt and not bool(rows_give(rows.delta, rows.a, rows.world, grad, rows.eps) & rows.complete):
            if rows.name not in self.warned:
                self.warned.add(rows.name)
                logger.warning(
                    "kfac.precondition=rows: the rows of %s do not give its gradient (it was changed after the "
                    "backward pass, or a rank had more rows than on the first step): preconditioned from its "
                    "gradient this step",
                    rows.name,
                )
            return precondition(grad, a_inv, g_inv)
        left = g_inv.left(rows.delta.T.to(g_inv.tensors[0].dtype))
        right = a_inv.right(rows.a.to(a_inv.tensors[0].dtype))
        return (left @ right).div_(rows.world).to(grad.dtype)


PRECONDITIONERS.add("kfac", KFACPrecondition, "G^-1 grad A^-1 per layer, then KL clipping of the update")
PRECONDITIONERS.add(
    "rows",
    RowsPrecondition,
    "as kfac, from each layer's rows (input patches and output gradients) where that takes half the flops or less",
)
