"""A run's checkpoint: everything a resumed run needs, and how every rank writes it together.

A resumed run must go on as if it had never stopped: besides the model, optimizer, schedule,
K-FAC and RNG states, the checkpoint carries the run's records (:class:`kfacflow.running.records.RunRecords`)
and what the run log adds up between two rows (:meth:`kfacflow.running.runlog.RunLog.state_dict`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import torch
from omegaconf import DictConfig
from torch import nn

from kfacflow import StorageError
from kfacflow.comm.base import Backend
from kfacflow.running import rundir
from kfacflow.running.resume import checkpoint_meta
from kfacflow.running.seeding import rng_state, set_rng_state


class Trainer(Protocol):
    """What a checkpoint is made of: the trainer's state (:class:`.trainer.Trainer`, which imports this)."""

    step: int
    world: int
    rank: int
    cfg: DictConfig
    run_dir: Path
    backend: Backend
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    stages: Any
    kfac: Any
    ema: Any
    precision: Any
    records: Any
    report: Any


def state_of(trainer: Trainer) -> dict[str, Any]:
    """Return everything a resumed run needs (collective: every rank must call it)."""
    return {
        "step": trainer.step,
        "world_size": trainer.world,
        "meta": checkpoint_meta(trainer.cfg, trainer.world, trainer.stages.preconditioned),
        "model": trainer.model.state_dict(),
        "optimizer": trainer.optimizer.state_dict(),
        "scheduler": trainer.scheduler.state_dict(),
        "kfac": trainer.kfac.state_dict() if trainer.kfac else None,
        "ema": trainer.ema.state_dict() if trainer.ema is not None else None,
        "loss_scale": trainer.precision.state_dict(),
        **trainer.records.state_dict(),
        "log": trainer.report.state_dict(),
        "rng": trainer.backend.gather_objects(rng_state()),
    }


def restore(trainer: Trainer, state: dict[str, Any]) -> None:
    """Restore a checkpoint written by :func:`state_of` (checked by :func:`kfacflow.running.build.training`)."""
    trainer.model.load_state_dict(state["model"])
    trainer.optimizer.load_state_dict(state["optimizer"])
    trainer.scheduler.load_state_dict(state["scheduler"])
    if trainer.kfac and state["kfac"]:
        trainer.kfac.load_state_dict(state["kfac"])
    if trainer.ema is not None and state.get("ema") is not None:
        trainer.ema.load_state_dict(state["ema"])  # a run resumed with train.ema newly on starts it afresh
    trainer.precision.load_state_dict(state.get("loss_scale"))
    trainer.step = int(state["step"])
    trainer.records.load_state_dict(state)
    trainer.report.load_state_dict(state.get("log"))
    set_rng_state(state["rng"][trainer.rank])


def save(trainer: Trainer) -> None:
    """Write a checkpoint of ``trainer`` (collective: rank 0 writes, every rank learns the outcome).

    Raises:
        StorageError: On every rank, if rank 0 could not write it (the previous ones stay).
    """
    state = state_of(trainer)
    error: StorageError | None = None
    if trainer.rank == 0:
        try:
            rundir.save_checkpoint(trainer.run_dir, trainer.step, state, trainer.cfg.train.keep_checkpoints)
            trainer.report.flush()  # a resume from here keeps the rows up to here: each is in timings.jsonl
        except StorageError as err:
            error = err
    # Slow storage is no failure: the others wait outside the collectives' timeout (dist.timeout_s).
    trainer.backend.await_rank0()
    failed = trainer.backend.allreduce_sum(torch.tensor([float(error is not None)]))
    if failed[0] > 0:
        raise error or StorageError("rank 0 could not write the checkpoint")
