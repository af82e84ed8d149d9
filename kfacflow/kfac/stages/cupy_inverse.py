"""Inverse ``cupy_cholesky``: what ``cholesky`` computes, through CuPy's cuSOLVER on torch's current stream.

CuPy is optional (``pip install -r requirements-gpu.txt``) and imported on first use only: importing
kfacflow never imports it. Tensors are shared with CuPy through DLPack (nothing is copied) and
cuSOLVER runs on torch's current stream, so its work is ordered with torch's kernels. A run that
chooses it where it cannot run (no CUDA device, or no CuPy) is rejected before it starts
(:func:`check_usable`, through :func:`kfacflow.running.build.check_device`).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
from torch import Tensor

from kfacflow import UserError
from kfacflow.kfac.stages.contracts import Inverse
from kfacflow.kfac.stages.inverse import CholeskyBased, DenseInverse, cholesky_inverse, eigen_inverse, warn_once
from kfacflow.registry import INVERSES

__all__ = ["NAME", "CupyCholesky", "check_usable", "cupy_cholesky"]

NAME = "cupy_cholesky"
NEEDS = f"kfac.inverse={NAME} needs a CUDA device and CuPy (pip install -r requirements-gpu.txt)"
PREFIX = {torch.float32: "s", torch.float64: "d"}
"""cuSOLVER's routine prefix by dtype (the dtypes it factors)."""


class _CuPy(NamedTuple):
    cupy: Any
    cusolver: Any
    lower: int
    """``CUBLAS_FILL_MODE_LOWER``."""


@functools.cache
def _import() -> _CuPy:
    """Import CuPy and its cuSOLVER binding (which fails where CuPy was built for another CUDA)."""
    import cupy
    from cupy_backends.cuda.libs import cublas, cusolver

    return _CuPy(cupy, cusolver, cublas.CUBLAS_FILL_MODE_LOWER)


def _import_error() -> str | None:
    """Why CuPy cannot be imported here, in a few words; None if it can."""
    try:
        _import()
    except Exception as err:  # noqa: BLE001 - a missing package, or CUDA libraries of another version
        text = str(err).strip().splitlines()
        return f"{type(err).__name__}: {text[0]}" if text else type(err).__name__
    return None


def check_usable(device: torch.device | str) -> None:
    """Check that ``cupy_cholesky`` can run on ``device``: a CUDA device, with CuPy importable.

    Raises:
        UserError: Naming ``kfac.inverse`` and what to do.
    """
    if torch.device(device).type != "cuda":
        raise UserError(f"{NEEDS}, but this run's device is {device}; on CPU use kfac.inverse=cholesky.")
    error = _import_error()
    if error is not None:
        raise UserError(f"{NEEDS}, but CuPy does not import ({error}); install it, or use kfac.inverse=cholesky.")


@contextlib.contextmanager
def _on_torch_stream(cu: _CuPy, device: torch.device) -> Iterator[int]:
    """Run CuPy, within, on ``device`` and torch's current stream there; yield the cuSOLVER handle bound to it.

    The handle's stream is set here, not left to CuPy: cuSOLVER then runs after torch's kernels
    that produced the factor and before those that read the inverse, whatever CuPy's handle had.
    """
    cp, current = cu.cupy, torch.cuda.current_stream(device)
    try:  # CuPy >= 14 (where ExternalStream is deprecated) takes torch's stream by its __cuda_stream__
        stream = cp.cuda.Stream.from_external(current)
    except (AttributeError, TypeError):
        stream = cp.cuda.ExternalStream(current.cuda_stream, device.index)
    with torch.cuda.device(device), cp.cuda.Device(device.index), stream:
        handle = cp.cuda.device.get_cusolver_handle()
        cu.cusolver.setStream(handle, current.cuda_stream)
        yield handle


def _ptr(cp: Any, tensor: Tensor) -> int:
    """The address of ``tensor``'s memory, as CuPy sees it through DLPack (a view: nothing is copied)."""
    return int(cp.from_dlpack(tensor).data.ptr)


def _potrf(cu: _CuPy, a: Tensor) -> tuple[Tensor, Tensor]:
    """Factor the symmetric ``a`` in place with cuSOLVER's ``potrf``; return it and the info (0: positive definite).

    cuSOLVER reads the row-major ``a`` as its transpose, the same matrix; only one triangle of the
    result holds the factor, as :func:`_potrs_identity` expects.
    """
    n, p, cp = a.shape[0], PREFIX[a.dtype], cu.cupy
    info = torch.zeros(1, dtype=torch.int32, device=a.device)
    with _on_torch_stream(cu, a.device) as handle:
        lwork = getattr(cu.cusolver, f"{p}potrf_bufferSize")(handle, cu.lower, n, _ptr(cp, a), n)
        work = torch.empty(max(lwork, 1), dtype=a.dtype, device=a.device)
        getattr(cu.cusolver, f"{p}potrf")(handle, cu.lower, n, _ptr(cp, a), n, _ptr(cp, work), lwork, _ptr(cp, info))
    return a, info


def _potrs_identity(cu: _CuPy, chol: Tensor) -> Tensor:
    """``A^-1`` from ``potrf``'s factor of ``A``: cuSOLVER's ``potrs`` against the identity, made exactly symmetric."""
    n, p, cp = chol.shape[0], PREFIX[chol.dtype], cu.cupy
    x = torch.eye(n, dtype=chol.dtype, device=chol.device)
    info = torch.zeros(1, dtype=torch.int32, device=chol.device)  # potrs reports only bad arguments: not read
    with _on_torch_stream(cu, chol.device) as handle:
        getattr(cu.cusolver, f"{p}potrs")(handle, cu.lower, n, n, _ptr(cp, chol), n, _ptr(cp, x), n, _ptr(cp, info))
    # The solution is A^-1 up to round-off in each half; their mean is exactly symmetric, as a
    # dense inverse must be to travel as its packed triangle and still be the owner's bits.
    return torch.add(x, x.T).mul_(0.5)


def _cupy_for(factor: Tensor) -> _CuPy | None:
    """CuPy if it can invert ``factor`` (a float32 or float64 CUDA tensor, CuPy importable); else None, logged once."""
    if factor.is_cuda and factor.dtype in PREFIX:
        error = _import_error()
        if error is None:
            return _import()
        why = f"CuPy does not import ({error})"
    else:
        why = f"CuPy takes float32 and float64 CUDA tensors, not {factor.dtype} on {factor.device}"
    warn_once(f"kfac.inverse={NAME}: {why}; torch's Cholesky (kfac.inverse=cholesky) inverts instead")
    return None


class CupyCholesky(CholeskyBased):
    """``(factor + damping I)^-1`` as ``cholesky`` computes it, with cuSOLVER's ``potrf`` and ``potrs`` through CuPy.

    The damping, its tenfold raises when a factor is not numerically positive definite, the
    eigendecomposition after them, and the statuses read once for many factors
    (:func:`~kfacflow.kfac.stages.inverse.invert_all`) are :class:`~kfacflow.kfac.stages.inverse.Cholesky`'s (the
    same base), so the result equals ``cholesky``'s to round-off. A factor CuPy cannot take (on the
    CPU, another dtype, no CuPy) is inverted by ``cholesky`` itself, logged once: only a calibration
    or a tool meets one, as a run that would is rejected before it starts (:func:`check_usable`).
    """

    result: type[Inverse] = DenseInverse

    def factorize(self, matrix: Tensor) -> tuple[Tensor, Tensor]:
        """Factor ``matrix`` in place with cuSOLVER's ``potrf``, status unread (torch's, where CuPy cannot)."""
        cu = _cupy_for(matrix)
        return cholesky_inverse.factorize(matrix) if cu is None else _potrf(cu, matrix)

    def from_cholesky(self, chol: Tensor) -> Inverse:
        """``potrs`` against the identity, from :meth:`factorize`'s result."""
        cu = _cupy_for(chol)
        return cholesky_inverse.from_cholesky(chol) if cu is None else DenseInverse(_potrs_identity(cu, chol))

    def fallback(self, factor: Tensor, damping: float) -> Inverse:
        """The eigendecomposition's inverse, as ``cholesky``'s."""
        return DenseInverse(eigen_inverse(factor, damping).dense())


cupy_cholesky = CupyCholesky()
INVERSES.add(
    NAME,
    cupy_cholesky,
    "cholesky's dense inverse through CuPy's cuSOLVER (potrf, potrs) on torch's stream; CUDA and CuPy only "
    "(pip install -r requirements-gpu.txt)",
)
