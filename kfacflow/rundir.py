"""Run folders: ``runs/<name>/<YYYYmmdd-HHMMSS>/`` with config, command, versions, summary, checkpoints."""

from __future__ import annotations

import json
import logging
import os
import platform
import re
import sys
import time
from pathlib import Path
from typing import Any

import torch

from kfacflow.errors import UserError

logger = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"
_CKPT = re.compile(r"step_(\d+)\.pt$")


def new_run_dir(out_dir: str, name: str) -> Path:
    """Create and return a fresh ``out_dir/name/<timestamp>`` folder (suffixed if taken)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    base = Path(out_dir) / name
    for k in range(1000):
        path = base / (stamp if k == 0 else f"{stamp}-{k}")
        try:
            path.mkdir(parents=True)
            return path
        except FileExistsError:
            continue
    raise RuntimeError(f"could not create a run folder under {base}")


def write_metadata(run_dir: Path, config_yaml: str, argv: list[str]) -> None:
    """Write the resolved config, the command line and the library versions."""
    write_atomic(run_dir / "config.yaml", config_yaml.encode())
    write_atomic(run_dir / "command.txt", (" ".join(argv) + "\n").encode())
    versions = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }
    for mod in ("torchvision", "omegaconf", "timm", "horovod"):
        module = sys.modules.get(mod)
        if module is not None:
            versions[mod] = getattr(module, "__version__", "?")
    write_atomic(run_dir / "versions.json", json.dumps(versions, indent=2).encode())


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the whole new one."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_summary(run_dir: Path, summary: dict[str, Any]) -> None:
    """Write ``summary.json``."""
    write_atomic(run_dir / "summary.json", json.dumps(summary, indent=2).encode())


def save_checkpoint(run_dir: Path, step: int, state: dict[str, Any], keep: int) -> Path:
    """Atomically write ``checkpoints/step_<step>.pt`` and delete all but the newest ``keep``."""
    folder = run_dir / CHECKPOINTS
    folder.mkdir(exist_ok=True)
    path = folder / f"step_{step:08d}.pt"
    tmp = folder / f".{path.name}.tmp"
    torch.save(state, tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    for old in checkpoints(run_dir)[:-keep] if keep > 0 else []:
        old.unlink(missing_ok=True)
    return path


def checkpoints(run_dir: Path) -> list[Path]:
    """Return the run's checkpoint files, oldest first."""
    folder = run_dir / CHECKPOINTS
    if not folder.is_dir():
        return []
    found = [p for p in folder.iterdir() if _CKPT.search(p.name)]
    return sorted(found, key=lambda p: int(_CKPT.search(p.name).group(1)))  # type: ignore[union-attr]


def load_latest_checkpoint(run_dir: Path) -> dict[str, Any]:
    """Return the newest readable checkpoint of ``run_dir``, skipping unreadable ones with a warning.

    Raises:
        UserError: If the folder has no readable checkpoint.
    """
    found = checkpoints(run_dir)
    for path in reversed(found):
        try:
            state: dict[str, Any] = torch.load(path, map_location="cpu", weights_only=False)
            logger.info("resuming from %s", path)
            return state
        except Exception as err:  # noqa: BLE001 - any unreadable file falls back to the previous one
            logger.warning("checkpoint %s is unreadable (%s); trying the previous one", path, err)
    what = "no readable checkpoint" if found else "no checkpoint"
    raise UserError(f"resume: {str(run_dir)!r} has {what} in {CHECKPOINTS}/; start a new run without resume=.")
