"""``kfac.variant=auto``: simulate every preset on a traced step of this run and keep the fastest.

The presets compute the same mathematics, so switching after a few steps changes only time.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, OmegaConf

from kfacflow.configuration.schema import KFACConfig
from kfacflow.kfac.planning.plan import EngineCaps
from kfacflow.kfac.variants import PRESETS, Stages, resolve
from kfacflow.perf import Profile
from kfacflow.simulation.events import EVERY_ROUTE, period

if TYPE_CHECKING:
    from collections.abc import Callable

    from kfacflow.comm.base import Backend
    from kfacflow.kfac.preconditioner import Preconditioner
    from kfacflow.kfac.strategies.contracts import StageSet

logger = logging.getLogger(__name__)

TRACED_STEP = 2
"""The step ``auto`` traces and simulates from (the first one warms up)."""


def preset_config(cfg: DictConfig, name: str) -> KFACConfig:
    """Return the ``kfac`` section with ``variant=name`` (explicit stage choices of the recipe still win).

    Under Horovod, whose optimizer averages gradients in the backward pass, gradients stay there.
    """
    section = OmegaConf.to_object(cfg.kfac)
    assert isinstance(section, KFACConfig)
    if cfg.dist.backend == "horovod" and section.grad_sync is None:
        section = replace(section, grad_sync="overlap")
    return replace(section, variant=name)


def choose(
    layers: dict[str, Any],
    profile: Profile,
    world_size: int,
    cfg: DictConfig,
    caps: EngineCaps = EVERY_ROUTE,
) -> str:
    """Simulate every preset on ``layers`` (this run's traced step) and ``profile``; return the fastest's name.

    Each is timed by its mean step over one inverse period of the recipe's intervals
    (:func:`~kfacflow.simulation.events.period`: at 10/100, the preset fastest at 10/100). Every preset
    runs the recipe's explicit stage choices, as it would if named; inversions traced with another
    method than a preset's are rescaled by the profile's models of both. The table is logged.
    ``caps``: what this run's engine can do (:meth:`~kfacflow.kfac.planning.plan.EngineCaps.of` its backend), so no
    preset is chosen for a route the run would not take.
    """
    totals = {}
    for name in PRESETS:
        stages = resolve(preset_config(cfg, name))
        parts = period(layers, profile, world_size, stages, True, cfg.kfac, caps)
        totals[name] = parts["total"]
    best = min(totals, key=lambda name: (totals[name], PRESETS.index(name)))
    table = ", ".join(f"{name} {seconds:.3f} s" for name, seconds in totals.items())
    logger.info("kfac.variant=auto: simulated steps (the mean over an inverse period) %s; using %s", table, best)
    return best


def switch(
    kfac: Preconditioner,
    traced: dict[str, Any] | None,
    cfg: DictConfig,
    backend: Backend,
    build: Callable[[KFACConfig, Stages, Profile], StageSet],
) -> tuple[str, Stages]:
    """Choose on rank 0 from its ``traced`` step, tell every rank, and run the chosen preset's stages from now on.

    ``build``: :func:`kfacflow.running.build.stages` (which imports this module).

    Returns:
        The preset's name and its stages.
    """
    assert kfac.profile is not None
    name = None
    if backend.rank == 0 and traced is not None:
        world = backend.world_size
        name = choose(traced, kfac.profile, world, cfg, EngineCaps.of(backend))
    name = backend.broadcast_object(name)
    chosen = preset_config(cfg, name)
    stages = resolve(chosen)
    kfac.reconfigure(build(chosen, stages, kfac.profile), kfac.profile.for_method(stages.inverse))
    return name, stages


def methods(cfg: DictConfig) -> set[str]:
    """The inverse methods of every preset ``auto`` chooses from."""
    return {resolve(preset_config(cfg, name)).inverse for name in PRESETS}
