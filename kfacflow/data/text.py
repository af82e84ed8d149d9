"""Text corpora read as bytes for a language model: ``python_source`` (the standard library) and ``text_files``.

A corpus is its files in sorted relative-path order, read as bytes and joined by a NUL byte (which no
Python source holds), so the vocabulary is the 256 byte values. Which files are validation is fixed
by each file's own path (:func:`split_of`), never by the other files, the machine or ``data.text_bytes``.
What a run read is identified by its files, bytes and checksums (:func:`identity`): the standard
library differs between Python versions, and so does ``python_source``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from kfacflow import UserError
from kfacflow.configuration.schema import DataConfig
from kfacflow.data.builtin import CHECKS
from kfacflow.data.checks import DataInfo
from kfacflow.registry import DATASETS

logger = logging.getLogger(__name__)

VOCAB = 256
"""Byte values: the vocabulary of every text set."""
SEPARATOR = b"\0"
"""Between two files: a byte no source file holds, so the model can learn where a file ends."""
VAL_SHARE = 10
"""One file in ``VAL_SHARE`` (by its path's hash) is validation, and ``data.text_bytes`` gives it one byte in ten."""
NOT_STDLIB = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})
"""Folders of the standard library's tree that are not its own code: installed packages, test suites."""
TEXT_SETS = ("python_source", "text_files")


@dataclass(frozen=True)
class Corpus:
    """The bytes a text set trains and validates on, and where they came from."""

    train: bytes
    val: bytes
    files: tuple[int, int]
    """Files read into (train, val); a file cut by ``data.text_bytes`` counts."""
    source: dict[str, Any]
    """What the files are: the folder, and for ``python_source`` the Python version."""


def split_of(relative: str) -> bool:
    """Whether the file at ``relative`` (a POSIX path inside the corpus' folder) is validation.

    By a hash of the path alone: a file stays on its side when files are added, removed or capped.
    """
    return int.from_bytes(hashlib.sha256(relative.encode()).digest()[:8], "big") % VAL_SHARE == 0


def stdlib_files(root: Path) -> list[str]:
    """The standard library's own ``.py`` files under ``root``, as sorted POSIX paths relative to it.

    Installed packages, test suites (``test``, ``tests``, ``idlelib/idle_test``, ...) and links (a
    distribution's ``sitecustomize.py`` pointing into ``/etc``) are not the standard library's code.
    """
    found = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in NOT_STDLIB and not d.startswith(".")]
        for name in names:
            path = Path(folder) / name
            if name.endswith(".py") and not path.is_symlink():
                found.append(path.relative_to(root).as_posix())
    return sorted(found)


def text_files(root: Path) -> list[str]:
    """Every regular file under ``root`` but hidden ones (``.git`` and the like), as sorted relative POSIX paths."""
    found = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        found += [(Path(folder) / n).relative_to(root).as_posix() for n in names if not n.startswith(".")]
    return sorted(p for p in found if (root / p).is_file())


def read_corpus(root: Path, files: list[str], cap: int, source: dict[str, Any]) -> Corpus:
    """Join ``files`` (relative to ``root``) into the training and validation bytes.

    Files go to the side :func:`split_of` puts them on; where that leaves a side empty (a folder of a
    few files), the last file is validation, and a single file gives its last tenth. ``cap``
    (``data.text_bytes``; 0: none) keeps the first nine tenths of it from training files and a tenth
    from validation files; only the files needed are read.
    """
    val_files = [f for f in files if split_of(f)]
    train_files = [f for f in files if not split_of(f)]
    if len(files) > 1 and not (val_files and train_files):
        train_files, val_files = files[:-1], files[-1:]
    limits = (cap - cap // VAL_SHARE, cap // VAL_SHARE) if cap else (0, 0)
    if len(files) == 1:
        whole = _join(root, files, 0)[0]
        cut = len(whole) - len(whole) // VAL_SHARE
        train, val = whole[:cut], whole[cut:]
        if cap:
            train, val = train[: limits[0]], val[: limits[1]]
        return Corpus(train, val, (1, 1), source)
    (train, n_train), (val, n_val) = _join(root, train_files, limits[0]), _join(root, val_files, limits[1])
    return Corpus(train, val, (n_train, n_val), source)


def _join(root: Path, files: list[str], cap: int) -> tuple[bytes, int]:
    """``files`` read and joined by :data:`SEPARATOR`, up to ``cap`` bytes (0: all); and how many were read."""
    parts: list[bytes] = []
    size = 0
    for name in files:
        if cap and size >= cap:
            break
        parts.append((root / name).read_bytes() + SEPARATOR)
        size += len(parts[-1])
    joined = b"".join(parts)
    return (joined[:cap] if cap else joined), len(parts)


def identity(name: str, corpus: Corpus, cfg: DataConfig) -> dict[str, Any]:
    """What names the corpus a run read: its files, bytes and the sha256 of its training and validation bytes."""
    return {
        "name": name,
        **corpus.source,
        "text_bytes": cfg.text_bytes,
        "files": {"train": corpus.files[0], "val": corpus.files[1]},
        "bytes": {"train": len(corpus.train), "val": len(corpus.val)},
        "sha256": {
            "train": hashlib.sha256(corpus.train).hexdigest(),
            "val": hashlib.sha256(corpus.val).hexdigest(),
        },
    }


class Windows(Dataset):  # type: ignore[type-arg]
    """Windows of ``seq_len`` bytes of ``data`` and, as targets, the ``seq_len`` bytes one further on.

    Window ``i`` starts at byte ``i * seq_len``: the windows do not overlap, and each target but the
    last is the next window's input.

    Args:
        data: The corpus' bytes.
        seq_len: Tokens per window.
    """

    def __init__(self, data: bytes, seq_len: int) -> None:
        self.data = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.zeros(0, dtype=torch.uint8)
        self.seq_len = seq_len

    def __len__(self) -> int:
        return max(0, (len(self.data) - 1) // self.seq_len)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(index)
        start = index * self.seq_len
        chunk = self.data[start : start + self.seq_len + 1].long()
        return chunk[:-1], chunk[1:]


def check_text(cfg: DataConfig) -> None:
    """What no text set takes: augmentation and an image size.

    Raises:
        UserError: Naming the key.
    """
    if cfg.augment:
        raise UserError(
            f"data.augment=true: data.name={cfg.name} is text, which has no augmentation (random crops and flips "
            "are for images); leave data.augment out or set it to false."
        )
    if cfg.image_size:
        raise UserError(
            f"data.image_size={cfg.image_size} is the side of images; data.name={cfg.name} is text, whose samples are "
            f"windows of data.seq_len={cfg.seq_len} bytes: leave data.image_size out (0)."
        )


def stdlib_root() -> Path:
    """The standard library's folder (``sysconfig``'s ``stdlib`` path).

    Raises:
        UserError: If this Python has none there.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    if not root.is_dir() or not stdlib_files(root):
        raise UserError(
            f"data.name=python_source: this Python keeps no standard library source at {str(root)!r} (a frozen or "
            "zipped build); use data.name=text_files with data.root a folder of text files."
        )
    return root


def _check_python_source(cfg: DataConfig) -> None:
    check_text(cfg)
    stdlib_root()


def _text_root(cfg: DataConfig) -> Path:
    if not cfg.root:
        raise UserError("data.root is not set; data.name=text_files reads the text files in the folder it names.")
    root = Path(cfg.root).expanduser()
    if not root.is_dir():
        raise UserError(f"data.root={cfg.root!r} is not a folder; data.name=text_files reads the text files in one.")
    return root


def _check_text_files(cfg: DataConfig) -> None:
    check_text(cfg)
    root = _text_root(cfg)
    if not text_files(root):
        raise UserError(f"data.root={cfg.root!r} holds no file (hidden ones left out); put text files in it.")


def windows(name: str, corpus: Corpus, cfg: DataConfig) -> tuple[Dataset, Dataset, DataInfo]:  # type: ignore[type-arg]
    """The training and validation windows of ``corpus``, and its :class:`DataInfo` (logged once, on rank 0).

    Raises:
        UserError: A side too short for one window, naming ``data.seq_len`` and ``data.text_bytes``.
    """
    train, val = Windows(corpus.train, cfg.seq_len), Windows(corpus.val, cfg.seq_len)
    for split, data, size in (("training", train, len(corpus.train)), ("validation", val, len(corpus.val))):
        if len(data) == 0:
            raise UserError(
                f"data.name={name}: the {split} text is {size} bytes, too short for one window of data.seq_len="
                f"{cfg.seq_len} bytes and its next byte; lower data.seq_len, raise data.text_bytes (0 reads all) or "
                "give more text."
            )
    ident = identity(name, corpus, cfg)
    logger.info(
        "corpus %s: %d + %d files, %d + %d bytes (train + val), sha256 %s / %s",
        name,
        *corpus.files,
        len(corpus.train),
        len(corpus.val),
        ident["sha256"]["train"][:16],
        ident["sha256"]["val"][:16],
    )
    return train, val, DataInfo(num_classes=VOCAB, seq_len=cfg.seq_len, identity=ident)


@DATASETS.register("python_source", "the Python standard library's own .py files as bytes (a language model's text)")
def _python_source(cfg: DataConfig) -> tuple[Dataset, Dataset, DataInfo]:  # type: ignore[type-arg]
    _check_python_source(cfg)
    root = stdlib_root()
    source = {"root": str(root), "python": sys.version.split()[0]}
    return windows("python_source", read_corpus(root, stdlib_files(root), cfg.text_bytes, source), cfg)


@DATASETS.register("text_files", "the files in data.root as bytes, in sorted order (a language model's text)")
def _text_files(cfg: DataConfig) -> tuple[Dataset, Dataset, DataInfo]:  # type: ignore[type-arg]
    _check_text_files(cfg)
    root = _text_root(cfg)
    return windows("text_files", read_corpus(root, text_files(root), cfg.text_bytes, {"root": str(root)}), cfg)


CHECKS["python_source"] = _check_python_source
CHECKS["text_files"] = _check_text_files
