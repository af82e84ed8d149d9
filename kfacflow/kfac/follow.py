"""When the model's trained layers change between steps: K-FAC follows (a frozen layer leaves it).

Every rank runs the same code, so every rank re-plans at the same forward pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from kfacflow import UserError
from kfacflow.kfac.hooks.watch import trained
from kfacflow.kfac.packing import pack, unpack

if TYPE_CHECKING:
    from torch import Tensor

    from kfacflow.kfac.hooks.capture import Capture
    from kfacflow.kfac.hooks.watch import Claims
    from kfacflow.kfac.layers import KFACLayer
    from kfacflow.kfac.stages.contracts import FactorSlot
    from kfacflow.kfac.strategies.contracts import State


class Following(Protocol):
    """What following the model changes (:class:`~kfacflow.kfac.plan_life.PlanLife`)."""

    layers: list[KFACLayer]
    slots: list[FactorSlot]

    @property
    def state(self) -> State:
        """The running state: the averages and inverses of what changed go."""
        ...

    @property
    def capture(self) -> Capture:
        """The factor hooks: a frozen layer's are dropped."""
        ...

    @property
    def claims(self) -> Claims:
        """The layers this preconditioner holds: a frozen one is released."""
        ...

    def every_average(self) -> dict[str, Tensor]:
        """Every running average, up to date, on this rank (collective)."""
        ...


def _change(was: tuple[bool, bool], now: tuple[bool, bool]) -> str:
    if not now[0]:
        return "frozen (left to the optimizer)"
    return "bias frozen" if was[1] else "bias trained again (its A factor restarts)"


def follow_model(life: Following, was: Sequence[tuple[bool, bool]]) -> tuple[list[KFACLayer], str]:
    """Drop what the layers frozen (or whose bias was frozen or unfrozen) since the plan leave.

    ``was``: whether each layer's weight and bias were trained when the plan was made. A frozen
    layer leaves K-FAC; a frozen bias leaves its layer's A factor (the rest of the running average
    is exactly the weight's factor); a bias trained again restarts its layer's A factor. The
    caller plans again and updates every factor and inverts at this step, so no inverse of the old
    plan is used (collective where running averages are kept by their owners).

    Returns:
        The layers kept, and what changed (for the log).

    Raises:
        UserError: Between the micro-batches of a step, or when no preconditioned layer is left.
    """
    if life.capture.micro:
        raise UserError(
            "kfac: a preconditioned layer was frozen or unfrozen between the micro-batches of a step; "
            "change requires_grad between steps."
        )
    changed = [
        (layer, was, now) for layer, was, now in zip(life.layers, was, trained(life.layers), strict=True) if was != now
    ]
    kept = [layer for layer in life.layers if layer.module.weight.requires_grad]
    if not kept:
        raise UserError(
            "kfac: every layer K-FAC preconditions is frozen now; remove() the preconditioner (or train some)."
        )
    state = life.state
    state.running = life.every_average()  # collective where owners alone keep theirs, or ranks hold sums
    for layer, (_, had_bias), (weight, bias) in changed:
        a_key = f"{layer.name}/A"
        state.inverses.pop(a_key, None)
        if not weight:
            for key in (a_key, f"{layer.name}/G"):
                state.running.pop(key, None)
                state.inverses.pop(key, None)
        elif a_key in state.running and had_bias and not bias:
            planned = unpack(state.running[a_key], next(slot.dim for slot in life.slots if slot.key == a_key))
            state.running[a_key] = pack(planned[:-1, :-1])
        else:
            state.running.pop(a_key, None)
    frozen = [layer for layer, _, (weight, _) in changed if not weight]
    life.claims.release([layer.module for layer in frozen])
    life.capture.drop({layer.name for layer in frozen})
    return kept, ", ".join(f"{layer.name} {_change(was, now)}" for layer, was, now in changed)
