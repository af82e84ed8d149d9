"""One YAML file read strictly (``read_yaml``): UTF-8 text, valid YAML, no key given twice in a mapping."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from kfacflow import UserError


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that rejects a key given twice in one mapping (plain YAML keeps the last).

    :meth:`construct_document` first notes the key path of every mapping node, so that the
    mapping constructor can name the duplicate as ``section.key``.
    """

    def __init__(self, stream: str, where: str) -> None:
        super().__init__(stream)
        self.where = where
        self.paths: dict[int, str] = {}

    def _note_paths(self, node: yaml.Node, path: str) -> None:
        if id(node) in self.paths:  # an alias of a node already seen
            return
        self.paths[id(node)] = path
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                name = key.value if isinstance(key, yaml.ScalarNode) else "?"
                self._note_paths(value, f"{path}.{name}" if path else name)
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                self._note_paths(item, f"{path}[{i}]")

    def construct_document(self, node: yaml.Node) -> Any:
        """Construct the document after noting where each mapping is."""
        self._note_paths(node, "")
        return super().construct_document(node)

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:  # type: ignore[override]
        """Construct a mapping, rejecting a duplicate key (``<<`` merge keys may be overridden)."""
        first: dict[str, int] = {}
        for key, _ in node.value:
            if not isinstance(key, yaml.ScalarNode) or key.tag == "tag:yaml.org,2002:merge":
                continue
            line = key.start_mark.line + 1
            if key.value in first:
                prefix = self.paths.get(id(node), "")
                name = f"{prefix}.{key.value}" if prefix else key.value
                raise UserError(
                    f"{self.where}: key {name!r} is given twice (lines {first[key.value]} and {line}); keep one."
                )
            first[key.value] = line
        return super().construct_mapping(node, deep=deep)


def read_yaml(path: str | Path, where: str, give: str) -> object:
    """Read one YAML file strictly: UTF-8 text, valid YAML, no key given twice in a mapping.

    Args:
        path: The file.
        where: How messages name it, e.g. ``recipe 'x.yaml'``.
        give: What to give instead of a folder, e.g. ``a YAML file such as recipes/quickstart.yaml``.

    Returns:
        The parsed document (None for an empty file).

    Raises:
        UserError: One line naming ``where`` and what to do.
    """
    p = Path(path)
    if p.is_dir():
        raise UserError(f"{where} is a folder; give {give}.")
    try:
        data = p.read_bytes()
    except OSError as err:
        raise UserError(f"{where} cannot be read ({err.strerror or err}); check that it is a readable file.") from None
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        line = data[: err.start].count(b"\n") + 1
        raise UserError(
            f"{where} is not UTF-8 text (byte 0x{data[err.start]:02x} on line {line}); save it as UTF-8."
        ) from None
    loader = _UniqueKeyLoader(text, where)
    try:
        return loader.get_single_data()
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        problem = getattr(err, "problem", None)
        if mark is not None and problem:
            raise UserError(f"{where} is not valid YAML (line {mark.line + 1}: {problem}); fix that line.") from None
        raise UserError(f"{where} is not valid YAML ({str(err).splitlines()[0]}).") from None
    finally:
        loader.dispose()
