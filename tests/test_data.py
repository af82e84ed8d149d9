"""Tests for kfacflow.data.sets: digits, synthetic, fashion_mnist, cifar10 and imagefolder datasets."""

from __future__ import annotations

import pickle
from collections.abc import Callable, Sized
from pathlib import Path

import numpy as np
import pytest
import torch

from kfacflow import UserError
from kfacflow.configuration.schema import DataConfig
from kfacflow.data.sets import DataInfo, build_datasets, check_data
from kfacflow.registry import DATASETS


def _all(ds: torch.utils.data.Dataset) -> tuple[torch.Tensor, torch.Tensor]:
    xs, ys = zip(*(ds[i] for i in range(len(ds))), strict=True)  # type: ignore[arg-type]
    return torch.stack(list(xs)), torch.as_tensor([int(y) for y in ys])


def test_registry_has_entries() -> None:
    for name in ("digits", "synthetic", "fashion_mnist", "cifar10", "imagefolder"):
        assert name in DATASETS


def test_unknown_dataset() -> None:
    with pytest.raises(UserError, match="data.name"):
        check_data(DataConfig(name="digitz"))


def test_digits_split_and_stats() -> None:
    train, val, info = build_datasets(DataConfig(name="digits"))
    assert isinstance(train, Sized) and isinstance(val, Sized)
    assert info == DataInfo(num_classes=10, channels=1, image_size=8)
    assert len(train) + len(val) == 1797 and len(train) == 1437
    x, y = train[0]
    assert x.shape == (1, 8, 8) and x.dtype == torch.float32 and y.dtype == torch.int64
    xt, yt = _all(train)
    assert abs(float(xt.mean())) < 1e-4 and abs(float(xt.std()) - 1) < 1e-3
    assert set(yt.tolist()) == set(range(10))
    train2, val2, _ = build_datasets(DataConfig(name="digits"))
    assert torch.equal(xt, _all(train2)[0]) and torch.equal(_all(val)[0], _all(val2)[0])
    # Disjoint: no validation image occurs in the training set.
    tr_rows = {tuple(r.tolist()) for r in xt.flatten(1)}
    overlap = sum(tuple(r.tolist()) in tr_rows for r in _all(val)[0].flatten(1))
    assert overlap < 5  # load_digits has a few duplicate images; the index split itself is disjoint
    from sklearn.datasets import load_digits

    perm = np.random.default_rng(0).permutation(1797)
    assert set(perm[:1437]).isdisjoint(perm[1437:])
    assert torch.equal(yt, torch.as_tensor(load_digits().target[perm[:1437]]))


def test_digits_read_from_the_file_are_what_scikit_learn_loads() -> None:
    from sklearn.datasets import load_digits

    from kfacflow.data.builtin import digits_arrays

    pixels, labels = digits_arrays()
    bunch = load_digits()
    assert np.array_equal(pixels, bunch.data) and np.array_equal(labels, bunch.target)
    assert pixels.shape == (1797, 64) and labels.dtype.kind == "i"


def test_digits_resize() -> None:
    train, val, info = build_datasets(DataConfig(name="digits", image_size=16))
    assert info.image_size == 16 and train[0][0].shape == (1, 16, 16) and val[0][0].shape == (1, 16, 16)


def test_synthetic_deterministic() -> None:
    cfg = DataConfig(name="synthetic", image_size=32, channels=2, num_classes=5, train_size=10, val_size=4)
    train, val, info = build_datasets(cfg)
    assert isinstance(train, Sized) and isinstance(val, Sized)
    assert info == DataInfo(num_classes=5, channels=2, image_size=32)
    assert len(train) == 10 and len(val) == 4
    x1, y1 = train[3]
    x2, y2 = build_datasets(cfg)[0][3]
    assert x1.shape == (2, 32, 32) and x1.dtype == torch.float32
    assert torch.equal(x1, x2) and y1 == y2 and 0 <= y1 < 5
    assert not torch.equal(train[0][0], val[0][0])
    with pytest.raises(IndexError):
        train[10]


def test_synthetic_default_size() -> None:
    train, _, info = build_datasets(DataConfig(name="synthetic", train_size=2, val_size=2))
    assert info.image_size == 224 and train[1][0].shape == (3, 224, 224)


def _fake_cifar(folder: Path, rows: int = 4) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(1)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {
            b"data": rng.integers(0, 256, (rows, 3072), dtype=np.uint8),
            b"labels": rng.integers(0, 10, rows).tolist(),
        }
        with open(folder / name, "wb") as fh:
            pickle.dump(batch, fh)


@pytest.mark.parametrize("nested", [False, True])
def test_cifar10_loads(tmp_path: Path, nested: bool) -> None:
    _fake_cifar(tmp_path / "cifar-10-batches-py" if nested else tmp_path)
    train, val, info = build_datasets(DataConfig(name="cifar10", root=str(tmp_path)))
    assert isinstance(train, Sized) and isinstance(val, Sized)
    assert info == DataInfo(num_classes=10, channels=3, image_size=32)
    assert len(train) == 20 and len(val) == 4
    x, y = train[0]
    assert x.shape == (3, 32, 32) and x.dtype == torch.float32 and 0 <= y < 10
    assert type(x) is torch.Tensor
    # Without augmentation training samples are deterministic and equal the plain transform.
    cfg = DataConfig(name="cifar10", root=str(tmp_path), augment=False, image_size=40)
    train_na, _, _ = build_datasets(cfg)
    assert train_na[0][0].shape == (3, 40, 40) and torch.equal(train_na[0][0], train_na[0][0])


def test_cifar10_missing(tmp_path: Path) -> None:
    for root in (None, str(tmp_path / "nope"), str(tmp_path)):
        with pytest.raises(UserError, match="data.root") as err:
            check_data(DataConfig(name="cifar10", root=root))
        assert "data_batch_1" in str(err.value) and "\n" not in str(err.value)
    _fake_cifar(tmp_path)
    (tmp_path / "test_batch").unlink()
    with pytest.raises(UserError, match="data_batch_1"):
        build_datasets(DataConfig(name="cifar10", root=str(tmp_path)))


def _write_pickle(path: Path, obj: object) -> None:
    path.write_bytes(pickle.dumps(obj))


@pytest.mark.parametrize(
    ("damage", "must"),
    [
        (lambda p: p.write_bytes(p.read_bytes()[:200]), "data_batch_3"),  # truncated: EOFError/UnpicklingError
        (lambda p: p.write_bytes(b"\x00garbage" * 10), "UnpicklingError"),
        (lambda p: p.write_bytes(b""), "EOFError"),
        (lambda p: _write_pickle(p, {b"data": np.zeros((4, 3000), np.uint8), b"labels": [0] * 4}), "3072"),
        (lambda p: _write_pickle(p, {b"data": np.zeros((4, 3072), np.uint8), b"labels": [0] * 3}), "3 labels"),
        (lambda p: _write_pickle(p, {b"data": np.zeros((4, 3072), np.uint8), b"labels": [0, 1, 2, 10]}), "0..9"),
        (lambda p: _write_pickle(p, {b"data": [["x"] * 3072] * 4, b"labels": [0] * 4}), "not numbers"),
        (lambda p: _write_pickle(p, [1, 2]), "no data/labels"),
    ],
    ids=["truncated", "garbage", "empty", "wrong-size", "label-count", "label-range", "not-numbers", "not-a-dict"],
)
def test_cifar10_corrupt_batch_is_one_line(tmp_path: Path, damage: Callable[[Path], None], must: str) -> None:
    _fake_cifar(tmp_path)
    damage(tmp_path / "data_batch_3")
    with pytest.raises(UserError) as err:
        build_datasets(DataConfig(name="cifar10", root=str(tmp_path)))
    message = str(err.value)
    assert message.startswith(f"data.root={str(tmp_path)!r}") and "data_batch_3" in message, message
    assert must in message and "\n" not in message, message


def _fake_folder(root: Path, splits: tuple[str, ...] = ("train", "val")) -> None:
    from PIL import Image

    rng = np.random.default_rng(2)
    for split in splits:
        for cls in ("a", "b"):
            (root / split / cls).mkdir(parents=True)
            for i in range(2):
                img = rng.integers(0, 256, (12, 10, 3), dtype=np.uint8)
                Image.fromarray(img).save(root / split / cls / f"{i}.png")


@pytest.mark.parametrize("augment", [True, False])
def test_imagefolder_loads(tmp_path: Path, augment: bool) -> None:
    _fake_folder(tmp_path)
    train, val, info = build_datasets(DataConfig(name="imagefolder", root=str(tmp_path), image_size=8, augment=augment))
    assert isinstance(train, Sized) and isinstance(val, Sized)
    assert info == DataInfo(num_classes=2, channels=3, image_size=8)
    assert len(train) == 4 and len(val) == 4
    x, y = train[0]
    assert x.shape == (3, 8, 8) and x.dtype == torch.float32 and y in (0, 1)
    assert val[3][0].shape == (3, 8, 8) and val[3][1] == 1


def test_imagefolder_missing(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="data.root"):
        check_data(DataConfig(name="imagefolder"))
    _fake_folder(tmp_path, ("train",))
    with pytest.raises(UserError, match="data.root.*val/"):
        check_data(DataConfig(name="imagefolder", root=str(tmp_path)))


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 1])
@pytest.mark.parametrize(
    ("keep", "why"), [(100, "image file is truncated"), (0, "not an image format")], ids=["truncated", "not-an-image"]
)
def test_imagefolder_undecodable_image_is_one_line(tmp_path: Path, workers: int, keep: int, why: str) -> None:
    _fake_folder(tmp_path)
    bad = tmp_path / "train" / "b" / "1.png"
    # Truncated: the PNG header is there, its pixels are not. Otherwise: text where an image should be.
    bad.write_bytes(bad.read_bytes()[:keep] if keep else b"not a png")
    train, _, _ = build_datasets(DataConfig(name="imagefolder", root=str(tmp_path), image_size=8))
    loader = torch.utils.data.DataLoader(train, batch_size=4, num_workers=workers)
    with pytest.raises(UserError) as err:
        list(loader)
    message = str(err.value)
    assert message.startswith(f"data.root={str(tmp_path)!r}: image {str(bad)!r} cannot be read"), message
    assert why in message and "\n" not in message and "Caught" not in message, message


def test_user_error_from_a_loader_worker_keeps_its_line() -> None:
    text = (
        "Caught UserError in DataLoader worker process 3.\nOriginal Traceback (most recent call last):\n"
        '  File "x.py", line 1, in f\n    raise UserError("data.root=\'r\': bad")\n'
        "kfacflow.UserError: data.root='r': bad: really\n"
    )
    assert str(UserError(text)) == "data.root='r': bad: really"
    assert str(UserError("Caught my eye")) == "Caught my eye"


def test_every_label_of_a_tensor_dataset_is_checked() -> None:
    from torch.utils.data import TensorDataset

    from kfacflow.data.checks import check_sets

    x, y = torch.zeros(64, 1, 2, 2), torch.zeros(64, dtype=torch.int64)
    info = DataInfo(num_classes=3, channels=1, image_size=2)
    check_sets("mine:data", TensorDataset(x, y), TensorDataset(x, y), info)
    y[40] = 3  # sample 0 is fine: only a look at every label finds it, at no cost for tensors in memory
    with pytest.raises(UserError, match=r"data.name='mine:data': the validation set: sample 40 has label 3, outside"):
        check_sets("mine:data", TensorDataset(x, y.clone().zero_()), TensorDataset(x, y), info)
    with pytest.raises(UserError, match=r"DataInfo.channels=0 must be an int >= 1"):
        check_sets("mine:data", TensorDataset(x, y), TensorDataset(x, y), DataInfo(3, 0, 2))


def _write_fashion(folder: Path, n_train: int = 12, n_val: int = 5, gz: bool = True) -> dict[str, np.ndarray]:
    """Small Fashion-MNIST IDX files of known values (images: pixel (i, j) of image k is (k + i + j) % 256)."""
    from kfacflow.data import idx

    folder.mkdir(parents=True, exist_ok=True)
    k, i, j = np.ogrid[: n_train + n_val, :28, :28]
    images = ((k + i + j) % 256).astype(np.uint8)
    labels = (np.arange(n_train + n_val) % 10).astype(np.uint8)
    sets = {"train-images-idx3-ubyte": images[:n_train], "train-labels-idx1-ubyte": labels[:n_train]}
    sets |= {"t10k-images-idx3-ubyte": images[n_train:], "t10k-labels-idx1-ubyte": labels[n_train:]}
    for name, values in sets.items():
        idx.write(folder / (f"{name}.gz" if gz else name), values)
    return sets


def test_idx_round_trip_and_header(tmp_path: Path) -> None:
    from kfacflow.data import idx

    values = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    idx.write(tmp_path / "a", values)
    # The format by hand: 0, 0, type 0x08, 3 dimensions, then 2, 3, 4 as big-endian 4-byte integers.
    assert (tmp_path / "a").read_bytes() == bytes([0, 0, 8, 3, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0, 4, *range(24)])
    idx.write(tmp_path / "a.gz", values)
    assert np.array_equal(idx.read(tmp_path / "a"), values) and np.array_equal(idx.read(tmp_path / "a.gz"), values)
    (tmp_path / "b").write_bytes(bytes([0, 0, 8, 1, 0, 0, 0, 5, 1, 2]))
    with pytest.raises(idx.IDXError, match="2 values where the header says 5"):
        idx.read(tmp_path / "b")


@pytest.mark.parametrize(("nested", "gz"), [(False, True), (True, False)])
def test_fashion_mnist_loads(tmp_path: Path, nested: bool, gz: bool) -> None:
    folder = tmp_path / "FashionMNIST" / "raw" if nested else tmp_path
    sets = _write_fashion(folder, gz=gz)
    train, val, info = build_datasets(DataConfig(name="fashion_mnist", root=str(tmp_path), augment=False))
    assert info == DataInfo(num_classes=10, channels=1, image_size=28)
    assert len(train) == 12 and len(val) == 5  # type: ignore[arg-type]
    x, y = _all(val)
    raw = torch.from_numpy(sets["t10k-images-idx3-ubyte"]).float().unsqueeze(1)
    assert torch.allclose(x, (raw / 255 - 0.2860) / 0.3530) and y.tolist() == [2, 3, 4, 5, 6]
    augmented, _, _ = build_datasets(DataConfig(name="fashion_mnist", root=str(tmp_path), image_size=32))
    assert augmented[0][0].shape == (1, 32, 32) and augmented[0][0].dtype == torch.float32


def test_fashion_mnist_missing_or_damaged_files_are_one_line(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"data.root is not set.*fetch_fashion_mnist.py"):
        check_data(DataConfig(name="fashion_mnist"))
    with pytest.raises(UserError, match=r"does not exist; Fashion-MNIST needs train-images-idx3-ubyte\[.gz\]"):
        check_data(DataConfig(name="fashion_mnist", root=str(tmp_path / "nowhere")))
    _write_fashion(tmp_path)
    (tmp_path / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(UserError, match="lacks them"):
        check_data(DataConfig(name="fashion_mnist", root=str(tmp_path)))
    (tmp_path / "t10k-labels-idx1-ubyte.gz").write_bytes(b"not gzip")
    with pytest.raises(UserError, match=r"t10k-labels-idx1-ubyte.gz' is not a readable IDX file"):
        build_datasets(DataConfig(name="fashion_mnist", root=str(tmp_path)))
