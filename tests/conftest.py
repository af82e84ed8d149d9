"""Fixtures shared by the test files."""

from __future__ import annotations

import pytest
from helpers import local_backend

from kfacflow.comm.torch_dist import TorchBackend


@pytest.fixture
def backend(monkeypatch: pytest.MonkeyPatch) -> TorchBackend:
    """A one-process engine on the CPU."""
    made = local_backend(monkeypatch)
    assert made.world_size == 1 and made.rank == 0
    return made
