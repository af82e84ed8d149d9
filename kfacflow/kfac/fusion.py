"""Stage *communicate*: when local factors are all-reduced, and which are fused.

A policy (:class:`~kfacflow.kfac.stages.FusionPolicy`) only decides. :class:`Grouper` applies
its decisions to factors as they arrive; :class:`Communicator` runs a grouper on the backend
during training, and :func:`plan_launches` runs one on the ready times of a traced step for the
simulator. So a policy is one rule with two users, and a new policy is simulated the day it is
written.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from kfacflow.comm import scatter
from kfacflow.comm.base import Backend, Handle
from kfacflow.kfac.fusion_plan import plan_groups
from kfacflow.kfac.stages import EVERY_RANK, FusionOptions, FusionPolicy, Waiting
from kfacflow.perf import LinearModel
from kfacflow.registry import COMMUNICATORS
from kfacflow.timing import UNTIL, StepTimer

logger = logging.getLogger(__name__)

SCATTER = -2
"""A :class:`Routing` part reduced to several owners at once, each receiving its own factors."""


class Policy:
    """Defaults of a fusion policy: nothing launched before the end of a pass, no planning."""

    launch_after_forward = True
    measure_steps = 0
    plan: list[list[str]] | None = None

    def __init__(self, options: FusionOptions) -> None:
        self.options = options

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


class Threshold(Policy):
    """Layer-wise, consecutive factors fused until the buffer reaches a byte threshold ("LW w/ TTF")."""

    def close_group(self, waiting: Sequence[Waiting]) -> bool:
        """Once the waiting factors fill ``threshold_bytes``."""
        return sum(w.nbytes for w in waiting) >= self.options.threshold_bytes


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


class FusedSum:
    """One asynchronous sum over ranks of several packed factors copied into one buffer.

    Args:
        backend: Where it runs (its K-FAC group).
        items: ``(key, packed factor)`` pairs; all of one dtype and device.
        timer: Records the transfer from launch to completion when tracing.
        dst: The one rank that needs the sum (a reduction), ``None`` for every rank (an all-reduce),
            or :data:`SCATTER`: each factor to its owner (``owners``; ``items`` in rank order).
        owners: With :data:`SCATTER`, the owner of each item.
    """

    def __init__(
        self,
        backend: Backend,
        items: list[tuple[str, Tensor]],
        timer: StepTimer | None = None,
        dst: int | None = None,
        owners: Sequence[int] = (),
    ) -> None:
        self.world_size = backend.world_size
        self.keys = [k for k, _ in items]
        self.sizes = [t.numel() for _, t in items]
        self.buffer = torch.cat([t.reshape(-1) for _, t in items]) if len(items) > 1 else items[0][1]
        self.mine = dst is None or dst == backend.rank
        self.handle: Handle
        if dst == SCATTER:
            counts = [sum(m for m, o in zip(self.sizes, owners, strict=True) if o == r) for r in range(self.world_size)]
            self.handle = backend.reduce_to_owners_async(self.buffer.view(-1), counts)
            self.keys = [k for k, o in zip(self.keys, owners, strict=True) if o == backend.rank]
            self.sizes = [m for m, o in zip(self.sizes, owners, strict=True) if o == backend.rank]
            self.mine = bool(self.keys)
        elif dst is None:
            self.handle = backend.allreduce_async(self.buffer)
        else:
            self.handle = backend.reduce_async(self.buffer, dst)
        self.scattered = dst == SCATTER
        self.timer, self.t0 = timer, time.perf_counter()
        self.name = f"{items[0][0]} +{len(items) - 1}" if len(items) > 1 else items[0][0]
        if dst is not None:
            self.name += " to owners" if dst == SCATTER else f" to {dst}"
        if timer is not None and timer.on_done(self.handle, self.name, "allreduce"):
            self.timer = None

    def wait(self) -> dict[str, Tensor]:
        """Block until done; return the averaged factors by key (none on a rank a reduction is not for)."""
        result = self.handle.wait()
        if self.timer is not None and self.timer.tracing:  # no future to say when it ended: until taken
            self.timer.record(f"{self.name} {UNTIL}", "allreduce", self.t0, time.perf_counter())
        if not self.mine:
            return {}
        avg = (result if self.scattered else self.buffer) / self.world_size
        return dict(zip(self.keys, avg.split(self.sizes), strict=True))


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


class Communicator:
    """Receives packed factors as layers produce them and returns them averaged over ranks.

    The calls each factor-update step: :meth:`push` (A factors, in the forward pass),
    :meth:`end_forward`, :meth:`push` (G factors, in the backward pass), :meth:`end_backward`,
    :meth:`wait`. The policy decides when to launch and what to fuse; for a policy that
    measures, the ready times of its first steps (after one warm-up step) are averaged over
    ranks, so that every rank plans from the same numbers.

    Args:
        backend: The communication engine.
        policy: The fusion policy.
        timer: Records each all-reduce from launch to completion when tracing.
    """

    def __init__(self, backend: Backend, policy: FusionPolicy, timer: StepTimer | None = None) -> None:
        self.backend, self.policy, self.timer = backend, policy, timer
        self.grouper = Grouper(policy)
        self.pending: dict[str, Tensor] = {}
        self.inflight: list[FusedSum] = []
        self.routing: Routing | None = None
        """With ``kfac.factor_sync=owner``: where each factor is reduced."""
        self.launches = 0
        """Groups launched so far (for tests and logs)."""
        self.reductions = 0
        """Reductions to one owner launched so far (``kfac.factor_sync=owner``; for tests and logs)."""
        self.scattered = 0
        """Reductions to several owners at once launched so far (:data:`SCATTER`; for tests and logs)."""
        self.groups: list[list[tuple[str, int]]] = []
        """The groups of the last complete step, in launch order: ``(key, elements)``."""
        self._groups: list[list[tuple[str, int]]] = []
        self._backward = False
        self._fresh = True
        self._t0 = 0.0
        self._measured = 0
        self._order: list[list[tuple[str, int]]] = [[], []]
        self._ready: dict[str, list[float]] = {}

    @property
    def plan(self) -> list[list[str]] | None:
        """The policy's planned groups, if it plans."""
        return self.policy.plan

    def push(self, key: str, packed: Tensor) -> None:
        """Take one local packed factor; launch what the policy says."""
        if packed.is_cuda and self._measuring:  # a ready time is when the factor is computed, not queued
            torch.cuda.synchronize(packed.device)
        now = time.perf_counter()
        if self._fresh:
            self._t0, self._fresh = now, False  # the first factor of a step starts the forward clock
        self._note(key, packed.numel(), now - self._t0)
        self.pending[key] = packed
        self._launch(self.grouper.add(Waiting(key, packed.numel(), packed.numel() * packed.element_size())))

    def end_forward(self) -> None:
        """The forward pass has produced every A factor; the G clock starts."""
        self._launch(self.grouper.end_forward())
        self._backward, self._t0 = True, time.perf_counter()

    def end_backward(self) -> None:
        """The backward pass has produced every G factor."""
        self._launch(self.grouper.end_backward())

    def wait(self) -> dict[str, Tensor]:
        """Launch what is still pending, wait for all, return the averaged factors by key."""
        out: dict[str, Tensor] = {}
        for averaged in self.arrivals():
            out.update(averaged)
        return out

    def arrivals(self) -> Iterator[dict[str, Tensor]]:
        """Launch what is still pending; yield each all-reduce's averaged factors as it completes, in launch order.

        Iterate to the end: the step's bookkeeping (a measuring policy's plan) runs after the last.
        """
        self._launch(self.grouper.end_backward())
        inflight, self.inflight = self.inflight, []
        for op in inflight:
            yield op.wait()
        self._backward, self._fresh = False, True
        self.groups, self._groups = self._groups, []
        self._after_step()

    def _launch(self, keys: list[str] | None) -> None:
        if keys:
            items = [(k, self.pending.pop(k)) for k in keys]
            self._groups.append([(k, t.numel()) for k, t in items])
            if self.routing is None or self.backend.world_size == 1:
                self.inflight.append(FusedSum(self.backend, items, self.timer))
            else:
                tensors = dict(items)
                for dst, part in self.routing.parts(keys, {k: t.numel() for k, t in items}):
                    owners = [self.routing.owners[k] for k in part] if dst == SCATTER else ()
                    self.inflight.append(
                        FusedSum(self.backend, [(k, tensors[k]) for k in part], self.timer, dst, owners)
                    )
                    self.reductions += dst is not None and dst != SCATTER
                    self.scattered += dst == SCATTER
            self.launches += 1

    @property
    def _measuring(self) -> bool:
        """Whether this step's ready times are noted (a policy that plans from them, before its plan)."""
        return bool(self.policy.measure_steps) and self.policy.plan is None

    def _note(self, key: str, elements: int, seconds: float) -> None:
        if not self._measuring:
            return
        if self._measured == 0:  # the first step orders the keys; its times include warm-up
            self._order[int(self._backward)].append((key, elements))
        else:
            self._ready.setdefault(key, []).append(seconds)

    def _after_step(self) -> None:
        if not self.policy.measure_steps or self.policy.plan is not None:
            return
        self._measured += 1
        if self._measured <= self.policy.measure_steps:
            return
        keys = [k for order in self._order for k, _ in order]
        means = torch.tensor([sum(self._ready[k]) / len(self._ready[k]) for k in keys], dtype=torch.float64)
        means = self.backend.allreduce_sum(means) / self.backend.world_size
        ready = dict(zip(keys, means.tolist(), strict=True))
        self.policy.learn([[(k, ready[k], m) for k, m in order] for order in self._order])


COMMUNICATORS.add("after_backward", AfterBackward, "all factors fused into one all-reduce after backward (D-KFAC)")
COMMUNICATORS.add("naive", Naive, "A factors all-reduced after forward, G factors after backward (Fig. 10 Naive)")
COMMUNICATORS.add("layerwise", Layerwise, "each factor all-reduced as soon as computed, no fusion (LW w/o TF)")
COMMUNICATORS.add("threshold", Threshold, "layer-wise, fused up to kfac.fusion_threshold_mb (LW w/ TTF)")
COMMUNICATORS.add(
    "optimal", Optimal, "layer-wise, fused by the paper's Eq. 15 from measured times (SP w/ OTF)", needs_profile=True
)
COMMUNICATORS.add(
    "optimal_split",
    OptimalSplit,
    "Eq. 15, a group closed once its transfer outweighs its start-up tenfold (for inverting on arrival)",
    needs_profile=True,
)
