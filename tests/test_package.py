"""The installable package: a fresh virtual environment, the ``kfacflow`` command, the shipped recipes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from helpers import ROOT, run_cli

import kfacflow


def _run(*cmd: str | Path, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "PYTHONPATH")}
    return subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def test_the_package_installs_into_a_fresh_venv_and_trains_by_recipe_name(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    # The system's packages (torch and the rest, pip and setuptools too) are reused; the package
    # itself is built offline. (A venv's own pip would bring a setuptools too old to build wheels.)
    made = _run(sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", venv, cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    python, command = venv / "bin" / "python", venv / "bin" / "kfacflow"
    pip = _run(python, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", ROOT, cwd=tmp_path)
    assert pip.returncode == 0, pip.stderr
    elsewhere = tmp_path / "elsewhere"  # no recipes/ here: the recipe comes from the installed package
    elsewhere.mkdir()
    where = _run(python, "-c", "import kfacflow; print(kfacflow.__file__)", cwd=elsewhere)
    assert where.stdout.startswith(str(venv)), where.stdout  # the installed copy, not this checkout
    version = _run(command, "--version", cwd=elsewhere)
    assert version.returncode == 0 and version.stdout.strip() == f"kfacflow {kfacflow.__version__}"
    listed = _run(command, "--list", "recipe", cwd=elsewhere)
    assert "  quickstart" in listed.stdout.splitlines()
    run = _run(command, "quickstart", "launch.nproc=1", "train.steps=2", "train.progress=false", cwd=elsewhere)
    assert run.returncode == 0, run.stderr
    run_dir = elsewhere / run.stdout.strip().splitlines()[-1]
    assert run_dir.is_relative_to(elsewhere / "runs" / "quickstart")
    # The command that started it, and the one that resumes it, name the installed command.
    assert (run_dir / "command.txt").read_text().startswith("kfacflow quickstart launch.nproc=1")
    wrong = _run(command, "quickstrat", cwd=elsewhere)
    assert wrong.returncode == 2
    assert wrong.stderr.strip().splitlines() == [
        "error: recipe 'quickstrat' does not exist. Did you mean 'quickstart'? Give a YAML file or a shipped recipe: "
        + ", ".join(sorted(p.stem for p in (ROOT / "kfacflow" / "recipes").glob("*.yaml")))
        + "."
    ]


def test_run_py_takes_a_shipped_recipe_by_name_too(tmp_path: Path) -> None:
    out = run_cli("quickstart.yaml", "--print-config", cwd=tmp_path)
    assert out.returncode == 0 and "name: quickstart" in out.stdout
    assert (ROOT / "recipes").resolve() == ROOT / "kfacflow" / "recipes"  # the top-level folder is a link
