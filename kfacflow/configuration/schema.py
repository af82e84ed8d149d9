"""The typed recipe schema: every section and key, its docstring and the range its values may take.

Reading recipes and overrides is :mod:`kfacflow.configuration.recipe`'s; the checks that apply the ranges and the
rules across keys are :mod:`kfacflow.configuration.rules`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from kfacflow.configuration.ranges import CORES, Range, above, at_least, up_to_cores, within  # noqa: F401 - their home


@dataclass
class ModelConfig:
    """Which network to train."""

    name: str = "digits_cnn"
    """A registry name (`--list model`): built-ins, any torchvision classifier, or ``timm/<name>``."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the model's factory, e.g. ``model.kwargs.patch_size=4`` for the built-in ``vit``,
    ``model.kwargs.n_layer=6`` for ``gpt``, or ``model.kwargs.img_size=32`` for a timm ViT: timm's ``create_model``,
    torchvision's builder, or your ``module.path:factory`` (after ``num_classes, in_channels``). The other built-ins
    take none; the classes, the channels, ``vit``'s image size and ``pretrained``/``weights`` are not given here
    (they come from the data; nothing is downloaded). An argument the factory does not take is refused, naming
    what it takes."""


@dataclass
class DataConfig:
    """Where samples come from and how they are batched."""

    name: str = "digits"
    """A registry name (`--list dataset`)."""
    root: Optional[str] = None
    """Local folder for datasets read from disk (cifar10, fashion_mnist, imagefolder; text_files' folder of text
    files). Never downloaded."""
    image_size: int = field(default=0, metadata=at_least(0, "0 keeps the dataset's own size"))
    """Side of the square input image; 0 keeps the dataset's own (digits 8, cifar10 32, synthetic 224)."""
    batch_size: int = field(default=32, metadata=at_least(1, "samples per worker per step"))
    """Samples per worker per step (the paper's convention)."""
    eval_batch_size: int = field(default=0, metadata=at_least(0, "0 means data.batch_size"))
    """Samples per worker per evaluation batch; 0 means ``batch_size``."""
    num_classes: int = field(default=1000, metadata=at_least(1))
    """Classes of the synthetic dataset (others know their own)."""
    channels: int = field(default=3, metadata=at_least(1))
    """Image channels of the synthetic dataset."""
    train_size: int = field(default=1024, metadata=at_least(1))
    """Training samples of the synthetic dataset."""
    val_size: int = field(default=256, metadata=at_least(1))
    """Validation samples of the synthetic dataset."""
    augment: Optional[bool] = None
    """Random crops and flips on training images (cifar10, fashion_mnist, imagefolder); empty (the default) is
    ``true`` for them and for your own ``module.path:factory``. Text has no augmentation: with a text set
    (python_source, text_files) ``true`` is refused."""
    text_bytes: int = field(default=2_000_000, metadata=at_least(0, "0 reads the whole corpus"))
    """Bytes of a text corpus read (python_source, text_files): the first nine tenths of them from the training
    files, the last tenth from the validation files, each in sorted path order; 0 reads every file whole."""
    seq_len: int = field(default=128, metadata=at_least(1, "tokens per window"))
    """Tokens (bytes) per window of a text set: each sample is ``seq_len`` bytes and the ``seq_len`` bytes that
    follow each of them; the model's context (``model.kwargs.seq_len`` of ``gpt``) must be at least as long."""
    workers: int = field(
        default=0,
        metadata=within(
            0,
            4 * CORES + 1,
            f"0 loads data in the training process; this machine has {CORES} CPU cores, and loaders waiting on "
            "files may outnumber them (up to four per core)",
        ),
    )
    """DataLoader worker processes per training process."""


@dataclass
class TrainConfig:
    """Length of the run, numerics, logging and checkpoints."""

    epochs: int = field(default=1, metadata=at_least(1))
    """Passes over the training set."""
    steps: int = field(default=0, metadata=at_least(0, "0 means: use train.epochs"))
    """Stop after this many optimizer steps in total; wins over ``epochs`` when > 0."""
    seed: int = field(default=0, metadata=within(0, 2**63, high_text="2**63"))
    """Seeds model initialisation, data order and every random number generator."""
    dtype: Literal["float32", "float64"] = "float32"
    """Parameter and data precision; float64 is for exactness checks."""
    log_every: int = field(default=10, metadata=at_least(1, "steps between scalar writes"))
    """Steps between TensorBoard scalar writes."""
    eval_every: int = field(default=1, metadata=at_least(1, "epochs between evaluations"))
    """Epochs between evaluations on the validation set (the final one always runs)."""
    eval_every_steps: int = field(default=0, metadata=at_least(0, "0 evaluates by train.eval_every epochs only"))
    """Also evaluate every this many optimizer steps (for a curve of accuracy against time); each evaluation
    records the training seconds so far (``seconds``: wall time without evaluations and checkpoints)."""
    stop_at_accuracy: float = field(default=0.0, metadata=within(0, 1, "0 is off"))
    """End the run at the first evaluation whose validation accuracy is at least this (time to accuracy: the
    learning-rate schedule stays the whole run's, so the steps up to there are the full run's)."""
    stop_at_loss: float = field(default=0.0, metadata=at_least(0, "0 is off"))
    """End the run at the first evaluation whose validation loss (mean cross-entropy per sample, or per token for
    a language model) is at most this, as ``stop_at_accuracy`` does; with both set, at the first evaluation that
    reaches both."""
    checkpoint_every: int = field(default=0, metadata=at_least(0, "0 checkpoints at the end of each epoch only"))
    """Steps between checkpoints; 0 checkpoints at the end of each epoch only."""
    keep_checkpoints: int = field(default=2, metadata=at_least(0, "0 keeps every checkpoint"))
    """Newest checkpoints kept on disk; 0 keeps every checkpoint."""
    save: bool = True
    """Write checkpoints; ``false`` writes none, not even the final one (benchmarks: a ResNet-50 K-FAC checkpoint
    is about 1 GB), so the run cannot be resumed and a SIGTERM stops it without one."""
    channels_last: bool = False
    """Hold the model's 4-D weights and the input images in the channels-last memory format (NHWC), which
    cuDNN's tensor-core convolutions prefer under mixed precision; the results are the same."""
    cudnn_benchmark: bool = True
    """On CUDA, let cuDNN time its convolution algorithms for each new input shape and keep the fastest
    (``torch.backends.cudnn.benchmark``); ``false`` takes its heuristic's choice. No effect on CPU."""
    progress: bool = True
    """Show a progress bar on rank 0 (where the output is not a terminal: a plain line every ``log_every`` steps)."""
    metrics: Literal["none", "csv", "jsonl"] = "none"
    """Also append the logged metrics (train every ``log_every`` steps, each evaluation) to ``metrics.csv`` or
    ``metrics.jsonl`` in the run folder."""
    max_nonfinite: int = field(default=5, metadata=at_least(1))
    """Steps in a row with a non-finite loss or gradient (each skipped on every rank) before training stops."""
    amp: Literal["none", "bf16", "fp16"] = "none"
    """Mixed precision: the forward pass and loss under ``torch.autocast`` in bfloat16 or float16 (parameters,
    gradients, optimizer and K-FAC's factors stay in ``train.dtype``); ``fp16`` also scales the loss (a gradient
    scaler every rank agrees on: a step whose gradients overflow is skipped by all and the scale backs off)."""
    loss_scale: float = field(default=65536.0, metadata=above(0, "the fp16 loss scale to start from"))
    """``train.amp=fp16``: the first loss scale (a power of two keeps the unscaling exact)."""
    timing: bool = True
    """Break every step down into the parts of ``timings.jsonl`` (on CUDA by events on the stream, one device
    synchronization a step); ``false`` keeps only each step's wall time, for production or to measure what
    timing costs. A traced step (``train.timeline``) is broken down either way."""
    timing_warmup: int = field(default=2, metadata=at_least(0))
    """First steps left out of the mean time breakdown and the median step time in summary.json."""
    timeline: int = field(default=0, metadata=at_least(0, "0 is off"))
    """Record step N (from 1) of every rank as timeline.json (Chrome trace) and timeline.png; 0 is off."""
    timeline_steps: int = field(default=1, metadata=at_least(1))
    """Steps traced from ``train.timeline`` on, one every ``train.timeline_every``: layers.json holds each layer's
    mean over them (the Chrome trace and its picture are the first's), firmer than one step where steps vary."""
    timeline_every: int = field(default=1, metadata=at_least(1))
    """Steps from one traced step to the next (``train.timeline_steps``): e.g. ``kfac.inv_update_freq`` to trace
    only inverting steps, ``kfac.factor_update_freq`` only factor updates."""
    ema: float = field(default=0.0, metadata=within(0, 1, "0 is off"))
    """Decay of an exponential moving average of the weights and buffers, updated after every optimizer step and
    evaluated beside the model (``val_loss_ema``, ``val_acc_ema``); 0 is off."""
    label_smoothing: float = field(default=0.0, metadata=within(0, 1, "0 is off"))
    """Label smoothing of the training loss (``F.cross_entropy``); evaluation reports the plain loss."""
    accumulate: int = field(default=1, metadata=at_least(1, "1 is no accumulation"))
    """Micro-batches of data.batch_size per optimizer step (gradient accumulation): factors and gradients
    are those of one batch accumulate times larger."""


@dataclass
class MuonConfig:
    """``optim.name=muon``'s own settings; ``optim.lr`` is its rate, ``optim.weight_decay`` its decoupled decay."""

    momentum: float = field(default=0.95, metadata=within(0, 1))
    """Momentum of each matrix's gradient, in [0, 1) (``torch.optim.Muon``'s 0.95)."""
    nesterov: bool = True
    """Nesterov momentum (``torch.optim.Muon``'s)."""
    ns_steps: int = field(default=5, metadata=within(1, 100, "Newton-Schulz iterations"))
    """Newton-Schulz iterations of the orthogonalisation (five of three products each)."""
    ns_dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    """The iterations' dtype: ``auto`` is bfloat16 on a GPU (every Muon's) and float32 on a CPU, which emulates
    bfloat16 products at about 1/16 of float32's speed."""
    adjust_lr: Literal["original", "match_rms_adamw"] = "original"
    """The rate's scale by a matrix's shape ``out x in``: ``original`` ``sqrt(max(1, out / in))`` (Keller Jordan's),
    ``match_rms_adamw`` ``0.2 sqrt(max(out, in))`` (Moonshot's: AdamW's rate and decay serve)."""
    head: bool = False
    """Whether the classifier head (the model's last Linear) is Muon's too; by default AdamW's, as the speedruns
    keep it."""
    adamw_lr: float = field(default=3e-3, metadata=above(0))
    """AdamW's rate for what Muon does not take (biases, norms, embeddings, the head); the schedule scales it too."""
    owners: Literal["auto", "kfac", "placed", "round_robin", "replicated"] = "auto"
    """On several workers, which one keeps each matrix's momentum and runs its Newton-Schulz, the finished updates
    then gathered (ZeRO-1 style; the step is the same): ``kfac`` the K-FAC layer's owner, which sends the finished
    update in place of the preconditioned one (no second exchange; where K-FAC's owners send updates:
    ``kfac.variant=flow``), ``placed`` by each matrix's Newton-Schulz cost, ``round_robin`` in model order,
    ``replicated`` (every worker does every matrix, as ``torch.optim.Muon``), or ``auto``: owners (``kfac`` where
    K-FAC's owners send updates, else ``placed``) or ``replicated``, whichever is faster on this job as it starts
    (the fastest of 5 timings of each, logged)."""


@dataclass
class OptimConfig:
    """The first-order optimizer that applies the (preconditioned) gradient."""

    name: str = "sgd"
    """A registry name (`--list optimizer`), or your own ``module.path:factory`` (``factory(model, cfg)`` returning
    a ``torch.optim.Optimizer``; ``cfg`` is this section)."""
    lr: float = field(default=0.1, metadata=above(0))
    """Base learning rate (before the schedule)."""
    momentum: float = field(default=0.9, metadata=within(0, 1))
    """Momentum factor, in [0, 1); 0 is plain SGD."""
    nesterov: bool = False
    """Nesterov momentum; needs ``momentum`` > 0."""
    weight_decay: float = field(default=0.0, metadata=at_least(0, "0 is none"))
    """L2 penalty added to the gradient (``sgd``), or decoupled weight decay (``adamw``, ``muon``)."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999], metadata=within(0, 1))
    """``adamw`` (and ``muon``'s AdamW part): decay rates of the first and second moment estimates."""
    eps: float = field(default=1e-8, metadata=above(0))
    """``adamw`` (and ``muon``'s AdamW part): added to the denominator."""
    clip_grad_norm: float = field(default=0.0, metadata=at_least(0, "0 is off"))
    """Scale the applied gradient (after K-FAC) so that its global L2 norm is at most this; 0 is off."""
    muon: MuonConfig = field(default_factory=MuonConfig)
    """``optim.name=muon``'s own settings."""


@dataclass
class ScheduleConfig:
    """Learning-rate schedule, stepped once per optimizer step."""

    name: str = "constant"
    """A registry name (`--list schedule`)."""
    warmup_epochs: float = field(default=0.0, metadata=at_least(0, "0 is no warm-up"))
    """Linear warm-up from 0 to ``optim.lr`` over this many epochs (any schedule)."""
    milestones: list[float] = field(default_factory=list, metadata=at_least(0, "epochs from the start"))
    """Epochs at which the ``step`` schedule multiplies the rate by ``gamma``."""
    gamma: float = field(default=0.1, metadata=above(0, "the step schedule's factor"))
    """Factor of the ``step`` schedule."""


@dataclass
class LaunchConfig:
    """How many local worker processes ``run.py`` starts when no launcher started it."""

    nproc: int = field(default=1, metadata=at_least(1, "workers to start on this machine"))
    """Local workers; 1 runs in this process. Ignored under torchrun/horovodrun."""
    threads: int = field(default=0, metadata=up_to_cores("0 means: the default"))
    """Intra-op threads per worker; 0 takes OMP_NUM_THREADS if set, else divides the cores among local workers."""


@dataclass
class DistConfig:
    """The communication engine."""

    backend: str = "torch"
    """A registry name (`--list backend`)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """``auto`` uses CUDA (and NCCL) when available, otherwise CPU and gloo."""
    engine: Literal["auto", "nccl", "gloo"] = "auto"
    """torch.distributed's engine (``dist.backend=torch``): ``auto`` is NCCL on CUDA and gloo on CPU. NCCL refuses
    two ranks on one GPU: ``gloo`` carries CUDA tensors too (through the host), for that case and for tests."""
    timeout_s: int = field(
        default=300, metadata=within(1, 10**9, "seconds a collective may wait; 10**9 is 31 years", "10**9")
    )
    """Seconds a collective may wait before the job fails instead of hanging."""
    find_unused_parameters: bool = False
    """For a model some of whose trained parameters get no gradient at some step on some rank (a mixture of experts'
    expert no token went to, early exit): DDP then finds them at every step (a walk of the autograd graph). Where
    kfacflow averages the gradients itself (``flow``'s) such parameters are always counted."""


LAYER_KINDS = ("linear", "conv2d", "embedding", "norm", "tied")
"""The kinds of layer ``kfac.kinds`` may name."""


@dataclass
class KFACConfig:
    """K-FAC: the variant preset and the four stage choices it fills, and hyperparameters."""

    variant: str = "d"
    """A preset (`--list variant`): ``spd``, ``mpd``, ``d``, ``flow``, ``auto`` or ``sgd`` (no preconditioner)."""
    factor: str = "expand"
    """How factors treat the uses of a weight within one example (`--list factor`): a Conv2d's positions in the
    image, a Linear's tokens in a sequence, and the calls of a layer applied several times in one forward pass
    (shared weights). ``expand`` (KFC): every use is a row of its own. ``reduce`` (K-FAC-reduce): every use of the
    weight in one example, its tokens, positions and calls, reduced (inputs averaged, each call weighted by its
    tokens; output gradients summed), so the factors come from one row an example; the calls of a layer must then
    see the same examples. Forward passes of a step (micro-batches, several views) stay examples of their own."""
    fusion: Optional[str] = None
    """When factors are all-reduced (`--list fusion`); empty takes the variant's."""
    placement: Optional[str] = None
    """Which rank inverts which factor (`--list placement`); empty takes the variant's."""
    inverse: Optional[str] = None
    """How a damped factor is inverted (`--list inverse`); empty takes the variant's."""
    pipeline: Optional[str] = None
    """When inversion and preconditioning start (`--list pipeline`); empty takes the variant's."""
    broadcast: Optional[str] = None
    """What an owner sends (an inverse, or a layer's update) and how it holds it (`--list broadcast`); empty
    takes the variant's."""
    grad_sync: Optional[str] = None
    """When and where gradients are summed (`--list grad_sync`): in backward, behind the inversions, or there on
    each layer's owner alone; empty takes
    the variant's."""
    factor_sync: Optional[str] = None
    """Where factors are summed (`--list factor_sync`): on every rank, or on each factor's owner alone; empty
    takes the variant's."""
    precondition: Optional[str] = None
    """How gradients are preconditioned (`--list precondition`): ``kfac``, or ``rows`` (the same update, from each
    layer's rows where that takes half the flops or less); empty takes the variant's (``flow``: ``rows``)."""
    damping: float = field(default=0.001, metadata=above(0, "Tikhonov damping keeps factors invertible"))
    """Tikhonov damping gamma added to both factors before inversion."""
    factor_decay: float = field(default=0.95, metadata=within(0, 1, "the old factor's weight in the running average"))
    """Running-average weight of the old factor, in [0, 1)."""
    kl_clip: float = field(default=0.001, metadata=at_least(0, "0 disables clipping"))
    """Scale the update so lr^2 * sum(v . g) <= kl_clip; 0 disables."""
    normalize: Literal["none", "rms"] = "none"
    """``rms``: scale each layer's preconditioned update (weight and bias together) to a root mean square of 1, so
    that ``optim.lr`` is each layer's step per weight, as Muon's orthogonalisation and Adam do, and K-FAC chooses
    the direction alone; KL clipping (whose one scale this replaces) is then off, and ``kfac.kl_clip`` away from
    its default is refused. ``none``: the preconditioned gradient as it is."""
    factor_update_freq: int = field(default=1, metadata=at_least(1, "steps between factor updates"))
    """Steps between factor updates."""
    inv_update_freq: int = field(default=1, metadata=at_least(1, "steps between inverse updates"))
    """Steps between inverse updates; a multiple of ``factor_update_freq``."""
    inverse_schedule: Literal["all", "staggered"] = "all"
    """``all``: every factor is inverted on the same step, every ``inv_update_freq`` steps. ``staggered``: each
    factor once per period of ``inv_update_freq`` steps, at a factor update of its own, the inversions spread so
    that every factor update carries an equal share (per rank); every inverse is at most one period old, as with
    ``all``, but refreshed on a different step (not step for step the same as ``all``)."""
    factor_exchange: Optional[Literal["update", "inversion"]] = None
    """When factors are summed over ranks. ``update`` (the paper's D, MPD and SPD): at every factor update.
    ``inversion`` (``flow``'s): only at the steps that invert; between them each rank sums its own factors,
    decayed (thin factors as their rows), and an exchange sends that sum. The running averages are linear in the
    factors, so every inverse is the same, to round-off, as with ``update``; factor traffic falls by
    ``inv_update_freq / factor_update_freq`` (nothing changes where that is 1). Empty takes the variant's."""
    fusion_threshold_mb: float = field(default=64.0, metadata=above(0, "MiB"))
    """Fusion buffer of the ``threshold`` policy, in MiB (Horovod's default); the same as ``options.threshold.mb``.
    Away from its default where the fusion is not ``threshold``, it is refused (nothing would read it)."""
    options: dict[str, Any] = field(default_factory=dict)
    """The settings of stages that have their own, by stage name: ``kfac.options.<name>.<setting>`` (e.g.
    ``kfac.options.threshold.mb=32``); each stage declares its own and checks them. The options of a stage the run
    does not use (the variant's choices included) are refused, except under ``kfac.variant=sgd``."""
    profile: Optional[str] = None
    """Performance-model profile (tools/fit_perf_models.py); empty calibrates at start when needed."""
    profile_steps: int = field(default=5, metadata=at_least(1))
    """Factor-update steps the ``optimal`` fusion measures (after one warm-up step) before fixing its plan."""
    placement_steps: int = field(default=0, metadata=at_least(0, "0: by the estimates alone"))
    """Steps whose preconditioning is timed layer by layer (after one warm-up step) before whole layers are placed
    again by the measured times, once, where the next inverse period starts: for a placement that weighs layers by
    their work (``kfac.placement=layer`` where updates are broadcast and ``inv_update_freq`` is over 1; elsewhere
    a value over 0 is refused); 0: by the estimates from their shapes alone (within about 2x of traced times)."""
    skip: list[str] = field(default_factory=list)
    """fnmatch patterns of module names K-FAC leaves alone (e.g. ``fc``, ``layer4.*``)."""
    kinds: list[str] = field(default_factory=lambda: ["linear", "conv2d"])
    """Kinds of layer K-FAC preconditions: ``linear`` (an ``nn.MultiheadAttention``'s ``out_proj`` and its packed
    ``in_proj`` too, the latter named ``<module>.in_proj``), ``conv2d``, ``embedding`` (an ``nn.Embedding`` of at most
    8192 rows, as a Linear on one-hot tokens: its A counts how often each token was seen), ``norm`` (the scale and
    shift of an ``nn.LayerNorm`` or ``nn.RMSNorm``, by a diagonal Fisher of per-example gradients, as kfac-jax's
    scale-and-shift blocks: ``grad / (D + damping)``), ``tied`` (one weight used as an ``nn.Embedding`` and as an
    ``nn.Linear`` head, a tied LM head: both uses' Kronecker blocks summed and that sum inverted exactly). Every
    other parameter is the optimizer's alone; a layer of a kind left out is named once in the log."""
    factor_dtype: Literal["auto", "float32", "float64", "bfloat16", "float16"] = "auto"
    """What factors are computed, all-reduced and averaged in; ``auto``: the parameters' (float32 under mixed
    precision: activations of the autocast forward are cast up first). Half precision only when named here."""
    factor_examples: int = field(default=0, metadata=at_least(0, "0: every example"))
    """Examples of each worker's batch that the factors are estimated from (Martens & Grosse 2015 estimate them
    from a subset of the mini-batch): the first ``factor_examples`` of every Conv2d and batch-first layer input,
    the same share of the leading rows of any other; 0 (or a batch no larger): all of them. The gradient and
    its preconditioning still use every example. Factor computation falls with the share kept, and the factors
    are an estimate from fewer examples: a different result from the full batch's, not a round-off."""
    inverse_dtype: Literal["auto", "float32", "float64"] = "auto"
    """What factors are inverted and gradients preconditioned in (the update is cast back to the gradient's
    dtype); ``auto``: the factors' dtype, at least float32."""


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
