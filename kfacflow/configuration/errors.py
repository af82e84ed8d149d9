"""OmegaConf's errors as one line naming the key and what to give: ``explain``, and ``merge`` that uses it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields, is_dataclass
from typing import Any, get_type_hints

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError
from omegaconf.nodes import BooleanNode, StringNode

from kfacflow import UserError
from kfacflow.configuration.schema import RunConfig


def _section(kind: str) -> tuple[str, str]:
    """Return the recipe section whose type is named ``kind`` and its first key (``kind`` and ``key`` if none)."""
    hints = get_type_hints(RunConfig)
    for f in fields(RunConfig):
        cls = hints[f.name]
        if isinstance(cls, type) and is_dataclass(cls) and cls.__name__ == kind:
            return f.name, fields(cls)[0].name
    return kind, "key"


def explain(err: OmegaConfBaseException, where: str) -> str:
    """Return OmegaConf's ``err`` as one line: ``where``, the key, and what to give instead.

    Args:
        err: What OmegaConf raised merging or validating a value.
        where: What gave the value, e.g. ``override`` or a recipe's path.
    """
    msg = str(getattr(err, "msg", None) or err).splitlines()[0]
    key = getattr(err, "full_key", None)
    if isinstance(err, ConfigKeyError):
        hint = msg.split(". ", 1)[-1] if "Did you mean" in msg else "See the keys in kfacflow/configuration/schema.py."
        return f"{where}: unknown key '{key}'. {hint}"
    if not key and "is not a subclass of" in msg:
        section, first = _section(msg.split("is not a subclass of ")[-1].split(".")[0])
        return f"{where}: '{section}' is a section, not a value; set its keys instead, e.g. {section}.{first}=..."
    if "is not a ListConfig" in msg:
        return f"{where}: '{key}' takes a list, e.g. {key}=[a,b]."
    if isinstance(err, ValidationError) and msg.startswith("Incompatible value 'None'"):
        kind = msg.rsplit("of type ", 1)[-1].strip("'")
        return f"{where}: '{key}' is empty but takes a {kind}; give a value, e.g. {key}=VALUE."
    if isinstance(err, ValidationError):
        return f"{where}: bad value for '{key}': {msg}"
    return f"{where}: '{key}': {msg}"


def merge(base: DictConfig, other: object, where: str) -> DictConfig:
    """Merge ``other`` over the structured ``base``: types and keys checked by OmegaConf, bools by :func:`strict_bools`.

    Raises:
        UserError: What :func:`explain` says of OmegaConf's error.
    """
    strict_bools(base, other, where)
    try:
        merged = OmegaConf.merge(base, other)
    except OmegaConfBaseException as err:
        raise UserError(explain(err, where)) from None
    assert isinstance(merged, DictConfig)
    return merged


def strict_bools(base: DictConfig, other: object, where: str, prefix: str = "") -> None:
    """Refuse a value that is not a bool for a bool key, and a bool for a text key, before OmegaConf converts them.

    OmegaConf takes ``2``, ``"y"`` or ``"off"`` for a bool (``train.cudnn_benchmark=2`` ran as true) and
    writes a bool into a text key as ``"True"``; a bool key takes only true or false here. Keys
    ``base`` does not know are left to OmegaConf, which names them.

    Raises:
        UserError: Naming the key and what it takes.
    """
    given = OmegaConf.to_container(other, resolve=False) if isinstance(other, DictConfig) else other
    if not isinstance(given, Mapping):
        return
    for key, value in given.items():
        if not isinstance(key, str) or key not in base:
            continue
        node, name = base._get_node(key), f"{prefix}{key}"
        if isinstance(node, DictConfig):
            strict_bools(node, value, where, f"{name}.")
        elif isinstance(node, BooleanNode) and not (isinstance(value, bool) or value is None or _interpolation(value)):
            raise UserError(f"{where}: '{name}' is a bool: it takes true or false, not {value!r}.")
        elif isinstance(node, StringNode) and isinstance(value, bool):
            raise UserError(
                f"{where}: '{name}' takes text, not the bool {str(value).lower()} (YAML reads true, yes, on, false, "
                f"no, off as bools); quote the word, e.g. {name}=\"'on'\"."
            )


def _interpolation(value: Any) -> bool:
    return isinstance(value, str) and value.startswith("${")
