"""Measure and fit kfacflow's performance models on the current job, write a profile, plot the fits.

    python tools/fit_perf_models.py --nproc 2 --out profile.yaml --plot figs/
    torchrun --nproc_per_node 4 tools/fit_perf_models.py --out profile.yaml
    python tools/fit_perf_models.py --dims 64,128,256,512,1024,2048,4096 --repeat 5 --device cuda

The models (all-reduce and broadcast t = alpha + beta m; inverse time as a function of d, the
better of an exponential and a cubic) are what ``kfac.fusion=optimal`` and
``kfac.placement=lbp`` plan with: name the file in a recipe as ``kfac.profile``. A run that
names none calibrates with the same code (``kfacflow.simulation.calibration.calibrate``) over smaller sizes.
The plots reproduce the paper's Fig. 7 (communication), Fig. 8 (inverse) and Fig. 11
(inverse vs broadcast: below the crossing a factor is cheaper to invert everywhere, an NCT).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from kfacflow import UserError, registry  # noqa: E402
from kfacflow.comm.launchers import under_launcher  # noqa: E402
from kfacflow.configuration.schema import DistConfig  # noqa: E402
from kfacflow.perf import Profile  # noqa: E402
from kfacflow.running import build
from kfacflow.running.launch import self_launch  # noqa: E402
from kfacflow.simulation.calibration import calibrate  # noqa: E402


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2, help="local workers to start (ignored under torchrun)")
    p.add_argument("--dims", default="64,128,256,512,1024,1536,2048", help="factor sides to measure")
    p.add_argument("--repeat", type=int, default=3, help="runs per size; the best is kept")
    p.add_argument("--inverse", default="cholesky", help="inverse method of the default model (kfac.inverse)")
    p.add_argument(
        "--methods",
        default=None,
        help="comma-separated inverse methods timed each with a model of its own (default: every registered one)",
    )
    p.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    p.add_argument("--backend", default="torch", help="communication backend (dist.backend)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--out", default="profile.yaml", help="profile file to write")
    p.add_argument("--plot", default=None, help="folder for fig7_comm.png, fig8_inverse.png, fig11_nct.png")
    return p.parse_args(argv)


def worker(args: argparse.Namespace) -> str | None:
    build.load_plugins()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", 1))))
    backend = registry.BACKENDS.get(args.backend)(DistConfig(backend=args.backend, device=args.device))
    try:
        dims = [int(d) for d in args.dims.split(",")]
        dtype = getattr(torch, args.dtype)
        names = args.methods.split(",") if args.methods else registry.INVERSES.names()
        methods = {name: registry.INVERSES.get(name) for name in names}
        profile = calibrate(backend, registry.INVERSES.get(args.inverse), dtype, dims, args.repeat, methods)
    finally:
        backend.close()
    if backend.rank != 0:
        return None
    profile.meta["inverse_method"] = args.inverse
    profile.save(args.out)
    report(profile)
    if args.plot:
        plot(profile, Path(args.plot))
    return args.out


def report(profile: Profile) -> None:
    for name in ("allreduce", "broadcast"):
        m = getattr(profile, name)
        print(f"{name:9s}: t = {m.alpha:.3e} + {m.beta:.3e} m s   (relative RMS error {100 * m.error:.1f} %)")
    inv = profile.inverse
    form = "alpha exp(beta d)" if inv.kind == "exp" else "alpha + beta d^3"
    print(f"inverse  : {form}, alpha {inv.alpha:.3e}, beta {inv.beta:.3e}   (error {100 * inv.error:.1f} %)")
    for d in (256, 1024, 4096):
        m = d * (d + 1) // 2
        print(f"  d={d:5d}: inverse {profile.inverse(d):.4f} s, broadcast {profile.broadcast(m):.4f} s")
    for method, model in profile.methods.items():
        times = ", ".join(f"d={d} {model(d):.4f} s" for d in (256, 1024, 4096))
        print(f"  {method:16s} ({model.kind}, error {100 * model.error:.1f} %): {times}")


def plot(profile: Profile, folder: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    folder.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for name, color in (("allreduce", "C0"), ("broadcast", "C1")):
        pts = np.asarray(profile.samples[name])
        model = getattr(profile, name)
        ax.loglog(pts[:, 0], pts[:, 1], "o", color=color, label=f"{name} measured")
        xs = np.geomspace(pts[:, 0].min(), pts[:, 0].max(), 50)
        ax.loglog(xs, model.alpha + model.beta * xs, "-", color=color, label=f"{name} fit")
    ax.set(xlabel="elements", ylabel="seconds", title="Fig. 7: communication models")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(folder / "fig7_comm.png", dpi=120)
    plt.close(fig)

    pts = np.asarray(profile.samples["inverse"])
    ds = np.linspace(pts[:, 0].min(), pts[:, 0].max(), 100)
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.semilogy(pts[:, 0], pts[:, 1], "o", label="measured")
    ax.semilogy(ds, [profile.inverse(d) for d in ds], "-", label=f"{profile.inverse.kind} fit")
    ax.set(xlabel="d", ylabel="seconds", title="Fig. 8: inverse of a d x d factor")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(folder / "fig8_inverse.png", dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.semilogy(ds, [profile.inverse(d) for d in ds], label="inverse (CompPM)")
    ax.semilogy(ds, [profile.broadcast(d * (d + 1) / 2) for d in ds], label="broadcast (CommPM)")
    ax.set(xlabel="d", ylabel="seconds", title="Fig. 11: NCT where inverse < broadcast")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(folder / "fig11_nct.png", dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    try:
        build.load_plugins()
        registry.BACKENDS.get(args.backend)
        registry.INVERSES.get(args.inverse)
        if under_launcher() or args.nproc == 1:
            out = worker(args)
        else:
            out = self_launch(args.nproc, worker, (args,))[0]
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
