"""One weight used as the token embedding and as the LM head (kind ``tied`` of ``kfac.kinds``).

A tied head's weight ``W`` (``V x d``) gets its gradient from two uses: the embedding, a Linear on one-hot
tokens with factors ``A_e`` (``V x V``: how often each token was seen) and ``G_e`` (``d x d``), and the head,
with ``A_h`` (``d x d``, its inputs) and ``G_h`` (``V x V``, the logits' gradients). Written on ``W``'s own
rows and columns both uses put the vocabulary on the rows, and the Fisher of the shared weight is the sum of
the two uses' blocks, as K-FAC-expand sums a shared weight's uses (Eschenhagen et al. 2023; the cross
terms between the uses are dropped), each use damped as its own layer would be::

    F = (A_e + l I) (x) (G_e + l I)  +  (G_h + l I) (x) (A_h + l I)  =:  P (x) Q + S (x) T.

The two uses' factors differ in scale (token counts against gradients), so the sum is not merged into one
Kronecker product but inverted exactly (Martens and Grosse 2015, appendix B): with ``X_r`` solving the
rows' generalized eigenproblem (``X_r^T P X_r = I``, ``X_r^T S X_r = diag(alpha)``) and ``X_c``, ``beta``
the columns' (``Q``, ``T``), ``F^-1 grad = X_r [(X_r^T grad X_c) / (1 + alpha beta^T)] X_c^T``.

A head with a trained bias has it as ``W``'s last column (the ones column of the head's A); the
embedding never uses it, so ``G_e`` has a zero row and column there. The four factors are made by the
factor stage as the Kronecker layers' are (``kfac.factor``, ``kfac.factor_examples``, micro-batches, loss
scale), averaged over the ranks that ran the pair in one all-reduce per factor update (outside the
Kronecker pipelines, as the norms' diagonals: :mod:`~kfacflow.kfac.norms`), and inverted when any factor
is, on rank 0, which broadcasts the result: every rank applies the same one.
"""

from __future__ import annotations

import fnmatch
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize
from torch.utils.hooks import RemovableHandle

from kfacflow import UserError
from kfacflow.kfac.finite import FiniteFlags, blend
from kfacflow.kfac.hooks.factor_parts import FactorParts
from kfacflow.kfac.hooks.layer_sums import LayerCapture, call_input, examples_first, full_precision, leading, unscaled
from kfacflow.kfac.layers import OWN_FORWARD, KFACLayer, embedding_reason, forward_kind, param_users
from kfacflow.kfac.packing import packed_size, unpack

if TYPE_CHECKING:
    from kfacflow.comm.base import Handle
    from kfacflow.kfac.hooks.capture import Capture
    from kfacflow.kfac.planning.schedule import Schedule
    from kfacflow.kfac.strategies.contracts import Engine

logger = logging.getLogger(__name__)

SIDES = ("A_e", "G_e", "A_h", "G_h")
"""The pair's four running factors, as keyed ``<weight>/<side>``: the embedding's A and G, the head's A and G."""


@dataclass
class TiedPair:
    """An embedding and a Linear head holding one weight (``name``: the embedding's ``<module>.weight``)."""

    name: str
    embedding: KFACLayer
    head: KFACLayer

    @property
    def params(self) -> list[Tensor]:
        """The weight, and the head's bias where it is trained."""
        return self.head.params

    def dims(self) -> tuple[int, int, int, int]:
        """The sides of ``A_e``, ``G_e``, ``A_h``, ``G_h``."""
        return self.embedding.a_dim, self.embedding.g_dim, self.head.a_dim, self.head.g_dim

    def grad_matrix(self) -> Tensor | None:
        """The gradient as ``W``'s ``(V, d)`` (the bias's as a last column), or None if there is none yet."""
        return self.head.grad_matrix()


Named = tuple[str, nn.Module]


def _pair(names: list[str], modules: dict[str, nn.Module]) -> tuple[Named, Named] | None:
    """The ``(name, embedding), (name, head)`` of a weight held by exactly an Embedding and a Linear, or None."""
    if len(names) != 2 or not all(n == "weight" or n.endswith(".weight") for n in names):
        return None
    held = [(owner := n.rpartition(".")[0], modules[owner]) for n in names]
    held.sort(key=lambda item: not isinstance(item[1], nn.Embedding))
    (_, emb), (_, head) = held
    return (held[0], held[1]) if isinstance(emb, nn.Embedding) and isinstance(head, nn.Linear) else None


def tied_weights(model: nn.Module) -> list[tuple[Named, Named]]:
    """Every ``(embedding, head)`` of ``model`` that share one weight, by name, in registration order."""
    modules = dict(model.named_modules())
    return [pair for names in param_users(model).values() if (pair := _pair(names, modules)) is not None]


def _reason(emb: nn.Module, head: nn.Module) -> str | None:
    if forward_kind(emb) != "plain" or forward_kind(head) != "plain":
        return OWN_FORWARD
    if parametrize.is_parametrized(emb) or parametrize.is_parametrized(head):
        return "it is parametrized, so its weight is computed from other parameters"
    return embedding_reason(emb)  # type: ignore[arg-type]


def find_tied(model: nn.Module, skip: list[str], kinds: tuple[str, ...]) -> list[TiedPair]:
    """The tied embeddings and heads K-FAC preconditions (``tied`` in ``kinds``), in registration order.

    A pair with a frozen weight is passed over silently; one a ``skip`` pattern names (either module) is left
    alone; one whose factors would not describe its gradient is left out with one INFO line saying why.
    """
    if "tied" not in kinds:
        return []
    found = []
    for (emb_name, emb), (head_name, head) in tied_weights(model):
        if not head.weight.requires_grad:
            continue
        if any(fnmatch.fnmatchcase(name, pat) for name in (emb_name, head_name) for pat in skip):
            logger.debug("kfac.skip leaves the tied %s and %s alone", emb_name, head_name)
        elif (reason := _reason(emb, head)) is not None:
            logger.info("K-FAC skips the tied %s and %s: %s", emb_name, head_name, reason)
        else:
            name = f"{emb_name}.weight" if emb_name else "weight"
            found.append(TiedPair(name, KFACLayer(emb_name, emb), KFACLayer(head_name, head)))
    return found


def generalized(p: Tensor, s: Tensor) -> tuple[Tensor, Tensor]:
    """``X`` and ``alpha`` with ``X^T p X = I`` and ``X^T s X = diag(alpha)`` (``p`` positive definite).

    By two symmetric eigendecompositions (which never fail where a Cholesky factor might in round-off):
    ``p = U diag(e) U^T``, ``M = e^-1/2 U^T s U e^-1/2 = V diag(alpha) V^T``, ``X = U e^-1/2 V``.
    """
    e, u = torch.linalg.eigh(p)
    half = u * e.clamp(min=torch.finfo(p.dtype).tiny).rsqrt()
    alpha, v = torch.linalg.eigh(half.T @ s @ half)
    return half @ v, alpha.clamp(min=0.0)


def joint_inverse(a_e: Tensor, g_e: Tensor, a_h: Tensor, g_h: Tensor, damping: float) -> tuple[Tensor, Tensor, Tensor]:
    """``(X_r, X_c, 1 / (1 + alpha beta^T))``: the inverse of the pair's damped Fisher (the module's formula).

    ``g_e`` smaller than ``a_h`` (a head's bias column) gets zero rows and columns at the end.
    """
    pad = a_h.shape[0] - g_e.shape[0]
    g_e = torch.nn.functional.pad(g_e, (0, pad, 0, pad)) if pad else g_e
    eye = lambda m: damping * torch.eye(m.shape[0], dtype=m.dtype, device=m.device)  # noqa: E731
    x_r, alpha = generalized(a_e + eye(a_e), g_h + eye(g_h))
    x_c, beta = generalized(g_e + eye(g_e), a_h + eye(a_h))
    return x_r, x_c, 1.0 / (1.0 + alpha[:, None] * beta[None, :])


def apply_inverse(inverse: tuple[Tensor, Tensor, Tensor], grad: Tensor) -> Tensor:
    """``F^-1 grad`` for a ``(V, d)`` gradient, from :func:`joint_inverse`'s parts."""
    x_r, x_c, scale = inverse
    return x_r @ ((x_r.T @ grad @ x_c) * scale) @ x_c.T


class TiedWeights:
    """The tied pairs' hooks, their four factors' running averages, their joint inverse and their updates.

    Called as the norms' diagonals are (:class:`~kfacflow.kfac.norms.NormDiagonals`): :meth:`launch` after the
    backward pass, :meth:`pairs` once the gradients are averaged, :meth:`set_grads` with the final updates.

    Args:
        pairs: The pairs preconditioned.
        capture: The Kronecker layers' factor hooks (whether a call captures; examples, dtype, loss scale, stage).
        engine: The communication engine and the step's timer.
        schedule: The factor updates, the inversions and the damping.
        finite: Where a non-finite factor is reported (the running state's).
        decay: ``kfac.factor_decay`` (read at each use).
        dtype: What the inverse and the updates are computed in (``kfac.inverse_dtype``).
    """

    def __init__(
        self,
        pairs: list[TiedPair],
        capture: Capture,
        engine: Engine,
        schedule: Schedule,
        finite: FiniteFlags,
        decay: Callable[[], float],
        dtype: torch.dtype,
    ) -> None:
        self.tied, self.capture, self.engine, self.schedule = pairs, capture, engine, schedule
        self.finite, self.decay, self.dtype = finite, decay, dtype
        self.parts = FactorParts(capture.parts.factors, capture.dtype)
        self.running: dict[str, Tensor] = {}
        """Each factor's running average, packed, by ``<weight>/<side>`` (``kfac.factor_dtype``)."""
        self.inverses: dict[str, tuple[Tensor, Tensor, Tensor]] = {}
        """Each pair's :func:`joint_inverse`, by weight."""
        self.sums: dict[str, LayerCapture] = {}
        """This step's factors of each module, by module name."""
        self._pass: dict[str, int] = {}
        self._pending: tuple[Tensor, Handle | None] | None = None
        self._live: list[TiedPair] = []
        self._hooks: list[RemovableHandle] = []
        for pair in pairs:
            for layer in (pair.embedding, pair.head):
                self._hooks.append(layer.module.register_forward_pre_hook(self._a_hook(layer), with_kwargs=True))
                self._hooks.append(layer.module.register_forward_hook(self._g_hook(layer), with_kwargs=True))
        for pair in pairs:
            logger.info(
                "K-FAC on the weight %s tied between %s and %s, by the sum of their Kronecker blocks",
                pair.name,
                pair.embedding.name,
                pair.head.name,
            )

    @property
    def params(self) -> list[Tensor]:
        """Every parameter preconditioned here."""
        return [p for pair in self.tied for p in pair.params]

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

    def _step_factors(self, pair: TiedPair) -> list[Tensor] | None:
        """The pair's four packed factors of this step, or None where a module did not run with a gradient."""
        emb, head = self.sums.get(pair.embedding.name), self.sums.get(pair.head.name)
        if emb is None or head is None or None in (emb.a, emb.g, head.a, head.g):
            return None
        return [emb.a_factor(), emb.g_factor(), head.a_factor(), head.g_factor()]  # type: ignore[list-item]

    def launch(self) -> None:
        """On a factor update, sum every pair's factors (and whether each rank ran it) over ranks: one all-reduce."""
        if not self.tied or not self.schedule.factors():
            return
        backend, dtype = self.engine.backend, self.capture.dtype
        parts, present = [], []
        for pair in self.tied:
            factors = self._step_factors(pair)
            widths = [packed_size(d) for d in pair.dims()]
            zeros = [torch.zeros(w, dtype=dtype, device=backend.device) for w in widths]
            parts += zeros if factors is None else [f.to(dtype) for f in factors]
            present.append(torch.full((1,), float(factors is not None), dtype=dtype, device=backend.device))
        flat = torch.cat([*parts, *present])
        self._pending = (flat, backend.allreduce_async(flat) if backend.world_size > 1 else None)
        self.reset()

    def _blend(self) -> None:
        """Wait for :meth:`launch`'s sums; blend each factor's mean over the ranks that ran it into its average."""
        if self._pending is None:
            return
        flat, handle = self._pending
        self._pending = None
        if handle is not None:
            with self.engine.timer.span("FactorComm"):
                handle.wait()
        counts, start = flat[-len(self.tied) :], 0
        for i, pair in enumerate(self.tied):
            ran = counts[i] > 0
            for side, d in zip(SIDES, pair.dims(), strict=True):
                mean = flat[start : start + packed_size(d)] / counts[i].clamp(min=1)
                start += packed_size(d)
                key = f"{pair.name}/{side}"
                finite = self.finite.check(key, self.schedule.steps, mean, ran) & ran
                blend(self.running, key, mean, finite, self.decay())

    def _invert(self) -> None:
        """Each pair's joint inverse from the running factors: on rank 0, broadcast to the others."""
        backend = self.engine.backend
        for pair in self.tied:
            keys = [f"{pair.name}/{side}" for side in SIDES]
            if any(key not in self.running for key in keys):
                continue
            v, d = pair.head.g_dim, pair.head.a_dim
            if backend.rank == 0:
                full = [unpack(self.running[k].to(self.dtype), n) for k, n in zip(keys, pair.dims(), strict=True)]
                x_r, x_c, scale = joint_inverse(*full, self.schedule.damping)
                flat = torch.cat([x_r.flatten(), x_c.flatten(), scale.flatten()])
            else:
                flat = torch.empty(v * v + d * d + v * d, dtype=self.dtype, device=backend.device)
            if backend.world_size > 1:
                with self.engine.timer.span("InverseComm"):
                    backend.broadcast_async(flat, 0).wait()
            x_r, x_c, scale = flat.split([v * v, d * d, v * d])
            self.inverses[pair.name] = (x_r.view(v, v), x_c.view(d, d), scale.view(v, d))

    def pairs(self) -> list[tuple[Tensor, Tensor]]:
        """Each pair's ``(F^-1 grad, grad)``, flat, for those with a gradient and an inverse.

        Call once the gradients are averaged; :meth:`set_grads` takes the final updates in the same order.
        """
        self._blend()
        if self.tied and (self.schedule.inverts() or len(self.inverses) < len(self.tied)):
            self._invert()
        self._live, out = [], []
        with torch.no_grad():
            for pair in self.tied:
                inverse, grad = self.inverses.get(pair.name), pair.grad_matrix()
                if inverse is None or grad is None:
                    continue
                wide = torch.promote_types(self.dtype, grad.dtype)
                update = apply_inverse(inverse, grad.to(wide)).to(grad.dtype)
                out.append((update.flatten(), grad.flatten()))
                self._live.append(pair)
        return out

    def set_grads(self, updates: list[Tensor]) -> None:
        """Write :meth:`pairs`' final updates into the weights' (and heads' biases') gradients."""
        with torch.no_grad():
            for pair, update in zip(self._live, updates, strict=True):
                pair.head.set_grad(update.view(pair.head.g_dim, pair.head.a_dim))
        self._live = []

    def reset(self) -> None:
        """Forget this step's sums (sent, or the step was skipped on every rank)."""
        self.sums, self._pass = {}, {}

    def saved(self) -> dict[str, Any]:
        """The running factors and the inverses, copied (for a checkpoint)."""
        inverses = {name: [t.detach().clone() for t in parts] for name, parts in self.inverses.items()}
        return {"running": {k: v.detach().clone() for k, v in self.running.items()}, "inverses": inverses}

    def restore(self, saved: dict[str, Any] | None) -> None:
        """Take :meth:`saved`'s factors and inverses back, onto this run's device and dtypes.

        A checkpoint without them (made without ``tied``) starts them at the next factor update.

        Raises:
            UserError: If a factor is of no pair of this run, or of another size.
        """
        sizes = {f"{p.name}/{s}": packed_size(d) for p in self.tied for s, d in zip(SIDES, p.dims(), strict=True)}
        running = (saved or {}).get("running", {})
        for key, factor in running.items():
            if sizes.get(key) != factor.numel():
                raise UserError(
                    f"resume: the checkpoint's K-FAC factor {key!r} of a tied weight does not fit this model "
                    "(model.name, kfac.kinds or kfac.skip changed?); resume with the run's own settings, or start "
                    "a new run."
                )
        device = self.engine.backend.device
        self.running = {k: v.to(device, self.capture.dtype, copy=True) for k, v in running.items()}
        inverses = (saved or {}).get("inverses", {})
        self.inverses = {n: tuple(t.to(device, self.dtype, copy=True) for t in parts) for n, parts in inverses.items()}  # type: ignore[misc]
        self.reset()
        self._pending = None

    def remove(self) -> None:
        """Take the hooks off the modules."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
