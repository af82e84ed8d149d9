"""Time a step's forward and backward pass without factors: K-FAC's hooks taken off, against kept on and idle.

    python tools/bench_hooks.py vit --kwargs patch_size=7,dim=64,depth=4,heads=4,mlp_ratio=2 --image-size 28
    python tools/bench_hooks.py resnet20 --channels 1 --image-size 28

A steps-without-factors pass (``kfac.factor_update_freq`` > 1) runs the model with no K-FAC hook on
it (:mod:`kfacflow.kfac.hooks.switch`); before, the hooks stayed registered and returned at once. Both
are timed here on one process, alternately, ``--reps`` pairs: the fastest of each, and the median of the
pairs' ratios (the machine's drifts hit both of a pair alike). A preconditioner over
the model (every kind of layer it takes, the norms too) is built, one factor step taken, and then the
pass timed with the hooks off, and with them put back while the step makes no factors.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tool_args import int_kwargs  # noqa: E402 - tools/, beside this file

from kfacflow.comm.torch_dist import TorchBackend  # noqa: E402
from kfacflow.configuration.schema import DistConfig, KFACConfig  # noqa: E402
from kfacflow.models.builtin import build_model  # noqa: E402
from kfacflow.running import build  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    """Print the pass's milliseconds both ways and their ratio."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument(
        "--kwargs", type=int_kwargs, default={}, help="the model's keyword arguments, k=v,... (integers)"
    )
    parser.add_argument("--channels", type=int, default=1)
    parser.add_argument("--image-size", type=int, default=28)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = build_model(args.model, 10, args.channels, args.kwargs, args.image_size)
    os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29531"})
    backend = TorchBackend(DistConfig(device="cpu"))
    kinds = ["linear", "conv2d", "norm"]
    pre = build.preconditioner(model, KFACConfig(kinds=kinds, factor_update_freq=1000, inv_update_freq=1000), backend)
    x = torch.randn(args.batch, args.channels, args.image_size, args.image_size)
    y = torch.randint(0, 10, (args.batch,))

    def step() -> None:
        model.zero_grad()
        out = model(x)
        pre.end_forward()
        F.cross_entropy(out, y).backward()
        pre.step(lr=0.1)

    step()  # the factor step: the layers' uses learnt, every factor and inverse made
    hooks = pre.capture.hooks
    best = {"off": float("inf"), "kept": float("inf")}
    ratios = []
    for _ in range(args.reps):
        pair = {}
        for way in best:
            if way == "off":
                hooks.on = True
                hooks.switch(False)
            else:  # registered, but the step makes no factors: each returns at once, as they used to
                hooks.switch(True)
                hooks.on = False
            start = time.perf_counter()
            model.zero_grad()
            F.cross_entropy(model(x), y).backward()
            pair[way] = time.perf_counter() - start
            best[way] = min(best[way], pair[way])
        ratios.append(pair["kept"] / pair["off"])
    print(
        f"{args.model}: forward+backward {best['off'] * 1e3:.2f} ms without K-FAC's hooks, {best['kept'] * 1e3:.2f} ms "
        f"with its {hooks.registered()} hooks kept idle (fastest {best['kept'] / best['off']:.3f}x, "
        f"median of {args.reps} pairs {statistics.median(ratios):.3f}x)"
    )


if __name__ == "__main__":
    main()
