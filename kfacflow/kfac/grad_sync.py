"""Strategy *grad sync*: when and where a step's gradients are averaged over ranks (``kfac.grad_sync``).

A strategy is asked to act, never inspected: :meth:`GradSync.backward` says how a micro-batch's
backward pass runs (DDP averaging in it, or not), :meth:`GradSync.gradients` gives the step's own
gradient traffic (posted behind the factors, awaited to precondition) or ``None``, and
:meth:`GradSync.usable` whether the step may go on as far as its gradients can be checked before
K-FAC runs. What it decides of the plan it writes into the plan's :class:`~kfacflow.kfac.plan.Choice`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import replace
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from kfacflow.comm import scatter
from kfacflow.comm.base import Backend, Handle
from kfacflow.kfac.plan import Choice
from kfacflow.kfac.stages import EVERY_RANK
from kfacflow.kfac.strategies import AFTER_BACKWARD, OWNERS_PRECONDITION, Gradients, GradSync
from kfacflow.registry import GRAD_SYNCS
from kfacflow.replay import Replay, buckets


class GradientAllreduce:
    """A step's gradients averaged over ranks after the backward pass, on the K-FAC group (``grad_sync=deferred``).

    :meth:`launch` is called once the step's factor all-reduces are posted, so the gradients
    queue behind them on the link; :meth:`wait` before preconditioning, which is the first thing
    that needs them. Buckets of about 25 MiB, as DDP's. Gradients :meth:`route` gives to owners
    (``grad_sync=owner``) go in one reduction to their owners instead; the others keep theirs.

    Args:
        backend: The engine (its K-FAC group carries the buckets).
        params: The parameters whose gradients are averaged.
    """

    BUCKET_BYTES = 25 * 2**20

    def __init__(self, backend: Backend, params: list[nn.Parameter]) -> None:
        self.backend = backend
        self.params = params
        self.inflight: list[tuple[list[Tensor], Tensor, Handle]] = []
        self.owned: list[list[Tensor]] = []
        self.routed: tuple[list[Tensor], Handle] | None = None
        self.launched = False
        self.left: set[int] = set()

    def route(self, owned: list[list[Tensor]]) -> None:
        """Send the gradients of ``owned[r]`` (parameters) to rank ``r`` alone (before :meth:`launch`)."""
        self.owned = owned

    def leave(self, params: list[Tensor]) -> None:
        """Leave these parameters' gradients out (before :meth:`launch`): the step rebuilds their averages itself."""
        self.left = {id(p) for p in params}

    def average(self, params: list[Tensor]) -> None:
        """Average these parameters' gradients now, in one blocking all-reduce (every rank calls it alike)."""
        grads = [p.grad for p in params if p.grad is not None]
        if grads and self.backend.world_size > 1:
            flat = torch.cat([g.reshape(-1) for g in grads])
            self.backend.allreduce_async(flat).wait()
            self._write_back(grads, flat)

    def launch(self) -> None:
        """Post the collectives (once)."""
        if self.launched:
            return
        self.launched = True
        if self.backend.world_size == 1:
            return
        routed = {id(p) for ps in self.owned for p in ps} | self.left
        pieces = [[p.grad for p in ps if p.grad is not None and id(p) not in self.left] for ps in self.owned]
        if any(pieces):  # the same on every rank: the same layers ran
            counts = [sum(g.numel() for g in piece) for piece in pieces]
            flat = torch.cat([g.reshape(-1) for piece in pieces for g in piece])
            self.routed = (pieces[self.backend.rank], self.backend.reduce_to_owners_async(flat, counts))
        grads = [p.grad for p in self.params if p.grad is not None and id(p) not in routed]
        bucket: list[Tensor] = []
        nbytes = 0
        for g in grads:
            bucket.append(g)
            nbytes += g.numel() * g.element_size()
            if nbytes >= self.BUCKET_BYTES:
                self._post(bucket)
                bucket, nbytes = [], 0
        if bucket:
            self._post(bucket)

    def _post(self, bucket: list[Tensor]) -> None:
        flat = torch.cat([t.reshape(-1) for t in bucket])
        self.inflight.append((bucket, flat, self.backend.allreduce_async(flat)))

    def wait(self) -> None:
        """Launch if need be, wait, and write the averages back into the gradients (routed ones: on their owner)."""
        self.launch()
        if self.routed is not None:
            mine, handle = self.routed
            self._write_back(mine, handle.wait())
            self.routed = None
        for bucket, flat, handle in self.inflight:
            handle.wait()
            self._write_back(bucket, flat)
        self.inflight = []

    def _write_back(self, grads: list[Tensor], flat: Tensor) -> None:
        write_back(grads, flat, self.backend.world_size)


def write_back(grads: list[Tensor], flat: Tensor, world_size: int) -> None:
    """Divide the summed ``flat`` by ``world_size`` and copy it back into ``grads``, laid end to end."""
    flat.div_(world_size)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


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


class ToOwners:
    """A backward pass's gradients sent as computed: each owned layer's to its owner alone, the rest all-reduced.

    Buckets of :attr:`BUCKET_BYTES` per destination, posted on K-FAC's group from each parameter's
    post-accumulate hook, in the order the backward pass computes them (the same on every rank);
    the last, smaller ones when the pass is over (:meth:`flush`). :meth:`wait` writes the averages
    back: every rank's for the all-reduced parameters, the owner's alone for its own (the other
    ranks keep their local gradients, which nothing reads: the owner sends the layer's update).

    The parameters whose averages the step rebuilds from rows are not sent at all: to the
    preconditioner this is the step's :class:`~kfacflow.kfac.strategies.Gradients`, with nothing left
    to launch, which leaves out those it was built without and averages on demand those a rank's rows
    could not give (:meth:`average`).

    Args:
        backend: The engine.
        owner: Each routed parameter's owner, by ``id``; the rest are all-reduced.
        rebuilt: The parameters none of whose gradients is sent (the step rebuilds their averages).
    """

    BUCKET_BYTES = 4 * 2**20

    def __init__(self, backend: Backend, owner: dict[int, int], rebuilt: Sequence[Tensor] = ()) -> None:
        self.backend, self.owner = backend, owner
        self.unsent, self.rebuilt = list(rebuilt), {id(p) for p in rebuilt}
        self.pending: dict[int, tuple[list[Tensor], int]] = {}
        """Each destination's gradients not yet posted, and their bytes."""
        self.posted: list[tuple[int, list[Tensor], Tensor, Handle]] = []

    def ready(self, param: Tensor) -> None:
        """A parameter's gradient is final for this step: queue it, and post its bucket once full."""
        if id(param) in self.rebuilt or param.grad is None:
            return
        key = self.owner.get(id(param), EVERY_RANK)
        grads, nbytes = self.pending.get(key, ([], 0))
        grads.append(param.grad)
        nbytes += param.grad.numel() * param.grad.element_size()
        self.pending[key] = (grads, nbytes)
        if nbytes >= self.BUCKET_BYTES:
            self._post(key)

    def flush(self) -> None:
        """Post what is left, destinations in a fixed order (every rank posts the same collectives alike)."""
        for key in sorted(self.pending):
            self._post(key)

    def _post(self, key: int) -> None:
        grads, _ = self.pending.pop(key)
        flat = torch.cat([g.reshape(-1) for g in grads])
        handle = self.backend.allreduce_async(flat) if key == EVERY_RANK else self.backend.reduce_async(flat, key)
        self.posted.append((key, grads, flat, handle))

    def wait(self) -> None:
        """Wait for every bucket and write the averages back where this rank holds them."""
        self.flush()
        for key, grads, flat, handle in self.posted:
            handle.wait()
            if key in (EVERY_RANK, self.backend.rank):
                write_back(grads, flat, self.backend.world_size)
        self.posted = []

    def route(self, owned: list[list[Tensor]]) -> None:
        """Nothing: the backward pass routed them."""

    def launch(self) -> None:
        """Nothing: the backward pass posted them."""

    def leave(self, params: list[Tensor]) -> None:
        """The step rebuilds these from rows (over any average sent); one unsent and not rebuilt is averaged now."""
        left = {id(p) for p in params}
        self.average([p for p in self.unsent if id(p) not in left])

    def average(self, params: list[Tensor]) -> None:
        """Average these now, in one blocking all-reduce (every rank calls it alike): rows that did not give them."""
        GradientAllreduce(self.backend, []).average(params)


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
            self.sending = ToOwners(backend, owner, self.rebuilt)
            params = [p for p in net.parameters() if p.requires_grad]
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
