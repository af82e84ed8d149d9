"""Time applying a layer's two damped inverses kept as Cholesky factors: two triangular solves each side, or products.

    python tools/bench_apply.py                           # the small CNN's and ResNet-50's shapes
    python tools/bench_apply.py --shapes 64x513,512x4608 --threads 2

For each ``g x a`` gradient, ``G^-1 grad A^-1`` by :class:`~kfacflow.kfac.stages.inverse.CholeskyFactorInverse`'s
solves, by the explicit inverses it forms where a period repays them (:meth:`~kfacflow.kfac.stages.inverse.
CholeskyFactorInverse.for_uses`), and what forming both explicit inverses costs; the fastest of ``--reps`` each,
alternated, in float32 on ``--threads`` threads. ``repaid after`` is the applications that make up the forming:
what :data:`~kfacflow.kfac.stages.inverse.EXPLICIT_UP_TO` and ``EXPLICIT_FROM_USES`` are read from.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fastest import fastest  # noqa: E402 - tools/, beside this file
from tool_args import count  # noqa: E402 - tools/, beside this file

from kfacflow.kfac.stages.inverse import CholeskyFactorInverse, explicit_inverse  # noqa: E402

SHAPES = "16x10,32x145,64x513,10x65,128x1153,256x2304,512x4608"
"""The small CNN's four layers (``g x a``: outputs x inputs with the bias), then ResNet-50-sized ones."""


def shapes(text: str) -> list[tuple[int, int]]:
    """An argparse type: ``g x a`` pairs, ``16x10,64x513``."""
    try:
        pairs = [tuple(int(n) for n in item.split("x")) for item in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give g x a pairs of whole numbers, e.g. 16x10,64x513") from None
    if any(len(p) != 2 or min(p) < 1 for p in pairs):
        raise argparse.ArgumentTypeError(f"{text!r}: give g x a pairs of positive numbers, e.g. 16x10,64x513")
    return [(p[0], p[1]) for p in pairs]


def _factor(d: int, seed: int) -> CholeskyFactorInverse:
    b = torch.randn(d, d + 8, generator=torch.Generator().manual_seed(seed))
    return CholeskyFactorInverse(torch.linalg.cholesky(b @ b.T / (d + 8) + 0.1 * torch.eye(d)).contiguous())


def _row(g: int, a: int, reps: int) -> tuple[float, float, float]:
    """Seconds to precondition a ``g x a`` gradient by the solves, by the products, and to form both inverses."""
    g_inv, a_inv = _factor(g, 1), _factor(a, 2)
    grad = torch.randn(g, a)
    g_exp, a_exp = explicit_inverse(g_inv.matrix), explicit_inverse(a_inv.matrix)
    t_solve = t_product = float("inf")
    for _ in range(2):  # alternate, so neither runs on a warmer machine
        t_solve = min(t_solve, fastest(lambda: g_inv.left(a_inv.right(grad)), reps))
        t_product = min(t_product, fastest(lambda: g_exp @ grad @ a_exp, reps))
    t_form = fastest(lambda: (explicit_inverse(g_inv.matrix), explicit_inverse(a_inv.matrix)), max(1, reps // 2))
    return t_solve, t_product, t_form


def main(argv: list[str] | None = None) -> None:
    """Print, for each shape, the two ways' milliseconds, the forming's and the applications that repay it."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", type=shapes, default=shapes(SHAPES), help=f"g x a pairs (default {SHAPES})")
    parser.add_argument("--reps", type=count(1, "5"), default=5)
    parser.add_argument("--threads", type=count(1, "1"), default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"{'g x a':>12} {'solves ms':>10} {'products ms':>12} {'forming ms':>11} {'repaid after':>13}")
    for g, a in args.shapes:
        t_solve, t_product, t_form = _row(g, a, args.reps)
        gain = t_solve - t_product
        repaid = f"{t_form / gain:.1f}" if gain > 0 else "never"
        print(f"{f'{g}x{a}':>12} {t_solve * 1e3:10.3f} {t_product * 1e3:12.3f} {t_form * 1e3:11.2f} {repaid:>13}")


if __name__ == "__main__":
    main()
