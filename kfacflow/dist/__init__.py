"""Communication backends behind one small interface (:class:`kfacflow.dist.base.Backend`)."""

from __future__ import annotations

from kfacflow.dist import torch as torch_backend  # noqa: F401  (registers "torch")
