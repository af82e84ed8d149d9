"""The tensor-fusion rule of the paper's Eq. 15 (after MG-WFBP): which consecutive factors share an all-reduce."""

from __future__ import annotations

from kfacflow.perf import LinearModel


def plan_groups(ready: list[float], sizes: list[int], allreduce: LinearModel, split: bool = False) -> list[list[int]]:
    """Split factors, in the order they become ready, into groups all-reduced together.

    All-reduces run one after another on one link and cost ``alpha + beta * m``. Walking the
    factors in order, the current group would start its all-reduce at
    ``s = max(ready of its last factor, time the link frees)``. The next factor joins the group
    when it is ready before ``s + alpha``: waiting for it costs less than the start-up time
    that a separate all-reduce would pay again. In particular it joins whenever it is ready
    before the current group could even start (the link is still busy). Otherwise the group
    is sent and the next factor starts a new one.

    ``split``: a group is also closed once it has paid for its start-up
    (:meth:`~kfacflow.perf.LinearModel.amortized`). Eq. 15 minimises when the *last* factor
    arrives, and while the link is busy it fuses everything that waits, however large; when each
    factor is inverted as it arrives, what counts is when *each* arrives, and a factor fused into
    a large group waits for all of it.

    Args:
        ready: Seconds at which each factor is computed, non-decreasing.
        sizes: Elements of each packed factor.
        allreduce: The all-reduce time model.
        split: Close amortized groups too.

    Returns:
        Groups of indices into ``ready``, consecutive and covering every factor.
    """
    if not ready:
        return []
    groups: list[list[int]] = [[0]]
    link_free = 0.0
    for j in range(1, len(ready)):
        current = groups[-1]
        start = max(ready[current[-1]], link_free)
        if ready[j] < start + allreduce.alpha and not (split and allreduce.amortized(sum(sizes[i] for i in current))):
            current.append(j)
        else:
            link_free = start + allreduce(sum(sizes[i] for i in current))
            groups.append([j])
    return groups
