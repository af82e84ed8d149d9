from __future__ import annotations

import pytest
import torch
from helpers import run_in_gloo

from kfacflow.comm.torch_dist import TorchBackend
from kfacflow.configuration.schema import DistConfig


def _sum_ranks(rank: int, world: int) -> float:
    backend = TorchBackend(DistConfig())
    t = torch.tensor([float(rank + 1)])
    backend.allreduce_async(t).wait()
    backend.close()
    return float(t)


@pytest.mark.slow
def test_allreduce_in_real_gloo_group() -> None:
    assert run_in_gloo(_sum_ranks, 3) == [6.0, 6.0, 6.0]
