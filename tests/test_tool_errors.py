"""The tools' answers to a user's mistakes: one ``error:`` line naming the argument, never a traceback;
and tools/tta.py's handling of overrides of the keys it sets itself (the user's value wins, or is refused)."""

from __future__ import annotations

import io
import json
import os
import sys
import tarfile
from pathlib import Path
from typing import Any

import pytest
from helpers import QUICK, ROOT, run_tool

sys.path.insert(0, str(ROOT / "tools"))

import bench  # noqa: E402
import bench_apply  # noqa: E402
import bench_hooks  # noqa: E402
import bench_newton_schulz  # noqa: E402
import fetch_fashion_mnist  # noqa: E402
import simulate  # noqa: E402
import tta  # noqa: E402

from kfacflow.configuration.recipe import load  # noqa: E402

HAND_LAYERS = {
    "world_size": 2,
    "batch_size": 1,
    "t_forward_total": 2.0,
    "t_backward_total": 2.0,
    "breakdown": {"FF&BP": 4.0, "FactorComp": 2.0, "Other": 0.3},
    "layers": [
        {"name": n, "a_dim": 3, "g_dim": 2, "params": 10, "t_forward": 1.0, "t_backward": 1.0}
        | {"t_factor_a": 0.5, "t_factor_g": 0.25, "t_inverse_a": 2.0, "t_inverse_g": 1.0}
        for n in ("l1", "l2")
    ],
}
PROFILE = (
    "allreduce: {alpha: 0.1, beta: 0.01}\nbroadcast: {alpha: 0.05, beta: 0.01}\n"
    "inverse: {kind: cubic, alpha: 0, beta: 0.01}\n"
)


def _package(path: Path, members: dict[str, bytes]) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for name, body in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(body)
            tar.addfile(info, io.BytesIO(body))
    return path


def _inputs(tmp: Path) -> dict[str, str]:
    """The files the table's arguments name (``{name}`` in an argument is replaced by the path)."""
    (tmp / "afile").write_text("not a folder\n")
    (tmp / "adir").mkdir()
    locked = tmp / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    (tmp / "layers.json").write_text(json.dumps(HAND_LAYERS))
    (tmp / "profile.yaml").write_text(PROFILE)
    (tmp / "empty.json").write_text("{}")
    (tmp / "list.json").write_text(json.dumps([HAND_LAYERS]))
    (tmp / "text.json").write_text("layers: none\n")
    no_dims = {**HAND_LAYERS, "layers": [{"name": "l1", "t_forward": 1.0}]}
    (tmp / "no_dims.json").write_text(json.dumps(no_dims))
    clothes = {f"package/src/clothes/{k}.json": json.dumps({"data": [[k] * 784] * 7}).encode() for k in range(10)}
    _package(tmp / "good.tgz", clothes)
    _package(tmp / "other.tgz", {"package/index.js": b"1"})
    _package(tmp / "notjson.tgz", {**clothes, "package/src/clothes/3.json": b"{"})
    _package(tmp / "ragged.tgz", {**clothes, "package/src/clothes/3.json": b'{"data": [[1, 2], [3]]}'})
    (tmp / "cut.tgz").write_bytes((tmp / "good.tgz").read_bytes()[:200])
    return {p.name.replace(".", "_"): str(p) for p in tmp.iterdir()} | {"tmp": str(tmp)}


SIM = ("{layers_json}", "{profile_yaml}")
BAD = [
    ("bench.py", ("quickstart", "--steps", "4", "--warmup", "4"), "--steps 4", None),
    ("tta.py", ("quickstart", "--seeds", "a,b"), "--seeds", None),
    ("tta.py", ("quickstart", "--seeds", ""), "--seeds", None),
    ("tta.py", ("quickstart", "--seeds", "0,0"), "--seeds", None),
    ("tta.py", ("quickstart", "--seeds", "-1"), "--seeds", None),
    ("tta.py", ("quickstart", "--targets", "ninety"), "--targets", None),
    ("tta.py", ("quickstart", "--targets", ""), "--targets", None),
    ("tta.py", ("quickstart", "--targets", "90"), "--targets", None),
    ("tta.py", ("quickstart", "--targets", "nan"), "--targets", None),
    ("tta.py", ("quickstart", "--loss-targets", "low"), "--loss-targets", None),
    ("tta.py", ("quickstart", "--loss-targets", "0"), "--loss-targets", None),
    ("tta.py", ("quickstart", "--epochs", "0"), "--epochs", None),
    ("tta.py", ("quickstart", "--eval-every", "ten"), "--eval-every", None),
    ("tta.py", ("quickstart", "--optimizers", ""), "--optimizers", None),
    ("tta.py", ("quickstart", "--grid", "sgd=optim.lr:0.1,,0.2"), "--grid", None),
    ("tta.py", ("quickstart", "--grid", "sgd=optim.lr:0.1", "--grid", "sgd=optim.lr:0.2"), "--grid", None),
    ("tta.py", ("quickstart", "--out", "{afile}/tta"), "--out", None),
    ("tta.py", ("quickstart", "--out", "{afile}"), "--out", None),
    ("tta.py", ("quickstart", "--out", "{locked}/tta"), "--out", "root writes anywhere"),
    ("fetch_fashion_mnist.py", ("--tgz", "{tmp}/missing.tgz", "--out", "{tmp}/o"), "--tgz", None),
    ("fetch_fashion_mnist.py", ("--tgz", "{adir}", "--out", "{tmp}/o"), "--tgz", None),
    ("fetch_fashion_mnist.py", ("--tgz", "{layers_json}", "--out", "{tmp}/o"), "--tgz", None),
    ("fetch_fashion_mnist.py", ("--tgz", "{cut_tgz}", "--out", "{tmp}/o"), "--tgz", None),
    ("fetch_fashion_mnist.py", ("--tgz", "{other_tgz}", "--out", "{tmp}/o"), "--tgz", None),
    ("fetch_fashion_mnist.py", ("--tgz", "{notjson_tgz}", "--out", "{tmp}/o"), "--tgz", None),
    ("fetch_fashion_mnist.py", ("--tgz", "{ragged_tgz}", "--out", "{tmp}/o"), "--tgz", None),
    ("fetch_fashion_mnist.py", ("--tgz", "{good_tgz}", "--out", "{afile}"), "--out", None),
    ("fetch_fashion_mnist.py", ("--tgz", "{good_tgz}", "--out", "{afile}/o"), "--out", None),
    ("fetch_fashion_mnist.py", ("--tgz", "{good_tgz}", "--out", "{locked}"), "--out", "root writes anywhere"),
    ("simulate.py", ("{tmp}/missing.json", "{profile_yaml}"), "layers", None),
    ("simulate.py", ("{empty_json}", "{profile_yaml}"), "layers", None),
    ("simulate.py", ("{list_json}", "{profile_yaml}"), "layers", None),
    ("simulate.py", ("{text_json}", "{profile_yaml}"), "layers", None),
    ("simulate.py", ("{adir}", "{profile_yaml}"), "layers", None),
    ("simulate.py", ("{no_dims_json}", "{profile_yaml}"), "layers", None),
    ("simulate.py", (*SIM, "--between", "{empty_json}"), "--between", None),
    ("simulate.py", (*SIM, "--workers", "two"), "--workers", None),
    ("simulate.py", (*SIM, "--workers", "0"), "--workers", None),
    ("simulate.py", (*SIM, "--workers", ""), "--workers", None),
    ("simulate.py", (*SIM, "--compute-scale", "nan"), "--compute-scale", None),
    ("simulate.py", (*SIM, "--fusion-threshold-mb", "-1"), "--fusion-threshold-mb", None),
    ("simulate.py", (*SIM, "--set", "broadcast.alpha=inf"), "--set", None),
    ("simulate.py", (*SIM, "--json", "{afile}/out.json"), "--json", None),
    ("simulate.py", (*SIM, "--json", "{adir}"), "--json", None),
    ("bench_hooks.py", ("vit", "--kwargs", "patch_size=7,dim"), "--kwargs", None),
    ("bench_newton_schulz.py", ("vit", "--kwargs", "dim=sixty"), "--kwargs", None),
    ("bench_apply.py", ("--shapes", "16x"), "--shapes", None),
    ("bench_apply.py", ("--shapes", "0x10"), "--shapes", None),
    ("bench_apply.py", ("--reps", "0"), "--reps", None),
]
"""Tool, arguments, the argument the error line must name, and why the case is skipped as root (None: never)."""
MAINS = {
    "bench.py": bench.main,
    "bench_apply.py": bench_apply.main,
    "bench_hooks.py": bench_hooks.main,
    "bench_newton_schulz.py": bench_newton_schulz.main,
    "tta.py": tta.main,
    "fetch_fashion_mnist.py": fetch_fashion_mnist.main,
    "simulate.py": simulate.main,
}
"""Each tool's entry point (their programs as a whole run in tests/test_tools.py)."""


@pytest.mark.parametrize(("tool", "args", "names", "unless_root"), BAD)
def test_a_bad_argument_of_a_tool_ends_with_one_error_line(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    tool: str,
    args: tuple[str, ...],
    names: str,
    unless_root: str | None,
) -> None:
    if unless_root and os.geteuid() == 0:
        pytest.skip(unless_root)
    paths = _inputs(tmp_path)
    argv = [a.format(**paths) for a in args]
    try:  # in this process (a run of its own imports torch first, seconds each); anything but an exit fails the test
        code: object = MAINS[tool](argv)
    except SystemExit as stop:
        code = stop.code
    err = capsys.readouterr().err
    returncode, stderr = (1, f"{err}{code}") if isinstance(code, str) else (code, err)
    (tmp_path / "locked").chmod(0o700)  # so that the test's folder can be removed
    assert returncode != 0
    assert "Traceback" not in stderr, stderr[-3000:]
    last = stderr.strip().splitlines()[-1]
    assert "error:" in last and names in last, stderr[-3000:]


def test_the_tables_package_is_good_but_for_the_bad_argument(tmp_path: Path) -> None:
    """The table's inputs are good but for the one bad argument: the fetcher takes the package it is given."""
    paths = _inputs(tmp_path)
    (tmp_path / "locked").chmod(0o700)
    proc = run_tool("fetch_fashion_mnist.py", "--tgz", paths["good_tgz"], "--out", str(tmp_path / "o"))
    assert proc.returncode == 0 and "60 training and 10 validation images" in proc.stdout, proc.stderr[-3000:]


def _fake_train(made: list[list[str]]) -> Any:
    def train(recipe: str, overrides: list[str], folder: Path) -> dict[str, Any]:
        made.append(overrides)
        history = [{"epoch": 1.0, "step": 44, "seconds": 1.0, "val_acc": 0.9, "val_loss": 0.3}]
        return {"val_acc": 0.9, "steps": 44, "step_time_median_s": 0.02, "history": history}

    return train


TTA = ["recipes/quickstart.yaml", "--optimizers", "sgd,flow", "--seeds", "0", "--epochs", "1", "--eval-every", "15"]


def test_tta_lets_the_users_save_and_progress_win(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[list[str]] = []
    monkeypatch.setattr(tta, "train", _fake_train(made))
    monkeypatch.setattr(tta, "picture", lambda *a, **k: None)
    args = [*TTA, "--grid", "sgd=optim.lr:0.1", "--grid", "flow=kfac.damping:0.1;train.steps:30"]
    assert tta.main([*args, "train.save=true", "--out", str(tmp_path / "a"), "train.progress=true"]) == 0
    assert len(made) == 2
    for overrides in made:  # what run.py trains: the user's keys as given, tta's own as it sets them
        cfg = load([QUICK], overrides)
        assert cfg.train.save is True and cfg.train.progress is True
        assert (cfg.train.epochs, cfg.train.eval_every_steps, cfg.train.seed) == (1, 15, 0)
    assert load([QUICK], made[0]).train.steps == 0 and load([QUICK], made[1]).train.steps == 30  # a grid's budget
    made.clear()
    assert tta.main([*args, "--out", str(tmp_path / "b")]) == 0
    assert all(not load([QUICK], o).train.save and not load([QUICK], o).train.progress for o in made)


@pytest.mark.parametrize(
    ("override", "says"),
    [
        ("train.steps=5", "--epochs"),
        ("train.epochs=2", "--epochs"),
        ("train.seed=3", "--seeds"),
        ("train.eval_every_steps=5", "--eval-every"),
        ("train.stop_at_accuracy=0.5", "--stop-at"),
        ("out_dir=elsewhere", "--out"),
        ("train={steps: 5}", "--"),
        ("optim.lr=0.3", '--grid "sgd=optim.lr:0.3"'),
        ("kfac.damping=0.2", '--grid "flow=optim.lr:0.1;kfac.damping:0.2"'),
        ("kfac.inv_update_freq=5", "--grid"),
        ("kfac.variant=spd", "--optimizers"),
        ("optim.name=adamw", "--optimizers"),
    ],
)
def test_tta_refuses_an_override_of_a_key_it_sets_itself(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, override: str, says: str
) -> None:
    made: list[list[str]] = []
    monkeypatch.setattr(tta, "train", _fake_train(made))
    monkeypatch.setattr(tta, "picture", lambda *a, **k: None)
    with pytest.raises(SystemExit) as refused:
        tta.main([*TTA, override, "--out", str(tmp_path)])
    line = str(refused.value)
    assert line.startswith(f"error: {override}: ") and says in line and "\n" not in line, line
    assert not made  # refused before any run


def test_tta_reads_a_cached_run_only_where_it_was_trained_as_asked(tmp_path: Path) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text("train: {epochs: 1}\n")
    folder = tmp_path / "run"
    folder.mkdir()
    asked = [str(recipe), tta.hashlib.sha256(recipe.read_bytes()).hexdigest()[:12], "optim.lr=0.1"]
    (folder / "summary.json").write_text(json.dumps({"val_acc": 0.5, "tta_run": asked}))
    assert tta.train(str(recipe), ["optim.lr=0.1"], folder)["val_acc"] == 0.5  # as asked: read, not trained
    with pytest.raises(SystemExit, match=r"was trained with other settings .*optim.lr=0.1.*give another --out"):
        tta.train(str(recipe), ["optim.lr=0.2"], folder)
    shipped = tta.hashlib.sha256((ROOT / "recipes" / "quickstart.yaml").read_bytes()).hexdigest()[:12]
    (folder / "summary.json").write_text(json.dumps({"val_acc": 0.7, "tta_run": ["quickstart", shipped]}))
    assert tta.train("quickstart", [], folder)["val_acc"] == 0.7  # a shipped recipe by its name
    (folder / "summary.json").write_text(json.dumps({"val_acc": 0.5, "tta_run": asked}))
    recipe.write_text("train: {epochs: 2}\n")  # the same command line, another recipe text
    with pytest.raises(SystemExit, match=r"was trained with other settings"):
        tta.train(str(recipe), ["optim.lr=0.1"], folder)
