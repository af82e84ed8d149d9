"""One hand-written DDP training loop, preconditioned by kfacflow, by kfac-pytorch or by nothing: libraries compared.

    torchrun --nproc-per-node 2 tools/bench_loop.py --library kfac-pytorch --strategy mem-opt --method inverse \\
        recipes/resnet18_synthetic.yaml kfac.inv_update_freq=10 train.steps=20
    python tools/bench.py recipes/resnet18_synthetic.yaml --ablation libraries --intervals 1/10 --cluster

The model, data, batch, seed, optimizer and K-FAC hyperparameters come from the recipe and its
overrides (``model.name``, ``data.*``, ``optim.*``, ``kfac.damping``, ``kfac.factor_decay``,
``kfac.kl_clip``, ``kfac.factor_update_freq``, ``kfac.inv_update_freq``, ``kfac.skip``), so a
library is timed on exactly what ``run.py`` trains. The loop is what a user writes around a
K-FAC library (kfac-pytorch's own CIFAR-10 example, less its logging): forward, loss, backward
under DDP, the preconditioner's ``step()``, the optimizer's; the learning rate stays at
``optim.lr``. ``--library kfacflow`` is ``kfacflow.KFACPreconditioner`` with every ``kfac.*`` key
of the recipe, on the model unwrapped (kfacflow averages the gradients after the factors, as its
recipes do), so the same loop times both libraries; ``--library sgd`` is the loop without one.

Each step is timed from the batch on the device to the cleared gradients (a CUDA device is
synchronized there): ``run.py``'s step timer also counts the batch's copy to the device (nothing on
the CPU) and its per-step checks; rank 0 writes one ``{"step",
"total"}`` line per step to ``timings.jsonl`` in ``out_dir/name/<timestamp>/``, where
``tools/bench.py`` reads it, and prints the mean after ``train.timing_warmup`` steps.

kfac-pytorch (github.com/gpauloski/kfac-pytorch, MIT) is not a dependency of kfacflow:
``pip install kfac-pytorch``, or a checkout of it on ``PYTHONPATH``. ``--strategy`` is its
``grad_worker_fraction`` (``comm-opt``: every rank preconditions every layer from broadcast
second-order results; ``mem-opt``: each layer on its owner alone, whose gradient is broadcast;
``hybrid-opt``: half the ranks), ``--method`` its ``compute_method`` (``eigen``, its default, or
``inverse``), ``--symmetry-aware`` its ``symmetry_aware`` (factors sent as upper triangles; off by
default).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kfacflow import UserError  # noqa: E402
from kfacflow.configuration import recipe  # noqa: E402
from kfacflow.data.checks import cross_entropy  # noqa: E402
from kfacflow.data.sets import build_datasets  # noqa: E402
from kfacflow.models.builtin import build_model  # noqa: E402
from kfacflow.optim.optimizers import build_optimizer  # noqa: E402
from kfacflow.running import rundir  # noqa: E402

LIBRARIES = ("sgd", "kfacflow", "kfac-pytorch")
STRATEGIES = {"comm-opt": "COMM_OPT", "mem-opt": "MEM_OPT", "hybrid-opt": "HYBRID_OPT"}
OWN_KEYS = ("variant", "profile", "damping", "factor_update_freq", "inv_update_freq")
"""kfacflow's ``kfac.*`` keys that KFACPreconditioner takes as named arguments, not as ``**kfac``."""


def parse(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--library", choices=LIBRARIES, default="kfac-pytorch")
    p.add_argument("--strategy", choices=sorted(STRATEGIES), default="comm-opt", help="kfac-pytorch's distribution")
    p.add_argument("--method", choices=["eigen", "inverse"], default="eigen", help="kfac-pytorch's compute_method")
    p.add_argument(
        "--symmetry-aware", action="store_true", help="kfac-pytorch sends the factors' upper triangles (symmetry_aware)"
    )
    p.add_argument("recipe")
    args, rest = p.parse_known_args(argv)
    for bad in (r for r in rest if r.startswith("-")):
        p.error(f"unknown option {bad}")
    return args, rest


def kfac_pytorch(net: torch.nn.Module, cfg: Any, args: argparse.Namespace) -> Any:
    """kfac-pytorch's KFACPreconditioner on ``net`` with the recipe's hyperparameters."""
    try:
        import kfac
    except ImportError:
        raise UserError(
            "--library kfac-pytorch: kfac-pytorch is not importable; pip install kfac-pytorch, or put a checkout "
            "of github.com/gpauloski/kfac-pytorch on PYTHONPATH."
        ) from None
    k = cfg.kfac
    return kfac.preconditioner.KFACPreconditioner(
        net,
        factor_update_steps=k.factor_update_freq,
        inv_update_steps=k.inv_update_freq,
        damping=k.damping,
        factor_decay=k.factor_decay,
        kl_clip=k.kl_clip,
        lr=cfg.optim.lr,
        compute_method=kfac.enums.ComputeMethod[args.method.upper()],
        grad_worker_fraction=kfac.enums.DistributedStrategy[STRATEGIES[args.strategy]],
        skip_layers=list(k.skip),
        symmetry_aware=args.symmetry_aware,
    )


def kfacflow_preconditioner(model: torch.nn.Module, cfg: Any, device: torch.device) -> Any:
    """kfacflow's KFACPreconditioner with every ``kfac.*`` key of the recipe."""
    from kfacflow import KFACPreconditioner

    k = OmegaConf.to_container(cfg.kfac, resolve=True)
    assert isinstance(k, dict)
    rest = {str(key): value for key, value in k.items() if key not in OWN_KEYS}
    return KFACPreconditioner(
        model,
        variant=k["variant"],
        lr=cfg.optim.lr,
        damping=k["damping"],
        factor_update_freq=k["factor_update_freq"],
        inv_update_freq=k["inv_update_freq"],
        device=device.type,
        profile=k["profile"] or None,
        **rest,
    )


def main(argv: list[str] | None = None) -> int:
    args, overrides = parse(argv)
    try:
        return train(args, overrides)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


def train(args: argparse.Namespace, overrides: list[str]) -> int:
    cfg = recipe.load([recipe.find_recipe(args.recipe)], overrides)
    if args.library != "sgd" and cfg.kfac.variant == "sgd":
        raise UserError(f"--library {args.library} with kfac.variant=sgd: give --library sgd for the plain loop.")
    distributed = "RANK" in os.environ
    cuda = torch.cuda.is_available() and cfg.dist.device != "cpu"
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if distributed:
        dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    seed = cfg.train.seed
    torch.manual_seed(seed)
    train_set, _, info = build_datasets(cfg.data)
    sampler: DistributedSampler[Any] = DistributedSampler(train_set, world, rank, seed=seed, drop_last=True)
    loader = DataLoader(train_set, batch_size=cfg.data.batch_size, sampler=sampler, drop_last=True)
    kwargs: dict[str, Any] = OmegaConf.to_container(cfg.model.kwargs)  # type: ignore[assignment]  # a str-keyed map
    model = build_model(cfg.model.name, info.num_classes, info.channels, kwargs, info.image_size).to(device)
    optimizer = build_optimizer(model, cfg.optim)
    # kfacflow averages the gradients itself, after the factors; DDP does it for the others.
    wrap = distributed and args.library != "kfacflow"
    net = DistributedDataParallel(model) if wrap else model
    precond = None
    if args.library == "kfac-pytorch":
        precond = kfac_pytorch(net, cfg, args)
    elif args.library == "kfacflow":
        precond = kfacflow_preconditioner(model, cfg, device)
    run_dir = rundir.new_run_dir(cfg.out_dir, cfg.name) if rank == 0 else None
    if rank == 0 and precond is not None:  # both libraries find the Linear and Conv2d layers on their own
        layers = len(precond._layers) if args.library == "kfac-pytorch" else len(precond.core.layers)
        print(f"{args.library}: {layers} layers preconditioned", flush=True)
    times: list[float] = []
    step, epoch = 0, 0
    while step < cfg.train.steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            start = time.perf_counter()
            loss = cross_entropy(net(x), y, cfg.data.name)
            loss.backward()
            if precond is not None:
                precond.step()
            optimizer.step()
            optimizer.zero_grad()
            if cuda:
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - start)
            step += 1
            if step >= cfg.train.steps:
                break
        epoch += 1
    if run_dir is not None:
        lines = "".join(json.dumps({"step": i + 1, "total": t}) + "\n" for i, t in enumerate(times))
        (run_dir / "timings.jsonl").write_text(lines)
        kept = times[cfg.train.timing_warmup :] or times
        what = args.library
        if args.library == "kfac-pytorch":
            what += f" {args.strategy} {args.method}" + (" symmetry-aware" if args.symmetry_aware else "")
        print(f"{what}: mean step {statistics.mean(kept):.3f} s over {len(kept)} steps; {run_dir}", flush=True)
    if args.library == "kfacflow" and precond is not None:
        precond.remove()
    if distributed:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
