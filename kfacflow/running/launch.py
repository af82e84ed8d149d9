"""Start N local workers through torch's elastic launcher, or join a torchrun/horovodrun job."""

from __future__ import annotations

import json
import logging
import os
import shlex
import signal
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from kfacflow import StorageError, TrainingError, UserError
from kfacflow.comm.launchers import under_launcher
from kfacflow.configuration.schema import CORES

logger = logging.getLogger(__name__)

SHUTDOWN_TIMEOUT_S = 120
"""Seconds a signalled worker gets to finish its step and write a checkpoint before it is killed."""


PROGRAM_VAR = "KFACFLOW_PROGRAM"
"""Set to ``kfacflow`` when the installed command started the job (``command.txt`` and the resume hint show it)."""
FAILURES_VAR = "KFACFLOW_FAILURES"
"""A folder where each failing worker of a self-launched job notes when and how it failed."""
HANDLED_CODES = (UserError.exit_code, TrainingError.exit_code, StorageError.exit_code)
"""Exit codes of workers that printed their own ``error:`` line."""
LAUNCHERS = ("torchrun", "horovodrun", "torch.distributed.run")


def check_environment() -> None:
    """Refuse an environment no job can run in: a stale or half-set ``RANK``/``WORLD_SIZE``, a bad ``OMP_NUM_THREADS``.

    Workers take ``OMP_NUM_THREADS`` as their thread count when ``launch.threads`` is 0, so it must be one.

    Raises:
        UserError: Naming the variables and what to do.
    """
    omp = os.environ.get("OMP_NUM_THREADS", "").strip()
    if omp and not (omp.isdigit() and 1 <= int(omp) <= CORES):
        raise UserError(
            f"OMP_NUM_THREADS={omp} is not a thread count from 1 to {CORES} (this machine's CPU cores); "
            "unset it or fix it (launch.threads sets the threads of a worker)."
        )
    rank, world = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
    if rank is None and world is None:
        return
    fix = "unset RANK WORLD_SIZE to train on this machine, or start the job with torchrun"
    if rank is None or world is None:
        raise UserError(f"only one of RANK and WORLD_SIZE is set (RANK={rank}, WORLD_SIZE={world}); {fix}.")
    if not (rank.isdigit() and world.isdigit() and int(world) >= 1 and int(rank) < int(world)):
        raise UserError(f"RANK={rank} and WORLD_SIZE={world} do not describe a job (0 <= RANK < WORLD_SIZE); {fix}.")
    joinable = os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT")
    if "TORCHELASTIC_RUN_ID" not in os.environ and not joinable:
        raise UserError(
            f"RANK={rank} and WORLD_SIZE={world} are set but MASTER_ADDR/MASTER_PORT are not: a stale environment "
            f"from another job? {fix}."
        )


def launcher_command() -> list[str] | None:
    """Return the command line of the torchrun or horovodrun process above this one, if it runs on this machine."""
    pid = os.getppid()
    for _ in range(8):
        try:
            args = [a.decode(errors="replace") for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if a]
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return None
        for i, arg in enumerate(args):
            if Path(arg).name in LAUNCHERS[:2]:
                return [Path(arg).name, *args[i + 1 :]]
            if arg == "-m" and i + 1 < len(args) and args[i + 1] == LAUNCHERS[2]:
                return ["python", *args[i:]]
        pid = int(stat.rsplit(")", 1)[1].split()[1])
        if pid <= 1:
            return None
    return None


def command_line(argv: list[str]) -> list[str]:
    """Return the command that started this job: the launcher's, ``kfacflow ARGS`` or ``python run.py ARGS``."""
    launcher = launcher_command() if under_launcher() else None
    program = ["kfacflow"] if os.environ.get(PROGRAM_VAR) == "kfacflow" else ["python", "run.py"]
    return launcher or [*program, *argv]


def continue_command(run_dir: Path, argv: list[str]) -> str:
    """Return the command that resumes ``run_dir`` the way this job was launched."""
    command = command_line(argv)
    if command[0] == "kfacflow":
        return shlex.join(["kfacflow", f"resume={run_dir}"])
    script = next((i for i, a in enumerate(command) if a.endswith(".py")), None)
    if script is None:
        return f"the same launcher command, with run.py resume={run_dir}"
    return shlex.join([*command[: script + 1], f"resume={run_dir}"])


def note_failure(rank: int, code: int, secondary: bool) -> None:
    """Tell the self-launching parent when and how this worker failed (no-op under other launchers)."""
    folder = os.environ.get(FAILURES_VAR)
    if not folder:
        return
    record = {"time": time.time(), "code": code, "secondary": secondary}
    try:
        Path(folder, f"{rank}.json").write_text(json.dumps(record))
    except OSError:
        pass  # the parent then judges by exit codes alone


def _root_failure(failures: dict[int, Any], folder: Path) -> tuple[int, int, int | None]:
    """Return (rank, exit code, pid if known) of the failure that caused the others.

    torch's launcher reports one failed worker, not necessarily the first: the notes the workers
    left decide. The earliest worker that failed on its own wins; a worker that only lost contact
    with a failed peer never does; a worker killed by a signal leaves no note.
    """
    notes: dict[int, dict[str, Any]] = {}
    for path in folder.glob("*.json"):
        try:
            notes[int(path.stem)] = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
    first = sorted((note["time"], rank) for rank, note in notes.items() if not note["secondary"])
    if first:
        rank = first[0][1]
        return rank, int(notes[rank]["code"]), getattr(failures.get(rank), "pid", None)
    killed = [rank for rank, failure in failures.items() if failure.exitcode < 0 or rank not in notes]
    rank = killed[0] if killed else min(failures)
    return rank, failures[rank].exitcode, failures[rank].pid


def self_launch(nproc: int, entry: Any, args: tuple[Any, ...]) -> dict[int, Any]:
    """Run ``entry(*args)`` in ``nproc`` fresh local processes joined by a c10d rendezvous.

    Args:
        nproc: Number of workers.
        entry: A module-level function (pickled into spawned processes).
        args: Its arguments (picklable).

    Returns:
        Each rank's return value.

    Raises:
        SystemExit: With the first failed worker's exit code, after one line naming it.
    """
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # The workers print their own errors (one line for a user's mistake, a traceback for a bug);
    # the launcher's ERROR records would repeat them as a second, parent-side traceback.
    for name in ("torch.distributed.elastic", "torch.distributed.launcher"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"kfacflow-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=0,
        monitor_interval=0.1,  # how often the agent polls its workers: 0.5 added up to 0.5 s to the end of every run
        start_method="spawn",
        shutdown_timeout=SHUTDOWN_TIMEOUT_S,
    )
    with tempfile.TemporaryDirectory(prefix="kfacflow-failures-") as folder:
        os.environ[FAILURES_VAR] = folder  # the spawned workers inherit it
        try:
            result: dict[int, Any] = elastic_launch(config, entry)(*args)
            return result
        except SignalException as err:
            # The agent forwarded the signal; the workers checkpoint, say how to resume, and exit.
            raise SystemExit(128 + int(err.sigval)) from None
        except ChildFailedError as err:
            rank, code, pid = _root_failure(err.failures, Path(folder))
            if code < 0:
                name = signal.Signals(-code).name if -code in signal.Signals.__members__.values() else str(-code)
                print(f"error: worker {rank} (pid {pid}) was killed by {name} (out of memory?).", file=sys.stderr)
                raise SystemExit(128 - code) from None
            if code not in HANDLED_CODES and code <= 128:  # the others printed their own line
                print(f"error: worker {rank} failed with exit code {code}; see its output above.", file=sys.stderr)
            raise SystemExit(code or 1) from None
        finally:
            os.environ.pop(FAILURES_VAR, None)
