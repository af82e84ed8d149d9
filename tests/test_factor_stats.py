"""tools/factor_stats.py reproduces the paper's ResNet-50 figures."""

from __future__ import annotations

import sys

from helpers import ROOT

sys.path.insert(0, str(ROOT / "tools"))

from factor_stats import main, stats  # noqa: E402


def test_resnet50_matches_the_paper() -> None:
    r = stats("resnet50")
    assert r["parameters"] == 25_557_032
    assert (r["A_elements"], r["G_elements"]) == (62_348_671, 14_618_356)  # the paper: 62.3 M and 14.6 M
    assert (r["smallest_factor_elements"], r["largest_factor_elements"]) == (2_080, 10_619_136)
    assert r["largest_dim"] == 4608 and r["layers"] == 54


def test_cli_and_histogram(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    assert (
        main(
            [
                "digits_cnn",
                "resnet20",
                "--num-classes",
                "10",
                "--channels",
                "1",
                "--layers",
                "--plot",
                str(tmp_path / "fig3.png"),
                "--json",
                str(tmp_path / "s.json"),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "digits_cnn" in out and "conv1" in out
    assert (tmp_path / "fig3.png").stat().st_size > 5_000
    assert main(["resnet5O"]) == 2
