"""Whether a step is kept: the one small all-reduce a step that every rank decides on alike."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kfacflow.comm.base import Backend


@dataclass(frozen=True)
class Verdict:
    """What every rank learns from a step's all-reduce."""

    skip: bool
    """Some rank's loss or update is not finite: no rank applies the step, so ranks never diverge."""
    stop: bool
    """Some rank was asked to stop (a signal): every rank stops after this step."""
    bad_ranks: int
    """How many ranks had a non-finite loss or update."""
    loss_finite: bool
    """Whether every rank's loss was finite (a skip then comes from the update alone)."""
    totals: Tensor
    """The ranks' ``stats`` summed (on the CPU)."""


def agree(backend: Backend, finite_update: bool, stats: Tensor, stop_requested: int) -> Verdict:
    """Sum, over every rank, whether the step must be skipped and whether to stop, with ``stats`` (the metrics).

    Args:
        backend: The ranks.
        finite_update: Whether this rank's update is finite.
        stats: This rank's loss sum, correct predictions and samples (float64, on the device); a non-finite
            loss sum is a non-finite loss.
        stop_requested: The signal this rank was asked to stop by, or 0.
    """
    bad_loss = ~torch.isfinite(stats[0])
    bad = torch.logical_or(bad_loss, torch.tensor(not finite_update, device=stats.device))
    head = torch.stack([bad.double(), stats.new_tensor(float(stop_requested)), bad_loss.double()])
    flags = backend.allreduce_sum(torch.cat([head, stats])).cpu()  # the step's one read of the device
    return Verdict(bool(flags[0] > 0), bool(flags[1] > 0), int(flags[0]), bool(flags[2] == 0), flags[3:])
