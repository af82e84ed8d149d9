"""Muon in your own loop (``kfacflow.muon``), and its per-layer work on the K-FAC layers' owners.

:func:`muon` builds the optimizer a recipe's ``optim.name=muon`` builds (every matrix and flattened
filter orthogonalised, AdamW for biases, norms, embeddings and the head), from keyword arguments named
as the recipe's ``optim.*`` and ``optim.muon.*`` keys and checked by the same schema. Stepped as it
is, every rank runs every matrix's Newton-Schulz, as ``torch.optim.Muon`` does. Given to
:meth:`kfacflow.library.KFACPreconditioner.finish_muon` (:func:`finish`), each K-FAC layer's owner runs
that layer's momentum and Newton-Schulz and sends the finished direction in place of the preconditioned
update, as ``optim.muon.owners=kfac`` does in a recipe (:mod:`kfacflow.on_owners.muon_step`).
"""

from __future__ import annotations

import math
from dataclasses import fields
from typing import TYPE_CHECKING, Any

import torch
from omegaconf import OmegaConf
from torch import nn

from kfacflow import UserError, did_you_mean
from kfacflow.configuration.errors import merge
from kfacflow.configuration.rules import check_ranges
from kfacflow.configuration.schema import MuonConfig, OptimConfig
from kfacflow.on_owners import muon_step
from kfacflow.optim.muon import Muon
from kfacflow.optim.optimizers import muon_adamw

if TYPE_CHECKING:
    from kfacflow.kfac.preconditioner import Preconditioner
    from kfacflow.kfac.variants import Stages
    from kfacflow.on_owners.muon_step import OwnedMuon

WHERE = "kfacflow.muon"
OPTIM_KEYS = ("weight_decay", "betas", "eps")
"""The ``optim.*`` keys Muon reads besides its rate (its own are ``optim.muon.*``)."""
MUON_KEYS = tuple(f.name for f in fields(MuonConfig) if f.name != "owners")
ELSEWHERE = {
    "owners": "the K-FAC layers' owners take Muon's step by precond.finish_muon(optimizer)",
    "clip_grad_norm": "give it to precond.finish_muon(optimizer, clip_grad_norm=...), or clip after precond.step()",
}


def muon(model: nn.Module, lr: float = 0.02, **keys: Any) -> Muon:
    """Muon for ``model``'s matrices and filters, AdamW for the rest: the recipes' ``optim.name=muon``.

    Args:
        model: The network, plain or wrapped in ``DistributedDataParallel``.
        lr: Muon's rate (``optim.lr``); AdamW's is ``adamw_lr``. A learning-rate scheduler scales both.
        **keys: ``weight_decay``, ``betas``, ``eps`` (``optim.*``) and ``momentum``, ``nesterov``, ``ns_steps``,
            ``ns_dtype``, ``adjust_lr``, ``head``, ``adamw_lr`` (``optim.muon.*``; defaults as there).

    Raises:
        UserError: An unknown keyword or a value out of range, naming it; a model with nothing to train.
    """
    inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    if not isinstance(inner, nn.Module) or not any(p.requires_grad for p in inner.parameters()):
        raise UserError(f"{WHERE}: give a torch.nn.Module with parameters to train, not {type(model).__name__!r}.")
    known = (*OPTIM_KEYS, *MUON_KEYS)
    for key in keys:
        if key in ELSEWHERE:
            raise UserError(f"{WHERE}: {key} is not a keyword here: {ELSEWHERE[key]}.")
        if key not in known:
            hint = did_you_mean(key, known)
            raise UserError(f"{WHERE}: unknown keyword {key!r}; it takes lr, {', '.join(known)}.{hint}")
    own = merge(OmegaConf.structured(MuonConfig), {k: v for k, v in keys.items() if k in MUON_KEYS}, WHERE)
    values = {"name": "muon", "lr": lr, **{k: v for k, v in keys.items() if k in OPTIM_KEYS}}
    node = merge(OmegaConf.structured(OptimConfig), values, WHERE)
    try:
        check_ranges(own, MuonConfig)
        node.muon = own
        check_ranges(node, OptimConfig)
    except UserError as err:
        raise UserError(f"{WHERE}: {err}") from None
    cfg = OmegaConf.to_object(node)
    assert isinstance(cfg, OptimConfig)
    optimizer = muon_adamw(inner, cfg)
    assert isinstance(optimizer, Muon)
    return optimizer


def finish(
    kfac: Preconditioner, model: nn.Module, optimizer: object, clip_grad_norm: float, names: Stages
) -> OwnedMuon | None:
    """Let ``kfac``'s layer owners finish ``optimizer``'s Muon step of their layers; None on one process.

    The owner that preconditions a layer advances its momentum and runs its Newton-Schulz inside the
    update broadcast, and every rank's step leaves the finished direction where the gradient was, which
    ``optimizer.step()`` applies: each Newton-Schulz once, on one rank, the model the replicated K-FAC +
    Muon's (to round-off). ``clip_grad_norm`` is then applied inside the step (no rank holds every update
    to clip after it). Each momentum lives on its owner: ``optimizer.state_dict()`` gathers them
    (collective); :func:`release` gives them back to every rank.
    ``names``: the preconditioner's stages (whether its owners send updates: :func:`muon_step.sends_updates`).

    Raises:
        UserError: ``optimizer`` is not :func:`muon`'s over ``model``; a bad ``clip_grad_norm``; the
            preconditioner's owners send no updates; a second call.
    """
    where = "KFACPreconditioner.finish_muon"
    if not isinstance(optimizer, Muon):
        raise UserError(
            f"{where}: optimizer is {type(optimizer).__name__!r}; give kfacflow.muon(model, ...)'s, whose matrices' "
            "step the layers' owners can take (torch.optim.Muon's cannot)."
        )
    ours = {id(p) for p in model.parameters()}
    if any(id(p) not in ours for g in optimizer.param_groups for p in g["params"]):
        raise UserError(f"{where}: the optimizer steps parameters that are not this preconditioner's model's.")
    number = isinstance(clip_grad_norm, int | float) and not isinstance(clip_grad_norm, bool)
    if not (number and math.isfinite(clip_grad_norm) and clip_grad_norm >= 0):
        raise UserError(f"{where}: clip_grad_norm={clip_grad_norm!r}; give a finite number >= 0 (0 is off).")
    if not muon_step.sends_updates(names):
        raise UserError(
            f"{where}: the layers' owners finish Muon's step only where they send the updates (variant='flow', "
            f"or broadcast={' or '.join(repr(b) for b in muon_step.UPDATES)}); this one's broadcast is "
            f"{names.broadcast!r}. Use variant='flow', or step the optimizer as it is (every rank then does "
            "every matrix)."
        )
    if kfac.updates.owned is not None or optimizer.owners != "replicated":
        raise UserError(f"{where}: called twice; one optimizer's step is finished once.")
    optimizer.shard(kfac.backend, "kfac")
    return muon_step.attach(kfac, optimizer, model, float(clip_grad_norm))


def release(kfac: Preconditioner, optimizer: Muon) -> None:
    """Take Muon's step back from ``kfac``'s owners: every rank holds every momentum again (collective)."""
    kfac.updates.owned = None
    optimizer.unshard()


def clip(model: nn.Module, bound: float) -> None:
    """The norm clip of one process, where no owner takes it (the applied gradients' norm at most ``bound``)."""
    if bound > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), bound)
