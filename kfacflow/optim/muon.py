"""Muon (``optim.name=muon``): every matrix-shaped weight orthogonalised, the rest by AdamW, in one optimizer.

Muon (Jordan et al., 2024; ``torch.optim.Muon``) keeps a momentum of each weight matrix's gradient
and steps along its orthogonalisation: the momentum's polar factor ``U Vᵀ`` (of ``U S Vᵀ``),
approximated by five Newton-Schulz iterations of three products each in bfloat16, its rate scaled
by the matrix's shape. It is made for matrices: a convolution's filters are flattened to
``out x in*k*k`` as the CIFAR-10 speedrun does, and every other parameter (biases, norms,
embeddings, and by default the classifier head) goes to AdamW. One optimizer holds both kinds of
group, so the learning-rate schedule scales both and one checkpoint holds both states.

The Muon step is ``torch.optim.Muon``'s (tested equal on matrices) and the AdamW step
``torch.optim.AdamW``'s (tested equal); :func:`split` decides which parameter goes where.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from kfacflow.optim.sharding import Owners, Sharding

if TYPE_CHECKING:
    from kfacflow.comm.base import Backend
    from kfacflow.timing import StepTimer

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
"""The quintic Newton-Schulz iteration's coefficients (``torch.optim.Muon``'s, Keller Jordan's)."""


def orthogonalised(update: Tensor, steps: int = 5, eps: float = 1e-7, dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """An approximation of ``update``'s polar factor (its singular values pushed towards 1), in ``dtype``.

    ``update`` is a matrix, or filters flattened here to ``out x in*k*k``; the result has its shape.
    """
    a, b, c = NS_COEFFICIENTS
    x = update.reshape(update.shape[0], -1).to(dtype)
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)  # spectral norm at most 1
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return (x.T if tall else x).reshape(update.shape)


def orthogonalised_together(
    updates: Sequence[Tensor],
    steps: int = 5,
    eps: float = 1e-7,
    dtype: torch.dtype = torch.bfloat16,
    batched: bool = True,
) -> list[Tensor]:
    """:func:`orthogonalised` of each of ``updates``, matrices of one shape as one batched product.

    A transformer's blocks repeat their shapes, and a product of many small matrices costs mostly its
    launch: one ``baddbmm`` over a stack does the work of many ``addmm`` (as distributed Muons batch
    same-shape matrices). A matrix whose shape no other shares takes :func:`orthogonalised` itself, and so
    does every matrix unless ``batched``: the step batches on a GPU only, since on a CPU the stacked products
    measured 0.82x (ViT), 0.94-1.08x (ResNet-20) and 1.14x (GPT) the time of one at a time
    (``tools/bench_newton_schulz.py``).
    """
    if not batched:
        return [orthogonalised(u, steps, eps, dtype) for u in updates]
    out: list[Tensor | None] = [None] * len(updates)
    alike: dict[tuple[tuple[int, int], torch.device], list[int]] = {}
    for i, u in enumerate(updates):
        rows, cols = u.shape[0], u[0].numel()
        alike.setdefault(((min(rows, cols), max(rows, cols)), u.device), []).append(i)
    a, b, c = NS_COEFFICIENTS
    for members in alike.values():
        if len(members) == 1:
            out[members[0]] = orthogonalised(updates[members[0]], steps, eps, dtype)
            continue
        mats = [updates[i].reshape(updates[i].shape[0], -1).to(dtype) for i in members]
        x = torch.stack([m.T if m.size(0) > m.size(1) else m for m in mats])
        x = x / x.norm(dim=(1, 2), keepdim=True).clamp(min=eps)
        for _ in range(steps):
            gram = x @ x.mT
            x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
        for i, m, xi in zip(members, mats, x, strict=True):
            out[i] = (xi.T if m.size(0) > m.size(1) else xi).reshape(updates[i].shape)
    return [o for o in out if o is not None]


def ns_dtype(name: str, p: Tensor) -> torch.dtype:
    """The Newton-Schulz iterations' dtype: ``auto`` is bfloat16 on a GPU, as in every Muon, and float32 elsewhere.

    A CPU without bfloat16 units emulates its products: about 16x slower than float32 on a 128 x 1568 matrix
    on this project's AMD EPYC CPU (127 against 7.8 ms), which would make a CPU comparison measure the
    emulation, not Muon.
    """
    if name == "auto":
        return torch.bfloat16 if p.device.type == "cuda" else torch.float32
    return torch.bfloat16 if name == "bfloat16" else torch.float32


def shape_scale(shape: torch.Size, rule: str) -> float:
    """The factor Muon's rate is scaled by for a ``shape`` matrix (``out x in``: filters flattened).

    ``original``: ``sqrt(max(1, out / in))`` (Keller Jordan's); ``match_rms_adamw``: ``0.2 sqrt(max(out, in))``,
    which lets AdamW's rate and weight decay serve (Moonshot's).
    """
    rows, cols = shape[0], math.prod(shape[1:])
    if rule == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    return math.sqrt(max(1.0, rows / cols))


def split(model: nn.Module, head: bool) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """The trained parameters Muon takes (matrices, filters) and those AdamW takes (the rest).

    An ``nn.Embedding``'s table is a lookup, not a map: AdamW's, as in every Muon setup. ``head``:
    whether the classifier head (the model's last ``Linear``) is Muon's too; by default it is
    AdamW's, as the speedruns keep it.
    """
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    last = linears[-1].weight if linears and not head else None
    lookups = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding | nn.EmbeddingBag)}
    matrices, rest = [], []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        if p.ndim >= 2 and id(p) not in lookups and p is not last:
            matrices.append(p)
        else:
            rest.append(p)
    return matrices, rest


class Muon(torch.optim.Optimizer):
    """Muon for the groups marked ``muon``, AdamW for the others: one optimizer, one schedule, one state.

    Args:
        groups: Parameter groups, each with ``muon`` (bool) and its own settings; see :func:`groups`.
    """

    def __init__(self, groups: Iterable[dict[str, Any]]) -> None:
        super().__init__(list(groups), {})
        self.sharding: Sharding | None = None
        self.owners: Owners = "replicated"
        """How :meth:`shard` gave the matrices owners."""
        self.timer: StepTimer | None = None
        """Where the step's ``NewtonSchulz`` and ``MuonComm`` go (the trainer's), or nowhere."""
        self.finished_elsewhere: frozenset[int] = frozenset()
        """The matrices (by ``id``) whose gradient holds their finished direction: their K-FAC layer's owner ran
        the momentum and Newton-Schulz and sent it (``optim.muon.owners=kfac``, :mod:`kfacflow.on_owners`)."""
        self.pending: dict[int, Tensor] = {}
        """Those owners' advanced momenta, kept by :meth:`step` only (a skipped step keeps the old ones)."""

    def shard(self, backend: Backend, how: Owners) -> None:
        """Give each matrix one owner on ``backend``'s ranks (:mod:`kfacflow.optim.sharding`); ``replicated``: none.

        Before :meth:`load_state_dict` (a resume keeps only what this rank owns). On one process, nothing.
        ``kfac``: placed until the K-FAC plan names its layers' owners (:meth:`Sharding.follow`).
        """
        self.owners = "replicated" if backend.world_size == 1 else how
        if how == "replicated" or backend.world_size == 1:
            self.sharding = None
            return
        self.sharding = self.sharded_by(backend, how)
        self._drop_unowned()

    def sharded_by(self, backend: Backend, how: Owners) -> Sharding:
        """Every Muon matrix's owner on ``backend``'s ranks by ``how``, weighed at the groups' Newton-Schulz steps."""
        steps = max((g["ns_steps"] for g in self.muon_groups()), default=5)
        return Sharding([p for g in self.muon_groups() for p in g["params"]], backend, how, steps)

    def muon_groups(self) -> list[dict[str, Any]]:
        """The groups Muon steps (the others are AdamW's)."""
        return [g for g in self.param_groups if g["muon"]]

    def _drop_unowned(self) -> None:
        if self.sharding is not None:
            for group in self.muon_groups():
                for p in group["params"]:
                    if not self.sharding.owns(p):
                        self.state.pop(p, None)

    def replicated_states(self) -> list[dict[str, Any]]:
        """The states every rank holds alike (:func:`kfacflow.running.consistency.check_replicas` repairs these).

        Sharded momenta are their owner's alone, and none is repaired from rank 0.
        """
        return [
            self.state[p]
            for g in self.param_groups
            if not (g["muon"] and self.sharding is not None)
            for p in g["params"]
            if p in self.state
        ]

    def state_dict(self) -> dict[str, Any]:  # noqa: D102 - torch.optim.Optimizer.state_dict
        """The whole state, every owner's momenta included (collective where sharded: every rank must call it)."""
        if self.sharding is None:
            return super().state_dict()
        borrowed = self._borrow_every_momentum()
        try:
            return super().state_dict()
        finally:
            for p in borrowed:
                del self.state[p]

    def unshard(self) -> None:
        """Every rank holds every momentum again and steps every matrix, as ``replicated`` (collective where sharded).

        For a Muon whose owners go away (:meth:`kfacflow.library.KFACPreconditioner.remove`): it steps on alone.
        """
        if self.sharding is None:
            return
        self._borrow_every_momentum()
        self.sharding, self.owners = None, "replicated"
        self.finished_elsewhere = frozenset()
        self.pending.clear()

    def _borrow_every_momentum(self) -> list[Tensor]:
        """Give this rank's state every owner's momentum (collective); returns the matrices it did not hold."""
        assert self.sharding is not None
        gathered: dict[int, Tensor] = {}
        for group in self.muon_groups():  # one exchange a group, as its steps: the momenta in its weights' dtype
            gathered.update(self.sharding.every_momentum(group["params"], self.state))
        matrices = [p for g in self.muon_groups() for p in g["params"]]
        borrowed = [p for p in matrices if id(p) in gathered and p not in self.state]
        for p in borrowed:
            self.state[p] = {"momentum_buffer": gathered[id(p)]}
        return borrowed

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # noqa: D102 - torch.optim.Optimizer
        """Load the whole state; where sharded, keep the momenta of the matrices this rank owns."""
        super().load_state_dict(state_dict)
        self._drop_unowned()

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # noqa: D102 - torch.optim.Optimizer.step
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            stepped = [p for p in group["params"] if p.grad is not None]
            for p in stepped:
                if p.grad.is_sparse:
                    raise RuntimeError("optim.name=muon does not take sparse gradients (nn.Embedding(sparse=True))")
            if group["muon"]:
                self._muon(stepped, group)
            else:
                for p in stepped:
                    self._adamw(p, group)
        return loss

    def _muon(self, params: list[Tensor], group: dict[str, Any]) -> None:
        """``torch.optim.Muon``'s step for a group's weights (matrices, or filters taken as one each).

        Where sharded, this rank's own matrices only, then every owner's directions gathered.
        """
        dtype = ns_dtype(group.get("ns_dtype", "auto"), group["params"][0])
        shard, elsewhere = self.sharding, self.finished_elsewhere
        lr = group["lr"]
        for p in (p for p in params if id(p) in elsewhere):
            assert p.grad is not None
            p.mul_(1 - lr * group["weight_decay"])
            p.add_(p.grad, alpha=-lr * shape_scale(p.shape, group["adjust_lr"]))
            if id(p) in self.pending:
                self.state[p]["momentum_buffer"] = self.pending.pop(id(p))
        params = [p for p in params if id(p) not in elsewhere]
        everyone = [p for p in group["params"] if id(p) not in elsewhere]
        mine = params if shard is None else [p for p in params if shard.owns(p)]
        with self._span("NewtonSchulz"):
            directions = self._directions(mine, group, dtype)
        if shard is None:
            stepped = list(zip(params, directions, strict=True))
        else:
            with self._span("MuonComm"):
                stepped = shard.exchange(everyone, dict(zip(map(id, mine), directions, strict=True)), dtype)
        for p, direction in stepped:
            p.mul_(1 - lr * group["weight_decay"])
            p.add_(direction, alpha=-lr * shape_scale(p.shape, group["adjust_lr"]))

    def _span(self, part: str) -> Any:
        return nullcontext() if self.timer is None else self.timer.span(part)

    def _directions(self, params: list[Tensor], group: dict[str, Any], dtype: torch.dtype) -> list[Tensor]:
        """The orthogonalised momentum of each of ``params``, its momentum buffer advanced."""
        if not params:
            return []
        momentum, updates = group["momentum"], []
        for p in params:
            assert p.grad is not None
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
            buf = state["momentum_buffer"]
            buf.lerp_(p.grad, 1 - momentum)
            updates.append(p.grad.lerp(buf, momentum) if group["nesterov"] else buf)
        batched = params[0].device.type == "cuda"
        return orthogonalised_together(updates, group["ns_steps"], dtype=dtype, batched=batched)

    def _adamw(self, p: Tensor, group: dict[str, Any]) -> None:
        """``torch.optim.AdamW``'s step for one parameter."""
        assert p.grad is not None
        grad, state = p.grad, self.state[p]
        if not state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["step"] += 1
        beta1, beta2 = group["betas"]
        lr, step = group["lr"], state["step"]
        p.mul_(1 - lr * group["weight_decay"])
        state["exp_avg"].lerp_(grad, 1 - beta1)
        state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        denom = (state["exp_avg_sq"].sqrt() / math.sqrt(1 - beta2**step)).add_(group["eps"])
        p.addcdiv_(state["exp_avg"], denom, value=-lr / (1 - beta1**step))


def groups(
    matrices: Sequence[nn.Parameter],
    rest: Sequence[nn.Parameter],
    lr: float,
    momentum: float,
    nesterov: bool,
    weight_decay: float,
    adjust_lr: str,
    ns_steps: int,
    ns_dtype: str,
    adamw_lr: float,
    betas: Sequence[float],
    eps: float,
    adamw_weight_decay: float,
) -> list[dict[str, Any]]:
    """The two parameter groups of :class:`Muon` (an empty one is left out)."""
    out = []
    if matrices:
        out.append(
            {
                "params": list(matrices),
                "muon": True,
                "lr": lr,
                "momentum": momentum,
                "nesterov": nesterov,
                "weight_decay": weight_decay,
                "adjust_lr": adjust_lr,
                "ns_steps": ns_steps,
                "ns_dtype": ns_dtype,
            }
        )
    if rest:
        out.append(
            {
                "params": list(rest),
                "muon": False,
                "lr": adamw_lr,
                "betas": tuple(betas),
                "eps": eps,
                "weight_decay": adamw_weight_decay,
            }
        )
    return out
