"""K-FAC's part of a checkpoint: what is saved, and the checks that a saved state fits this model."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from kfacflow import UserError
from kfacflow.kfac.stages.contracts import Inverse

if TYPE_CHECKING:
    from kfacflow.kfac.hooks.capture import Capture
    from kfacflow.kfac.stages.contracts import FactorSlot


def state_of(inverses: dict[str, Inverse], running: dict[str, Tensor], steps: int, capture: Capture) -> dict[str, Any]:
    """Factors, inverses, the step counter and the layers in use.

    ``inverses`` and ``running``: every one, on this rank. Where owners alone hold their inverses
    (``kfac.broadcast=update``) or running averages (``kfac.factor_sync=owner``), the owners send
    theirs to every rank first (collective), so that the checkpoint (rank 0's) holds them all.
    """
    return {
        "steps": steps,
        "factors": dict(running),
        "inverses": {k: (v.kind, v.tensors) for k, v in inverses.items()},
        "layers": dict(capture.uses) if capture.uses is not None else None,
        "passes": capture.passes,
    }


def check_layers(state: dict[str, Any], names: set[str]) -> None:
    """Check that the checkpoint preconditions no layer this run does not (``names``: this model's).

    Raises:
        UserError: Naming some of them.
    """
    missing = sorted(set(state.get("layers") or ()) - names)
    if missing:
        raise UserError(
            f"resume: the checkpoint preconditions layers this run does not ({', '.join(missing[:3])}); "
            "resume with the run's own model and kfac.skip, or start a new run."
        )


def check_factors(state: dict[str, Any], slots: list[FactorSlot]) -> None:
    """Check that every saved running average is of one of ``slots``, and of its size.

    Raises:
        UserError: Naming the first that is not.
    """
    dims = {slot.key: slot.dim for slot in slots}
    for key, packed in state["factors"].items():
        if key not in dims or packed.numel() != dims[key] * (dims[key] + 1) // 2:
            raise UserError(
                f"resume: the checkpoint's K-FAC factor {key!r} does not fit this model's layers "
                "(model.name or kfac.skip changed?); resume with the run's own settings, or start a new run."
            )


def restored(
    state: dict[str, Any],
    device: torch.device,
    dtypes: tuple[torch.dtype, torch.dtype],
    holds: Callable[[str], bool],
) -> tuple[dict[str, Tensor], dict[str, Inverse]]:
    """The saved running averages and the inverses this rank ``holds``, on ``device`` in ``dtypes`` (factors, inverses).

    A checkpoint is read onto the CPU, and may come from a run that held its factors in other
    dtypes (``kfac.factor_dtype``, ``kfac.inverse_dtype``).
    """
    running = {k: v.to(device, dtypes[0], copy=True) for k, v in state["factors"].items()}
    inverses = {
        k: Inverse.restore(kind, [t.to(device, dtypes[1]) for t in ts])
        for k, (kind, ts) in state["inverses"].items()
        if holds(k)
    }
    return running, inverses
