"""Time the factor products of a model as the factor stage computes them: whole, or the upper triangle in block rows.

    python tools/bench_gram.py digits_cnn --image-size 28 --channels 1 --batch 64
    python tools/bench_gram.py resnet18 resnet50 --image-size 32 --batch 32 --blocks 192,384,768
    python tools/bench_gram.py digits_cnn --image-size 28 --channels 1 --batch 64 --rows

For each model one forward and backward pass of ``--batch`` random images records the shape of every
preconditioned layer's row matrices (A: patches with the ones column, ``expand`` factors; G: output
gradients); each distinct shape is then timed on random data, ``pack(a.T @ a)`` against
:func:`~kfacflow.kfac.stages.factors.gram_packed` with block rows at most ``--blocks`` wide, one after the
other on the same matrix, the fastest of ``--reps`` each, and weighted by how many layers have it.
Prints the step's total for each and the ratio to the whole product; ``GRAM_BLOCK`` in
``kfacflow/kfac/stages/factors.py`` is chosen from this, on one thread (``--threads``) as the cluster
benchmarks run.

``--rows`` times instead the copy that comes before the product: every layer's rows (``a_rows``,
``g_rows``) of one real forward and backward pass, row-major against column-major where
:func:`~kfacflow.kfac.stages.factors.positions_inner` chooses it (the same values, checked), which is how
``POSITIONS_INNER_FROM`` is chosen.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fastest import fastest  # noqa: E402 - tools/, beside this file

from kfacflow.kfac.layers import find_layers  # noqa: E402
from kfacflow.kfac.packing import pack  # noqa: E402
from kfacflow.kfac.stages import factors  # noqa: E402
from kfacflow.kfac.stages.factors import ExpandFactors  # noqa: E402
from kfacflow.models.builtin import build_model, check_name  # noqa: E402


def one_pass(name: str, image_size: int, channels: int, batch: int) -> list[tuple[nn.Module, Tensor, Tensor]]:
    """Every preconditioned layer of ``name`` with its input and output gradient from one forward and backward pass."""
    check_name(name)
    model = build_model(name, 10, channels, image_size=image_size)
    inputs: dict[nn.Module, Tensor] = {}
    grads: dict[nn.Module, Tensor] = {}

    def hook(module: nn.Module, args: tuple[Tensor, ...], out: Tensor) -> None:
        inputs[module] = args[0].detach()
        out.register_hook(lambda g: grads.__setitem__(module, g))

    layers = [layer.module for layer in find_layers(model, [])]
    for module in layers:
        module.register_forward_hook(hook)
    model(torch.randn(batch, channels, image_size, image_size)).sum().backward()
    return [(module, inputs[module], grads[module]) for module in layers]


def shapes(name: str, image_size: int, channels: int, batch: int) -> Counter[tuple[int, int]]:
    """Return ``(rows, width)`` of every A and G row matrix of one step of ``name``, counted."""
    stage = ExpandFactors()
    seen: Counter[tuple[int, int]] = Counter()
    for module, x, g in one_pass(name, image_size, channels, batch):
        seen.update([tuple(stage.a_rows(module, x).shape), tuple(stage.g_rows(module, g).shape)])  # type: ignore[list-item]
    return seen


def row_copies(name: str, image_size: int, channels: int, batch: int, reps: int) -> None:
    """Print each Conv2d's row copies (A's patches, G's output gradients) timed row-major and as chosen."""
    stage = ExpandFactors()
    convs = [(m, x, g) for m, x, g in one_pass(name, image_size, channels, batch) if isinstance(m, nn.Conv2d)]
    copies: list[tuple[str, Callable[[], Tensor]]] = [
        *((f"A {tuple(x.shape)}", partial(stage.a_rows, m, x)) for m, x, _ in convs),
        *((f"G {tuple(g.shape)}", partial(stage.g_rows, m, g)) for m, _, g in convs),
    ]
    chosen = factors.POSITIONS_INNER_FROM
    total = [0.0, 0.0]
    for label, copy in copies:
        factors.POSITIONS_INNER_FROM = 2**62  # never column-major
        seconds, reference = [fastest(copy, reps, untimed=1)], copy()
        factors.POSITIONS_INNER_FROM = chosen
        seconds.append(fastest(copy, reps, untimed=1))
        assert torch.equal(copy(), reference), label  # the same values either way
        total = [t + s for t, s in zip(total, seconds, strict=True)]
        print(f"  {label:<22} row-major {seconds[0] * 1e3:7.2f} ms  as chosen {seconds[1] * 1e3:7.2f} ms")
    print(f"{name}: a step's rows: row-major {total[0] * 1e3:.1f} ms, as chosen {total[1] * 1e3:.1f} ms", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="+")
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--channels", type=int, default=3)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--blocks", default="128,256,384,512,768,1024", help="widest block rows to time")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", action="store_true", help="time the row copies instead of the products")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.rows:
        for name in args.models:
            row_copies(name, args.image_size, args.channels, args.batch, args.reps)
        return
    widths = [int(b) for b in args.blocks.split(",")]
    for name in args.models:
        counts = shapes(name, args.image_size, args.channels, args.batch)
        total: dict[str | int, float] = dict.fromkeys(["whole", *widths], 0.0)
        for (rows, width), count in sorted(counts.items(), key=lambda kv: -kv[0][0] * kv[0][1] ** 2):
            a = torch.randn(rows, width)
            line: dict[str | int, float] = {"whole": fastest(lambda: pack(a.T @ a), args.reps, untimed=1)}  # noqa: B023
            for block in widths:
                factors.GRAM_BLOCK = block
                line[block] = fastest(lambda: factors.gram_packed(a), args.reps, untimed=1)  # noqa: B023
            for key, seconds in line.items():
                total[key] += count * seconds
            ratios = " ".join(f"{b}:{line[b] / line['whole']:.2f}" for b in widths)
            print(f"  {rows:>7} x {width:<5} x{count:<3} whole {line['whole'] * 1e3:8.1f} ms   {ratios}")
        ratios = " ".join(f"{b}:{total[b] / total['whole']:.2f}" for b in widths)
        print(f"{name}: whole {total['whole'] * 1e3:.0f} ms a step   block rows at most  {ratios}", flush=True)


if __name__ == "__main__":
    main()
