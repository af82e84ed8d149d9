"""What the model takes from a data set (``DataInfo``) and the checks that it can take the sets and batches."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import IterableDataset, TensorDataset

from kfacflow import DataError, UserError
from kfacflow.usercode import UserCodeError, first_line


@dataclass(frozen=True)
class DataInfo:
    """What the model builder needs to know about a dataset: images (the default), or token sequences.

    ``DataInfo(num_classes, channels, image_size)`` describes images; ``DataInfo(num_classes=256, seq_len=128)``
    token windows, whose samples are ``(int64 tensor of seq_len token ids, int64 tensor of the next seq_len)``
    and whose ``num_classes`` is the vocabulary.
    """

    num_classes: int
    channels: int = 1
    image_size: int = 0
    seq_len: int = 0
    """Tokens per sample for token data (a language model's windows); 0: the samples are images."""
    identity: dict[str, Any] | None = field(default=None, compare=False, repr=False)
    """What identifies the data a run read, where the set can tell (a corpus' files, bytes and checksums):
    written to the run folder's ``data.json``."""

    @property
    def tokens(self) -> bool:
        """Whether the samples are token windows rather than images."""
        return self.seq_len > 0


def shown(info: DataInfo) -> str:
    """The samples of ``info`` as a message names them: ``1x28x28 images``, ``windows of 128 tokens``."""
    if info.tokens:
        return f"windows of {info.seq_len} tokens"
    return f"{info.channels}x{info.image_size}x{info.image_size} images"


def check_sets(name: str, train: Any, val: Any, info: DataInfo, own: bool = True) -> None:
    """Check once, cheaply, that the model can take what the sets hold (their first sample; a set of tensors whole).

    Both sets must be map-style (the samplers shard them by index) and not empty, and their samples
    ``(C x H x W tensor, int label)`` with the channels and a label below the classes of ``info``; for token
    data (``info.seq_len``) ``(int64 tensor [seq_len], int64 tensor [seq_len])`` with ids below the vocabulary.

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
    for attr in ("num_classes", "seq_len") if info.tokens else ("num_classes", "channels", "image_size"):
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
    if info.tokens:
        _check_token_sample(where, sample, info)
        return
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


def _check_token_sample(where: str, sample: Any, info: DataInfo) -> None:
    """A token window: ``(int64 tensor [seq_len], int64 tensor [seq_len])``, every id below the vocabulary."""
    shape = f"(int64 tensor of {info.seq_len} token ids, int64 tensor of the {info.seq_len} next ones)"
    if not (isinstance(sample, (tuple, list)) and len(sample) == 2):
        raise UserError(f"{where}: sample 0 is a {type(sample).__name__}; token samples are {shape}.")
    for part, ids in zip(("inputs", "targets"), sample, strict=True):
        if not isinstance(ids, torch.Tensor) or ids.dtype != torch.int64 or tuple(ids.shape) != (info.seq_len,):
            tensor = isinstance(ids, torch.Tensor)
            what = f"{ids.dtype} tensor of shape {tuple(ids.shape)}" if tensor else repr(ids)[:40]
            raise UserError(
                f"{where}: the {part} of sample 0 are {what}, but its DataInfo.seq_len={info.seq_len} asks for {shape}."
            )
        low, high = (int(ids.min()), int(ids.max())) if len(ids) else (0, 0)
        if not 0 <= low <= high < info.num_classes:
            raise UserError(
                f"{where}: the {part} of sample 0 hold token ids from {low} to {high}, outside the vocabulary of its "
                f"DataInfo (num_classes={info.num_classes}: ids 0 to {info.num_classes - 1})."
            )


def _check_labels(where: str, labels: torch.Tensor, num_classes: int) -> None:
    bad = ((labels < 0) | (labels >= num_classes)).reshape(len(labels), -1)  # a sample's row: its targets
    rows = bad.any(1).nonzero()
    if len(rows):
        index = int(rows[0, 0])
        _check_label_range(where, index, int(labels[index].reshape(-1)[bad[index]][0]), num_classes)


def _check_label_range(where: str, index: int, label: int, num_classes: int) -> None:
    if not 0 <= label < num_classes:
        raise UserError(
            f"{where}: sample {index} has label {label}, outside the {num_classes} classes of its DataInfo; labels "
            f"are class indices from 0 to {num_classes - 1}."
        )


def cross_entropy(out: torch.Tensor, labels: torch.Tensor, name: str, **options: Any) -> torch.Tensor:
    """``F.cross_entropy`` of a batch of ``data.name`` (``name``); any integer labels, int64 or not.

    A language model's logits ``(B, T, V)`` against targets ``(B, T)`` are the mean over every position
    (a sum with ``reduction="sum"``).

    Building checked each set's first sample only (every label would cost a pass over the data), so a
    label outside the outputs can still come in a later batch: on the CPU it is named here. (On CUDA it
    is a device-side assert no process survives.)

    Raises:
        DataError: On the rank whose batch has the label.
    """
    if out.ndim == labels.ndim + 1 > 2:  # a logit per position (B, T, V) against (B, T) targets: every position
        out, labels = out.reshape(-1, out.shape[-1]), labels.reshape(-1)
    try:
        return F.cross_entropy(out, labels.long(), **options)
    except IndexError as err:
        classes = out.shape[-1]
        raise DataError(
            f"data.name={name!r}: a batch has a label outside the model's {classes} classes ({err}); labels are "
            f"class indices from 0 to {classes - 1}."
        ) from None
