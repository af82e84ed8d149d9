"""What the first capturing step learns of the model: the layers that run, their calls per pass, its passes per step.

With several ranks, each rank's own is gathered with the order of its factors
(:class:`~kfacflow.kfac.hooks.handover.Handover`) and merged, so that every rank keeps the same layers: a
layer that ran with a gradient on some rank (an expert of a mixture of experts that no token of
another rank's batch went to) is kept on every rank.
"""

from __future__ import annotations

import logging

from kfacflow import UserError
from kfacflow.kfac.hooks.layer_sums import LayerCapture
from kfacflow.kfac.layers import KFACLayer
from kfacflow.kfac.stages.contracts import layer_of

logger = logging.getLogger(__name__)

NOT_CALLED = (
    "K-FAC: the model itself was not called (only its methods or submodules, e.g. encode_image): each layer counts "
    "its examples by its input's first dimension, which is wrong for a layer that sees (S, N, E); call the model's "
    "forward (e.g. model(image, text)) to count them by its input"
)
"""Said once where a step's layers ran but the model's own forward did not (its hooks give the batch's examples)."""


def recomputed(layer: str, passes: int | None) -> UserError:
    """A layer ran forward in the backward pass, or after the step's last forward pass."""
    return UserError(
        f"kfac: layer {layer!r} ran forward during the backward pass, or after the step's last forward pass "
        f"({passes} per step): K-FAC cannot tell a recomputation (activation checkpointing) or an extra forward "
        f"from a new pass. Turn checkpointing off, or add {layer!r} to kfac.skip."
    )


def more_calls(layer: str, calls: int, uses: int) -> UserError:
    """A layer ran more often in one forward pass than in the first step's."""
    return UserError(
        f"kfac: layer {layer!r} ran {calls} times in one forward pass but {uses} times in the first; K-FAC needs "
        f"the same calls every step (add {layer!r} to kfac.skip)."
    )


def other_passes(passes: int, first: int | None) -> UserError:
    """A step ran another number of forward passes than the first."""
    return UserError(
        f"kfac: this step ran {passes} forward passes of the model with K-FAC's layers where the first step ran "
        f"{first}; K-FAC needs the same passes every step (gradient accumulation: train.accumulate micro-batches, "
        "each one forward and one backward pass)."
    )


def merged_calls(gathered: list[tuple[dict[str, int], int]]) -> tuple[dict[str, int], int]:
    """The most calls per pass of each layer and the passes per step, from every rank's ``(calls, passes)``.

    Raises:
        UserError: Where the ranks ran different numbers of forward passes.
    """
    calls = {name: max(c.get(name, 0) for c, _ in gathered) for c, _ in gathered for name in c}
    passes = sorted({p for _, p in gathered})
    if len(passes) > 1:
        raise UserError(
            f"kfac: the ranks ran {passes} forward passes in the first step; K-FAC needs the same forward passes "
            "on every rank."
        )
    return calls, passes[0]


def ran_and_got(agreed: dict[str, list[str] | None], captures: dict[str, LayerCapture]) -> tuple[set[str], set[str]]:
    """The layers whose forward ran, and those whose output got a gradient, on any rank.

    Args:
        agreed: The keys of each side's factors every rank agreed on (``None``: one rank).
        captures: This rank's captures of the step.
    """
    a_keys, g_keys = agreed["A"], agreed["G"]
    if a_keys is not None and g_keys is not None:
        return {layer_of(k) for k in a_keys}, {layer_of(k) for k in g_keys}
    return (
        {name for name, cap in captures.items() if cap.a is not None},
        {name for name, cap in captures.items() if cap.g is not None},
    )


def learn_uses(
    layers: list[KFACLayer], ran: set[str], got: set[str], calls: dict[str, int], several: bool, reduced: bool = False
) -> tuple[dict[str, int], list[KFACLayer]]:
    """The layers kept (their forward ran and their output got a gradient), each with its calls per pass; the others.

    Args:
        layers: The candidate layers.
        ran: The layers whose forward ran (on some rank).
        got: The layers whose output got a gradient (on some rank).
        calls: The most forward calls per pass of each layer that ran.
        several: Whether ``ran`` and ``got`` are of several ranks (for the log).
        reduced: Whether a layer's calls are reduced (``kfac.factor=reduce``; for the log).

    Raises:
        UserError: If no layer is kept.
    """
    kept, dropped = [], []
    anywhere = " on any rank" if several else ""
    for layer in layers:
        if layer.name not in ran or layer.name not in got:
            elsewhere = getattr(layer.module, "elsewhere", None)
            why = "its forward never ran (its weight is used directly)"
            why = "its output got no gradient" if layer.name in ran else why
            if elsewhere is not None and layer.name not in ran:
                logger.info("K-FAC takes %s otherwise: %s", layer.name, elsewhere)
            else:
                logger.info("K-FAC leaves %s to the optimizer: %s%s", layer.name, why, anywhere)
            dropped.append(layer)
            continue
        kept.append(layer)
        if calls[layer.name] > 1:
            how = "each example's uses reduced over them" if reduced else "each call's rows count in A and G"
            logger.info(
                "K-FAC: %s runs %d times per forward pass (shared weights); %s", layer.name, calls[layer.name], how
            )
    if not kept:
        raise UserError(
            "kfac: none of the model's Linear or Conv2d layers ran in the forward pass with a gradient "
            "(use kfac.variant=sgd)."
        )
    return {layer.name: calls[layer.name] for layer in kept}, dropped
