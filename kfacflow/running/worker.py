"""What each worker process runs: join the job, pick the run folder, train, write the summary."""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from kfacflow import UserError
from kfacflow.comm.launchers import LOCAL_SIZE_VARS, RANK_VARS, from_env
from kfacflow.configuration.recipe import to_yaml
from kfacflow.configuration.schema import RunConfig
from kfacflow.running import build, rundir
from kfacflow.running.launch import command_line, continue_command, note_failure
from kfacflow.running.records import finished_line, target_line
from kfacflow.running.trainer import Trainer
from kfacflow.usercode import UserCodeError

logger = logging.getLogger(__name__)


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
            3 when training cannot go on, 4 when the run folder cannot be written); with 128 + the
            signal after a SIGTERM/SIGINT stop.
    """
    rank = int(next((os.environ[v] for v in RANK_VARS if v in os.environ), 0))
    setup_logging(rank)
    try:
        return _run(config_yaml, argv, announce, rank)
    except UserError as err:
        if rank == 0 or err.local:
            if isinstance(err, UserCodeError):
                err.print_cause()
            print(f"error: {err}", file=sys.stderr, flush=True)
        else:
            # Rank 0 raises the same and says it; ending first, this rank would have the launcher stop rank 0
            # before it could (a model every rank refuses as it is built), and the job would end without a word.
            time.sleep(SECONDARY_DELAY_S)
        note_failure(rank, err.exit_code, secondary=False)
        raise SystemExit(err.exit_code) from None
    except Exception as err:
        if lost_peer(err):
            # Another worker failed first and says why; this one only lost its connection to it. It
            # waits a moment so that the launcher sees the first failure first and reports that one.
            logger.warning("stopping: lost contact with another worker (it failed or was killed)")
            note_failure(rank, 1, secondary=True)
            sys.stdout.flush()
            sys.stderr.flush()
            time.sleep(SECONDARY_DELAY_S)
            os._exit(1)  # a normal exit would let gloo's threads abort the process with a second message
        print(f"worker {rank} failed:", file=sys.stderr, flush=True)
        traceback.print_exc()
        sys.stderr.flush()
        note_failure(rank, 1, secondary=False)
        raise


def lost_peer(err: BaseException) -> bool:
    """Whether ``err`` says that another worker of the job went away (it failed or was killed)."""
    text = str(err)
    return isinstance(err, RuntimeError) and any(cause in text for cause in PEER_GONE)


SECONDARY_DELAY_S = 2.0
"""Seconds a worker that lost contact waits before it exits (launchers poll every 0.1 to 1 s)."""
PEER_GONE = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "remote process exited",
    "communicator was aborted",
)
"""What gloo, NCCL and the TCP store say when the other end of a connection disappeared."""


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
    local = from_env(LOCAL_SIZE_VARS) or 1
    env_threads = int(os.environ.get("OMP_NUM_THREADS", 0) or 0)  # torchrun and cluster tools set it
    torch.set_num_threads(cfg.launch.threads or env_threads or max(1, (os.cpu_count() or 1) // local))
    command = command_line(argv)
    backend = build.backend(cfg.dist)
    try:
        saved = cfg.copy()
        saved.resume = None
        run_dir = None
        if backend.rank == 0:
            run_dir = Path(cfg.resume) if cfg.resume else rundir.new_run_dir(cfg.out_dir, cfg.name)
            if not cfg.resume:
                rundir.write_metadata(run_dir, to_yaml(saved), command)
        run_dir = Path(backend.broadcast_object(str(run_dir) if run_dir else None))
        trainer = Trainer.from_recipe(cfg, backend, run_dir)  # checks a resume before its folder is touched
        if trainer.nothing_to_do:  # its budget done, or its target reached: nothing is written
            return _already_finished(trainer, run_dir, argv, announce)
        if cfg.resume and backend.rank == 0:
            rundir.write_metadata(run_dir, to_yaml(saved), command, resumed=True)
        if backend.rank == 0 and trainer.info.identity is not None:
            rundir.write_data(run_dir, trainer.info.identity)
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
        if not cfg.train.save:
            print(f"stopped by {name} after step {trainer.step}; no checkpoint (train.save=false).", file=sys.stderr)
        elif trainer.finished:
            print(
                f"stopped by {name} after step {trainer.step}, the last; checkpoint written. Its final evaluation "
                f"did not run: {continue_command(run_dir, argv)} runs it.",
                file=sys.stderr,
                flush=True,
            )
        else:
            print(
                f"stopped by {name} after step {trainer.step}; checkpoint written. Continue with: "
                f"{continue_command(run_dir, argv)}",
                file=sys.stderr,
                flush=True,
            )
        raise SystemExit(128 + trainer.stopped_by)
    if (line := target_line(summary, trainer.total)) is not None:
        logger.info(line)
    logger.info(
        "val_acc %.4f val_loss %.4f%s after %d steps in %.1f s",
        summary["val_acc"],
        summary["val_loss"],
        f" val_ppl {summary['val_ppl']:.3f}" if "val_ppl" in summary else "",
        summary["steps"],
        summary["seconds"],
    )
    if announce:
        print(run_dir, flush=True)
    return str(run_dir)


def _already_finished(trainer: Any, run_dir: Path, argv: list[str], announce: bool) -> str | None:
    """Say that a resumed run has nothing left to do; its folder stays as it is."""
    if trainer.rank != 0:
        return None
    print(finished_line(trainer, run_dir, continue_command(run_dir, argv)), file=sys.stderr, flush=True)
    if announce:
        print(run_dir, flush=True)
    return str(run_dir)
