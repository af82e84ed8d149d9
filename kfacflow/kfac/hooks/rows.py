"""A layer's gradient as its rows: each output position's input patch and output gradient, gathered from every rank.

A Linear or Conv2d weight gradient is a sum of outer products, ``grad = D^T a`` over its ``n``
rows (``a``: the layer input as the weight sees it, a patch per output position, with the ones
column of a preconditioned bias; ``D``: the gradient of the loss w.r.t. the output at the same
positions), and the averaged gradient over ``P`` ranks is ``(1/P) D_all^T a_all`` of every rank's
rows stacked. So ``G^-1 grad A^-1 = (1/P) (G^-1 D_all^T)(a_all A^-1)``: ``2N(a^2 + g^2 + ga)``
flops instead of ``2ga(g + a)``, far less where the rows of a step (``N``: examples times
positions times ranks) are fewer than the layer is wide, as in a ResNet's deep layers on small
images (:class:`~kfacflow.kfac.stages.precondition.RowsPrecondition`, ``kfac.precondition=rows``).

:class:`RowCapture` keeps the rows of the layers the precondition stage takes from rows
(``rows_pay``) on every training step and sends them to every rank once the step's factors are
on their way: the input patches copied once from a strided view of the layer's input in the forward
pass, the output gradients (unscaled as the factors' are, under mixed precision) in the backward pass. On the first
step it only counts each layer's rows per rank, and one small all-reduce makes every rank agree on
which layers go by rows and how many rows each rank sends (the most any rank had): a rank with
fewer sends zero rows, which add nothing to ``D^T a``; one with more cannot send them all, and the
stage's check (its rows must give the gradient) falls back to the gradient.

Where the step averages gradients itself after the backward pass (``kfac.grad_sync=deferred``,
``owner``, or ``between`` on a step that exchanges factors), or sends them to their owners during it
(``between`` on the other steps, where the plan routes gradients), the chosen layers' gradients need not
travel at all: each rank checks its own rows against its own gradient before sending them (a flag
in its share of the message), and once every rank's rows are here the averaged gradient is
``D_all^T a_all / P`` (:meth:`RowCapture.leave`, :meth:`RowCapture.rebuild`). A layer whose rows
some rank could not vouch for has its gradient all-reduced there instead, by every rank alike. On
a ResNet-18 at 32 px these are ``layer4``'s five layers: three quarters of its parameters.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from kfacflow.comm.base import Backend, Handle
from kfacflow.kfac.hooks.layer_sums import call_input, full_precision, unscaled
from kfacflow.kfac.layers import KFACLayer
from kfacflow.kfac.stages.contracts import LayerRows
from kfacflow.kfac.stages.factors import ExpandFactors
from kfacflow.kfac.stages.precondition import rows_give
from kfacflow.timing import StepTimer

if TYPE_CHECKING:
    from kfacflow.kfac.gradients import Gradients
    from kfacflow.kfac.hooks.capture import Capture

logger = logging.getLogger(__name__)

_EXPAND = ExpandFactors()
"""The rows of a gradient are per output position, whatever factors the recipe chose."""


@dataclass
class _Rows:
    a: list[Tensor] = field(default_factory=list)
    delta: list[Tensor] = field(default_factory=list)
    count: int = 0
    eps: float = 0.0


class RowCapture:
    """Keeps each chosen layer's rows of the current step and sends them to every rank (:meth:`post`).

    Args:
        layers: The layers K-FAC preconditions.
        backend: The engine (the rows travel on its K-FAC group).
        pays: ``pays(rows, a_dim, g_dim)``: whether a layer with ``rows`` rows a step, over every rank, goes by rows.
        dtype: What the rows are kept in (the inverses' dtype: where they are applied).
        capture: The factor capture (training calls, the loss scale of the backward pass).
        timer: Stage times.
    """

    def __init__(
        self,
        layers: list[KFACLayer],
        backend: Backend,
        pays: Callable[[int, int, int], bool],
        dtype: torch.dtype,
        capture: Capture,
        timer: StepTimer,
    ) -> None:
        self.backend, self.pays, self.dtype, self.capture, self.timer = backend, pays, dtype, capture, timer
        self.planned: dict[str, int] | None = None
        """Rows each rank sends per chosen layer (agreed on the first step); ``None`` before."""
        self.step: dict[str, _Rows] = {}
        self.posted: dict[str, tuple[Handle | None, Tensor, KFACLayer, float]] = {}
        self.arrived: dict[str, LayerRows | None] = {}
        self.left: list[KFACLayer] = []
        """The layers whose averaged gradients this step rebuilds from their rows (:meth:`leave`)."""
        self.warned: set[str] = set()
        self._hooks: list[RemovableHandle] = []
        for layer in layers:
            self._hooks.append(layer.module.register_forward_pre_hook(self._a_hook(layer), with_kwargs=True))
            self._hooks.append(layer.module.register_forward_hook(self._delta_hook(layer), with_kwargs=True))

    def chosen(self, name: str) -> bool:
        """Whether the layer ``name`` goes by rows."""
        return self.planned is not None and name in self.planned

    def _a_hook(self, layer: KFACLayer) -> Callable[[nn.Module, tuple[Any, ...], dict[str, Any]], None]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if not (self.chosen(layer.name) and module.training and torch.is_grad_enabled()):
                return
            x = call_input(args, kwargs)
            if x is None:
                return
            with torch.no_grad(), full_precision(x):
                rows = self.step.setdefault(layer.name, _Rows())
                rows.a.append(_EXPAND.a_rows(module, layer.factor_input(x.detach(), self.dtype)))
                rows.eps = max(rows.eps, torch.finfo(x.dtype).eps)

        return hook

    def _delta_hook(self, layer: KFACLayer) -> Callable[[nn.Module, tuple[Any, ...], dict[str, Any], Any], None]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
            if not (module.training and torch.is_grad_enabled() and isinstance(output, Tensor)):
                return
            if self.planned is None:  # the first step counts the rows
                rows = self.step.setdefault(layer.name, _Rows())
                rows.count += output.numel() // output.shape[1 if isinstance(module, nn.Conv2d) else -1]
                return
            if not self.chosen(layer.name) or not output.requires_grad:
                return
            rows = self.step.setdefault(layer.name, _Rows())

            def grad_hook(grad: Tensor) -> None:
                with torch.no_grad():
                    rows.delta.append(_EXPAND.g_rows(module, unscaled(grad, self.capture.grad_scale, self.dtype)))
                    rows.eps = max(rows.eps, torch.finfo(grad.dtype).eps)

            output.register_hook(grad_hook)

        return hook

    def leave(self, layers: list[KFACLayer]) -> list[Tensor]:
        """The parameters whose gradients need not be averaged this step: the chosen layers' (the same on every rank).

        Call it before the step's gradients are launched and :meth:`post` the rows after; :meth:`rebuild`
        writes their averages once the rows are here. Nothing before the rows are planned (the first step).
        """
        self.left = [layer for layer in layers if self.chosen(layer.name)] if self.backend.world_size > 1 else []
        return [p for layer in self.left for p in layer.params]

    def post(self, layers: list[KFACLayer]) -> None:
        """Send this step's rows of the chosen layers to every rank (on the first step: agree which layers they are).

        Each rank's share ends in a row of flags every rank reads: its rows were cut off; and, for the
        layers :meth:`leave` left out, its rows do not give its own gradient (or it has none).
        """
        if self.planned is None:
            self._plan(layers)
            return
        world, rank, left = self.backend.world_size, self.backend.rank, {layer.name for layer in self.left}
        with torch.no_grad():
            for layer in layers:
                if layer.name not in self.planned:
                    continue
                rows, n, width = self.step.get(layer.name, _Rows()), self.planned[layer.name], layer.g_dim + layer.a_dim
                flat = torch.zeros(world, n + 1, width, dtype=self.dtype, device=self.backend.device)
                eps = max(rows.eps, torch.finfo(self.dtype).eps)
                mine = flat[rank, n, 1] if layer.name in left else None
                if mine is not None:
                    mine.fill_(1.0)  # until its rows are checked against its gradient
                if rows.a and len(rows.a) == len(rows.delta):  # every call's output gradient came back
                    a, delta = torch.cat(rows.a), torch.cat(rows.delta)
                    k = min(n, a.shape[0])
                    flat[rank, :k, : layer.g_dim].copy_(delta[:k])
                    flat[rank, :k, layer.g_dim :].copy_(a[:k])
                    flat[rank, n, 0] = float(a.shape[0] > n)  # the last row says: cut off, every rank learns it
                    grad = layer.grad_matrix()
                    if mine is not None and grad is not None:  # this rank's own gradient: it did not travel
                        mine.copy_((~rows_give(delta, a, 1, grad, eps)).to(self.dtype))
                handle = None
                if world > 1:
                    with self.timer.span("GradComm"):
                        handle = self.backend.allreduce_async(flat)  # x + 0 == x: every rank's own bits
                self.posted[layer.name] = (handle, flat, layer, eps)

    def _plan(self, layers: list[KFACLayer]) -> None:
        """Agree, from this first step's row counts, on the layers that go by rows and each rank's share."""
        world, rank = self.backend.world_size, self.backend.rank
        if not any(layer.by_rows and self.pays(world, layer.a_dim, layer.g_dim) for layer in layers):  # none ever would
            self.planned = {}
            self.remove()  # no hook need run on any forward pass again
            return
        counts = torch.zeros(world, len(layers), dtype=torch.float64, device=self.backend.device)
        counts[rank] = torch.tensor([float(self.step.get(x.name, _Rows()).count) for x in layers], dtype=torch.float64)
        if world > 1:
            self.backend.allreduce_async(counts).wait()
        most = counts.max(dim=0).values.tolist()
        uses = self.capture.uses or {}  # a layer called twice a pass: its calls' rows would not pair up in order
        self.planned = {
            layer.name: int(n)
            for layer, n in zip(layers, most, strict=True)
            if n > 0
            and layer.by_rows
            and uses.get(layer.name, 1) == 1
            and self.pays(int(n) * world, layer.a_dim, layer.g_dim)
        }
        logger.info(
            "kfac.precondition: %d of %d layers preconditioned from their rows%s",
            len(self.planned),
            len(layers),
            f": {', '.join(self.planned)}" if self.planned else " (none has fewer rows a step than it is wide)",
        )

    def get(self, name: str) -> LayerRows | None:
        """The layer's rows from every rank (waiting for them), or ``None`` where it does not go by rows this step."""
        if name in self.arrived:
            return self.arrived[name]
        if name not in self.posted:
            return None
        handle, flat, layer, eps = self.posted.pop(name)
        if handle is not None:
            with self.timer.span("GradComm"):
                handle.wait()
        complete = flat[:, -1, :2].sum() == 0  # read with the stage's check: one wait for the device
        stacked = flat[:, :-1].reshape(-1, flat.shape[-1])
        self.arrived[name] = LayerRows(
            name, stacked[:, : layer.g_dim], stacked[:, layer.g_dim :], flat.shape[0], eps, complete
        )
        return self.arrived[name]

    def rebuild(self, gradients: Gradients, elsewhere: Collection[str] = ()) -> None:
        """Write the averaged gradient of every layer :meth:`leave` left out, from every rank's rows.

        But for the layers ``elsewhere`` (another rank preconditions them and alone reads their average).
        One read of the device for all of them. A layer some rank's flags fail (its rows cut off or
        not its gradient) has its gradient averaged by ``gradients`` instead, by every rank in the
        same order (every rank reads the same flags), and goes by its gradient this step.
        """
        if not self.left:
            return
        rows = [r for layer in self.left if (r := self.get(layer.name)) is not None]  # every one was posted
        good = torch.stack([torch.as_tensor(r.complete) for r in rows]).tolist()
        failed = []
        with torch.no_grad():
            for layer, r, ok in zip(self.left, rows, good, strict=True):
                if ok:  # every rank had a gradient and vouched for its rows
                    if layer.name not in elsewhere:
                        layer.set_grad((r.delta.T @ r.a).div_(r.world))
                    self.arrived[layer.name] = LayerRows(r.name, r.delta, r.a, r.world, r.eps, True, rebuilt=True)
                    continue
                failed.append(layer)
                self.arrived[layer.name] = None
                if layer.name not in self.warned:
                    self.warned.add(layer.name)
                    logger.warning(
                        "kfac.precondition=rows: a rank's rows of %s did not give its gradient (more rows than on "
                        "the first step, or the layer did not run): its gradient was averaged instead this step",
                        layer.name,
                    )
        if failed:
            with self.timer.span("GradComm"):
                gradients.average([p for layer in failed for p in layer.params])
        self.left = []

    def reset(self) -> None:
        """Forget the step's rows (every posted collective is complete first: its buffer stays alive until then)."""
        for handle, *_ in self.posted.values():
            if handle is not None:
                handle.wait()
        self.step, self.posted, self.arrived, self.left = {}, {}, {}, []

    def remove(self) -> None:
        """Remove the hooks."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
