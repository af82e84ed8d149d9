"""One small ``Registry`` class and every registry instance; it imports nothing else of kfacflow.

The modules that register entries (the plugins) are imported by :mod:`kfacflow.running.build`; the
types of the entries are the stage contracts of :mod:`kfacflow.kfac.stages.contracts`, imported for mypy only.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from kfacflow import UserError, did_you_mean

if TYPE_CHECKING:
    from torch import nn
    from torch.utils.data import Dataset

    from kfacflow.comm.base import Backend
    from kfacflow.kfac.stages.contracts import (
        FactorStage,
        FusionFactory,
        InverseMethod,
        Placement,
        PreconditionFactory,
        Variant,
    )

T = TypeVar("T")


@dataclass(frozen=True)
class Entry(Generic[T]):
    """A registered object, the line that describes it, and what building it needs."""

    name: str
    obj: T
    description: str
    needs_profile: bool = False
    """Whether it plans with a performance profile (``kfac.profile``, or a calibration at start)."""
    options: type | None = None
    """Its own settings, a dataclass (``kfac.options.<name>``: :mod:`kfacflow.kfac.stages.options`), if it has any."""


class Registry(Generic[T]):
    """Maps names to objects for one kind of component (models, datasets, K-FAC stages...).

    A name ending in ``/`` is a prefix entry: ``get("timm/resnet50")`` returns the ``timm/``
    entry, and the builder receives the rest of the name itself.

    Args:
        kind: What the entries are, e.g. ``"model"``; used by ``--list``.
        key: The recipe key that selects an entry, e.g. ``"model.name"``; used in errors.
    """

    def __init__(self, kind: str, key: str, imports: str = "") -> None:
        self.kind = kind
        self.key = key
        self.imports = imports
        """What a ``module.path:factory`` name must give, if the user may name their own (empty: no)."""
        self._entries: dict[str, Entry[T]] = {}
        self._deferred: list[Callable[[], None]] = []

    def defer(self, fill: Callable[[], None]) -> None:
        """Have ``fill`` add entries when they are needed: before looking up a name not registered yet, or listing all.

        For entries whose listing costs an import most runs never need (torchvision's models take
        1.5 s of CPU to list, in every process of every run).
        """
        self._deferred.append(fill)

    def _fill(self) -> None:
        while self._deferred:
            self._deferred.pop(0)()

    def register(
        self, name: str, description: str, needs_profile: bool = False, options: type | None = None
    ) -> Callable[[T], T]:
        """Decorator form of :meth:`add`."""

        def deco(obj: T) -> T:
            self.add(name, obj, description, needs_profile, options)
            return obj

        return deco

    def add(
        self, name: str, obj: T, description: str, needs_profile: bool = False, options: type | None = None
    ) -> None:
        """Register ``obj`` under ``name`` (``options``: the dataclass of its own settings, if any).

        Raises:
            ValueError: If ``name`` is already registered (a programming error).
        """
        if name in self._entries:
            raise ValueError(f"{self.kind} {name!r} is registered twice")
        self._entries[name] = Entry(name, obj, description, needs_profile, options)

    def entry(self, name: str) -> Entry[T]:
        """Return the entry of ``name`` (its object and metadata); raises as :meth:`get` does."""
        self.get(name)
        return self._entries[name if name in self._entries else str(self.prefix_of(name))]

    def get(self, name: str) -> T:
        """Return the object registered under ``name`` (or the prefix entry that covers it).

        Raises:
            UserError: If nothing is registered under ``name``; names the key, close matches
                and the available entries.
        """
        if name in self._entries:
            return self._entries[name].obj
        if self.imports and ":" in name:
            return self._import(name)  # type: ignore[no-any-return]
        self._fill()
        if name in self._entries:
            return self._entries[name].obj
        prefix = self.prefix_of(name)
        if prefix is not None:
            return self._entries[prefix].obj
        raise UserError(
            f"{self.key}: unknown {self.kind} {name!r}.{did_you_mean(name, self._entries)} "
            f"Available: {', '.join(self.names())} (see `python run.py --list {self.kind}`)."
        )

    def _import(self, name: str) -> Any:
        """Import the user's ``module.path:factory`` (from the working folder or ``PYTHONPATH``)."""
        module_name, _, attr = name.partition(":")
        if os.getcwd() not in sys.path:  # `python run.py` puts its own folder there, not the user's
            sys.path.insert(0, os.getcwd())
        try:
            module = importlib.import_module(module_name)
        except Exception as err:  # noqa: BLE001 - any failure of the user's module is reported in one line
            raise UserError(
                f"{self.key}={name!r}: cannot import {module_name!r} ({type(err).__name__}: {err}); the module "
                "must be importable from the working folder or PYTHONPATH."
            ) from None
        factory = getattr(module, attr, None)
        if not callable(factory):
            raise UserError(f"{self.key}={name!r}: {module_name!r} has no function {attr!r}; {self.imports}.")
        return factory

    def prefix_of(self, name: str) -> str | None:
        """Return the prefix entry (``"timm/"``) that covers ``name``, if any."""
        for key in self._entries:
            if key.endswith("/") and name.startswith(key) and len(name) > len(key):
                return key
        return None

    def names(self) -> list[str]:
        """Return all registered names in registration order."""
        self._fill()
        return list(self._entries)

    def __contains__(self, name: object) -> bool:
        if not isinstance(name, str):
            return False
        if name not in self._entries:
            self._fill()
        return name in self._entries or self.prefix_of(name) is not None

    def __iter__(self) -> Iterator[Entry[T]]:
        self._fill()
        return iter(self._entries.values())


# Every registry instance; the plugin modules fill them when kfacflow.running.build imports them.
MODELS: Registry[Callable[..., nn.Module]] = Registry(
    "model", "model.name", imports="give a function (num_classes, in_channels) -> torch.nn.Module"
)
DATASETS: Registry[Callable[..., tuple[Dataset[Any], Dataset[Any], Any]]] = Registry(
    "dataset",
    "data.name",
    imports="give a function (data config) -> (train set, validation set, kfacflow.data.DataInfo)",
)
OPTIMIZERS: Registry[Callable[..., Any]] = Registry(
    "optimizer", "optim.name", imports="give a function (model, optim config) -> torch.optim.Optimizer"
)
SCHEDULES: Registry[Callable[..., Callable[[int], float]]] = Registry("schedule", "schedule.name")
BACKENDS: Registry[Callable[..., Backend]] = Registry("backend", "dist.backend")
VARIANTS: Registry[Variant] = Registry("variant", "kfac.variant")
FACTORS: Registry[Callable[[], FactorStage]] = Registry("factor", "kfac.factor")
FUSIONS: Registry[FusionFactory] = Registry("fusion", "kfac.fusion")
PLACEMENTS: Registry[Placement] = Registry("placement", "kfac.placement")
INVERSES: Registry[InverseMethod] = Registry("inverse", "kfac.inverse")
PRECONDITIONERS: Registry[PreconditionFactory] = Registry("precondition", "kfac.precondition")
# The strategies' protocols are kfacflow.kfac.strategies.contracts' (which uses these registries): each strategy
# subclasses its kind's protocol, so mypy checks it there; here they are typed loosely.
PIPELINES: Registry[Any] = Registry("pipeline", "kfac.pipeline")
BROADCASTS: Registry[Any] = Registry("broadcast", "kfac.broadcast")
GRAD_SYNCS: Registry[Any] = Registry("grad_sync", "kfac.grad_sync")
FACTOR_SYNCS: Registry[Any] = Registry("factor_sync", "kfac.factor_sync")

ALL: dict[str, Registry[Any]] = {
    r.kind: r
    for r in (
        MODELS,
        DATASETS,
        OPTIMIZERS,
        SCHEDULES,
        BACKENDS,
        VARIANTS,
        FACTORS,
        FUSIONS,
        PLACEMENTS,
        INVERSES,
        PRECONDITIONERS,
        PIPELINES,
        BROADCASTS,
        GRAD_SYNCS,
        FACTOR_SYNCS,
    )
}
