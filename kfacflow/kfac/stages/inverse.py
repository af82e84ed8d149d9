"""Stage *invert*: damped inverses of factors, as one small type every other stage understands.

An :class:`Inverse` is what is broadcast (:meth:`Inverse.to_flat`), checkpointed
(:attr:`Inverse.tensors`) and applied (:meth:`Inverse.left`, :meth:`Inverse.right`), so any
inverse method works with any placement and any precondition stage. Two kinds exist: the dense
matrix (Cholesky) and the eigendecomposition.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import Tensor

from kfacflow.kfac.packing import pack, pack_lower, packed_size, unpack, unpack_lower
from kfacflow.kfac.stages.contracts import Inverse
from kfacflow.registry import INVERSES

__all__ = [
    "Cholesky",
    "CholeskyFactor",
    "CholeskyBased",
    "CholeskyFactorInverse",
    "DenseInverse",
    "Eigen",
    "EigenInverse",
    "Inverse",
    "cholesky_factor",
    "cholesky_inverse",
    "eigen_inverse",
    "invert_all",
]

logger = logging.getLogger(__name__)


class _OneMatrix(Inverse):
    """An inverse held as one ``d x d`` matrix, which may also travel whole."""

    def __init__(self, matrix: Tensor) -> None:
        self.matrix = matrix

    @property
    def tensors(self) -> tuple[Tensor, ...]:
        """The matrix."""
        return (self.matrix,)

    def to_full(self) -> Tensor:
        """Return the whole matrix as a vector (a view: nothing is copied)."""
        return self.matrix.reshape(-1)

    def full_exact(self) -> bool:
        """Whether the matrix is row-major, as a received copy is."""
        return self.matrix.is_contiguous()

    @classmethod
    def full_elements(cls, d: int) -> int:
        """Return ``d^2``."""
        return d * d

    @classmethod
    def from_full(cls, flat: Tensor, d: int) -> Inverse:
        """Take the received matrix as it is (a view)."""
        return cls(flat.view(d, d))

    @classmethod
    def elements(cls, d: int) -> int:
        """Return ``d (d + 1) / 2``: a triangle travels."""
        return packed_size(d)


class DenseInverse(_OneMatrix):
    """The symmetric inverse matrix; it travels as its packed upper triangle, or whole."""

    kind = "dense"

    def left(self, x: Tensor) -> Tensor:
        """Return ``inverse @ x``."""
        return self.matrix @ x

    def dense(self) -> Tensor:
        """Return the matrix."""
        return self.matrix

    def to_flat(self) -> Tensor:
        """Return the packed upper triangle."""
        return pack(self.matrix)

    def round_trip_exact(self) -> bool:
        """Whether the matrix is exactly symmetric (its unpacked upper triangle is then the same matrix)."""
        return self.matrix.is_contiguous() and torch.equal(self.matrix, self.matrix.T)

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


EXPLICIT_UP_TO = 2048
"""Widest factor whose Cholesky inverse (:class:`CholeskyFactorInverse`) is also formed explicitly to be applied.

Two triangular solves cost more than one product with the explicit inverse, most for small factors. On one
thread of this project's AMD EPYC CPU (``tools/bench_apply.py``), preconditioning a ``g x a`` gradient took
0.031 against 0.006 ms at 16 x 10, 0.11 against 0.024 at 32 x 145, 1.07 against 0.42 at 64 x 513, 7.5 against
4.8 at 128 x 1153, 45 against 33 at 256 x 2304 (``docs/results/explicit_inverses_2workers``); forming both explicit
inverses (``potri``) is repaid after 1-5 applications up to 513 wide, 8-14 up to 2304. At 512 x 4608 the runs
of one day gave 14 to 144 applications (the solves ran 1.02-1.3x the products' time): left to the solves."""

EXPLICIT_FROM_USES = 10
"""Fewest applications of one inverse (steps of an inversion period) for which it is formed explicitly."""


def explicit_inverse(chol: Tensor) -> Tensor:
    """``(L L^T)^-1`` from the lower Cholesky factor ``L``, exactly symmetric.

    On CUDA ``cholesky_solve`` against the identity, made exactly symmetric: ``cholesky_inverse`` checks its own
    status, one more wait for the device per factor.
    """
    if not chol.is_cuda:
        return torch.cholesky_inverse(chol)
    x = torch.cholesky_solve(torch.eye(chol.shape[0], dtype=chol.dtype, device=chol.device), chol)
    return torch.add(x, x.T).mul_(0.5)


class CholeskyFactorInverse(_OneMatrix):
    """``(F + damping I)^-1`` kept as the Cholesky factor ``L`` of ``F + damping I``: applied by two triangular solves.

    A third of the flops of an explicit inverse to compute (no ``potri``), and no less accurate. ``L`` travels
    as its packed triangle, or whole; :attr:`matrix` is ``L``, what a checkpoint keeps. Where one inverse serves
    enough steps (:meth:`for_uses`) the explicit inverse is formed from ``L`` once and applied by one product
    instead: the solves cost more (:data:`EXPLICIT_UP_TO`). Every rank forms it from the same ``L`` alike, and
    a resumed run from the checkpoint's.
    """

    kind = "cholesky_factor"

    def __init__(self, matrix: Tensor) -> None:
        super().__init__(matrix)
        self.explicit: Tensor | None = None
        """``(L L^T)^-1``, where :meth:`for_uses` formed it; then :meth:`left` and :meth:`right` multiply by it."""

    def for_uses(self, uses: int) -> Inverse:
        """Form the explicit inverse where ``uses`` applications repay it (:data:`EXPLICIT_UP_TO`); return this."""
        if self.explicit is None and uses >= EXPLICIT_FROM_USES and self.matrix.shape[0] <= EXPLICIT_UP_TO:
            self.explicit = explicit_inverse(self.matrix)
        return self

    def left(self, x: Tensor) -> Tensor:
        """Return ``(L L^T)^-1 x``: two triangular solves, or one product with the explicit inverse."""
        if self.explicit is not None:
            return self.explicit @ x
        y = torch.linalg.solve_triangular(self.matrix, x, upper=False)
        return torch.linalg.solve_triangular(self.matrix.T, y, upper=True)

    def right(self, x: Tensor) -> Tensor:
        """Return ``x (L L^T)^-1``, solving from the right (or one product with the explicit inverse).

        About as fast as multiplying by an explicit inverse for a 512 x 4608 gradient on one CPU thread (1.02-1.3x
        its time), where ``cholesky_solve`` on the transpose takes 1.4x the solves'.
        """
        if self.explicit is not None:
            return x @ self.explicit
        y = torch.linalg.solve_triangular(self.matrix.T, x, upper=True, left=False)
        return torch.linalg.solve_triangular(self.matrix, y, upper=False, left=False)

    def dense(self) -> Tensor:
        """Return the inverse as a dense matrix (the explicit one, where formed)."""
        return explicit_inverse(self.matrix) if self.explicit is None else self.explicit

    def to_flat(self) -> Tensor:
        """Return the lower triangle of ``L``, packed (as the upper triangle of ``L^T``)."""
        return pack_lower(self.matrix)

    def round_trip_exact(self) -> bool:
        """Whether ``L`` is exactly lower triangular (its packed triangle is then all of it)."""
        return self.matrix.is_contiguous() and torch.equal(self.matrix, self.matrix.tril())

    @classmethod
    def unflat(cls, flat: Tensor, d: int) -> Inverse:
        """Unpack the triangle into ``L`` (zeros above the diagonal)."""
        return cls(unpack_lower(flat, d))


def _damped(factor: Tensor, damping: float) -> Tensor:
    return factor + damping * torch.eye(factor.shape[0], dtype=factor.dtype, device=factor.device)


RETRY_BOOSTS = (1, 10, 100)
_warned: set[str] = set()


def warn_once(message: str) -> None:
    """Log ``message`` as a warning the first time this process sees it."""
    if message not in _warned:
        _warned.add(message)
        logger.warning("%s (logged once)", message)


def _cholesky_with_retries(
    factor: Tensor,
    damping: float,
    factorize: Callable[[Tensor], tuple[Tensor, Tensor]] = torch.linalg.cholesky_ex,
    boosts: tuple[int, ...] = RETRY_BOOSTS,
) -> Tensor | None:
    """The Cholesky factor of ``factor + damping I``, the damping raised tenfold twice if needed; None if it fails.

    ``factorize`` returns the factor of a matrix and its info code (0: positive definite); CuPy's
    inverse passes cuSOLVER's (:mod:`kfacflow.kfac.stages.cupy_inverse`). ``boosts``: the damping's
    multiples to try (:func:`invert_all` has tried the first already).
    """
    for boost in boosts:
        chol, info = factorize(_damped(factor, damping * boost))
        if int(info) == 0:
            if boost != 1:
                warn_once(f"a factor needed {boost}x damping to be positive definite")
            return chol
    warn_once("a factor stayed indefinite under Cholesky; using its eigendecomposition")
    return None


class CholeskyBased:
    """An inverse made from the Cholesky factor of ``factor + damping I``, with retries and a fallback.

    A factor whose large eigenvalues make the damping vanish in round-off is not numerically
    positive definite. Then the damping is raised tenfold, twice, and if that fails too the
    eigendecomposition (with negative eigenvalues clamped) gives the inverse; this is logged
    once per process. Every rank that inverts the same factor takes the same path.

    A subclass says how a factorization is made (:meth:`factorize`, without reading its status),
    what becomes of a successful one (:meth:`from_cholesky`) and of a failed one
    (:meth:`fallback`); :func:`invert_all` reads the statuses of many at once.
    """

    result: type[Inverse]

    def factorize(self, matrix: Tensor) -> tuple[Tensor, Tensor]:
        """Return the lower Cholesky factor of ``matrix`` and its status on the device (0: positive definite)."""
        chol, info = torch.linalg.cholesky_ex(matrix)
        return chol, info

    def from_cholesky(self, chol: Tensor) -> Inverse:
        """Return the inverse of a successful factorization (no status read)."""
        raise NotImplementedError

    def fallback(self, factor: Tensor, damping: float) -> Inverse:
        """Return the inverse of a factor that stayed indefinite under every damping boost."""
        raise NotImplementedError

    def __call__(self, factor: Tensor, damping: float) -> Inverse:
        """Return the damped inverse of ``factor``."""
        return invert_all(self, [factor], damping)[0]


def invert_all(invert: Callable[[Tensor, float], Inverse], factors: list[Tensor], damping: float) -> list[Inverse]:
    """Invert every factor; a Cholesky-based method factors them all first and reads their statuses once.

    On a GPU each read of a status waits for everything queued before it: one read for the lot,
    instead of one per factor, lets the work of every factorization queue up. The rare factor
    that is not positive definite retries with more damping on its own.
    """
    if not isinstance(invert, CholeskyBased) or not factors:
        return [invert(factor, damping) for factor in factors]
    firsts = [invert.factorize(_damped(factor, damping)) for factor in factors]
    good = torch.stack([info.reshape(()) for _, info in firsts]).eq(0).tolist()  # the one read
    out: list[Inverse] = []
    for factor, (chol, _), ok in zip(factors, firsts, good, strict=True):
        if not ok:
            retried = _cholesky_with_retries(factor, damping, invert.factorize, RETRY_BOOSTS[1:])
            if retried is None:
                out.append(invert.fallback(factor, damping))
                continue
            chol = retried
        out.append(invert.from_cholesky(chol))
    return out


class Cholesky(CholeskyBased):
    """``(factor + damping I)^-1`` through a Cholesky factorisation (half LU's flops), as a dense matrix."""

    result: type[Inverse] = DenseInverse

    def from_cholesky(self, chol: Tensor) -> Inverse:
        """Return ``(L L^T)^-1`` as a :class:`DenseInverse`."""
        return DenseInverse(explicit_inverse(chol))

    def fallback(self, factor: Tensor, damping: float) -> Inverse:
        """The eigendecomposition's inverse, as a dense matrix."""
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


class CholeskyFactor(CholeskyBased):
    """``(factor + damping I)^-1`` as the Cholesky factor of ``factor + damping I`` (no explicit inverse).

    A factor that is not numerically positive definite gets the damping raised tenfold, twice,
    as :class:`Cholesky` does; then the factor of its eigendecomposition with negative
    eigenvalues clamped (logged once).
    """

    result: type[Inverse] = CholeskyFactorInverse

    def from_cholesky(self, chol: Tensor) -> Inverse:
        """Keep ``L`` itself, row-major as a received copy is: the same layout rounds the same on every rank."""
        return CholeskyFactorInverse(chol.contiguous())

    def fallback(self, factor: Tensor, damping: float) -> Inverse:
        """The Cholesky factor of the eigendecomposition with negative eigenvalues clamped."""
        evals, q = torch.linalg.eigh(factor)
        clamped = (q * (evals.clamp(min=0.0) + damping)) @ q.T
        chol, _ = torch.linalg.cholesky_ex((clamped + clamped.T) / 2)
        return CholeskyFactorInverse(chol.contiguous())


cholesky_inverse = Cholesky()
cholesky_factor = CholeskyFactor()
eigen_inverse = Eigen()
INVERSES.add("cholesky", cholesky_inverse, "Cholesky factorisation then cholesky_inverse (dense result)")
INVERSES.add("eigen", eigen_inverse, "symmetric eigendecomposition; Q and 1/(lambda+damping) travel")
INVERSES.add(
    "cholesky_factor",
    cholesky_factor,
    "Cholesky factor only (a third of the flops); preconditioning solves with it, or multiplies by the explicit "
    "inverse formed from it where the inversion period repays that",
)
