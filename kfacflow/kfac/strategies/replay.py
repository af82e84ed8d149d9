"""The simulator's model of a step, which each strategy replays its own part on (:mod:`kfacflow.simulation.events`).

One shared :class:`Link` carries every collective, one at a time in the order they are posted (a
reduction to one rank, or an update sent point to point, between two ranks takes one direction only);
each rank has a :class:`Clock` that counts what it waited for; :class:`Replay` is what the passes leave
for the strategies: when each factor arrived, when the gradients are averaged, the plan, the costs. A
strategy's ``replay`` reads and advances it, as its ``run`` does the real step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from kfacflow.kfac.planning.plan import StepPlan
from kfacflow.perf import Profile
from kfacflow.timing import PAPER_OTHER

BUCKET_ELEMENTS = 25 * 2**20 // 4
"""DDP's default gradient bucket (25 MiB of float32)."""
PARTS = ("FF&BP", "GradComm", "FactorComp", "FactorComm", "InverseComp", "InverseComm", "Other")


@dataclass
class Link:
    """One shared network link: operations run one at a time in the order they are posted.

    A reduction to one rank between two (``into``), or a transfer point to point, uses one direction
    only: those into different ranks run at once, each after everything posted before it that uses its
    direction.
    """

    free: float = 0.0
    into: dict[int, float] = field(default_factory=dict)
    """When each direction (by receiving rank) is free of reductions."""

    def send(self, launch: float, seconds: float, into: int | None = None) -> float:
        """Run an operation posted at ``launch`` taking ``seconds``; return when it ends."""
        if into is None:
            self.free = max(self.free, launch, *self.into.values()) + seconds
            self.into = dict.fromkeys(self.into, self.free)
            return self.free
        self.into[into] = max(self.free, launch, self.into.get(into, 0.0)) + seconds
        return self.into[into]


@dataclass
class Clock:
    """One rank's clock during the inverse and precondition phases, and what it waited for."""

    t: float
    inverse: float = 0.0
    waits: dict[str, float] | None = None

    def wait(self, until: float, part: str) -> None:
        """Wait until ``until``, counting it to ``part``."""
        if until > self.t:
            self.waits = self.waits or {}
            self.waits[part] = self.waits.get(part, 0.0) + until - self.t
            self.t = until


@dataclass
class Replay:
    """A step being replayed: what the passes left, and the models the strategies replay the rest with."""

    rows: list[dict[str, Any]]
    """The traced step's layers (``layers.json``)."""
    measured: dict[str, float]
    """The traced step's breakdown."""
    prof: Profile
    """The profile, scaled to :attr:`workers`."""
    workers: int
    plan: StepPlan
    """The running preconditioner's plan for these layers (:func:`kfacflow.simulation.events.step_plan`)."""
    costs: list[float]
    """Seconds to invert each factor."""
    update: list[float]
    """Seconds to average each factor into its running average."""
    factor_comp: float
    """The step's factor work: in the hooks and averaging."""
    ffbp: float
    link: Link
    arrival: dict[str, float]
    """When each factor's collective ends."""
    t_bwd: float
    """When the backward pass ends."""
    buckets: list[tuple[float, int]]
    """DDP's gradient buckets: when each is ready, its elements."""
    layer_grads: list[tuple[float, int]] = field(default_factory=list)
    """When each layer's gradients are ready in the backward pass, and the layer (an index into :attr:`rows`)."""
    direct: bool = False
    """Whether a reduction to owners goes straight to each owner (:func:`kfacflow.comm.scatter.direct_cost`)."""
    updates_direct: bool = False
    """Whether owners send updates point to point, one direction each
    (:meth:`~kfacflow.kfac.planning.plan.EngineCaps.sends_updates_direct`)."""
    grads_done: float = 0.0
    """When the gradients are averaged (the grad sync's replay sets it)."""
    start: float = 0.0
    """When the K-FAC step starts (the backward pass over, and what it waits for)."""
    grad_comm: float = 0.0
    """What the backward pass waited for of the gradients."""
    routed: bool = False
    """Whether the gradients went to their owners alone (who then send the KL clipping's ``v.g``)."""
    inverted: frozenset[str] | None = None
    """The factors the step inverts (``kfac.inv_update_freq``, ``kfac.inverse_schedule``; no other inverse is
    computed or sent); ``None``: every factor."""

    def inverts(self, key: str) -> bool:
        """Whether the step inverts the factor ``key``."""
        return self.inverted is None or key in self.inverted

    @property
    def keys(self) -> list[str]:
        """The factors' keys, A1, G1, A2, G2, ..."""
        return [f"{r['name']}/{side}" for r in self.rows for side in ("A", "G")]

    @cached_property
    def preconditioning(self) -> tuple[dict[str, float], float]:
        """Each layer's preconditioning seconds and the rest of the traced ``Other`` (:func:`precondition_costs`)."""
        return precondition_costs(self.rows, self.measured)

    def breakdown(self, last: Clock, packing: float = 0.0) -> dict[str, float]:
        """The step's parts as the last rank to finish saw them; ``Other`` is what no part names."""
        rest = self.preconditioning[1]
        waits = last.waits or {}
        parts = {
            "FF&BP": self.ffbp,
            "GradComm": self.grad_comm + waits.get("GradComm", 0.0),
            "FactorComp": self.factor_comp,
            "FactorComm": waits.get("FactorComm", 0.0),
            "InverseComp": last.inverse,
            "InverseComm": waits.get("InverseComm", 0.0) + packing,
        }
        parts["Other"] = last.t + rest - sum(parts.values())
        parts["total"] = last.t + rest
        return parts


def precondition_costs(rows: list[dict[str, Any]], measured: dict[str, float]) -> tuple[dict[str, float], float]:
    """Seconds to precondition each layer, and the rest of the traced step's ``Other``.

    A layer the traced rank did not precondition (another rank owned it) takes the seconds its owner
    took where the trace has them (``t_precondition_elsewhere``), else the traced seconds per
    multiply-add, ``a g (a + g)``, of those the traced rank did (a layer preconditioned from its rows
    costs far less than that). What the traced rank did precondition is taken out of the paper's
    "other" (:data:`~kfacflow.timing.PAPER_OTHER`: a trace of before it was split has ``Other`` alone),
    and the remainder is the step's other work.
    """
    flops = {r["name"]: r["a_dim"] * r["g_dim"] * (r["a_dim"] + r["g_dim"]) for r in rows}
    traced = {r["name"]: r["t_precondition"] for r in rows if r.get("t_precondition") is not None}
    owners = {r["name"]: r["t_precondition_elsewhere"] for r in rows if r.get("t_precondition_elsewhere") is not None}
    rate = sum(traced.values()) / (sum(flops[n] for n in traced) or 1)
    rest = max(0.0, sum(measured.get(part, 0.0) for part in PAPER_OTHER) - sum(traced.values()))
    return {n: traced.get(n, owners.get(n, rate * f)) for n, f in flops.items()}, rest


def per_element(rows: list[dict[str, Any]], sizes: list[int], field: str) -> list[float]:
    """Seconds of ``field`` (``t_pack`` or ``t_unpack``) for every factor, A1, G1, A2, G2, ...

    Factors the traced step did not communicate get the measured seconds per element of those it
    did (none measured: free).
    """
    times = [t for r in rows for t in (r.get(f"{field}_a"), r.get(f"{field}_g"))]
    timed = [(t, m) for t, m in zip(times, sizes, strict=True) if t is not None]
    rate = sum(t for t, _ in timed) / sum(m for _, m in timed) if timed else 0.0
    return [t if t is not None else rate * m for t, m in zip(times, sizes, strict=True)]


def counts(items: Sequence[Any], elements: Any, owners: Any, workers: int) -> list[int]:
    """Elements of ``items`` (indices into ``elements`` and ``owners``) each rank owns."""
    per_rank = [0] * workers
    for j in items:
        per_rank[owners[j]] += elements[j]
    return per_rank


def buckets(elements: int) -> list[tuple[float, int]]:
    """``elements`` of gradients in DDP-sized buckets (their times unused)."""
    return [(0.0, min(BUCKET_ELEMENTS, elements - i)) for i in range(0, elements, BUCKET_ELEMENTS)]
