"""The ranges a numeric recipe key may take (:class:`Range`) and the field metadata that declares them."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from kfacflow import UserError


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


@dataclass(frozen=True)
class Range:
    """The values a numeric recipe key may take; NaN and the infinities are always out.

    Kept in a field's ``metadata["range"]``; :func:`kfacflow.configuration.rules.check` walks the schema and
    applies every one (to each element of a list).
    """

    low: float
    low_open: bool = False
    """Whether ``low`` itself is out (``> low`` rather than ``>= low``)."""
    high: float = math.inf
    high_text: str = ""
    """How to print ``high`` (e.g. ``2**63``)."""
    hint: str = ""
    """What the bounds mean, printed in brackets after the rule."""

    def holds(self, value: float) -> bool:
        """Whether ``value`` is finite and within the bounds (the upper one is always excluded)."""
        if not math.isfinite(value):
            return False
        above = value > self.low if self.low_open else value >= self.low
        return above and value < self.high

    def rule(self, number: bool = False) -> str:
        """The bounds in words: ``>= 0``, ``in [0, 1)``; ``number``: a float, said to be finite."""
        if math.isinf(self.high):
            op = f"{'>' if self.low_open else '>='} {_number(self.low)}"
            return f"a finite number {op}" if number else op
        opening = "(" if self.low_open else "["
        return f"in {opening}{_number(self.low)}, {self.high_text or _number(self.high)})"

    def check(self, key: str, value: float) -> None:
        """Raise a :class:`UserError` naming ``key`` unless :meth:`holds`."""
        if self.holds(value):
            return
        hint = f" ({self.hint})" if self.hint else ""
        raise UserError(f"{key}={value} must be {self.rule(isinstance(value, float))}{hint}.")


def at_least(low: float, hint: str = "") -> dict[str, Range]:
    """Field metadata: the value must be ``>= low`` (and finite)."""
    return {"range": Range(low, hint=hint)}


def above(low: float, hint: str = "") -> dict[str, Range]:
    """Field metadata: the value must be ``> low`` (and finite)."""
    return {"range": Range(low, low_open=True, hint=hint)}


def within(low: float, high: float, hint: str = "", high_text: str = "") -> dict[str, Range]:
    """Field metadata: the value must be in ``[low, high)``."""
    return {"range": Range(low, high=high, high_text=high_text, hint=hint)}


CORES = os.cpu_count() or 1
"""This machine's CPU cores. A worker may start at most this many threads or loader processes: more only wait
for a core (and a pool of thousands dies in the threading library); every machine of a job checks its own."""


def up_to_cores(hint: str) -> dict[str, Range]:
    """Field metadata: a count from 0 to :data:`CORES`; ``hint`` says what 0 means."""
    return within(0, CORES + 1, f"{hint}; this machine has {CORES} CPU cores")
