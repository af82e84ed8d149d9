"""Which modules K-FAC preconditions, and their gradients viewed as one matrix."""

from __future__ import annotations

import fnmatch
import logging
from dataclasses import dataclass

import torch
from torch import Tensor, nn

logger = logging.getLogger(__name__)


@dataclass
class KFACLayer:
    """A preconditioned module: its name, its factor sizes and its gradient matrix.

    The gradient matrix is ``(g_dim, a_dim)``: the weight gradient flattened to
    ``(C_out, C_in*kh*kw)`` with the bias gradient as the last column.
    """

    name: str
    module: nn.Module

    @property
    def has_bias(self) -> bool:
        """Whether the layer has a bias (a ones column in A)."""
        return getattr(self.module, "bias", None) is not None

    @property
    def a_dim(self) -> int:
        """Side of the A factor."""
        weight = self.module.weight
        assert isinstance(weight, Tensor)
        return weight[0].numel() + int(self.has_bias)

    @property
    def g_dim(self) -> int:
        """Side of the G factor."""
        weight = self.module.weight
        assert isinstance(weight, Tensor)
        return weight.shape[0]

    def grad_matrix(self) -> Tensor | None:
        """Return the gradient as a ``(g_dim, a_dim)`` matrix, or None if there is none yet."""
        weight = self.module.weight
        assert isinstance(weight, Tensor)
        if weight.grad is None:
            return None
        g = weight.grad.reshape(weight.shape[0], -1)
        if self.has_bias:
            bias = self.module.bias
            assert isinstance(bias, Tensor) and bias.grad is not None
            g = torch.cat([g, bias.grad.reshape(-1, 1)], dim=1)
        return g

    def set_grad(self, mat: Tensor) -> None:
        """Write a ``(g_dim, a_dim)`` matrix back into the weight (and bias) gradients."""
        weight = self.module.weight
        assert isinstance(weight, Tensor) and weight.grad is not None
        if self.has_bias:
            bias = self.module.bias
            assert isinstance(bias, Tensor) and bias.grad is not None
            bias.grad.copy_(mat[:, -1].reshape(bias.shape))
            mat = mat[:, :-1]
        weight.grad.copy_(mat.reshape(weight.shape))


def supported(module: nn.Module) -> bool:
    """Return whether K-FAC knows the factors of ``module`` (Linear; Conv2d, groups=1, zero padding)."""
    if isinstance(module, nn.Linear):
        return True
    if isinstance(module, nn.Conv2d):
        return module.groups == 1 and module.padding_mode == "zeros"
    return False


def find_layers(model: nn.Module, skip: list[str]) -> list[KFACLayer]:
    """Return the modules of ``model`` that K-FAC preconditions, in registration order.

    Args:
        model: The network (not wrapped in DDP).
        skip: fnmatch patterns of module names to leave alone.

    Returns:
        The preconditioned layers. Grouped or non-zero-padded convolutions, modules of other
        types and skipped names are left to the plain optimizer.
    """
    layers = []
    for name, module in model.named_modules():
        if not isinstance(module, (nn.Linear, nn.Conv2d)):
            continue
        if any(fnmatch.fnmatchcase(name, pat) for pat in skip):
            logger.debug("kfac.skip leaves %s alone", name)
        elif not supported(module):
            logger.info("K-FAC skips %s (%s): grouped or non-zero padding", name, type(module).__name__)
        elif module.weight.requires_grad:
            layers.append(KFACLayer(name, module))
    return layers
