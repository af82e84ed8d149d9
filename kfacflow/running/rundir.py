"""Run folders: ``runs/<name>/<YYYYmmdd-HHMMSS>/`` with config, command, versions, summary, checkpoints."""

from __future__ import annotations

import contextlib
import errno
import importlib.metadata
import io
import json
import logging
import os
import pickle
import platform
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kfacflow import StorageError, UserError, __version__

logger = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"
_CKPT = re.compile(r"step_(\d+)\.pt$")


def new_run_dir(out_dir: str, name: str) -> Path:
    """Create and return a fresh ``out_dir/name/<timestamp>`` folder (suffixed if taken).

    Raises:
        UserError: If the folder cannot be created (naming ``out_dir``).
    """
    stamp = time.strftime("%Y%m%d-%H%M%S")
    base = Path(out_dir) / name
    for k in range(1000):
        path = base / (stamp if k == 0 else f"{stamp}-{k}")
        try:
            path.mkdir(parents=True)
            return path
        except FileExistsError:
            if path.is_dir():
                continue
            raise UserError(f"out_dir={out_dir!r}: {path} exists and is not a folder; choose another.") from None
        except OSError as err:
            raise UserError(f"out_dir={out_dir!r}: cannot create {path} ({err.strerror}); choose another.") from None
    raise UserError(f"out_dir={out_dir!r}: 1000 run folders named {stamp} already exist under {base}.")


def write_metadata(run_dir: Path, config_yaml: str, argv: list[str], resumed: bool = False) -> None:
    """Write the resolved config, the command line (appended on resume) and the library versions.

    Raises:
        StorageError: If the run folder cannot be written.
    """
    write_atomic(run_dir / "config.yaml", config_yaml.encode())
    command = " ".join(argv) + "\n"
    if resumed and (run_dir / "command.txt").is_file():
        command = (run_dir / "command.txt").read_text(errors="replace") + command
    write_atomic(run_dir / "command.txt", command.encode())
    versions = {
        "kfacflow": __version__,
        "git_commit": git_commit(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }
    for package in ("torchvision", "omegaconf", "timm", "horovod"):  # installed ones, imported or not
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions[package] = importlib.metadata.version(package)
    write_atomic(run_dir / "versions.json", json.dumps(versions, indent=2).encode())


DATA = "data.json"


def write_data(run_dir: Path, identity: dict[str, Any]) -> None:
    """Write what identifies the data the run reads (a text corpus: files, bytes, sha256) as ``data.json``.

    A resumed run that reads other data (another Python's standard library) keeps the first file and says so.

    Raises:
        StorageError: If it cannot be written.
    """
    path = run_dir / DATA
    if path.is_file():
        try:
            before = json.loads(path.read_text())
        except (OSError, ValueError):
            before = None
        if before is not None and before != identity:
            logger.warning(
                "%s: this process reads other data than the run began with (%s); its results mix the two",
                path,
                json.dumps(identity.get("sha256", identity)),
            )
            return
    write_atomic(path, json.dumps(identity, indent=2).encode())


def git_commit() -> str | None:
    """Return the commit of the kfacflow checkout that runs (``+dirty`` with local changes), or None if not one."""
    source = Path(__file__).resolve().parents[2]
    if not (source / ".git").exists():  # an installed copy: no checkout of ours around it
        return None
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=source, capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=source,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the whole new one.

    Raises:
        StorageError: If it cannot be written (the temporary file is removed, the old file stays).
    """
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as err:  # Ctrl-C included: never leave the temporary file behind
        tmp.unlink(missing_ok=True)
        if isinstance(err, OSError):
            raise storage_error(path, err) from None
        raise


def storage_error(path: Path, err: BaseException) -> StorageError:
    """Return the one-line error for a file of the run folder that could not be written."""
    reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err).splitlines()[0]
    if isinstance(err, OSError) and err.errno == errno.ENOSPC or "unexpected pos" in str(err):
        reason = "no space left on the device (disk full)"
    return StorageError(f"could not write {path}: {reason}. Free space or fix the folder, then resume.")


def append_lines(path: Path, lines: list[str]) -> None:
    """Append lines to a log file of the run folder.

    Raises:
        StorageError: If it cannot be written.
    """
    try:
        with open(path, "a") as f:
            f.writelines(lines)
    except OSError as err:
        raise storage_error(path, err) from None


def keep_lines(path: Path, keep: Callable[[str], bool]) -> None:
    """Rewrite the log file ``path``, if there is one, with only its whole lines that ``keep`` accepts (atomically).

    Args:
        path: A file of lines, each ended by a newline (a last line without one was cut short: dropped).
        keep: Takes a line without its newline.

    Raises:
        StorageError: If it cannot be read or rewritten.
    """
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return
    except OSError as err:
        raise storage_error(path, err) from None
    *whole, _cut = text.split("\n")
    kept = "".join(f"{line}\n" for line in whole if keep(line))
    if kept != text:
        write_atomic(path, kept.encode())


def write_summary(run_dir: Path, summary: dict[str, Any]) -> None:
    """Write ``summary.json``.

    Raises:
        StorageError: If it cannot be written.
    """
    write_atomic(run_dir / "summary.json", json.dumps(summary, indent=2).encode())


def save_checkpoint(run_dir: Path, step: int, state: dict[str, Any], keep: int) -> Path:
    """Atomically write ``checkpoints/step_<step>.pt`` and delete all but the newest ``keep`` (0 keeps all).

    Raises:
        StorageError: If the checkpoint cannot be written (disk full, permissions): the temporary
            file is removed and the previous checkpoints stay as they were.
    """
    folder = run_dir / CHECKPOINTS
    path = folder / f"step_{step:08d}.pt"
    tmp = folder / f".{path.name}.tmp"
    try:
        folder.mkdir(exist_ok=True)
        torch.save(state, tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as err:  # Ctrl-C included: never leave the temporary file behind
        tmp.unlink(missing_ok=True)
        if isinstance(err, (OSError, RuntimeError)):  # torch.save reports a full disk as "... unexpected pos"
            raise storage_error(path, err) from None
        raise
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


CHECKPOINT_KEYS = ("step", "world_size", "model", "optimizer", "scheduler", "kfac", "history", "rng")
"""What every checkpoint holds; a file without them is not one of ours (or is damaged)."""


def read_checkpoint(path: Path, quiet: bool = False) -> dict[str, Any] | None:
    """Return the checkpoint at ``path``, or None (with a warning unless ``quiet``) if it is unreadable."""
    try:
        # quiet reads only look at the metadata: mmap leaves the tensors on disk until used.
        try:  # tensors, numbers and strings only: what torch.load opens safely
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=quiet)
        except pickle.UnpicklingError:  # written before the RNG states were stored as tensors
            state = torch.load(path, map_location="cpu", weights_only=False, mmap=quiet)
        if not isinstance(state, dict) or any(key not in state for key in CHECKPOINT_KEYS):
            raise ValueError("not a kfacflow checkpoint")
    except Exception as err:  # noqa: BLE001 - any unreadable file falls back to the previous one
        if not quiet:
            reason = str(err).splitlines()[0] if str(err) else type(err).__name__
            logger.warning("checkpoint %s is unreadable (%s); trying the previous one", path, reason)
        return None
    return state


def export_weights(run_dir: Path) -> Path:
    """Write the newest checkpoint's model weights as ``export/model_step_<step>.pt`` and return its path.

    The file holds ``model`` (the ``state_dict``), ``step``, ``meta`` (model, data, world size) and,
    with ``train.ema``, ``model_ema``: nothing but tensors, numbers and strings, so that
    ``torch.load(path, weights_only=True)`` opens it.

    Raises:
        UserError: If the folder has no readable checkpoint.
        StorageError: If the file cannot be written.
    """
    state = load_latest_checkpoint(run_dir, what="export")
    path = run_dir / "export" / f"model_step_{int(state['step']):08d}.pt"
    weights = {"model": state["model"], "step": int(state["step"]), "meta": state.get("meta", {})}
    if state.get("ema") is not None:  # train.ema: the averaged weights too, under the model's own names
        weights["model_ema"] = {k.removeprefix("module."): v for k, v in state["ema"].items() if k != "n_averaged"}
    buffer = io.BytesIO()
    torch.save(weights, buffer)
    try:
        path.parent.mkdir(exist_ok=True)
    except OSError as err:
        raise storage_error(path.parent, err) from None
    write_atomic(path, buffer.getvalue())
    return path


def load_latest_checkpoint(run_dir: Path, quiet: bool = False, what: str = "resume") -> dict[str, Any]:
    """Return the newest readable checkpoint of ``run_dir``, skipping unreadable ones with a warning.

    Raises:
        UserError: If the folder has no readable checkpoint.
    """
    found = checkpoints(run_dir)
    for path in reversed(found):
        state = read_checkpoint(path, quiet)
        if state is not None:
            if not quiet:
                logger.info("resuming from %s", path)
            return state
    missing = "no readable checkpoint" if found else "no checkpoint"
    hint = "start a new run without resume=" if what == "resume" else "give a run folder that has trained a step"
    raise UserError(f"{what}: {str(run_dir)!r} has {missing} in {CHECKPOINTS}/; {hint}.")
