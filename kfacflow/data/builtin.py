"""The built-in datasets of ``registry.DATASETS`` (digits, synthetic, fashion_mnist, cifar10, imagefolder)."""

from __future__ import annotations

import importlib.util
import pickle
import struct
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset, TensorDataset

from kfacflow import DataError, UserError
from kfacflow.configuration.schema import DataConfig
from kfacflow.data import idx
from kfacflow.data.checks import DataInfo
from kfacflow.registry import DATASETS

Sample = tuple[torch.Tensor, int]

CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
FASHION_MEAN, FASHION_STD = 0.2860, 0.3530
FASHION_FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "val_images": "t10k-images-idx3-ubyte",
    "val_labels": "t10k-labels-idx1-ubyte",
}
FASHION_FETCH = "python tools/fetch_fashion_mnist.py --out DIR"
CIFAR_TRAIN_FILES = tuple(f"data_batch_{i}" for i in range(1, 6))
CIFAR_FILES = (*CIFAR_TRAIN_FILES, "test_batch")

CHECKS: dict[str, Callable[[DataConfig], None]] = {}
"""Optional cheap per-dataset checks (folders, expected files), run by ``data.check_data`` before any worker starts."""


def _resize(x: torch.Tensor, size: int) -> torch.Tensor:
    return F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)


def digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits as ``(1797 x 64 pixels, 1797 labels)``, what ``load_digits()`` gives.

    Read from the file scikit-learn ships, without importing it: importing ``sklearn.datasets``
    takes about a second of CPU in every worker of every run, most of a small run's start.
    """
    spec = importlib.util.find_spec("sklearn")
    folders = spec.submodule_search_locations if spec is not None else None
    path = Path(folders[0]) / "datasets" / "data" / "digits.csv.gz" if folders else None
    if path is None or not path.is_file():  # another layout: scikit-learn's own loader
        from sklearn.datasets import load_digits

        bunch = load_digits()
        return np.asarray(bunch.data), np.asarray(bunch.target)
    data = np.loadtxt(path, delimiter=",")
    return data[:, :-1], data[:, -1].astype(int)


@DATASETS.register("digits", "scikit-learn 8x8 handwritten digits (1797 images, 10 classes, in memory)")
def _digits(cfg: DataConfig) -> tuple[Dataset, Dataset, DataInfo]:
    pixels, labels = digits_arrays()
    x = torch.as_tensor(pixels, dtype=torch.float32).reshape(-1, 1, 8, 8)
    y = torch.as_tensor(labels, dtype=torch.int64)
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


CHECKS["synthetic"] = _check_synthetic


def _fashion_files(root: str | None) -> dict[str, Path]:
    """The four IDX files (gzipped or not) in ``root`` or torchvision's ``FashionMNIST/raw`` below it."""
    names = ", ".join(f"{name}[.gz]" for name in FASHION_FILES.values())
    if not root:
        raise UserError(
            f"data.root is not set; point it at the Fashion-MNIST IDX files ({names}); {FASHION_FETCH} writes them."
        )
    base = Path(root).expanduser()
    for folder in (base, base / "FashionMNIST" / "raw"):
        found = {}
        for key, name in FASHION_FILES.items():
            path = next((p for p in (folder / f"{name}.gz", folder / name) if p.is_file()), None)
            if path is not None:
                found[key] = path
        if len(found) == len(FASHION_FILES):
            return found
    where = "does not exist" if not base.is_dir() else "lacks them"
    raise UserError(
        f"data.root={root!r} {where}; Fashion-MNIST needs {names} there (never downloaded at run time: "
        f"{FASHION_FETCH} writes them, or use the files from the dataset's site as they are)."
    )


def _read_fashion(path: Path, root: str | None, images: bool) -> np.ndarray:
    try:
        values = idx.read(path)
    except (OSError, EOFError, idx.IDXError) as err:
        why = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise UserError(
            f"data.root={root!r}: {str(path)!r} is not a readable IDX file ({why}); replace it ({FASHION_FETCH})."
        ) from None
    want = (3, "N x 28 x 28 images") if images else (1, "N labels")
    if values.ndim != want[0] or (images and values.shape[1:] != (28, 28)) or (not images and values.max() > 9):
        raise UserError(f"data.root={root!r}: {str(path)!r} holds shape {values.shape}, not {want[1]} (labels 0..9).")
    return values


def _check_fashion(cfg: DataConfig) -> None:
    _fashion_files(cfg.root)


@DATASETS.register("fashion_mnist", "Fashion-MNIST IDX files from data.root (tools/fetch_fashion_mnist.py writes them)")
def _fashion_mnist(cfg: DataConfig) -> tuple[Dataset, Dataset, DataInfo]:
    files = _fashion_files(cfg.root)
    split = {key: _read_fashion(path, cfg.root, key.endswith("images")) for key, path in files.items()}
    for part in ("train", "val"):
        if len(split[f"{part}_images"]) != len(split[f"{part}_labels"]):
            raise UserError(f"data.root={cfg.root!r}: {part} images and labels differ in number; replace the files.")
    size = cfg.image_size or 28
    info = DataInfo(num_classes=10, channels=1, image_size=size)
    sets: list[Dataset] = []
    for part in ("train", "val"):
        x = torch.from_numpy(split[f"{part}_images"].copy()).unsqueeze(1)
        y = torch.from_numpy(split[f"{part}_labels"].astype(np.int64))
        if part == "train" and cfg.augment is not False:  # empty (the default) augments
            from torchvision.transforms import v2

            tail = [] if size == 28 else [v2.Resize((size, size), antialias=True)]
            tf = v2.Compose(
                [
                    v2.RandomCrop(28, padding=2),
                    v2.RandomHorizontalFlip(),
                    *tail,
                    v2.ToDtype(torch.float32, scale=True),
                    v2.Normalize([FASHION_MEAN], [FASHION_STD]),
                    v2.ToPureTensor(),
                ]
            )
            sets.append(TransformedImages(x, y, tf))
            continue
        # Without augmentation the whole set is one float tensor: no per-sample work in the loader.
        images = (x.float() / 255 - FASHION_MEAN) / FASHION_STD
        sets.append(TensorDataset(images if size == 28 else _resize(images, size), y))
    return sets[0], sets[1], info


CHECKS["fashion_mnist"] = _check_fashion


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
    aug = [v2.RandomCrop(32, padding=4), v2.RandomHorizontalFlip()] if cfg.augment is not False else []
    train_tf, val_tf = v2.Compose([*aug, *tail]), v2.Compose(tail)
    x_tr, y_tr = _read_cifar(folder, CIFAR_TRAIN_FILES, cfg.root)
    x_te, y_te = _read_cifar(folder, ("test_batch",), cfg.root)
    info = DataInfo(num_classes=10, channels=3, image_size=size)
    return TransformedImages(x_tr, y_tr, train_tf), TransformedImages(x_te, y_te, val_tf), info


CHECKS["cifar10"] = _check_cifar10


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
    if cfg.augment is not False:
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


CHECKS["imagefolder"] = _check_imagefolder
