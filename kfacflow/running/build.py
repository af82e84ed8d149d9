"""The one place a validated recipe becomes objects: plugins, name checks, the variant preset, the builders.

:func:`check` runs what the schema cannot (names in the registries, files the recipe points
at, the environment) before anything starts; :func:`training` builds, in every worker, what
the trainer runs: data, model, K-FAC with its stages, optimizer, schedule and loaders.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torch.optim.lr_scheduler import LambdaLR
from torch.utils.data import DataLoader

from kfacflow import UserError, did_you_mean, registry
from kfacflow.comm.base import Backend
from kfacflow.configuration.schema import DistConfig, KFACConfig
from kfacflow.data.loader import ResumableSampler, eval_loader, train_loader
from kfacflow.data.sets import DataInfo, build_datasets, check_shard
from kfacflow.kfac import in_use
from kfacflow.kfac.preconditioner import Preconditioner
from kfacflow.kfac.stages import options
from kfacflow.kfac.stages.contracts import FusionOptions
from kfacflow.kfac.strategies import contracts as strategies
from kfacflow.kfac.strategies.contracts import StageSet
from kfacflow.kfac.variants import Stages, resolve
from kfacflow.models.builtin import build_model, check_kwargs, check_name
from kfacflow.models.checks import check_input, check_tokens
from kfacflow.on_owners import muon_step
from kfacflow.optim.optimizers import build_scheduler, for_workers
from kfacflow.perf import Profile
from kfacflow.running.resume import check_meta, check_model
from kfacflow.running.rundir import CHECKPOINTS, checkpoints, load_latest_checkpoint
from kfacflow.running.seeding import seed_all
from kfacflow.running.timeline import traced_steps
from kfacflow.simulation.auto import methods as auto_methods
from kfacflow.simulation.calibration import calibrate
from kfacflow.timing import StepTimer

logger = logging.getLogger(__name__)

PLUGINS = (
    "kfacflow.data.builtin",
    "kfacflow.data.text",
    "kfacflow.models.builtin",
    "kfacflow.optim.optimizers",
    "kfacflow.comm.torch_dist",
    "kfacflow.comm.horovod",
    "kfacflow.kfac.variants",
    "kfacflow.kfac.stages.factors",
    "kfacflow.kfac.stages.fusion",
    "kfacflow.kfac.stages.placement",
    "kfacflow.kfac.stages.inverse",
    "kfacflow.kfac.stages.cupy_inverse",
    "kfacflow.kfac.stages.precondition",
    "kfacflow.kfac.strategies.pipeline",
    "kfacflow.kfac.strategies.inverse_broadcast",
    "kfacflow.kfac.strategies.update_broadcast",
    "kfacflow.kfac.strategies.grad_sync",
    "kfacflow.kfac.strategies.factor_sync",
)
"""The modules that fill the registries."""
PROFILE = "profile.yaml"


def load_plugins() -> None:
    """Import every module that registers entries, so the registries are complete."""
    for name in PLUGINS:
        importlib.import_module(name)


def check(cfg: DictConfig) -> None:
    """Check what the schema cannot: registry names, the files the recipe names, the environment.

    Raises:
        UserError: Naming the key to change.
    """
    load_plugins()
    k = cfg.kfac
    for reg, name in (
        (registry.DATASETS, cfg.data.name),
        (registry.OPTIMIZERS, cfg.optim.name),
        (registry.SCHEDULES, cfg.schedule.name),
        (registry.BACKENDS, cfg.dist.backend),
        (registry.VARIANTS, k.variant),
        (registry.FACTORS, k.factor),
        (registry.PRECONDITIONERS, k.precondition),
        (registry.FUSIONS, k.fusion),
        (registry.PLACEMENTS, k.placement),
        (registry.INVERSES, k.inverse),
        (registry.PIPELINES, k.pipeline),
        (registry.BROADCASTS, k.broadcast),
        (registry.GRAD_SYNCS, k.grad_sync),
        (registry.FACTOR_SYNCS, k.factor_sync),
    ):
        if name is not None:
            reg.get(name)
    names = resolve(k)
    check_stages(names)
    in_use.check(k, names)
    muon_step.check(cfg.optim.muon.owners if cfg.optim.name == "muon" else "", names)
    check_name(cfg.model.name)
    check_kwargs(cfg.model.name, cfg.model.kwargs)
    if k.profile:
        for method in Profile.load(k.profile).methods:  # a misspelt method would silently use the default model
            if method not in registry.INVERSES.names():
                raise UserError(
                    f"kfac.profile: {k.profile}: 'methods.{method}' is no inverse method."
                    f"{did_you_mean(method, registry.INVERSES.names())} Known: {', '.join(registry.INVERSES.names())}."
                )
    if cfg.resume:
        if not Path(cfg.resume).is_dir():
            raise UserError(f"resume: {cfg.resume!r} is not a run folder.")
        if not checkpoints(Path(cfg.resume)):
            raise UserError(
                f"resume: {cfg.resume!r} has no checkpoint in {CHECKPOINTS}/; start a new run without resume=."
            )
    if cfg.dist.backend == "horovod":
        # The recipe's own mistake first: it needs no Horovod installed to be found.
        chosen = names.strategies()
        for kind, need in strategies.unmet(chosen, engine=frozenset()) if names.preconditioned else []:
            raise UserError(
                f"kfac.{kind}={chosen[kind]} (kfac.variant={k.variant}) needs dist.backend=torch: Horovod's "
                f"optimizer averages gradients in the backward pass; set kfac.{kind}="
                f"{strategies.fallback(chosen, kind, need)}."
            )
        _check_horovod(cfg.launch.nproc)
    if cfg.dist.device == "cuda" and not torch.cuda.is_available():
        raise UserError("dist.device=cuda but no CUDA device is visible; use dist.device=auto or cpu.")
    check_device(names, cfg.dist.device)
    _check_engine(cfg)


def _check_engine(cfg: DictConfig) -> None:
    """NCCL needs CUDA, and a GPU of its own for every rank of a machine."""
    if cfg.dist.backend != "torch" or cfg.dist.engine == "gloo":
        return
    cuda = _device_type(cfg.dist.device) == "cuda"
    if cfg.dist.engine == "nccl" and not cuda:
        raise UserError("dist.engine=nccl needs CUDA tensors, but this run's device is the CPU; use dist.engine=auto.")
    gpus = torch.cuda.device_count() if cuda else 0
    if cuda and cfg.launch.nproc > 1 and cfg.launch.nproc > gpus and os.environ.get("LOCAL_WORLD_SIZE") is None:
        raise UserError(
            f"launch.nproc={cfg.launch.nproc} ranks on {gpus} visible GPU(s): NCCL refuses two ranks on one GPU; "
            f"set launch.nproc={gpus}, or dist.engine=gloo (CUDA tensors through the host)."
        )


def check_stages(names: Stages) -> None:
    """Check that the chosen stages fit together (:func:`kfacflow.kfac.strategies.contracts.check`).

    Raises:
        UserError: Naming the key to change.
    """
    if names.preconditioned:
        strategies.check(names.strategies())


def check_device(names: Stages, device: str | torch.device) -> None:
    """Check that the chosen stages can run on ``device`` (``auto``: CUDA where it is available, as workers pick).

    Raises:
        UserError: Naming the key to change (``kfac.inverse=cupy_cholesky`` needs CUDA and CuPy).
    """
    from kfacflow.kfac.stages import cupy_inverse  # a plugin: registering it is load_plugins' work, not this import's

    if names.preconditioned and names.inverse == cupy_inverse.NAME:
        cupy_inverse.check_usable(_device_type(device))


def _device_type(choice: str | torch.device) -> str:
    """The device type a worker picks for ``dist.device`` (``auto``: CUDA where it is available)."""
    return ("cuda" if torch.cuda.is_available() else "cpu") if choice == "auto" else torch.device(choice).type


def _check_horovod(nproc: int) -> None:
    from kfacflow.comm.horovod import INSTALL_HINT
    from kfacflow.comm.launchers import under_mpi_launcher

    if importlib.util.find_spec("horovod") is None:
        raise UserError(f"dist.backend=horovod: Horovod is not installed; {INSTALL_HINT}.")
    if nproc > 1 and not under_mpi_launcher():
        raise UserError(
            f"dist.backend=horovod starts no workers itself: run `horovodrun -np {nproc} -H localhost:{nproc} "
            "--gloo python run.py RECIPE dist.backend=horovod` (launch.nproc is then ignored)."
        )


def check_out_dir(out_dir: str) -> None:
    """Check that run folders can be created under ``out_dir``, creating nothing.

    The nearest existing folder on the way to ``out_dir`` (``out_dir`` itself if it exists) must
    be a folder this process may write to.

    Raises:
        UserError: Naming ``out_dir``.
    """
    path = Path(out_dir).absolute()
    while not os.path.exists(path) and path != path.parent:
        path = path.parent
    if not path.is_dir():
        raise UserError(
            f"out_dir={out_dir!r} cannot hold run folders: {str(path)!r} is a file, not a folder; "
            "set out_dir to a folder (it is created if missing)."
        )
    if not os.access(path, os.W_OK | os.X_OK):
        raise UserError(
            f"out_dir={out_dir!r} cannot hold run folders: {str(path)!r} is not writable; "
            "set out_dir to a folder you can write to."
        )


def backend(cfg: DistConfig) -> Backend:
    """Join the job with the engine ``dist.backend`` names."""
    load_plugins()
    return registry.BACKENDS.get(cfg.backend)(cfg)


def needs_profile(names: Stages) -> bool:
    """Whether the chosen fusion or placement plans with a performance profile (``auto`` simulates with one)."""
    return names.preconditioned and (
        names.choose
        or registry.FUSIONS.entry(names.fusion).needs_profile
        or registry.PLACEMENTS.entry(names.placement).needs_profile
    )


def stages(cfg: KFACConfig, names: Stages, profile: Profile | None) -> StageSet:
    """Build the stages ``names`` chooses, each from its own options.

    Raises:
        UserError: If they do not fit together (:func:`check_stages`).
    """
    check_stages(names)
    fusion = FusionOptions(
        own=options.of(registry.FUSIONS.entry(names.fusion), cfg),
        profile_steps=cfg.profile_steps,
        allreduce=profile.allreduce if profile is not None else None,
    )
    return StageSet(
        factor=registry.FACTORS.get(cfg.factor)(),
        fusion=registry.FUSIONS.get(names.fusion)(fusion),
        placement=registry.PLACEMENTS.get(names.placement),
        invert=registry.INVERSES.get(names.inverse),
        precondition=registry.PRECONDITIONERS.get(names.precondition)(
            cfg.kl_clip, **({"normalize": cfg.normalize} if cfg.normalize != "none" else {})
        ),
        pipeline=registry.PIPELINES.get(names.pipeline),
        broadcast=registry.BROADCASTS.get(names.broadcast),
        factor_sync=registry.FACTOR_SYNCS.get(names.factor_sync),
        grad_sync=registry.GRAD_SYNCS.get(names.grad_sync),
        factor_exchange=names.factor_exchange,
    )


def preconditioner(
    model: nn.Module,
    cfg: KFACConfig,
    backend: Backend,
    profile: Profile | None = None,
    timer: StepTimer | None = None,
    accumulate: int = 1,
    batch_dim: int = 0,
) -> Preconditioner:
    """Build K-FAC for ``model`` from the ``kfac`` section of a recipe (its variant must precondition)."""
    load_plugins()
    names = resolve(cfg)
    check_device(names, backend.device)
    planning = profile.for_method(names.inverse) if profile is not None else None
    built = stages(cfg, names, profile)
    kfac = Preconditioner(model, cfg, built, backend, planning, timer, accumulate, batch_dim)
    return kfac


def profile(cfg: DictConfig, backend: Backend, run_dir: Path, dtype: torch.dtype) -> Profile:
    """Load the recipe's profile (or the resumed run's), else calibrate now and save it in the run folder."""
    path = cfg.kfac.profile or (run_dir / PROFILE if (run_dir / PROFILE).is_file() else None)
    if path is not None:
        loaded: Profile = backend.broadcast_object(Profile.load(path) if backend.rank == 0 else None)
        return loaded
    names = resolve(cfg.kfac)
    # auto simulates every preset, each with its own inverse method's costs
    others = sorted(auto_methods(cfg) - {names.inverse}) if names.choose else []
    measured = calibrate(
        backend,
        registry.INVERSES.get(names.inverse),
        dtype,
        methods={name: registry.INVERSES.get(name) for name in [names.inverse, *others]},
    )
    measured.meta["inverse_method"] = names.inverse
    if backend.rank == 0:
        measured.save(run_dir / PROFILE)
        logger.info(
            "calibrated: all-reduce %.2e + %.2e m s, broadcast %.2e + %.2e m s, inverse %s (error %.0f%%)",
            measured.allreduce.alpha,
            measured.allreduce.beta,
            measured.broadcast.alpha,
            measured.broadcast.beta,
            measured.inverse.kind,
            100 * measured.inverse.error,
        )
    return measured


@dataclass
class Training:
    """Everything the trainer runs, built from a recipe."""

    model: nn.Module
    net: nn.Module
    kfac: Preconditioner | None
    optimizer: torch.optim.Optimizer
    scheduler: LambdaLR
    loader: DataLoader[Any]
    sampler: ResumableSampler
    val_loader: DataLoader[Any]
    info: DataInfo
    stages: Stages
    dtype: torch.dtype
    steps_per_epoch: int
    total: int
    resume_state: dict[str, Any] | None


def training(cfg: DictConfig, backend: Backend, run_dir: Path, timer: StepTimer) -> Training:
    """Build the data, model, K-FAC, optimizer, schedule and loaders of a run (every worker).

    A resume is read and checked against this run before anything is calibrated or written.

    Raises:
        UserError: What only building reveals (too little data, a checkpoint that does not fit, ...).
    """
    load_plugins()
    rank, world = backend.rank, backend.world_size
    dtype = torch.float64 if cfg.train.dtype == "float64" else torch.float32
    accumulate = cfg.train.accumulate
    train_set, val_set, info = build_datasets(cfg.data)
    check_shard(len(train_set), world, cfg.data.batch_size, accumulate)  # type: ignore[arg-type]
    seed_all(cfg.train.seed)  # identical initial weights on every rank
    kwargs: dict[str, Any] = OmegaConf.to_container(cfg.model.kwargs)  # type: ignore[assignment]  # a str-keyed map
    model = build_model(cfg.model.name, info.num_classes, info.channels, kwargs, info.image_size)
    model = model.to(backend.device, dtype)
    if cfg.train.channels_last:  # the trainer sends the images in the same format
        model = model.to(memory_format=torch.channels_last)
    # before cuDNN's benchmark mode, which would time its algorithms for the trial's shape too
    if info.tokens:
        check_tokens(model, cfg.model.name, kwargs, info.num_classes, info.seq_len)
    else:
        check_input(model, cfg.model.name, kwargs, info.channels, info.image_size, cfg.train.channels_last)
    if backend.device.type == "cuda":
        torch.backends.cudnn.benchmark = cfg.train.cudnn_benchmark
    names = resolve(cfg.kfac)
    state = _read_resume(cfg, model, world, names) if cfg.resume else None
    kfac = None
    if names.preconditioned:
        prof = profile(cfg, backend, run_dir, dtype) if needs_profile(names) else None
        kfac = preconditioner(model, cfg.kfac, backend, prof, timer, accumulate)
    net = backend.wrap_model(model)
    optimizer = for_workers(model, cfg.optim, backend, accumulate, timer, muon_step.sends_updates(names))
    muon_step.attach(kfac, optimizer, model, cfg.optim.clip_grad_norm)
    loader, sampler = train_loader(train_set, cfg.data.batch_size, rank, world, cfg.train.seed, cfg.data.workers)
    val_loader = eval_loader(val_set, cfg.data.eval_batch_size or cfg.data.batch_size, rank, world, cfg.data.workers)
    steps_per_epoch = len(loader) // accumulate
    total = cfg.train.steps or cfg.train.epochs * steps_per_epoch
    if cfg.train.timeline > total:
        raise UserError(
            f"train.timeline={cfg.train.timeline} is after the run's last step ({total}); "
            f"pick a step from 1 to {total} (0 turns it off)."
        )
    last = traced_steps(cfg.train)[-1:]
    if last and last[0] > total:
        t = cfg.train
        raise UserError(
            f"train.timeline_steps={t.timeline_steps} steps from train.timeline={t.timeline}, one every "
            f"train.timeline_every={t.timeline_every}, end at step {last[0]}, after the run's last step ({total}); "
            f"trace fewer steps or raise train.steps."
        )
    scheduler = build_scheduler(optimizer, cfg.schedule, steps_per_epoch, total)
    seed_all(cfg.train.seed + 1 + rank)  # per-rank streams for dropout and augmentation
    return Training(
        model, net, kfac, optimizer, scheduler, loader, sampler, val_loader, info, names, dtype,
        steps_per_epoch, total, state,
    )  # fmt: skip


def _read_resume(cfg: DictConfig, model: nn.Module, world: int, names: Stages) -> dict[str, Any]:
    """Read the newest checkpoint of ``resume`` and check that it fits this run (every rank)."""
    state = load_latest_checkpoint(Path(cfg.resume))
    check_meta(state.get("meta") or {"world_size": state["world_size"]}, cfg, world, names.preconditioned)
    check_model(state["model"], model, cfg)
    return state
