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
embedding never uses it, so ``G_e`` has a zero row and column there. The four factors (``<embedding>/A``,
``<embedding>/G``, ``<head>/A``, ``<head>/G``) are kept beside the pipelines
(:class:`~kfacflow.kfac.sides.factors.SideFactors`) and inverted when any factor is, on rank 0, which
broadcasts the result.
"""

from __future__ import annotations

import fnmatch
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

from kfacflow.kfac.layers import OWN_FORWARD, KFACLayer, embedding_reason, forward_kind, param_users
from kfacflow.kfac.sides.factors import SideFactors, SideParts

if TYPE_CHECKING:
    pass

logger = logging.getLogger(__name__)


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


class TiedWeights(SideFactors):
    """The tied pairs' factors (:class:`~kfacflow.kfac.sides.factors.SideFactors`), joint inverses and updates.

    Called as the norms' diagonals are (:class:`~kfacflow.kfac.sides.norms.NormDiagonals`): :meth:`launch` after the
    backward pass, :meth:`pairs` once the gradients are averaged, :meth:`set_grads` with the final updates. Its
    :attr:`inverses`: each pair's :func:`joint_inverse`, by weight.

    Args:
        pairs: The pairs preconditioned.
        parts: What a side block is handed (:class:`~kfacflow.kfac.sides.factors.SideParts`).
    """

    what = "a tied weight"

    def __init__(self, pairs: list[TiedPair], parts: SideParts) -> None:
        super().__init__([layer for pair in pairs for layer in (pair.embedding, pair.head)], parts)
        self.tied = pairs
        self._live: list[TiedPair] = []
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

    def _invert(self) -> None:
        """Each pair's joint inverse from the running factors (on rank 0, broadcast)."""
        for pair in self.tied:
            uses = ((pair.embedding, "A"), (pair.embedding, "G"), (pair.head, "A"), (pair.head, "G"))
            if any(f"{layer.name}/{side}" not in self.running for layer, side in uses):
                continue
            v, d = pair.head.g_dim, pair.head.a_dim

            def make(uses: tuple[tuple[KFACLayer, str], ...] = uses) -> list[Tensor]:
                a_e, g_e, a_h, g_h = (self.factor(layer, side) for layer, side in uses)
                assert a_e is not None and g_e is not None and a_h is not None and g_h is not None
                return list(joint_inverse(a_e, g_e, a_h, g_h, self.schedule.damping))

            self.inverses[pair.name] = self.from_rank0(make, [(v, v), (d, d), (v, d)])

    def pairs(self) -> list[tuple[Tensor, Tensor]]:
        """Each pair's ``(F^-1 grad, grad)``, flat, for those with a gradient and an inverse.

        Call once the gradients are averaged; :meth:`set_grads` takes the final updates in the same order.
        """
        self.blend_arrived()
        if self.tied and (self.schedule.inverts() or len(self.inverses) < len(self.tied)):
            self._invert()
        self._live, out = [], []
        with torch.no_grad():
            for pair in self.tied:
                inverse, grad = self.inverses.get(pair.name), pair.grad_matrix()
                if inverse is None or grad is None:
                    continue
                wide = torch.promote_types(self.dtype, grad.dtype)
                update = apply_inverse((inverse[0], inverse[1], inverse[2]), grad.to(wide)).to(grad.dtype)
                out.append((update.flatten(), grad.flatten()))
                self._live.append(pair)
        return out

    def set_grads(self, updates: list[Tensor]) -> None:
        """Write :meth:`pairs`' final updates into the weights' (and heads' biases') gradients."""
        with torch.no_grad():
            for pair, update in zip(self._live, updates, strict=True):
                pair.head.set_grad(update.view(pair.head.g_dim, pair.head.a_dim))
        self._live = []
