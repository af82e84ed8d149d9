"""Keys that only some stages read are refused where no stage in use reads them, in the library as on the command line.

The command line's table is ``tests/test_cli.py``'s (``MISTAKES``); here the library's, and what both
accept: a key the stages in use read, which then takes effect.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
from test_stage_equivalence import PROFILE, make_model

import kfacflow
from kfacflow import UserError
from kfacflow.configuration.recipe import load
from kfacflow.kfac.stages.fusion import Threshold
from kfacflow.kfac.variants import resolve
from kfacflow.running import build

QUICK = "recipes/quickstart.yaml"

# (arguments beside the model, what the one line says after "KFACPreconditioner: ")
LIBRARY = [
    pytest.param({"options": {"nosuch": {"a": 1}}}, "options.nosuch: no stage named 'nosuch'", id="unknown-stage"),
    pytest.param({"options": {"threshold": {"mb": -1.0}}}, "options.threshold.mb=-1.0 must be", id="bad-value"),
    pytest.param({"options": {"threshold": {"mbb": 1.0}}}, "options.threshold: unknown key 'mbb'", id="bad-setting"),
    pytest.param(
        {"options": {"threshold": {"mb": 8.0}}},
        "options.threshold: fusion is after_backward here (variant=d), so the fusion 'threshold' and its options "
        "are not used; set fusion=threshold",
        id="stage-not-in-use",
    ),
    pytest.param(
        {"variant": "spd", "options": {"threshold": {"mb": 8.0}}},
        "options.threshold: fusion is optimal here (variant=spd)",
        id="stage-not-in-use-spd",
    ),
    pytest.param(
        {"fusion_threshold_mb": 8.0},
        "fusion_threshold_mb=8.0 sets options.threshold.mb, but fusion is after_backward",
        id="older-key-not-in-use",
    ),
    pytest.param(
        {"placement_steps": 3},
        "placement_steps=3 times the layers to place whole layers by their work, which only placement=layer",
        id="placement-steps-nothing-placed",
    ),
    pytest.param(
        {"variant": "flow", "broadcast": "packed", "placement_steps": 3},
        "placement_steps=3 times the layers to place whole layers by their work, which only placement=layer with "
        "broadcast=update or fused_update does; here placement/broadcast are layer/packed (variant=flow)",
        id="placement-steps-inverses-broadcast",
    ),
]


@pytest.fixture(autouse=True)
def _one_process(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)


@pytest.mark.parametrize(("kwargs", "message"), LIBRARY)
def test_the_library_refuses_what_no_stage_in_use_reads(kwargs: dict[str, Any], message: str) -> None:
    kwargs = {"variant": "d", "profile": PROFILE, **kwargs}
    with pytest.raises(UserError, match=f"^KFACPreconditioner: {re.escape(message)}") as err:
        kfacflow.KFACPreconditioner(make_model(), lr=0.1, **kwargs)
    assert "\n" not in str(err.value)


def test_the_library_takes_what_the_stages_in_use_read() -> None:
    pre = kfacflow.KFACPreconditioner(
        make_model(), "d", lr=0.1, profile=PROFILE, fusion="threshold", options={"threshold": {"mb": 8.0}}
    )
    assert isinstance(pre.core.comm.policy, Threshold) and pre.core.comm.policy.threshold_bytes == 8 * 2**20
    pre.remove()
    # Its interval may be a schedule here, so placement_steps is checked against the stages alone.
    pre = kfacflow.KFACPreconditioner(make_model(), "flow", lr=0.1, profile=PROFILE, placement_steps=3)
    assert pre.core.layer_times.steps == 3
    pre.remove()


ACCEPTED = [
    pytest.param(["kfac.fusion=threshold", "kfac.options.threshold.mb=8"], 8.0, id="threshold-options"),
    pytest.param(["kfac.fusion=threshold", "kfac.fusion_threshold_mb=8"], 8.0, id="threshold-older-key"),
    pytest.param(["kfac.variant=d", "kfac.fusion_threshold_mb=64"], None, id="older-key-at-its-default"),
    pytest.param(["kfac.variant=sgd", "kfac.options.threshold.mb=8", "kfac.placement_steps=5"], None, id="sgd"),
    pytest.param(["kfac.variant=flow", "kfac.inv_update_freq=10", "kfac.placement_steps=5"], None, id="flow"),
    pytest.param(["kfac.variant=auto", "kfac.inv_update_freq=10", "kfac.placement_steps=5"], None, id="auto"),
    pytest.param(
        [
            "kfac.variant=mpd",
            "kfac.placement=layer",
            "kfac.broadcast=update",
            "kfac.inv_update_freq=4",
            "kfac.placement_steps=2",
        ],
        None,
        id="mpd-with-layers-placed",
    ),
]


@pytest.mark.parametrize(("overrides", "mb"), ACCEPTED)
def test_the_command_line_takes_what_the_stages_in_use_read(overrides: list[str], mb: float | None) -> None:
    cfg = load([QUICK], overrides)
    build.check(cfg)
    if mb is not None:
        fusion = build.stages(cfg.kfac, resolve(cfg.kfac), PROFILE).fusion
        assert isinstance(fusion, Threshold) and fusion.threshold_bytes == int(mb * 2**20)
