"""kfacflow's own small Vision Transformer (``model.name=vit``), built of the layers K-FAC preconditions.

Every map with a weight matrix is a module K-FAC's hooks see: the patch embedding is an ``nn.Conv2d``
(a patch-sized kernel and stride), each attention is one fused ``qkv`` ``nn.Linear`` and an output
``nn.Linear`` around ``F.scaled_dot_product_attention``, each MLP two ``nn.Linear``
(:class:`~kfacflow.models.attention.Attention`, not ``nn.MultiheadAttention``).
The layer norms and the position embedding are left to the optimizer alone.
"""

from __future__ import annotations

from collections import OrderedDict

from torch import Tensor, nn

from kfacflow import UserError
from kfacflow.models.attention import Attention


class Block(nn.Module):
    """A pre-norm transformer block: ``x + attn(norm1(x))``, then ``x + mlp(norm2(x))`` (a GELU between two Linears).

    Args:
        dim: Width of the tokens.
        heads: Attention heads.
        mlp_ratio: The MLP's hidden width over ``dim``.
        dropout: Dropout in the attention and after each MLP layer.
    """

    def __init__(self, dim: int, heads: int, mlp_ratio: float, dropout: float = 0.0) -> None:
        super().__init__()
        hidden = round(mlp_ratio * dim)
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads, dropout)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(
            OrderedDict(
                fc1=nn.Linear(dim, hidden),
                act=nn.GELU(),
                drop1=nn.Dropout(dropout),
                fc2=nn.Linear(hidden, dim),
                drop2=nn.Dropout(dropout),
            )
        )

    def forward(self, x: Tensor) -> Tensor:
        """Return the block's output, ``(N, T, dim)`` as ``x``."""
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class ViT(nn.Module):
    """A small Vision Transformer for small images; its tokens are averaged for the head (no class token).

    Mean pooling rather than a class token: small ViTs trained from scratch do as well or better with it
    (Beyer et al., *Better plain ViT baselines*, 2022), and it adds no parameter outside the layers. The
    learned position embedding is an ``nn.Embedding``'s table, added to the patches: an embedding, which
    Muon (``optim.name=muon``) leaves to AdamW as it does every embedding, not a matrix to orthogonalise.

    Args:
        num_classes: Outputs of the head (the data's classes).
        in_channels: Channels of the images (the data's).
        image_size: Side of the square images (the data's: kfacflow gives it).
        patch_size: Side of each square patch; it must divide ``image_size``.
        dim: Width of the tokens.
        depth: Transformer blocks.
        heads: Attention heads; they must divide ``dim``.
        mlp_ratio: The MLP's hidden width over ``dim``.
        dropout: Dropout in attention and MLPs (0: none, and every rank computes the same).

    Raises:
        UserError: A patch size that does not tile the image, or heads that do not divide ``dim``.
    """

    def __init__(
        self,
        num_classes: int = 10,
        in_channels: int = 1,
        image_size: int = 28,
        patch_size: int = 7,
        dim: int = 64,
        depth: int = 4,
        heads: int = 4,
        mlp_ratio: float = 2.0,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        _check(image_size, patch_size, dim, heads, depth, mlp_ratio, dropout)
        self.image_size = image_size  # read by kfacflow.models.checks when the data's images do not fit
        self.patch_embed = nn.Conv2d(in_channels, dim, patch_size, stride=patch_size)
        self.pos_embed = nn.Embedding((image_size // patch_size) ** 2, dim)
        self.blocks = nn.Sequential(*(Block(dim, heads, mlp_ratio, dropout) for _ in range(depth)))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)
        self.apply(_init)

    def forward(self, x: Tensor) -> Tensor:
        """Return logits of shape ``(N, num_classes)`` for images ``(N, in_channels, image_size, image_size)``."""
        tokens = self.patch_embed(x).flatten(2).transpose(1, 2)  # (N, patches, dim)
        tokens = self.blocks(tokens + self.pos_embed.weight)
        return self.head(self.norm(tokens).mean(dim=1))


def _init(m: nn.Module) -> None:
    """As timm initialises its ViTs: truncated normal (std 0.02) weights, zero biases, unit layer norms."""
    if isinstance(m, nn.Linear | nn.Conv2d | nn.Embedding):
        nn.init.trunc_normal_(m.weight, std=0.02)
        bias = getattr(m, "bias", None)
        if bias is not None:
            nn.init.zeros_(bias)
    elif isinstance(m, nn.LayerNorm):
        nn.init.ones_(m.weight)
        nn.init.zeros_(m.bias)


def _check(image_size: int, patch_size: int, dim: int, heads: int, depth: int, mlp_ratio: float, drop: float) -> None:
    """Refuse, in one line naming the key, a shape the ViT cannot be built with."""
    if not 1 <= patch_size <= image_size or image_size % patch_size:
        fits = [p for p in range(2, image_size) if image_size % p == 0] or [image_size]
        raise UserError(
            f"model.kwargs.patch_size={patch_size} does not divide the data's {image_size} px images "
            f"(data.image_size): pick a divisor of {image_size}, e.g. {', '.join(map(str, fits[:6]))}, "
            "or set data.image_size to a multiple of the patch size."
        )
    for key, value in (("dim", dim), ("heads", heads), ("depth", depth)):
        if value < 1:
            raise UserError(f"model.kwargs.{key}={value} must be at least 1.")
    if dim % heads:
        fits = [h for h in range(1, dim + 1) if dim % h == 0 and dim // h >= 8][-4:]
        raise UserError(
            f"model.kwargs.heads={heads} does not divide model.kwargs.dim={dim}: pick heads that do, e.g. "
            f"{', '.join(map(str, fits or [1]))}, or another dim."
        )
    if mlp_ratio <= 0 or round(mlp_ratio * dim) < 1:
        raise UserError(f"model.kwargs.mlp_ratio={mlp_ratio} must be positive (the MLP's width over dim).")
    if not 0.0 <= drop < 1.0:
        raise UserError(f"model.kwargs.dropout={drop} must be in [0, 1).")
