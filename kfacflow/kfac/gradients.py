"""A step's own gradient traffic when kfacflow averages the gradients itself (no DDP or Horovod in the backward pass).

:class:`GradientAllreduce` averages them after the backward pass, behind the factors; :class:`ToOwners`
sends each as the backward pass computes it, an owned layer's to its owner alone. Both are the
step's :class:`Gradients`; the strategies of :mod:`~kfacflow.kfac.strategies.grad_sync`
make them. Every trained parameter has its place in every bucket on every rank, one this rank has
no gradient of as zeros that say so (:func:`~kfacflow.comm.averaging.flagged`): ranks sum by
position, and a layer that did not run on some rank (an expert no token went to) must neither
shift another's gradient nor be averaged as a zero where no rank ran it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from torch import Tensor, nn

from kfacflow.comm.averaging import average_sparse, flagged, write_back
from kfacflow.comm.base import Backend, Handle
from kfacflow.kfac.stages.contracts import EVERY_RANK


class Gradients(Protocol):
    """A step's own gradient traffic (made by :meth:`~kfacflow.kfac.strategies.contracts.GradSync.gradients`)."""

    def route(self, owned: list[list[Tensor]]) -> None:
        """Send the gradients of ``owned[r]`` (parameters) to rank ``r`` alone (before :meth:`launch`)."""
        ...

    def launch(self) -> None:
        """Post the collectives (once), behind the step's factors."""
        ...

    def wait(self) -> None:
        """Launch if need be, wait, and write the averages back into the gradients."""
        ...

    def leave(self, params: list[Tensor]) -> None:
        """Leave these parameters' gradients out (before :meth:`launch`): the step rebuilds their averages itself."""
        ...

    def average(self, params: list[Tensor]) -> None:
        """Average these parameters' gradients now, in one blocking collective (every rank calls it alike)."""
        ...


class Elsewhere:
    """Whether any rank has a gradient of each parameter sent to one owner: every rank must know.

    An owner preconditions its layers and sends each one's update (``kfac.broadcast=update``), and
    every rank takes part in that for the layers that have a gradient. Where a layer did not run on
    this rank (no gradient here) but did on another, this rank gives it a placeholder of zeros, which
    the owner's update replaces; where it ran on no rank, no rank has one. One small all-reduce of a
    flag per such parameter, read only where this rank lacks a gradient.

    Args:
        backend: The engine.
        routed: Every parameter reduced to an owner, in an order every rank shares.
        others: Those of them another rank owns.
    """

    def __init__(self, backend: Backend, routed: list[Tensor], others: list[Tensor]) -> None:
        self.others = others
        flags = torch.tensor([float(p.grad is not None) for p in routed], dtype=torch.float32)
        self.index = {id(p): i for i, p in enumerate(routed)}
        self.flags = flags.to(backend.device) if routed else flags
        self.handle = backend.allreduce_async(self.flags) if routed else None

    def place(self) -> None:
        """A placeholder for each parameter another rank owns that some rank, but not this one, has a gradient of."""
        if self.handle is None:
            return
        self.handle.wait()
        lacking = [p for p in self.others if p.grad is None]
        if lacking:
            counts = self.flags.tolist()
            for p in lacking:
                if counts[self.index[id(p)]] > 0:
                    p.grad = torch.zeros_like(p)


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
        self.inflight: list[tuple[list[nn.Parameter], Tensor, Handle]] = []
        self.owned: list[list[Tensor]] = []
        self.routed: tuple[list[Tensor], Handle] | None = None
        self.elsewhere: Elsewhere | None = None
        self.launched = False
        self.left: set[int] = set()
        self.sparse: list[Tensor] = []

    def route(self, owned: list[list[Tensor]]) -> None:
        """Send the gradients of ``owned[r]`` (parameters) to rank ``r`` alone (before :meth:`launch`)."""
        self.owned = owned

    def leave(self, params: list[Tensor]) -> None:
        """Leave these parameters' gradients out (before :meth:`launch`): the step rebuilds their averages itself."""
        self.left = {id(p) for p in params}

    def average(self, params: list[Tensor]) -> None:
        """Average these parameters' gradients now, in one blocking all-reduce (every rank calls it alike)."""
        params = [p for p in params if p.requires_grad]
        if params and self.backend.world_size > 1:
            flat = flagged(params)
            self.backend.allreduce_async(flat).wait()
            write_back(params, flat, self.backend.world_size)

    def launch(self) -> None:
        """Post the collectives (once)."""
        if self.launched:
            return
        self.launched = True
        if self.backend.world_size == 1:
            return
        # Every trained parameter has its place on every rank, one this rank has no gradient of too
        # (:func:`flagged`), so that the buckets are the same everywhere whichever layers ran here.
        routed = {id(p) for ps in self.owned for p in ps} | self.left
        pieces = [[p for p in ps if p.requires_grad and id(p) not in self.left] for ps in self.owned]
        if any(pieces):
            flats = [flagged(piece) if piece else None for piece in pieces]
            counts = [0 if f is None else f.numel() for f in flats]
            flat = torch.cat([f for f in flats if f is not None])
            self.routed = (pieces[self.backend.rank], self.backend.reduce_to_owners_async(flat, counts))
            others = [p for r, piece in enumerate(pieces) if r != self.backend.rank for p in piece]
            self.elsewhere = Elsewhere(self.backend, [p for piece in pieces for p in piece], others)
        self.sparse = [p for p in self.params if p.grad is not None and p.grad.is_sparse]  # no bucket takes them
        routed |= {id(p) for p in self.sparse}
        dense = [p for p in self.params if p.requires_grad and id(p) not in routed]
        bucket: list[nn.Parameter] = []
        nbytes = 0
        for p in dense:
            bucket.append(p)
            nbytes += p.numel() * p.element_size()
            if nbytes >= self.BUCKET_BYTES:
                self._post(bucket)
                bucket, nbytes = [], 0
        if bucket:
            self._post(bucket)

    def _post(self, bucket: list[nn.Parameter]) -> None:
        flat = flagged(bucket)
        self.inflight.append((bucket, flat, self.backend.allreduce_async(flat)))

    def wait(self) -> None:
        """Launch if need be, wait, and write the averages back into the gradients (routed ones: on their owner)."""
        self.launch()
        if self.routed is not None:
            mine, handle = self.routed
            if mine:
                write_back(mine, handle.wait(), self.backend.world_size)
            else:
                handle.wait()
            self.routed = None
        if self.elsewhere is not None:
            self.elsewhere.place()
            self.elsewhere = None
        for bucket, flat, handle in self.inflight:
            handle.wait()
            write_back(bucket, flat, self.backend.world_size)
        self.inflight = []
        average_sparse(self.backend, self.sparse)
        self.sparse = []


def sparse_parameters(net: nn.Module) -> list[Tensor]:
    """The parameters whose gradients are sparse (an ``nn.Embedding(sparse=True)``'s), known from the model alone."""
    return [m.weight for m in net.modules() if isinstance(m, nn.Embedding | nn.EmbeddingBag) and m.sparse]


class ToOwners:
    """A backward pass's gradients sent as computed: each owned layer's to its owner alone, the rest all-reduced.

    Buckets of :attr:`BUCKET_BYTES` per destination, posted on K-FAC's group from each parameter's
    post-accumulate hook. Ranks sum buckets by position, so a bucket's parameters are fixed by one
    order that every rank shares, the reverse of the model's (the order most backward passes compute
    them in): a parameter joins its bucket once it and every parameter before it are final, and when
    the pass is over (:meth:`flush`) those that got no gradient on this rank (a layer that did not run
    here, as an expert no token went to) join theirs as zeros that say so (:func:`flagged`), and the
    last, smaller buckets go. :meth:`wait` writes the averages back: every rank's for the all-reduced
    parameters, the owner's alone for its own (the other ranks keep their local gradients, which
    nothing reads: the owner sends the layer's update).

    The parameters whose averages the step rebuilds from rows are not sent at all: to the
    preconditioner this is the step's :class:`Gradients`, with nothing left
    to launch, which leaves out those it was built without and averages on demand those a rank's rows
    could not give (:meth:`average`).

    Args:
        backend: The engine.
        owner: Each routed parameter's owner, by ``id``; the rest are all-reduced.
        params: The trained parameters, in the model's order.
        rebuilt: The parameters none of whose gradients is sent (the step rebuilds their averages).
        sparse: The parameters whose gradients are sparse (averaged apart, once the pass is over).
    """

    BUCKET_BYTES = 4 * 2**20

    def __init__(
        self,
        backend: Backend,
        owner: dict[int, int],
        params: Sequence[Tensor] = (),
        rebuilt: Sequence[Tensor] = (),
        sparse: Sequence[Tensor] = (),
    ) -> None:
        self.backend, self.owner = backend, owner
        self.unsent, self.rebuilt = list(rebuilt), {id(p) for p in rebuilt}
        self.sparse, apart = list(sparse), {id(p) for p in sparse}
        self.order = [p for p in reversed(params) if id(p) not in self.rebuilt and id(p) not in apart]
        """The parameters sent, in the order every rank joins them to their buckets."""
        self._final: set[int] = set()
        self._next = 0
        self.pending: dict[int, tuple[list[Tensor], int]] = {}
        """Each destination's parameters not yet posted, and their bytes."""
        self.posted: list[tuple[int, list[Tensor], Tensor, Handle]] = []
        self.elsewhere: Elsewhere | None = None

    def ready(self, param: Tensor) -> None:
        """A parameter's gradient is final for this step: queue what the shared order lets go, post full buckets."""
        self._final.add(id(param))
        self._join(until_final=True)

    def _join(self, until_final: bool) -> None:
        while self._next < len(self.order) and (not until_final or id(self.order[self._next]) in self._final):
            param = self.order[self._next]
            self._next += 1
            key = self.owner.get(id(param), EVERY_RANK)
            params, nbytes = self.pending.get(key, ([], 0))
            params.append(param)
            nbytes += param.numel() * param.element_size()
            self.pending[key] = (params, nbytes)
            if nbytes >= self.BUCKET_BYTES:
                self._post(key)

    def flush(self) -> None:
        """Join the rest (no gradient here: zeros), post what is left, destinations in a fixed order."""
        self._join(until_final=False)
        for key in sorted(self.pending):
            self._post(key)
        if self.elsewhere is None:  # once, when the pass is over
            routed = [p for p in self.order if self.owner.get(id(p), EVERY_RANK) != EVERY_RANK]
            others = [p for p in routed if self.owner[id(p)] != self.backend.rank]
            self.elsewhere = Elsewhere(self.backend, routed, others)

    def _post(self, key: int) -> None:
        params, _ = self.pending.pop(key)
        flat = flagged(params)
        handle = self.backend.allreduce_async(flat) if key == EVERY_RANK else self.backend.reduce_async(flat, key)
        self.posted.append((key, params, flat, handle))

    def wait(self) -> None:
        """Wait for every bucket and write the averages back where this rank holds them."""
        self.flush()
        for key, params, flat, handle in self.posted:
            handle.wait()
            if key in (EVERY_RANK, self.backend.rank):
                write_back(params, flat, self.backend.world_size)
        self.posted = []
        if self.elsewhere is not None:
            self.elsewhere.place()
        average_sparse(self.backend, [p for p in self.sparse if p.grad is not None])
        self.sparse = []

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
