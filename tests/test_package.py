"""The installable package: a fresh virtual environment, the ``kfacflow`` command, the shipped recipes."""

from __future__ import annotations

import os
import site
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT, run_cli

import kfacflow


def _run(*cmd: str | Path, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "PYTHONPATH")}
    return subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def _venv_seeing_this_interpreter(venv: Path, cwd: Path) -> Path:
    """Make a venv that sees the packages of the interpreter running the tests, whatever it is.

    ``--system-site-packages`` would give the *base* interpreter's packages even when the tests run
    in a venv (setuptools 65 without ``wheel``, no torch, on a fresh machine), so the running
    interpreter's own site folders go in a ``.pth`` file instead. Plain paths there add no ``.pth``
    files of their own: this checkout's editable install stays out, and ``kfacflow`` can only come
    from the copy installed into the new venv.
    """
    made = _run(sys.executable, "-m", "venv", "--without-pip", venv, cwd=cwd)
    assert made.returncode == 0, made.stderr
    python = venv / "bin" / "python"
    site_dir = Path(
        _run(python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))", cwd=cwd).stdout.strip()
    )
    assert site_dir.is_relative_to(venv), site_dir
    here = [*site.getsitepackages(), site.getusersitepackages()]
    (site_dir / "_tests_parent.pth").write_text("".join(f"{d}\n" for d in here if Path(d).is_dir()))
    return python


@pytest.mark.slow
def test_the_package_installs_into_a_fresh_venv_and_trains_by_recipe_name(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    # torch and the rest come from the interpreter running the tests (a venv or not); the package
    # itself is built offline with its setuptools (>= 70.1 builds wheels without the `wheel` package).
    python = _venv_seeing_this_interpreter(venv, tmp_path)
    command = venv / "bin" / "kfacflow"
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


@pytest.mark.slow
def test_run_py_takes_a_shipped_recipe_by_name_too(tmp_path: Path) -> None:
    out = run_cli("quickstart.yaml", "--print-config", cwd=tmp_path)
    assert out.returncode == 0 and "name: quickstart" in out.stdout
    assert (ROOT / "recipes").resolve() == ROOT / "kfacflow" / "recipes"  # the top-level folder is a link
