"""Stage *communicate*: when local factors are all-reduced, and which are fused.

A policy (:class:`~kfacflow.kfac.stages.contracts.FusionPolicy`) only decides. :class:`Grouper` applies
its decisions to factors as they arrive; :class:`Communicator` runs a grouper on the backend
during training, and :func:`plan_launches` runs one on the ready times of a traced step for the
simulator. So a policy is one rule with two users, and a new policy is simulated the day it is
written.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, TypeVar

from kfacflow.comm import scatter
from kfacflow.configuration.schema import above
from kfacflow.kfac.stages.contracts import EVERY_RANK, FusionOptions, FusionPolicy, Waiting
from kfacflow.kfac.stages.fusion_plan import plan_groups
from kfacflow.kfac.stages.options import StageOptions
from kfacflow.perf import LinearModel
from kfacflow.registry import FUSIONS

logger = logging.getLogger(__name__)

OwnOptions = TypeVar("OwnOptions", bound=StageOptions)

SCATTER = -2
"""A :class:`Routing` part reduced to several owners at once, each receiving its own factors."""


class Policy:
    """Defaults of a fusion policy: nothing launched before the end of a pass, no planning."""

    launch_after_forward = True
    measure_steps = 0
    plan: list[list[str]] | None = None

    def __init__(self, options: FusionOptions) -> None:
        self.options = options

    def own(self, kind: type[OwnOptions]) -> OwnOptions:
        """The policy's own options (``kfac.options.<name>``), or the defaults of ``kind`` where none were given."""
        return self.options.own if isinstance(self.options.own, kind) else kind()

    def close_group(self, waiting: Sequence[Waiting]) -> bool:
        """Keep waiting (the pass's end launches what waits)."""
        return False

    def learn(self, passes: Sequence[Sequence[tuple[str, float, int]]]) -> None:
        """Nothing to learn."""


class AfterBackward(Policy):
    """All factors in one all-reduce after the backward pass (D-KFAC; the paper's ref. [22])."""

    launch_after_forward = False


class Naive(Policy):
    """A factors fused after the forward pass (overlapping backward), G factors after backward (ref. [20])."""


class Layerwise(Policy):
    """Each factor all-reduced as soon as it is computed, no fusion ("LW w/o TF")."""

    def close_group(self, waiting: Sequence[Waiting]) -> bool:
        """Always: one all-reduce per factor."""
        return True


@dataclass(frozen=True)
class ThresholdOptions(StageOptions):
    """``kfac.options.threshold``."""

    mb: float = field(default=64.0, metadata=above(0, "MiB"))
    """The fusion buffer, in MiB (Horovod's default); ``kfac.fusion_threshold_mb`` sets it too."""
    KEYS: ClassVar[Mapping[str, str]] = {"mb": "fusion_threshold_mb"}


class Threshold(Policy):
    """Layer-wise, consecutive factors fused until the buffer reaches a byte threshold ("LW w/ TTF")."""

    def __init__(self, options: FusionOptions) -> None:
        super().__init__(options)
        self.threshold_bytes = int(self.own(ThresholdOptions).mb * 2**20)

    def close_group(self, waiting: Sequence[Waiting]) -> bool:
        """Once the waiting factors fill the buffer."""
        return sum(w.nbytes for w in waiting) >= self.threshold_bytes


class Optimal(Policy):
    """Layer-wise with the fusion of the paper's Eq. 15 (SP w/ OTF), planned from measured times.

    While it measures it behaves like :class:`Layerwise`. Then :func:`plan_groups` splits the
    A factors (forward pass) and the G factors (backward pass) into consecutive groups from
    their mean ready times, and a group is launched once its last member arrives.
    """

    split = False

    def __init__(self, options: FusionOptions) -> None:
        super().__init__(options)
        self.measure_steps = options.profile_steps
        self.group_of: dict[str, int] | None = None
        self.group_len: list[int] = []

    def close_group(self, waiting: Sequence[Waiting]) -> bool:
        """When the newest factor completes its group (or has none)."""
        if self.group_of is None:
            return True
        group = self.group_of.get(waiting[-1].key)
        return group is None or sum(1 for w in waiting if self.group_of.get(w.key) == group) == self.group_len[group]

    def learn(self, passes: Sequence[Sequence[tuple[str, float, int]]]) -> None:
        """Plan the groups of each pass from its mean ready times (Eq. 15)."""
        model = self.options.allreduce
        assert model is not None, "the optimal fusion needs an all-reduce model"
        self.plan = []
        for items in passes:
            keys = [key for key, _, _ in items]
            groups = plan_groups([t for _, t, _ in items], [m for _, _, m in items], model, self.split)
            self.plan += [[keys[i] for i in g] for g in groups]
        self.group_of = {k: g for g, keys in enumerate(self.plan) for k in keys}
        self.group_len = [len(keys) for keys in self.plan]
        sizes = [sum(1 for _ in items) for items in passes]
        logger.info("optimal fusion: %s factors per pass in %d all-reduces", sizes, len(self.plan))


class OptimalSplit(Optimal):
    """Eq. 15's groups, each closed once it has paid for its start-up: large factors travel alone.

    For factors inverted as they arrive (``kfac.pipeline=invert_on_arrival`` or ``arrival``):
    Eq. 15 fuses everything that waits while the link is busy, so the A factors of the last
    layers, computed at the end of the forward pass, arrive together, a second later on a
    1 Gbit/s link; split, the first of them can be inverted while the rest travel. Small factors
    still share all-reduces, so start-ups do not queue at large P.
    """

    split = True


class Grouper:
    """Applies a policy to factors as they arrive: returns the groups to launch, in order."""

    def __init__(self, policy: FusionPolicy) -> None:
        self.policy = policy
        self.waiting: list[Waiting] = []

    def add(self, item: Waiting) -> list[str] | None:
        """Take one factor; return the keys to all-reduce now, if any."""
        self.waiting.append(item)
        return self._take() if self.policy.close_group(self.waiting) else None

    def end_forward(self) -> list[str] | None:
        """The forward pass is over; return the keys to all-reduce now, if any."""
        return self._take() if self.policy.launch_after_forward and self.waiting else None

    def end_backward(self) -> list[str] | None:
        """The backward pass is over; return every key still waiting, if any."""
        return self._take() if self.waiting else None

    def _take(self) -> list[str]:
        keys = [w.key for w in self.waiting]
        self.waiting = []
        return keys


@dataclass(frozen=True)
class Ready:
    """A factor of a simulated step: when the hooks had it, and its elements."""

    key: str
    time: float
    elements: int


def plan_launches(
    policy: FusionPolicy,
    forward: Sequence[Ready],
    forward_end: float,
    backward: Sequence[Ready],
    backward_end: float,
    element_size: int = 4,
) -> list[tuple[float, list[str]]]:
    """Return (launch time, keys) of every all-reduce a step makes under ``policy`` (the simulator's view).

    A policy that measures first is given the ready times of this step, relative to the start
    of each pass, as :class:`Communicator` gives it the mean of its first steps.
    """
    passes = ((forward, forward[0].time if forward else 0.0), (backward, forward_end))
    if policy.measure_steps:
        level = logger.level
        logger.setLevel(max(level, logging.WARNING))  # a simulated plan is not the run's: keep it out of the log
        try:
            policy.learn([[(r.key, r.time - start, r.elements) for r in items] for items, start in passes])
        finally:
            logger.setLevel(level)
    grouper = Grouper(policy)
    launches: list[tuple[float, list[str]]] = []
    ends = ((forward, forward_end, grouper.end_forward), (backward, backward_end, grouper.end_backward))
    for items, end, close in ends:
        for r in items:
            keys = grouper.add(Waiting(r.key, r.elements, r.elements * element_size))
            if keys:
                launches.append((r.time, keys))
        keys = close()
        if keys:
            launches.append((end, keys))
    return launches


def estimated_arrivals(groups: Sequence[Sequence[tuple[str, int]]], allreduce: LinearModel | None) -> dict[str, float]:
    """Estimate when each factor arrives: its group's all-reduce after every group launched before it.

    Groups are ``(key, elements)`` lists in launch order; the link carries one at a time. Only
    the order and the sizes count, so every rank estimates the same from the same launches.
    """
    t, out = 0.0, dict[str, float]()
    for group in groups:
        elements = sum(m for _, m in group)
        t += allreduce(elements) if allreduce is not None else float(elements)
        out.update((key, t) for key, _ in group)
    return out


def by_owner(keys: Sequence[str], owners: dict[str, int]) -> list[tuple[int | None, list[str]]]:
    """Split a group into one reduction per owner, in the order of first appearance; ``None``: all-reduced.

    A factor every rank inverts (:data:`EVERY_RANK`) is all-reduced; so is any factor not in ``owners``.
    """
    parts: dict[int | None, list[str]] = {}
    for key in keys:
        owner = owners.get(key, EVERY_RANK)
        parts.setdefault(None if owner == EVERY_RANK else owner, []).append(key)
    return list(parts.items())


@dataclass(frozen=True)
class Routing:
    """Where ``kfac.factor_sync=owner`` sends each factor, and what the link costs.

    Args:
        owners: Each factor's owner (or :data:`EVERY_RANK`).
        world_size: P.
        allreduce: All-reduce time model; ``None``: unknown.
        reduce: Reduction time model (a broadcast reversed: the broadcast's); ``None``: unknown.
        scatters: Whether the engine can reduce a buffer to several owners at once
            (:meth:`~kfacflow.comm.base.Backend.reduce_to_owners_async`).
    """

    owners: dict[str, int]
    world_size: int
    allreduce: LinearModel | None = None
    reduce: LinearModel | None = None
    scatters: bool = False

    def parts(self, keys: Sequence[str], elements: dict[str, int]) -> list[tuple[int | None, list[str]]]:
        """How one group is summed: one all-reduce, one reduction per owner, or one reduction to all owners.

        The cheapest by the models. Between two ranks the reductions to each run at once, one per
        direction (the longest counts); with more, they queue, each paying its start-ups, so a
        group of many small factors of many owners stays one all-reduce, or, from three ranks on,
        goes to its owners in one reduce-scatter and all-to-all (:data:`SCATTER`, the factors in
        rank order: two start-ups, each element moved about once). Without models: reductions
        between two ranks, else only a group of one owner. Factors every rank inverts are
        all-reduced beside the reductions.
        """
        parts = by_owner(keys, self.owners)
        owned = [(dst, part) for dst, part in parts if dst is not None]
        if not owned:
            return [(None, list(keys))]
        if self.allreduce is None or self.reduce is None:
            return parts if self.world_size == 2 or len(owned) == 1 else [(None, list(keys))]
        sizes = {dst: sum(elements[k] for k in part) for dst, part in owned}
        shared = [(dst, part) for dst, part in parts if dst is None]
        rest = self.allreduce(sum(elements[k] for _, part in shared for k in part)) if shared else 0.0
        times = [self.reduce(m) for m in sizes.values()]
        options: list[tuple[float, list[tuple[int | None, list[str]]]]] = [
            (self.allreduce(sum(elements[k] for k in keys)), [(None, list(keys))]),
            ((max(times) if self.world_size == 2 else sum(times)) + rest, parts),
        ]
        if self.scatters and self.world_size > 2 and len(owned) > 1:
            counts = [sizes.get(r, 0) for r in range(self.world_size)]
            in_rank_order = [k for _, part in sorted(owned, key=lambda p: p[0]) for k in part]
            options.append((scatter.cost(self.reduce, counts) + rest, [(SCATTER, in_rank_order), *shared]))
        return min(options, key=lambda option: option[0])[1]  # the first of equals: all-reduce before the rest


FUSIONS.add("after_backward", AfterBackward, "all factors fused into one all-reduce after backward (D-KFAC)")
FUSIONS.add("naive", Naive, "A factors all-reduced after forward, G factors after backward (Fig. 10 Naive)")
FUSIONS.add("layerwise", Layerwise, "each factor all-reduced as soon as computed, no fusion (LW w/o TF)")
FUSIONS.add(
    "threshold",
    Threshold,
    "layer-wise, fused up to kfac.options.threshold.mb (LW w/ TTF)",
    options=ThresholdOptions,
)
FUSIONS.add(
    "optimal", Optimal, "layer-wise, fused by the paper's Eq. 15 from measured times (SP w/ OTF)", needs_profile=True
)
FUSIONS.add(
    "optimal_split",
    OptimalSplit,
    "Eq. 15, a group closed once its transfer outweighs its start-up tenfold (for inverting on arrival)",
    needs_profile=True,
)
