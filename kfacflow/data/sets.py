"""Data sets by ``data.name``: checked before any worker starts, built, checked that the model can take them."""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Callable

from torch.utils.data import Dataset

from kfacflow import UserError
from kfacflow.configuration.schema import DataConfig
from kfacflow.data import text  # noqa: F401 - registers the text sets beside the built-in image ones
from kfacflow.data.builtin import CHECKS
from kfacflow.data.checks import DataInfo, check_sets
from kfacflow.registry import DATASETS
from kfacflow.usercode import call_factory

__all__ = ["DataInfo", "build_datasets", "check_data", "check_shard"]

logger = logging.getLogger(__name__)

Builder = Callable[[DataConfig], "tuple[Dataset, Dataset, DataInfo]"]


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
    check = CHECKS.get(cfg.name)
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
        ``(train, val, info)``; samples are ``(float32 CxHxW tensor, int64 label)``, or for a text set
        ``(int64 tensor of data.seq_len token ids, int64 tensor of the next ones)``.

    Raises:
        UserError: As :func:`check_data`.
    """
    check_data(cfg)
    builder: Builder = DATASETS.get(cfg.name)  # type: ignore[assignment]
    own = ":" in cfg.name  # the user's module.path:factory
    if own and cfg.augment is None:  # the user's factory reads true, as it did before the key could be empty
        cfg = copy.copy(cfg)
        cfg.augment = True
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
