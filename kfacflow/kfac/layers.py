"""Which modules K-FAC preconditions, what their weights see, and their gradients as one matrix.

K-FAC's factors describe a weight gradient only when the module computes what ``nn.Linear``,
``nn.Conv2d`` or ``nn.Embedding`` computes from the input its hooks see, and nothing else adds to that
gradient. (A norm's scale and shift, kind ``norm``, go by a diagonal instead: :mod:`~kfacflow.kfac.sides.norms`.)
An embedding is a Linear on one-hot tokens: its weight ``(V, d)`` is that Linear's
``(d, V)`` transposed, its A factor (``V x V``) counts how often each token was seen (diagonal under
``expand``), its G is the Linear's. The kinds preconditioned are ``kfac.kinds``.
An ``nn.MultiheadAttention`` is two Linear maps (kind ``linear``): its ``out_proj``, and its packed
``in_proj_weight`` as a :class:`~kfacflow.kfac.multihead.PackedProjection` named ``<module>.in_proj``,
seen by the hooks through a forward of kfacflow's (:mod:`~kfacflow.kfac.multihead`).
Anything else is left to the plain optimizer with one INFO line saying why: a subclass with a
forward of its own (except the known ones below), a parametrized or computed weight, a weight
tied to another module, a grouped or non-zero-padded convolution, a MultiheadAttention of a
configuration K-FAC does not know (``kdim``/``vdim``, ``bias_k``/``bias_v``, ``add_zero_attn``).
"""

from __future__ import annotations

import fnmatch
import logging
from collections import defaultdict
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.parameter import is_lazy
from torch.nn.utils import parametrize

from kfacflow import UserError, did_you_mean
from kfacflow.kfac.multihead import IN_PROJ, PackedProjection, attention_reason, in_proj_reason

logger = logging.getLogger(__name__)

OWN_FORWARD = "its forward is its own, so the factors cannot know what it computes"
EMBEDDING_ROWS = 8192
"""Most rows of an embedding K-FAC takes: its A factor is ``V x V`` and its factors' rows one-hot ``V`` wide."""
NORMS = (nn.LayerNorm, nn.RMSNorm)
"""The norms whose scale and shift kind ``norm`` preconditions (by a diagonal: :mod:`~kfacflow.kfac.sides.norms`)."""
KINDS: dict[str, type[nn.Module] | tuple[type[nn.Module], ...]] = {
    "linear": nn.Linear,
    "conv2d": nn.Conv2d,
    "embedding": nn.Embedding,
    "norm": NORMS,
}
"""The modules each of ``kfac.kinds`` names (subclasses too, where their forward is the parent's); and ``tied``
(an embedding and a Linear head sharing their weight: :mod:`~kfacflow.kfac.sides.tied`)."""

# Subclasses whose forward K-FAC knows, by (defining module, class): recognised by name so that
# kfacflow does not import timm. timm.models.layers held them before timm 0.9.
_TF_SAME = frozenset(
    (mod, cls)
    for mod in ("timm.layers.conv2d_same", "timm.models.layers.conv2d_same")
    for cls in ("Conv2dSame", "Conv2dSameExport")
)
"""TF "SAME" convolutions: zero-pad the input (asymmetrically if need be), then a padding-0 conv."""
_AS_PARENT = frozenset({("timm.layers.linear", "Linear"), ("timm.models.layers.linear", "Linear")})
"""Subclasses computing exactly what their parent computes (timm's Linear only casts under TorchScript)."""


def _defining(module: nn.Module, method: str) -> type:
    """Return the class of ``module``'s MRO that defines ``method``."""
    return next(cls for cls in type(module).__mro__ if method in vars(cls))


def _key(cls: type) -> tuple[str, str]:
    return cls.__module__, cls.__qualname__


def forward_kind(module: nn.Module) -> str | None:
    """Return how ``module`` computes its output, or None if K-FAC does not know.

    Args:
        module: A Linear, Conv2d, Embedding or norm (or a subclass).

    Returns:
        ``"plain"`` (what nn.Linear, nn.Conv2d, ... compute), ``"tf_same"`` (timm's TF-same
        convolutions) or None (a forward of its own).
    """
    if "forward" in vars(module):  # forward replaced on the instance
        return None
    if isinstance(module, nn.Conv2d) and _defining(module, "_conv_forward") is not nn.Conv2d:
        return None
    owner = _defining(module, "forward")
    if owner in (nn.Linear, nn.Conv2d, nn.Embedding, *NORMS) or _key(owner) in _AS_PARENT:
        return "plain"
    if _key(owner) in _TF_SAME:
        return "tf_same"
    return None


def tf_same_pad(conv: nn.Conv2d, x: Tensor) -> Tensor:
    """Pad ``x`` as timm's ``pad_same`` does for ``conv`` (TF "SAME": the extra row/column at the end).

    Per dimension ``total = max((ceil(in / stride) - 1) * stride + (k - 1) * dilation + 1 - in, 0)``,
    ``total // 2`` before and the rest after.
    """
    cached = getattr(conv, "pad", None)
    if isinstance(cached, nn.ZeroPad2d):
        # Conv2dSameExport keeps the padding of the first input size it saw: use what it uses.
        return cached(x)
    pads: list[int] = []
    dims = zip(x.shape[-2:], conv.kernel_size, conv.stride, conv.dilation, strict=True)
    for size, k, s, d in reversed(list(dims)):
        total = max((-(-size // s) - 1) * s + (k - 1) * d + 1 - size, 0)
        pads += [total // 2, total - total // 2]
    return F.pad(x, pads)


def bias_preconditioned(module: nn.Module) -> bool:
    """Return whether ``module``'s bias is preconditioned with its weight (it exists and is trained)."""
    bias = getattr(module, "bias", None)
    return isinstance(bias, Tensor) and bias.requires_grad


@dataclass
class KFACLayer:
    """A preconditioned module: its name, its factor sizes and its gradient matrix.

    The gradient matrix is ``(g_dim, a_dim)``: the weight gradient flattened to
    ``(C_out, C_in*kh*kw)``, with the bias gradient as the last column when the bias is trained.
    """

    name: str
    module: nn.Module
    _tf_same: bool = field(init=False, repr=False)
    embedding: bool = field(init=False)
    """An ``nn.Embedding``: its gradient matrix is its weight's gradient transposed, its inputs one-hot rows."""

    def __post_init__(self) -> None:
        self._tf_same = forward_kind(self.module) == "tf_same"
        self.embedding = isinstance(self.module, nn.Embedding)

    @property
    def by_rows(self) -> bool:
        """Whether its update may be made from its rows (``kfac.precondition=rows``): not from one-hot ones."""
        return not self.embedding

    @property
    def has_bias(self) -> bool:
        """Whether the bias is preconditioned together with the weight (a ones column in A)."""
        return bias_preconditioned(self.module)

    @property
    def params(self) -> list[Tensor]:
        """The parameters it preconditions: the weight, and the bias where it is trained."""
        bias = getattr(self.module, "bias", None)
        return [self._weight(), bias] if self.has_bias and isinstance(bias, Tensor) else [self._weight()]

    @property
    def a_dim(self) -> int:
        """Side of the A factor."""
        if self.embedding:
            return self._weight().shape[0]
        return self._weight()[0].numel() + int(self.has_bias)

    @property
    def g_dim(self) -> int:
        """Side of the G factor."""
        return self._weight().shape[1 if self.embedding else 0]

    def factor_input(self, x: Tensor, dtype: torch.dtype) -> Tensor:
        """The module input as the factors take it, in ``dtype``: padded (TF-same), or one-hot tokens (an embedding)."""
        if self.embedding:
            return F.one_hot(x.long(), self.a_dim).to(dtype)
        return self.layer_input(x.to(dtype))

    def layer_input(self, x: Tensor) -> Tensor:
        """Return the module input ``x`` as the weight sees it (TF-same convolutions pad it first).

        A plain Conv2d's own padding is not applied here: ``factors.conv_windows`` applies it.
        """
        if not self._tf_same:
            return x
        assert isinstance(self.module, nn.Conv2d)
        return tf_same_pad(self.module, x)

    def grad_matrix(self) -> Tensor | None:
        """Return the gradient as a ``(g_dim, a_dim)`` matrix, or None if there is none yet."""
        weight = self._weight()
        if weight.grad is None:
            return None
        if self.embedding:
            return weight.grad.T.contiguous()
        g = weight.grad.reshape(weight.shape[0], -1)
        if self.has_bias:
            bias = self.module.bias
            assert isinstance(bias, Tensor) and bias.grad is not None
            g = torch.cat([g, bias.grad.reshape(-1, 1)], dim=1)
        return g

    def set_grad(self, mat: Tensor) -> None:
        """Write a ``(g_dim, a_dim)`` matrix back into the weight (and trained bias) gradients."""
        weight = self._weight()
        assert weight.grad is not None
        if self.embedding:
            weight.grad.copy_(mat.T)
            # The padding row is never trained, as PyTorch keeps it (reduce's A mixes tokens: the update would not).
            padding = getattr(self.module, "padding_idx", None)
            if padding is not None:
                weight.grad[padding] = 0
            return
        if self.has_bias:
            bias = self.module.bias
            assert isinstance(bias, Tensor) and bias.grad is not None
            bias.grad.copy_(mat[:, -1].reshape(bias.shape))
            mat = mat[:, :-1]
        weight.grad.copy_(mat.reshape(weight.shape))

    def _weight(self) -> Tensor:
        weight = self.module.weight
        assert isinstance(weight, Tensor)
        return weight


def param_users(model: nn.Module) -> dict[int, list[str]]:
    """Map each parameter's id to the ``module.param`` names of every distinct module holding it."""
    users: dict[int, list[str]] = defaultdict(list)
    for name, module in model.named_modules():
        for pname, p in module.named_parameters(prefix=name, recurse=False):
            users[id(p)].append(pname)
    return users


def skip_reason(name: str, module: nn.Module, users: dict[int, list[str]]) -> str | None:
    """Return why K-FAC cannot precondition ``module``, or None if its factors describe its gradient.

    Args:
        name: The module's name in the model.
        module: A Linear, Conv2d, Embedding or norm (or a subclass).
        users: :func:`param_users` of the model, to find tied parameters.
    """
    if forward_kind(module) is None:
        return OWN_FORWARD
    if isinstance(module, nn.Embedding) and (reason := embedding_reason(module)):
        return reason
    if parametrize.is_parametrized(module):
        return "it is parametrized (e.g. weight_norm, spectral_norm), so its weight is computed from other parameters"
    for pname in ("weight", "bias"):
        p = getattr(module, pname, None)
        if p is None and pname == "bias":
            continue
        if not isinstance(p, nn.Parameter):
            hint = " (e.g. computed by the old weight_norm hook)" if pname == "weight" else ""
            return f"its {pname} is not an nn.Parameter{hint}"
        if is_lazy(p):
            return f"its {pname} is not initialised yet (a lazy module)"
        if not p.requires_grad:  # a frozen bias is not preconditioned: sharing it changes nothing
            continue
        others = [u for u in users[id(p)] if u != (f"{name}.{pname}" if name else pname)]
        if others:
            return (
                f"its {pname} is shared with {', '.join(others)}, so its gradient sums several uses, "
                "which the factors of one module do not describe"
            )
    if isinstance(module, nn.Conv2d) and module.groups != 1:
        return f"grouped convolution (groups={module.groups})"
    if isinstance(module, nn.Conv2d) and module.padding_mode != "zeros":
        return f"padding_mode={module.padding_mode!r}, only zero padding is supported"
    return None


def embedding_reason(module: nn.Embedding) -> str | None:
    """Why an embedding's factors would not describe its gradient (or cost too much), or None."""
    if module.sparse:
        return "its gradient is sparse (sparse=True)"
    if module.max_norm is not None:
        return "max_norm renormalises its rows in the forward pass"
    if module.scale_grad_by_freq:
        return "scale_grad_by_freq scales its gradient by each token's count"
    if module.num_embeddings > EMBEDDING_ROWS:
        return f"its {module.num_embeddings} rows would make a factor wider than {EMBEDDING_ROWS}"
    return None


def affine_trained(module: nn.Module) -> list[Tensor]:
    """A norm's trained scale and shift (``weight``, ``bias``), in that order: none where absent or frozen."""
    params = (getattr(module, name, None) for name in ("weight", "bias"))
    return [p for p in params if isinstance(p, nn.Parameter) and p.requires_grad]


def class_name(module: nn.Module) -> str:
    """The module's class as a log line names it: torch's by its name alone, others with their module."""
    cls = type(module)
    return cls.__name__ if cls.__module__.startswith("torch.") else f"{cls.__module__}.{cls.__qualname__}"


def find_layers(
    model: nn.Module, skip: list[str], kinds: tuple[str, ...] = ("linear", "conv2d"), others: Collection[str] = ()
) -> list[KFACLayer]:
    """Return the modules of ``model`` that K-FAC preconditions by Kronecker factors, in registration order.

    Args:
        model: The network (not wrapped in DDP).
        skip: fnmatch patterns of module names to leave alone.
        kinds: The kinds of layer to precondition (``kfac.kinds``, keys of :data:`KINDS`).
        others: The names of the modules K-FAC preconditions otherwise (the norms, the tied embeddings and heads):
            a pattern may match them, and they are not candidates here.

    Returns:
        The preconditioned layers: modules of the ``kinds`` asked (and the known subclasses) for which
        :func:`skip_reason` finds nothing, whose weight is trained and whose name no pattern
        matches. Each module left out for a :func:`skip_reason` is logged at INFO. A MultiheadAttention
        gives ``<name>.in_proj`` (before its ``<name>.out_proj``); its hooks see calls only once
        :class:`~kfacflow.kfac.multihead.HeldAttention` gives it kfacflow's forward (the preconditioner does).

    Raises:
        UserError: If a ``skip`` pattern matches no module K-FAC would precondition.
    """
    layers, candidates, used = [], [], set()
    for name, module, reason in _candidates(model, kinds):
        if name in others:
            continue
        hits = [pat for pat in skip if fnmatch.fnmatchcase(name, pat)]
        trained = reason is None and bool(module.weight.requires_grad)
        if trained:
            candidates.append(name)
            used.update(hits)
        if hits:
            logger.debug("kfac.skip leaves %s alone", name)
        elif reason is not None:
            logger.info("K-FAC skips %s (%s): %s", name, class_name(module), reason)
        elif not trained:
            logger.debug("K-FAC skips %s: its weight is frozen", name)
        else:
            layers.append(KFACLayer(name, module))
    for pat in skip:
        if pat not in used and not any(fnmatch.fnmatchcase(name, pat) for name in others):
            raise UserError(_unused_pattern(model, pat, [*candidates, *others]))
    return layers


def _candidates(model: nn.Module, kinds: tuple[str, ...]) -> Iterator[tuple[str, nn.Module, str | None]]:
    """Each module of the ``kinds`` asked, by name, with :func:`skip_reason`'s reason; a MultiheadAttention's two.

    A MultiheadAttention K-FAC cannot take is logged here (its ``out_proj`` is not a candidate then); one
    it takes adds its packed projection, as a :class:`~kfacflow.kfac.multihead.PackedProjection` (or as
    the module itself, with :func:`~kfacflow.kfac.multihead.in_proj_reason`'s reason).
    """
    users = param_users(model)
    taken = tuple(KINDS[kind] for kind in kinds if kind in KINDS)
    left: set[int] = set()
    for name, module in model.named_modules():
        if isinstance(module, nn.MultiheadAttention) and "linear" in kinds:
            if (whole := attention_reason(module)) is not None:
                logger.info("K-FAC skips %s (%s) and its projections: %s", name, class_name(module), whole)
                left.add(id(module.out_proj))
                continue
            why = in_proj_reason(module, name, users)
            yield f"{name}.{IN_PROJ}" if name else IN_PROJ, module if why else PackedProjection(module), why
        elif isinstance(module, (nn.Linear, nn.Conv2d, nn.Embedding)) and isinstance(module, taken):
            if id(module) not in left:
                yield name, module, skip_reason(name, module, users)


def _unused_pattern(model: nn.Module, pat: str, candidates: list[str]) -> str:
    """Explain a ``kfac.skip`` pattern that matches no module K-FAC would precondition."""
    msg = f"kfac.skip: {pat!r} matches no module K-FAC would precondition."
    matched = [(name, m) for name, m in model.named_modules() if fnmatch.fnmatchcase(name, pat)]
    left_alone = [name for name, m in matched if isinstance(m, (nn.Linear, nn.Conv2d))]
    containers = [name for name, m in matched if any(c.startswith(f"{name}.") for c in candidates)]
    if containers:
        msg += f" {containers[0]!r} holds layers: use '{pat}.*' to skip the layers inside it."
    elif left_alone:
        msg += f" It matches only {', '.join(map(repr, left_alone[:3]))}, which K-FAC leaves alone anyway."
    return msg + did_you_mean(pat, candidates)
