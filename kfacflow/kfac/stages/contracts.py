"""The contracts between K-FAC's stages: a ``Protocol`` per stage, and the record of one factor.

A step hands work along: the factor stage computes each layer's A and G in the hooks; the
communicate stage's policy decides which of them are all-reduced together and when; the
placement decides who inverts each factor; the inverse method inverts it into an
:class:`~kfacflow.kfac.stages.inverse.Inverse`, which is what is broadcast, checkpointed and applied;
the precondition stage turns gradients and inverses into the update. Every registry entry of a
stage satisfies its protocol here (mypy checks them), and :class:`FactorSlot` is the one record
of a factor the orchestrator keeps.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Literal, Protocol

import torch
from torch import Tensor, nn

if TYPE_CHECKING:
    from kfacflow.kfac.layers import KFACLayer
    from kfacflow.perf import LinearModel, Profile

EVERY_RANK = -1
"""Owner value of a non-communicated tensor (NCT): every rank inverts it, nothing is sent."""


@dataclass
class FactorSlot:
    """One Kronecker factor of one layer: what it is, its size, who inverts it.

    Args:
        layer: The layer.
        side: ``"A"`` (from the layer input) or ``"G"`` (from the output gradient).
        owner: The rank that inverts it and broadcasts the result, or :data:`EVERY_RANK`.
        flat_size: Elements its inverse takes when broadcast.
    """

    layer: KFACLayer
    side: Literal["A", "G"]
    owner: int = EVERY_RANK
    flat_size: int = 0
    dim: int = field(init=False)
    """Side of the square factor, as planned: a bias frozen later changes the layer, not the plan."""

    def __post_init__(self) -> None:
        self.dim = self.layer.a_dim if self.side == "A" else self.layer.g_dim

    @property
    def key(self) -> str:
        """``"<layer>/A"`` or ``"<layer>/G"``: how communication, checkpoints and logs name it."""
        return f"{self.layer.name}/{self.side}"


@dataclass(frozen=True)
class Absent:
    """The factor of a layer that did not run on this rank this step: it adds nothing to its sum over ranks.

    Ranks sum factors by position, so one a rank lacks still goes out, as zeros that say so
    (:mod:`~kfacflow.kfac.hooks.handover`, :class:`~kfacflow.kfac.communicator.FusedSum`).
    """

    size: int
    """Elements of the packed factor the other ranks send."""
    dtype: torch.dtype
    device: torch.device

    def zeros(self) -> Tensor:
        """What travels in its place."""
        return torch.zeros(self.size, dtype=self.dtype, device=self.device)


def side_of(key: str) -> str:
    """``"A"`` or ``"G"``: the side of the factor :attr:`FactorSlot.key` names."""
    return key.rsplit("/", 1)[1]


def layer_of(key: str) -> str:
    """The layer of the factor :attr:`FactorSlot.key` names."""
    return key.rsplit("/", 1)[0]


class Inverse(ABC):
    """``(F + damping I)^-1`` of one factor: what is broadcast, checkpointed and applied.

    The kinds (dense, eigendecomposition) are the subclasses in :mod:`kfacflow.kfac.stages.inverse`.
    """

    kind: ClassVar[str]
    """Names the kind in checkpoints."""
    kinds: ClassVar[dict[str, type[Inverse]]] = {}
    """Every kind by its name (a subclass adds itself)."""

    def __init_subclass__(cls) -> None:
        super().__init_subclass__()
        if "kind" in cls.__dict__:  # a shared base of kinds names none
            Inverse.kinds[cls.kind] = cls

    @property
    @abstractmethod
    def tensors(self) -> tuple[Tensor, ...]:
        """What a checkpoint keeps; ``Inverse.restore(kind, tensors)`` rebuilds it."""

    @abstractmethod
    def left(self, x: Tensor) -> Tensor:
        """Return ``inverse @ x``."""

    def right(self, x: Tensor) -> Tensor:
        """Return ``x @ inverse`` (the inverse is symmetric)."""
        return self.left(x.T).T

    @abstractmethod
    def dense(self) -> Tensor:
        """Return the inverse as a dense matrix."""

    @abstractmethod
    def to_flat(self) -> Tensor:
        """Return one vector to broadcast."""

    def for_uses(self, uses: int) -> Inverse:
        """This inverse made ready to be applied ``uses`` times (the steps of an inversion period): here, itself."""
        return self

    def to_full(self) -> Tensor:
        """Return the vector a ``full`` broadcast sends (by default :meth:`to_flat`'s)."""
        return self.to_flat()

    def full_exact(self) -> bool:
        """Whether :meth:`from_full` of :meth:`to_full` is this inverse, bits and layout (then its owner keeps it)."""
        return False

    @classmethod
    def full_elements(cls, d: int) -> int:
        """Return the length of :meth:`to_full` for a d x d factor."""
        return cls.elements(d)

    @classmethod
    def from_full(cls, flat: Tensor, d: int) -> Inverse:
        """Rebuild one from :meth:`to_full`'s vector."""
        return cls.unflat(flat, d)

    def round_trip_exact(self) -> bool:
        """Whether :meth:`unflat` of :meth:`to_flat` gives this inverse back bit for bit, in the same layout."""
        return False

    @classmethod
    @abstractmethod
    def elements(cls, d: int) -> int:
        """Return the length of :meth:`to_flat` for a d x d factor."""

    @classmethod
    @abstractmethod
    def unflat(cls, flat: Tensor, d: int) -> Inverse:
        """Rebuild one from :meth:`to_flat`'s vector."""

    @staticmethod
    def flat_size(kind: str, d: int) -> int:
        """Return the length of the broadcast vector of a ``kind`` inverse of a d x d factor."""
        return Inverse.kinds[kind].elements(d)

    @staticmethod
    def from_flat(kind: str, flat: Tensor, d: int) -> Inverse:
        """Rebuild a ``kind`` inverse from its broadcast vector."""
        return Inverse.kinds[kind].unflat(flat, d)

    @staticmethod
    def restore(kind: str, tensors: tuple[Tensor, ...] | list[Tensor]) -> Inverse:
        """Rebuild an inverse from what :attr:`tensors` gave to a checkpoint."""
        return Inverse.kinds[kind](*tensors)  # type: ignore[call-arg]


class FactorStage(Protocol):
    """Stage *factor*: a layer's A from its input and G from its output gradient (full matrices).

    A stage may also offer ``a_factor_packed(module, x) -> (packed A, rows)`` and
    ``g_factor_packed(module, grad_out, batch) -> packed G``, the upper triangles that capture sums
    and sends (:func:`~kfacflow.kfac.packing.pack`'s order): then capture calls those, and the stage
    need not compute the lower half (the shipped ones do not: :func:`~kfacflow.kfac.stages.factors.gram_packed`).
    """

    def a_factor_rows(self, module: nn.Module, x: Tensor) -> tuple[Tensor, int]:
        """Return A and the number of rows it averages (examples, times positions where they count)."""
        ...

    def g_factor(self, module: nn.Module, grad_out: Tensor, batch: int) -> Tensor:
        """Return G from the gradient of the output and the examples of the batch."""
        ...


@dataclass(frozen=True)
class FusionOptions:
    """What fusion policies may be told; each takes what it needs."""

    own: object = None
    """The policy's own options (:mod:`kfacflow.kfac.stages.options`; ``None``: its defaults)."""
    profile_steps: int = 5
    """Factor-update steps a measuring policy (``optimal``) times before it plans."""
    allreduce: LinearModel | None = None
    """All-reduce time model (``optimal``)."""


@dataclass(frozen=True)
class Waiting:
    """A factor handed to the communicate stage and not yet all-reduced."""

    key: str
    elements: int
    nbytes: int


class FusionPolicy(Protocol):
    """Stage *communicate*, its decisions only (pure: no communication, no clock).

    Factors arrive one by one, A factors in the forward pass, G factors in the backward pass.
    After each, :meth:`close_group` says whether the factors waiting so far are all-reduced now,
    together; at the end of the forward pass, those still waiting go then if
    :attr:`launch_after_forward`, else at the end of backward with the rest.
    """

    launch_after_forward: bool
    measure_steps: int
    """Factor-update steps whose ready times the policy wants (:meth:`learn`) before it plans; 0: none."""
    plan: list[list[str]] | None
    """The groups it decided on, if it plans ahead (for logs and tests)."""

    def close_group(self, waiting: Sequence[Waiting]) -> bool:
        """Whether the waiting factors (the newest last) are all-reduced now."""
        ...

    def learn(self, passes: Sequence[Sequence[tuple[str, float, int]]]) -> None:
        """Take the mean ready times: per pass (forward, backward), ``(key, seconds, elements)`` in order."""
        ...


FusionFactory = Callable[[FusionOptions], FusionPolicy]


class Placement(Protocol):
    """Stage *invert*, who and in which order: the owner of every factor (a rank, or :data:`EVERY_RANK`).

    The registered ones (:mod:`kfacflow.kfac.stages.placement`) share one inversion order; a placement
    may bring its own.
    """

    def __call__(
        self, dims: Sequence[int], sizes: Sequence[int], world_size: int, profile: Profile | None
    ) -> list[int]:
        """Return the owner of each factor, given their sides and broadcast sizes.

        A placement with ``weighs_layers = True`` is also given, between inversions where updates
        travel, each layer's seconds a step on its owner (a fifth argument, ``work``:
        :func:`~kfacflow.kfac.stages.update_plan.layer_work`).
        """
        ...

    def order(
        self,
        dims: Sequence[int],
        owners: Sequence[int],
        world_size: int,
        profile: Profile | None,
        ready: Sequence[float] | None,
    ) -> list[int]:
        """Return the order every rank walks the factors in when inverting (the same on all ranks).

        ``ready``: when each factor is expected to arrive, for a pipeline that inverts as they do.
        Broadcasts are posted in this order and run in it (collectives run in the order posted).
        """
        ...


class InverseMethod(Protocol):
    """Stage *invert*, how: ``(factor + damping I)^-1`` as an :class:`Inverse` of type :attr:`result`."""

    result: type[Inverse]

    def __call__(self, factor: Tensor, damping: float) -> Inverse:
        """Return the damped inverse of ``factor``."""
        ...


@dataclass
class LayerRows:
    """Every rank's rows of one layer, stacked: ``grad = delta^T a / world`` (:mod:`~kfacflow.kfac.hooks.rows`).

    Zero rows pad a rank's share: they add nothing to ``delta^T a``.
    """

    name: str
    delta: Tensor
    """``(N, g_dim)`` output gradients."""
    a: Tensor
    """``(N, a_dim)`` input patches (with the ones column of a preconditioned bias)."""
    world: int
    eps: float
    """Machine epsilon of the least precise dtype the rows or the gradient were computed in (for the check)."""
    complete: Tensor | bool = True
    """False where a rank had more rows than it may send (they cannot give the gradient); a tensor on the device."""
    rebuilt: bool = False
    """Whether each rank checked its rows against its own gradient and the averaged gradient was rebuilt from them
    (:meth:`~kfacflow.kfac.hooks.rows.RowCapture.rebuild`): they give it by construction."""


class PreconditionStage(Protocol):
    """Stage *precondition*: the update of every layer from its gradient and its two inverses."""

    def layer(self, grad: Tensor, a_inv: Inverse, g_inv: Inverse, rows: LayerRows | None = None) -> Tensor:
        """Return one layer's update direction (``(g_dim, a_dim)``); ``rows``: its rows, where :meth:`rows_pay`."""
        ...

    def rows_pay(self, rows: int, a_dim: int, g_dim: int) -> bool:
        """Whether a layer of ``rows`` rows a step (all ranks) is preconditioned from them (:mod:`.rows`).

        Optional: a stage without it is never given rows (:meth:`layer` is then called with three arguments).
        """
        ...

    clips: bool
    """Whether :meth:`finish` needs every layer's :meth:`contribution` (e.g. KL clipping is on)."""

    def contribution(self, update: Tensor, grad: Tensor) -> Tensor:
        """Return what :meth:`finish` needs of one layer's gradient (KL clipping: ``v.g``, a float64 scalar).

        Computed where the layer's averaged gradient is: on its owner alone when the gradients
        travel to owners only (``kfac.grad_sync=owner``), which then sends it to every rank.
        """
        ...

    def finish(self, updates: list[Tensor], contributions: list[Tensor], lr: float) -> list[Tensor]:
        """Return the updates of every layer after what depends on all of them (e.g. KL clipping).

        ``contributions``: each layer's, where :attr:`clips`; else empty. A stage that scales every update
        by one factor may keep it in a ``scale`` attribute (a 0-d tensor), which the run log shows as
        ``kfac/kl_clip_scale`` (:class:`~kfacflow.kfac.stages.precondition.KFACPrecondition` does).
        """
        ...


PreconditionFactory = Callable[..., PreconditionStage]
"""Builds the precondition stage from ``kfac.kl_clip`` (and ``normalize=kfac.normalize`` where that is not ``none``)."""


@dataclass(frozen=True)
class Variant:
    """Stage names: a preset's (``kfac.variant``), or those in force once a recipe's choices override it.

    ``preconditioned=False`` means no K-FAC at all. :data:`kfacflow.kfac.variants.Stages` is this class.
    """

    fusion: str = "after_backward"
    placement: str = "local"
    inverse: str = "cholesky"
    preconditioned: bool = True
    pipeline: str = "barrier"
    broadcast: str = "packed"
    grad_sync: str = "overlap"
    factor_sync: str = "allreduce"
    factor_exchange: str = "update"
    """When factors are summed over ranks: ``update`` or ``inversion`` (:mod:`kfacflow.kfac.exchange`)."""
    precondition: str = "kfac"
    """How gradients become updates (``kfac.precondition``): ``kfac``, or ``rows`` where that pays per layer."""
    choose: bool = False
    """Start with these stages, then simulate every preset on a traced step and keep the fastest."""

    def strategies(self) -> dict[str, str]:
        """The strategy names by kind (:data:`~kfacflow.kfac.strategies.contracts.KINDS`)."""
        return {kind: getattr(self, kind) for kind in ("pipeline", "broadcast", "grad_sync", "factor_sync")}
