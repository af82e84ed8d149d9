"""Performance models: alpha-beta communication, inverse time as a function of d, fitting, profiles."""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from kfacflow import UserError, did_you_mean
from kfacflow.configuration.yaml_file import read_yaml

START_UP_SHARE = 0.1
"""A message whose start-up is at most this share of its transfer is not fused further (``LinearModel.amortized``)."""


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

    def amortized(self, m: float) -> bool:
        """Whether a message of ``m`` elements has paid for its start-up: ``alpha <= START_UP_SHARE * beta * m``.

        Fusing more into such a message saves little, and what is fused waits for the last of it.
        """
        return self.alpha <= START_UP_SHARE * self.beta * m


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
    methods: dict[str, InverseModel] = field(default_factory=dict)
    """Inverse models by ``kfac.inverse`` method, where they were measured (their costs differ up to 3x)."""

    def for_method(self, method: str) -> Profile:
        """This profile with ``inverse`` the model of ``method`` (the default model if it was not measured)."""
        if method not in self.methods:
            return self
        return replace(self, inverse=self.methods[method])

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
        _no_unknown_keys(raw, (*_SECTIONS, "meta", "samples", "methods"), where, "")
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
        inverse = _inverse_model(sections["inverse"], "inverse", where)
        methods = raw.get("methods") or {}
        if not isinstance(methods, dict):
            raise UserError(f"{where}: 'methods' must map kfac.inverse methods to models {{kind, alpha, beta}}.")
        models = {}
        for method, section in methods.items():
            if not isinstance(section, dict):
                raise UserError(f"{where}: 'methods.{method}' must be an inverse model {{kind, alpha, beta}}.")
            _no_unknown_keys(section, _SECTIONS["inverse"], where, f"methods.{method}.")
            models[str(method)] = _inverse_model(section, f"methods.{method}", where)
        extra = {}
        for name in ("meta", "samples"):
            value = raw.get(name) or {}
            if not isinstance(value, dict) or (
                name == "samples" and not all(isinstance(v, list) for v in value.values())
            ):
                want = "a mapping" if name == "meta" else "a mapping of lists of [size, seconds]"
                raise UserError(f"{where}: '{name}' must be {want}; write the profile with tools/fit_perf_models.py.")
            extra[name] = dict(value)
        return Profile(allreduce, broadcast, inverse, meta=extra["meta"], samples=extra["samples"], methods=models)


_SECTIONS = {
    "allreduce": ("alpha", "beta", "error"),
    "broadcast": ("alpha", "beta", "error"),
    "inverse": ("kind", "alpha", "beta", "error"),
}
_NEEDS = "a profile needs allreduce/broadcast {alpha, beta} and inverse {kind, alpha, beta}"


def _inverse_model(section: dict[str, Any], name: str, where: str) -> InverseModel:
    kind = section.get("kind")
    if kind is None:
        raise UserError(f"{where}: '{name}.kind' is missing; {_NEEDS}.")
    if kind not in ("exp", "cubic"):
        raise UserError(
            f"{where}: {name}.kind={kind!r} must be 'exp' (alpha * exp(beta * d)) or 'cubic' (alpha + beta * d^3)."
        )
    exp = kind == "exp"
    return InverseModel(
        kind=kind,
        alpha=_field(section, name, "alpha", where, "seconds", low=0.0 if exp else None, low_open=exp),
        beta=_field(section, name, "beta", where, "per d" if exp else "seconds per d^3", low=None),
        error=_field(section, name, "error", where, "relative error of the fit", 0.0),
    )


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

    from scipy.optimize import least_squares  # 0.3 s to import, for the fit alone

    bulk = least_squares(lambda x: (line(x) - t) / t_unit, np.array([0.01, 1.0]), bounds=(0.0, np.inf)).x
    x = least_squares(lambda x: (line(x) - t) / t, bulk, bounds=(0.0, np.inf), loss="cauchy", f_scale=0.1).x
    alpha, beta = float(x[0] * t_unit), float(x[1] * t_unit / m_unit)
    return LinearModel(alpha, beta, _rel_rms(alpha + beta * m, t))


def fit_inverse(dims: list[float], seconds: list[float]) -> InverseModel:
    """Fit the exponential and the cubic model; return the exponential only where it is clearly better.

    Placement decides about the largest factors, beyond the calibrated sides (ResNet's 4608 from
    calibration up to 2048), and an exponential extrapolates wildly: it must fit with half the
    cubic's error and predict the largest side from the others better than the cubic does (every
    method here is O(d^3) in the end). Choosing by the error of the whole fit alone let a few
    milliseconds of noise on the smallest sides (a shared CPU, the other rank's traffic) pick an
    exponential that predicted 32 s for an inversion that takes 0.9 s at d = 4096.
    """
    order = np.argsort(np.asarray(dims, float))
    d, t = np.asarray(dims, float)[order], np.asarray(seconds, float)[order]
    exp, cubic = _fit_exp(d, t), _fit_cubic(d, t)
    if len(d) < 4:
        return exp if exp.error < cubic.error else cubic
    exp_out, cubic_out = _fit_exp(d[:-1], t[:-1]), _fit_cubic(d[:-1], t[:-1])
    extrapolates = abs(exp_out(d[-1]) / t[-1] - 1) < abs(cubic_out(d[-1]) / t[-1] - 1)
    return exp if extrapolates and exp.error < cubic.error / 2 else cubic


def _fit_exp(d: np.ndarray, t: np.ndarray) -> InverseModel:
    slope, intercept = np.polyfit(d, np.log(t), 1)
    exp = InverseModel("exp", float(math.exp(intercept)), float(slope))
    exp.error = _rel_rms(exp.alpha * np.exp(exp.beta * d), t)
    return exp


def _fit_cubic(d: np.ndarray, t: np.ndarray) -> InverseModel:
    lin = fit_linear(list(d**3), list(t))
    return InverseModel("cubic", lin.alpha, lin.beta, _rel_rms(lin.alpha + lin.beta * d**3, t))


def fit(samples: dict[str, list[list[float]]], meta: dict[str, Any]) -> Profile:
    """Fit a :class:`Profile` from measured samples (:func:`kfacflow.simulation.calibration.measure`'s)."""

    def cols(key: str) -> tuple[list[float], list[float]]:
        return [x for x, _ in samples[key]], [t for _, t in samples[key]]

    return Profile(
        allreduce=fit_linear(*cols("allreduce")),
        broadcast=fit_linear(*cols("broadcast")),
        inverse=fit_inverse(*cols("inverse")),
        meta=meta,
        samples=samples,
        methods={key.split(":", 1)[1]: fit_inverse(*cols(key)) for key in samples if key.startswith("inverse:")},
    )
