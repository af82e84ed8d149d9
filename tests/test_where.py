"""``where.yaml``: each results folder says where it ran, so that no page has to."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml
from helpers import ROOT

sys.path.insert(0, str(ROOT / "tools"))

import where  # noqa: E402 - tools/, after the path


def test_a_result_made_now_records_the_machine_the_versions_the_commit_and_the_date(tmp_path: Path) -> None:
    facts = yaml.safe_load(where.record(tmp_path).read_text())
    assert set(facts) == {"cpu", "cores", "gpu", "torch", "python", "commit", "date"}
    assert facts["cpu"] and facts["cores"] >= 1 and facts["date"].endswith("UTC")
    assert facts["torch"].split("+")[0] == __import__("torch").__version__.split("+")[0]


def test_every_results_folder_records_where_it_ran() -> None:
    folders = [p for p in (ROOT / "docs" / "results").iterdir() if p.is_dir()]
    assert len(folders) > 40, "the folders were not found"
    assert [p.name for p in folders if not (p / where.NAME).is_file()] == []


def test_an_older_folder_takes_the_commit_that_added_it(tmp_path: Path) -> None:
    facts = where.from_git(ROOT / "docs" / "results" / "tta_fashion_cnn")
    assert len(facts["commit"]) == 40 and facts["cpu"] == "not recorded" and facts["date"].endswith("UTC")
    with pytest.raises(SystemExit, match="not in this checkout"):
        where.from_git(tmp_path)
