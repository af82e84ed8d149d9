"""Communication backends behind one small interface (:class:`kfacflow.dist.base.Backend`)."""

from __future__ import annotations

from typing import Any

from kfacflow.config import DistConfig
from kfacflow.dist import torch as torch_backend  # noqa: F401  (registers "torch")
from kfacflow.registry import BACKENDS


def _horovod(cfg: DistConfig) -> Any:
    from kfacflow.dist.horovod import HorovodBackend  # Horovod is imported only when chosen

    return HorovodBackend(cfg)


BACKENDS.add("horovod", _horovod, "Horovod (horovodrun): async all-reduce/broadcast, DistributedOptimizer")
