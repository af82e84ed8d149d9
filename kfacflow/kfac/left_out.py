"""What K-FAC leaves to the optimizer alone: one INFO line naming it, and the kinds of ``kfac.kinds`` that take some."""

from __future__ import annotations

import logging
import re

from torch import Tensor, nn

from kfacflow.kfac.layers import KINDS, affine_trained
from kfacflow.kfac.sides.tied import tied_weights

logger = logging.getLogger(__name__)


def kinds_left(model: nn.Module, kinds: tuple[str, ...]) -> tuple[str, ...]:
    """The kinds of layer ``model`` has that ``kinds`` (``kfac.kinds``) leaves to the optimizer (a norm: if trained).

    ``tied`` where the model has an embedding and a Linear head sharing a weight (which only ``tied`` takes).
    """
    tied = {id(module) for pair in tied_weights(model) for _, module in pair}

    def counts(kind: str, module: nn.Module) -> bool:
        return isinstance(module, KINDS[kind]) and (kind != "norm" or bool(affine_trained(module)))

    has = [kind for kind in KINDS if any(counts(kind, m) for m in model.modules() if id(m) not in tied)]
    has += ["tied"] if tied else []
    return tuple(sorted(kind for kind in has if kind not in kinds))


def log_left(model: nn.Module, preconditioned: list[Tensor], kinds: tuple[str, ...]) -> list[str]:
    """Log, in one INFO line, the trained parameters K-FAC leaves to the optimizer, and the kinds that would take some.

    Repeated blocks are named once, their indices as ``*`` (``blocks.*.norm1.weight``); the kinds are those the
    model has that ``kinds`` (``kfac.kinds``) leaves out (:func:`kinds_left`). Returns the names logged.
    """
    held = {id(p) for p in preconditioned}
    names = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in held]
    left = list(dict.fromkeys(re.sub(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.)", "*", n) for n in names))
    if left:
        more = kinds_left(model, kinds)
        hint = f"; kfac.kinds may add {', '.join(more)}" if more else ""
        tensors = f"{len(names)} parameter tensor{'s' if len(names) > 1 else ''}"
        logger.info("K-FAC leaves %s to the optimizer alone: %s%s", tensors, ", ".join(left), hint)
    return left
