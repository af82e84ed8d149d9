"""When factors are summed over ranks (``kfac.factor_exchange``): at every factor update, or only where inverted.

``update`` (the paper): every factor update all-reduces the step's factors; their running averages
are of the averaged factors. ``inversion``: only the steps that invert exchange factors. Between
them each rank keeps, for each factor, the decayed sum of its own factors since the last exchange,

    E = sum_j (1 - xi) xi^(k - j) f_j        (the k factor updates since, j = 1 .. k; xi the decay),

an exchange sends ``E`` where the paper sends the step's factor, and the rank that keeps the running
average sets ``R <- xi^k R + mean_ranks(E)``. A running average is linear in the factors, so that is
the ``R`` that ``k`` exchanges would have made, to round-off: every inverse is computed from the same
``R`` at the same step, and only the traffic moves (at inverses every 10 factor updates, a tenth of
it, on the steps that invert). A factor with no running average yet (the first step, a restarted A)
counts its first contribution whole, as :func:`~kfacflow.kfac.finite.blend`'s first factor does.

A factor that is the Gram matrix of fewer rows than half its width (``aᵀa`` of a 4608-wide A from a
32-example batch) is not multiplied out at each step: the capture hands over its rows (:class:`Rows`),
which are held, each block with its decayed weight, until an exchange (or until they are as many as
half the width) and then multiplied out once, as one product of every block stacked: the same sum
(``c Rᵀ R`` summed is ``Sᵀ S`` for ``S`` the blocks scaled by ``√c``), the same multiplications in one
large product instead of ``k`` thin ones, and no blend of the wide triangle at every step.

Where every running average is wanted between exchanges (a checkpoint, a new plan, a layer that
changes), :meth:`Preconditioner.settle <kfacflow.kfac.preconditioner.Preconditioner.settle>`
exchanges what is held at once. A non-finite ``mean(E)`` leaves its running average as it was: the
factors of the whole period are left out, where ``update`` leaves out one step's.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from kfacflow import UserError
from kfacflow.comm.base import Backend
from kfacflow.kfac.stages.contracts import Absent, layer_of
from kfacflow.kfac.stages.factors import gram_packed
from kfacflow.timing import StepTimer


@dataclass
class Rows:
    """A factor as rows not yet multiplied out: ``weight * rows.T @ rows`` (packed, :func:`gram_packed` of them)."""

    rows: Tensor
    weight: float


Contribution = Tensor | Rows
"""One step's factor as the capture hands it over: packed, or as its rows."""


@dataclass
class _Held:
    """One factor's sum since the last exchange: a packed part and blocks of rows, each ``(R, c)`` for ``c RᵀR``."""

    total: Tensor | None = None
    blocks: list[tuple[Tensor, float]] = field(default_factory=list)
    k: int = 0
    """Factor updates it holds."""

    @property
    def rows(self) -> int:
        """The rows its blocks hold."""
        return sum(r.shape[0] for r, _ in self.blocks)

    def packed(self) -> Tensor:
        """The whole sum, packed (its own packed part where it has no blocks: a collective may sum into it)."""
        if not self.blocks:
            assert self.total is not None
            return self.total
        stacked = torch.cat([r * math.sqrt(c) for r, c in self.blocks])
        product = gram_packed(stacked)
        return product if self.total is None else product.add_(self.total)

    def decayed(self, xi: float, in_place: bool) -> _Held:
        """The sum times ``xi``: this one, or a new one (sharing the blocks' rows, which nothing changes)."""
        blocks = [(r, c * xi) for r, c in self.blocks]
        if in_place:
            if self.total is not None:
                self.total.mul_(xi)
            self.blocks = blocks
            return self
        return _Held(None if self.total is None else self.total * xi, blocks, self.k)

    def add(self, part: Contribution, weight: float) -> None:
        """Add ``weight`` times ``part`` (in place)."""
        if isinstance(part, Rows):
            self.blocks.append((part.rows, weight * part.weight))
        elif self.total is None:
            self.total = part * weight if weight != 1 else part
        else:
            self.total.add_(part, alpha=weight)
        self.k += 1


class LocalSums:
    """Each factor's decayed sum of this rank's factors since the last exchange (``kfac.factor_exchange=inversion``).

    The calls each factor update: :meth:`push` from the capture (for every factor, as it is complete);
    then :meth:`commit` (a step that does not exchange: its factors join the sums) or, once the
    exchange's averages are blended, :meth:`exchanged`; :meth:`drop` for a skipped step. Every rank
    makes the same calls for the same keys, so ``started`` and the counts agree everywhere.

    Args:
        decay: The running averages' ``kfac.factor_decay`` (read at each use: it may change).
        send: Where an exchanged sum goes (the communicator's ``push``).
        exchanges: Whether the current step exchanges (it inverts).
        started: The factors that have a running average (on their keeper).
        timer: Where the products of held rows are timed (``FactorComp``).
    """

    def __init__(
        self,
        decay: Callable[[], float],
        send: Callable[[str, Tensor | Absent], None],
        exchanges: Callable[[], bool],
        started: set[str] | None = None,
        timer: StepTimer | None = None,
    ) -> None:
        self.decay, self.send, self.exchanges = decay, send, exchanges
        self.timer = timer or StepTimer(torch.device("cpu"), enabled=False)
        self.started: set[str] = set(started or ())
        self.sums: dict[str, _Held] = {}
        self._known: set[str] = set()
        self._step: dict[str, Contribution] = {}
        self.sent: dict[str, int] = {}
        """Per factor in flight, the factor updates its sum holds (the keeper's ``xi^k``)."""
        self.absent: set[str] = set()
        """The factors of layers that did not run on this rank at some step since the last exchange
        (:meth:`refuse_absent`)."""
        self.keys: list[str] = []
        """Every factor pushed so far, in the order they came (the same on every rank)."""

    def takes_rows(self, key: str, rows: int, width: int) -> bool:
        """Whether ``rows`` more rows of the ``width``-wide factor ``key`` are held as rows (at most half the width)."""
        held = self.sums.get(key)
        return (held.rows if held is not None else 0) + rows <= width // 2

    def push(self, key: str, factor: Contribution | Absent) -> None:
        """Take a factor of this step: held until :meth:`commit`, or sent in the sum where the step exchanges."""
        if key not in self._known:
            self._known.add(key)
            self.keys.append(key)
        if isinstance(factor, Absent):
            self.absent.add(key)
            if self.exchanges():
                self.sent[key] = 0
                self.send(key, factor)
            return
        if not self.exchanges():
            self._step[key] = factor
            return
        held = self._with(key, factor)
        self.sent[key] = held.k
        packed = self._packed(key, held)
        self.send(key, Absent(packed.numel(), packed.dtype, packed.device) if key in self.absent else packed)

    def _packed(self, key: str, held: _Held) -> Tensor:
        if not held.blocks:
            return held.packed()
        with self.timer.span("FactorComp", f"{key} from {held.rows} rows", "factor"):
            return held.packed()

    def _with(self, key: str, factor: Contribution, in_place: bool = False) -> _Held:
        """The sum of ``key`` with ``factor`` added: the held one (``in_place``, a commit) or a new one.

        An exchange's sum is a new one: the held sum must stay as it was until the exchange is
        blended, since a skipped step sends it again at the next.
        """
        held = self.sums.get(key)
        fresh = held is None and key not in self.started  # the first factor of a running average counts whole
        xi = self.decay()
        out = _Held() if held is None else held.decayed(xi, in_place)
        out.add(factor, 1.0 if fresh else 1 - xi)
        return out

    def commit(self) -> None:
        """The step's factors join the sums (a step that updates factors and does not exchange them).

        Blocks of rows past half their factor's width are multiplied out into its packed part.
        """
        for key, factor in self._step.items():
            held = self._with(key, factor, in_place=True)
            width = held.blocks[0][0].shape[1] if held.blocks else 0
            if held.blocks and held.rows > width // 2:
                held = _Held(self._packed(key, held), [], held.k)
            self.sums[key] = held
        self._step = {}

    def exchanged(self) -> None:
        """The sums sent this step were averaged and blended: they start again from zero."""
        for key in self.sent:
            self.sums.pop(key, None)
        self.started.update(self.sent)
        self.sent, self.absent = {}, set()

    def refuse_absent(self, backend: Backend) -> None:
        """Stop on every rank where a layer did not run on some rank at some step since the last exchange (collective).

        The exchange sums each rank's factors of many steps, and which ranks ran a layer may differ from
        step to step: no count of ranks can weigh such a sum as the steps' own averages would have been
        weighed (:class:`~kfacflow.kfac.communicator.FusedSum`). One small all-reduce an exchange.

        Raises:
            UserError: Naming the first such layer.
        """
        if backend.world_size == 1 or not self.keys:
            return
        flags = torch.tensor([float(key in self.absent) for key in self.keys], dtype=torch.float32)
        lacking = [key for key, n in zip(self.keys, backend.allreduce_sum(flags).tolist(), strict=True) if n]
        if lacking:
            layer = layer_of(lacking[0])
            raise UserError(
                f"kfac: layer {layer!r} did not run on every rank at every step (a mixture of experts, early exit, "
                "stochastic depth...): kfac.factor_exchange=inversion sums each rank's factors over many steps and "
                f"cannot weigh them by the ranks that ran it. Use kfac.factor_exchange=update, or add {layer!r} to "
                "kfac.skip."
            )

    def drop(self) -> None:
        """Forget the step's factors (the step is skipped on every rank); the sums stay for the next exchange."""
        self._step, self.sent = {}, {}

    def held(self, order: list[str]) -> list[tuple[str, Tensor]]:
        """The sums held, packed, in ``order`` (every rank's the same), marked as sent."""
        items = [(key, self._packed(key, self.sums[key])) for key in order if key in self.sums]
        self.sent = {key: self.sums[key].k for key, _ in items}
        return items

    def blend(self, running: dict[str, Tensor], key: str, mean: Tensor, finite: Tensor) -> None:
        """``R <- xi^k R + mean`` where ``mean`` is finite (``R = mean`` where there is none yet); else ``R`` stays."""
        old = running.get(key)
        if old is None:
            running[key] = torch.where(finite, mean, 0.0)
        else:
            running[key] = torch.where(finite, old * self.decay() ** self.sent[key] + mean, old)
