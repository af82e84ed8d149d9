"""A stage's own settings: a small dataclass it declares, set in a recipe as ``kfac.options.<name>.<setting>``.

A registry entry names its options class (``Registry.add(..., options=...)``); the class subclasses
:class:`StageOptions` and may give its fields ranges as the schema's do (``above``, ``at_least``).
:func:`of` builds the options a run gives the stage, checked as the schema checks its keys, and
:func:`check` that every ``kfac.options.<name>`` is of a stage that has them. Nothing else names a
stage's settings, so adding one edits only the stage's own file.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from omegaconf import DictConfig, OmegaConf

from kfacflow import UserError, did_you_mean, registry
from kfacflow.configuration.errors import merge
from kfacflow.configuration.rules import check_ranges

STAGES: tuple[registry.Registry[Any], ...] = (
    registry.FACTORS,
    registry.FUSIONS,
    registry.PLACEMENTS,
    registry.INVERSES,
    registry.PRECONDITIONERS,
    registry.PIPELINES,
    registry.BROADCASTS,
    registry.GRAD_SYNCS,
    registry.FACTOR_SYNCS,
)
"""The registries whose entries may have options of their own."""


@dataclass(frozen=True)
class StageOptions:
    """The base of a stage's options; the fields are its settings, with their defaults."""

    KEYS: ClassVar[Mapping[str, str]] = {}
    """Settings an older ``kfac`` key also sets (setting -> key), for the recipes written before ``kfac.options``."""


def of(entry: registry.Entry[Any], kfac: Any, prefix: str = "kfac.") -> Any:
    """Return the options ``kfac`` (the section, as a dataclass or a ``DictConfig``) gives ``entry``, or ``None``.

    Its defaults, then the older keys it declares (:attr:`StageOptions.KEYS`), then ``kfac.options.<name>``.
    ``prefix`` opens the keys messages name (``kfac.``; the library's ``KFACPreconditioner: ``).

    Raises:
        UserError: An unknown setting, a wrong type or a value out of range, naming the key.
    """
    if entry.options is None:
        return None
    kind: type[StageOptions] = entry.options
    where = f"{prefix}options.{entry.name}"
    older = {setting: read(kfac, key) for setting, key in kind.KEYS.items()}
    given = read(kfac, "options").get(entry.name) or {}
    node = merge(merge(OmegaConf.structured(kind), older, where), given, where)
    check_ranges(node, kind, f"{where}.")
    return OmegaConf.to_object(node)


def having() -> dict[str, tuple[registry.Registry[Any], registry.Entry[Any]]]:
    """Every stage that has options of its own, by name: its registry and its entry."""
    return {entry.name: (reg, entry) for reg in STAGES for entry in reg if entry.options is not None}


def check(kfac: Any, prefix: str = "kfac.") -> None:
    """Check every ``kfac.options.<name>``: of a stage with options, each setting known, typed and in range.

    Whether the run uses that stage is :func:`kfacflow.kfac.in_use.check`'s. ``prefix``: as :func:`of`'s.

    Raises:
        UserError: Naming the key, with the stages that have options.
    """
    stages = having()
    for name in read(kfac, "options"):
        if name not in stages:
            raise UserError(
                f"{prefix}options.{name}: no stage named {name!r} has options of its own.{did_you_mean(name, stages)} "
                f"Stages with options: {', '.join(sorted(stages)) or 'none'}."
            )
        of(stages[name][1], kfac, prefix)


def read(kfac: Any, key: str) -> Any:
    """The value of ``key`` in the ``kfac`` section (a dataclass or a ``DictConfig``), plain (no ``DictConfig``)."""
    value = kfac[key] if isinstance(kfac, DictConfig | Mapping) else getattr(kfac, key)
    return OmegaConf.to_container(value) if isinstance(value, DictConfig) else value
