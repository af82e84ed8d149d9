"""K-FAC for your own model, data, optimizer and loop: :class:`KFACPreconditioner` (``kfacflow.KFACPreconditioner``).

The recipe runner builds the same preconditioner (:class:`kfacflow.kfac.preconditioner.Preconditioner`)
from a recipe; here it is built from keyword arguments named as the recipe's ``kfac.*`` keys and
validated by the same schema, under a process group the user started (``torchrun`` and
``torch.distributed.init_process_group``, or ``hvd.init()``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from kfacflow import UserError, library_muon, registry
from kfacflow.comm.base import Backend
from kfacflow.configuration.rules import kfac_section
from kfacflow.configuration.schema import DistConfig
from kfacflow.kfac import in_use
from kfacflow.kfac.gradients import GradientAllreduce
from kfacflow.kfac.strategies.contracts import AFTER_BACKWARD
from kfacflow.kfac.variants import Stages, resolve
from kfacflow.perf import Profile
from kfacflow.running import build
from kfacflow.simulation.calibration import calibrate

logger = logging.getLogger(__name__)

FloatOrSchedule = float | Callable[[int], float]
"""A value, or a function of the step (0, 1, ...) giving it, as in kfac-pytorch."""
IntOrSchedule = int | Callable[[int], int]

WHERE = "KFACPreconditioner"
T = TypeVar("T", int, float)


def _at(value: T | Callable[[int], T], step: int) -> T:
    return value(step) if callable(value) else value


def _checked(name: str, value: object, step: int, integer: bool = False) -> float:
    """``value`` if it is a finite number above zero (a whole one where ``integer``); else a UserError naming ``name``.

    Every value a schedule gives is checked, not only the first: a damping that later becomes
    zero or NaN would train on through NaN parameters, a learning rate that does would turn KL
    clipping off.
    """
    if isinstance(value, int | float) and not isinstance(value, bool):
        number = float(value)
        if math.isfinite(number) and number > 0 and (number.is_integer() or not integer):
            return number
    kind = "a whole number >= 1" if integer else "a finite number > 0"
    raise UserError(f"{WHERE}: {name} at step {step} is {value!r}; it must be {kind}.")


def _unwrapped(model: object) -> tuple[nn.Module, bool]:
    """The network inside ``model``, and whether DDP wraps it; a UserError where there is nothing to precondition."""
    wrapped = isinstance(model, nn.parallel.DistributedDataParallel)
    inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    if not isinstance(inner, nn.Module):
        raise UserError(
            f"{WHERE}: model is {type(model).__name__!r}, not a torch.nn.Module; give the network, plain or "
            "wrapped in DistributedDataParallel."
        )
    params = list(inner.parameters())
    if not any(p.requires_grad for p in params):
        what = "every parameter is frozen (requires_grad=False)" if params else "it has no parameters"
        raise UserError(f"{WHERE}: the model has nothing to train or precondition: {what}.")
    return inner, wrapped


class KFACPreconditioner:
    """Preconditions a model's gradients with K-FAC inside your own training loop.

    Call :meth:`step` after ``loss.backward()`` and before ``optimizer.step()``. Factors are
    captured by hooks (the end of the forward pass too: no extra call), averaged over the
    ranks of the job you started, inverted where the variant places them, and every Linear and
    Conv2d gradient is replaced by its preconditioned one.

    Distributed training: start the job first (``torch.distributed.init_process_group``, or
    ``hvd.init()`` with ``backend="horovod"``); the preconditioner joins it and opens its own
    process group for K-FAC's traffic. With a model wrapped in ``DistributedDataParallel`` the
    gradients are DDP's averages; with Horovod, call ``optimizer.synchronize()`` before
    :meth:`step` and step the optimizer under ``optimizer.skip_synchronize()``; with a plain
    model on several ranks the preconditioner averages the gradients itself, inside :meth:`step`
    (behind the factors, where it costs least), and starts every rank from rank 0's parameters:
    code that reads or changes the gradients before :meth:`step` (``clip_grad_norm_``, a norm to
    log) calls :meth:`average_gradients` first, which does nothing where DDP or Horovod has
    averaged them, so one loop gives the same result either way::

        loss.backward()
        precond.average_gradients()  # only where your code touches the gradients before step()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        precond.step()
        optimizer.step()

    Sparse gradients (``nn.Embedding(sparse=True)``, not preconditioned) are averaged as sparse
    ones. Without DDP (a plain model, or Horovod) :meth:`step` also gives every rank rank 0's
    buffers (BatchNorm's running statistics), as DDP does, so every rank evaluates and saves the
    same model.

    Args:
        model: The network, plain or wrapped in ``DistributedDataParallel``.
        variant: A preset (``spd``, ``mpd``, ``d``, ``flow``; ``python run.py --list variant``).
        lr: The learning rate the optimizer uses (KL clipping needs it), or a function of the
            step; :meth:`step` may also be given it.
        damping: Tikhonov damping, or a function of the step.
        factor_update_freq: Steps between factor updates, or a function of the step.
        inv_update_freq: Steps between inversions (a multiple of ``factor_update_freq``), or a
            function of the step.
        accumulate: Backward passes (micro-batches) per step, each loss divided by it.
        backend: ``torch`` (torch.distributed) or ``horovod``.
        device: ``auto``, ``cpu`` or ``cuda`` (where K-FAC's work and the model are).
        profile: Performance models for the placements and fusions that plan with them (a
            ``profile.yaml`` path or a :class:`~kfacflow.perf.Profile`); measured now if they
            need one and none is given.
        grad_scaler: The ``torch.amp.GradScaler`` of a float16 mixed-precision loop: G factors
            are then taken from the unscaled output gradients. Call ``scaler.unscale_(optimizer)``
            before :meth:`step`, then ``scaler.step(optimizer)`` and ``scaler.update()``. Under
            float16 autocast without one, a warning says so once (a scaled loss would give G
            factors ``scale^2`` too large).
        batch_dim: The dimension of the model's first tensor input that counts the examples of
            the batch (G undoes the batch-mean loss's ``1/N``); 1 for a model that takes
            ``(S, N, ...)`` inputs (``batch_first=False``).
        **kfac: Any other ``kfac.*`` recipe key: ``fusion``, ``placement``, ``inverse``,
            ``pipeline``, ``broadcast``, ``grad_sync``, ``factor_sync``, ``factor_exchange``, ``factor``,
            ``factor_decay``, ``factor_examples``, ``kl_clip``, ``inverse_schedule``, ``skip`` (fnmatch patterns of
            module names), ``profile_steps`` ...

    Raises:
        UserError: A bad argument (named, with the accepted values); a model with no trainable
            parameter, no layer to precondition, or parameters on another device than ``device``.
    """

    def __init__(
        self,
        model: nn.Module,
        variant: str = "spd",
        *,
        lr: FloatOrSchedule | None = None,
        damping: FloatOrSchedule = 0.001,
        factor_update_freq: IntOrSchedule = 1,
        inv_update_freq: IntOrSchedule = 1,
        accumulate: int = 1,
        backend: str = "torch",
        device: str = "auto",
        profile: str | Path | Profile | None = None,
        grad_scaler: torch.amp.GradScaler | None = None,
        batch_dim: int = 0,
        **kfac: Any,
    ) -> None:
        if "profile" in kfac or "variant" in kfac:
            raise UserError(f"{WHERE}: give variant and profile as the arguments of those names.")
        inner, wrapped = _unwrapped(model)
        if isinstance(kfac.get("skip"), str):
            kfac["skip"] = [kfac["skip"]]
        elif isinstance(kfac.get("skip"), tuple):
            kfac["skip"] = list(kfac["skip"])
        self.lr, self.damping = lr, damping
        self.factor_update_freq, self.inv_update_freq = factor_update_freq, inv_update_freq
        cfg = kfac_section(
            {
                **kfac,
                "variant": variant,
                "damping": _checked("damping", _at(damping, 0), 0),
                "factor_update_freq": int(_checked("factor_update_freq", _at(factor_update_freq, 0), 0, integer=True)),
                "inv_update_freq": int(_checked("inv_update_freq", _at(inv_update_freq, 0), 0, integer=True)),
            },
            WHERE,
        )
        build.load_plugins()
        in_use.check(cfg, where=f"{WHERE}: ", prefix="", intervals=False)  # intervals may be schedules of the step
        if not isinstance(batch_dim, int) or isinstance(batch_dim, bool) or batch_dim < 0:
            raise UserError(f"{WHERE}: batch_dim={batch_dim!r} must be an integer >= 0 (the inputs' batch dimension).")
        if not isinstance(accumulate, int) or isinstance(accumulate, bool) or accumulate < 1:
            raise UserError(f"{WHERE}: accumulate={accumulate!r} must be an integer >= 1 (backward passes per step).")
        if lr is not None and not callable(lr):
            _checked("lr", lr, 0)
        self._check_engine(backend, device, grad_scaler)
        names = resolve(cfg)
        if names.choose or not names.preconditioned:
            raise UserError(
                f"{WHERE}: variant={variant!r} is for recipes (run.py); give d, mpd, spd or flow "
                "(`python run.py --list variant`)."
            )
        self.backend: Backend = registry.BACKENDS.get(backend)(DistConfig(backend=backend, device=device))  # type: ignore[arg-type]
        self.model: nn.Module = inner
        self._check_device(device)
        # Who averages the gradients: DDP or Horovod's optimizer (the user's), else this object.
        self.averages = self.backend.world_size > 1 and not wrapped and backend == "torch"
        self.syncs_buffers = self.backend.world_size > 1 and not wrapped
        """Whether :meth:`step` gives every rank rank 0's buffers (nothing else does: no DDP)."""
        self._averaged: list[RemovableHandle] | None = None
        """Set once :meth:`average_gradients` averaged the gradients: hooks that forget it at a backward pass."""
        names = self._grad_sync(cfg, names, wrapped, backend)
        cfg.grad_sync = names.grad_sync
        build.check_device(names, self.backend.device)  # before any calibration
        if self.averages:  # what DDP does when it wraps a model
            self.backend.broadcast_state([*self.model.parameters(), *self.model.buffers()])
        dtype = next(self.model.parameters()).dtype
        planning = self._profile(profile, names, dtype) if build.needs_profile(names) else None
        self.core = build.preconditioner(
            self.model, cfg, self.backend, planning, accumulate=accumulate, batch_dim=batch_dim
        )
        self.core.grad_scaler = grad_scaler
        self.cfg = cfg
        self._names = names
        self._muon: tuple[library_muon.Muon, float] | None = None
        """:meth:`finish_muon`'s optimizer and norm bound."""

    def _grad_sync(self, cfg: Any, names: Stages, wrapped: bool, backend: str) -> Stages:
        # A grad sync that needs the gradients averaged after backward averages them itself.
        deferred = AFTER_BACKWARD in registry.GRAD_SYNCS.get(names.grad_sync).needs
        if self.averages and not deferred:
            logger.info("the model is not wrapped in DDP: kfacflow averages its gradients after the backward pass")
            return replace(names, grad_sync="deferred")
        if deferred and not self.averages:
            who = "DDP" if wrapped else "Horovod's optimizer"
            if cfg.grad_sync and self.backend.world_size > 1:  # asked for by name, not by the preset
                raise UserError(
                    f"{WHERE}: grad_sync='{names.grad_sync}' averages gradients itself, but here {who} does; "
                    "pass the model unwrapped (torch backend), or grad_sync='overlap'."
                )
            return replace(names, grad_sync="overlap")
        return names

    @staticmethod
    def _check_engine(backend: object, device: object, grad_scaler: object) -> None:
        if not isinstance(backend, str):
            raise UserError(f"{WHERE}: backend={backend!r}; give 'torch' or 'horovod'.")
        if device not in ("auto", "cpu", "cuda"):
            raise UserError(f"{WHERE}: device={device!r}; give 'auto', 'cpu' or 'cuda'.")
        if device == "cuda" and not torch.cuda.is_available():
            raise UserError(f"{WHERE}: device='cuda', but torch sees no CUDA device; give device='cpu' or 'auto'.")
        if grad_scaler is not None and not isinstance(grad_scaler, torch.amp.GradScaler):
            raise UserError(f"{WHERE}: grad_scaler is {type(grad_scaler).__name__!r}, not a torch.amp.GradScaler.")

    def _check_device(self, device: str) -> None:
        """The model's parameters are where K-FAC works (its factors and inverses live there)."""
        found = sorted({str(p.device) for p in self.model.parameters()})
        if found != [str(self.backend.device)]:
            self._close()
            raise UserError(
                f"{WHERE}: the model's parameters are on {' and '.join(found)}, but with device={device!r} K-FAC "
                f"works on {self.backend.device}; move the model there first (model.to(...)), or choose the device."
            )

    def _profile(self, profile: str | Path | Profile | None, names: Stages, dtype: torch.dtype) -> Profile:
        if isinstance(profile, Profile):
            return profile
        if profile is not None:
            loaded: Profile = Profile.load(str(profile))
            return loaded
        logger.info(
            "measuring the communication and inversion models (%s, %s plan with them)", names.fusion, names.placement
        )
        inverse = registry.INVERSES.get(names.inverse)
        return calibrate(self.backend, inverse, dtype, methods={names.inverse: inverse})

    @property
    def steps(self) -> int:
        """Steps taken so far."""
        return self.core.steps

    def mean_clip_scale(self) -> float | None:
        """The mean factor KL clipping scaled the updates by since the last call (1: never clipped; None: no clipping).

        Near 0 for long stretches means ``kl_clip``, not the learning rate, sets the step size: a
        schedule's decay then changes nothing until ``lr`` falls below the clip (reads the device).
        """
        return self.core.mean_clip_scale()

    def step(self, lr: float | None = None) -> None:
        """Precondition the gradients of this step in place (factors and inverses updated when due).

        Args:
            lr: The learning rate of this step (default: the one given at construction).

        Raises:
            UserError: No learning rate while KL clipping is on (no default is guessed: KL clipping
                bounds ``lr^2 v.g``, so a wrong one clips silently wrong), or a learning rate,
                damping or interval (given, or a schedule's value at this step) that is not a
                finite number above zero.
        """
        step = self.core.steps
        lr = lr if lr is not None else (_at(self.lr, step) if self.lr is not None else None)
        if lr is None:
            if self.cfg.kl_clip > 0 and self.cfg.normalize == "none":
                raise UserError(f"{WHERE}: KL clipping needs the learning rate: step(lr=...), lr=... or kl_clip=0.")
            lr = 1.0
        lr = _checked("lr", lr, step)
        self.core.schedule.damping = _checked("damping", _at(self.damping, step), step)
        self._intervals(step)
        params = list(self.model.parameters())
        gradients = None if self._averaged is not None else self.core.stages.grad_sync.gradients(self.backend, params)
        self._forget_averaged()
        self.core.step(lr, gradients)
        if self._muon is not None and self.core.updates.owned is None:  # one process: no owner clips
            library_muon.clip(self.model, self._muon[1])
        if self.syncs_buffers:
            self.backend.sync_buffers(self.model)
        self._intervals(step + 1)  # whether the next forward pass captures factors

    def finish_muon(self, optimizer: torch.optim.Optimizer, clip_grad_norm: float = 0.0) -> None:
        """Let each layer's owner run ``optimizer``'s Muon step of that layer (:func:`kfacflow.library_muon.finish`).

        ``optimizer``: :func:`kfacflow.muon`'s over this model. ``clip_grad_norm``: the applied gradients'
        norm bound (0: off), clipped inside :meth:`step`. Call once, on every rank; ``optimizer.state_dict()``
        is then collective, and :meth:`remove` gives every rank every momentum back.
        """
        library_muon.finish(self.core, self.model, optimizer, clip_grad_norm, self._names)
        assert isinstance(optimizer, library_muon.Muon)  # finish refuses any other
        self._muon = (optimizer, float(clip_grad_norm))

    def average_gradients(self) -> None:
        """Average this step's gradients over the ranks now, for code that reads or changes them before :meth:`step`.

        Where the preconditioner averages them (a plain model on several ranks), :meth:`step` would,
        behind the factors; called first, clipping and norms see the averages, as under DDP, and
        :meth:`step` does not average again, unless a backward pass (another micro-batch) added
        this rank's own gradients since. Where DDP, Horovod's ``optimizer.synchronize()`` or a single
        process leaves them averaged, it does nothing. Collective: every rank calls it alike.
        """
        if not self.averages or self._averaged is not None:
            return
        params = [p for p in self.model.parameters() if p.requires_grad]
        GradientAllreduce(self.backend, params).wait()
        # A backward pass before step() (another micro-batch, a step the loop skipped) adds this rank's own again.
        self._averaged = [p.register_post_accumulate_grad_hook(self._forget_averaged) for p in params]

    def _forget_averaged(self, *_: Any) -> None:
        for hook in self._averaged or []:
            hook.remove()
        self._averaged = None

    def _intervals(self, step: int) -> None:
        factor = int(_checked("factor_update_freq", _at(self.factor_update_freq, step), step, integer=True))
        inverse = int(_checked("inv_update_freq", _at(self.inv_update_freq, step), step, integer=True))
        if inverse % factor:
            raise UserError(
                f"{WHERE}: at step {step}, inv_update_freq={inverse} must be a multiple of "
                f"factor_update_freq={factor}, both >= 1."
            )
        self.core.set_intervals(factor, inverse)

    def state_dict(self) -> dict[str, Any]:
        """Factors, inverses and the step counter (collective: call it on every rank)."""
        return self.core.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict`'s output (the intervals' schedules at its step decide what comes next)."""
        self.core.load_state_dict(state)
        self._intervals(self.core.steps)

    def remove(self) -> None:
        """Take the hooks off the model and close K-FAC's process groups (the job's own group stays).

        A Muon given to :meth:`finish_muon` gets every momentum back on every rank (collective) and steps alone.
        """
        if self._muon is not None:
            library_muon.release(self.core, self._muon[0])
            self._muon = None
        self.core.remove()
        self._forget_averaged()
        self._close()

    def _close(self) -> None:
        if dist.is_available() and dist.is_initialized() and getattr(self.backend, "joined", False):
            self.backend.close()
