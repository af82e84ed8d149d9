"""Random number generators: seeding, and the states a checkpoint keeps so that a resumed run continues exactly."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def rng_state() -> dict[str, Any]:
    """Return this process's random number generator states, as tensors and numbers only.

    So that ``torch.load(..., weights_only=True)`` opens a checkpoint: numpy's and Python's
    states are tuples holding an array or 625 integers, which the safe unpickler refuses.
    """
    kind, keys, pos, has_gauss, gauss = np.random.get_state(legacy=True)
    version, words, gauss_next = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": pos,
            "gauss": [has_gauss, gauss],
        },
        "python": {"version": version, "words": torch.tensor(words, dtype=torch.int64), "gauss_next": gauss_next},
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` returned (or the tuples of checkpoints written before it)."""
    torch.set_rng_state(state["torch"])
    numpy, python = state["numpy"], state["python"]
    if isinstance(numpy, dict):
        keys = numpy["keys"].numpy().astype(np.uint32)
        numpy = (numpy["kind"], keys, numpy["pos"], *numpy["gauss"])
    np.random.set_state(numpy)
    if isinstance(python, dict):
        python = (python["version"], tuple(int(w) for w in python["words"].tolist()), python["gauss_next"])
    random.setstate(python)
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def seed_all(seed: int) -> None:
    """Seed torch, numpy and random."""
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)
