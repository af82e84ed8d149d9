"""Stage *precondition*: ``G^-1 grad A^-1`` per layer, then KL clipping of the whole update."""

from __future__ import annotations

import torch
from torch import Tensor

from kfacflow.kfac.inverse import Inverse
from kfacflow.registry import PRECONDITIONERS


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


class KFACPrecondition:
    """Kronecker-factored natural gradient with KL clipping (Martens & Grosse 2015; Ba et al. 2017)."""

    def __init__(self, kl_clip: float) -> None:
        self.kl_clip = kl_clip
        self.clips = kl_clip > 0

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

    def layer(self, grad: Tensor, a_inv: Inverse, g_inv: Inverse) -> Tensor:
        """Return ``G^-1 grad A^-1`` of one layer."""
        return precondition(grad, a_inv, g_inv)

    def contribution(self, update: Tensor, grad: Tensor) -> Tensor:
        """Return the layer's ``v.g`` (float64)."""
        return v_dot_g(update, grad)

    def finish(self, updates: list[Tensor], contributions: list[Tensor], lr: float) -> list[Tensor]:
        """Scale every layer's update by the KL clipping factor of them all (from each layer's ``v.g``)."""
        if not self.clips or not contributions:
            return updates
        scale = clip_scale(contributions, lr, self.kl_clip)
        with torch.no_grad():  # x * 1 == x exactly: an unclipped step keeps its bits
            return [u * scale.to(u.dtype) for u in updates]


PRECONDITIONERS.add("kfac", KFACPrecondition, "G^-1 grad A^-1 per layer, then KL clipping of the update")
