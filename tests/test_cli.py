"""Tests for the command line: user mistakes exit 2 with one helpful line, --list, --print-config, variants."""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import subprocess
import sys
import typing
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import yaml
from helpers import last_line, run_cli
from omegaconf import OmegaConf

from kfacflow import UserError
from kfacflow.cli import main
from kfacflow.configuration.recipe import load
from kfacflow.configuration.schema import CORES, KFACConfig, RunConfig
from kfacflow.kfac.variants import resolve
from kfacflow.running.build import check_out_dir

QUICK = "recipes/quickstart.yaml"
# Put before every table row's arguments so that a check that fails to fire can never start a long or multi-process run.
SAFE = ["launch.nproc=1", "train.steps=1", "train.progress=false"]


@pytest.fixture(autouse=True)
def _restore_process_state() -> Iterator[None]:
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
    (tmp_path / "latin1.yaml").write_bytes("kfac:\n  variant: d  # défaut\n".encode("latin-1"))
    (tmp_path / "dup.yaml").write_text(
        "# line 1\nkfac:\n  damping: 0.01\n  kl_clip: 0.001\n  variant: d\n  damping: 0.1\n"
    )
    (tmp_path / "dup_run").mkdir()
    (tmp_path / "dup_run" / "config.yaml").write_text("train:\n  epochs: 1\n  epochs: 2\n")
    (tmp_path / "afile").write_text("not a folder\n")
    (tmp_path / "bool.yaml").write_text("optim:\n  nesterov: 1\n")
    comm = "allreduce: {alpha: 2.0e-5, beta: 1.6e-10}\nbroadcast: {alpha: 1.0e-5, beta: 8.0e-11}\n"
    cubic = "inverse: {kind: cubic, alpha: 1.0e-4, beta: 1.0e-12}\n"
    (tmp_path / "p_fast.yaml").write_text(comm.replace("alpha: 2.0e-5", "alpha: fast") + cubic)
    (tmp_path / "p_quad.yaml").write_text(comm + cubic.replace("cubic", "quadratic"))
    (tmp_path / "p_bytes.yaml").write_bytes(comm.encode() + b"inverse: {kind: cubic\xff\xfe}\n")
    (tmp_path / "p_negbeta.yaml").write_text(comm.replace("beta: 8.0e-11", "beta: -8.0e-11") + cubic)
    (tmp_path / "p_noinv.yaml").write_text(comm)
    method = "methods:\n  cholesky_factr: {kind: cubic, alpha: 1.0e-4, beta: 1.0e-12}\n"
    (tmp_path / "p_method.yaml").write_text(comm + cubic + method)
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
    pytest.param(
        [QUICK, "optim.name=muon", "optim.muon.owners=kfac"],
        ("optim.muon.owners=kfac", "kfac.broadcast is packed", "optim.muon.owners=placed"),
        id="muon-owners-without-update-owners",
    ),
    pytest.param([QUICK, "kfac.dampin=0.1"], ("kfac.dampin", "damping"), id="unknown-key"),
    pytest.param([QUICK, "kfc.damping=1"], ("kfc", "kfac"), id="unknown-section"),
    pytest.param([QUICK, "launch.nproc=1000"], ("data.batch_size", "launch.nproc"), id="more-workers-than-samples"),
    pytest.param([QUICK, "kfac.profile={tmp}/nowhere.yaml"], ("kfac.profile", "does not exist"), id="no-profile"),
    pytest.param([QUICK, "kfac.profile_steps=0"], ("kfac.profile_steps", ">= 1"), id="profile-steps-0"),
    pytest.param([QUICK, "kfac.fusion_threshold_mb=0"], ("kfac.fusion_threshold_mb", "> 0"), id="threshold-0"),
    pytest.param([QUICK, "kfac.options.threshold.mb=0"], ("kfac.options.threshold.mb", "> 0"), id="option-range"),
    pytest.param(
        [QUICK, "kfac.options.threshold.bytes=1"], ("kfac.options.threshold", "'bytes'"), id="option-unknown-setting"
    ),
    pytest.param(
        [QUICK, "kfac.options.treshold.mb=1"], ("kfac.options.treshold", "Did you mean 'threshold'"), id="option-stage"
    ),
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
    pytest.param(
        ["recipes/nope.yaml"],
        ("recipes/nope.yaml", "or a shipped recipe: charlm_gpt, cifar10_resnet20"),
        id="missing-recipe",
    ),
    pytest.param([QUICK, "{tmp}/bad.yaml"], ("bad.yaml", "not valid YAML"), id="invalid-yaml"),
    pytest.param([QUICK, "{tmp}/list.yaml"], ("list.yaml", "mapping"), id="yaml-list"),
    pytest.param([QUICK, "kfac.damping"], ("kfac.damping", "does not exist"), id="override-without-equals"),
    pytest.param([QUICK, "launch.nproc=0"], ("launch.nproc=0", ">= 1"), id="nproc-0"),
    pytest.param([QUICK, "kfac.damping=0"], ("kfac.damping", "> 0"), id="damping-0"),
    pytest.param([QUICK, "kfac.damping=-1"], ("kfac.damping", "> 0"), id="damping-negative"),
    pytest.param([QUICK, "kfac.damping=nan"], ("kfac.damping", "> 0"), id="damping-nan"),
    pytest.param([QUICK, "kfac.factor_decay=1.0"], ("kfac.factor_decay", "[0, 1)"), id="factor-decay-1"),
    pytest.param([QUICK, "kfac.kl_clip=-1"], ("kfac.kl_clip", ">= 0"), id="kl-clip-negative"),
    pytest.param([QUICK, "kfac.factor_update_freq=0"], ("kfac.factor_update_freq", ">= 1"), id="factor-freq-0"),
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
    # Every numeric key is range-checked, NaN and the infinities included.
    pytest.param([QUICK, "kfac.kl_clip=nan"], ("kfac.kl_clip=nan", "finite", ">= 0"), id="kl-clip-nan"),
    pytest.param([QUICK, "kfac.kl_clip=.inf"], ("kfac.kl_clip=inf", "finite"), id="kl-clip-inf"),
    pytest.param([QUICK, "kfac.damping=inf"], ("kfac.damping=inf", "finite", "> 0"), id="damping-inf"),
    pytest.param([QUICK, "optim.momentum=-1"], ("optim.momentum=-1", "[0, 1)"), id="momentum-negative"),
    pytest.param([QUICK, "optim.momentum=1"], ("optim.momentum=1", "[0, 1)"), id="momentum-1"),
    pytest.param([QUICK, "optim.weight_decay=nan"], ("optim.weight_decay=nan", ">= 0"), id="weight-decay-nan"),
    pytest.param([QUICK, "dist.timeout_s=0"], ("dist.timeout_s=0", "[1, 10**9)"), id="timeout-0"),
    # Keys a library takes unchecked: gloo's clock, the thread pool, the loader's processes.
    pytest.param([QUICK, "dist.timeout_s=10000000000000"], ("dist.timeout_s=", "[1, 10**9)"), id="timeout-huge"),
    pytest.param(
        [QUICK, "launch.threads=100000"], ("launch.threads=100000", f"{CORES} CPU cores"), id="threads-beyond-cores"
    ),
    pytest.param(
        [QUICK, f"data.workers={4 * CORES + 1}"],
        (f"data.workers={4 * CORES + 1}", f"{CORES} CPU cores"),
        id="workers-beyond-cores",
    ),
    # An empty resume= reads as no resume at all: it must not start a fresh run.
    pytest.param(["resume="], ("resume= is empty", "run folder"), id="resume-empty-alone"),
    pytest.param([QUICK, "resume="], ("resume= is empty",), id="resume-empty-with-recipe"),
    pytest.param([QUICK, "resume=''"], ("resume= is empty",), id="resume-empty-string"),
    pytest.param([QUICK, "train.seed=-1"], ("train.seed=-1", "[0, 2**63)"), id="seed-negative"),
    pytest.param([QUICK, "schedule.gamma=0"], ("schedule.gamma", "> 0"), id="gamma-0"),
    pytest.param([QUICK, "schedule.milestones=[-1]"], ("schedule.milestones[0]=-1", ">= 0"), id="milestone-negative"),
    pytest.param([QUICK, "schedule.warmup_epochs=nan"], ("schedule.warmup_epochs=nan", ">= 0"), id="warmup-nan"),
    pytest.param(
        [QUICK, "train.keep_checkpoints=-1"], ("train.keep_checkpoints=-1", "0 keeps every"), id="keep-negative"
    ),
    pytest.param([QUICK, "train.accumulate=0"], ("train.accumulate=0", ">= 1"), id="accumulate-0"),
    pytest.param(
        [QUICK, "optim.nesterov=true", "optim.momentum=0"],
        ("optim.nesterov=true", "optim.momentum > 0"),
        id="nesterov-without-momentum",
    ),
    # Files: one line for bytes that are not UTF-8, a key given twice, a folder given as a recipe.
    pytest.param([QUICK, "{tmp}/latin1.yaml"], ("latin1.yaml", "UTF-8", "line 2"), id="recipe-not-utf8"),
    pytest.param(
        [QUICK, "{tmp}/dup.yaml"], ("dup.yaml", "'kfac.damping'", "twice", "lines 3 and 6"), id="recipe-duplicate-key"
    ),
    pytest.param([QUICK, "{tmp}/empty_root"], ("empty_root", "folder", "YAML file"), id="recipe-is-a-folder"),
    pytest.param(["resume={tmp}/dup_run"], ("config.yaml", "'train.epochs'", "lines 2 and 3"), id="resume-duplicate"),
    # Where runs go: name is one folder name, out_dir decides the place.
    pytest.param([QUICK, "name=../../x"], ("name='../../x'", "plain folder name", "out_dir"), id="name-escapes"),
    pytest.param([QUICK, "name=a/b"], ("name='a/b'", "out_dir"), id="name-with-slash"),
    pytest.param([QUICK, "name=.."], ("name='..'", "out_dir"), id="name-dotdot"),
    pytest.param([QUICK, "name=' '"], ("name=' '", "out_dir"), id="name-blank"),
    pytest.param([QUICK, "out_dir={tmp}/afile/runs"], ("out_dir=", "afile", "not a folder"), id="out-dir-under-file"),
    # Profiles: every field checked, one line naming the file and the field.
    pytest.param(
        [QUICK, "kfac.profile={tmp}/p_fast.yaml"], ("p_fast.yaml", "allreduce.alpha='fast'"), id="profile-alpha-text"
    ),
    pytest.param(
        [QUICK, "kfac.profile={tmp}/p_quad.yaml"],
        ("p_quad.yaml", "inverse.kind='quadratic'", "'exp'", "'cubic'"),
        id="profile-kind-unknown",
    ),
    pytest.param([QUICK, "kfac.profile={tmp}/p_bytes.yaml"], ("p_bytes.yaml", "UTF-8"), id="profile-bad-bytes"),
    pytest.param(
        [QUICK, "kfac.profile={tmp}/p_negbeta.yaml"],
        ("p_negbeta.yaml", "broadcast.beta", ">= 0"),
        id="profile-neg-beta",
    ),
    pytest.param(
        [QUICK, "kfac.profile={tmp}/p_noinv.yaml"], ("p_noinv.yaml", "'inverse' section"), id="profile-no-inverse"
    ),
    pytest.param(
        [QUICK, "dist.backend=horovod", "launch.nproc=1", "kfac.variant=flow"],
        ("kfac.grad_sync=between", "dist.backend=torch", "kfac.grad_sync=overlap"),
        id="deferred-gradients-under-horovod",
    ),
    pytest.param(
        [QUICK, "kfac.profile={tmp}/p_method.yaml"],
        ("methods.cholesky_factr", "Did you mean 'cholesky_factor'"),
        id="profile-method-misspelt",
    ),
    # Bad messages: the line must name the key, not '?' or OmegaConf internals.
    pytest.param([QUICK, "model=abc"], ("'model'",), id="section-given-a-value"),
    pytest.param([QUICK, "kfac.skip=fc"], ("kfac.skip", "list"), id="list-given-a-string"),
    # A bool key takes true or false alone (OmegaConf took 2 for true); a text key no bool.
    pytest.param([QUICK, "train.cudnn_benchmark=2"], ("train.cudnn_benchmark", "true or false", "not 2"), id="bool-2"),
    pytest.param([QUICK, "train.save=0"], ("train.save", "true or false"), id="bool-0"),
    pytest.param([QUICK, "train.timing=yes"], ("train.timing=yes", "true or false"), id="bool-yes"),
    pytest.param([QUICK, "data.augment=off"], ("data.augment=off", "true or false"), id="bool-off"),
    pytest.param([QUICK, "train.progress='true'"], ("train.progress", "true or false"), id="bool-quoted"),
    pytest.param([QUICK, "{tmp}/bool.yaml"], ("bool.yaml", "optim.nesterov", "not 1"), id="bool-in-recipe"),
    pytest.param([QUICK, "name=on"], ("name=on", "quote the word"), id="text-given-a-bool"),
    # Keys no stage in use reads: one line naming the key and what reads it (a preset's choices count).
    pytest.param(
        [QUICK, "kfac.options.threshold.mb=32"],
        ("kfac.options.threshold", "kfac.fusion is optimal here (kfac.variant=spd)", "kfac.fusion=threshold"),
        id="options-of-a-stage-not-in-use",
    ),
    pytest.param(
        [QUICK, "kfac.fusion_threshold_mb=32", "kfac.variant=d"],
        ("kfac.fusion_threshold_mb=32", "kfac.fusion is after_backward", "kfac.fusion=threshold"),
        id="older-option-key-of-a-stage-not-in-use",
    ),
    pytest.param(
        [QUICK, "kfac.options.threshold.mb=32", "kfac.variant=auto"],
        ("kfac.options.threshold", "after_backward, optimal, optimal_split"),
        id="options-no-preset-of-auto-uses",
    ),
    pytest.param(
        [QUICK, "kfac.placement_steps=5", "kfac.variant=d", "kfac.inv_update_freq=10"],
        ("kfac.placement_steps=5", "local/packed", "kfac.placement=layer", "kfac.placement_steps=0"),
        id="placement-steps-nothing-placed",
    ),
    pytest.param(
        [QUICK, "kfac.placement_steps=5", "kfac.variant=flow"],
        ("kfac.placement_steps=5", "kfac.inv_update_freq=1", "raise kfac.inv_update_freq"),
        id="placement-steps-inverting-every-step",
    ),
    pytest.param(
        [QUICK, "kfac.placement_steps=5", "kfac.variant=flow", "kfac.inv_update_freq=10", "kfac.broadcast=packed"],
        ("kfac.placement_steps=5", "layer/packed", "kfac.broadcast=fused_update"),
        id="placement-steps-inverses-broadcast",
    ),
    # model.kwargs: what the factory does not take, named before anything starts.
    pytest.param(
        [QUICK, "model.kwargs.depth=2"], ("model.kwargs.depth", "digits_cnn", "takes none"), id="kwargs-builtin"
    ),
    pytest.param(
        [QUICK, "model.name=timm/vit_tiny_patch16_224", "model.kwargs.img_sz=32"],
        ("model.kwargs.img_sz", "timm's VisionTransformer", "Did you mean 'img_size'", "patch_size"),
        id="kwargs-timm-misspelt",
    ),
    pytest.param(
        [QUICK, "model.name=resnet18", "data.name=synthetic", "model.kwargs.zero_init=true"],
        ("model.kwargs.zero_init", "torchvision's ResNet", "zero_init_residual"),
        id="kwargs-torchvision",
    ),
    pytest.param(
        [QUICK, "model.kwargs.num_classes=3"], ("model.kwargs.num_classes", "data's classes"), id="kwargs-from-data"
    ),
    pytest.param(
        [QUICK, "model.name=resnet18", "model.kwargs.weights=DEFAULT"],
        ("model.kwargs.weights", "nothing is downloaded"),
        id="kwargs-pretrained",
    ),
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


def _numeric_keys(cls: type = RunConfig, prefix: str = "") -> list[tuple[str, type, dataclasses.Field]]:
    """Every int, float and list-of-float key of the schema, with its type and field."""
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            out += _numeric_keys(hint, f"{prefix}{f.name}.")  # type: ignore[arg-type]
        elif hint in (int, float, list[float]):
            out.append((f"{prefix}{f.name}", hint, f))
    return out


def test_every_numeric_key_has_a_range() -> None:
    keys = _numeric_keys()
    assert len(keys) > 30
    missing = [key for key, _, f in keys if "range" not in f.metadata]
    assert not missing, f"numeric keys without metadata=at_least/above/within: {missing}"


LIST_KEYS = {key for key, hint, _ in _numeric_keys() if hint == list[float]}


@pytest.mark.parametrize("key", [key for key, hint, _ in _numeric_keys() if hint is not int])
@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_every_float_key_rejects_non_finite(key: str, value: str) -> None:
    text = f"[{value}]" if key in LIST_KEYS else value
    with pytest.raises(UserError) as err:
        load([QUICK], [f"{key}={text}"])
    message = str(err.value)
    assert message.startswith(key) and value.lstrip("-") in message and "\n" not in message, message


def _bool_keys(cls: type = RunConfig, prefix: str = "") -> list[str]:
    """Every bool key of the schema."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            out += _bool_keys(hints[f.name], f"{prefix}{f.name}.")  # type: ignore[arg-type]
        elif hints[f.name] is bool:
            out.append(f"{prefix}{f.name}")
    return out


@pytest.mark.parametrize("key", _bool_keys())
@pytest.mark.parametrize("value", ["2", "0", "1", "yes", "off", "'true'", "y"])
def test_every_bool_key_takes_only_true_or_false(key: str, value: str) -> None:
    with pytest.raises(UserError, match=re.escape(key)) as err:
        load([QUICK], [f"{key}={value}"])
    assert "true or false" in str(err.value) and "\n" not in str(err.value), err.value
    reader = ["optim.name=muon"] if key.startswith("optim.muon.") else []  # read by Muon alone: refused elsewhere
    for given in (True, False):
        assert OmegaConf.select(load([QUICK], [*reader, f"{key}={str(given).lower()}"]), key) is given


def test_range_boundaries_are_accepted() -> None:
    cfg = load(
        [QUICK],
        [
            "optim.momentum=0",
            "optim.weight_decay=0",
            "kfac.kl_clip=0",
            "kfac.factor_decay=0",
            "train.keep_checkpoints=0",
            "train.accumulate=1",
            f"train.seed={2**63 - 1}",
            "train.steps=0",
            "train.timeline=0",
            "schedule.milestones=[0,1.5]",
            "schedule.warmup_epochs=0",
            "dist.timeout_s=1",
            "name=.hidden",
        ],
    )
    assert cfg.train.accumulate == 1 and cfg.train.seed == 2**63 - 1 and cfg.name == ".hidden"
    with pytest.raises(UserError, match=r"train.seed=9223372036854775808 must be in \[0, 2\*\*63\)"):
        load([QUICK], [f"train.seed={2**63}"])


def test_duplicate_keys_only_within_one_mapping(tmp_path: Path) -> None:
    # The same key in two sections, a YAML merge key overridden, and a later file or override: all fine.
    first = tmp_path / "first.yaml"
    first.write_text("kfac:\n  damping: 0.2\n")
    second = tmp_path / "second.yaml"
    second.write_text("model:\n  name: digits_cnn\ndata:\n  name: digits\nkfac:\n  damping: 0.3\n")
    assert load([QUICK, str(first), str(second)], []).kfac.damping == 0.3
    assert load([QUICK, str(first)], ["kfac.damping=0.4"]).kfac.damping == 0.4
    merged = tmp_path / "merged.yaml"
    merged.write_text("kfac:\n  <<: {damping: 0.5, kl_clip: 0.01}\n  damping: 0.6\n")
    cfg = load([QUICK, str(merged)], [])
    assert (cfg.kfac.damping, cfg.kfac.kl_clip) == (0.6, 0.01)


def test_out_dir_check_creates_nothing(tmp_path: Path) -> None:
    check_out_dir(str(tmp_path / "a" / "b" / "c"))
    check_out_dir(str(tmp_path))
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "f").write_text("")
    with pytest.raises(UserError, match=r"out_dir=.*f/x.* is a file, not a folder"):
        check_out_dir(str(tmp_path / "f" / "x"))


def test_out_dir_not_writable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # os.access rather than chmod: root may write anywhere.
    monkeypatch.setattr("os.access", lambda path, mode: Path(path) != tmp_path)
    with pytest.raises(UserError, match=r"out_dir=.*runs.* is not writable; set out_dir"):
        check_out_dir(str(tmp_path / "runs" / "x"))
    assert list(tmp_path.iterdir()) == []


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
    # Found only by the model or the data:
    pytest.param(["data.image_size=1"], "data.image_size", id="image-too-small-for-the-model"),
    pytest.param(["kfac.skip=[layer9.*]"], "kfac.skip: 'layer9.*' matches no module", id="skip-matches-nothing"),
    pytest.param(["train.timeline=3"], "train.timeline=3 is after the run's last step (2)", id="timeline-after-end"),
    pytest.param(
        ["train.timeline=1", "train.timeline_steps=2", "train.timeline_every=2"],
        "train.timeline_steps=2 steps from train.timeline=1, one every train.timeline_every=2, end at step 3",
        id="timeline-window-after-end",
    ),
    pytest.param(["train.accumulate=100"], "train.accumulate=100", id="accumulate-more-than-the-data"),
]


@pytest.mark.parametrize(("extra", "key"), UNCHECKED)
def test_unchecked_value_exits_2_not_traceback(
    extra: list[str], key: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, exc = call_main([QUICK, *SAFE, "train.steps=2", f"out_dir={tmp_path}", *extra])
    err = "\n".join(line for line in capsys.readouterr().err.splitlines() if line.startswith("error:"))
    assert_user_error(rc, exc, err, (key,))


VIT = ["model.name=timm/vit_tiny_patch16_224", "data.image_size=32", "kfac.variant=d"]
"""A ViT built for 224 px on 32 px images (the digits, resized), with D-KFAC: no profile to measure."""


@pytest.mark.slow
def test_a_model_that_cannot_take_the_images_is_one_line_and_model_kwargs_make_it_fit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # timm's patch embedding asserts the size: an AssertionError, which escaped the first step's check.
    rc, exc = call_main([QUICK, *SAFE, *VIT, f"out_dir={tmp_path}"])
    err = capsys.readouterr().err
    errors = "\n".join(line for line in err.splitlines() if line.startswith("error:"))
    line = assert_user_error(rc, exc, errors, ("model.name=timm/vit_tiny_patch16_224", "1x32x32", "data.image_size"))
    assert "Input height (32) doesn't match model (224)" in line and "model.kwargs.img_size=32" in line, line
    assert "Traceback" not in err, err
    # The same model built for the data: 8 x 8 patches of 4 px (one block keeps it quick) trains a step.
    fit = ["model.kwargs.img_size=32", "model.kwargs.patch_size=4", "model.kwargs.depth=1"]
    rc, exc = call_main([QUICK, *SAFE, *VIT, *fit, f"out_dir={tmp_path}"])
    assert (rc, exc) == (0, None), capsys.readouterr().err
    run = sorted((tmp_path / "quickstart").iterdir())[-1]
    assert json.loads((run / "summary.json").read_text())["steps"] == 1
    assert yaml.safe_load((run / "config.yaml").read_text())["model"]["kwargs"] == {
        "img_size": 32,
        "patch_size": 4,
        "depth": 1,
    }


@pytest.mark.slow
def test_the_vit_at_another_size_on_two_workers_ends_with_one_line(tmp_path: Path) -> None:
    """The issue's command as given: two workers, each of which raised the AssertionError with its traceback."""
    proc = run_cli(QUICK, "model.name=timm/vit_tiny_patch16_224", "data.image_size=32", f"out_dir={tmp_path}")
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "model.kwargs.img_size=32" in errors[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "AssertionError" not in proc.stderr.replace(errors[0], "")


@pytest.mark.parametrize("workers", [0, 1])
def test_undecodable_image_found_while_training_exits_2(
    workers: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from PIL import Image

    for split in ("train", "val"):
        for cls in ("a", "b"):
            (tmp_path / split / cls).mkdir(parents=True)
            Image.new("RGB", (10, 10)).save(tmp_path / split / cls / "0.png")
    (tmp_path / "train" / "b" / "0.png").write_bytes(b"not a png")  # in the first batch: it holds both
    data = ["data.name=imagefolder", f"data.root={tmp_path}", "data.image_size=8", "data.batch_size=2"]
    rc, exc = call_main([QUICK, *SAFE, *data, f"data.workers={workers}", f"out_dir={tmp_path}/runs"])
    err = "\n".join(line for line in capsys.readouterr().err.splitlines() if line.startswith("error:"))
    assert_user_error(rc, exc, err, ("data.root=", "train/b/0.png", "cannot be read"))


# The user's own model and data (module.path:factory): whatever they get wrong is one line naming the key.
USER_CODE = """
import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset, IterableDataset, TensorDataset

from kfacflow.data import DataInfo

X = torch.randn(64, 1, 2, 2)
Y = torch.zeros(64, dtype=torch.int64)
INFO = DataInfo(num_classes=3, channels=1, image_size=2)


def linear(num_classes, in_channels):
    return nn.Sequential(nn.Flatten(), nn.Linear(in_channels * 4, num_classes))


def conv(num_classes, in_channels):
    return nn.Sequential(nn.Conv2d(in_channels, 4, 1), nn.Flatten(), nn.Linear(16, num_classes))


def one_argument(num_classes):
    return linear(num_classes, 1)


def no_parameters(num_classes, in_channels):
    return nn.Flatten()


def frozen(num_classes, in_channels):
    return linear(num_classes, in_channels).requires_grad_(False)


def model_bug(num_classes, in_channels):
    return nn.Linear(in_channels, num_classes, bais=False)


def sets(x=X, y=Y, val=8):
    return TensorDataset(x, y), TensorDataset(x[:val], y[:val]), INFO


def data(cfg):
    return sets()


def no_argument():
    return sets()


def data_bug(cfg):
    return sets(val=cfg.val_count)


def label_too_big(cfg):
    return sets(y=torch.full((64,), 3))


def label_negative(cfg):
    return sets(y=torch.full((64,), -1))


def float_labels(cfg):
    return sets(y=torch.zeros(64))


def one_hot_labels(cfg):
    return sets(y=torch.eye(3)[Y])


def flat_images(cfg):
    return sets(x=X[:, 0])


def empty_val(cfg):
    return sets(val=0)


def empty_train(cfg):
    return TensorDataset(X[:0], Y[:0]), TensorDataset(X, Y), INFO


class Stream(IterableDataset):
    def __iter__(self):
        return zip(X, Y)


def iterable(cfg):
    return Stream(), Stream(), INFO


class Arrays(Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        return X[i].numpy(), 0


def numpy_images(cfg):
    return Arrays(), Arrays(), INFO


class LaterLabels(Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        return X[i], 0 if i == 0 else 7


def label_too_big_later(cfg):
    return LaterLabels(), LaterLabels(), INFO


class Broken(Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        return X[i], {}["label"]


def getitem_bug(cfg):
    return Broken(), Broken(), INFO


def int32_labels(cfg):
    return sets(y=Y.int())
"""


@pytest.fixture(scope="module")
def user_code(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The module name of the user's factories, importable while the tests of this file run."""
    folder = tmp_path_factory.mktemp("user_code")
    (folder / "kfacflow_user_code.py").write_text(USER_CODE)
    sys.path.insert(0, str(folder))
    yield "kfacflow_user_code"
    sys.path.remove(str(folder))
    sys.modules.pop("kfacflow_user_code", None)


def run_user_code(user_code: str, model: str, data: str, out: Path) -> tuple[int | None, BaseException | None]:
    """One step of the quickstart on the user's model and data, in this process."""
    own = [f"model.name={user_code}:{model}", f"data.name={user_code}:{data}"]
    return call_main([QUICK, *SAFE, "data.batch_size=16", f"out_dir={out}", *own])


USER_MISTAKES = [
    pytest.param(
        "one_argument",
        "data",
        ("model.name=", "factory(num_classes, in_channels)", "one_argument(num_classes)"),
        id="model-factory-signature",
    ),
    pytest.param(
        "linear", "no_argument", ("data.name=", "factory(data_cfg)", "no_argument()"), id="data-factory-signature"
    ),
    pytest.param("no_parameters", "data", ("model.name=", "no parameters"), id="model-without-parameters"),
    pytest.param("frozen", "data", ("model.name=", "frozen"), id="model-all-frozen"),
    pytest.param("linear", "label_too_big", ("data.name=", "label 3", "3 classes"), id="label-too-big"),
    pytest.param("linear", "label_negative", ("data.name=", "label -1", "0 to 2"), id="label-negative"),
    pytest.param("linear", "float_labels", ("data.name=", "0.0 (float)", "int class index"), id="float-labels"),
    pytest.param("linear", "one_hot_labels", ("data.name=", "shape (3,)", "y.argmax()"), id="one-hot-labels"),
    pytest.param(
        "conv",
        "flat_images",
        ("data.name=", "shape (2, 2)", "C x H x W", "x.unsqueeze(0)"),
        id="images-without-channels",
    ),
    pytest.param("linear", "numpy_images", ("data.name=", "ndarray", "not a tensor"), id="images-not-tensors"),
    pytest.param("linear", "iterable", ("data.name=", "IterableDataset", "__getitem__"), id="iterable-dataset"),
    pytest.param("linear", "empty_val", ("data.name=", "validation set is empty"), id="empty-validation-set"),
    pytest.param("linear", "empty_train", ("data.name=", "training set is empty"), id="empty-training-set"),
    pytest.param(
        "linear", "label_too_big_later", ("data.name=", "a batch has a label", "0 to 2"), id="label-too-big-later"
    ),
]


@pytest.mark.slow
@pytest.mark.parametrize(("model", "data", "must"), USER_MISTAKES)
def test_users_model_or_data_that_cannot_train_exits_2(
    model: str, data: str, must: tuple[str, ...], user_code: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, exc = run_user_code(user_code, model, data, tmp_path / "runs")
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    assert_user_error(rc, exc, "\n".join(line for line in err.splitlines() if line.startswith("error:")), must)


@pytest.mark.parametrize(
    ("model", "data", "must"),
    [
        ("model_bug", "data", ("model.name=", "model_bug' raised TypeError", "bais")),
        ("linear", "data_bug", ("data.name=", "data_bug' raised ConfigAttributeError", "val_count")),
        ("linear", "getitem_bug", ("data.name=", "training set", "sample 0 raised KeyError", "label")),
    ],
    ids=["model-factory", "data-factory", "dataset-getitem"],
)
def test_a_bug_in_the_users_code_keeps_its_traceback_and_names_the_key(
    model: str, data: str, must: tuple[str, ...], user_code: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, exc = run_user_code(user_code, model, data, tmp_path / "runs")
    err = capsys.readouterr().err
    assert exc is None and rc == 2, (rc, exc, err)
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and err.rstrip().endswith(errors[0]), err  # one line, the last
    for text in must:
        assert text in errors[0], errors[0]
    traceback = err[err.index("Traceback (most recent call last):") :]
    assert f"{user_code}.py" in traceback, "the traceback shows the user's code"


def test_integer_labels_of_any_width_train(user_code: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, exc = run_user_code(user_code, "linear", "int32_labels", tmp_path / "runs")
    assert (rc, exc) == (0, None), capsys.readouterr().err


def test_empty_export_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, exc = call_main(["export="])
    assert_user_error(rc, exc, capsys.readouterr().err, ("export= is empty",))


@pytest.mark.parametrize("value", ["abc", "4,2", "0", "100000"])
def test_omp_num_threads_that_is_no_thread_count_exits_2(
    value: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", value)
    rc, exc = call_main([QUICK, *SAFE, f"out_dir={tmp_path}/runs"])
    assert_user_error(rc, exc, capsys.readouterr().err, (f"OMP_NUM_THREADS={value}", f"1 to {CORES}"))
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
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
        "pipeline": "barrier",
        "broadcast": "packed",
        "grad_sync": "overlap",
        "factor_sync": "allreduce",
        "factor_exchange": "update",
        "precondition": "kfac",
        "choose": False,
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


@pytest.mark.parametrize(
    ("env", "must"),
    [
        ({"RANK": "0", "WORLD_SIZE": "2"}, ("RANK=0 and WORLD_SIZE=2", "MASTER_ADDR", "unset RANK WORLD_SIZE")),
        ({"RANK": "1"}, ("only one of RANK and WORLD_SIZE", "RANK=1")),
        ({"RANK": "3", "WORLD_SIZE": "2", "MASTER_ADDR": "x", "MASTER_PORT": "1"}, ("0 <= RANK < WORLD_SIZE",)),
    ],
    ids=["stale", "half-set", "rank-out-of-range"],
)
def test_stale_launcher_environment_exits_2(
    env: dict[str, str], must: tuple[str, ...], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    rc, exc = call_main([QUICK, *SAFE])
    assert_user_error(rc, exc, capsys.readouterr().err, must)
