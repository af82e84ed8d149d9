"""Strategy *grad sync*: when and where a step's gradients are averaged over ranks (``kfac.grad_sync``).

A strategy is asked to act, never inspected: :meth:`GradSync.backward` says how a micro-batch's
backward pass runs (DDP averaging in it, or not), :meth:`GradSync.gradients` gives the step's own
gradient traffic (posted behind the factors, awaited to precondition) or ``None``, and
:meth:`GradSync.usable` whether the step may go on as far as its gradients can be checked before
K-FAC runs. What it decides of the plan it writes into the plan's :class:`~kfacflow.kfac.planning.plan.Choice`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import replace
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from kfacflow.comm import scatter
from kfacflow.comm.base import Backend
from kfacflow.kfac.gradients import GradientAllreduce, Gradients, ToOwners, sparse_parameters
from kfacflow.kfac.planning.plan import Choice
from kfacflow.kfac.stages.contracts import EVERY_RANK
from kfacflow.kfac.strategies.contracts import AFTER_BACKWARD, OWNERS_PRECONDITION, GradSync
from kfacflow.kfac.strategies.replay import Replay, buckets
from kfacflow.registry import GRAD_SYNCS


class Overlap(GradSync):
    """Gradients averaged during the backward pass (DDP's buckets, Horovod's hooks), before K-FAC starts."""

    def backward(self, backend: Backend, net: nn.Module, last: bool) -> AbstractContextManager[Any]:
        """DDP averages in the step's last backward pass only (earlier micro-batches accumulate)."""
        return nullcontext() if last else backend.no_sync(net)

    def gradients(self, backend: Backend, params: list[nn.Parameter]) -> Gradients | None:
        """None: the backward pass averaged them."""
        return None

    def usable(self, backend: Backend, finite: Callable[[], bool]) -> bool:
        """The averaged gradients are here (the same on every rank): check them now."""
        return finite()

    def in_backward(self, r: Replay) -> list[tuple[float, int, int | None]]:
        """The simulator's :meth:`backward`: DDP posts each bucket as the backward pass fills it."""
        return [(at, m, None) for at, m in r.buckets]

    def replay(self, r: Replay) -> None:
        """The backward pass returns once DDP's buckets are averaged."""
        r.grad_comm = max(0.0, r.grads_done - r.t_bwd)
        r.start = r.t_bwd + r.grad_comm


class Deferred(Overlap):
    """Gradients averaged after the backward pass, behind the factors on K-FAC's group; awaited to precondition."""

    needs: ClassVar[Mapping[str, str]] = {AFTER_BACKWARD: "overlap"}
    does = "averages the gradients after the backward pass"

    def backward(self, backend: Backend, net: nn.Module, last: bool) -> AbstractContextManager[Any]:
        """DDP averages nothing: K-FAC's group does, once the factors are on their way."""
        return backend.no_sync(net)

    def gradients(self, backend: Backend, params: list[nn.Parameter]) -> GradientAllreduce | None:
        """The step's gradient traffic (the preconditioner routes it by its plan)."""
        return GradientAllreduce(backend, params) if backend.world_size > 1 else None

    def usable(self, backend: Backend, finite: Callable[[], bool]) -> bool:
        """Not averaged yet where several ranks run (ranks could disagree): checked after the step, preconditioned."""
        return backend.world_size > 1 or finite()

    def in_backward(self, r: Replay) -> list[tuple[float, int, int | None]]:
        """Nothing in the backward pass."""
        return []

    def replay(self, r: Replay) -> None:
        """Posted after the last factor, so they queue behind every one of them.

        As the plan routes them: one reduction of the owned layers' gradients to their owners,
        the rest all-reduced in buckets.
        """
        if r.workers == 1:
            return super().replay(r)
        r.start = r.grads_done = r.t_bwd
        grads = r.buckets
        if r.plan.grad_owners is not None:
            routed, shared = [0] * r.workers, 0
            for row, owner in zip(r.rows, r.plan.grad_owners, strict=True):
                if owner == EVERY_RANK:
                    shared += row["params"]
                else:
                    routed[owner] += row["params"]
            cost = scatter.direct_cost if r.direct else scatter.cost
            r.grads_done = r.link.send(max(r.start, r.link.free), cost(r.prof.broadcast, routed))
            grads, r.routed = buckets(shared), True
        for _, m in grads:
            r.grads_done = r.link.send(max(r.start, r.link.free), r.prof.allreduce(m))
        return None


class Owner(Deferred):
    """As deferred; each owned layer's gradients go to its owner alone where that costs less.

    From P = 3 with a reduce-scatter (NCCL), from P = 2 where each piece is sent straight to its owner (gloo).
    """

    needs: ClassVar[Mapping[str, str]] = {OWNERS_PRECONDITION: "deferred", AFTER_BACKWARD: "overlap"}
    does = "leaves each layer's gradients on its owner alone"

    def shape(self, choice: Choice) -> Choice:
        """The plan routes owned layers' gradients to their owners (where it pays)."""
        return replace(choice, grad_to_owner=True)


class InBackward(Overlap):
    """Between steps that exchange factors (``between``, where the plan routes them): gradients to owners in backward.

    Not a recipe's name: :meth:`Between.for_step` makes one per step from the plan's routes. DDP
    averages nothing; the last micro-batch's backward pass sends each owned layer's gradients to its
    owner alone, as they are computed (:class:`ToOwners`), so the link carries half an all-reduce's
    traffic at P = 2 while the backward pass runs, and the update exchange the other half.

    Args:
        routes: The plan's routes (:meth:`Between.for_step`): the parameters each rank receives alone
            (the running step), or each layer's owner (the simulator's replay).
        rebuilt: The parameters whose averages the step rebuilds from rows: not sent.
    """

    does = "sends each owned layer's gradients to its owner during the backward pass"

    def __init__(self, routes: Sequence[Any], rebuilt: Sequence[Tensor] = ()) -> None:
        self.routes, self.rebuilt = routes, rebuilt
        self.sending: ToOwners | None = None

    @contextmanager
    def backward(self, backend: Backend, net: nn.Module, last: bool) -> Iterator[None]:
        """DDP averages nothing; in the last micro-batch, each gradient is posted once accumulated."""
        with backend.no_sync(net):
            if not last:
                yield
                return
            owner = {id(p): rank for rank, params in enumerate(self.routes) for p in params}
            params = [p for p in net.parameters() if p.requires_grad]
            self.sending = ToOwners(backend, owner, params, self.rebuilt, sparse_parameters(net))
            hooks = [p.register_post_accumulate_grad_hook(self.sending.ready) for p in params]
            try:
                yield
            finally:
                for hook in hooks:
                    hook.remove()
            self.sending.flush()

    def finish(self, backend: Backend, optimizer: torch.optim.Optimizer) -> None:
        """Wait for the backward pass's buckets and write back the averages this rank holds."""
        if self.sending is not None:
            self.sending.wait()
        backend.finish_gradients(optimizer)

    def gradients(self, backend: Backend, params: list[nn.Parameter]) -> Gradients | None:
        """What the backward pass sent (nothing left to launch), for the rows to rebuild the rest."""
        return self.sending

    def usable(self, backend: Backend, finite: Callable[[], bool]) -> bool:
        """Owned layers' gradients differ between ranks (only owners hold averages): checked after the step."""
        return backend.world_size > 1 or finite()

    def in_backward(self, r: Replay) -> list[tuple[float, int, int | None]]:
        """The layers' gradients in :class:`ToOwners`' buckets (each destination's), as the backward pass makes them."""
        per_bucket = ToOwners.BUCKET_BYTES // 4
        posted: list[tuple[float, int, int | None]] = []
        pending: dict[int, int] = {}
        for at, j in r.layer_grads:
            key = self.routes[j]
            pending[key] = pending.get(key, 0) + r.rows[j]["params"]
            if pending[key] >= per_bucket:
                posted.append((at, pending.pop(key), None if key == EVERY_RANK else key))
        end = r.layer_grads[-1][0] if r.layer_grads else r.t_bwd
        posted += [(end, m, None if key == EVERY_RANK else key) for key, m in sorted(pending.items())]
        return posted

    def replay(self, r: Replay) -> None:
        """As overlap's: the step waits for the buckets; the owners then send the KL clipping's ``v.g``."""
        super().replay(r)
        r.routed = True


class Between(Owner):
    """As owner on a step whose factors travel after its backward pass; between those steps, to owners during backward.

    With ``kfac.factor_exchange=inversion`` the link is idle during most steps' backward passes, so
    their gradients go there: each owned layer's to its owner alone where the plan routes gradients
    (:class:`InBackward`), otherwise all-reduced in DDP's buckets (as overlap); a step that exchanges
    factors sends its gradients behind them. The trainer asks :meth:`for_step` each step; the
    library, which does not wrap the model, averages after the backward pass every step (as owner).
    """

    does = "averages the gradients after the backward pass of a step that exchanges factors"

    def for_step(self, sends: bool, routes: Sequence[Any] | None = None, rebuilt: Sequence[Tensor] = ()) -> GradSync:
        """Owner's where the step sends factors; elsewhere to the plan's owners during backward, or overlap's."""
        if sends:
            return self
        return InBackward(routes, rebuilt) if routes else OVERLAP


OVERLAP = Overlap()

GRAD_SYNCS.add("overlap", OVERLAP, "gradients all-reduced during backward (DDP, Horovod)")
GRAD_SYNCS.add(
    "deferred",
    Deferred(),
    "gradients all-reduced after backward, behind the factors, awaited to precondition",
)
GRAD_SYNCS.add(
    "owner",
    Owner(),
    "as deferred, but each owned layer's gradients reduced to its owner alone where that costs less "
    "(kfac.broadcast=update; gloo from two ranks, NCCL from three)",
)
GRAD_SYNCS.add(
    "between",
    Between(),
    "as owner on a step that exchanges factors; on the others during backward, to the owners where owner "
    "routes them, else as overlap (kfac.factor_exchange=inversion: the link is free during most backward passes)",
)
