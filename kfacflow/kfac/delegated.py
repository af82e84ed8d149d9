"""An attribute an object keeps in one of its parts: read and written there, typed as the part's."""

from __future__ import annotations

from typing import Generic, TypeVar, overload

T = TypeVar("T")


class Delegated(Generic[T]):
    """An attribute kept by the part ``part`` of its owner, under the same name (or ``name``).

    The orchestrator keeps its state in parts of their own (:class:`~kfacflow.kfac.state.FactorState`,
    :class:`~kfacflow.kfac.plan_life.PlanLife`); what callers holding the orchestrator alone read of
    them (the trainer, the library, tests: ``pre.running``, ``pre.plan``) stays where they read it.
    """

    def __init__(self, part: str, name: str = "") -> None:
        self.part, self.name = part, name

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = self.name or name

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> Delegated[T]: ...

    @overload
    def __get__(self, obj: object, owner: type | None = None) -> T: ...

    def __get__(self, obj: object | None, owner: type | None = None) -> Delegated[T] | T:
        if obj is None:
            return self
        value: T = getattr(getattr(obj, self.part), self.name)
        return value

    def __set__(self, obj: object, value: T) -> None:
        setattr(getattr(obj, self.part), self.name, value)
