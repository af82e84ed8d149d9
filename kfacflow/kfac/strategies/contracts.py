"""The strategies of a step (pipeline, broadcast, grad sync, factor sync): their protocols, and which fit together.

Each kind is a ``Protocol`` here (:class:`Pipeline`, :class:`Broadcast`, :class:`GradSync`,
:class:`FactorSync`); a strategy subclasses its kind's and is registered by name. It acts (the
orchestrator, the trainer and the library call it, never inspect it) and replays its part on the
simulator's model (:mod:`kfacflow.kfac.strategies.replay`). It acts on what it is handed, never on the orchestrator:
the running state (:class:`State`), the plan as laid onto this rank (:class:`Routes`), the engine
(:class:`Engine`), the precondition stage (:class:`Apply`); a pipeline inverts through the broadcast
it is given.

Which go together is one generic check. A strategy declares ``needs``: each thing it relies on,
with the name of its own kind to fall back to without it; ``gives``: what it lets the others rely
on; ``does``: what it does, for a message; ``lacks``: per need it does not give, what it does
instead. A preset's strategy whose need is not met gives way to its fallback (:func:`settle`); one
asked for by name is an error naming both keys (:func:`check`). A need no strategy gives is the
engine's (:data:`TORCH`): gradients averaged after the backward pass, which Horovod's optimizer
does not allow.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch
from torch import Tensor, nn

from kfacflow import UserError, registry
from kfacflow.kfac.planning.plan import Choice

if TYPE_CHECKING:
    from kfacflow.comm.base import Backend, Handle
    from kfacflow.kfac.gradients import Gradients
    from kfacflow.kfac.layers import KFACLayer
    from kfacflow.kfac.stages.contracts import (
        FactorSlot,
        FactorStage,
        FusionPolicy,
        Inverse,
        InverseMethod,
        Placement,
        PreconditionStage,
    )
    from kfacflow.kfac.strategies.replay import Replay
    from kfacflow.perf import Profile
    from kfacflow.timing import StepTimer


@dataclass
class Sent:
    """A posted broadcast of one inverse: its slot, buffer, handle, and whether the owner keeps its own copy."""

    slot: FactorSlot
    flat: Tensor
    handle: Handle
    keep: bool


@dataclass(frozen=True)
class Engine:
    """What a strategy moves tensors with and times its work on: the communication engine and the step's timer."""

    backend: Backend
    timer: StepTimer


class State(Protocol):
    """What a strategy may use of the running state (:class:`~kfacflow.kfac.state.FactorState`)."""

    running: dict[str, Tensor]
    """Running averages, packed, of the factors this rank keeps."""
    inverses: dict[str, Inverse]
    inverse_dtype: torch.dtype

    @property
    def result(self) -> type[Inverse]:
        """The inverses' type (the inverse method's): what a broadcast inverse is rebuilt as."""
        ...

    def average(self, averaged: dict[str, Tensor]) -> list[str]:
        """Blend arrived factors into their running averages; return their keys."""
        ...

    def to_apply(self, inverse: Inverse) -> Inverse:
        """``inverse`` made ready for the steps of one inversion period (a received one as a made one)."""
        ...

    def invert(self, batch: list[FactorSlot]) -> None:
        """Invert the factors of ``batch`` this rank inverts."""
        ...


class Routes(Protocol):
    """What a strategy may read of the plan as laid onto this rank (:class:`~kfacflow.kfac.plan_life.PlanLife`).

    Read each where it is used: the plan may be made again while a step's factors arrive.
    """

    slots: list[FactorSlot]
    layer_order: list[KFACLayer]
    update_buckets: dict[str, list[str]]
    gathered: set[str]
    grad_owned: list[list[Tensor]]

    @property
    def order(self) -> list[FactorSlot]:
        """The plan's inversion order, of the factors this step inverts."""
        ...


class Apply(Protocol):
    """The precondition stage on this preconditioner's layers (:class:`~kfacflow.kfac.layer_updates.LayerUpdates`)."""

    @property
    def stage(self) -> PreconditionStage:
        """The precondition stage (whether it clips, each layer's contribution to its ``finish``)."""
        ...

    def layer(self, layer: KFACLayer, grad: Tensor) -> Tensor:
        """One layer's update from its gradient matrix and its two inverses."""
        ...

    @property
    def owned(self) -> OwnedWork | None:
        """What owners finish of their layers beyond the update (Muon's step: :mod:`kfacflow.on_owners`), or None."""
        ...


class OwnedWork(Protocol):
    """A first-order step's per-layer work on the layer's owner (:class:`kfacflow.on_owners.muon_step.OwnedMuon`)."""

    directed: set[str]
    """This step's layers whose owners send what :meth:`finish` gives in place of the update."""
    contributions: list[Tensor]
    """Every live layer's contribution, then the side blocks' (as :meth:`settle` took them)."""

    def prepare(self, lr: float, stage: PreconditionStage, side_pairs: list[tuple[Tensor, Tensor]]) -> None:
        """Take the step's rate, precondition stage and side blocks' ``(update, gradient)`` pairs, before the walk."""
        ...

    def begin(self, owner: dict[str, int], live: Sequence[str]) -> None:
        """Take this step's owners (collective where they moved)."""
        ...

    def settle(
        self, contributions: list[Tensor], updates: dict[str, Tensor], sent: Sequence[str], owner: dict[str, int]
    ) -> None:
        """Fix what the owners' :meth:`finish` needs of every layer (collective)."""
        ...

    def finish(self, name: str) -> Tensor:
        """What the owner sends in place of the layer's update (which :meth:`settle` was given)."""
        ...

    def clip_rest(self, finished: set[str]) -> None:
        """Apply what the owners applied before their step to every gradient they did not finish."""
        ...


class Strategy(Protocol):
    """What a strategy declares of the others (for :func:`check`); by default nothing.

    A strategy subclasses its kind's protocol (:class:`Pipeline`, :class:`Broadcast`, :class:`GradSync`,
    :class:`FactorSync`), so it inherits these defaults.
    """

    needs: ClassVar[Mapping[str, str]] = {}
    """Each thing it relies on, and the name of its own kind it gives way to without it."""
    gives: ClassVar[frozenset[str]] = frozenset()
    """What it lets the other strategies rely on."""
    does: ClassVar[str] = ""
    """What it does (for the message when what it needs is missing)."""
    lacks: ClassVar[Mapping[str, str]] = {}
    """For each need it does not give, what it does instead (for the same message)."""

    def shape(self, choice: Choice) -> Choice:
        """Return ``choice`` with what this strategy decides of the step's plan (by default nothing)."""
        return choice


class Pipeline(Strategy, Protocol):
    """Strategy *pipeline* (``kfac.pipeline``): when inversions and preconditioning start.

    The registered ones are in :mod:`kfacflow.kfac.strategies.pipeline`.
    """

    def run(
        self,
        broadcast: Broadcast,
        state: State,
        plan: Routes,
        engine: Engine,
        arrivals: Iterator[dict[str, Tensor]],
        inverting: bool,
    ) -> list[Sent]:
        """Average the factors as they arrive; invert (where the step inverts) through ``broadcast``."""
        ...

    def early(self, apply: Callable[[], None]) -> None:
        """Call ``apply`` if work may start before every inverse has landed."""
        ...

    def expected(
        self, groups: list[list[tuple[str, int]]], profile: Profile | None, ready: dict[str, float] | None
    ) -> dict[str, float] | None:
        """When the next step's factors are expected, given this step's groups (``ready``: the plan's now)."""
        ...

    def arrived(self, ends: list[float], start: float) -> list[float]:
        """The simulator's :meth:`run`: when each factor is taken in, given when its collective ends."""
        ...


class Broadcast(Strategy, Protocol):
    """Strategy *broadcast* (``kfac.broadcast``): what travels once factors are inverted.

    The registered ones are in :mod:`~kfacflow.kfac.strategies.inverse_broadcast` and
    :mod:`~kfacflow.kfac.strategies.update_broadcast`.
    """

    def invert(self, state: State, engine: Engine, slots: list[FactorSlot]) -> list[Sent]:
        """Invert what this rank inverts of ``slots``; post what travels, in their order."""
        ...

    def invert_arriving(
        self, state: State, plan: Routes, engine: Engine, arrivals: Iterator[dict[str, Tensor]]
    ) -> list[Sent]:
        """Average and invert the factors as their reductions complete."""
        ...

    def precondition(
        self,
        state: State,
        plan: Routes,
        engine: Engine,
        apply: Apply,
        live: list[tuple[KFACLayer, Tensor]],
        sent: list[Sent],
        early: Callable[[Callable[[], None]], None],
    ) -> tuple[dict[str, Tensor], list[Tensor]]:
        """Return every live layer's update and its contribution to the precondition stage's ``finish``."""
        ...

    def every_inverse(self, state: State, plan: Routes, engine: Engine) -> dict[str, Inverse]:
        """Every inverse on this rank (for a checkpoint; collective where owners alone hold theirs)."""
        ...

    def replay(self, r: Replay, pipeline: Pipeline) -> dict[str, float]:
        """Replay inverting, exchanging and preconditioning on the simulator's model; return the step's breakdown."""
        ...

    def holds(self, owner: int | None, rank: int) -> bool:
        """Whether ``rank`` keeps the inverses of a factor ``owner`` inverts (``None``: a factor of no layer here)."""
        ...


class GradSync(Strategy, Protocol):
    """Strategy *grad sync* (``kfac.grad_sync``): when and where gradients are averaged.

    The registered ones are in :mod:`kfacflow.kfac.strategies.grad_sync`.
    """

    def backward(self, backend: Backend, net: nn.Module, last: bool) -> AbstractContextManager[Any]:
        """How one micro-batch's backward pass runs (``last``: the step's last)."""
        ...

    def gradients(self, backend: Backend, params: list[nn.Parameter]) -> Gradients | None:
        """The step's own gradient traffic, posted behind the factors; ``None`` where there is none."""
        ...

    def usable(self, backend: Backend, finite: Callable[[], bool]) -> bool:
        """Whether the step may go on, as far as its gradients can be checked before K-FAC runs (``finite``)."""
        ...

    def in_backward(self, r: Replay) -> list[tuple[float, int, int | None]]:
        """The simulator's :meth:`backward`: the gradient collectives the backward pass posts.

        Each as (when, elements, owner): ``None`` for an all-reduce, else the rank it is reduced to.
        """
        ...

    def replay(self, r: Replay) -> None:
        """Replay the rest of the gradient traffic; set when the step starts and when the gradients are here."""
        ...

    def finish(self, backend: Backend, optimizer: torch.optim.Optimizer) -> None:
        """Complete what the backward pass posted of the gradients (GradComm): the engine's (Horovod's hooks)."""
        backend.finish_gradients(optimizer)

    def for_step(self, sends: bool, routes: Sequence[Any] | None = None, rebuilt: Sequence[Tensor] = ()) -> GradSync:
        """The grad sync of a step whose factors do (``sends``) or do not travel after its backward pass: itself.

        ``routes``: where the plan routes gradients to owners (empty or ``None`` where it does not): the
        parameters each rank receives alone (the running step), or each layer's owner (the simulator).
        ``rebuilt``: the parameters whose averages the step rebuilds from rows (none of it need travel).
        """
        return self


class FactorSync(Strategy, Protocol):
    """Strategy *factor sync* (``kfac.factor_sync``): where factors are summed.

    The registered ones are in :mod:`kfacflow.kfac.strategies.factor_sync`.
    """

    def every_average(self, state: State, plan: Routes, engine: Engine) -> dict[str, Tensor]:
        """Every running average on this rank (collective where owners alone keep theirs)."""
        ...


@dataclass
class StageSet:
    """The built stages one preconditioner runs."""

    factor: FactorStage
    fusion: FusionPolicy
    placement: Placement
    invert: InverseMethod
    precondition: PreconditionStage
    pipeline: Pipeline
    broadcast: Broadcast
    factor_sync: FactorSync
    grad_sync: GradSync
    factor_exchange: str = "update"
    """When factors are summed over ranks (``kfac.factor_exchange``): ``update`` or ``inversion``."""


def choice_of(stages: StageSet) -> Choice:
    """What the built stages of a preconditioner decide of its plan (:meth:`.plan.Choice.shaped`)."""
    strategies = (stages.pipeline, stages.broadcast, stages.factor_sync, stages.grad_sync)
    return Choice.shaped(stages.placement, stages.invert.result, strategies)


KINDS: dict[str, registry.Registry[Any]] = {
    "pipeline": registry.PIPELINES,
    "broadcast": registry.BROADCASTS,
    "grad_sync": registry.GRAD_SYNCS,
    "factor_sync": registry.FACTOR_SYNCS,
}
"""Each strategy kind by its field of :class:`~kfacflow.kfac.variants.Stages`, and its registry."""

AFTER_BACKWARD = "gradients averaged after the backward pass"
OWNERS_READ_FACTORS = "factors read by their layers' owners alone"
OWNERS_PRECONDITION = "layers preconditioned by their owners alone"
TORCH = frozenset({AFTER_BACKWARD})
"""What the torch engine gives the strategies (Horovod's optimizer averages in the backward pass: nothing)."""


def unmet(chosen: Mapping[str, str], engine: frozenset[str] = TORCH) -> list[tuple[str, str]]:
    """Return ``(kind, need)`` for every need of the ``chosen`` strategies (kind -> name) nothing gives."""
    strategies = {kind: KINDS[kind].get(name) for kind, name in chosen.items()}
    given = set(engine).union(*(s.gives for s in strategies.values()))
    return [(kind, need) for kind, s in strategies.items() for need in s.needs if need not in given]


def settle(chosen: Mapping[str, str], named: set[str]) -> dict[str, str]:
    """Return ``chosen`` with each strategy not ``named`` by the recipe whose need is unmet replaced by its fallback."""
    chosen = dict(chosen)
    while gaps := [(kind, need) for kind, need in unmet(chosen) if kind not in named]:
        kind, need = gaps[0]
        chosen[kind] = KINDS[kind].get(chosen[kind]).needs[need]
    return chosen


def check(chosen: Mapping[str, str]) -> None:
    """Raise, naming both keys, where a chosen strategy needs what the others do not give (the engine aside).

    Raises:
        UserError: The first conflict, with the keys to change.
    """
    for kind, need in unmet(chosen):
        raise UserError(_conflict(chosen, kind, need))


def fallback(chosen: Mapping[str, str], kind: str, need: str) -> str:
    """The name of ``kind`` the chosen one gives way to without ``need``."""
    return str(KINDS[kind].get(chosen[kind]).needs[need])


def _conflict(chosen: Mapping[str, str], kind: str, need: str) -> str:
    needing = KINDS[kind].get(chosen[kind])
    for other, reg in KINDS.items():
        givers = [entry.name for entry in reg if need in entry.obj.gives]
        if givers and other != kind:
            lacks = reg.get(chosen[other]).lacks.get(need, "does not")
            return (
                f"kfac.{kind}={chosen[kind]} {needing.does}, but kfac.{other}={chosen[other]} {lacks}; "
                f"set kfac.{other}={' or '.join(givers)}, or kfac.{kind}={needing.needs[need]}."
            )
    return f"kfac.{kind}={chosen[kind]} needs {need}; set kfac.{kind}={needing.needs[need]}."
