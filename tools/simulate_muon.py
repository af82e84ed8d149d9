"""Project Muon's step to P workers: Newton-Schulz replicated (torch.optim.Muon), round_robin or placed owners.

    python tools/simulate_muon.py resnet50 --image-size 32 --channels 3 --classes 10 \
        docs/results/projections/ib100_p64.yaml --workers 2,4,16,64 --tflops 10 --launch 2e-5
    python tools/simulate_muon.py resnet50 --image-size 32 --channels 3 --classes 10 profile.yaml --workers 2 \
        --measure --engine gloo --layers RUN/layers.json     # this CPU's Newton-Schulz, timed per shape

The matrices are those the optimizer gives Muon (:func:`kfacflow.optim.muon.split`, the head left to AdamW),
of the model built as a recipe builds it. A rank's Newton-Schulz is modelled (``--tflops``: the rate of
its products, ``--launch``: seconds a product costs besides its flops, same-shape matrices batched as the
step batches them on CUDA) or timed here (``--measure``: each shape once, in ``--dtype``, one at a time
as the step runs on CPU). ``--layers`` adds forward and backward from a traced step (scaled by
``--compute-scale``) and the gradient all-reduce DDP cannot hide behind the backward pass; without it
the table holds the optimizer's part alone. The model is :mod:`kfacflow.simulation.muon_owners`'s.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fastest import fastest  # noqa: E402 - tools/, beside this file
from simulate import traced  # noqa: E402  (the layer profiles, read and checked as simulate.py reads them)
from tool_args import count, counts, number  # noqa: E402

from kfacflow import UserError  # noqa: E402
from kfacflow.models.builtin import build_model  # noqa: E402
from kfacflow.optim import muon  # noqa: E402
from kfacflow.optim.sharding import Owners  # noqa: E402
from kfacflow.perf import Profile  # noqa: E402
from kfacflow.simulation.events import forward_backward  # noqa: E402
from kfacflow.simulation.muon_owners import MuonStep, NewtonSchulzModel, RankSeconds, Shape, measured, project  # noqa: E402

HOWS: tuple[Owners, ...] = ("replicated", "round_robin", "placed")
WIDTH = {"float32": 1.0, "bfloat16": 0.5}
"""Bytes of a direction's element over a float32 profile's."""
GATHERS = {"nccl": True, "gloo": True, "horovod": False}
"""``--engine``: whether it gathers to owners (:attr:`~kfacflow.comm.base.Backend.gathers`) or all-reduces."""


def timed(shapes: Sequence[Shape], steps: int, dtype: torch.dtype, reps: int) -> dict[Shape, float]:
    """The fastest of ``reps`` Newton-Schulz runs on a random matrix of each distinct shape (seconds)."""
    out = {}
    for shape in sorted(set(shapes)):
        update = torch.randn(shape)
        out[shape] = fastest(lambda: muon.orthogonalised(update, steps, dtype=dtype), reps)  # noqa: B023 - called here
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="a model's registry name (model.name), e.g. resnet50")
    p.add_argument("profile", help="performance profile (kfac.profile format) of the link")
    p.add_argument("--image-size", type=count(0, "32"), default=0)
    p.add_argument("--channels", type=count(1, "3"), default=3)
    p.add_argument("--classes", type=count(1, "10"), default=10)
    p.add_argument("--workers", type=counts(1, "2,4,16,64"), default="2,4,16,64")
    p.add_argument("--steps", type=count(1, "5"), default=5, help="Newton-Schulz iterations (optim.muon.ns_steps)")
    p.add_argument("--tflops", type=number(0, "10"), default=10.0, help="the products' rate, in TFLOP/s")
    p.add_argument("--launch", type=number(0, "2e-5", above=False), default=2e-5, help="seconds a product adds")
    p.add_argument("--measure", action="store_true", help="time each shape's Newton-Schulz here instead")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="with --measure")
    p.add_argument("--reps", type=count(1, "3"), default=3, help="with --measure: the fastest of these")
    p.add_argument("--engine", choices=sorted(GATHERS), default="nccl")
    p.add_argument(
        "--directions",
        choices=sorted(WIDTH),
        default=None,
        help="the gathered directions' dtype, the Newton-Schulz one (default: bfloat16 modelled, --dtype measured)",
    )
    p.add_argument("--layers", nargs="+", default=None, metavar="LAYERS_JSON", help="traced steps (their average)")
    p.add_argument("--compute-scale", type=number(0, "0.01"), default=1.0, help="multiply the traced times")
    p.add_argument("--markdown", action="store_true", help="also print the table as markdown")
    args = p.parse_args(argv)
    try:
        profile = Profile.load(args.profile)
        model = build_model(args.model, args.classes, args.channels, {}, args.image_size)
    except UserError as e:
        raise SystemExit(f"error: {e}") from None
    matrices, _ = muon.split(model, head=False)
    shapes: list[Shape] = [(p.shape[0], p[0].numel()) for p in matrices]
    seconds: RankSeconds
    if args.measure:
        seconds = measured(timed(shapes, args.steps, getattr(torch, args.dtype), args.reps))
    else:
        seconds = NewtonSchulzModel(args.launch, args.tflops * 1e12, args.steps)
    forward = backward = 0.0
    if args.layers:
        forward, backward = forward_backward(traced(args.layers, args.compute_scale, "--layers"))
    gradients = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print(f"{args.model}: {len(shapes)} Muon matrices, {sum(s[0] * s[1] for s in shapes) / 1e6:.2f} M elements")
    rows = [
        project(
            shapes,
            how,
            world,
            profile,
            seconds,
            steps=args.steps,
            forward=forward,
            backward=backward,
            gradients=gradients if args.layers else 0,
            gathers=GATHERS[args.engine],
            width=WIDTH[args.directions or (args.dtype if args.measure else "bfloat16")],
        )
        for world in args.workers
        for how in HOWS
    ]
    print(table(rows, markdown=False))
    if args.markdown:
        print(table(rows, markdown=True))
    return 0


def table(rows: list[MuonStep], markdown: bool) -> str:
    """Each projection in ms, and its step against the replicated one's at the same P."""
    head = ("P", "owners", "compute", "Newton-Schulz", "gather", "step", "vs replicated")
    base = {r.workers: r.total for r in rows if r.how == "replicated"}
    body = [
        (
            str(r.workers),
            r.how,
            *(f"{1e3 * t:.2f}" for t in (r.compute, r.newton_schulz, r.gather, r.total)),
            f"{r.total / base[r.workers]:.3f}x",
        )
        for r in rows
    ]
    if markdown:
        lines = [head, tuple("---" for _ in head), *body]
        return "\n".join("| " + " | ".join(cells) + " |" for cells in lines)
    return "\n".join("".join(f"{c:>15}" for c in cells) for cells in [head, *body])


if __name__ == "__main__":
    sys.exit(main())
