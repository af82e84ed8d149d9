"""Start N local workers through torch's elastic launcher, or join a torchrun/horovodrun job."""

from __future__ import annotations

import logging
import os
import sys
import uuid
from typing import Any

from kfacflow.errors import UserError

logger = logging.getLogger(__name__)

SHUTDOWN_TIMEOUT_S = 120
"""Seconds a signalled worker gets to finish its step and write a checkpoint before it is killed."""


MPI_RANK_VARS = ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK")
"""Where horovodrun and MPI launchers put a process's rank."""
RANK_VARS = ("RANK", *MPI_RANK_VARS)
"""Where any supported launcher (torchrun first) puts a process's rank."""


def under_mpi_launcher() -> bool:
    """Return whether horovodrun or an MPI launcher started this process."""
    return any(var in os.environ for var in MPI_RANK_VARS)


def under_launcher() -> bool:
    """Return whether an external launcher (torchrun, horovodrun, mpirun) started this process."""
    return ("RANK" in os.environ and "WORLD_SIZE" in os.environ) or under_mpi_launcher()


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
        monitor_interval=0.5,
        start_method="spawn",
        shutdown_timeout=SHUTDOWN_TIMEOUT_S,
    )
    try:
        result: dict[int, Any] = elastic_launch(config, entry)(*args)
        return result
    except SignalException as err:
        # The agent forwarded the signal; the workers checkpoint, say how to resume, and exit.
        raise SystemExit(128 + int(err.sigval)) from None
    except ChildFailedError as err:
        rank, failure = err.get_first_failure()
        code = failure.exitcode if failure.exitcode and failure.exitcode > 0 else 1
        if code != UserError.exit_code:
            print(
                f"error: worker {rank} failed with exit code {failure.exitcode}; see its output above.", file=sys.stderr
            )
        raise SystemExit(code) from None
