"""Datasets registered in ``registry.DATASETS``: digits, synthetic, cifar10 and imagefolder."""

from __future__ import annotations

import logging
import math
import pickle
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset, IterableDataset, TensorDataset

from kfacflow import DataError, UserError
from kfacflow.config import DataConfig
from kfacflow.registry import DATASETS
from kfacflow.usercode import UserCodeError, call_factory, first_line

logger = logging.getLogger(__name__)

Sample = tuple[torch.Tensor, int]
Builder = Callable[[DataConfig], "tuple[Dataset, Dataset, DataInfo]"]

CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
CIFAR_TRAIN_FILES = tuple(f"data_batch_{i}" for i in range(1, 6))
CIFAR_FILES = (*CIFAR_TRAIN_FILES, "test_batch")


@dataclass(frozen=True)
class DataInfo:
    """What the model builder needs to know about a dataset."""

    num_classes: int
    channels: int
    image_size: int


# Optional cheap per-dataset checks, run before any worker starts.
_CHECKS: dict[str, Callable[[DataConfig], None]] = {}


def check_data(cfg: DataConfig) -> None:
    """Cheap checks of the data settings (names, paths, expected files) before any worker starts.

    Args:
        cfg: The ``data`` section of the recipe.

    Raises:
        UserError: Unknown dataset, bad size, or missing folders/files; names the recipe key.
    """
    DATASETS.get(cfg.name)
    if cfg.image_size < 0:
        raise UserError(f"data.image_size={cfg.image_size} must be >= 0 (0 keeps the dataset's own size).")
    check = _CHECKS.get(cfg.name)
    if check is not None:
        check(cfg)


def check_shard(samples: int, world: int, batch: int, accumulate: int = 1) -> None:
    """Check that each of ``world`` workers gets at least one step (``accumulate`` batches) of the ``samples``.

    Raises:
        UserError: Naming ``data.batch_size`` (and ``train.accumulate``) and the worker count to change.
    """
    per_rank = math.ceil(samples / world)
    if per_rank < batch * accumulate:
        if accumulate == 1:
            what, lower = f"data.batch_size={batch} is", "data.batch_size"
        else:
            what = f"data.batch_size={batch} x train.accumulate={accumulate} = {batch * accumulate} samples a step are"
            lower = "data.batch_size, train.accumulate"
        raise UserError(
            f"{what} more than the {per_rank} training samples each of {world} workers gets; lower {lower} "
            "or the number of workers (launch.nproc)."
        )


def build_datasets(cfg: DataConfig) -> tuple[Dataset, Dataset, DataInfo]:
    """Build the training and validation sets selected by ``data.name``.

    Args:
        cfg: The ``data`` section of the recipe.

    Returns:
        ``(train, val, info)``; samples are ``(float32 CxHxW tensor, int64 label)``.

    Raises:
        UserError: As :func:`check_data`.
    """
    check_data(cfg)
    builder: Builder = DATASETS.get(cfg.name)  # type: ignore[assignment]
    own = ":" in cfg.name  # the user's module.path:factory
    built = call_factory(DATASETS.key, cfg.name, builder, "factory(data_cfg)", cfg) if own else builder(cfg)
    if not (isinstance(built, tuple) and len(built) == 3 and isinstance(built[2], DataInfo)):
        raise UserError(
            f"data.name={cfg.name!r} must return (train set, validation set, kfacflow.data.DataInfo), "
            f"not {type(built).__name__}."
        )
    train, val, info = built
    check_sets(cfg.name, train, val, info, own)
    logger.info("dataset %s: %d train, %d val, %s", cfg.name, len(train), len(val), info)  # type: ignore[arg-type]
    return train, val, info


def check_sets(name: str, train: Any, val: Any, info: DataInfo, own: bool = True) -> None:
    """Check once, cheaply, that the model can take what the sets hold (their first sample; a set of tensors whole).

    Both sets must be map-style (the samplers shard them by index) and not empty, and their samples
    ``(C x H x W tensor, int label)`` with the channels and a label below the classes of ``info``.

    Args:
        name: ``data.name``.
        train: The training set.
        val: The validation set.
        info: What the model is built for.
        own: Whether the sets are the user's (a sample that raises is then the user's bug).

    Raises:
        UserError: Naming ``data.name``, the set and what is wrong.
    """
    key = f"data.name={name!r}"
    for attr in ("num_classes", "channels", "image_size"):
        value = getattr(info, attr)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise UserError(f"{key}: DataInfo.{attr}={value!r} must be an int >= 1.")
    for split, data in (("training", train), ("validation", val)):
        where = f"{key}: the {split} set"
        if isinstance(data, IterableDataset):
            raise UserError(
                f"{where} is an IterableDataset, but every worker draws its shard by index; return a map-style "
                "Dataset (with __len__ and __getitem__, e.g. a TensorDataset)."
            )
        if not (hasattr(data, "__len__") and hasattr(data, "__getitem__")):
            raise UserError(
                f"{where} is a {type(data).__name__}, not a map-style dataset; give it __len__ and __getitem__ "
                "(e.g. a TensorDataset)."
            )
        if len(data) == 0:
            use = "training" if split == "training" else "evaluation (after train.eval_every epochs and at the end)"
            raise UserError(f"{where} is empty, but {use} needs samples; give it at least one.")
        _check_first_sample(where, data, info, own)
        if isinstance(data, TensorDataset) and len(data.tensors) == 2:  # all labels, in memory already
            _check_labels(where, data.tensors[1], info.num_classes)


def _check_first_sample(where: str, data: Any, info: DataInfo, own: bool) -> None:
    try:
        sample = data[0]
    except UserError as err:  # a file that cannot be read: every rank reads this one, so rank 0 says it
        raise UserError(str(err)) from None
    except Exception as err:
        if not own:
            raise
        raise UserCodeError(f"{where}: reading sample 0 raised {first_line(err)} (its traceback is above).") from err
    if not (isinstance(sample, (tuple, list)) and len(sample) == 2):
        raise UserError(f"{where}: sample 0 is a {type(sample).__name__}; samples are (image tensor, int label).")
    image, label = sample
    if not isinstance(image, torch.Tensor):
        raise UserError(
            f"{where}: the image of sample 0 is a {type(image).__name__}, not a tensor; convert it (e.g. with "
            "torchvision's v2.ToImage() and v2.ToDtype(torch.float32, scale=True))."
        )
    if image.ndim != 3 or image.shape[0] != info.channels:
        fix = " (add the channel dimension: x.unsqueeze(0))" if image.ndim == 2 else ""
        raise UserError(
            f"{where}: the image of sample 0 has shape {tuple(image.shape)}, but the model takes C x H x W images "
            f"with the {info.channels} channel(s) of its DataInfo{fix}."
        )
    value = label.item() if isinstance(label, (torch.Tensor, np.generic)) and label.ndim == 0 else label
    if not isinstance(value, int):
        what = f"a tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else repr(value)[:40]
        raise UserError(
            f"{where}: the label of sample 0 is {what} ({type(value).__name__}), not an int class index; labels are "
            "ints from 0 to num_classes - 1 (for one-hot labels give the index, y.argmax())."
        )
    _check_label_range(where, 0, value, info.num_classes)


def _check_labels(where: str, labels: torch.Tensor, num_classes: int) -> None:
    bad = ((labels < 0) | (labels >= num_classes)).nonzero()
    if len(bad):
        index = int(bad[0, 0])
        _check_label_range(where, index, int(labels[index]), num_classes)


def _check_label_range(where: str, index: int, label: int, num_classes: int) -> None:
    if not 0 <= label < num_classes:
        raise UserError(
            f"{where}: sample {index} has label {label}, outside the {num_classes} classes of its DataInfo; labels "
            f"are class indices from 0 to {num_classes - 1}."
        )


def _resize(x: torch.Tensor, size: int) -> torch.Tensor:
    return F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)


@DATASETS.register("digits", "scikit-learn 8x8 handwritten digits (1797 images, 10 classes, in memory)")
def _digits(cfg: DataConfig) -> tuple[Dataset, Dataset, DataInfo]:
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x = torch.as_tensor(np.asarray(bunch.data), dtype=torch.float32).reshape(-1, 1, 8, 8)
    y = torch.as_tensor(np.asarray(bunch.target), dtype=torch.int64)
    # A fixed generator of its own so the split never depends on train.seed or the world size.
    perm = torch.as_tensor(np.random.default_rng(0).permutation(len(x)))
    n_train = int(0.8 * len(x))
    tr, te = perm[:n_train], perm[n_train:]
    mean, std = x[tr].mean(), x[tr].std()
    x = (x - mean) / std
    size = cfg.image_size or 8
    if size != 8:
        x = _resize(x, size)
    info = DataInfo(num_classes=10, channels=1, image_size=size)
    return TensorDataset(x[tr].contiguous(), y[tr]), TensorDataset(x[te].contiguous(), y[te]), info


class SyntheticImages(Dataset):
    """Random Gaussian images generated on demand; identical for a given (split, index) everywhere.

    Args:
        split: 0 for training, 1 for validation (keeps the two sets different).
        length: Number of samples.
        channels: Image channels.
        size: Image side.
        num_classes: Labels are drawn from ``range(num_classes)``.
    """

    def __init__(self, split: int, length: int, channels: int, size: int, num_classes: int) -> None:
        self.split = split
        self.length = length
        self.shape = (channels, size, size)
        self.num_classes = num_classes

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> Sample:
        if not 0 <= index < self.length:
            raise IndexError(index)
        # Seeding from (split, index) only makes every process and every epoch see the same sample;
        # interleaving keeps the seed small, as the CPU generator only uses its low 32 bits.
        gen = torch.Generator().manual_seed(2 * index + self.split)
        label = int(torch.randint(self.num_classes, (), generator=gen))
        return torch.randn(self.shape, generator=gen), label


def _check_synthetic(cfg: DataConfig) -> None:
    for key in ("num_classes", "channels", "train_size", "val_size"):
        if getattr(cfg, key) < 1:
            raise UserError(f"data.{key}={getattr(cfg, key)} must be >= 1 for the synthetic dataset.")


@DATASETS.register("synthetic", "deterministic random images, ImageNet-shaped by default (for throughput)")
def _synthetic(cfg: DataConfig) -> tuple[Dataset, Dataset, DataInfo]:
    size = cfg.image_size or 224
    train = SyntheticImages(0, cfg.train_size, cfg.channels, size, cfg.num_classes)
    val = SyntheticImages(1, cfg.val_size, cfg.channels, size, cfg.num_classes)
    return train, val, DataInfo(num_classes=cfg.num_classes, channels=cfg.channels, image_size=size)


_CHECKS["synthetic"] = _check_synthetic


def _cifar_dir(root: str | None) -> Path:
    expected = ", ".join(CIFAR_FILES)
    if not root:
        raise UserError(f"data.root is not set; point it at the CIFAR-10 python batches ({expected}).")
    base = Path(root).expanduser()
    for cand in (base, base / "cifar-10-batches-py"):
        if all((cand / f).is_file() for f in CIFAR_FILES):
            return cand
    if not base.is_dir():
        raise UserError(f"data.root={root!r} does not exist; it must hold the CIFAR-10 batches ({expected}).")
    raise UserError(
        f"data.root={root!r} lacks CIFAR-10 files; expected {expected} there or in cifar-10-batches-py/ "
        "(never downloaded)."
    )


def _read_cifar(folder: Path, names: tuple[str, ...], root: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    xs, ys = [], []
    for name in names:
        x, y = _read_cifar_batch(folder / name, root)
        xs.append(x)
        ys.append(y)
    return torch.from_numpy(np.concatenate(xs)), torch.from_numpy(np.concatenate(ys))


def _read_cifar_batch(path: Path, root: str | None) -> tuple[np.ndarray, np.ndarray]:
    """Read one CIFAR-10 python batch; a corrupt, truncated or wrongly shaped one is a :class:`UserError`."""

    def bad(why: str) -> UserError:
        return UserError(
            f"data.root={root!r}: {str(path)!r} is not a readable CIFAR-10 python batch ({why}); replace it "
            "with the file from cifar-10-python.tar.gz."
        )

    try:
        with open(path, "rb") as fh:
            # The official batches are Python 2 pickles; bytes keys keep them readable on Python 3.
            batch = pickle.load(fh, encoding="bytes")
    except OSError as err:
        raise bad(err.strerror or type(err).__name__) from None
    except Exception as err:  # noqa: BLE001 - a damaged pickle raises almost anything (EOFError, UnpicklingError, ...)
        raise bad(f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else 'damaged'}") from None
    if not isinstance(batch, dict) or b"data" not in batch or b"labels" not in batch:
        raise bad("no data/labels")
    try:
        data = np.asarray(batch[b"data"], dtype=np.uint8)
        labels = np.asarray(batch[b"labels"], dtype=np.int64)
    except (TypeError, ValueError, OverflowError) as err:
        raise bad(f"data/labels are not numbers: {str(err).splitlines()[0]}") from None
    rows = data.size // 3072
    if data.size == 0 or data.size % 3072 or labels.shape != (rows,):
        raise bad(f"{data.size} data bytes and {labels.size} labels; expected 3072 bytes per label")
    if labels.min() < 0 or labels.max() > 9:
        raise bad("labels outside 0..9")
    return data.reshape(-1, 3, 32, 32), labels


class TransformedImages(Dataset):
    """uint8 NxCxHxW images kept in memory, turned into float tensors by ``transform`` per sample.

    Args:
        images: uint8 tensor of shape ``(N, C, H, W)``.
        labels: int64 tensor of shape ``(N,)``.
        transform: Maps one uint8 CxHxW image to a float32 tensor.
    """

    def __init__(
        self, images: torch.Tensor, labels: torch.Tensor, transform: Callable[[torch.Tensor], torch.Tensor]
    ) -> None:
        self.images = images
        self.labels = labels
        self.transform = transform

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> Sample:
        return self.transform(self.images[index]), int(self.labels[index])


def _check_cifar10(cfg: DataConfig) -> None:
    _cifar_dir(cfg.root)


@DATASETS.register("cifar10", "CIFAR-10 python batches from data.root (never downloaded)")
def _cifar10(cfg: DataConfig) -> tuple[Dataset, Dataset, DataInfo]:
    from torchvision.transforms import v2

    folder = _cifar_dir(cfg.root)
    size = cfg.image_size or 32
    tail: list[Callable[..., object]] = [] if size == 32 else [v2.Resize((size, size), antialias=True)]
    tail += [v2.ToDtype(torch.float32, scale=True), v2.Normalize(CIFAR_MEAN, CIFAR_STD), v2.ToPureTensor()]
    aug = [v2.RandomCrop(32, padding=4), v2.RandomHorizontalFlip()] if cfg.augment else []
    train_tf, val_tf = v2.Compose([*aug, *tail]), v2.Compose(tail)
    x_tr, y_tr = _read_cifar(folder, CIFAR_TRAIN_FILES, cfg.root)
    x_te, y_te = _read_cifar(folder, ("test_batch",), cfg.root)
    info = DataInfo(num_classes=10, channels=3, image_size=size)
    return TransformedImages(x_tr, y_tr, train_tf), TransformedImages(x_te, y_te, val_tf), info


_CHECKS["cifar10"] = _check_cifar10


def _class_dirs(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.is_dir())


def _check_imagefolder(cfg: DataConfig) -> None:
    if not cfg.root:
        raise UserError("data.root is not set; point it at a folder with train/<class>/ and val/<class>/.")
    base = Path(cfg.root).expanduser()
    for split in ("train", "val"):
        if not (base / split).is_dir():
            raise UserError(f"data.root={cfg.root!r} has no {split}/ folder; expected train/<class>/ and val/<class>/.")
    train_classes, val_classes = _class_dirs(base / "train"), _class_dirs(base / "val")
    if not train_classes:
        raise UserError(f"data.root={cfg.root!r}: train/ has no class sub-folders.")
    if train_classes != val_classes:
        # ImageFolder numbers classes per folder, so differing sets would silently mislabel val.
        raise UserError(f"data.root={cfg.root!r}: train/ and val/ must hold the same class sub-folders.")


class ImageLoader:
    """ImageFolder's loader: an image that cannot be decoded is a :class:`DataError` naming it and ``data.root``.

    A class rather than a closure so that DataLoader worker processes can receive it.

    Args:
        root: ``data.root`` as the recipe gives it (for the message).
    """

    def __init__(self, root: str) -> None:
        self.root = root

    def __call__(self, path: str) -> Any:
        """Return the image at ``path`` as RGB."""
        from PIL import Image

        try:
            with open(path, "rb") as fh:
                return Image.open(fh).convert("RGB")
        except (
            OSError,
            SyntaxError,
            ValueError,
            EOFError,
            struct.error,
            zlib.error,
            Image.DecompressionBombError,
        ) as err:
            if isinstance(err, Image.UnidentifiedImageError):
                why = "not an image format PIL can decode"
            else:
                why = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise DataError(
                f"data.root={self.root!r}: image {path!r} cannot be read ({why}); replace or remove it."
            ) from None


@DATASETS.register("imagefolder", "torchvision ImageFolder on data.root/{train,val} (ImageNet layout)")
def _imagefolder(cfg: DataConfig) -> tuple[Dataset, Dataset, DataInfo]:
    from torchvision.datasets import ImageFolder
    from torchvision.transforms import v2

    _check_imagefolder(cfg)
    base = Path(str(cfg.root)).expanduser()
    size = cfg.image_size or 224
    tail = [
        v2.ToImage(),
        v2.ToDtype(torch.float32, scale=True),
        v2.Normalize(IMAGENET_MEAN, IMAGENET_STD),
        v2.ToPureTensor(),
    ]
    if cfg.augment:
        head: list[Callable[..., object]] = [v2.RandomResizedCrop(size, antialias=True), v2.RandomHorizontalFlip()]
    else:
        head = [v2.Resize(size, antialias=True), v2.CenterCrop(size)]
    val_head = [v2.Resize(int(size * 256 / 224), antialias=True), v2.CenterCrop(size)]
    try:
        load = ImageLoader(str(cfg.root))
        train = ImageFolder(str(base / "train"), transform=v2.Compose([*head, *tail]), loader=load)
        val = ImageFolder(str(base / "val"), transform=v2.Compose([*val_head, *tail]), loader=load)
    except FileNotFoundError as err:
        raise UserError(f"data.root={cfg.root!r}: {str(err).splitlines()[0]}") from None
    return train, val, DataInfo(num_classes=len(train.classes), channels=3, image_size=size)


_CHECKS["imagefolder"] = _check_imagefolder


def cross_entropy(out: torch.Tensor, labels: torch.Tensor, name: str, **options: Any) -> torch.Tensor:
    """``F.cross_entropy`` of a batch of ``data.name`` (``name``); any integer labels, int64 or not.

    Building checked each set's first sample only (every label would cost a pass over the data), so a
    label outside the outputs can still come in a later batch: on the CPU it is named here. (On CUDA it
    is a device-side assert no process survives.)

    Raises:
        DataError: On the rank whose batch has the label.
    """
    try:
        return F.cross_entropy(out, labels.long(), **options)
    except IndexError as err:
        classes = out.shape[-1]
        raise DataError(
            f"data.name={name!r}: a batch has a label outside the model's {classes} classes ({err}); labels are "
            f"class indices from 0 to {classes - 1}."
        ) from None
