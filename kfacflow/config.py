"""The typed recipe schema and ``load(recipes, overrides)``: YAML files and dotlist overrides."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Literal, Optional

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from kfacflow.errors import UserError


@dataclass
class ModelConfig:
    """Which network to train."""

    name: str = "digits_cnn"
    """A registry name (`--list model`): built-ins, any torchvision classifier, or ``timm/<name>``."""


@dataclass
class DataConfig:
    """Where samples come from and how they are batched."""

    name: str = "digits"
    """A registry name (`--list dataset`)."""
    root: Optional[str] = None
    """Local folder for datasets read from disk (cifar10, imagefolder). Never downloaded."""
    image_size: int = 0
    """Side of the square input image; 0 keeps the dataset's own (digits 8, cifar10 32, synthetic 224)."""
    batch_size: int = 32
    """Samples per worker per step (the paper's convention)."""
    eval_batch_size: int = 0
    """Samples per worker per evaluation batch; 0 means ``batch_size``."""
    num_classes: int = 1000
    """Classes of the synthetic dataset (others know their own)."""
    channels: int = 3
    """Image channels of the synthetic dataset."""
    train_size: int = 1024
    """Training samples of the synthetic dataset."""
    val_size: int = 256
    """Validation samples of the synthetic dataset."""
    augment: bool = True
    """Random crops and flips on training images (cifar10, imagefolder)."""
    workers: int = 0
    """DataLoader worker processes per training process."""


@dataclass
class TrainConfig:
    """Length of the run, numerics, logging and checkpoints."""

    epochs: int = 1
    """Passes over the training set."""
    steps: int = 0
    """Stop after this many optimizer steps in total; wins over ``epochs`` when > 0."""
    seed: int = 0
    """Seeds model initialisation, data order and every random number generator."""
    dtype: Literal["float32", "float64"] = "float32"
    """Parameter and data precision; float64 is for exactness checks."""
    log_every: int = 10
    """Steps between TensorBoard scalar writes."""
    eval_every: int = 1
    """Epochs between evaluations on the validation set (the final one always runs)."""
    checkpoint_every: int = 0
    """Steps between checkpoints; 0 checkpoints at the end of each epoch only."""
    keep_checkpoints: int = 2
    """Newest checkpoints kept on disk."""
    progress: bool = True
    """Show a progress bar on rank 0."""
    max_nonfinite: int = 5
    """Steps in a row with a non-finite loss or gradient (each skipped on every rank) before training stops."""
    timing_warmup: int = 2
    """First steps left out of the mean time breakdown and the median step time in summary.json."""
    timeline: int = 0
    """Record step N (from 1) of every rank as timeline.json (Chrome trace) and timeline.png; 0 is off."""


@dataclass
class OptimConfig:
    """The first-order optimizer that applies the (preconditioned) gradient."""

    name: str = "sgd"
    """A registry name (`--list optimizer`)."""
    lr: float = 0.1
    """Base learning rate (before the schedule)."""
    momentum: float = 0.9
    nesterov: bool = False
    weight_decay: float = 0.0


@dataclass
class ScheduleConfig:
    """Learning-rate schedule, stepped once per optimizer step."""

    name: str = "constant"
    """A registry name (`--list schedule`)."""
    warmup_epochs: float = 0.0
    """Linear warm-up from 0 to ``optim.lr`` over this many epochs (any schedule)."""
    milestones: list[float] = field(default_factory=list)
    """Epochs at which the ``step`` schedule multiplies the rate by ``gamma``."""
    gamma: float = 0.1
    """Factor of the ``step`` schedule."""


@dataclass
class LaunchConfig:
    """How many local worker processes ``run.py`` starts when no launcher started it."""

    nproc: int = 1
    """Local workers; 1 runs in this process. Ignored under torchrun/horovodrun."""
    threads: int = 0
    """Intra-op threads per worker; 0 takes OMP_NUM_THREADS if set, else divides the cores among local workers."""


@dataclass
class DistConfig:
    """The communication engine."""

    backend: str = "torch"
    """A registry name (`--list backend`)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """``auto`` uses CUDA (and NCCL) when available, otherwise CPU and gloo."""
    timeout_s: int = 300
    """Seconds a collective may wait before the job fails instead of hanging."""


@dataclass
class KFACConfig:
    """K-FAC: the variant preset and the four stage choices it fills, and hyperparameters."""

    variant: str = "d"
    """A preset (`--list variant`): ``spd``, ``mpd``, ``d`` or ``sgd`` (no preconditioner)."""
    factor: str = "expand"
    """How Conv2d factors treat spatial positions (`--list factor`)."""
    fusion: Optional[str] = None
    """When factors are all-reduced (`--list fusion`); empty takes the variant's."""
    placement: Optional[str] = None
    """Which rank inverts which factor (`--list placement`); empty takes the variant's."""
    inverse: Optional[str] = None
    """How a damped factor is inverted (`--list inverse`); empty takes the variant's."""
    precondition: str = "kfac"
    """How gradients are preconditioned (`--list precondition`)."""
    damping: float = 0.001
    """Tikhonov damping gamma added to both factors before inversion."""
    factor_decay: float = 0.95
    """Running-average weight of the old factor, in [0, 1)."""
    kl_clip: float = 0.001
    """Scale the update so lr^2 * sum(v . g) <= kl_clip; 0 disables."""
    factor_update_freq: int = 1
    """Steps between factor updates."""
    inv_update_freq: int = 1
    """Steps between inverse updates; a multiple of ``factor_update_freq``."""
    fusion_threshold_mb: float = 64.0
    """Fusion buffer of the ``threshold`` policy, in MiB (Horovod's default)."""
    profile: Optional[str] = None
    """Performance-model profile (tools/fit_perf_models.py); empty calibrates at start when needed."""
    profile_steps: int = 5
    """Factor-update steps the ``optimal`` fusion measures (after one warm-up step) before fixing its plan."""
    skip: list[str] = field(default_factory=list)
    """fnmatch patterns of module names K-FAC leaves alone (e.g. ``fc``, ``layer4.*``)."""


@dataclass
class RunConfig:
    """A whole recipe."""

    name: str = ""
    """Run name, the folder under ``out_dir``; empty takes the first recipe's file name."""
    out_dir: str = "runs"
    """Where run folders are created."""
    resume: Optional[str] = None
    """A run folder to continue from its newest checkpoint."""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    kfac: KFACConfig = field(default_factory=KFACConfig)


def _omegaconf_message(err: OmegaConfBaseException, where: str) -> str:
    msg = str(getattr(err, "msg", None) or err).splitlines()[0]
    key = getattr(err, "full_key", None)
    if isinstance(err, ConfigKeyError):
        hint = msg.split(". ", 1)[-1] if "Did you mean" in msg else "See the keys in kfacflow/config.py."
        return f"{where}: unknown key '{key}'. {hint}"
    if not key and "is not a subclass of" in msg:
        kind = msg.split("is not a subclass of ")[-1].split(".")[0]
        section = next((f.name for f in fields(RunConfig) if f.type == kind), kind)
        first = fields(globals()[kind])[0].name if kind in globals() else "key"
        return f"{where}: '{section}' is a section, not a value; set its keys instead, e.g. {section}.{first}=..."
    if "is not a ListConfig" in msg:
        return f"{where}: '{key}' takes a list, e.g. {key}=[a,b]."
    if isinstance(err, ValidationError):
        return f"{where}: bad value for '{key}': {msg}"
    return f"{where}: '{key}': {msg}"


def _merge(base: DictConfig, other: object, where: str) -> DictConfig:
    try:
        merged = OmegaConf.merge(base, other)
    except OmegaConfBaseException as err:
        raise UserError(_omegaconf_message(err, where)) from None
    assert isinstance(merged, DictConfig)
    return merged


def _read_yaml(path: str) -> object:
    p = Path(path)
    if not p.is_file():
        raise UserError(f"recipe {path!r} does not exist. Recipes shipped: recipes/*.yaml")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as err:
        raise UserError(f"recipe {path!r} is not valid YAML: {str(err).splitlines()[0]}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError(f"recipe {path!r} must be a mapping of keys, not {type(data).__name__}.")
    return data


def load(recipes: list[str], overrides: list[str]) -> DictConfig:
    """Merge recipe files left to right, then ``key.sub=value`` overrides, over the schema.

    A ``resume=<run dir>`` with no recipe starts from that run's saved ``config.yaml``.

    Args:
        recipes: YAML recipe paths.
        overrides: Dotlist overrides (Hydra grammar without the ``+``/``~`` forms).

    Returns:
        The validated config (a structured ``DictConfig`` of :class:`RunConfig`).

    Raises:
        UserError: Unknown key, wrong type, unreadable recipe, unknown registry name, or a
            cross-field rule broken.
    """
    cfg = OmegaConf.structured(RunConfig)
    for bad in (o for o in overrides if "=" not in o):
        raise UserError(f"override {bad!r} must look like key.sub=value (e.g. kfac.damping=0.01).")
    for item in overrides:
        try:
            OmegaConf.from_dotlist([item])
        except (OmegaConfBaseException, yaml.YAMLError) as err:
            raise UserError(
                f"override {item!r} does not parse ({str(err).splitlines()[0]}); quote YAML's special "
                "characters, e.g. kfac.skip=['*']."
            ) from None
    dot = OmegaConf.from_dotlist(overrides)
    resume = dot.get("resume") if not recipes else None
    if resume:
        saved = Path(str(resume)) / "config.yaml"
        if not saved.is_file():
            raise UserError(f"resume: {resume!r} has no config.yaml; give the run folder printed at the end of a run.")
        cfg = _merge(cfg, _read_yaml(str(saved)), str(saved))
    for path in recipes:
        cfg = _merge(cfg, _read_yaml(path), path)
    cfg = _merge(cfg, dot, "override")
    if not cfg.name:
        cfg.name = Path(recipes[0]).stem if recipes else "run"
    check(cfg)
    return cfg


def _positive(value: float, key: str, what: str = "must be > 0") -> None:
    if not (value > 0 and math.isfinite(value)):
        raise UserError(f"{key}={value} {what}.")


def check(cfg: DictConfig) -> None:
    """Cross-field and registry checks that the types alone cannot express.

    Raises:
        UserError: Naming the key to change.
    """
    from kfacflow import registry

    registry.load_all()
    k = cfg.kfac
    registry.DATASETS.get(cfg.data.name)
    registry.OPTIMIZERS.get(cfg.optim.name)
    registry.SCHEDULES.get(cfg.schedule.name)
    registry.BACKENDS.get(cfg.dist.backend)
    registry.VARIANTS.get(k.variant)
    registry.FACTORS.get(k.factor)
    registry.PRECONDITIONERS.get(k.precondition)
    for stage, reg in (
        ("fusion", registry.COMMUNICATORS),
        ("placement", registry.PLACEMENTS),
        ("inverse", registry.INVERSES),
    ):
        if k[stage] is not None:
            reg.get(k[stage])
    from kfacflow.models import check_name

    check_name(cfg.model.name)
    _positive(cfg.data.batch_size, "data.batch_size")
    _positive(cfg.train.log_every, "train.log_every")
    _positive(cfg.train.eval_every, "train.eval_every")
    _positive(cfg.train.max_nonfinite, "train.max_nonfinite")
    for key in (
        "data.eval_batch_size",
        "data.workers",
        "launch.threads",
        "train.checkpoint_every",
        "train.timing_warmup",
        "train.timeline",
    ):
        if OmegaConf.select(cfg, key) < 0:
            raise UserError(f"{key}={OmegaConf.select(cfg, key)} must be >= 0 (0 means: the default).")
    _positive(cfg.optim.lr, "optim.lr")
    _positive(cfg.launch.nproc, "launch.nproc", "must be >= 1 (workers to start on this machine)")
    if cfg.train.steps < 0 or cfg.train.epochs < 1:
        raise UserError("train.epochs must be >= 1 and train.steps >= 0 (0 means: use epochs).")
    _positive(k.damping, "kfac.damping", "must be > 0 (Tikhonov damping keeps factors invertible)")
    if not 0 <= k.factor_decay < 1:
        raise UserError(f"kfac.factor_decay={k.factor_decay} must be in [0, 1).")
    if k.kl_clip < 0:
        raise UserError(f"kfac.kl_clip={k.kl_clip} must be >= 0 (0 disables clipping).")
    _positive(k.factor_update_freq, "kfac.factor_update_freq")
    _positive(k.inv_update_freq, "kfac.inv_update_freq")
    _positive(k.fusion_threshold_mb, "kfac.fusion_threshold_mb")
    _positive(k.profile_steps, "kfac.profile_steps")
    if k.profile:
        from kfacflow.perf import Profile

        Profile.load(k.profile)
    if k.inv_update_freq % k.factor_update_freq:
        raise UserError(
            f"kfac.inv_update_freq={k.inv_update_freq} must be a multiple of "
            f"kfac.factor_update_freq={k.factor_update_freq}."
        )
    if cfg.resume:
        from kfacflow.rundir import CHECKPOINTS, checkpoints

        if not Path(cfg.resume).is_dir():
            raise UserError(f"resume: {cfg.resume!r} is not a run folder.")
        if not checkpoints(Path(cfg.resume)):
            raise UserError(
                f"resume: {cfg.resume!r} has no checkpoint in {CHECKPOINTS}/; start a new run without resume=."
            )
    if cfg.dist.backend == "horovod":
        _check_horovod(cfg.launch.nproc)
    if cfg.dist.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise UserError("dist.device=cuda but no CUDA device is visible; use dist.device=auto or cpu.")


def _check_horovod(nproc: int) -> None:
    import importlib.util

    from kfacflow.dist.horovod import INSTALL_HINT
    from kfacflow.launch import under_mpi_launcher

    if importlib.util.find_spec("horovod") is None:
        raise UserError(f"dist.backend=horovod: Horovod is not installed; {INSTALL_HINT}.")
    if nproc > 1 and not under_mpi_launcher():
        raise UserError(
            f"dist.backend=horovod starts no workers itself: run `horovodrun -np {nproc} -H localhost:{nproc} "
            "--gloo python run.py RECIPE dist.backend=horovod` (launch.nproc is then ignored)."
        )


def to_yaml(cfg: DictConfig) -> str:
    """Return the resolved config as YAML (what ``config.yaml`` in a run folder holds)."""
    return OmegaConf.to_yaml(cfg, resolve=True)
