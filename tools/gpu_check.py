"""The GPU check behind ``tools/gpu_check.sh``: CUDA tests, quickstarts, a small benchmark; one JSON and one table.

    python tools/gpu_check.py --out runs/gpu_check            # on a machine with one CUDA GPU
    python tools/gpu_check.py --out /tmp/g --device cpu --image-size 32 --steps 4 --no-tests   # the tool itself, on CPU

1. The CUDA-only tests (``pytest -m cuda``: events timing without synchronizing, ``cupy_cholesky`` =
   ``cholesky`` to float32 round-off, D-KFAC = SPD-KFAC with two ranks over gloo on CUDA tensors).
2. The quickstart on one rank (CUDA), and on two ranks over gloo on CUDA tensors (one GPU).
3. ResNet-50, 224 px, batch 32, on one rank: SGD, D-KFAC and SPD-KFAC, each with bf16 autocast off
   and on, and SPD with the step timing off (``train.timing=false``) beside it; the median step
   time after 2 warm-up steps, and the wall time of the run beside it.
4. Inverting many same-sized factors one call each against one batched call (what batching NCT
   inversions on CUDA would gain), timed with CUDA events.

Writes ``gpu_check.json`` and ``gpu_check.md`` into ``--out`` and prints the table.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]


def run(cmd: list[str], timeout: float) -> tuple[int, str, float]:
    """Run ``cmd`` in the repository; return its exit code, its output's tail and its wall seconds."""
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        code, out = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as err:
        code, out = 124, f"timed out after {timeout} s: {err}"
    return code, out[-4000:], time.perf_counter() - t0


def train(out: Path, name: str, overrides: list[str], timeout: float) -> dict[str, Any]:
    """One run of ``run.py``; its summary's accuracy and step time, and the run's wall time."""
    code, tail, wall = run([sys.executable, "run.py", *overrides, f"out_dir={out / 'runs'}", f"name={name}"], timeout)
    row: dict[str, Any] = {"name": name, "exit": code, "wall_s": round(wall, 2)}
    folders = sorted((out / "runs" / name).glob("*/summary.json"))
    if code == 0 and folders:
        summary = json.loads(folders[-1].read_text())
        row |= {
            "val_acc": summary["val_acc"],
            "step_s": summary["step_time_median_s"],
            "breakdown_s": summary["breakdown_mean_s"],
            "skipped_steps": summary["skipped_steps"],
        }
    else:
        row["error"] = tail
    print(f"  {name}: exit {code}, {row.get('step_s', '-')} s/step, wall {wall:.1f} s", flush=True)
    return row


def batched_inverses(device: torch.device, sizes: tuple[int, ...] = (64, 256, 512), count: int = 64) -> list[dict]:
    """Seconds to invert ``count`` damped SPD matrices of each size: one call each, and one batched call."""
    rows = []
    for d in sizes:
        x = torch.randn(count, d, 2 * d, device=device)
        factors = x @ x.transpose(1, 2) / (2 * d) + 1e-3 * torch.eye(d, device=device)

        def each(factors: torch.Tensor = factors) -> None:
            for f in factors:
                torch.cholesky_inverse(torch.linalg.cholesky(f))

        def batched(factors: torch.Tensor = factors) -> None:
            torch.cholesky_inverse(torch.linalg.cholesky(factors))

        times = {}
        for name, fn in (("each", each), ("batched", batched)):
            fn()  # warm-up (kernels, workspace)
            times[name] = _seconds(fn, device)
        rows.append({"size": d, "count": count, "each_s": times["each"], "batched_s": times["batched"]})
        print(f"  {count} x {d}: each {times['each'] * 1e3:.2f} ms, batched {times['batched'] * 1e3:.2f} ms")
    return rows


def _seconds(fn: Any, device: torch.device, repeat: int = 5) -> float:
    """Median seconds of ``fn`` (CUDA events on the stream; the host clock on CPU)."""
    times = []
    for _ in range(repeat):
        if device.type == "cuda":
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def table(result: dict[str, Any]) -> str:
    """The markdown table of the benchmark, and the lines of the other checks."""
    lines = [
        f"GPU check on {result['device_name']} (torch {result['torch']}, CUDA {result['cuda']}, "
        f"CuPy {result['cupy'] or 'not installed'})",
        "",
        f"- CUDA tests: {result['tests']['summary']}",
    ]
    for row in result["quickstart"]:
        lines.append(f"- {row['name']}: exit {row['exit']}, val_acc {row.get('val_acc', '-')}")
    lines += [
        "",
        f"| ResNet-50, {result['image_size']} px, batch 32, 1 GPU | s/step | wall s | FF&BP | FactorComp | "
        "InverseComp | Other |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in result["bench"]:
        parts = row.get("breakdown_s", {})
        cells = [f"{parts[c]:.3f}" if c in parts else "-" for c in ("FF&BP", "FactorComp", "InverseComp", "Other")]
        step = f"{row['step_s']:.3f}" if "step_s" in row else f"failed ({row['exit']})"
        lines.append(f"| {row['name']} | {step} | {row['wall_s']:.1f} | " + " | ".join(cells) + " |")
    lines += ["", "| same-sized inverses | one call each, ms | one batched call, ms |", "|---|---|---|"]
    for row in result["batched_inverses"]:
        lines.append(f"| {row['count']} x {row['size']} | {row['each_s'] * 1e3:.2f} | {row['batched_s'] * 1e3:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "gpu_check")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: try the tool itself")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--no-tests", action="store_true", help="skip the CUDA-only tests")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: no CUDA device is visible; this check needs one (or --device cpu to try the tool)")
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    try:
        import cupy

        cupy_version: str | None = cupy.__version__
    except Exception:  # noqa: BLE001 - absent, or built for another CUDA: the check says so
        cupy_version = None
    result: dict[str, Any] = {
        "device_name": torch.cuda.get_device_name() if device.type == "cuda" else "CPU",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cupy": cupy_version,
        "image_size": args.image_size,
        "steps": args.steps,
    }
    print("1. CUDA-only tests", flush=True)
    if args.no_tests:
        result["tests"] = {"summary": "not run (--no-tests)"}
    else:
        code, tail, wall = run([sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider"], 300)
        last = [line for line in tail.splitlines() if re.search(r"\d+ (passed|failed|skipped)", line)]
        result["tests"] = {"exit": code, "summary": last[-1] if last else tail[-300:], "wall_s": round(wall, 1)}
        print(f"  {result['tests']['summary']}")
    print("2. quickstarts", flush=True)
    common = ["train.progress=false", f"dist.device={args.device}"]
    result["quickstart"] = [
        train(args.out, "quickstart_1rank", ["recipes/quickstart.yaml", "launch.nproc=1", *common], 240),
        train(
            args.out,
            "quickstart_2ranks_gloo",
            ["recipes/quickstart.yaml", "launch.nproc=2", "dist.engine=gloo", *common],
            240,
        ),
    ]
    print("3. ResNet-50", flush=True)
    bench = [
        "recipes/resnet50_spd.yaml",
        "launch.nproc=1",
        f"data.image_size={args.image_size}",
        f"data.train_size={32 * (args.steps + 1)}",
        "data.val_size=32",
        f"train.steps={args.steps}",
        "train.checkpoint_every=0",
        "train.eval_every=1000",
        *common,
    ]
    cases = [
        ("sgd", ["kfac.variant=sgd"]),
        ("sgd_bf16", ["kfac.variant=sgd", "train.amp=bf16"]),
        ("d", ["kfac.variant=d"]),
        ("d_bf16", ["kfac.variant=d", "train.amp=bf16"]),
        ("spd", ["kfac.variant=spd"]),
        ("spd_bf16", ["kfac.variant=spd", "train.amp=bf16"]),
        ("spd_untimed", ["kfac.variant=spd", "train.timing=false"]),
        ("spd_bf16_untimed", ["kfac.variant=spd", "train.amp=bf16", "train.timing=false"]),
    ]
    result["bench"] = [train(args.out, name, [*bench, *extra], 300) for name, extra in cases]
    print("4. same-sized inverses", flush=True)
    result["batched_inverses"] = batched_inverses(device)
    (args.out / "gpu_check.json").write_text(json.dumps(result, indent=2))
    text = table(result)
    (args.out / "gpu_check.md").write_text(text)
    print(text)
    failed = [r["name"] for r in result["quickstart"] + result["bench"] if r["exit"] != 0]
    return 1 if failed or result["tests"].get("exit", 0) not in (0, 5) else 0


if __name__ == "__main__":
    sys.exit(main())
