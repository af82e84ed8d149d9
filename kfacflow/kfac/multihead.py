"""``nn.MultiheadAttention`` through module calls, so that K-FAC's hooks see its two projections.

``nn.MultiheadAttention`` hands ``out_proj.weight`` and its packed ``in_proj_weight`` (``3E x E``) to
``F.multi_head_attention_forward``: no module of its runs, so no hook sees a projection's input. While
K-FAC holds such a module, its instance gets a forward of kfacflow's (:class:`ModuleCalls`) that
computes what the class's forward computes, with ``out_proj`` called as the ``nn.Linear`` it is and the
input projection as a :class:`PackedProjection`: an ``nn.Linear`` holding the module's own
``in_proj_weight`` and ``in_proj_bias`` Parameters, not registered as its child, so the model's
``state_dict``, ``named_parameters``, DDP and checkpoints see nothing new.

- **Self-attention** (the call's query, key and value one tensor, as in ``nn.TransformerEncoderLayer``):
  ``in_proj`` is one Linear on that input, exactly.
- **Other calls** (cross-attention, an encoder-decoder's memory): the packed weight's row blocks see
  different inputs, so they are called as three modules (:class:`RowBlock`: query, key, value), each a
  Linear on its own input, which are preconditioned beside the pipelines
  (:mod:`~kfacflow.kfac.sides.cross_attention`: the routes of gradients to their owners and the rows of
  ``kfac.precondition=rows`` take a Parameter whole, never a slice); ``in_proj`` itself then never runs
  and leaves the pipelines on the first step, with a line saying where its blocks went. A module
  called both ways is an error, never a silent mismatch.
- **Outside training** (eval mode, or no gradients) the class's own forward runs, fast path included:
  no hook captures then. Nested tensors, which only that fast path takes, go there too.

Modules of other configurations (``kdim``/``vdim`` other than ``embed_dim``, ``bias_k``/``bias_v``,
``add_zero_attn``, a forward of their own) keep their forward and are left to the optimizer with their
reason (:func:`attention_reason`). :meth:`HeldAttention.remove` gives every forward back.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils import parametrize

from kfacflow import UserError

IN_PROJ = "in_proj"
"""The last part of the name K-FAC gives a module's packed input projection (``blocks.0.attn.in_proj``)."""


def attention_reason(module: nn.MultiheadAttention) -> str | None:
    """Why K-FAC leaves ``module`` (both its projections) to the optimizer, or None if it can take it."""
    forward = vars(module).get("forward")
    cls = next(c for c in type(module).__mro__ if "forward" in vars(c))
    if (forward is not None and not isinstance(forward, ModuleCalls)) or cls is not nn.MultiheadAttention:
        return "its forward is its own, so the factors cannot know what it computes"
    if not module._qkv_same_embed_dim:
        return "its keys or values are not embed_dim wide (kdim/vdim): three projection weights, not one packed"
    if module.bias_k is not None or module.bias_v is not None:
        return "bias_k/bias_v append a learnt key and value to every sequence"
    if module.add_zero_attn:
        return "add_zero_attn appends a zero key and value to every sequence"
    return None


def in_proj_reason(module: nn.MultiheadAttention, name: str, users: dict[int, list[str]]) -> str | None:
    """Why K-FAC leaves ``module``'s packed input projection to the optimizer, or None.

    Args:
        module: A MultiheadAttention :func:`attention_reason` finds nothing against.
        name: Its name in the model.
        users: The ``module.param`` names holding each parameter (by id), to find tied ones.
    """
    if parametrize.is_parametrized(module):
        return "it is parametrized, so its in_proj_weight is computed from other parameters"
    for pname in ("in_proj_weight", "in_proj_bias"):
        p = getattr(module, pname, None)
        if p is None and pname == "in_proj_bias":
            continue
        if not isinstance(p, nn.Parameter):
            return f"its {pname} is not an nn.Parameter"
        others = [u for u in users[id(p)] if u != (f"{name}.{pname}" if name else pname)]
        if p.requires_grad and others:
            return f"its {pname} is shared with {', '.join(others)}, so its gradient sums several uses"
    return None


class PackedProjection(nn.Linear):
    """A MultiheadAttention's packed input projection as an ``nn.Linear`` (``E`` in, ``3E`` out).

    Its ``weight`` and ``bias`` are the module's own ``in_proj_weight`` and ``in_proj_bias`` Parameters
    (the same objects: their gradients are the module's). Its forward is ``nn.Linear``'s.

    Args:
        module: The MultiheadAttention (:func:`attention_reason` and :func:`in_proj_reason` find nothing).
    """

    elsewhere: str | None = None
    """Where its weight went instead when its forward never ran (its row blocks, in cross-attention)."""

    def __init__(self, module: nn.MultiheadAttention) -> None:
        nn.Module.__init__(self)  # not nn.Linear's: it would allocate a weight only to drop it
        self.in_features, self.out_features = module.embed_dim, 3 * module.embed_dim
        self.weight = module.in_proj_weight
        self.register_parameter("bias", module.in_proj_bias)


class RowBlock(nn.Module):
    """One row block of a MultiheadAttention's packed projection (``E`` rows: query 0, key 1, value 2) as a Linear.

    Its ``weight`` and ``bias`` are views of the module's ``in_proj_weight`` and ``in_proj_bias``, taken at each
    use (their gradients land in the module's); not registered anywhere.

    Args:
        module: The MultiheadAttention.
        index: Which block: 0, 1 or 2.
    """

    def __init__(self, module: nn.MultiheadAttention, index: int) -> None:
        super().__init__()
        self.rows = slice(index * module.embed_dim, (index + 1) * module.embed_dim)
        self.held = (module,)  # in a tuple: not a child module, so the model's walks never reach it twice

    @property
    def weight(self) -> Tensor:
        """The block's rows of ``in_proj_weight``."""
        return self.held[0].in_proj_weight[self.rows]

    @property
    def bias(self) -> Tensor | None:
        """The block's part of ``in_proj_bias`` (None where the module has none)."""
        bias = self.held[0].in_proj_bias
        return None if bias is None else bias[self.rows]

    def forward(self, x: Tensor) -> Tensor:
        """``x W_block^T + b_block``."""
        return F.linear(x, self.weight, self.bias)


class ModuleCalls:
    """The forward K-FAC gives a MultiheadAttention it holds (an attribute of the instance).

    Args:
        module: The MultiheadAttention.
        name: Its name in the model (for the messages).
        in_proj: Its packed input projection, where K-FAC preconditions it; None: computed as the class does.
    """

    def __init__(self, module: nn.MultiheadAttention, name: str, in_proj: PackedProjection | None) -> None:
        self.module, self.name, self.in_proj = module, name, in_proj
        self.blocks = None if in_proj is None else (RowBlock(module, 0), RowBlock(module, 1), RowBlock(module, 2))
        """The row blocks called as modules in cross-attention (where ``in_proj`` is preconditioned)."""
        self.mode: str | None = None
        """``"self"`` or ``"cross"``: how the first training call used ``in_proj`` (every later one must agree)."""

    def __call__(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Tensor | None = None,
        need_weights: bool = True,
        attn_mask: Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """Return what ``nn.MultiheadAttention.forward`` returns for these arguments."""
        module = self.module
        nested = query.is_nested or key.is_nested or value.is_nested
        if nested or not (module.training and torch.is_grad_enabled()):
            return nn.MultiheadAttention.forward(
                module, query, key, value, key_padding_mask, need_weights, attn_mask, average_attn_weights, is_causal
            )
        if is_causal and attn_mask is None:  # as the class's forward says, before any hook sees the call
            raise RuntimeError(
                "Need attn_mask if specifying the is_causal hint. You may use the Transformer module method "
                "`generate_square_subsequent_mask` to create this mask."
            )
        in_proj = self._in_proj(query is key and key is value)
        masks = (key_padding_mask, attn_mask, is_causal)
        return attend(module, in_proj, (query, key, value), masks, need_weights, average_attn_weights)

    def _in_proj(self, self_attention: bool) -> PackedProjection | tuple[RowBlock, ...] | None:
        """The projection (or its row blocks) to call as modules for this call, or None (computed from the weight)."""
        if self.in_proj is None:
            return None
        if self_attention and self.mode != "cross":
            self.mode = "self"
            return self.in_proj
        if self.mode == "self":
            layer = f"{self.name}.{IN_PROJ}" if self.name else IN_PROJ
            raise UserError(
                f"kfac: {self.name or 'the model'} (MultiheadAttention) was called as self-attention (one tensor as "
                "query, key and value), then with different ones: K-FAC preconditions its packed in_proj as one "
                f"Linear on the input of self-attention alone. Add '{layer}' to kfac.skip."
            )
        if self.mode is None:
            self.mode = "cross"
            self.in_proj.elsewhere = (
                f"{self.name} (MultiheadAttention) is called with a query, key and value that are not one tensor "
                "(cross-attention): its packed in_proj's query, key and value rows are three layers instead, "
                "preconditioned beside the pipelines"
            )
        return self.blocks


def _additive(mask: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """A boolean mask (True: not attended) as the additive float mask MultiheadAttention makes of it."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.zeros_like(mask, dtype=dtype).masked_fill_(mask, float("-inf"))


def _projected(
    module: nn.MultiheadAttention,
    in_proj: PackedProjection | tuple[RowBlock, ...] | None,
    qkv: tuple[Tensor, Tensor, Tensor],
) -> tuple[Tensor, Tensor, Tensor]:
    """Queries, keys and values: the packed weight's row blocks on query, key and value (each ``(N, L, E)``)."""
    query, key, value = qkv
    if isinstance(in_proj, tuple):
        return in_proj[0](query), in_proj[1](key), in_proj[2](value)
    if in_proj is not None:
        return in_proj(query).chunk(3, dim=-1)  # type: ignore[no-any-return]
    weight, bias = module.in_proj_weight, module.in_proj_bias
    if query is key and key is value:
        return F.linear(query, weight, bias).chunk(3, dim=-1)  # type: ignore[return-value]
    e = module.embed_dim
    w_q, w_kv = weight[:e], weight[e:]
    b_q, b_kv = (None, None) if bias is None else (bias[:e], bias[e:])
    q = F.linear(query, w_q, b_q)
    if key is value:
        k, v = F.linear(key, w_kv, b_kv).chunk(2, dim=-1)
        return q, k, v
    b_k, b_v = (None, None) if b_kv is None else b_kv.chunk(2)
    return q, F.linear(key, w_kv[:e], b_k), F.linear(value, w_kv[e:], b_v)


def attend(
    module: nn.MultiheadAttention,
    in_proj: PackedProjection | tuple[RowBlock, ...] | None,
    qkv: tuple[Tensor, Tensor, Tensor],
    masks: tuple[Tensor | None, Tensor | None, bool],
    need_weights: bool,
    average_attn_weights: bool,
) -> tuple[Tensor, Tensor | None]:
    """What ``module``'s own forward computes, with ``in_proj`` (where given) and ``out_proj`` called as modules.

    Both projections see their inputs examples first (``(N, L, E)``, a view of a ``(L, N, E)`` input),
    so that no factor need guess which dimension counts examples.

    Args:
        module: The MultiheadAttention.
        in_proj: Its packed projection, called on the query of self-attention, or its row blocks (cross-attention),
            called on the query, key and value; None: the weight's blocks, computed here.
        qkv: The call's query, key and value (one tensor three times for self-attention).
        masks: ``key_padding_mask``, ``attn_mask`` and ``is_causal``, as the module takes them.
        need_weights: Whether the attention weights are returned (computed explicitly, else
            ``F.scaled_dot_product_attention``).
        average_attn_weights: Whether the weights returned are averaged over the heads.
    """
    key_padding_mask, attn_mask, is_causal = masks
    batched = qkv[0].dim() == 3

    def examples_first(t: Tensor) -> Tensor:
        return t if batched and module.batch_first else t.transpose(0, 1) if batched else t.unsqueeze(0)

    views: dict[int, Tensor] = {}  # one view per distinct tensor, so that "query is key" still tells self-attention
    for t in qkv:
        if id(t) not in views:
            views[id(t)] = examples_first(t)
    q, k, v = _projected(module, in_proj, (views[id(qkv[0])], views[id(qkv[1])], views[id(qkv[2])]))
    n, length, e = q.shape
    heads, source = module.num_heads, k.shape[1]
    q, k, v = (t.unflatten(-1, (heads, e // heads)).transpose(1, 2) for t in (q, k, v))  # (N, H, L, E / H)
    padding = _additive(key_padding_mask, qkv[0].dtype)
    causal = is_causal and padding is None and not need_weights  # the hint alone, as MultiheadAttention takes it
    mask = None if causal else _additive(attn_mask, qkv[0].dtype)
    if mask is not None and mask.dim() == 3:  # (N * H, L, S)
        mask = mask.view(n, heads, length, source)
    if padding is not None:
        padding = padding.view(n, 1, 1, source)
        mask = padding if mask is None else mask + padding
    dropout = module.dropout if module.training else 0.0
    weights = None
    if need_weights:
        scores = (q * math.sqrt(1.0 / q.shape[-1])) @ k.transpose(-2, -1)
        weights = (scores if mask is None else scores + mask).softmax(dim=-1)
        if dropout > 0.0:
            weights = F.dropout(weights, p=dropout)
        out = weights @ v
        if average_attn_weights:
            weights = weights.mean(dim=1)
    else:
        out = F.scaled_dot_product_attention(q, k, v, mask, dropout, is_causal=causal)
    out = module.out_proj(out.transpose(1, 2).reshape(n, length, e))
    if not batched:
        return out.squeeze(0), None if weights is None else weights.squeeze(0)
    return (out if module.batch_first else out.transpose(0, 1)), weights


class HeldAttention:
    """Gives the MultiheadAttention modules whose projections K-FAC preconditions a :class:`ModuleCalls` forward.

    Args:
        model: The network.
        layers: The names and modules of the layers K-FAC preconditions (``attn.out_proj``, ``attn.in_proj``).

    Raises:
        UserError: If another preconditioner holds one of these modules already.
    """

    def __init__(self, model: nn.Module, layers: dict[str, nn.Module]) -> None:
        self.held: list[nn.MultiheadAttention] = []
        self.blocks: dict[str, tuple[RowBlock, ...]] = {}
        """Each held module's row blocks (where its in_proj is preconditioned), by the in_proj's layer name."""
        for name, module in model.named_modules():
            if not isinstance(module, nn.MultiheadAttention):
                continue
            prefix = f"{name}." if name else ""
            in_proj = layers.get(f"{prefix}{IN_PROJ}")
            if not isinstance(in_proj, PackedProjection) and layers.get(f"{prefix}out_proj") is not module.out_proj:
                continue
            if isinstance(vars(module).get("forward"), ModuleCalls):
                self.remove()
                raise UserError(
                    f"kfac: {name!r} (MultiheadAttention) is already held by another K-FAC preconditioner, which "
                    "would precondition its gradients twice; call the other one's remove() first."
                )
            calls = ModuleCalls(module, name, in_proj if isinstance(in_proj, PackedProjection) else None)
            module.forward = calls  # type: ignore[method-assign]
            self.held.append(module)
            if calls.blocks is not None:
                self.blocks[f"{prefix}{IN_PROJ}"] = calls.blocks

    def remove(self) -> None:
        """Give every module held its class's forward back."""
        for module in self.held:
            if isinstance(vars(module).get("forward"), ModuleCalls):
                del module.forward
        self.held = []
