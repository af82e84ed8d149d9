"""Which rank inverts which factor: every rank (NCT) or one owner whose result is broadcast (CT)."""

from __future__ import annotations

from kfacflow.registry import PLACEMENTS

EVERY_RANK = -1
"""Owner value of a non-communicated tensor (NCT): every rank inverts it, nothing is sent."""


def local(dims: list[int], world_size: int) -> list[int]:
    """Every rank inverts every factor (D-KFAC): no inverse traffic.

    Args:
        dims: Side of each factor, in the preconditioner's order.
        world_size: Number of ranks.

    Returns:
        The owner of each factor: :data:`EVERY_RANK` or a rank.
    """
    return [EVERY_RANK] * len(dims)


PLACEMENTS.add("local", local, "every rank inverts every factor; no inverse traffic (D-KFAC)")
