"""Stage *invert*: damped inverses of factors, as one small type every other stage understands.

An :class:`Inverse` is what is broadcast (:meth:`Inverse.to_flat`), checkpointed
(:attr:`Inverse.tensors`) and applied (:meth:`Inverse.left`, :meth:`Inverse.right`), so any
inverse method works with any placement and any precondition stage. Two kinds exist: the dense
matrix (Cholesky) and the eigendecomposition.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor

from kfacflow.kfac.packing import pack, packed_size, unpack
from kfacflow.kfac.stages import Inverse
from kfacflow.registry import INVERSES

__all__ = ["Cholesky", "DenseInverse", "Eigen", "EigenInverse", "Inverse", "cholesky_inverse", "eigen_inverse"]

logger = logging.getLogger(__name__)


class DenseInverse(Inverse):
    """The symmetric inverse matrix; it travels as its packed upper triangle."""

    kind = "dense"

    def __init__(self, matrix: Tensor) -> None:
        self.matrix = matrix

    @property
    def tensors(self) -> tuple[Tensor, ...]:
        """The matrix."""
        return (self.matrix,)

    def left(self, x: Tensor) -> Tensor:
        """Return ``inverse @ x``."""
        return self.matrix @ x

    def dense(self) -> Tensor:
        """Return the matrix."""
        return self.matrix

    def to_flat(self) -> Tensor:
        """Return the packed upper triangle."""
        return pack(self.matrix)

    @classmethod
    def elements(cls, d: int) -> int:
        """Return ``d (d + 1) / 2``."""
        return packed_size(d)

    @classmethod
    def unflat(cls, flat: Tensor, d: int) -> Inverse:
        """Unpack the upper triangle."""
        return cls(unpack(flat, d))


class EigenInverse(Inverse):
    """``Q diag(scale) Q^T`` with ``scale = 1 / (lambda + damping)``; ``Q`` and ``scale`` travel."""

    kind = "eigen"

    def __init__(self, q: Tensor, scale: Tensor) -> None:
        self.q, self.scale = q, scale

    @property
    def tensors(self) -> tuple[Tensor, ...]:
        """``Q`` and the scales."""
        return (self.q, self.scale)

    def left(self, x: Tensor) -> Tensor:
        """Return ``Q diag(scale) Q^T x``."""
        return self.q @ (self.scale[:, None] * (self.q.T @ x))

    def dense(self) -> Tensor:
        """Return ``Q diag(scale) Q^T``."""
        return (self.q * self.scale) @ self.q.T

    def to_flat(self) -> Tensor:
        """Return ``Q`` (row-major) followed by the scales."""
        return torch.cat([self.q.reshape(-1), self.scale])

    @classmethod
    def elements(cls, d: int) -> int:
        """Return ``d^2 + d``."""
        return d * d + d

    @classmethod
    def unflat(cls, flat: Tensor, d: int) -> Inverse:
        """Split the vector into ``Q`` and the scales."""
        return cls(flat[: d * d].reshape(d, d), flat[d * d :])


def _damped(factor: Tensor, damping: float) -> Tensor:
    return factor + damping * torch.eye(factor.shape[0], dtype=factor.dtype, device=factor.device)


RETRY_BOOSTS = (1, 10, 100)
_warned: set[str] = set()


def warn_once(message: str) -> None:
    """Log ``message`` as a warning the first time this process sees it."""
    if message not in _warned:
        _warned.add(message)
        logger.warning("%s (logged once)", message)


class Cholesky:
    """``(factor + damping I)^-1`` through a Cholesky factorisation (half LU's flops).

    A factor whose large eigenvalues make the damping vanish in round-off is not numerically
    positive definite. Then the damping is raised tenfold, twice, and if that fails too the
    eigendecomposition (with negative eigenvalues clamped) gives the inverse; this is logged
    once per process. Every rank that inverts the same factor takes the same path.
    """

    result: type[Inverse] = DenseInverse

    def __call__(self, factor: Tensor, damping: float) -> Inverse:
        """Return the damped inverse of ``factor`` as a :class:`DenseInverse`."""
        for boost in RETRY_BOOSTS:
            chol, info = torch.linalg.cholesky_ex(_damped(factor, damping * boost))
            if int(info) == 0:
                if boost != 1:
                    warn_once(f"a factor needed {boost}x damping to be positive definite")
                return DenseInverse(torch.cholesky_inverse(chol))
        warn_once("a factor stayed indefinite under Cholesky; using its eigendecomposition")
        return DenseInverse(eigen_inverse(factor, damping).dense())


class Eigen:
    """``(factor + damping I)^-1`` as ``Q diag(1/(lambda + damping)) Q^T``.

    Eigenvalues below zero (round-off of a PSD factor) are clamped to zero first.
    """

    result: type[Inverse] = EigenInverse

    def __call__(self, factor: Tensor, damping: float) -> Inverse:
        """Return the damped inverse of ``factor`` as an :class:`EigenInverse`."""
        evals, q = torch.linalg.eigh(factor)
        return EigenInverse(q, 1.0 / (evals.clamp(min=0.0) + damping))


cholesky_inverse = Cholesky()
eigen_inverse = Eigen()
INVERSES.add("cholesky", cholesky_inverse, "Cholesky factorisation then cholesky_inverse (dense result)")
INVERSES.add("eigen", eigen_inverse, "symmetric eigendecomposition; Q and 1/(lambda+damping) travel")
