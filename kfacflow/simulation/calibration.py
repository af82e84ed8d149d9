"""Calibration on a live job: time collectives and inverses through the backend, fit a :class:`Profile`."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import numpy as np
import torch

from kfacflow.comm.base import Backend
from kfacflow.kfac.packing import pack, unpack
from kfacflow.perf import Profile, fit
from kfacflow.timing import fastest

QUICK_DIMS = [32, 64, 128, 256, 512, 768, 1024]
"""Factor sides of the quick calibration a run does at start when it names no profile."""


def _allreduce(backend: Backend, buf: torch.Tensor) -> None:
    backend.allreduce_async(buf).wait()


def _broadcast(backend: Backend, buf: torch.Tensor) -> None:
    backend.broadcast_async(buf, 0).wait()


def measure(
    backend: Backend,
    dims: list[int],
    inverse: Callable[[torch.Tensor, float], Any],
    dtype: torch.dtype,
    repeat: int = 3,
    methods: Mapping[str, Callable[[torch.Tensor, float], Any]] | None = None,
) -> dict[str, list[list[float]]]:
    """Measure all-reduce and broadcast of packed ``d x d`` factors and inverses of packed ``d x d`` factors.

    Collective: every rank calls it with the same arguments. Times are the best of ``repeat``
    runs, maximised over ranks (a collective ends when its slowest rank does).

    Returns:
        ``{"allreduce": [[elements, seconds], ...], "broadcast": ..., "inverse": [[d, seconds], ...]}``,
        and ``"inverse:<name>"`` for each of ``methods``.
    """
    device = backend.device
    timed = {"inverse": inverse, **{f"inverse:{name}": method for name, method in (methods or {}).items()}}
    out: dict[str, list[list[float]]] = {"allreduce": [], "broadcast": [], **{key: [] for key in timed}}
    gen = torch.Generator().manual_seed(0)
    for d in dims:
        m = d * (d + 1) // 2
        buf = torch.ones(m, dtype=dtype, device=device)
        ar = fastest(partial(_allreduce, backend, buf), repeat, device, backend.barrier)
        bc = fastest(partial(_broadcast, backend, buf), repeat, device, backend.barrier)
        x = torch.randn(d, d, generator=gen, dtype=dtype).to(device)
        # As the preconditioner does: running averages stay packed and a factor is unpacked to invert it.
        packed = pack(x @ x.T / d)
        out["allreduce"].append([m, ar])
        out["broadcast"].append([m, bc])
        seconds: dict[int, float] = {}  # the default method is usually one of ``methods`` too: time it once
        for key, method in timed.items():
            if id(method) not in seconds:
                seconds[id(method)] = fastest(lambda: method(unpack(packed, d), 1e-3), repeat, device, backend.barrier)  # noqa: B023
            out[key].append([d, seconds[id(method)]])
    for key in out:
        times = torch.tensor([s for _, s in out[key]], dtype=torch.float64)
        gathered = backend.gather_objects(times.tolist())
        maxed = np.max(np.asarray(gathered), axis=0)
        out[key] = [[x, float(t)] for (x, _), t in zip(out[key], maxed, strict=True)]
    return out


def calibrate(
    backend: Backend,
    inverse: Callable[[torch.Tensor, float], Any],
    dtype: torch.dtype,
    dims: list[int] | None = None,
    repeat: int = 3,
    methods: Mapping[str, Callable[[torch.Tensor, float], Any]] | None = None,
) -> Profile:
    """Measure and fit on the running job (collective); the same code as ``tools/fit_perf_models.py``.

    ``inverse`` gives the profile's default inverse model; each of ``methods`` one of its own.
    """
    samples = measure(backend, dims or QUICK_DIMS, inverse, dtype, repeat, methods)
    meta = {
        "world_size": backend.world_size,
        "device": str(backend.device),
        "dtype": str(dtype).replace("torch.", ""),
        "backend": type(backend).__name__,
        "created": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    return fit(samples, meta)
