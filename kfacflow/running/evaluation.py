"""Evaluation on the validation set: loss and accuracy summed over every rank's share.

The model and its moving average (``train.ema``), which is evaluated beside it.
"""

from __future__ import annotations

import math
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
    tokens: bool = False,
) -> dict[str, float]:
    """Return ``val_loss<suffix>`` and ``val_acc<suffix>`` for each network (by suffix; ``None`` is left out).

    For a language model (``tokens``: targets ``(B, T)``, a token per position) both are means over tokens,
    and ``val_ppl<suffix>``, the perplexity ``exp(val_loss)``, comes with them.

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
            x, y = inputs(x, device, dtype, memory_format), y.to(device)
            with precision.autocast():
                out = net(x).float()
            loss = cross_entropy(out, y, data, reduction="sum").double()
            sums += torch.stack([loss, (out.argmax(-1) == y).sum().double(), torch.ones_like(loss) * y.numel()])
        total = backend.allreduce_sum(sums).cpu()
        n = max(float(total[2]), 1.0)
        record |= {f"val_loss{suffix}": float(total[0]) / n, f"val_acc{suffix}": float(total[1]) / n}
        if tokens:
            record[f"val_ppl{suffix}"] = perplexity(record[f"val_loss{suffix}"])
    return record


def perplexity(loss: float) -> float:
    """``exp(loss)`` of a mean loss per token; ``inf`` where that overflows (a diverged model)."""
    return math.inf if loss > 700 else math.exp(loss)


def inputs(x: Tensor, device: torch.device, dtype: torch.dtype, memory_format: torch.memory_format) -> Tensor:
    """A batch's inputs on ``device``: images in the model's ``dtype`` and memory format, token ids as they are."""
    if x.is_floating_point():
        return x.to(device, dtype, non_blocking=True, memory_format=memory_format)
    return x.to(device, non_blocking=True)


def moving_average(model: nn.Module, decay: float) -> AveragedModel | None:
    """The moving average of ``model``'s weights and buffers (``train.ema``), or ``None`` where ``decay`` is 0."""
    return AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(decay), use_buffers=True) if decay > 0 else None
