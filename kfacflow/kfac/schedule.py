"""When a step updates factors and inverts them (``kfac.factor_update_freq``, ``kfac.inv_update_freq``)."""

from __future__ import annotations

from kfacflow.config import KFACConfig


class Schedule:
    """Counts steps; says whether the current one updates factors and inverts.

    Every ``factor_update_freq`` and ``inv_update_freq`` steps, and at the first step after
    :meth:`refresh` (the model's layers changed: no inverse of the old plan may be used), whatever
    the intervals say.
    """

    def __init__(self, cfg: KFACConfig) -> None:
        self.cfg = cfg
        self.steps = 0
        self._refresh = False

    def refresh(self) -> None:
        """Update every factor and invert at this step."""
        self._refresh = True

    def factors(self) -> bool:
        """Whether this step updates factors."""
        return self._refresh or self.steps % self.cfg.factor_update_freq == 0

    def inverts(self) -> bool:
        """Whether this step inverts."""
        return self._refresh or self.steps % self.cfg.inv_update_freq == 0

    def advance(self, refreshed: bool = True) -> None:
        """Go to the next step (``refreshed=False``: this one was skipped and refreshed nothing, so the next does)."""
        self.steps += 1
        self._refresh = self._refresh and not refreshed
