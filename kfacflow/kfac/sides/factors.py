"""Kronecker factors of a few layers kept beside the pipelines: their hooks, one all-reduce, running averages.

What a side block whose layers are Kronecker-factored shares (:mod:`~kfacflow.kfac.sides.tied`,
:mod:`~kfacflow.kfac.sides.cross_attention`): each layer's A and G are made by the factor stage as the pipelines'
layers' are (``kfac.factor``, ``kfac.factor_examples``, micro-batches and several calls of a pass, the loss
scale), on the steps the capture of those layers captures; after the backward pass every layer's pair goes
in one all-reduce with a flag a rank saying whether it ran the layer, and each factor's mean over the ranks
that ran it is blended into its running average (``kfac.factor_decay``). Every rank holds every factor
(they are few and small), so none of the fusion, placement or pipelines carries them. What is made of the
averages is computed on rank 0 and broadcast (:meth:`SideFactors.from_rank0`): every rank applies the same.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import Tensor, nn

from kfacflow import UserError
from kfacflow.kfac.finite import FiniteFlags, blend
from kfacflow.kfac.hooks.factor_parts import FactorParts
from kfacflow.kfac.hooks.layer_sums import LayerCapture, call_input, examples_first, full_precision, leading, unscaled
from kfacflow.kfac.layers import KFACLayer
from kfacflow.kfac.packing import packed_size, unpack

if TYPE_CHECKING:
    from kfacflow.comm.base import Handle
    from kfacflow.kfac.hooks.capture import Capture
    from kfacflow.kfac.planning.schedule import Schedule
    from kfacflow.kfac.strategies.contracts import Engine


@dataclass(frozen=True)
class SideParts:
    """What every block beside the pipelines is handed (the norms', :class:`SideFactors`).

    Attributes:
        capture: The pipelines' factor hooks (whether a call captures; its examples, dtype, loss scale, stage).
        engine: The communication engine and the step's timer.
        schedule: The factor updates, the inversions and the damping.
        finite: Where a non-finite factor is reported (the running state's).
        decay: ``kfac.factor_decay`` (read at each use).
        dtype: What is made of the averages, and the updates (``kfac.inverse_dtype``).
    """

    capture: Capture
    engine: Engine
    schedule: Schedule
    finite: FiniteFlags
    decay: Callable[[], float]
    dtype: torch.dtype


class RankMeans:
    """Sums over ranks in one all-reduce, and each entry's mean over the ranks that had it, blended.

    :meth:`launch` sums the entries with a flag a group saying whether the rank had it; :meth:`average` blends
    each entry's mean over the ranks that had its group into its running average. What the side blocks'
    factors and the norms' diagonals (:mod:`~kfacflow.kfac.sides.norms`) go by.
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.pending: tuple[Tensor, Handle | None] | None = None
        """The flat sums and their all-reduce (none with one rank), until :meth:`average`."""

    def launch(self, parts: list[Tensor], present: list[Tensor]) -> None:
        """Start summing ``parts`` and ``present`` (a one-element flag a group) over ranks."""
        backend = self.engine.backend
        flat = torch.cat([*parts, *present])
        self.pending = (flat, backend.allreduce_async(flat) if backend.world_size > 1 else None)

    def average(
        self,
        groups: list[list[tuple[str, str, int]]],
        running: dict[str, Tensor],
        finite: FiniteFlags,
        step: int,
        decay: float,
    ) -> None:
        """Wait for :meth:`launch`'s sums; blend each entry's mean into ``running`` (none launched: nothing).

        Args:
            groups: Each group's entries in the order launched: ``(key in running, key reported, width)``.
            running: The running averages.
            finite: Where a non-finite mean is reported.
            step: The step reported with it.
            decay: The running averages' decay.
        """
        if self.pending is None:
            return
        flat, handle = self.pending
        self.pending = None
        if handle is not None:
            with self.engine.timer.span("FactorComm"):
                handle.wait()
        counts, start = flat[-len(groups) :], 0
        for count, entries in zip(counts, groups, strict=True):
            ran = count > 0
            for key, reported, width in entries:
                mean = flat[start : start + width] / count.clamp(min=1)
                start += width
                blend(running, key, mean, finite.check(reported, step, mean, ran) & ran, decay)


class SideFactors:
    """The layers' factor hooks, their sums of a step, and the running averages by ``<layer>/A`` and ``<layer>/G``.

    What a subclass makes of the averages it keeps in :attr:`inverses`, saved with them in checkpoints.

    Args:
        layers: The layers whose factors are kept (their modules are hooked).
        parts: What a side block is handed.
    """

    what: ClassVar[str] = "a side block"
    """What the layers are, as a message names them."""

    def __init__(self, layers: list[KFACLayer], parts: SideParts) -> None:
        self.layers, self.capture, self.engine, self.schedule = layers, parts.capture, parts.engine, parts.schedule
        self.finite, self.decay, self.dtype = parts.finite, parts.decay, parts.dtype
        self.parts = FactorParts(self.capture.parts.factors, self.capture.dtype)
        self.running: dict[str, Tensor] = {}
        """Each factor's running average, packed (``kfac.factor_dtype``)."""
        self.inverses: dict[str, list[Tensor]] = {}
        """What the subclass made of the averages (its inverses), by name."""
        self.sums: dict[str, LayerCapture] = {}
        """This step's factors of each layer, by name."""
        self._pass: dict[str, int] = {}
        self._means = RankMeans(self.engine)
        self._key = f"{type(self).__name__}@{id(self)}"
        for layer in layers:  # on the modules while the capture captures (:mod:`kfacflow.kfac.hooks.switch`)
            self.capture.hooks.add(self._key, layer.module, self._a_hook(layer), self._g_hook(layer))

    def _counts(self, module: nn.Module) -> bool:
        """Whether this call adds to the factors (a factor update; not a forward run again in backward)."""
        passes = self.capture.passes
        return self.capture.capturing(module) and not (passes is not None and self.capture.micro >= passes)

    def _batch(self, given: Tensor) -> int:
        return self.capture.examples if self.capture.examples is not None else given.shape[0]

    def _a_hook(self, layer: KFACLayer) -> Callable[[nn.Module, tuple[Any, ...], dict[str, Any]], None]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            given = call_input(args, kwargs)
            if given is None or not self._counts(module):
                return
            batch = self._batch(given)
            x = examples_first(given.detach(), batch, self.parts.examples_first)
            cap = self.sums.setdefault(layer.name, LayerCapture())
            if self._pass.get(layer.name) != self.capture.micro:  # the first call of this forward pass
                self._pass[layer.name] = self.capture.micro
                cap.examples += batch
            with torch.no_grad(), full_precision(x), self.engine.timer.span("FactorComp", f"{layer.name}/A", "factor"):
                x_in = layer.factor_input(leading(x, batch, self.capture.keep), self.capture.dtype)
                cap.add("A", *self.parts.a_part(layer, module, x_in, False))

        return hook

    def _g_hook(self, layer: KFACLayer) -> Callable[[nn.Module, tuple[Any, ...], dict[str, Any], Any], None]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
            given = call_input(args, kwargs)
            if given is None or not isinstance(output, Tensor) or not output.requires_grad or not self._counts(module):
                return
            batch = self._batch(given)

            def grad_hook(grad: Tensor) -> None:
                grad = examples_first(grad, batch, self.parts.examples_first)
                kept = leading(grad, batch, self.capture.keep)
                span = self.engine.timer.span("FactorComp", f"{layer.name}/G", "factor")
                with torch.no_grad(), full_precision(grad), span:
                    g = unscaled(kept, self.capture.grad_scale, self.capture.dtype)
                    share = grad.shape[0] / kept.shape[0]
                    self.sums[layer.name].add("G", self.parts.g_part(layer, module, g, batch, share, False), batch)

            output.register_hook(grad_hook)

        return hook

    def launch(self) -> None:
        """On a factor update, sum every layer's factors (and whether each rank ran it) over ranks: one all-reduce."""
        if not self.layers or not self.schedule.factors():
            return
        backend, dtype = self.engine.backend, self.capture.dtype
        parts, present = [], []
        for layer in self.layers:
            cap = self.sums.get(layer.name)
            ran = cap is not None and cap.a is not None and cap.g is not None
            for d, side in ((layer.a_dim, "A"), (layer.g_dim, "G")):
                if ran:
                    assert cap is not None
                    parts.append((cap.a_factor() if side == "A" else cap.g_factor()).to(dtype))  # type: ignore[union-attr]
                else:
                    parts.append(torch.zeros(packed_size(d), dtype=dtype, device=backend.device))
            present.append(torch.full((1,), float(ran), dtype=dtype, device=backend.device))
        self._means.launch(parts, present)
        self.reset()

    def blend_arrived(self) -> None:
        """Wait for :meth:`launch`'s sums; blend each factor's mean over the ranks that ran it into its average."""
        groups = [[(key, key, width) for key, width in _keys(layer)] for layer in self.layers]
        self._means.average(groups, self.running, self.finite, self.schedule.steps, self.decay())

    def factor(self, layer: KFACLayer, side: str) -> Tensor | None:
        """The running ``side`` (``"A"``, ``"G"``) of ``layer`` as a full matrix in :attr:`dtype`, or None."""
        packed = self.running.get(f"{layer.name}/{side}")
        return None if packed is None else unpack(packed.to(self.dtype), layer.a_dim if side == "A" else layer.g_dim)

    def from_rank0(self, make: Callable[[], list[Tensor]], shapes: Sequence[tuple[int, ...]]) -> list[Tensor]:
        """``make()`` on rank 0, broadcast to the others: tensors of ``shapes``, the same on every rank."""
        backend = self.engine.backend
        sizes = [int(torch.Size(shape).numel()) for shape in shapes]
        if backend.rank == 0:
            flat = torch.cat([t.reshape(-1).to(self.dtype) for t in make()])
        else:
            flat = torch.empty(sum(sizes), dtype=self.dtype, device=backend.device)
        if backend.world_size > 1:
            with self.engine.timer.span("InverseComm"):
                backend.broadcast_async(flat, 0).wait()
        return [part.view(shape) for part, shape in zip(flat.split(sizes), shapes, strict=True)]

    def reset(self) -> None:
        """Forget this step's sums (sent, or the step was skipped on every rank)."""
        self.sums, self._pass = {}, {}

    def saved(self) -> dict[str, Any]:
        """The running factors and the inverses, copied (for a checkpoint)."""
        inverses = {name: [t.detach().clone() for t in parts] for name, parts in self.inverses.items()}
        return {"running": {key: f.detach().clone() for key, f in self.running.items()}, "inverses": inverses}

    def restore(self, saved: dict[str, Any] | None) -> None:
        """Take :meth:`saved`'s factors and inverses back, onto this run's device and dtypes.

        A checkpoint made without these layers (``None``) starts them at the next factor update.

        Raises:
            UserError: If a factor is of no layer here (:attr:`what` names them in the message), or of another size.
        """
        running, inverses = (saved or {}).get("running", {}), (saved or {}).get("inverses", {})
        sizes = dict(width for layer in self.layers for width in _keys(layer))
        check_fits(running, sizes, lambda key: f"factor {key!r} of {self.what} does not fit this model")
        device = self.engine.backend.device
        self.running = {k: v.to(device, self.capture.dtype, copy=True) for k, v in running.items()}
        self.inverses = {n: [t.to(device, self.dtype, copy=True) for t in parts] for n, parts in inverses.items()}
        self.reset()
        self._means.pending = None

    def remove(self) -> None:
        """Take the hooks off the modules."""
        self.capture.hooks.remove({self._key})


def _keys(layer: KFACLayer) -> tuple[tuple[str, int], tuple[str, int]]:
    """The layer's two running factors' keys and packed sizes, in the order they are launched."""
    return (f"{layer.name}/A", packed_size(layer.a_dim)), (f"{layer.name}/G", packed_size(layer.g_dim))


def check_fits(saved: dict[str, Tensor], sizes: dict[str, int], what: Callable[[str], str]) -> None:
    """Refuse a checkpoint's tensor that is of none of ``sizes``' keys, or of another size.

    Raises:
        UserError: ``resume: the checkpoint's K-FAC`` and ``what(key)``, with what to do.
    """
    for key, tensor in saved.items():
        if sizes.get(key) != tensor.numel():
            raise UserError(
                f"resume: the checkpoint's K-FAC {what(key)} (model.name, kfac.kinds or kfac.skip changed?); "
                "resume with the run's own settings, or start a new run."
            )
