"""First-order optimizers and learning-rate schedules, registered by name.

An optimizer's factory takes the model (an optimizer that treats parameters by kind, as Muon
does, needs to know which is which) and the ``optim`` section; a user's ``module.path:factory``
is called the same way.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from kfacflow import UserError
from kfacflow.comm.base import Backend
from kfacflow.configuration.schema import OptimConfig, ScheduleConfig
from kfacflow.optim import muon, owner_choice
from kfacflow.registry import OPTIMIZERS, SCHEDULES
from kfacflow.timing import StepTimer
from kfacflow.usercode import call_factory

Multiplier = Callable[[int], float]


@OPTIMIZERS.register("sgd", "SGD with momentum, optional Nesterov and weight decay")
def sgd(model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    """Return ``torch.optim.SGD`` configured from ``cfg``."""
    return torch.optim.SGD(
        model.parameters(), lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov, weight_decay=cfg.weight_decay
    )


@OPTIMIZERS.register("adamw", "AdamW (decoupled weight decay; optim.betas, optim.eps), fed the preconditioned gradient")
def adamw(model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    """Return ``torch.optim.AdamW`` configured from ``cfg`` (``momentum`` and ``nesterov`` do not apply)."""
    beta1, beta2 = cfg.betas
    return torch.optim.AdamW(
        model.parameters(), lr=cfg.lr, betas=(beta1, beta2), eps=cfg.eps, weight_decay=cfg.weight_decay
    )


@OPTIMIZERS.register(
    "muon", "Muon for matrices and filters (optim.muon.*), AdamW for biases, norms, embeddings and the head"
)
def muon_adamw(model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    """Return :class:`kfacflow.optim.muon.Muon` configured from ``cfg`` (``optim.lr`` Muon's rate; ``optim.muon``)."""
    m = cfg.muon
    matrices, rest = muon.split(model, m.head)
    return muon.Muon(
        muon.groups(
            matrices,
            rest,
            cfg.lr,
            m.momentum,
            m.nesterov,
            cfg.weight_decay,
            m.adjust_lr,
            m.ns_steps,
            m.ns_dtype,
            m.adamw_lr,
            cfg.betas,
            cfg.eps,
            cfg.weight_decay,
        )  # fmt: skip
    )


def for_workers(
    model: nn.Module,
    cfg: OptimConfig,
    backend: Backend,
    accumulate: int,
    timer: StepTimer | None = None,
    kfac_sends_updates: bool = False,
) -> torch.optim.Optimizer:
    """:func:`build_optimizer`, wrapped for the engine, and Muon's matrices given their owners (``optim.muon.owners``).

    The owners are set on the engine's optimizer: Horovod's wrapper is a new instance of Muon's class.
    Muon's Newton-Schulz and gather are parts of the step's breakdown in ``timer``. ``kfac_sends_updates``:
    whether K-FAC's layer owners send the updates (``owners=kfac`` is then possible, and ``auto``'s choice).
    """
    optimizer = backend.wrap_optimizer(build_optimizer(model, cfg), model, accumulate)
    if isinstance(optimizer, muon.Muon):
        how = owner_choice.resolve(optimizer, backend, cfg.muon.owners, kfac_sends_updates)
        optimizer.shard(backend, how)
        optimizer.timer = timer
    return optimizer


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    """Return the optimizer ``cfg.name`` over ``model``'s trained parameters (a user's factory: checked).

    Raises:
        UserError: If a user's ``module.path:factory`` does not return a ``torch.optim.Optimizer``.
    """
    factory = OPTIMIZERS.get(cfg.name)
    if ":" not in cfg.name:
        built: torch.optim.Optimizer = factory(model, cfg)
        return built
    optimizer = call_factory("optim.name", cfg.name, factory, "factory(model, cfg)", model, cfg)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise UserError(
            f"optim.name={cfg.name}: the factory returned {type(optimizer).__name__}, not a torch.optim.Optimizer."
        )
    return optimizer


@SCHEDULES.register("constant", "the base rate throughout (after any warm-up)")
def constant(cfg: ScheduleConfig, steps_per_epoch: int, total: int) -> Multiplier:
    """Return a multiplier that is always 1."""
    return lambda step: 1.0


@SCHEDULES.register("warmup", "linear warm-up over schedule.warmup_epochs, then constant")
def warmup(cfg: ScheduleConfig, steps_per_epoch: int, total: int) -> Multiplier:
    """Return a multiplier that is always 1 (the warm-up is applied to every schedule)."""
    return lambda step: 1.0


@SCHEDULES.register("step", "multiply by schedule.gamma at each epoch in schedule.milestones")
def step_decay(cfg: ScheduleConfig, steps_per_epoch: int, total: int) -> Multiplier:
    """Return a piecewise-constant multiplier with drops at ``cfg.milestones`` (in epochs)."""
    bounds = sorted(round(m * steps_per_epoch) for m in cfg.milestones)
    return lambda step: cfg.gamma ** sum(step >= b for b in bounds)


@SCHEDULES.register("cosine", "cosine decay from the base rate to 0 at the last step")
def cosine(cfg: ScheduleConfig, steps_per_epoch: int, total: int) -> Multiplier:
    """Return a half-cosine multiplier over ``total`` steps."""
    return lambda step: 0.5 * (1.0 + math.cos(math.pi * min(step, total) / max(total, 1)))


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: ScheduleConfig, steps_per_epoch: int, total: int
) -> LambdaLR:
    """Return a per-step ``LambdaLR``: the named schedule times a linear warm-up.

    Args:
        optimizer: The optimizer whose rate is scheduled.
        cfg: The ``schedule`` section of the recipe.
        steps_per_epoch: Optimizer steps per epoch (to convert epochs to steps).
        total: Optimizer steps of the whole run.
    """
    base = SCHEDULES.get(cfg.name)(cfg, steps_per_epoch, total)
    warm = max(0, round(cfg.warmup_epochs * steps_per_epoch))

    def multiplier(step: int) -> float:
        ramp = min(1.0, (step + 1) / warm) if warm else 1.0
        return float(base(step)) * ramp  # type: ignore[operator]

    return LambdaLR(optimizer, multiplier)
