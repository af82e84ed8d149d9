"""K-FAC + Muon with Muon's per-layer work on the K-FAC layer's owner (``optim.muon.owners=kfac``).

Replicated, every rank receives each owner's preconditioned update, scales it (KL clipping), clips
the gradients' norm (``optim.clip_grad_norm``), then advances every matrix's momentum and runs every
Newton-Schulz. Here the owner does that for its layers inside the update broadcast's walk and sends
the finished direction in the update's place (its bias column, AdamW's, as the scaled update): every
rank applies the same bits, and each Newton-Schulz runs once. What the owner needs of all layers
comes first, in float64 slots of one all-reduce each: every sent layer's ``v.g`` (the KL clipping's
factor) and, where the norm is clipped, every sent layer's squared norm. The momentum each owner
advances is kept only by :meth:`kfacflow.optim.muon.Muon.step` (a skipped step keeps the old one), and
the momenta follow the plan's owners when they change (:meth:`kfacflow.optim.sharding.Sharding.follow`).

The step is the replicated K-FAC + Muon's: the same operations on the same values, the norm summed
in float64 rather than ``torch.nn.utils.clip_grad_norm_``'s float32 (a difference of round-off).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from kfacflow import UserError
from kfacflow.comm.base import Piece
from kfacflow.kfac.layers import KFACLayer
from kfacflow.kfac.stages.contracts import EVERY_RANK
from kfacflow.kfac.strategies.update_broadcast import UpdateBroadcast
from kfacflow.optim.muon import Muon, ns_dtype, orthogonalised

if TYPE_CHECKING:
    from kfacflow.comm.base import Backend
    from kfacflow.kfac.preconditioner import Preconditioner
    from kfacflow.kfac.stages.contracts import PreconditionStage
    from kfacflow.kfac.variants import Stages
    from kfacflow.timing import StepTimer


UPDATES = ("update", "fused_update")
"""The broadcasts whose layer owners send the update (:mod:`kfacflow.kfac.strategies.update_broadcast`)."""


def whole_matrix(layer: KFACLayer, matrices: set[int]) -> bool:
    """Whether ``layer``'s gradient matrix is one whole Muon matrix (and its bias): only such can its owner finish."""
    weight = getattr(layer.module, "weight", None)
    if type(layer) is not KFACLayer or layer.embedding or not isinstance(weight, Tensor) or id(weight) not in matrices:
        return False
    return layer.g_dim == weight.shape[0] and layer.a_dim == weight[0].numel() + int(layer.has_bias)


class OwnedMuon:
    """Muon's momentum and Newton-Schulz of each K-FAC layer on the layer's owner, inside the update broadcast.

    Args:
        optimizer: The run's Muon, sharded (``optim.muon.owners=kfac``): it applies the directions.
        layers: The preconditioner's layers; those that are one whole Muon matrix are finished on their owners.
        params: Every trained parameter of the model (the norm clipping reads those K-FAC does not touch).
        preconditioned: Every parameter K-FAC writes the update of: its layers' and its side blocks'.
        backend: The engine (the slots' all-reduces).
        clip_norm: ``optim.clip_grad_norm`` (0: off): clipped here, since no rank holds every update.
        timer: The step's breakdown (the owners' work is ``NewtonSchulz``).
    """

    def __init__(
        self,
        optimizer: Muon,
        layers: Sequence[KFACLayer],
        params: Sequence[Tensor],
        preconditioned: Sequence[Tensor],
        backend: Backend,
        clip_norm: float,
        timer: StepTimer,
    ) -> None:
        if optimizer.sharding is None:
            raise ValueError("OwnedMuon needs a sharded Muon (Muon.shard(backend, 'kfac'))")
        self.muon, self.backend, self.clip_norm, self.timer = optimizer, backend, clip_norm, timer
        self.matrices = [p for g in optimizer.muon_groups() for p in g["params"]]
        group_of = {id(p): g for g in optimizer.muon_groups() for p in g["params"]}
        finishable = [layer for layer in layers if whole_matrix(layer, set(group_of))]
        self.layers = {layer.name: layer for layer in finishable}
        self.groups = {layer.name: group_of[id(layer.module.weight)] for layer in finishable}
        self.preconditioned = {id(p) for p in preconditioned}
        self.params = list(params)
        self.directed: set[str] = set()
        """This step's layers finished on their owners (every rank names the same)."""
        self.lr = 0.0
        self.stage: PreconditionStage | None = None
        self.side_pairs: list[tuple[Tensor, Tensor]] = []
        self.contributions: list[Tensor] = []
        self.coef: Tensor | None = None
        self.finals: dict[str, Tensor] = {}
        """This rank's own sent layers' updates after the stage's finish (scaled), until :meth:`finish` takes them."""

    def prepare(self, lr: float, stage: PreconditionStage, side_pairs: list[tuple[Tensor, Tensor]]) -> None:
        """Take what the step's scaling needs before the walk (the side blocks' updates are every rank's)."""
        self.lr, self.stage, self.side_pairs = lr, stage, side_pairs
        self.coef, self.contributions, self.finals = None, [], {}

    def begin(self, owner: dict[str, int], live: Sequence[str]) -> None:
        """Name this step's owners of the finished layers; move the momenta where the plan moved (collective)."""
        owned = {n: r for n, r in owner.items() if n in self.layers and r != EVERY_RANK}
        by_id = {id(self.layers[n].module.weight): r for n, r in owned.items()}
        assert self.muon.sharding is not None
        self.muon.sharding.follow(by_id, self.matrices, self.muon.state)
        self.muon.finished_elsewhere = frozenset(by_id)
        self.muon.pending.clear()
        self.directed = {n for n in live if n in owned}

    def settle(
        self,
        contributions: list[Tensor],
        updates: dict[str, Tensor],
        sent: Sequence[str],
        owner: dict[str, int],
    ) -> None:
        """Fix the step's factors from every layer's contribution: the KL clipping's and the norm clip's (collective).

        ``contributions``: each live layer's, in the walk's order (the side blocks' are added here);
        ``updates``: this rank's (its own layers' and every rank's); ``sent``: the layers owners send.
        """
        stage = self.stage
        assert stage is not None
        if stage.clips:
            contributions = [*contributions, *(stage.contribution(v, g) for v, g in self.side_pairs)]
        self.contributions = contributions
        rank, clips_norm = self.backend.rank, self.clip_norm > 0
        # the norm clip reads every final update; without it only the owners' finished layers are needed now
        mine = [n for n in sent if owner[n] == rank and (clips_norm or n in self.directed)]
        local = [n for n in updates if n not in sent] if clips_norm else []
        sides = [v for v, _ in self.side_pairs] if clips_norm else []
        finals = self._scaled_all([updates[n] for n in [*mine, *local]] + sides)
        self.finals = dict(zip(mine, finals, strict=False))
        if not clips_norm:
            return
        slots = torch.zeros(len(sent), dtype=torch.float64, device=self.backend.device)
        for i, name in enumerate(sent):
            if name in self.finals:
                slots[i] = _squared(self.finals[name])
        if sent and self.backend.world_size > 1:
            slots = Piece(self.backend.allreduce_async(slots), slots).wait()  # x + 0 == x: the owners' bits
        plain = [p.grad for p in self.params if p.grad is not None and id(p) not in self.preconditioned]
        others = sum((_squared(t) for t in [*finals[len(mine) :], *plain]), torch.zeros((), dtype=torch.float64))
        self.coef = (self.clip_norm / ((slots.sum() + others).sqrt() + 1e-6)).clamp(max=1.0)

    def finish(self, name: str) -> Tensor:
        """The owner's part: the layer's scaled, clipped update into the momentum, orthogonalised; what it sends."""
        layer, group = self.layers[name], self.groups[name]
        weight = layer.module.weight
        assert isinstance(weight, Tensor)
        with self.timer.span("NewtonSchulz", name, "muon"):
            final = self.finals.pop(name)
            if self.coef is not None:
                final = final * self.coef.to(final.dtype)
            # contiguous, as the replicated step's gradient is: the same kernels on the same values
            grad = (final[:, :-1] if layer.has_bias else final).reshape(weight.shape).contiguous()
            state = self.muon.state.get(weight, {})
            momentum = group["momentum"]
            held = state.get("momentum_buffer")
            buf = torch.zeros_like(grad).lerp_(grad, 1 - momentum) if held is None else held.lerp(grad, 1 - momentum)
            self.muon.pending[id(weight)] = buf
            ahead = grad.lerp(buf, momentum) if group["nesterov"] else buf
            dtype = ns_dtype(group.get("ns_dtype", "auto"), weight)
            direction = orthogonalised(ahead, group["ns_steps"], dtype=dtype).to(final.dtype)
            flat = direction.reshape(final.shape[0], -1)
            return torch.cat([flat, final[:, -1:]], dim=1) if layer.has_bias else flat.contiguous()

    def clip_rest(self, finished: set[str]) -> None:
        """Clip every gradient the owners did not finish (the norm clip's factor, as ``clip_grad_norm_`` applies it)."""
        if self.coef is None:
            return
        done = {id(p) for n in finished for p in self.layers[n].params}
        for p in self.params:
            if p.grad is not None and id(p) not in done:
                p.grad.mul_(self.coef.to(p.grad.dtype))

    def _scaled_all(self, updates: list[Tensor]) -> list[Tensor]:
        assert self.stage is not None
        return self.stage.finish(updates, self.contributions, self.lr) if updates else []


def _squared(t: Tensor) -> Tensor:
    return torch.sum(t.to(torch.float64) ** 2)


def trained(model: nn.Module) -> list[Tensor]:
    """The model's trained parameters (those the norm clip reads)."""
    return [p for p in model.parameters() if p.requires_grad]


def check(owners: str, names: Stages) -> None:
    """Refuse ``optim.muon.owners=kfac`` where no K-FAC layer owner sends its update (before any worker starts).

    Raises:
        UserError: Naming the key and what to set instead.
    """
    if owners == "kfac" and not sends_updates(names):
        raise UserError(
            "optim.muon.owners=kfac: the K-FAC layers' owners finish Muon's step only where they send the "
            f"updates (kfac.variant=flow, or kfac.broadcast={' or '.join(UPDATES)}, not kfac.variant=auto or sgd; "
            f"this run's kfac.broadcast is {names.broadcast}); use optim.muon.owners=placed."
        )


def sends_updates(names: Stages) -> bool:
    """Whether K-FAC's layer owners send the updates for the whole run (not where ``kfac.variant=auto`` may change)."""
    return names.preconditioned and names.broadcast in UPDATES and not names.choose


def attach(
    kfac: Preconditioner | None, optimizer: torch.optim.Optimizer, model: nn.Module, clip_norm: float = 0.0
) -> OwnedMuon | None:
    """Let ``kfac``'s layer owners finish ``optimizer``'s Muon step of their layers (the trainer's call).

    Only where ``optimizer`` is a :class:`~kfacflow.optim.muon.Muon` sharded ``kfac`` (``optim.muon.owners=kfac``;
    else nothing, None: one process never shards). ``clip_norm``: the gradients' norm bound
    (``optim.clip_grad_norm``), which the step then applies in place of ``torch.nn.utils.clip_grad_norm_``.
    Call it before the first step, on every rank.

    Raises:
        ValueError: If ``kfac``'s owners do not send updates (a recipe's is refused before: :func:`check`).
    """
    if kfac is None or not isinstance(optimizer, Muon) or optimizer.owners != "kfac":
        return None
    if not isinstance(kfac.stages.broadcast, UpdateBroadcast):
        raise ValueError("optim.muon.owners=kfac needs a K-FAC whose layer owners send the updates")
    written = [p for layer in kfac.layers for p in layer.params] + kfac.sides.params
    owned = OwnedMuon(optimizer, kfac.layers, trained(model), written, kfac.backend, clip_norm, kfac.timer)
    kfac.updates.owned = owned
    return owned
