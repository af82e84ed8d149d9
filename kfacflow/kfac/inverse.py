"""Stage *invert*: damped inverses of factors, as one small type every other stage understands."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import Tensor

from kfacflow.kfac.factors import pack, packed_size, unpack
from kfacflow.registry import INVERSES

logger = logging.getLogger(__name__)


@dataclass
class Inverse:
    """``(F + damping I)^-1`` of one factor, stored densely or as an eigendecomposition.

    ``dense`` holds the symmetric inverse; ``eigen`` holds ``Q`` and ``1 / (lambda + damping)``
    so that the inverse is ``Q diag(scale) Q^T``. Preconditioning, broadcasting and
    checkpointing only go through the methods below, so any inverse works with any placement.
    """

    kind: str
    tensors: tuple[Tensor, ...]

    def left(self, x: Tensor) -> Tensor:
        """Return ``inverse @ x``."""
        if self.kind == "dense":
            return self.tensors[0] @ x
        q, scale = self.tensors
        return q @ (scale[:, None] * (q.T @ x))

    def right(self, x: Tensor) -> Tensor:
        """Return ``x @ inverse`` (the inverse is symmetric)."""
        return self.left(x.T).T

    def dense(self) -> Tensor:
        """Return the inverse as a dense matrix."""
        if self.kind == "dense":
            return self.tensors[0]
        q, scale = self.tensors
        return (q * scale) @ q.T

    def to_flat(self) -> Tensor:
        """Return one vector to broadcast: the packed upper triangle, or ``Q`` and the scales."""
        if self.kind == "dense":
            return pack(self.tensors[0])
        q, scale = self.tensors
        return torch.cat([q.reshape(-1), scale])

    @staticmethod
    def flat_size(kind: str, d: int) -> int:
        """Return the length of :meth:`to_flat` for a d x d factor."""
        return packed_size(d) if kind == "dense" else d * d + d

    @staticmethod
    def from_flat(kind: str, flat: Tensor, d: int) -> Inverse:
        """Rebuild an :class:`Inverse` from :meth:`to_flat`'s vector."""
        if kind == "dense":
            return Inverse("dense", (unpack(flat, d),))
        return Inverse("eigen", (flat[: d * d].reshape(d, d), flat[d * d :]))


def _damped(factor: Tensor, damping: float) -> Tensor:
    return factor + damping * torch.eye(factor.shape[0], dtype=factor.dtype, device=factor.device)


def cholesky_inverse(factor: Tensor, damping: float) -> Inverse:
    """Return ``(factor + damping I)^-1`` through a Cholesky factorisation (half LU's flops).

    A factor whose large eigenvalues make the damping vanish in round-off is not numerically
    positive definite. Then the damping is raised tenfold, twice, and if that fails too the
    eigendecomposition (with negative eigenvalues clamped) gives the inverse; this is logged
    once per process. Every rank that inverts the same factor takes the same path.
    """
    for boost in RETRY_BOOSTS:
        chol, info = torch.linalg.cholesky_ex(_damped(factor, damping * boost))
        if int(info) == 0:
            if boost != 1:
                warn_once(f"a factor needed {boost}x damping to be positive definite")
            return Inverse("dense", (torch.cholesky_inverse(chol),))
    warn_once("a factor stayed indefinite under Cholesky; using its eigendecomposition")
    return Inverse("dense", (eigen_inverse(factor, damping).dense(),))


RETRY_BOOSTS = (1, 10, 100)
_warned: set[str] = set()


def warn_once(message: str) -> None:
    """Log ``message`` as a warning the first time this process sees it."""
    if message not in _warned:
        _warned.add(message)
        logger.warning("%s (logged once)", message)


def eigen_inverse(factor: Tensor, damping: float) -> Inverse:
    """Return ``(factor + damping I)^-1`` as ``Q diag(1/(lambda + damping)) Q^T``.

    Eigenvalues below zero (round-off of a PSD factor) are clamped to zero first.
    """
    evals, q = torch.linalg.eigh(factor)
    return Inverse("eigen", (q, 1.0 / (evals.clamp(min=0.0) + damping)))


INVERSES.add("cholesky", cholesky_inverse, "Cholesky factorisation then cholesky_inverse (dense result)")
INVERSES.add("eigen", eigen_inverse, "symmetric eigendecomposition; Q and 1/(lambda+damping) travel")
KINDS = {"cholesky": "dense", "eigen": "eigen"}
