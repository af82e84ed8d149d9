"""A norm's scale and shift preconditioned by a diagonal Fisher (kind ``norm`` of ``kfac.kinds``).

kfac-jax's ``ScaleAndShiftDiagonal`` block: for a norm ``y = xhat * gamma + beta`` over its last
dimensions (``nn.LayerNorm``; ``nn.RMSNorm`` has no ``beta`` and ``xhat = x / rms(x)``), example
``n``'s gradient is ``g_gamma[n] = sum_t dL/dy[n, t] * xhat[n, t]`` and ``g_beta[n] = sum_t dL/dy[n, t]``
over its tokens ``t`` (every dimension between the examples and the normalised ones). With the
Linear factors' convention (:mod:`~kfacflow.kfac.stages.factors`: the batch-mean loss's ``1/N`` undone
by ``N``), ``D = 1/N sum_n (N g[n])^2`` elementwise, ``gamma`` and ``beta`` as one vector; the update is
``grad / (D + damping)``.

Every example of every forward pass of a step counts, as in G (``N`` is the step's examples; a norm
called twice in a pass adds each call's squares, as G adds each call's). Each rank's ``D`` is
averaged over the ranks that ran the norm, all norms in one all-reduce per factor update, then
blended into a running average with ``kfac.factor_decay``; every rank holds every norm's (they are
tiny), so none of the Kronecker machinery (fusion, placement, pipelines) carries them. An input whose
leading dimension is not the batch's (``(N S, E)``) has each of its rows taken as an example.
"""

from __future__ import annotations

import fnmatch
import logging
from collections.abc import Callable
from dataclasses import dataclass
from math import prod
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kfacflow.kfac.hooks.layer_sums import call_input, examples_first, full_precision, leading, unscaled
from kfacflow.kfac.layers import NORMS, affine_trained, class_name, param_users, skip_reason
from kfacflow.kfac.sides.factors import RankMeans, SideParts, check_fits

if TYPE_CHECKING:
    pass

logger = logging.getLogger(__name__)


@dataclass
class NormLayer:
    """A preconditioned norm: its name, its module and the affine parameters it trains (weight first)."""

    name: str
    module: nn.Module
    params: list[Tensor]

    @property
    def shape(self) -> tuple[int, ...]:
        """The normalised dimensions (``normalized_shape``)."""
        return tuple(self.module.normalized_shape)  # type: ignore[arg-type]

    @property
    def width(self) -> int:
        """Length of the diagonal: every trained affine element."""
        return sum(p.numel() for p in self.params)

    def normalized(self, x: Tensor, eps_of: torch.dtype) -> Tensor:
        """``xhat``: ``x`` normalised as the module does (its ``eps``; RMSNorm's default: ``eps_of``'s epsilon)."""
        given = getattr(self.module, "eps", None)
        eps = torch.finfo(eps_of).eps if given is None else float(given)
        if isinstance(self.module, nn.RMSNorm):  # the module's own kernels, without the scale and shift
            return F.rms_norm(x, self.shape, eps=eps)
        return F.layer_norm(x, self.shape, eps=eps)

    def per_example(self, x: Tensor, dy: Tensor, eps_of: torch.dtype) -> Tensor:
        """Each example's gradient ``(N, width)`` from its input and output gradient (examples first)."""
        k = len(self.shape)
        n, width = (x.shape[0] if x.dim() > k else 1), prod(self.shape)
        grads = []
        for p in self.params:
            if p is self.module.weight:
                grads.append((dy * self.normalized(x, eps_of)).reshape(n, -1, width).sum(dim=1))
            else:
                grads.append(dy.reshape(n, -1, width).sum(dim=1))
        return torch.cat(grads, dim=1)


def find_norms(model: nn.Module, skip: list[str], kinds: tuple[str, ...]) -> list[NormLayer]:
    """The norms of ``model`` K-FAC preconditions (``norm`` in ``kinds``), in registration order.

    A norm with no trained scale or shift is passed over silently; one a ``skip`` pattern names is left
    alone; one whose gradient the diagonal would not describe (a subclass with a forward of its own, a
    parametrized or shared weight) is left out with one INFO line saying why.
    """
    if "norm" not in kinds:
        return []
    users, found = param_users(model), []
    for name, module in model.named_modules():
        if not isinstance(module, NORMS) or not affine_trained(module):
            continue
        if any(fnmatch.fnmatchcase(name, pat) for pat in skip):
            logger.debug("kfac.skip leaves %s alone", name)
        elif (reason := skip_reason(name, module, users)) is not None:
            logger.info("K-FAC skips %s (%s): %s", name, class_name(module), reason)
        else:
            found.append(NormLayer(name, module, affine_trained(module)))
    return found


class NormDiagonals:
    """The norms' hooks, their diagonals' running averages, and their updates.

    Per step: the hooks sum each example's squared gradient on a factor update (when the capture
    of the Kronecker layers captures: the same steps, passes, examples, dtype and loss scale);
    :meth:`launch` all-reduces every norm's ``D`` at once after the backward pass; :meth:`pairs` waits,
    blends them into the running averages and returns each norm's ``(update, gradient)`` (once the
    gradients are averaged); :meth:`set_grads` writes the final updates back.

    Args:
        norms: The norms preconditioned.
        parts: What a side block is handed (:class:`~kfacflow.kfac.sides.factors.SideParts`).
    """

    def __init__(self, norms: list[NormLayer], parts: SideParts) -> None:
        self.norms, self.capture, self.engine, self.schedule = norms, parts.capture, parts.engine, parts.schedule
        self.finite, self.decay, self.dtype = parts.finite, parts.decay, parts.dtype
        self.running: dict[str, Tensor] = {}
        """Each norm's running diagonal, by name (``kfac.factor_dtype``)."""
        self.sums: dict[str, Tensor] = {}
        """This step's ``sum_n (g[n])^2`` of each norm that ran (over its examples kept, scaled to all of them)."""
        self.examples: dict[str, int] = {}
        """This step's examples of each norm: the batch of its first call in each forward pass."""
        self._pass: dict[str, int] = {}
        self._means = RankMeans(self.engine)
        self._live: list[tuple[NormLayer, list[Tensor]]] = []
        self._key = f"norms@{id(self)}"
        for norm in norms:  # on the modules while the capture captures (:mod:`kfacflow.kfac.hooks.switch`)
            self.capture.hooks.add(self._key, norm.module, post=self._hook(norm))
        if norms:
            logger.info("K-FAC on %d norms' scale and shift, by their diagonal Fisher", len(norms))

    @property
    def params(self) -> list[Tensor]:
        """Every parameter preconditioned here."""
        return [p for norm in self.norms for p in norm.params]

    def _hook(self, norm: NormLayer) -> Callable[[nn.Module, tuple[Any, ...], dict[str, Any], Any], None]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
            given = call_input(args, kwargs)
            if given is None or not isinstance(output, Tensor) or not output.requires_grad:
                return
            passes = self.capture.passes
            if not self.capture.capturing(module) or (passes is not None and self.capture.micro >= passes):
                return  # not a factor update; or a forward run again in backward (checkpointing), already counted
            x = given.detach()
            batch = self.capture.examples if self.capture.examples is not None else x.shape[0]
            if self._pass.get(norm.name) != self.capture.micro:  # the first call of this forward pass
                self._pass[norm.name] = self.capture.micro
                self.examples[norm.name] = self.examples.get(norm.name, 0) + batch
            output.register_hook(lambda dy: self._add(norm, x, dy, batch))

        return hook

    def _add(self, norm: NormLayer, x: Tensor, dy: Tensor, batch: int) -> None:
        """Add one call's squared per-example gradients (in the factors' dtype, autocast off)."""
        dtype, keep = self.capture.dtype, self.capture.keep
        with torch.no_grad(), full_precision(dy), self.engine.timer.span("FactorComp", f"{norm.name}/D", "factor"):
            x, dy = examples_first(x, batch, True), examples_first(dy, batch, True)
            kept_x, kept_dy = leading(x, batch, keep), leading(dy, batch, keep)
            share = dy.shape[0] / kept_dy.shape[0]
            grads = norm.per_example(kept_x.to(dtype), unscaled(kept_dy, self.capture.grad_scale, dtype), x.dtype)
            squares = grads.square().sum(dim=0)
            if share != 1:
                squares.mul_(share)
            held = self.sums.get(norm.name)
            self.sums[norm.name] = squares if held is None else held.add_(squares)

    def launch(self) -> None:
        """On a factor update, sum every norm's ``D`` (and whether each rank ran it) over ranks: one all-reduce."""
        if not self.norms or not self.schedule.factors():
            return
        backend, dtype = self.engine.backend, self.capture.dtype
        device = backend.device
        parts, present = [], []  # made on the device: a copy from the host would wait for its queue
        for norm in self.norms:
            sums, examples = self.sums.get(norm.name), self.examples.get(norm.name, 0)
            ran = sums is not None and examples > 0
            parts.append(
                sums * examples if sums is not None and ran else torch.zeros(norm.width, dtype=dtype, device=device)
            )
            present.append(torch.full((1,), float(ran), dtype=dtype, device=device))
        self._means.launch(parts, present)
        self.reset()

    def _blend(self) -> None:
        """Wait for :meth:`launch`'s sums; blend each norm's mean over the ranks that ran it into its average."""
        groups = [[(norm.name, f"{norm.name}/D", norm.width)] for norm in self.norms]
        self._means.average(groups, self.running, self.finite, self.schedule.steps, self.decay())

    def pairs(self) -> list[tuple[Tensor, Tensor]]:
        """Each norm's ``(grad / (D + damping), grad)``, flat, for those with a gradient and a diagonal.

        Call once the gradients are averaged; :meth:`set_grads` takes the final updates in the same order.
        """
        self._blend()
        self._live, out = [], []
        with torch.no_grad():
            for norm in self.norms:
                diagonal = self.running.get(norm.name)
                if diagonal is None or any(p.grad is None for p in norm.params):
                    continue
                grad = torch.cat([p.grad.flatten() for p in norm.params if p.grad is not None])
                wide = torch.promote_types(self.dtype, grad.dtype)
                damped = diagonal.to(wide) + self.schedule.damping
                out.append(((grad.to(wide) / damped).to(grad.dtype), grad))
                self._live.append((norm, norm.params))
        return out

    def set_grads(self, updates: list[Tensor]) -> None:
        """Write :meth:`pairs`' norms' final updates into their gradients."""
        with torch.no_grad():
            for (_, params), update in zip(self._live, updates, strict=True):
                start = 0
                for p in params:
                    assert p.grad is not None
                    p.grad.copy_(update[start : start + p.numel()].view_as(p))
                    start += p.numel()
        self._live = []

    def reset(self) -> None:
        """Forget this step's sums (sent, or the step was skipped on every rank)."""
        self.sums, self.examples, self._pass = {}, {}, {}

    def saved(self) -> dict[str, Tensor]:
        """The running diagonals, copied (for a checkpoint)."""
        return {name: d.detach().clone() for name, d in self.running.items()}

    def restore(self, saved: dict[str, Tensor] | None) -> None:
        """Take :meth:`saved`'s diagonals back, onto this run's device and factor dtype.

        A checkpoint without them (made without ``norm``) starts them at the next factor update.

        Raises:
            UserError: If a diagonal is of no norm of this run, or of another size.
        """
        widths = {norm.name: norm.width for norm in self.norms}
        check_fits(saved or {}, widths, lambda name: f"diagonal of the norm {name!r} does not fit this model's norms")
        device = self.engine.backend.device
        self.running = {k: v.to(device, self.capture.dtype, copy=True) for k, v in (saved or {}).items()}
        self.reset()
        self._means.pending = None

    def remove(self) -> None:
        """Take the hooks off the norms."""
        self.capture.hooks.remove({self._key})
