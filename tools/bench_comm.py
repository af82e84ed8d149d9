"""Time the ways one buffer's pieces can reach their owners on this engine, at P = 2 and up.

``python tools/cluster.py --nodes 2 --threads 1 -- tools/bench_comm.py [--mb 51] [--reps 3]``

K-FAC's owners each need a different piece of a buffer (the gradients of their layers) and then
send every rank their piece of another (the layers' updates). Which collective moves that in the
fewest seconds depends on the engine, not only on the bytes: gloo's reduce-scatter takes as long as
its all-reduce, while sending each piece straight to its owner moves half the bytes at P = 2. Each
line is the best of ``--reps`` timed runs (after one untimed), all ranks starting together:

- ``all-reduce``: the whole buffer, every rank receiving the sum;
- ``reduce-scatter``: each rank receiving the sum of its equal piece;
- ``reduce to rank 0``: the sum on one rank;
- ``all-to-all``: each rank sending every other its equal piece, in one collective and in 32 pieces;
- ``to owners (point to point)``: :meth:`~kfacflow.comm.torch_dist.TorchBackend.reduce_to_owners_async`,
  each rank sending the pieces it does not own straight to their owners (gloo);
- ``broadcast``: the whole buffer from rank 0, and each rank's piece from its owner, all at once;
- ``all-gather``: each rank's piece to every rank.

Prints one line per collective (seconds, and GB/s of the buffer's size) and, with ``--json``, a JSON
object of the seconds on rank 0.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from kfacflow.comm.torch_dist import TorchBackend  # noqa: E402
from kfacflow.configuration.schema import DistConfig  # noqa: E402


def collectives(backend: TorchBackend, elements: int) -> dict[str, Callable[[], object]]:
    """Each way of moving a buffer of ``elements`` float32 values, as a call that returns once it is done."""
    world, rank = backend.world_size, backend.rank
    piece = elements // world
    x = torch.ones(piece * world)
    mine, out = torch.ones(piece), torch.empty(piece * world)
    parts = list(x.split(piece * world // 32 or 1))
    counts = [piece] * world

    def all_to_all_pieces() -> None:
        works = [dist.all_to_all_single(torch.empty_like(p), p, async_op=True) for p in parts if p.numel() % world == 0]
        for work in works:
            assert work is not None
            work.wait()

    def broadcast_pieces() -> None:
        works = [dist.broadcast(x[r * piece : (r + 1) * piece], r, async_op=True) for r in range(world)]
        for work in works:
            assert work is not None
            work.wait()

    return {
        "all-reduce": lambda: dist.all_reduce(x),
        "reduce-scatter": lambda: dist.reduce_scatter_single(mine, x),
        "reduce to rank 0": lambda: dist.reduce(x, 0),
        "all-to-all": lambda: dist.all_to_all_single(out, x),
        "all-to-all, 32 pieces": all_to_all_pieces,
        "to owners (point to point)": lambda: backend.reduce_to_owners_async(x, counts).wait(),
        "broadcast": lambda: dist.broadcast(x, 0),
        "broadcast, each piece from its owner": broadcast_pieces,
        "all-gather": lambda: dist.all_gather_single(out, x[rank * piece : (rank + 1) * piece]),
    }


def measure(backend: TorchBackend, elements: int, reps: int) -> dict[str, float]:
    """The best of ``reps`` timed runs of each collective (after one untimed), every rank starting together."""
    seconds = {}
    for name, run in collectives(backend, elements).items():
        run()
        best = float("inf")
        for _ in range(reps):
            dist.barrier()
            start = time.perf_counter()
            run()
            best = min(best, time.perf_counter() - start)
        seconds[name] = best
    return seconds


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=float, default=51.2, help="buffer size in MB (default 51.2: ResNet-50's gradients / 2)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--json", action="store_true", help="also print the seconds as one JSON object")
    args = p.parse_args(argv)
    backend = TorchBackend(DistConfig(device="cpu", engine="gloo"))
    if backend.world_size < 2:
        raise SystemExit("bench_comm.py: run it on 2 or more ranks (tools/cluster.py, or torchrun --nproc-per-node 2)")
    try:
        elements = int(args.mb * 1e6 / 4)
        seconds = measure(backend, elements, args.reps)
        if backend.rank == 0:
            size = elements * 4
            print(f"{backend.world_size} ranks, {size / 1e6:.1f} MB of float32, best of {args.reps}")
            for name, s in seconds.items():
                print(f"{name:<40} {s:8.3f} s  {size / s / 1e9:6.3f} GB/s")
            if args.json:
                print(json.dumps(seconds))
    finally:
        backend.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
