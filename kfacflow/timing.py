"""Stage timers: the paper's six-part step breakdown, and per-layer events for a timeline.

Categories follow the paper (Fig. 9): ``FF&BP`` (forward and backward compute), ``GradComm``
(gradient all-reduce), ``FactorComp``, ``FactorComm``, ``InverseComp``, ``InverseComm`` (under
``kfac.broadcast=update`` the owners' updates travel there in the inverses' place), then what the
paper's figure calls "other", in four parts: ``Precondition`` (each layer's update from its
inverses, and the KL clipping of them all), ``NewtonSchulz`` (Muon's momentum and orthogonalisation
on this rank), ``MuonComm`` (waiting for the gather of Muon's owners' directions:
``optim.muon.owners``), ``Other`` (the rest of the optimizer, the step's checks), and ``Between``
(from the end of the previous step to the start of this one: the next batch, logging). A step's
time is the wall interval from the end of the previous step to its own end, so consecutive steps tile the run and
every second is in some part; only evaluations, checkpoints and a traced step's files, which are
not steps, are left out (:meth:`StepTimer.outside`).
Communication is the time the step *waits* for it (launch overhead plus blocking waits), not
the time the transfer takes: an all-reduce hidden behind computation costs nothing here.
``GradComm`` is the tail of DDP's bucketed all-reduce: from the last bucket's launch to the end
of ``backward()``, where DDP waits for all buckets (:meth:`StepTimer.end_step` attributes it).

On either device a part is the time the *worker* spent in it: on CPU the host's wall time
between a span's ends; on CUDA the compute stream's time between two CUDA events recorded at
them, resolved once after the step (one device synchronization a step, at its end), so that the
spans neither stall the host nor serialize the stream against communication. Only a traced step
(``train.timeline``, ``kfac.variant=auto``'s choice) synchronizes at every span boundary, since
its events need host times. ``train.timing=false`` times nothing but the step's wall interval
(the cost of timing itself can then be measured).

A traced collective is timed by its future where the engine finishes the work on the host
(gloo). An NCCL future is complete as soon as the work is queued on NCCL's stream, so there a
traced collective is timed by CUDA events instead: one on the compute stream when it is posted
(NCCL's stream starts it after that point) and one on a side stream made to wait for the work,
read when the step ends.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

PAPER_OTHER = ("Precondition", "NewtonSchulz", "MuonComm", "Other")
"""The parts the paper's breakdown counts as one "other" (the simulator models them as measured)."""
CATEGORIES = ("FF&BP", "GradComm", "FactorComp", "FactorComm", "InverseComp", "InverseComm", *PAPER_OTHER, "Between")
LANES = (
    "forward",
    "backward",
    "compute",
    "factor",
    "allreduce",
    "average",
    "inverse",
    "pack",
    "broadcast",
    "unpack",
    "precondition",
)
"""Where traced events go, in display order."""


UNTIL = "(until taken)"
"""Ends the name of a transfer whose end was not seen, only when it was waited for (gloo's point-to-point work)."""


class StepTimer:
    """Accumulates the breakdown of the current step and, when tracing, its events.

    Args:
        device: The training device (on CUDA, spans are timed by events on the current stream).
        enabled: Whether steps are broken down; ``False`` keeps only each step's wall time (a
            traced step is broken down all the same).
    """

    def __init__(self, device: torch.device, enabled: bool = True) -> None:
        self.cuda = device.type == "cuda"
        self.enabled = enabled
        self.device = device
        self.parts: dict[str, float] = defaultdict(float)
        self.events: list[dict[str, Any]] = []
        self.tracing = False
        self.origin = time.perf_counter()
        self._compute = 0.0
        self._last_pass = (0.0, 0.0)
        self._last_end: float | None = None
        self._outside = 0.0
        self._marks: list[tuple[str, Any, Any]] = []
        """CUDA spans of this step, resolved at its end: (category, start event, end event)."""
        self._passes: list[tuple[Any, Any, int, int]] = []
        """CUDA forward and backward passes: their events and the range of ``_marks`` inside them."""
        self._transfers: list[tuple[str, str, Any, Any]] = []
        """Traced collectives on a CUDA stream (NCCL), resolved at the end of the step: (name, lane, start, end)."""
        self._origin_event: Any = None
        self._side: Any = None

    @property
    def timing(self) -> bool:
        """Whether this step is broken down."""
        return self.enabled or self.tracing

    @property
    def _events(self) -> bool:
        """Whether spans are CUDA events (CUDA, broken down, not traced)."""
        return self.cuda and self.enabled and not self.tracing

    def now(self) -> float:
        """Return the current time in seconds (on CUDA while tracing: after the device finished its queued work)."""
        if self.cuda and self.tracing:
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def mark(self) -> Any:
        """Return a point in time that :meth:`end_step` can compare: a recorded CUDA event, else :meth:`now`."""
        if self._events:
            return _record()
        return self.now()

    def begin_step(self, trace: bool = False) -> None:
        """Start a new step; ``trace`` records per-layer events for :meth:`chrome_events`."""
        self.parts = defaultdict(float)
        self.tracing = trace
        self.events = []
        self._marks, self._passes, self._transfers = [], [], []
        self._compute, self._last_pass = 0.0, (0.0, 0.0)
        self.origin = self.now()
        # Synchronized just now: device times since this event are host times since the origin.
        self._origin_event = _record() if self.cuda and trace else None
        if self._last_end is not None:
            self.parts["Between"] = max(0.0, self.origin - self._last_end - self._outside)
        self._outside = 0.0

    @contextmanager
    def outside(self) -> Iterator[None]:
        """Leave the ``with`` body out of every step (evaluation, checkpoints: not part of a step)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._outside += time.perf_counter() - t0

    @contextmanager
    def compute(self, name: str) -> Iterator[None]:
        """Time a forward or backward pass: it counts as FF&BP less the factor work its hooks did."""
        if not self.timing:
            yield
            return
        if self._events:
            start, first = _record(), len(self._marks)
            try:
                yield
            finally:
                self._passes.append((start, _record(), first, len(self._marks)))
            return
        t0 = self.now()
        hooks = self.parts["FactorComp"] + self.parts["FactorComm"]
        try:
            yield
        finally:
            t1 = self.now()
            self._compute += (t1 - t0) - (self.parts["FactorComp"] + self.parts["FactorComm"] - hooks)
            self._last_pass = (t0, t1)
            self.record(name, "compute", t0, t1)

    @contextmanager
    def span(self, category: str, name: str | None = None, lane: str = "compute") -> Iterator[None]:
        """Add the time of the ``with`` body to ``category`` (and an event named ``name`` when tracing)."""
        if not self.timing:
            yield
            return
        if self._events:
            start = _record()
            try:
                yield
            finally:
                self._marks.append((category, start, _record()))
            return
        t0 = self.now()
        try:
            yield
        finally:
            t1 = self.now()
            self.parts[category] += t1 - t0
            if self.tracing and name is not None:
                self.record(name, lane, t0, t1)

    def add(self, category: str, seconds: float) -> None:
        """Add ``seconds`` to ``category``."""
        self.parts[category] += seconds

    def record(self, name: str, lane: str, t0: float, t1: float) -> None:
        """Record one event from ``t0`` to ``t1`` (``perf_counter`` seconds) when tracing."""
        if self.tracing:
            self.events.append({"name": name, "lane": lane, "t0": t0 - self.origin, "t1": t1 - self.origin})

    def on_done(self, handle: Any, name: str, lane: str) -> bool:
        """Record an asynchronous operation from now until ``handle`` completes (when tracing).

        Returns whether it will be recorded: a handle without a future is not (its caller may
        record it until it was waited for).
        """
        if not self.tracing or not hasattr(handle, "get_future"):
            return False
        future = handle.get_future()
        if self.cuda and future.done():  # queued on a stream (NCCL): its callbacks would run now, at zero time
            start = _record()
            if self._side is None:
                self._side = torch.cuda.Stream(self.device)
            with torch.cuda.stream(self._side):
                future.wait()  # the side stream waits for the work; the host and the compute stream do not
                self._transfers.append((name, lane, start, _record()))
            return True
        t0 = time.perf_counter()
        callback: Callable[[Any], None] = lambda _: self.record(name, lane, t0, time.perf_counter())  # noqa: E731
        future.add_done_callback(callback)
        return True

    def end_step(self, total: float | None = None, grad_launch: Any = 0.0) -> dict[str, float]:
        """Close the step; return the breakdown with ``Other`` = ``total`` minus the named parts.

        Args:
            total: The step's seconds; by default since the end of the previous step (less the time
                spent :meth:`outside` steps), or since :meth:`begin_step` for the first.
            grad_launch: When the last gradient all-reduce was launched (a :meth:`mark`). If that
                was during the last pass, the rest of that pass waited for it: GradComm, not FF&BP.
        """
        if self.cuda and (self._transfers or (not self.tracing and self.timing)):
            torch.cuda.synchronize(self.device)  # the step's one synchronization: its events are resolved
        self._resolve_transfers()
        end = time.perf_counter()
        self._last_end = end
        total = end - self.origin + self.parts["Between"] if total is None else total
        if not self.timing:
            return {"total": total}
        if self._events:
            tail = self._resolve(grad_launch)
        else:
            t0, t1 = self._last_pass
            tail = t1 - grad_launch if isinstance(grad_launch, float) and grad_launch > t0 else 0.0
        self.parts["GradComm"] += tail
        self.parts["FF&BP"] += max(0.0, self._compute - tail)
        parts = {c: self.parts.get(c, 0.0) for c in CATEGORIES if c != "Other"}
        parts["Other"] = max(0.0, total - sum(parts.values()))
        parts["total"] = total
        return parts

    def _resolve_transfers(self) -> None:
        """Record the traced collectives timed on the device, in seconds since the step's origin."""
        for name, lane, start, stop in self._transfers:
            t0 = self._origin_event.elapsed_time(start) / 1e3
            self.events.append({"name": name, "lane": lane, "t0": t0, "t1": t0 + start.elapsed_time(stop) / 1e3})
        self._transfers = []

    def _resolve(self, grad_launch: Any) -> float:
        """Add the step's CUDA spans and passes to the parts; return the last pass's tail after ``grad_launch``."""
        for category, start, stop in self._marks:
            self.parts[category] += start.elapsed_time(stop) / 1e3
        tail = 0.0
        for start, stop, first, last in self._passes:
            hooks = sum(s.elapsed_time(e) for c, s, e in self._marks[first:last] if c in ("FactorComp", "FactorComm"))
            self._compute += (start.elapsed_time(stop) - hooks) / 1e3
        if self._passes and isinstance(grad_launch, torch.cuda.Event):
            start, stop, _, _ = self._passes[-1]
            if start.elapsed_time(grad_launch) > 0:
                tail = grad_launch.elapsed_time(stop) / 1e3
        self._marks, self._passes = [], []
        return max(0.0, tail)


def _record() -> Any:
    """Record a timing event on the current CUDA stream."""
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def chrome_trace(events_by_rank: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """Return a Chrome trace (Perfetto opens it): one process per rank, one thread per lane."""
    trace: list[dict[str, Any]] = []
    lanes = list(LANES)
    for rank, events in enumerate(events_by_rank):
        trace.append({"ph": "M", "name": "process_name", "pid": rank, "args": {"name": f"rank {rank}"}})
        for e in events:
            if e["lane"] not in lanes:
                lanes.append(e["lane"])
        for tid, lane in enumerate(lanes):
            trace.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": lane}})
        for e in events:
            trace.append(
                {
                    "ph": "X",
                    "name": e["name"],
                    "cat": e["lane"],
                    "pid": rank,
                    "tid": lanes.index(e["lane"]),
                    "ts": e["t0"] * 1e6,
                    "dur": max(e["t1"] - e["t0"], 1e-7) * 1e6,
                }
            )
    return {"traceEvents": trace, "displayTimeUnit": "ms"}


def summarize(steps: list[dict[str, float]], warmup: int) -> dict[str, float]:
    """Return the mean of each part over ``steps`` after the first ``warmup`` (all steps if too few).

    Only the parts every step has (with ``train.timing=false`` the traced step alone is broken down).
    """
    kept = steps[warmup:] if len(steps) > warmup else steps
    if not kept:
        return {}
    return {k: sum(s[k] for s in kept) / len(kept) for k in kept[0] if all(k in s for s in kept)}


class StepTimes:
    """The run's step times for ``summary.json``, over every process of it (carried by the checkpoint).

    The median step time and the mean breakdown leave out the run's first ``warmup`` timed steps
    (all of them while there are no more), as if the run had never stopped: a resumed run's
    figures are over the same steps as an uninterrupted one's. After the warm-up only the step
    times (for the median) and each part's sum are kept, so the state grows by one number a step.

    Args:
        warmup: Timed steps left out at the start of the run (``train.timing_warmup``).
    """

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.count = 0
        self.early: list[dict[str, float]] = []
        """The breakdowns of the first ``warmup`` timed steps."""
        self.totals: list[float] = []
        """The time of each timed step after the warm-up."""
        self.sums: dict[str, float] = {}
        """Each part's sum over the steps after the warm-up: only the parts every one of them has."""

    def add(self, parts: dict[str, float]) -> None:
        """Count one timed step's breakdown."""
        self.count += 1
        if self.count <= self.warmup:
            self.early.append(dict(parts))
            return
        self.totals.append(parts["total"])
        if len(self.totals) == 1:
            self.sums = dict(parts)
        else:
            self.sums = {k: v + parts[k] for k, v in self.sums.items() if k in parts}

    def median(self) -> float | None:
        """The median step time (None if no step was timed)."""
        times = self.totals or [p["total"] for p in self.early]
        return statistics.median(times) if times else None

    def means(self) -> dict[str, float]:
        """The mean of each part (see :func:`summarize`)."""
        if not self.totals:
            return summarize(self.early, 0)
        return {k: v / len(self.totals) for k, v in self.sums.items()}

    def state_dict(self) -> dict[str, Any]:
        """Return what a checkpoint keeps (numbers, strings and one tensor: ``torch.load(weights_only=True)``)."""
        totals = torch.tensor(self.totals, dtype=torch.float64)
        return {"warmup": self.warmup, "count": self.count, "early": self.early, "totals": totals, "sums": self.sums}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Go on from what :meth:`state_dict` returned (the warm-up the run began with stays)."""
        self.warmup, self.count = int(state["warmup"]), int(state["count"])
        self.early = [dict(p) for p in state["early"]]
        self.totals = [float(t) for t in state["totals"].tolist()]
        self.sums = dict(state["sums"])


def fastest(fn: Callable[[], Any], repeat: int, device: torch.device, sync: Callable[[], None]) -> float:
    """The fastest of ``repeat`` runs of ``fn`` (seconds), each after ``sync()`` and timed to the device's end."""
    best = math.inf
    for _ in range(repeat):
        sync()  # start every rank together: a root that runs ahead makes a broadcast look free
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        tic = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - tic)
    return best
