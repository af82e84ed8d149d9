"""Resuming: what a checkpoint must share with the run that continues it, checked before anything is written.

A checkpoint records the recipe values that define its state (:data:`MUST_MATCH`), its world
size and whether K-FAC ran. A resume that changes one of them would load a state that does
not fit (another model) or would silently mean something else (another batch per step makes
the saved position in the epoch point at other samples), so it stops with one line naming the
key. Everything else may change on resume: the length of the run, learning rate, damping, the
K-FAC variant among d, mpd and spd (the same mathematics), threads, logging.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from torch import nn

from kfacflow import UserError
from kfacflow.kfac.variants import resolve
from kfacflow.running import rundir

MUST_MATCH = (
    "model.name",
    "data.name",
    "data.num_classes",
    "data.channels",
    "data.batch_size",
    "data.seq_len",
    "data.text_bytes",
    "train.accumulate",
)


def checkpoint_meta(cfg: DictConfig, world_size: int, preconditioned: bool) -> dict[str, Any]:
    """Return what a checkpoint records about the run that wrote it."""
    meta: dict[str, Any] = {key: OmegaConf.select(cfg, key) for key in MUST_MATCH}
    meta.update(world_size=world_size, preconditioned=preconditioned, variant=cfg.kfac.variant)
    return meta


def check_meta(meta: dict[str, Any] | None, cfg: DictConfig, world_size: int, preconditioned: bool) -> None:
    """Check that a checkpoint's ``meta`` (None for older checkpoints) fits this run.

    Raises:
        UserError: Naming the first key that differs, the saved value and what to do.
    """
    if not meta:
        return
    where = f"resume: {cfg.resume}"
    for key in MUST_MATCH:
        if key in meta and meta[key] != OmegaConf.select(cfg, key):
            raise UserError(
                f"{where} was trained with {key}={meta[key]}, this run asks for {key}={OmegaConf.select(cfg, key)}; "
                f"resume with {key}={meta[key]} (or leave it out), or start a new run."
            )
    if meta.get("world_size", world_size) != world_size:
        raise UserError(
            f"{where} was trained by {meta['world_size']} workers, this run has {world_size}; resume with "
            f"launch.nproc={meta['world_size']} (or the same launcher world size), or start a new run."
        )
    if meta.get("preconditioned", preconditioned) != preconditioned:
        was = f"K-FAC (kfac.variant={meta.get('variant')})" if meta["preconditioned"] else "kfac.variant=sgd"
        now = f"kfac.variant={cfg.kfac.variant}"
        raise UserError(
            f"{where} was trained with {was}, this run asks for {now}; resume with kfac.variant="
            f"{meta.get('variant')} (d, mpd and spd may be swapped: the same mathematics), or start a new run."
        )


def check_model(saved: dict[str, Any], model: nn.Module, cfg: DictConfig) -> None:
    """Check that a checkpoint's model state fits ``model`` (the same names and shapes).

    Raises:
        UserError: Naming ``model.name`` and the first tensor that does not fit.
    """
    own = model.state_dict()
    missing = [k for k in own if k not in saved]
    extra = [k for k in saved if k not in own]
    wrong = [k for k in own if k in saved and tuple(saved[k].shape) != tuple(own[k].shape)]
    if not (missing or extra or wrong):
        return
    if wrong:
        what = f"{wrong[0]} has shape {tuple(saved[wrong[0]].shape)}, here {tuple(own[wrong[0]].shape)}"
    else:
        what = f"{(missing or extra)[0]} is {'missing' if missing else 'unknown here'}"
    raise UserError(
        f"resume: {cfg.resume} holds another model than model.name={cfg.model.name} builds ({what}); resume "
        "with the run's own model.name and data settings, or start a new run."
    )


def check_before_start(cfg: DictConfig, world_size: int) -> None:
    """Check ``resume`` against its newest readable checkpoint before any worker starts.

    Raises:
        UserError: If there is no readable checkpoint, or it does not fit (see :func:`check_meta`).
    """
    state = rundir.load_latest_checkpoint(Path(cfg.resume), quiet=True)
    preconditioned = resolve(cfg.kfac).preconditioned
    check_meta(state.get("meta") or {"world_size": state["world_size"]}, cfg, world_size, preconditioned)
