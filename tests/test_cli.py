"""Tests for the command line: user mistakes exit 2 with one helpful line, --list, --print-config, variants."""

from __future__ import annotations

import json
import logging
import subprocess
from pathlib import Path

import pytest
import torch
import yaml
from helpers import last_line, run_cli

from kfacflow.cli import main
from kfacflow.config import KFACConfig
from kfacflow.kfac.variants import resolve

QUICK = "recipes/quickstart.yaml"
# Put before every table row's arguments so that a check that fails to fire can never start a long or multi-process run.
SAFE = ["launch.nproc=1", "train.steps=1", "train.progress=false"]


@pytest.fixture(autouse=True)
def _restore_process_state():
    """In-process runs reconfigure logging and torch threads; put them back after each test."""
    threads = torch.get_num_threads()
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    torch.set_num_threads(threads)
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.fixture
def recipes_dir(tmp_path: Path) -> Path:
    """Broken recipe files for the table rows that need them."""
    (tmp_path / "bad.yaml").write_text("kfac:\n  damping: [0.1\n")
    (tmp_path / "list.yaml").write_text("- kfac\n- damping\n")
    (tmp_path / "empty_root").mkdir()
    return tmp_path


def call_main(argv: list[str]) -> tuple[int | None, BaseException | None]:
    """Run ``main(argv)`` in-process; return (exit code, unexpected exception)."""
    try:
        return main(argv), None
    except SystemExit as err:  # workers exit with SystemExit(2) after printing their line
        return (err.code if isinstance(err.code, int) else 1), None
    except Exception as err:  # noqa: BLE001 - an escaping exception is the failure the tests report
        return None, err


def assert_user_error(rc: int | None, exc: BaseException | None, err: str, must: tuple[str, ...]) -> str:
    """Assert exit code 2, exactly one non-empty ``error:`` line naming ``must``, and no traceback."""
    assert exc is None, f"expected exit 2 with an error: line, got {type(exc).__name__}: {exc}"
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2, f"exit code {rc}, stderr:\n{err}"
    assert "Traceback" not in err, err
    assert len(lines) == 1, f"expected one stderr line, got:\n{err}"
    line = lines[0]
    assert line.startswith("error: "), line
    for text in must:
        assert text in line, f"{text!r} not in {line!r}"
    return line


# (argv after the SAFE overrides; "{tmp}" is tmp_path), strings the one error line must contain.
MISTAKES = [
    pytest.param([QUICK, "kfac.dampin=0.1"], ("kfac.dampin", "damping"), id="unknown-key"),
    pytest.param([QUICK, "kfc.damping=1"], ("kfc", "kfac"), id="unknown-section"),
    pytest.param([QUICK, "launch.nproc=1000"], ("data.batch_size", "launch.nproc"), id="more-workers-than-samples"),
    pytest.param([QUICK, "kfac.profile={tmp}/nowhere.yaml"], ("kfac.profile", "does not exist"), id="no-profile"),
    pytest.param([QUICK, "kfac.profile_steps=0"], ("kfac.profile_steps", "> 0"), id="profile-steps-0"),
    pytest.param([QUICK, "kfac.fusion_threshold_mb=0"], ("kfac.fusion_threshold_mb", "> 0"), id="threshold-0"),
    pytest.param([QUICK, "a.b.c=1"], ("'a'",), id="unknown-section-no-match"),
    pytest.param([QUICK, "kfac.damping=abc"], ("kfac.damping", "abc", "Float"), id="type-float"),
    pytest.param([QUICK, "train.epochs=many"], ("train.epochs", "many", "Integer"), id="type-int"),
    pytest.param([QUICK, "data.batch_size=1.5"], ("data.batch_size", "Integer"), id="type-int-from-float"),
    pytest.param([QUICK, "train.progress=maybe"], ("train.progress", "bool"), id="type-bool"),
    pytest.param([QUICK, "train.dtype=float16"], ("train.dtype", "float16", "float32", "float64"), id="literal"),
    pytest.param([QUICK, "dist.device=tpu"], ("dist.device", "auto", "cpu"), id="literal-device"),
    pytest.param([QUICK, "model.name=resnet5O"], ("model.name", "resnet5O", "resnet50", "--list model"), id="model"),
    pytest.param([QUICK, "data.name=digit"], ("data.name", "'digits'", "--list dataset"), id="dataset"),
    pytest.param([QUICK, "optim.name=sdg"], ("optim.name", "'sgd'"), id="optimizer"),
    pytest.param([QUICK, "schedule.name=cosin"], ("schedule.name", "'cosine'"), id="schedule"),
    pytest.param([QUICK, "dist.backend=torhc"], ("dist.backend", "'torch'"), id="backend"),
    pytest.param([QUICK, "kfac.variant=dd"], ("kfac.variant", "'d'"), id="variant"),
    pytest.param([QUICK, "kfac.factor=expnd"], ("kfac.factor", "'expand'"), id="factor"),
    pytest.param([QUICK, "kfac.fusion=after_backwrd"], ("kfac.fusion", "'after_backward'"), id="fusion"),
    pytest.param([QUICK, "kfac.placement=locl"], ("kfac.placement", "'local'"), id="placement"),
    pytest.param([QUICK, "kfac.inverse=cholesky2"], ("kfac.inverse", "'cholesky'"), id="inverse"),
    pytest.param([QUICK, "kfac.precondition=kfca"], ("kfac.precondition", "'kfac'"), id="precondition"),
    pytest.param([QUICK, "model.name=timm/resnet1"], ("model.name", "resnet1", "resnet18"), id="timm-typo"),
    pytest.param([QUICK, "model.name=timm/"], ("model.name", "timm/resnet50"), id="timm-empty"),
    pytest.param(["recipes/nope.yaml"], ("recipes/nope.yaml", "recipes/*.yaml"), id="missing-recipe"),
    pytest.param([QUICK, "{tmp}/bad.yaml"], ("bad.yaml", "not valid YAML"), id="invalid-yaml"),
    pytest.param([QUICK, "{tmp}/list.yaml"], ("list.yaml", "mapping"), id="yaml-list"),
    pytest.param([QUICK, "kfac.damping"], ("kfac.damping", "does not exist"), id="override-without-equals"),
    pytest.param([QUICK, "launch.nproc=0"], ("launch.nproc=0", ">= 1"), id="nproc-0"),
    pytest.param([QUICK, "kfac.damping=0"], ("kfac.damping", "> 0"), id="damping-0"),
    pytest.param([QUICK, "kfac.damping=-1"], ("kfac.damping", "> 0"), id="damping-negative"),
    pytest.param([QUICK, "kfac.damping=nan"], ("kfac.damping", "> 0"), id="damping-nan"),
    pytest.param([QUICK, "kfac.factor_decay=1.0"], ("kfac.factor_decay", "[0, 1)"), id="factor-decay-1"),
    pytest.param([QUICK, "kfac.kl_clip=-1"], ("kfac.kl_clip", ">= 0"), id="kl-clip-negative"),
    pytest.param([QUICK, "kfac.factor_update_freq=0"], ("kfac.factor_update_freq", "> 0"), id="factor-freq-0"),
    pytest.param(
        [QUICK, "kfac.inv_update_freq=3", "kfac.factor_update_freq=2"],
        ("kfac.inv_update_freq=3", "multiple", "kfac.factor_update_freq=2"),
        id="inv-freq-not-multiple",
    ),
    pytest.param([QUICK, "optim.lr=0"], ("optim.lr", "> 0"), id="lr-0"),
    pytest.param([QUICK, "train.epochs=0"], ("train.epochs", ">= 1"), id="epochs-0"),
    pytest.param([QUICK, "train.steps=-1"], ("train.steps", ">= 0"), id="steps-negative"),
    pytest.param(["recipes/cifar10_resnet20.yaml"], ("data.root", "not set", "data_batch_1"), id="cifar10-no-root"),
    pytest.param(
        [QUICK, "data.name=cifar10", "data.root={tmp}/nowhere"], ("data.root", "does not exist"), id="cifar10-bad-root"
    ),
    pytest.param(
        [QUICK, "data.name=imagefolder", "data.root={tmp}/nowhere"], ("data.root", "train/"), id="imagefolder-bad-root"
    ),
    pytest.param([QUICK, "data.name=imagefolder"], ("data.root", "not set"), id="imagefolder-no-root"),
    pytest.param(
        [QUICK, "data.name=synthetic", "data.num_classes=0"], ("data.num_classes", ">= 1"), id="synthetic-classes-0"
    ),
    pytest.param([QUICK, "data.image_size=-1"], ("data.image_size", ">= 0"), id="image-size-negative"),
    pytest.param([QUICK, "resume={tmp}/nowhere"], ("resume", "nowhere"), id="resume-missing-with-recipe"),
    pytest.param(["resume={tmp}/nowhere"], ("resume", "nowhere", "config.yaml"), id="resume-missing-alone"),
    pytest.param(["resume={tmp}/empty_root"], ("resume", "config.yaml"), id="resume-not-a-run"),
    pytest.param([], ("give a recipe", "recipes/quickstart.yaml"), id="no-recipe"),
    # Bad messages: the line must name the key, not '?' or OmegaConf internals.
    pytest.param([QUICK, "model=abc"], ("'model'",), id="section-given-a-value"),
    pytest.param([QUICK, "kfac.skip=fc"], ("kfac.skip", "list"), id="list-given-a-string"),
]


@pytest.mark.parametrize(("argv", "must"), MISTAKES)
def test_user_mistake_exits_2_with_one_line(
    argv: list[str], must: tuple[str, ...], recipes_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tmp = str(recipes_dir)
    items = [a.replace("{tmp}", tmp) for a in argv]
    # The row's own overrides come last, so they win over SAFE.
    rc, exc = call_main([*SAFE, f"out_dir={tmp}/runs", *items] if items else [])
    line = assert_user_error(rc, exc, capsys.readouterr().err, must)
    assert "AnyNode" not in line and "'?'" not in line and ": None" not in line, f"internals leak: {line!r}"
    assert not (recipes_dir / "runs").exists(), "a run folder was created for a rejected command"


# Values rejected by the checks, or (the last rows) only once the run builds the model: exit 2 either way.
UNCHECKED = [
    pytest.param(["train.log_every=0"], "train.log_every", id="log-every-0"),
    pytest.param(
        ["train.eval_every=0", "data.batch_size=256", "train.steps=6", "kfac.variant=sgd"],
        "train.eval_every",
        id="eval-every-0",
    ),
    pytest.param(["launch.threads=-1"], "launch.threads", id="threads-negative"),
    pytest.param(["data.eval_batch_size=-1"], "data.eval_batch_size", id="eval-batch-negative"),
    pytest.param(["data.workers=-1"], "data.workers", id="workers-negative"),
    pytest.param(["optim.lr=inf"], "optim.lr", id="lr-inf"),
    pytest.param(["kfac.skip=['*']"], "kfac.skip", id="no-layer-to-precondition"),
    pytest.param(["kfac.skip=[*]"], "kfac.skip=[*]", id="override-not-yaml"),
]


@pytest.mark.parametrize(("extra", "key"), UNCHECKED)
def test_unchecked_value_exits_2_not_traceback(
    extra: list[str], key: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, exc = call_main([QUICK, *SAFE, "train.steps=2", f"out_dir={tmp_path}", *extra])
    err = "\n".join(line for line in capsys.readouterr().err.splitlines() if line.startswith("error:"))
    assert_user_error(rc, exc, err, (key,))


@pytest.mark.parametrize(
    ("override", "must"),
    [
        ("kfac.dampin=0.1", "damping"),
        ("model.name=resnet5O", "resnet50"),
        ("kfac.damping=abc", "kfac.damping"),
    ],
    ids=["unknown-key", "unknown-name", "bad-type"],
)
def test_mistake_end_to_end(override: str, must: str, tmp_path: Path) -> None:
    proc = run_cli(QUICK, override, f"out_dir={tmp_path / 'runs'}", "train.progress=false", timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and must in lines[0], proc.stderr
    assert not (tmp_path / "runs").exists(), "a run folder was created for a rejected command"
    assert proc.stdout.strip() == ""


def test_error_found_by_workers_exits_2_without_traceback(tmp_path: Path) -> None:
    # 1437 digits over 2 workers is 719 each: a batch of 5000 cannot be filled (found before workers start).
    try:
        proc = run_cli(
            QUICK,
            "launch.nproc=2",
            "data.batch_size=5000",
            "train.progress=false",
            f"out_dir={tmp_path}",
            timeout=120,
        )
    except subprocess.TimeoutExpired:
        pytest.fail("a user error inside the workers hung the job")
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "data.batch_size" in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr, f"launcher noise after the user's error line:\n{proc.stderr}"


# --- --list ------------------------------------------------------------------------------------


def test_list_all_kinds(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--list"]) == 0
    out = capsys.readouterr().out
    for header in (
        "model (model.name):",
        "dataset (data.name):",
        "optimizer (optim.name):",
        "schedule (schedule.name):",
        "backend (dist.backend):",
        "variant (kfac.variant):",
        "factor (kfac.factor):",
        "fusion (kfac.fusion):",
        "placement (kfac.placement):",
        "inverse (kfac.inverse):",
        "precondition (kfac.precondition):",
    ):
        assert header in out
    for name in ("after_backward", "cholesky", "eigen", "digits_cnn", "resnet50", "timm/", "digits", "cosine"):
        assert any(line.split()[0] == name for line in out.splitlines() if line.startswith("  ")), name
    entries = [line for line in out.splitlines() if line.startswith("  ")]
    assert entries and all(len(line.split(None, 1)) == 2 for line in entries), "an entry has no description"


def test_list_one_kind(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--list", "fusion"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "fusion (kfac.fusion):"
    assert all(line.startswith("  ") for line in lines[1:]) and len(lines) >= 2
    assert any(line.split()[0] == "after_backward" for line in lines[1:])


@pytest.mark.parametrize(("kind", "must"), [("nonsense", ("'nonsense'", "fusion")), ("fusin", ("'fusion'",))])
def test_list_unknown_kind(kind: str, must: tuple[str, ...], capsys: pytest.CaptureFixture[str]) -> None:
    rc, exc = call_main(["--list", kind])
    assert_user_error(rc, exc, capsys.readouterr().err, ("--list", *must))


# --- --print-config and merging ---------------------------------------------------------------


def print_config(argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict:
    assert main([*argv, "--print-config"]) == 0
    cfg = yaml.safe_load(capsys.readouterr().out)
    assert isinstance(cfg, dict)
    return cfg


def test_print_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = print_config([QUICK, "kfac.damping=0.5", "optim.name=sgd", f"out_dir={tmp_path}/runs"], capsys)
    assert cfg["name"] == "quickstart"
    assert cfg["kfac"]["damping"] == 0.5
    assert cfg["optim"]["lr"] == 0.05 and cfg["schedule"]["name"] == "cosine"  # from the recipe
    assert cfg["kfac"]["inv_update_freq"] == 1  # from the schema defaults
    assert cfg["out_dir"] == f"{tmp_path}/runs"
    assert not (tmp_path / "runs").exists()


def test_print_config_end_to_end(tmp_path: Path) -> None:
    proc = run_cli(QUICK, "name=mine", f"out_dir={tmp_path}/runs", "--print-config", timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert yaml.safe_load(proc.stdout)["name"] == "mine"
    assert not (tmp_path / "runs").exists()


def test_recipes_merge_left_to_right(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    more = tmp_path / "more.yaml"
    more.write_text("kfac:\n  damping: 0.02\noptim:\n  lr: 0.01\n")
    cfg = print_config([QUICK, str(more)], capsys)
    assert (cfg["kfac"]["damping"], cfg["optim"]["lr"]) == (0.02, 0.01)
    assert cfg["data"]["batch_size"] == 32 and cfg["optim"]["weight_decay"] == 0.0005  # untouched keys stay
    assert cfg["name"] == "quickstart"  # the first recipe names the run

    cfg = print_config([str(more), QUICK], capsys)
    assert (cfg["kfac"]["damping"], cfg["optim"]["lr"]) == (0.1, 0.05)
    assert cfg["name"] == "more"

    cfg = print_config([QUICK, str(more), "kfac.damping=0.3", "optim.lr=0.2"], capsys)
    assert (cfg["kfac"]["damping"], cfg["optim"]["lr"]) == (0.3, 0.2)


# --- variants ----------------------------------------------------------------------------------


def test_variant_resolution() -> None:
    d = resolve(KFACConfig(variant="d"))
    assert (d.fusion, d.placement, d.inverse, d.preconditioned) == ("after_backward", "local", "cholesky", True)
    assert resolve(KFACConfig(variant="d", inverse="eigen")).inverse == "eigen"
    assert resolve(KFACConfig(variant="d", inverse="eigen")).fusion == "after_backward"
    assert resolve(KFACConfig(variant="sgd")).preconditioned is False


def test_explicit_stage_wins_in_summary(tmp_path: Path) -> None:
    proc = run_cli(
        QUICK,
        "kfac.inverse=eigen",
        "train.steps=2",
        "launch.nproc=1",
        "train.progress=false",
        f"out_dir={tmp_path}",
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((Path(last_line(proc)) / "summary.json").read_text())
    assert summary["stages"] == {
        "fusion": "optimal",
        "placement": "lbp",
        "inverse": "eigen",
        "preconditioned": True,
    }
    assert summary["variant"] == "spd" and summary["steps"] == 2
    assert Path(last_line(proc)).parent == tmp_path / "quickstart"


def test_horovod_missing_names_the_install_script(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "horovod" else real(name, *a))
    rc, exc = call_main([QUICK, *SAFE, "dist.backend=horovod"])
    assert_user_error(rc, exc, capsys.readouterr().err, ("dist.backend=horovod", "tools/install_horovod.sh"))
