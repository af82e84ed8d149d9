"""Where launchers (torchrun, horovodrun, mpirun, srun) put a process's rank, local rank and the job's size."""

from __future__ import annotations

import os

MPI_RANK_VARS = ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK")
"""Where horovodrun and MPI launchers put a process's rank."""
RANK_VARS = ("RANK", *MPI_RANK_VARS)
"""Where any supported launcher (torchrun first) puts a process's rank."""
LOCAL_RANK_VARS = (
    "LOCAL_RANK",  # torchrun
    "SLURM_LOCALID",  # srun
    "HOROVOD_LOCAL_RANK",
    "OMPI_COMM_WORLD_LOCAL_RANK",  # Open MPI
    "MV2_COMM_WORLD_LOCAL_RANK",  # MVAPICH2
    "MPI_LOCALRANKID",  # MPICH and Intel MPI (Hydra)
    "PMI_LOCAL_RANK",  # Cray PALS
)
"""Where launchers put a process's index among the processes of its machine (which GPU is its own)."""
LOCAL_SIZE_VARS = (
    "LOCAL_WORLD_SIZE",
    "HOROVOD_LOCAL_SIZE",
    "OMPI_COMM_WORLD_LOCAL_SIZE",
    "MV2_COMM_WORLD_LOCAL_SIZE",
    "MPI_LOCALNRANKS",
    "PMI_LOCAL_SIZE",
)
"""Where launchers put the number of processes on this machine."""


def from_env(names: tuple[str, ...]) -> int | None:
    """Return the first of the variables ``names`` set to a number, or None."""
    return next((int(os.environ[v]) for v in names if os.environ.get(v, "").strip().isdigit()), None)


def under_mpi_launcher() -> bool:
    """Return whether horovodrun or an MPI launcher started this process."""
    return any(var in os.environ for var in MPI_RANK_VARS)


def launched_world_size() -> int:
    """Return the job's world size as the launcher set it (torchrun, horovodrun, mpirun)."""
    for var in ("WORLD_SIZE", "HOROVOD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 1


def under_launcher() -> bool:
    """Return whether an external launcher (torchrun, horovodrun, mpirun) started this process."""
    return ("RANK" in os.environ and "WORLD_SIZE" in os.environ) or under_mpi_launcher()
