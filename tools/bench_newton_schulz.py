"""Time Muon's Newton-Schulz over a model's matrices: each alone against those of one shape together.

    python tools/bench_newton_schulz.py vit --kwargs patch_size=7,dim=64,depth=4,heads=4,mlp_ratio=2 --image-size 28
    python tools/bench_newton_schulz.py resnet20 --channels 1 --image-size 28

The matrices are the model's Muon takes (:func:`~kfacflow.optim.muon.split`, the head left to AdamW),
random updates of their shapes; :func:`~kfacflow.optim.muon.orthogonalised` on each in turn and
:func:`~kfacflow.optim.muon.orthogonalised_together` on all are timed alternately, the fastest of
``--reps`` each, on ``--threads`` threads, in float32 as a CPU runs them (``--dtype bfloat16`` as a GPU).
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fastest import fastest  # noqa: E402 - tools/, beside this file
from tool_args import int_kwargs  # noqa: E402 - tools/, beside this file

from kfacflow.models.builtin import build_model  # noqa: E402
from kfacflow.optim import muon  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    """Print, for each model, its matrices' shapes and the two times in milliseconds."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="+")
    parser.add_argument(
        "--kwargs", type=int_kwargs, default={}, help="the model's keyword arguments, k=v,... (integers)"
    )
    parser.add_argument("--image-size", type=int, default=0)
    parser.add_argument("--channels", type=int, default=1)
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    for name in args.models:
        model = build_model(name, args.classes, args.channels, args.kwargs, args.image_size)
        matrices, _ = muon.split(model, head=False)
        updates = [torch.randn_like(p) for p in matrices]
        shapes = Counter((u.shape[0], u[0].numel()) for u in updates)

        def each_alone(us: list[torch.Tensor] = updates) -> object:
            return [muon.orthogonalised(u, dtype=dtype) for u in us]

        def one_shape_together(us: list[torch.Tensor] = updates) -> object:
            return muon.orthogonalised_together(us, dtype=dtype)

        alone = together = float("inf")
        for _ in range(2):  # alternate, so neither runs on a warmer machine
            alone = min(alone, fastest(each_alone, args.reps))
            together = min(together, fastest(one_shape_together, args.reps))
        print(f"{name}: {len(updates)} matrices in {len(shapes)} shapes {dict(shapes)}")
        print(f"  each alone {alone * 1e3:.2f} ms, one shape together {together * 1e3:.2f} ms: {together / alone:.2f}x")


if __name__ == "__main__":
    main()
