"""What each worker process runs: join the job, pick the run folder, train, write the summary."""

from __future__ import annotations

import logging
import os
import signal
import sys
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from kfacflow import registry, rundir
from kfacflow.config import RunConfig, to_yaml
from kfacflow.dist.base import Backend
from kfacflow.errors import UserError
from kfacflow.launch import RANK_VARS

logger = logging.getLogger(__name__)

LOCAL_SIZE_VARS = ("LOCAL_WORLD_SIZE", "HOROVOD_LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE")


def setup_logging(rank: int) -> None:
    """Rank 0 logs at INFO, the others only warnings, each line tagged with its rank."""
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"[%(asctime)s r{rank} %(name)s] %(message)s",
        datefmt="%H:%M:%S",
        force=True,
    )


def worker(config_yaml: str, argv: list[str], announce: bool) -> str | None:
    """Run one worker of the job described by the launcher's environment.

    Args:
        config_yaml: The validated recipe, as YAML.
        argv: The user's command line (recorded in the run folder).
        announce: Print the run folder as the last line on rank 0 (False when a parent does).

    Returns:
        The run folder on rank 0, None elsewhere.

    Raises:
        SystemExit: After one ``error:`` line, with the error's exit code (2 for a bad recipe or data,
            3 when training cannot go on); with 128 + the signal after a SIGTERM/SIGINT stop.
    """
    rank = int(next((os.environ[v] for v in RANK_VARS if v in os.environ), 0))
    setup_logging(rank)
    try:
        return _run(config_yaml, argv, announce, rank)
    except UserError as err:
        if rank == 0:
            print(f"error: {err}", file=sys.stderr, flush=True)
        raise SystemExit(err.exit_code) from None
    except Exception:
        print(f"worker {rank} failed:", file=sys.stderr, flush=True)
        traceback.print_exc()
        sys.stderr.flush()
        raise


@contextmanager
def stop_on_signals(trainer: Any) -> Iterator[None]:
    """While training, SIGTERM and SIGINT ask the trainer to checkpoint and stop after the current step.

    In a process of its own, a second SIGINT interrupts at once (the last checkpoint stays the
    newest). Under a launcher the terminal's SIGINT and the one the launcher forwards arrive
    together, so repeats are ignored there; the launcher kills a worker that takes too long.
    """
    own_process = "TORCHELASTIC_RUN_ID" not in os.environ

    def ask(signum: int, frame: object) -> None:
        if signum == signal.SIGINT and trainer.stop_requested and own_process:
            raise KeyboardInterrupt
        trainer.stop_requested = trainer.stop_requested or signum

    old = {sig: signal.signal(sig, ask) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def _run(config_yaml: str, argv: list[str], announce: bool, rank: int) -> str | None:
    cfg = OmegaConf.merge(OmegaConf.structured(RunConfig), OmegaConf.create(config_yaml))
    assert isinstance(cfg, DictConfig)
    registry.load_all()
    local = int(next((os.environ[v] for v in LOCAL_SIZE_VARS if v in os.environ), 1))
    env_threads = int(os.environ.get("OMP_NUM_THREADS", 0) or 0)  # torchrun and cluster tools set it
    torch.set_num_threads(cfg.launch.threads or env_threads or max(1, (os.cpu_count() or 1) // local))
    backend: Backend = registry.BACKENDS.get(cfg.dist.backend)(cfg.dist)
    try:
        from kfacflow.trainer import Trainer

        run_dir = None
        if backend.rank == 0:
            run_dir = Path(cfg.resume) if cfg.resume else rundir.new_run_dir(cfg.out_dir, cfg.name)
            saved = cfg.copy()
            saved.resume = None
            rundir.write_metadata(run_dir, to_yaml(saved), argv)
        run_dir = Path(backend.broadcast_object(str(run_dir) if run_dir else None))
        trainer = Trainer(cfg, backend, run_dir)
        with stop_on_signals(trainer):
            summary = trainer.fit()
        backend.barrier()
    finally:
        backend.close()
    if backend.rank != 0:
        if trainer.stopped_by:
            raise SystemExit(128 + trainer.stopped_by)
        return None
    rundir.write_summary(run_dir, summary)
    if trainer.stopped_by:
        name = signal.Signals(trainer.stopped_by).name
        print(
            f"stopped by {name} after step {trainer.step}; checkpoint written. Continue with: "
            f"python run.py resume={run_dir}",
            file=sys.stderr,
            flush=True,
        )
        raise SystemExit(128 + trainer.stopped_by)
    logger.info(
        "val_acc %.4f val_loss %.4f after %d steps in %.1f s",
        summary["val_acc"],
        summary["val_loss"],
        summary["steps"],
        summary["seconds"],
    )
    if announce:
        print(run_dir, flush=True)
    return str(run_dir)
