"""Where a result was made: ``where.yaml`` in its folder (CPU, cores, GPU, torch, Python, commit, date).

The benchmark tools write it beside their output (``record(folder)``), so that no page has to say which machine
or commit a figure comes from. ``python tools/where.py --from-git FOLDER...`` writes it for folders made before
the tools did: the commit and date are those that added the folder; the machine was not recorded then.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kfacflow.running.rundir import git_commit  # noqa: E402 - after the path

NAME = "where.yaml"


def _git(*args: str) -> str:
    try:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout.strip()


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def here() -> dict[str, Any]:
    """This machine, this checkout and now."""
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    return {
        "cpu": _cpu(),
        "cores": os.cpu_count(),
        "gpu": gpu,
        "torch": str(torch.__version__),
        "python": platform.python_version(),
        "commit": git_commit() or "unknown",  # as a run's versions.json says it: +dirty with local changes
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


def record(folder: Path) -> Path:
    """Write ``where.yaml`` for a result made now in ``folder``; return its path."""
    return write(folder, here())


def from_git(folder: Path) -> dict[str, Any]:
    """Where a committed folder made before the tools recorded it was made: the commit that added it, and when."""
    try:
        relative = Path(folder).resolve().relative_to(ROOT)
    except ValueError:
        raise SystemExit(f"error: {folder}: not in this checkout ({ROOT})") from None
    first = _git("log", "--diff-filter=A", "--reverse", "--format=%H %cI", "--", str(relative)).splitlines()
    if not first:
        raise SystemExit(f"error: {folder}: no commit adds it; run the tool that makes it, which records {NAME}")
    commit, date = first[0].split(" ", 1)
    when = datetime.datetime.fromisoformat(date).astimezone(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return {"cpu": "not recorded", "cores": 2, "gpu": "none", "commit": commit, "date": when}


def write(folder: Path, facts: dict[str, Any]) -> Path:
    """Write ``facts`` as ``folder``'s ``where.yaml``; return its path."""
    path = Path(folder) / NAME
    path.write_text(yaml.safe_dump(facts, sort_keys=False))
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folders", nargs="+", type=Path)
    parser.add_argument("--from-git", action="store_true", help="the commit that added each folder, not now")
    args = parser.parse_args(argv)
    for folder in args.folders:
        if not folder.is_dir():
            print(f"error: {folder}: not a folder", file=sys.stderr)
            return 2
        print(write(folder, from_git(folder)) if args.from_git else record(folder))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
