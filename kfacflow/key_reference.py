"""The reference of every recipe key, read from the schema itself: its type, default, range and docstring.

The documentation's "Every recipe key" page, ``docs/reference/keys.md``, is :func:`markdown`'s output
(``tools/docs_keys.py`` writes it; a test fails where the committed page differs), so the page cannot drift from
:mod:`kfacflow.configuration.schema`; a key without a docstring is a test failure too (:func:`undocumented`).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
from dataclasses import MISSING, dataclass
from typing import Any

from kfacflow import registry
from kfacflow.configuration.ranges import Range
from kfacflow.configuration.schema import RunConfig


@dataclass(frozen=True)
class Key:
    """One recipe key as the reference shows it."""

    name: str
    """Its dotted name, e.g. ``kfac.damping``."""
    type: str
    default: str
    range: str
    """The values it may take beyond its type (``>= 0 (0 is off)``), or empty."""
    doc: str
    choices: str
    """For a key that names a registry entry: the shipped names, or empty."""


def attribute_docs(cls: type) -> dict[str, str]:
    """Return each field's docstring: the string literal that follows its annotated assignment in the class body."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for here, after in zip(body, body[1:], strict=False):
        if not (isinstance(here, ast.AnnAssign) and isinstance(here.target, ast.Name)):
            continue
        if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str):
            docs[here.target.id] = inspect.cleandoc(after.value.value)
    return docs


def _default(field: dataclasses.Field[Any]) -> str:
    if field.default is not MISSING:
        value = field.default
    elif field.default_factory is not MISSING:
        value = field.default_factory()
    else:
        return "(required)"
    if value is None or value == "":
        return "empty"
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value) if isinstance(value, str) else str(value)


def _range(field: dataclasses.Field[Any]) -> str:
    bounds: Range | None = field.metadata.get("range")
    if bounds is None:
        return ""
    return bounds.rule() + (f" ({bounds.hint})" if bounds.hint else "")


def _choices(name: str) -> str:
    for reg in registry.ALL.values():
        if reg.key == name:
            names = ", ".join(f"`{entry.name}`" for entry in reg)
            return names + (f", or your own `module.path:factory` ({reg.imports})" if reg.imports else "")
    return ""


def keys(cls: type = RunConfig, prefix: str = "") -> list[Key]:
    """Every key of ``cls`` (a schema dataclass) and its sections', in the schema's order."""
    docs = attribute_docs(cls)
    found: list[Key] = []
    for field in dataclasses.fields(cls):
        name = f"{prefix}{field.name}"
        default = field.default_factory() if field.default_factory is not MISSING else field.default
        if dataclasses.is_dataclass(default):
            found += keys(type(default), f"{name}.")
            continue
        kind = str(field.type)
        kind = kind[len("Optional[") : -1] if kind.startswith("Optional[") else kind  # empty is in the default
        found.append(Key(name, kind, _default(field), _range(field), docs.get(field.name, ""), _choices(name)))
    return found


def stage_keys() -> list[Key]:
    """The settings of every stage that has its own, as ``kfac.options.<stage>.<setting>``."""
    from kfacflow.kfac.stages import options

    found: list[Key] = []
    for name, (_, entry) in sorted(options.having().items()):
        assert entry.options is not None  # having() lists only the stages that have options
        found += keys(entry.options, f"kfac.options.{name}.")
    return found


def undocumented() -> list[str]:
    """The keys (stage settings included) whose docstring is missing."""
    return [key.name for key in keys() + stage_keys() if not key.doc.strip()]


def _entry(key: Key) -> list[str]:
    facts = [f"**type** `{key.type}`", f"**default** `{key.default}`"]
    if key.range:
        facts.append(f"**range** {key.range}")
    lines = [f"### `{key.name}`", "", " · ".join(facts), ""]
    if key.choices:
        lines += [f"**choices** {key.choices}", ""]
    return lines + [key.doc, ""]


def markdown() -> str:
    """The reference page: one section per recipe section, one entry per key."""
    build_plugins()
    lines = [
        "# Every recipe key",
        "",
        "Generated from the schema (`kfacflow/configuration/schema.py` and the stages' own options) by",
        "`tools/docs_keys.py`: each",
        "key's type, default, the range its values may take and its docstring. Set any of them in a recipe or as an",
        "override (`section.key=value`); see [Recipes and overrides](../recipes.md).",
        "",
    ]
    section = ""
    for key in keys() + stage_keys():
        top = "kfac.options" if key.name.startswith("kfac.options.") else key.name.split(".")[0] * ("." in key.name)
        if top != section or len(lines) == 6:
            section = top
            lines += [f"## {section or 'top level'}", ""]
        lines += _entry(key)
    return "\n".join(lines)


def build_plugins() -> None:
    """Register the plugins' stages, so that the reference lists every choice ``--list`` lists."""
    from kfacflow.running import build

    build.load_plugins()
