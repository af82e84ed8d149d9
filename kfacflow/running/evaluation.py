"""Evaluation on the validation set: loss and accuracy summed over every rank's share.

The model and its moving average (``train.ema``), which is evaluated beside it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import Tensor, nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from kfacflow.comm.base import Backend
from kfacflow.data.checks import cross_entropy
from kfacflow.running.precision import MixedPrecision


def evaluate(
    nets: Mapping[str, nn.Module | None],
    loader: Iterable[tuple[Tensor, Tensor]],
    backend: Backend,
    precision: MixedPrecision,
    data: str,
    memory_format: torch.memory_format,
    dtype: torch.dtype,
) -> dict[str, float]:
    """Return ``val_loss<suffix>`` and ``val_acc<suffix>`` for each network (by suffix; ``None`` is left out).

    Collective: one all-reduce per network, so every rank gets the same numbers.
    """
    record: dict[str, float] = {}
    device = backend.device
    for suffix, net in nets.items():
        if net is None:
            continue
        net.eval()
        sums = torch.zeros(3, dtype=torch.float64, device=device)
        for x, y in loader:
            x, y = x.to(device, dtype, memory_format=memory_format), y.to(device)
            with precision.autocast():
                out = net(x).float()
            loss = cross_entropy(out, y, data, reduction="sum").double()
            sums += torch.stack([loss, (out.argmax(1) == y).sum().double(), torch.ones_like(loss) * y.shape[0]])
        total = backend.allreduce_sum(sums).cpu()
        n = max(float(total[2]), 1.0)
        record |= {f"val_loss{suffix}": float(total[0]) / n, f"val_acc{suffix}": float(total[1]) / n}
    return record


def moving_average(model: nn.Module, decay: float) -> AveragedModel | None:
    """The moving average of ``model``'s weights and buffers (``train.ema``), or ``None`` where ``decay`` is 0."""
    return AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(decay), use_buffers=True) if decay > 0 else None
