"""The generated reference of every recipe key: complete, documented, and in step with the schema."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import OmegaConf

from kfacflow import key_reference
from kfacflow.configuration.ranges import at_least
from kfacflow.configuration.schema import RunConfig


def _leaves(node: object, prefix: str = "") -> list[str]:
    found: list[str] = []
    for name, value in node.items():  # type: ignore[attr-defined]
        key = f"{prefix}{name}"
        is_section = OmegaConf.is_dict(value) and OmegaConf.get_type(value) is not dict
        found += _leaves(value, f"{key}.") if is_section else [key]
    return found


def test_every_key_of_the_schema_is_in_the_reference() -> None:
    listed = [key.name for key in key_reference.keys()]
    assert listed == _leaves(OmegaConf.structured(RunConfig))
    page = key_reference.markdown()
    for name in listed + [key.name for key in key_reference.stage_keys()]:
        assert f"### `{name}`" in page


def test_every_key_has_a_docstring() -> None:
    assert key_reference.undocumented() == []


@dataclass
class _Section:
    documented: int = field(default=3, metadata=at_least(1, "steps"))
    """Documented."""
    bare: float = 0.5


def test_a_key_without_a_docstring_is_found() -> None:
    found = {key.name: key for key in key_reference.keys(_Section, "toy.")}
    assert found["toy.documented"].doc == "Documented."
    assert found["toy.bare"].doc == ""
    assert found["toy.documented"].range == ">= 1 (steps)"
    assert found["toy.documented"].default == "3"


def test_the_reference_shows_types_defaults_ranges_and_choices() -> None:
    by_name = {key.name: key for key in key_reference.keys() + key_reference.stage_keys()}
    damping = by_name["kfac.damping"]
    assert (damping.type, damping.default, damping.range) == (
        "float",
        "0.001",
        "> 0 (Tikhonov damping keeps factors invertible)",
    )
    assert "`flow`" in by_name["kfac.variant"].choices and "`spd`" in by_name["kfac.variant"].choices
    assert by_name["kfac.fusion"].default == "empty"
    assert by_name["kfac.options.threshold.mb"].default == "64.0"
    assert by_name["kfac.normalize"].type == "Literal['none', 'rms']"
    assert by_name["kfac.factor_exchange"].type == "Literal['update', 'inversion']"


def test_the_committed_page_is_the_schemas() -> None:
    # In a process of its own: other tests register stages of their own, which the page must not list.
    tool = Path(__file__).resolve().parents[1] / "tools" / "docs_keys.py"
    done = subprocess.run([sys.executable, str(tool), "--check"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
