"""The README is a front door and the guide a site that builds: short, current, every link alive."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers import ROOT

DOCS = ROOT / "docs"
README = ROOT / "README.md"
HISTORY = re.compile(r"sitting|commit before|this commit|EPYC", re.IGNORECASE)
"""Words of a figure's history, which belongs in its results folder's notes, not in the guide."""


def guide_pages() -> list[Path]:
    """The site's own pages: everything under ``docs/`` but the results folders (their notes keep the history)."""
    pages = [p.relative_to(DOCS) for p in DOCS.rglob("*.md")]
    return sorted(DOCS / p for p in pages if not (p.parts[0] == "results" and len(p.parts) > 2))


def test_the_readme_is_a_front_door() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= 250
    first = lines[lines.index("```bash") + 1 : lines.index("```bash") + 3]
    assert first[0].startswith("pip install -r requirements.txt && python run.py recipes/quickstart.yaml")
    assert first[1].startswith("python -m pytest")


def test_the_readme_and_the_guide_state_what_holds_now() -> None:
    found = [
        f"{p.relative_to(ROOT)}: {m.group(0)}"
        for p in [README, *guide_pages()]
        for m in HISTORY.finditer(p.read_text())
    ]
    assert found == []


def test_the_readme_links_lead_somewhere() -> None:
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README.read_text())
    local = [link for link in links if "://" not in link]
    assert local, "no links were read"
    assert [link for link in local if not (ROOT / link).exists()] == []


def test_every_page_is_in_the_sites_navigation() -> None:
    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text().replace("!!python", "#"))["nav"]
    listed: set[str] = set()

    def walk(node: object) -> None:
        if isinstance(node, str):
            listed.add(node)
        elif isinstance(node, dict):
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(nav)
    pages = {str(p.relative_to(DOCS)) for p in guide_pages()}
    assert pages - listed == set() and listed - pages == set()


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("mkdocs") is None, reason="MkDocs is not installed (pip install -e .[docs])"
)
def test_the_site_builds_strictly(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={"NO_MKDOCS_2_WARNING": "1", "PATH": "/usr/bin:/bin"},
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
