"""When a step updates factors and which factors it inverts (``kfac.*_update_freq``, ``kfac.inverse_schedule``)."""

from __future__ import annotations

from collections.abc import Sequence

from kfacflow.configuration.schema import KFACConfig
from kfacflow.kfac.stages.contracts import EVERY_RANK


def stagger(dims: Sequence[int], owners: Sequence[int], world: int, turns: int) -> list[int]:
    """Each factor's turn, ``0 .. turns-1``, in an inverse period spread over ``turns`` factor updates.

    A turn takes as long as its slowest rank's inversions (ranks invert side by side), so largest
    first (an inverse costs ``dim^3``) each factor goes to the turn it lengthens least: a factor
    loads the rank that owns it, or every rank where every rank inverts it (``EVERY_RANK``); ties
    go to the turn that stays shortest, then to the earlier one. Every rank computes the same turns
    from the plan.
    """
    load = [[0.0] * world for _ in range(turns)]
    chosen = [0] * len(dims)
    for i in sorted(range(len(dims)), key=lambda i: (-dims[i], i)):
        cost = float(dims[i]) ** 3
        ranks = range(world) if owners[i] == EVERY_RANK else [owners[i]]

        def lengthens(turn: int, ranks: Sequence[int] | range = ranks, cost: float = cost) -> tuple[float, float, int]:
            after = max(load[turn][r] + (cost if r in ranks else 0.0) for r in range(world))
            return after - max(load[turn]), after, turn

        chosen[i] = min(range(turns), key=lengthens)
        for r in ranks:
            load[chosen[i]][r] += cost
    return chosen


class Schedule:
    """Counts steps; says whether the current one updates factors and which factors it inverts.

    Every ``factor_every`` steps factors are updated. Every ``inverse_every`` steps every factor is
    inverted (``kfac.inverse_schedule=all``); or (``staggered``) each factor is inverted once per
    period of ``inverse_every`` steps at a factor update of its own turn (:func:`stagger`), so that
    every factor update carries a share. The first step, and the first after :meth:`refresh` (the
    model's layers changed: no inverse of the old plan may be used), update and invert everything,
    whatever the intervals say.

    The run-time values live here, not in the recipe's ``kfac`` section: the intervals start as
    ``kfac.factor_update_freq`` and ``kfac.inv_update_freq`` and the damping as ``kfac.damping``;
    a schedule of the step (the library's) changes them from a step on (:meth:`set_intervals`,
    :attr:`damping`), leaving the configuration as it was given.
    """

    def __init__(self, cfg: KFACConfig) -> None:
        self.factor_every = cfg.factor_update_freq
        """Steps between factor updates."""
        self.inverse_every = cfg.inv_update_freq
        """Steps between inversions (a multiple of :attr:`factor_every`)."""
        self.damping = cfg.damping
        """The Tikhonov damping the step's inversions use."""
        self.spread = cfg.inverse_schedule == "staggered"
        self.steps = 0
        self._refresh = False
        self.turns: dict[str, int] = {}
        """Each factor's turn where staggered (by key); empty: every factor inverts on the same step."""

    def set_intervals(self, factor_every: int, inverse_every: int) -> None:
        """Update factors every ``factor_every`` steps and invert every ``inverse_every`` from this step on.

        The turns depend on the intervals: :meth:`plan` gives them again.
        """
        self.factor_every, self.inverse_every = factor_every, inverse_every

    @property
    def staggered(self) -> int:
        """Turns in a period where inverses are staggered (``kfac.inverse_schedule=staggered``), else 0."""
        turns = self.inverse_every // self.factor_every
        return turns if self.spread and turns > 1 else 0

    def plan(self, keys: Sequence[str], dims: Sequence[int], owners: Sequence[int], world: int) -> None:
        """Give each factor its turn (from a new plan, or new intervals)."""
        turns = self.staggered
        self.turns = dict(zip(keys, stagger(dims, owners, world, turns), strict=True)) if turns else {}

    def refresh(self) -> None:
        """Update every factor and invert at this step."""
        self._refresh = True

    def factors(self) -> bool:
        """Whether this step updates factors."""
        return self._refresh or self.steps % self.factor_every == 0

    def inverts(self) -> bool:
        """Whether this step inverts any factor."""
        if self.turns:  # every factor update inverts a turn (the first step inverts everything)
            return self.factors()
        return self._refresh or self.steps % self.inverse_every == 0

    def due(self, key: str) -> bool:
        """Whether this step inverts the factor ``key``."""
        if not self.turns or self._refresh or self.steps == 0:
            return self.inverts()
        f = self.factor_every
        return self.steps % f == 0 and (self.steps // f) % self.staggered == self.turns[key]

    def advance(self, refreshed: bool = True) -> None:
        """Go to the next step (``refreshed=False``: this one was skipped and refreshed nothing, so the next does)."""
        self.steps += 1
        self._refresh = self._refresh and not refreshed
