"""Strategy *broadcast*, updates: a layer's owner preconditions it and sends the update; no inverse travels.

``kfac.broadcast=update`` and ``fused_update``. Each layer's owner inverts both of its factors,
preconditions the layer and sends the update (the layer's size, far less than its inverses), so the
preconditioning is shared out too and every rank applies the owner's bits; ``fused_update`` sends
the updates of consecutive layers in buckets. Since no other rank reads a layer's factors or
gradients, it lets them go to the owner alone (:data:`~kfacflow.kfac.strategies.contracts.OWNERS_READ_FACTORS`,
:data:`~kfacflow.kfac.strategies.contracts.OWNERS_PRECONDITION`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import Tensor

from kfacflow.comm import scatter
from kfacflow.comm.base import Handle, Piece
from kfacflow.kfac.owners import every_inverse
from kfacflow.kfac.planning.plan import Choice, EngineCaps
from kfacflow.kfac.planning.routes import batches
from kfacflow.kfac.stages.contracts import EVERY_RANK, FactorSlot, Inverse
from kfacflow.kfac.strategies.contracts import (
    OWNERS_PRECONDITION,
    OWNERS_READ_FACTORS,
    Apply,
    Broadcast,
    Engine,
    Pipeline,
    Routes,
    Sent,
    State,
)
from kfacflow.kfac.strategies.inverse_broadcast import Updates
from kfacflow.kfac.strategies.replay import Clock, Replay, counts
from kfacflow.registry import BROADCASTS

if TYPE_CHECKING:
    from kfacflow.kfac.layers import KFACLayer
    from kfacflow.kfac.stages.contracts import PreconditionStage


@dataclass(frozen=True)
class UpdateBroadcast(Broadcast):
    """A layer's owner inverts both of its factors, preconditions it and sends the update; no inverse travels.

    ``fused``: the updates travel in the plan's buckets (consecutive layers of the shared order),
    each one collective: a zero-filled all-reduce into which the owners wrote their disjoint
    pieces (``x + 0 = x`` exactly), or a gather from the owners where the plan says so.
    """

    fused: bool = False
    gives: ClassVar[frozenset[str]] = frozenset({OWNERS_READ_FACTORS, OWNERS_PRECONDITION})

    def shape(self, choice: Choice) -> Choice:
        """Updates travel (whole layers to owners), in buckets where fused."""
        return replace(choice, update=True, fused=self.fused)

    def invert(self, state: State, engine: Engine, slots: list[FactorSlot]) -> list[Sent]:
        """Invert what this rank holds; nothing is sent (the owners send their layers' updates)."""
        for batch in batches(slots, engine.backend.device, engine.timer.tracing):
            state.invert(batch)
        return []

    def invert_arriving(
        self, state: State, plan: Routes, engine: Engine, arrivals: Iterator[dict[str, Tensor]]
    ) -> list[Sent]:
        """No inverse is sent, so no order binds the ranks: invert what has come, each reduction as it completes."""
        for group in arrivals:
            state.average(group)
            self.invert(state, engine, [slot for slot in plan.order if slot.key in group])
        return []

    def precondition(
        self,
        state: State,
        plan: Routes,
        engine: Engine,
        apply: Apply,
        live: list[tuple[KFACLayer, Tensor]],
        sent: list[Sent],
        early: Callable[[Callable[[], None]], None],
    ) -> Updates:
        """Precondition the layers this rank owns (and every rank's), sending each owned update.

        Every rank walks the plan's layer order and posts each communicated layer's collective in
        it (collectives run in the order they are posted): a broadcast of its own update as soon
        as it is computed, a receive buffer for the others'; a bucket as one collective once its
        last layer is reached. Every rank then applies the owner's bits. Where the gradients went
        to their owners alone, the owners compute their layers' contributions and send them in one
        all-reduce of zero-filled float64 slots. Where the owners also run the first-order step of
        their layers (``apply.owned``: Muon's, :mod:`kfacflow.on_owners.muon_step`), every update is
        computed first, those slots are reduced, and each owner sends what it finishes in the walk.
        """
        grads = {layer.name: g for layer, g in live}
        backend, timer = engine.backend, engine.timer
        rank = backend.rank
        owner = {slot.layer.name: slot.owner for slot in plan.slots}
        bucketed = {name for names in plan.update_buckets.values() for name in names}
        stage, owned = apply.stage, apply.owned
        sent_layers = [name for name in grads if owner[name] != EVERY_RANK]
        # The owners' v.g go to every rank where no other rank can compute it: the gradients went to the
        # owners alone, or the owners send finished directions in place of their updates.
        from_owners = (bool(plan.grad_owned) or owned is not None) and stage.clips
        updates: dict[str, Tensor] = {}
        mine: dict[str, Tensor] = {}
        posted: list[tuple[list[str], Handle]] = []
        alone = [
            layer.name
            for layer in plan.layer_order
            if layer.name in grads and owner[layer.name] != EVERY_RANK and layer.name not in bucketed
        ]
        if owned is not None:
            owned.begin(owner, list(grads))
        tags = self._receive(engine, alone, grads, owner, updates, posted)

        def compute(layer: KFACLayer) -> None:
            grad, src = grads.get(layer.name), owner[layer.name]
            if grad is not None and src in (EVERY_RANK, rank):
                updates[layer.name] = apply.layer(layer, grad).contiguous()
                if from_owners and src == rank:
                    mine[layer.name] = stage.contribution(updates[layer.name], grad)

        with torch.no_grad():
            if owned is not None:  # every update first: the owners finish theirs by what all of them give
                for layer in plan.layer_order:
                    compute(layer)
                with timer.span("MuonComm"):  # what the owners' Muon step waits for: every owner's v.g
                    dots = self._dots(engine, sent_layers, mine) if from_owners else None
                    received = dict(zip(sent_layers, dots.wait(), strict=True)) if dots is not None else {}
                owned.settle(self._contributions(stage, grads, updates, received), updates, sent_layers, owner)
            for layer in plan.layer_order:  # each finished update leaves as soon as it is made
                grad, src = grads.get(layer.name), owner[layer.name]
                if owned is None:
                    compute(layer)
                elif layer.name in owned.directed and src == rank:
                    updates[layer.name] = owned.finish(layer.name)
                if layer.name in plan.update_buckets:
                    posted += self._post_bucket(plan, engine, layer.name, grads, updates, owner)
                elif layer.name in tags and src == rank:
                    with timer.span("InverseComm"):
                        for dst in range(backend.world_size):
                            if dst != rank:
                                posted.append(([], backend.send_async(updates[layer.name], dst, tags[layer.name])))
                elif grad is not None and layer.name in alone and not tags:
                    if src != rank:
                        updates[layer.name] = torch.empty(grad.shape, dtype=grad.dtype, device=grad.device)
                    with timer.span("InverseComm"):
                        handle = backend.broadcast_async(updates[layer.name], src)
                    timer.on_done(handle, f"{layer.name} update from {src}", "broadcast")
                    posted.append(([], handle))
            if owned is None:
                dots = self._dots(engine, sent_layers, mine) if from_owners and sent_layers else None
            for names, handle in posted:  # names: a bucket's layers, to be cut out of it
                with timer.span("InverseComm"):
                    buffer = handle.wait()
                offset = 0
                for name in names:
                    grad = grads[name]
                    updates[name] = buffer[offset : offset + grad.numel()].view(grad.shape)
                    offset += grad.numel()
            if not stage.clips:
                return updates, []
            if owned is not None:
                return updates, owned.contributions[: len(grads)]
            received = dict(zip(sent_layers, dots.wait(), strict=True)) if dots is not None else {}
        return updates, self._contributions(stage, grads, updates, received)

    @staticmethod
    def _dots(engine: Engine, sent: list[str], mine: dict[str, Tensor]) -> Handle | None:
        """Every owner's ``v.g`` of its sent layers to every rank: one all-reduce of zero-filled float64 slots."""
        if not sent:
            return None
        backend = engine.backend
        slots = torch.zeros(len(sent), dtype=torch.float64, device=backend.device)
        for i, name in enumerate(sent):
            if name in mine:
                slots[i] = mine[name]
        return Piece(backend.allreduce_async(slots), slots)  # x + 0 == x: every rank receives each owner's bits

    @staticmethod
    def _contributions(
        stage: PreconditionStage, grads: dict[str, Tensor], updates: dict[str, Tensor], received: dict[str, Tensor]
    ) -> list[Tensor]:
        """Each live layer's contribution: an owner's as received, else this rank's own of its update."""
        if not stage.clips:
            return []
        return [received[n] if n in received else stage.contribution(updates[n], g) for n, g in grads.items()]

    def _receive(
        self,
        engine: Engine,
        alone: list[str],
        grads: dict[str, Tensor],
        owner: dict[str, int],
        updates: dict[str, Tensor],
        posted: list[tuple[list[str], Handle]],
    ) -> dict[str, int]:
        """Where owners send their updates point to point, post every receive now; return each layer's tags.

        Each layer sent alone gets its tags here, in the shared order, on every rank: its owner sends
        with them once it has the update, while every receive waits from the start, so each owner's
        updates leave as it computes them (:meth:`~kfacflow.kfac.planning.plan.EngineCaps.sends_updates_direct`).
        Elsewhere nothing is posted and no tag taken: the updates are broadcast in the walk.
        """
        backend = engine.backend
        if not EngineCaps.of(backend).sends_updates_direct(backend.world_size):
            return {}
        tags: dict[str, int] = {}
        with engine.timer.span("InverseComm"):
            for name in alone:
                grad = grads[name]
                tags[name] = backend.reserve(grad)
                if owner[name] != backend.rank:
                    updates[name] = torch.empty(grad.shape, dtype=grad.dtype, device=grad.device)
                    posted.append(([], backend.recv_async(updates[name], owner[name], tags[name])))
        return tags

    def _post_bucket(
        self,
        plan: Routes,
        engine: Engine,
        key: str,
        live: dict[str, Tensor],
        updates: dict[str, Tensor],
        owner: dict[str, int],
    ) -> list[tuple[list[str], Handle]]:
        """Send the owners' updates of one bucket to every rank in one collective; return its layers in its order.

        Where the bucket gathers, each owner's layers are its piece, in rank order; otherwise every
        rank adds zeros to each owner's piece of an all-reduced buffer (``x + 0 == x`` exactly).
        Either way every rank (the owner too, which takes the received copy) ends with the owner's bits.
        """
        names = [name for name in plan.update_buckets[key] if name in live]
        if not names:
            return []
        first = live[names[0]]
        backend, timer = engine.backend, engine.timer
        with timer.span("InverseComm"):
            if key in plan.gathered:
                names = sorted(names, key=lambda name: owner[name])  # stable: the bucket's order within a rank
                counts = [sum(live[n].numel() for n in names if owner[n] == r) for r in range(backend.world_size)]
                own = [updates[n].reshape(-1) for n in names if owner[n] == backend.rank]
                piece = torch.cat(own) if own else first.new_empty(0)
                handle: Handle = backend.gather_async(piece, counts)
            else:
                buffer = first.new_zeros(sum(live[name].numel() for name in names))
                offset = 0
                for name in names:
                    if name in updates:
                        buffer[offset : offset + live[name].numel()].copy_(updates[name].reshape(-1))
                    offset += live[name].numel()
                handle = Piece(backend.allreduce_async(buffer), buffer)
        timer.on_done(handle, f"{len(names)} updates, {names[0]}..{names[-1]}", "broadcast")
        return [(names, handle)]

    def replay(self, r: Replay, pipeline: Pipeline) -> dict[str, float]:
        """Replay on the simulator's link what :meth:`invert` and :meth:`precondition` do; return the breakdown.

        Every rank averages each factor it receives once it has arrived (the pipeline says when)
        and inverts the ones it holds (its layers' and the NCTs'). Then, after the gradients, it
        walks the plan's layer order: it preconditions its own and the NCT layers, and each own
        update (or bucket, at its last layer) is posted there; the link carries them in that order.
        """
        keys, plan = r.keys, r.plan
        sizes, owners = plan.sizes, plan.owners
        to_owner = plan.factor_owners is not None
        here = pipeline.arrived([r.arrival.get(k, r.start) for k in keys], r.start)
        ranks = [Clock(r.start) for _ in range(r.workers)]
        for i in sorted(range(len(keys)), key=lambda i: (here[i], i)):
            for k, rank in enumerate(ranks):
                if to_owner and owners[i] not in (EVERY_RANK, k):
                    continue  # another rank's factor: it never comes here
                rank.wait(here[i], "FactorComm")
                rank.t += r.update[i]
                if owners[i] in (EVERY_RANK, k):
                    rank.t += r.costs[i]
                    rank.inverse += r.costs[i]
        cost, _ = r.preconditioning
        done: dict[int, float] = {}  # communicated layers and when their owner has the update
        for rank in ranks:
            rank.wait(r.grads_done, "GradComm")
        for j in plan.layer_order:
            owner = owners[2 * j]
            for k, rank in enumerate(ranks):
                if owner in (EVERY_RANK, k):
                    rank.t += cost[r.rows[j]["name"]]
            if owner != EVERY_RANK:
                done[j] = ranks[owner].t
        sends: list[tuple[float, float, int | None]] = []  # each bucket at its last layer, others alone, as posted
        bucket_of = {b[-1]: n for n, b in enumerate(plan.buckets)}
        bucketed = {j for b in plan.buckets for j in b}
        for j in done:
            if j in bucket_of:  # a gather from the owners or a zero-filled all-reduce, as planned
                b = plan.buckets[bucket_of[j]]
                if bucket_of[j] in plan.gathered:
                    seconds = scatter.cost(r.prof.broadcast, counts(b, sizes[::2], owners[::2], r.workers))
                else:
                    seconds = r.prof.allreduce(sum(sizes[2 * i] for i in b))
                sends.append((max(done[i] for i in b), seconds, None))
            elif j not in bucketed:  # point to point (P = 2): the one direction into the other rank
                into = 1 - owners[2 * j] if r.updates_direct else None
                sends.append((done[j], r.prof.broadcast(sizes[2 * j]), into))
        if r.routed and sends:  # each owned layer's v.g (float64: two elements), after the updates
            sends.append((max(t for t, _, _ in sends), r.prof.allreduce(2 * len(done)), None))
        ends = [r.link.send(t, seconds, into) if r.workers > 1 else t for t, seconds, into in sends]
        for rank in ranks:
            rank.wait(max(ends, default=0.0), "InverseComm")
        return r.breakdown(max(ranks, key=lambda rank: rank.t))

    def every_inverse(self, state: State, plan: Routes, engine: Engine) -> dict[str, Inverse]:
        """Each inverse lives on its owner only: the owners send theirs to every rank (collective)."""
        return every_inverse(state.inverses, plan.slots, engine.backend)

    def holds(self, owner: int | None, rank: int) -> bool:
        """A rank needs its own layers' inverses only."""
        return owner in (EVERY_RANK, rank)


BROADCASTS.add(
    "update",
    UpdateBroadcast(),
    "a layer's owner inverts both factors, preconditions it and broadcasts the update; no inverse travels",
)
BROADCASTS.add(
    "fused_update",
    UpdateBroadcast(fused=True),
    "as update, the updates summed into zero-filled buckets (one all-reduce each): one start-up per bucket",
)
