"""Strategy *factor exchange*: when a step's factors are summed over ranks (``kfac.factor_exchange``).

:class:`AtUpdate` (``update``, the paper) sums every factor update's factors, and blends each
average into its running average. :class:`AtInversion` (``inversion``) sums them only on the steps
that invert: between those each rank keeps its own decayed sums (:class:`~kfacflow.kfac.exchange.LocalSums`,
where the mathematics is), which an exchange sends instead of the step's factors. One is chosen
per stage set (:func:`exchange_for`); the running state (:class:`~kfacflow.kfac.state.FactorState`)
asks it what a step sends, how an arrived factor is blended, and what it still holds.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from torch import Tensor

from kfacflow.kfac.exchange import LocalSums
from kfacflow.kfac.finite import blend
from kfacflow.kfac.stages.contracts import Absent

if TYPE_CHECKING:
    from kfacflow.comm.base import Backend
    from kfacflow.kfac.hooks.capture import Capture
    from kfacflow.kfac.planning.schedule import Schedule
    from kfacflow.timing import StepTimer


class Exchange(Protocol):
    """When factors are summed over ranks, and how what arrives joins the running averages."""

    def sends(self) -> bool:
        """Whether this step sums factors over ranks after its backward pass."""
        ...

    @property
    def holding(self) -> bool:
        """Whether this rank holds factors not yet exchanged."""
        ...

    def route(self, capture: Capture) -> None:
        """Hand the capture's factors to this exchange (on their way to the communicator)."""
        ...

    def opening(self, backend: Backend, sends: bool) -> None:
        """Before a step's factors are averaged (``sends``: whether it sums them over ranks); may be collective."""
        ...

    def closing(self, sends: bool) -> None:
        """After a step's factors were averaged and blended (``sends`` as for :meth:`opening`)."""
        ...

    def drop(self) -> None:
        """Forget the step's factors (the step is skipped on every rank)."""
        ...

    def held(self, order: list[str]) -> list[tuple[str, Tensor]]:
        """What this rank holds, packed, in ``order``, marked as sent (to exchange it now)."""
        ...

    def blend(self, running: dict[str, Tensor], key: str, mean: Tensor, finite: Tensor) -> None:
        """Blend the averaged ``mean`` of ``key`` into ``running`` where ``finite``."""
        ...


class AtUpdate:
    """``kfac.factor_exchange=update``: every factor update sums the step's factors over ranks (the paper).

    Args:
        decay: The running averages' ``kfac.factor_decay`` (read at each use).
        schedule: Which steps update factors.
    """

    holding = False

    def __init__(self, decay: Callable[[], float], schedule: Schedule) -> None:
        self.decay, self.schedule = decay, schedule

    def sends(self) -> bool:
        """Every step that updates factors."""
        return self.schedule.factors()

    def route(self, capture: Capture) -> None:
        """The capture sends straight to the communicator, every factor packed."""
        capture.parts.takes_rows = None

    def opening(self, backend: Backend, sends: bool) -> None:
        """Nothing to check: every rank's factors of one step are weighed by the ranks that had them."""

    def closing(self, sends: bool) -> None:
        """Nothing is kept between steps."""

    def drop(self) -> None:
        """Nothing is kept between steps."""

    def held(self, order: list[str]) -> list[tuple[str, Tensor]]:
        """Nothing."""
        return []

    def blend(self, running: dict[str, Tensor], key: str, mean: Tensor, finite: Tensor) -> None:
        """The step's mean joins its running average with the decay (:func:`~kfacflow.kfac.finite.blend`)."""
        blend(running, key, mean, finite, self.decay())


class AtInversion(LocalSums):
    """``kfac.factor_exchange=inversion``: factors summed over ranks where inverted; between, each rank sums its own.

    Args:
        decay: The running averages' ``kfac.factor_decay`` (read at each use).
        send: Where an exchanged sum goes (the communicator's ``push``).
        schedule: Which steps update factors and invert.
        started: The factors that have a running average (on their keeper).
        timer: Where the products of held rows are timed.
    """

    def __init__(
        self,
        decay: Callable[[], float],
        send: Callable[[str, Tensor | Absent], None],
        schedule: Schedule,
        started: set[str] | None = None,
        timer: StepTimer | None = None,
    ) -> None:
        self.schedule = schedule
        super().__init__(decay, send, self.sends, started, timer)

    def sends(self) -> bool:
        """The steps that update factors and invert."""
        return self.schedule.factors() and self.schedule.inverts()

    @property
    def holding(self) -> bool:
        """Whether any sum is held."""
        return bool(self.sums)

    def route(self, capture: Capture) -> None:
        """The capture's factors go into this rank's sums, wide ones as their rows."""
        capture.push, capture.parts.takes_rows = self.push, self.takes_rows

    def opening(self, backend: Backend, sends: bool) -> None:
        """Where the step exchanges, stop unless every rank ran every layer since the last exchange (collective)."""
        if sends:
            self.refuse_absent(backend)

    def closing(self, sends: bool) -> None:
        """The sums start again where they were exchanged; the step's factors join them where not."""
        if sends:
            self.exchanged()
        else:
            self.commit()


def exchange_for(
    kind: str,
    decay: Callable[[], float],
    send: Callable[[str, Tensor | Absent], None],
    schedule: Schedule,
    started: set[str] | None = None,
    timer: StepTimer | None = None,
) -> Exchange:
    """The exchange ``kind`` names (``kfac.factor_exchange``: ``update`` or ``inversion``)."""
    if kind == "inversion":
        return AtInversion(decay, send, schedule, started, timer)
    return AtUpdate(decay, schedule)
