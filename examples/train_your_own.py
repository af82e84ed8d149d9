"""K-FAC in your own training loop: your model, data, optimizer and DDP; kfacflow only preconditions.

    torchrun --nproc_per_node 2 examples/train_your_own.py            # 2 workers (gloo on CPU, NCCL on GPUs)
    python examples/train_your_own.py --variant flow --epochs 3       # one process
    python examples/train_your_own.py --amp fp16                      # mixed precision (a GradScaler for fp16)
    torchrun --nproc_per_node 2 examples/train_your_own.py --variant flow --optimizer muon   # K-FAC + Muon

It trains a small CNN on scikit-learn's handwritten digits (no download) and prints the test
accuracy. Nothing here is kfacflow's but the lines marked ``kfacflow``.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import kfacflow


def main() -> None:
    """Train, evaluate, print the accuracy."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variant", default="spd", help="d, mpd, spd or flow")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--optimizer", default="sgd", choices=["sgd", "muon"], help="muon: kfacflow.muon, K-FAC + Muon")
    p.add_argument("--amp", default="none", choices=["none", "bf16", "fp16"], help="autocast the forward pass")
    args = p.parse_args()

    distributed = "RANK" in os.environ  # started by torchrun
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if distributed:
        dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank() if distributed else 0
    torch.manual_seed(0)

    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target)
    train, test = TensorDataset(x[:1500], y[:1500]), TensorDataset(x[1500:], y[1500:])
    sampler: DistributedSampler[tuple[torch.Tensor, ...]] | None = (
        DistributedSampler(train, seed=0) if distributed else None
    )
    loader = DataLoader(train, batch_size=32, sampler=sampler, shuffle=sampler is None)

    model = nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(16 * 16, 64),
        nn.ReLU(),
        nn.Linear(64, 10),
    ).to(device)
    net = DistributedDataParallel(model) if distributed else model
    if args.optimizer == "muon":  # kfacflow: Muon for the matrices and filters, AdamW for the rest
        optimizer: torch.optim.Optimizer = kfacflow.muon(model, lr=args.lr, adamw_lr=3e-3)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    amp = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.amp)
    scaler = torch.amp.GradScaler(device.type) if args.amp == "fp16" else None
    # kfacflow: joins the process group above; the damping may be a function of the step; with fp16, the
    # scaler lets K-FAC take its factors from the unscaled gradients.
    precond = kfacflow.KFACPreconditioner(
        net, variant=args.variant, lr=args.lr, damping=lambda step: 0.003, device=device.type, grad_scaler=scaler
    )
    if args.optimizer == "muon" and args.variant == "flow":
        precond.finish_muon(optimizer)  # kfacflow: each layer's owner runs its Muon step; no rank repeats another's

    for epoch in range(args.epochs):
        if sampler is not None:
            sampler.set_epoch(epoch)
        for inputs, targets in loader:
            inputs, targets = inputs.to(device), targets.to(device)
            with torch.autocast(device.type, dtype=amp, enabled=amp is not None):
                loss = F.cross_entropy(net(inputs), targets)
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.unscale_(optimizer)  # K-FAC preconditions the true gradients
                precond.step()  # kfacflow
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                precond.step()  # kfacflow: preconditions the averaged gradients in place
                optimizer.step()
            optimizer.zero_grad()

    with torch.no_grad():
        inputs, targets = test.tensors[0].to(device), test.tensors[1].to(device)
        accuracy = (model(inputs).argmax(1) == targets).float().mean().item()
    if rank == 0:
        what = f"{args.variant}, {args.optimizer}"
        print(f"test accuracy {accuracy:.3f} after {precond.steps} steps ({what})", flush=True)
    precond.remove()  # kfacflow: hooks off, K-FAC's process groups closed; the job's own group stays
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
