"""Performance models: alpha-beta communication, inverse time as a function of d, fitting, profiles."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from scipy.optimize import least_squares

from kfacflow import UserError, did_you_mean
from kfacflow.comm.base import Backend
from kfacflow.config import read_yaml


@dataclass
class LinearModel:
    """``t = alpha + beta * m`` seconds for a message of ``m`` elements (the paper's Eq. 14 and 27)."""

    alpha: float
    beta: float
    error: float = 0.0
    """Relative RMS error of the fit on its measurements."""

    def __call__(self, m: float) -> float:
        """Return the predicted seconds for ``m`` elements."""
        return self.alpha + self.beta * m


@dataclass
class InverseModel:
    """Seconds to invert a ``d x d`` factor.

    ``exp``: ``alpha * exp(beta * d)`` (the paper's Eq. 26). ``cubic``: ``alpha + beta * d^3``
    (the flop count of a dense factorisation). Whichever fits the measurements better is kept.
    """

    kind: str
    alpha: float
    beta: float
    error: float = 0.0

    def __call__(self, d: float) -> float:
        """Return the predicted seconds for a ``d x d`` factor."""
        if self.kind == "exp":
            return self.alpha * math.exp(self.beta * d)
        return self.alpha + self.beta * d**3


@dataclass
class Profile:
    """The fitted models of one cluster, with the measurements they came from."""

    allreduce: LinearModel
    broadcast: LinearModel
    inverse: InverseModel
    meta: dict[str, Any] = field(default_factory=dict)
    samples: dict[str, list[list[float]]] = field(default_factory=dict)

    def save(self, path: str | Path) -> None:
        """Write the profile as YAML."""
        Path(path).write_text(yaml.safe_dump(asdict(self), sort_keys=False))

    @staticmethod
    def load(path: str | Path) -> Profile:
        """Read a profile written by :meth:`save` (or by hand: the three models are enough).

        Every field is checked: ``allreduce`` and ``broadcast`` need ``alpha`` and ``beta``, finite
        numbers >= 0; ``inverse`` needs ``kind`` (``exp`` or ``cubic``) and finite ``alpha`` and
        ``beta`` (``alpha`` > 0 for ``exp``); ``error`` is optional, finite and >= 0. A number YAML
        reads as text (``1e-5``, which has no dot) is taken as the number.

        Raises:
            UserError: One line naming the file and the field: missing, unreadable, not UTF-8, not
                YAML, not a mapping, a section or key missing or unknown, or a value out of range.
        """
        where = f"kfac.profile: {str(path)!r}"
        if not os.path.exists(path):
            raise UserError(f"{where} does not exist; write one with tools/fit_perf_models.py.")
        raw = read_yaml(path, where, "the YAML file tools/fit_perf_models.py writes")
        if not isinstance(raw, dict):
            raise UserError(f"{where} must be a mapping, not {type(raw).__name__}; {_NEEDS}.")
        _no_unknown_keys(raw, (*_SECTIONS, "meta", "samples"), where, "")
        sections = {}
        for name, keys in _SECTIONS.items():
            section = raw.get(name)
            if not isinstance(section, dict):
                what = "has no" if section is None else "has a malformed"
                raise UserError(f"{where} {what} '{name}' section; {_NEEDS}.")
            _no_unknown_keys(section, keys, where, f"{name}.")
            sections[name] = section
        allreduce, broadcast = (
            LinearModel(
                alpha=_field(sections[name], name, "alpha", where, "seconds per message"),
                beta=_field(sections[name], name, "beta", where, "seconds per element"),
                error=_field(sections[name], name, "error", where, "relative error of the fit", 0.0),
            )
            for name in ("allreduce", "broadcast")
        )
        inv = sections["inverse"]
        kind = inv.get("kind")
        if kind is None:
            raise UserError(f"{where}: 'inverse.kind' is missing; {_NEEDS}.")
        if kind not in ("exp", "cubic"):
            raise UserError(
                f"{where}: inverse.kind={kind!r} must be 'exp' (alpha * exp(beta * d)) or 'cubic' (alpha + beta * d^3)."
            )
        exp = kind == "exp"
        inverse = InverseModel(
            kind=kind,
            alpha=_field(inv, "inverse", "alpha", where, "seconds", low=0.0 if exp else None, low_open=exp),
            beta=_field(inv, "inverse", "beta", where, "per d" if exp else "seconds per d^3", low=None),
            error=_field(inv, "inverse", "error", where, "relative error of the fit", 0.0),
        )
        extra = {}
        for name in ("meta", "samples"):
            value = raw.get(name) or {}
            if not isinstance(value, dict) or (
                name == "samples" and not all(isinstance(v, list) for v in value.values())
            ):
                want = "a mapping" if name == "meta" else "a mapping of lists of [size, seconds]"
                raise UserError(f"{where}: '{name}' must be {want}; write the profile with tools/fit_perf_models.py.")
            extra[name] = dict(value)
        return Profile(allreduce, broadcast, inverse, meta=extra["meta"], samples=extra["samples"])


_SECTIONS = {
    "allreduce": ("alpha", "beta", "error"),
    "broadcast": ("alpha", "beta", "error"),
    "inverse": ("kind", "alpha", "beta", "error"),
}
_NEEDS = "a profile needs allreduce/broadcast {alpha, beta} and inverse {kind, alpha, beta}"


def _no_unknown_keys(mapping: dict[Any, Any], allowed: tuple[str, ...], where: str, prefix: str) -> None:
    for key in mapping:
        if key not in allowed:
            hint = did_you_mean(str(key), allowed)
            raise UserError(f"{where}: unknown key '{prefix}{key}'.{hint} Known keys: {', '.join(allowed)}.")


def _field(
    section: dict[str, Any],
    name: str,
    key: str,
    where: str,
    what: str,
    default: float | None = None,
    low: float | None = 0.0,
    low_open: bool = False,
) -> float:
    """Return ``section[key]`` as a finite float (``> low`` or ``>= low`` unless ``low`` is None)."""
    if key not in section:
        if default is not None:
            return default
        raise UserError(f"{where}: '{name}.{key}' is missing; {_NEEDS}.")
    value = section[key]
    number = math.nan
    if isinstance(value, (int, float, str)) and not isinstance(value, bool):
        try:
            number = float(value)
        except ValueError:
            pass
    bound = "" if low is None else f" {'>' if low_open else '>='} {low:g}"
    if math.isfinite(number) and (low is None or (number > low if low_open else number >= low)):
        return number
    raise UserError(f"{where}: {name}.{key}={value!r} must be a finite number{bound} ({what}).")


def _rel_rms(pred: np.ndarray, y: np.ndarray) -> float:
    return float(np.sqrt(np.mean(((pred - y) / y) ** 2)))


def fit_linear(sizes: list[float], seconds: list[float]) -> LinearModel:
    """Fit ``alpha + beta * m`` to the relative error, with alpha >= 0 and beta >= 0.

    The loss is robust (Cauchy beyond 10 %) and starts from the least-squares line of the
    absolute times, which the large messages decide: a few small messages far off that line,
    such as those that fit within a shaped link's burst, must not drag the slope every large
    message is timed with. The bounds are part of the fit: clipping an unconstrained negative
    intercept to zero afterwards would leave a slope fitted for a different line.
    """
    m, t = np.asarray(sizes, float), np.asarray(seconds, float)
    # Unknowns in units of the largest sample keep both of them near 1 for the solver.
    t_unit, m_unit = float(t.max()), float(m.max())

    def line(x: np.ndarray) -> np.ndarray:
        return t_unit * (x[0] + x[1] * m / m_unit)

    bulk = least_squares(lambda x: (line(x) - t) / t_unit, np.array([0.01, 1.0]), bounds=(0.0, np.inf)).x
    x = least_squares(lambda x: (line(x) - t) / t, bulk, bounds=(0.0, np.inf), loss="cauchy", f_scale=0.1).x
    alpha, beta = float(x[0] * t_unit), float(x[1] * t_unit / m_unit)
    return LinearModel(alpha, beta, _rel_rms(alpha + beta * m, t))


def fit_inverse(dims: list[float], seconds: list[float]) -> InverseModel:
    """Fit both the exponential and the cubic model and return the one with the smaller error."""
    d, t = np.asarray(dims, float), np.asarray(seconds, float)
    slope, intercept = np.polyfit(d, np.log(t), 1)
    exp = InverseModel("exp", float(math.exp(intercept)), float(slope))
    exp.error = _rel_rms(exp.alpha * np.exp(exp.beta * d), t)
    lin = fit_linear(list(d**3), list(t))
    cubic = InverseModel("cubic", lin.alpha, lin.beta, _rel_rms(lin.alpha + lin.beta * d**3, t))
    return exp if exp.error < cubic.error else cubic


def _time(fn: Callable[[], Any], repeat: int, device: torch.device, sync: Callable[[], None]) -> float:
    best = math.inf
    for _ in range(repeat):
        sync()  # start every rank together: a root that runs ahead makes a broadcast look free
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        tic = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - tic)
    return best


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
) -> dict[str, list[list[float]]]:
    """Measure all-reduce and broadcast of packed ``d x d`` factors and inverses of packed ``d x d`` factors.

    Collective: every rank calls it with the same arguments. Times are the best of ``repeat``
    runs, maximised over ranks (a collective ends when its slowest rank does).

    Returns:
        ``{"allreduce": [[elements, seconds], ...], "broadcast": ..., "inverse": [[d, seconds], ...]}``.
    """
    from kfacflow.kfac.packing import pack, unpack  # kfacflow.kfac imports this module

    device = backend.device
    out: dict[str, list[list[float]]] = {"allreduce": [], "broadcast": [], "inverse": []}
    gen = torch.Generator().manual_seed(0)
    for d in dims:
        m = d * (d + 1) // 2
        buf = torch.ones(m, dtype=dtype, device=device)
        ar = _time(partial(_allreduce, backend, buf), repeat, device, backend.barrier)
        bc = _time(partial(_broadcast, backend, buf), repeat, device, backend.barrier)
        x = torch.randn(d, d, generator=gen, dtype=dtype).to(device)
        # As the preconditioner does: running averages stay packed and a factor is unpacked to invert it.
        packed = pack(x @ x.T / d)
        inv = _time(lambda: inverse(unpack(packed, d), 1e-3), repeat, device, backend.barrier)  # noqa: B023
        out["allreduce"].append([m, ar])
        out["broadcast"].append([m, bc])
        out["inverse"].append([d, inv])
    for key in out:
        times = torch.tensor([s for _, s in out[key]], dtype=torch.float64)
        gathered = backend.gather_objects(times.tolist())
        maxed = np.max(np.asarray(gathered), axis=0)
        out[key] = [[x, float(t)] for (x, _), t in zip(out[key], maxed, strict=True)]
    return out


def fit(samples: dict[str, list[list[float]]], meta: dict[str, Any]) -> Profile:
    """Fit a :class:`Profile` from :func:`measure`'s samples."""

    def cols(key: str) -> tuple[list[float], list[float]]:
        return [x for x, _ in samples[key]], [t for _, t in samples[key]]

    return Profile(
        allreduce=fit_linear(*cols("allreduce")),
        broadcast=fit_linear(*cols("broadcast")),
        inverse=fit_inverse(*cols("inverse")),
        meta=meta,
        samples=samples,
    )


QUICK_DIMS = [32, 64, 128, 256, 512, 768, 1024]
"""Factor sides of the quick calibration a run does at start when it names no profile."""


def calibrate(
    backend: Backend,
    inverse: Callable[[torch.Tensor, float], Any],
    dtype: torch.dtype,
    dims: list[int] | None = None,
    repeat: int = 3,
) -> Profile:
    """Measure and fit on the running job (collective); the same code as ``tools/fit_perf_models.py``."""
    samples = measure(backend, dims or QUICK_DIMS, inverse, dtype, repeat)
    meta = {
        "world_size": backend.world_size,
        "device": str(backend.device),
        "dtype": str(dtype).replace("torch.", ""),
        "backend": type(backend).__name__,
        "created": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    return fit(samples, meta)
