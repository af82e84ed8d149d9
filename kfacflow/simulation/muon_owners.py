"""Muon's step projected to P workers: every matrix's Newton-Schulz on every worker, or each on its owner.

``optim.muon.owners`` (:mod:`kfacflow.optim.sharding`) trades Newton-Schulz work for one gather:
replicated, every worker orthogonalises every matrix (``torch.optim.Muon``); ``round_robin`` or
``placed``, each matrix on its owner, then every owner's finished directions (a flag and the matrix
per matrix, in the Newton-Schulz dtype) gathered to every rank. The projection places the matrices with
the optimizer's own :func:`~kfacflow.optim.sharding.place` (by Newton-Schulz flops, as the trainer
does), charges the busiest owner's Newton-Schulz, and the gather by the engine's route: NCCL's two
steps to and from owners (:func:`kfacflow.comm.scatter.cost` on the broadcast model), or, on an
engine that does not gather (gloo), one all-reduce of the zero-filled buffer. Communication is
re-scaled to P with the ring model (:func:`kfacflow.simulation.events.scaled`); compute per worker
does not change with P (weak scaling). Forward and backward, with the gradient all-reduce hidden
behind the backward pass as far as it lasts, are the same for every choice of owners.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from kfacflow.comm import scatter
from kfacflow.optim.sharding import Owners, ns_flops, place
from kfacflow.perf import Profile
from kfacflow.simulation.events import scaled

Shape = tuple[int, ...]
RankSeconds = Callable[[Sequence[Shape]], float]
"""Seconds one rank takes to orthogonalise these matrices."""


@dataclass(frozen=True)
class NewtonSchulzModel:
    """Seconds of a rank's Newton-Schulz: each product's launch, and its flops at a rate.

    ``batched``: matrices of one shape go as one batched product (the step's way on CUDA), so a
    shape pays its launches once, however many matrices have it.
    """

    launch: float
    flops_per_s: float
    steps: int = 5
    batched: bool = True

    def __call__(self, shapes: Sequence[Shape]) -> float:
        """Seconds of ``shapes``' Newton-Schulz on one rank."""
        launches = len(set(shapes)) if self.batched else len(shapes)
        flops = sum(ns_flops(s, self.steps) for s in shapes)
        return 3 * self.steps * self.launch * launches + flops / self.flops_per_s


def measured(seconds: dict[Shape, float]) -> RankSeconds:
    """A rank's Newton-Schulz as the sum of each matrix's measured seconds (one at a time, the step's way on CPU)."""
    return lambda shapes: sum(seconds[s] for s in shapes)


@dataclass(frozen=True)
class MuonStep:
    """One projected step, in seconds.

    ``compute``: forward and backward with the exposed gradient all-reduce; ``newton_schulz``: the busiest
    rank's; ``gather``: the directions'.
    """

    how: str
    workers: int
    compute: float
    newton_schulz: float
    gather: float

    @property
    def total(self) -> float:
        """The whole step."""
        return self.compute + self.newton_schulz + self.gather


def project(
    shapes: Sequence[Shape],
    how: Owners,
    workers: int,
    profile: Profile,
    seconds: RankSeconds,
    *,
    steps: int = 5,
    forward: float = 0.0,
    backward: float = 0.0,
    gradients: int = 0,
    gathers: bool = True,
    width: float = 1.0,
) -> MuonStep:
    """Muon's step on ``workers`` ranks with ``how`` owners, for matrices of ``shapes``.

    ``forward``, ``backward``: a worker's seconds; ``gradients``: the elements DDP all-reduces;
    ``gathers``: whether the engine gathers to owners (NCCL) or all-reduces a zero-filled buffer (gloo);
    ``width``: the directions' bytes an element over the profile's (0.5: bfloat16, the step's on a GPU, on a
    float32 profile).
    """
    link = scaled(profile, workers) if workers > 1 else profile
    exposed = max(0.0, link.allreduce(gradients) - backward) if workers > 1 and gradients else 0.0
    compute = forward + backward + exposed
    if how == "replicated" or workers == 1:
        return MuonStep(how, workers, compute, seconds(shapes), 0.0)
    owners = place(shapes, workers, how, steps)
    mine: list[list[Shape]] = [[] for _ in range(workers)]
    for shape, rank in zip(shapes, owners, strict=True):
        mine[rank].append(shape)
    counts = [sum(1 + math.prod(s) for s in ss) for ss in mine]
    carrier = link.broadcast if gathers else link.allreduce
    carrier = replace(carrier, beta=width * carrier.beta)
    gather = scatter.cost(carrier, counts) if gathers else carrier(sum(counts))
    return MuonStep(how, workers, compute, max(seconds(ss) for ss in mine), gather)
