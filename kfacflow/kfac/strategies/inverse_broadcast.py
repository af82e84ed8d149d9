"""Strategy *broadcast*: what travels once factors are inverted, and how every rank ends with the same update.

``kfac.broadcast`` names one. An :class:`InverseBroadcast` (``packed``, ``owner_keeps``, ``full``)
broadcasts each communicated inverse from its owner, and every rank preconditions every layer;
the update broadcasts (``update``, ``fused_update``: :mod:`kfacflow.kfac.strategies.update_broadcast`) send
layers' updates instead. The pipeline it is handed to asks it to invert (:meth:`invert`, and
:meth:`invert_arriving` for a pipeline that inverts as factors arrive); the orchestrator asks it to
precondition and to give every inverse for a checkpoint; the simulator asks it to :meth:`replay` the
same on its model of the link; what it decides of the plan it writes into the
:class:`~kfacflow.kfac.planning.plan.Choice`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import Tensor

from kfacflow.kfac.planning.plan import Choice
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
from kfacflow.kfac.strategies.replay import Clock, Replay, per_element
from kfacflow.registry import BROADCASTS

if TYPE_CHECKING:
    from kfacflow.kfac.layers import KFACLayer

Updates = tuple[dict[str, Tensor], list[Tensor]]
"""Each live layer's update by name, and each one's contribution to the precondition stage's ``finish``."""


@dataclass(frozen=True)
class InverseBroadcast(Broadcast):
    """Each communicated inverse broadcast from its owner; every rank preconditions every layer.

    ``owner_keeps``: the owner keeps its own inverse where the unpacked copy would be bit-equal
    (otherwise every rank, the owner too, takes the broadcast copy: every rank holds the same
    bits). ``full``: whole matrices, twice the bytes, used where they land (no packing).
    """

    owner_keeps: bool = False
    full: bool = False
    lacks: ClassVar[Mapping[str, str]] = {
        OWNERS_READ_FACTORS: "sends inverses that every rank applies",
        OWNERS_PRECONDITION: "has every rank precondition every layer",
    }

    def shape(self, choice: Choice) -> Choice:
        """Inverses travel, packed or whole."""
        return replace(choice, full=self.full)

    def invert(self, state: State, engine: Engine, slots: list[FactorSlot]) -> list[Sent]:
        """Invert the ``slots`` this rank inverts; post the broadcast of every communicated one, in order."""
        sent: list[Sent] = []
        for batch in batches(slots, engine.backend.device, engine.timer.tracing):
            state.invert(batch)
            sent += [self._send(state, engine, slot) for slot in batch if slot.owner != EVERY_RANK]
        return sent

    def invert_arriving(
        self, state: State, plan: Routes, engine: Engine, arrivals: Iterator[dict[str, Tensor]]
    ) -> list[Sent]:
        """Invert in the plan's order, each factor as soon as its reduction has completed.

        The order stays the plan's (communicated factors by estimated finish, then the rest)
        because broadcasts run one after another in the order they are posted: a factor inverted
        early but sent late would hold up every broadcast behind it.
        """
        arrived: set[str] = set()
        sent: list[Sent] = []
        ready: list[FactorSlot] = []
        for slot in plan.order:
            if slot.key not in arrived:  # invert what has come before waiting for more
                sent += self.invert(state, engine, ready)
                ready = []
            while slot.key not in arrived and (averaged := next(arrivals, None)) is not None:
                arrived.update(state.average(averaged))
            ready.append(slot)
        sent += self.invert(state, engine, ready)
        for averaged in arrivals:  # the rest (and the communicator's bookkeeping after the last)
            state.average(averaged)
        return sent

    def _send(self, state: State, engine: Engine, slot: FactorSlot) -> Sent:
        """Post the broadcast of a communicated inverse: its owner's, or a buffer to receive it."""
        backend, timer = engine.backend, engine.timer
        keep = False
        if slot.owner == backend.rank:
            inverse = state.inverses[slot.key]
            if self.full:
                flat, keep = inverse.to_full(), inverse.full_exact()  # the owner's own bits travel
            else:
                with timer.span("InverseComm", slot.key, "pack"):
                    flat = inverse.to_flat()
                    keep = self.owner_keeps and inverse.round_trip_exact()
        else:
            flat = torch.empty(slot.flat_size, dtype=state.inverse_dtype, device=backend.device)
        with timer.span("InverseComm"):
            handle = backend.broadcast_async(flat, slot.owner)
        timer.on_done(handle, f"{slot.key} from {slot.owner}", "broadcast")
        return Sent(slot, flat, handle, keep)

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
        """Precondition every layer here, each once both of its inverses are (broadcast ones as they land).

        ``early``: the pipeline's, called with the work that can start before every inverse has
        landed (the ``arrival`` pipeline starts it; the others leave it to the end).
        """
        waiting = {send.slot.key for send in sent}
        updates: dict[str, Tensor] = {}
        result = state.result

        def apply_ready() -> None:
            for layer, grad in live:
                if layer.name not in updates and f"{layer.name}/A" not in waiting and f"{layer.name}/G" not in waiting:
                    updates[layer.name] = apply.layer(layer, grad)

        early(apply_ready)
        with torch.no_grad():
            for send in sent:
                with engine.timer.span("InverseComm"):
                    send.handle.wait()
                if not send.keep:  # every rank holds the same bits: the broadcast copy
                    state.inverses[send.slot.key] = state.to_apply(self._received(engine, result, send))
                waiting.discard(send.slot.key)
                early(apply_ready)
        apply_ready()
        stage = apply.stage
        contributions = [stage.contribution(updates[layer.name], g) for layer, g in live] if stage.clips else []
        return updates, contributions

    def _received(self, engine: Engine, result: type[Inverse], send: Sent) -> Inverse:
        if self.full:
            return result.from_full(send.flat, send.slot.dim)
        with engine.timer.span("InverseComm", f"{send.slot.key} unpack", "unpack"):
            return result.unflat(send.flat, send.slot.dim)

    def replay(self, r: Replay, pipeline: Pipeline) -> dict[str, float]:
        """Replay on the simulator's link what :meth:`invert` and :meth:`precondition` do; return the breakdown.

        Every rank averages each factor once it has arrived (the pipeline says when that is) and
        inverts what it owns in the plan's order, each owner packing and posting its broadcasts;
        then, after the gradients, it receives and unpacks each broadcast and preconditions every
        layer (as they land where the pipeline starts early).
        """
        keys, plan = r.keys, r.plan
        sizes, owners = list(plan.sizes), plan.owners
        # Whole matrices travel from the owner's memory and are used where they land: no (un)packing.
        pack = [0.0] * len(keys) if self.full else per_element(r.rows, sizes, "t_pack")
        unpack = [0.0] * len(keys) if self.full else per_element(r.rows, sizes, "t_unpack")
        here = pipeline.arrived([r.arrival.get(k, r.start) for k in keys], r.start)
        ranks = [Clock(r.start) for _ in range(r.workers)]
        by_arrival = sorted(range(len(keys)), key=lambda i: (here[i], i))
        averaged = 0  # how many of by_arrival every rank has averaged in (the same on every rank)
        sent: list[tuple[int, float]] = []  # (factor, broadcast end), in the order they are posted
        for i in plan.order:  # each factor once it is here, as invert_arriving does
            while averaged < len(keys) and here[by_arrival[averaged]] <= here[i]:
                j = by_arrival[averaged]
                for rank in ranks:
                    rank.wait(here[j], "FactorComm")
                    rank.t += r.update[j]
                averaged += 1
            for k, rank in enumerate(ranks):
                if owners[i] in (EVERY_RANK, k):
                    rank.t += r.costs[i]
                    rank.inverse += r.costs[i]
            if owners[i] != EVERY_RANK and r.inverts(keys[i]):  # nothing is sent where nothing was inverted
                owner = ranks[owners[i]]
                owner.t += pack[i]
                sent.append((i, r.link.send(owner.t, r.prof.broadcast(sizes[i])) if r.workers > 1 else owner.t))
        cost, _ = r.preconditioning
        for k, rank in enumerate(ranks):
            rank.wait(r.grads_done, "GradComm")
            waiting = {keys[i] for i, _ in sent}
            done: set[str] = set()

            def ready(rank: Clock = rank, waiting: set[str] = waiting, done: set[str] = done) -> None:
                for row in r.rows:
                    name = row["name"]
                    if name not in done and f"{name}/A" not in waiting and f"{name}/G" not in waiting:
                        done.add(name)
                        rank.t += cost[name]

            pipeline.early(ready)
            for i, end in sent:
                rank.wait(end, "InverseComm")
                if not (self.owner_keeps and owners[i] == k):
                    rank.t += unpack[i]
                    rank.waits = rank.waits or {}
                    rank.waits["InverseComm"] = rank.waits.get("InverseComm", 0.0) + unpack[i]
                waiting.discard(keys[i])
                pipeline.early(ready)
            ready()
        last = max(ranks, key=lambda rank: rank.t)
        return r.breakdown(last, sum(pack[i] for i, _ in sent if owners[i] == ranks.index(last)))

    def every_inverse(self, state: State, plan: Routes, engine: Engine) -> dict[str, Inverse]:
        """Every rank holds every inverse already."""
        return state.inverses

    def holds(self, owner: int | None, rank: int) -> bool:
        """Every rank applies every inverse (a checkpoint's are all restored)."""
        return True


BROADCASTS.add("packed", InverseBroadcast(), "every rank, the owner too, unpacks the broadcast copy")
BROADCASTS.add(
    "owner_keeps",
    InverseBroadcast(owner_keeps=True),
    "the owner keeps its inverse where the unpacked copy would be bit-equal",
)
BROADCASTS.add(
    "full",
    InverseBroadcast(owner_keeps=True, full=True),
    "whole matrices: twice the bytes, no packing or unpacking on any rank",
)
