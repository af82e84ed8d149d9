"""Every shipped recipe runs two steps end to end (shrunk to CPU-test size)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml
from helpers import ROOT, last_line, run_cli_batch

from kfacflow.data.text import TEXT_SETS
from kfacflow.kfac.layers import find_layers
from kfacflow.models.builtin import build_model

RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))
# Datasets read from disk, or large: replaced by a tiny synthetic set of the same image shape family.
SMALL_SYNTHETIC = [
    "data.name=synthetic",
    "data.root=null",
    "data.image_size=32",
    "data.num_classes=10",
    "data.train_size=64",
    "data.val_size=16",
    "data.batch_size=4",
    "data.workers=0",
]


WIDE = 600
"""Widest factor a shrunk recipe keeps preconditioned: every recipe keeps some of its layers (ResNets' 3x3
convolutions of 64 channels are 576 wide), and the first step's inversions stay short (1200: twice the time)."""


def shrink(recipe: Path) -> list[str]:
    """Overrides that make ``recipe`` run in seconds without any files on disk."""
    cfg = yaml.safe_load(recipe.read_text()) or {}
    if ((cfg.get("data") or {}).get("name") or "digits") == "digits":
        return ["data.workers=0"]
    if (cfg.get("data") or {}).get("name") in TEXT_SETS:  # a few kB of its own text, no images
        return ["data.workers=0", "data.text_bytes=20000", "data.batch_size=4"]
    model = str((cfg.get("model") or {}).get("name"))
    # Inverting factors thousands wide takes seconds each on 2 cores (ResNet-152 has 36 of 2305 in
    # layer3 alone): the layers with one wider than WIDE are left out, by name (a pattern must match a layer).
    wide = [layer.name for layer in find_layers(build_model(model, 10, 3), []) if max(layer.a_dim, layer.g_dim) > WIDE]
    skip = [*((cfg.get("kfac") or {}).get("skip") or []), *wide]
    # Inception-v4's stem and reduction blocks need at least ~75 px; a ViT's patches must tile the images (its
    # 7 px ones Fashion-MNIST's 28 px); the others run at 32 px.
    size = ["data.image_size=96"] if "inception" in model else ["data.image_size=28"] if model == "vit" else []
    return [*SMALL_SYNTHETIC, *size, f"kfac.skip=[{','.join(skip)}]"]


def test_recipes_found() -> None:
    assert {"quickstart", "digits_sgd"} <= {r.stem for r in RECIPES}


Runs = dict[str, tuple[Path, subprocess.CompletedProcess[str]]]


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    """Every recipe's two steps, one after another in one interpreter (each alone is mostly start-up)."""
    outs = {recipe.stem: tmp_path_factory.mktemp(recipe.stem) for recipe in RECIPES}
    args = ["train.steps=2", "launch.nproc=1", "train.progress=false"]
    runs = [[str(r.relative_to(ROOT)), *args, f"out_dir={outs[r.stem]}", *shrink(r)] for r in RECIPES]
    return {r.stem: (outs[r.stem], proc) for r, proc in zip(RECIPES, run_cli_batch(runs), strict=True)}


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES, ids=[r.stem for r in RECIPES])
def test_recipe_runs_two_steps(recipe: Path, two_steps: Runs) -> None:
    tmp_path, proc = two_steps[recipe.stem]
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = Path(last_line(proc))
    assert run_dir.parent == tmp_path / recipe.stem
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 2
    assert summary["world_size"] == 1
    assert (run_dir / "config.yaml").is_file()
