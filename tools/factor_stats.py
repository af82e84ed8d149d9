"""Kronecker-factor statistics of registered models: dimensions, packed sizes, the paper's Fig. 3.

    python tools/factor_stats.py resnet50
    python tools/factor_stats.py resnet50 resnet152 densenet201 timm/inception_v4 --plot fig3.png
    python tools/factor_stats.py resnet50 --layers            # one line per preconditioned layer

Sizes are packed upper triangles, d (d + 1) / 2 elements, the amount each factor all-reduce (and
each inverse broadcast) moves; A includes the ones column of a bias. ResNet-50 (torchvision):
25.5 M parameters, A factors 62.3 M and G factors 14.6 M elements, the smallest factor 2,080
elements and the largest 10,619,136, as the paper reports.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kfacflow import UserError  # noqa: E402
from kfacflow.kfac.layers import find_layers  # noqa: E402
from kfacflow.kfac.packing import packed_size  # noqa: E402
from kfacflow.models.builtin import build_model, check_name  # noqa: E402


def stats(name: str, num_classes: int = 1000, channels: int = 3) -> dict[str, Any]:
    """Return the factor statistics of model ``name``."""
    check_name(name)
    model = build_model(name, num_classes, channels)
    layers = find_layers(model, [])
    rows: list[dict[str, Any]] = [
        {"layer": layer.name, "type": type(layer.module).__name__, "A": layer.a_dim, "G": layer.g_dim}
        for layer in layers
    ]
    a_sizes = [packed_size(r["A"]) for r in rows]
    g_sizes = [packed_size(r["G"]) for r in rows]
    all_sizes = a_sizes + g_sizes
    return {
        "model": name,
        "parameters": sum(p.numel() for p in model.parameters()),
        "layers": len(rows),
        "A_elements": sum(a_sizes),
        "G_elements": sum(g_sizes),
        "smallest_factor_elements": min(all_sizes),
        "largest_factor_elements": max(all_sizes),
        "largest_dim": max(max(r["A"], r["G"]) for r in rows),
        "per_layer": rows,
    }


def plot(results: list[dict[str, Any]], path: Path) -> None:
    """Histogram of packed factor sizes per model (the paper's Fig. 3)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, len(results), figsize=(4 * len(results), 3.2), squeeze=False)
    for ax, r in zip(axes[0], results, strict=True):
        sizes = [packed_size(x[k]) for x in r["per_layer"] for k in ("A", "G")]
        ax.hist(sizes, bins=np.geomspace(min(sizes), max(sizes) * 1.01, 20), color="C0", edgecolor="black")
        ax.set_xscale("log")
        ax.set(title=r["model"], xlabel="elements per factor (packed)", ylabel="factors")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("models", nargs="+", help="registry names (python run.py --list model)")
    p.add_argument("--num-classes", type=int, default=1000)
    p.add_argument("--channels", type=int, default=3)
    p.add_argument("--layers", action="store_true", help="print every layer's factor dimensions")
    p.add_argument("--plot", default=None, help="write the Fig. 3 histogram to this PNG")
    p.add_argument("--json", default=None, help="write all statistics to this JSON file")
    args = p.parse_args(argv)
    try:
        results = [stats(m, args.num_classes, args.channels) for m in args.models]
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(
        f"{'model':<22} {'params':>12} {'layers':>6} {'A elements':>13} {'G elements':>13} {'smallest':>9} "
        f"{'largest':>11}"
    )
    for r in results:
        print(
            f"{r['model']:<22} {r['parameters']:>12,} {r['layers']:>6} {r['A_elements']:>13,} "
            f"{r['G_elements']:>13,} {r['smallest_factor_elements']:>9,} {r['largest_factor_elements']:>11,}"
        )
        if args.layers:
            for x in r["per_layer"]:
                print(f"    {x['layer']:<40} {x['type']:<7} A {x['A']:>5}  G {x['G']:>5}")
    if args.plot:
        plot(results, Path(args.plot))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
