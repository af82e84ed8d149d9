"""The GPU check behind ``tools/gpu_check.sh``: CUDA tests, quickstarts, a small benchmark; one JSON and one table.

    bash tools/gpu_check.sh runs/gpu_check                   # on a machine with one CUDA GPU (installs what it needs)
    python tools/gpu_check.py --out /tmp/g --device cpu --image-size 32 --steps 4 --no-tests   # the tool itself, on CPU

1. The CUDA-only tests (``pytest -m cuda``).
2. The quickstart on one rank (CUDA), and on two ranks over gloo on CUDA tensors (one GPU).
3. ResNet-50, 224 px, batch 32, on one rank, most telling first: SGD, D, SPD and flow in float32; bf16
   autocast and fp16 (GradScaler) against float32; ``cupy_cholesky`` against ``cholesky``; step timing
   off against on; channels-last and cuDNN's autotuner off against the defaults; ``data.workers`` set.
   Per run: the median s/step after 2 warm-up steps, images/s, the peak GPU memory the run allocated,
   the mean time breakdown and the run's wall time. No run writes a checkpoint (``train.save=false``).
4. Inverting many same-sized factors one call each against one batched call, timed with CUDA events.

On the CPU only the runs that can run there run, and K-FAC leaves layer3 and layer4 to SGD, to fit.
Everything shares one deadline (``--budget-s``, 8 minutes): each run gets what is left, and what no
longer fits is reported as skipped. A run past its time is stopped with its whole process group (the
workers, DataLoader processes), so nothing keeps holding the GPU. Writes ``gpu_check.json`` and
``gpu_check.md`` into ``--out`` and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
BATCH = 32
REPORT = 20.0
"""Seconds kept for the inverse comparison and the report when the runs are given their time."""
SHORTEST = 45.0
"""A run is not started with less time left than this (it would only be stopped)."""
GRACE = 10.0
"""Seconds a stopped run gets after SIGTERM (it finishes its step; it writes no checkpoint) before SIGKILL."""
CPU_SKIP = "kfac.skip=[layer3.*,layer4.*]"
"""On the CPU (a trial of the tool) K-FAC leaves its widest factors (up to 4608) to SGD: a run then takes
seconds a step, not a minute."""


class Deadline:
    """The time left of the whole check."""

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        """Seconds until the deadline (negative after it)."""
        return self.end - time.monotonic()

    def allows(self, cap: float) -> float:
        """Seconds the next step may take (at most ``cap``, keeping :data:`REPORT`); 0 if it should not start."""
        seconds = min(cap, self.left() - REPORT - GRACE)
        return seconds if seconds >= SHORTEST else 0.0


def run(cmd: list[str], timeout: float, env: dict[str, str] | None = None) -> tuple[int, str, float]:
    """Run ``cmd`` in the repository; return its exit code, its output's tail and its wall seconds.

    Past ``timeout`` its whole process group gets SIGTERM, then SIGKILL: the workers a run started
    (and their DataLoader processes) go with it; so does anything it left behind when it exits. The
    output goes to a file, not a pipe that such a leftover would hold open.
    """
    t0 = time.perf_counter()
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code, late = proc.wait(timeout=timeout), False
            _kill_group(proc, grace=0.0)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            proc.wait()
            code, late = 124, True
        log.seek(0)
        out = log.read()
    if late:
        out += f"\ntimed out after {timeout:.0f} s: stopped with its process group"
    return code, out[-4000:], time.perf_counter() - t0


def _kill_group(proc: subprocess.Popen[Any], grace: float = GRACE) -> None:
    """SIGTERM the process group of ``proc`` (a run checkpoints nothing: it stops at once), then SIGKILL."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 0.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and _group_alive(proc.pid):
            time.sleep(0.1)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def train(out: Path, name: str, overrides: list[str], timeout: float, base: str | None = None) -> dict[str, Any]:
    """One run of ``run.py``; its summary's step time, throughput, memory and breakdown, and its wall time."""
    row: dict[str, Any] = {"name": name, "base": base, "overrides": overrides}
    if timeout <= 0:
        row |= {"exit": None, "skipped": "no time left"}
        print(f"  {name}: skipped (no time left)", flush=True)
        return row
    argv = [sys.executable, "run.py", *overrides, "train.save=false", f"out_dir={out / 'runs'}", f"name={name}"]
    code, tail, wall = run(argv, timeout)
    row |= {"exit": code, "wall_s": round(wall, 2)}
    folders = sorted((out / "runs" / name).glob("*/summary.json"))
    if code == 0 and folders:
        summary = json.loads(folders[-1].read_text())
        step = summary["step_time_median_s"]
        memory = summary.get("peak_gpu_memory_bytes")
        row |= {
            "val_acc": summary["val_acc"],
            "step_s": step,
            "images_per_s": BATCH * summary["world_size"] / step if step else None,
            "peak_gpu_memory_gib": memory / 2**30 if memory is not None else None,
            "breakdown_s": summary["breakdown_mean_s"],
            "skipped_steps": summary["skipped_steps"],
        }
    else:
        row["error"] = tail
    print(f"  {name}: exit {code}, {row.get('step_s', '-')} s/step, wall {wall:.1f} s", flush=True)
    return row


def cases(device: str, cupy: bool) -> list[tuple[str, list[str], str | None]]:
    """The benchmark runs, most telling first: (name, overrides, the run it is compared against)."""
    cuda = device == "cuda"
    found: list[tuple[str, list[str], str | None, bool]] = [
        ("sgd", ["kfac.variant=sgd"], None, True),
        ("d", ["kfac.variant=d"], None, True),
        ("spd", ["kfac.variant=spd"], None, True),
        ("flow", ["kfac.variant=flow"], None, True),
        ("spd_bf16", ["kfac.variant=spd", "train.amp=bf16"], "spd", True),
        ("spd_fp16", ["kfac.variant=spd", "train.amp=fp16"], "spd", cuda),
        ("sgd_bf16", ["kfac.variant=sgd", "train.amp=bf16"], "sgd", True),
        ("sgd_fp16", ["kfac.variant=sgd", "train.amp=fp16"], "sgd", cuda),
        ("spd_cupy", ["kfac.variant=spd", "kfac.inverse=cupy_cholesky"], "spd", cuda and cupy),
        ("spd_untimed", ["kfac.variant=spd", "train.timing=false"], "spd", True),
        ("sgd_bf16_nhwc", ["kfac.variant=sgd", "train.amp=bf16", "train.channels_last=true"], "sgd_bf16", True),
        ("spd_bf16_nhwc", ["kfac.variant=spd", "train.amp=bf16", "train.channels_last=true"], "spd_bf16", cuda),
        ("sgd_no_autotune", ["kfac.variant=sgd", "train.cudnn_benchmark=false"], "sgd", cuda),
        ("spd_workers", ["kfac.variant=spd", f"data.workers={4 if cuda else 2}"], "spd", True),
        ("d_bf16", ["kfac.variant=d", "train.amp=bf16"], "d", cuda),
        ("flow_bf16", ["kfac.variant=flow", "train.amp=bf16"], "flow", cuda),
    ]
    light = [] if cuda else [CPU_SKIP]
    return [
        (name, extra if "kfac.variant=sgd" in extra else [*extra, *light], base)
        for name, extra, base, wanted in found
        if wanted
    ]


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


def versions(device: torch.device) -> dict[str, Any]:
    """torch, CUDA, cuDNN, NCCL, the driver and CuPy, as this interpreter sees them."""
    try:
        import cupy

        cupy_version: str | None = cupy.__version__
    except Exception:  # noqa: BLE001 - absent, or built for another CUDA: the check says so
        cupy_version = None
    found: dict[str, Any] = {
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "nccl": None,
        "driver": None,
        "cupy": cupy_version,
        "python": sys.version.split()[0],
    }
    if torch.cuda.is_available():
        try:
            found["nccl"] = ".".join(str(v) for v in torch.cuda.nccl.version())
        except Exception:  # noqa: BLE001 - a build without NCCL
            pass
        try:
            query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
            found["driver"] = subprocess.run(query, capture_output=True, text=True, timeout=30).stdout.split()[0]
        except (OSError, IndexError, subprocess.SubprocessError):
            pass
    return found


PARTS = ("FF&BP", "FactorComp", "FactorComm", "InverseComp", "InverseComm", "Precondition", "Other", "Between")


def table(result: dict[str, Any]) -> str:
    """The markdown table of the benchmark, and the lines of the other checks."""
    v = result["versions"]
    lines = [
        f"GPU check on {v['device_name']}: torch {v['torch']}, CUDA {v['cuda']}, cuDNN {v['cudnn']}, "
        f"NCCL {v['nccl']}, driver {v['driver']}, CuPy {v['cupy'] or 'not installed'}; "
        f"{result['seconds']:.0f} s of a {result['budget_s']:.0f} s budget",
        "",
        f"- CUDA tests: {result['tests']['summary']}",
    ]
    for row in result["quickstart"]:
        lines.append(f"- {row['name']}: exit {row['exit']}, val_acc {row.get('val_acc', '-')}")
    lines += [
        "",
        f"| ResNet-50, {result['image_size']} px, batch {BATCH}, 1 rank | s/step | images/s | vs | peak GiB | "
        "wall s | " + " | ".join(PARTS) + " |",
        "|---" * (6 + len(PARTS)) + "|",
    ]
    rows = {row["name"]: row for row in result["bench"]}
    for row in result["bench"]:
        if row.get("skipped"):
            lines.append(f"| {row['name']} | skipped: {row['skipped']} |" + " |" * (4 + len(PARTS)))
            continue
        if "step_s" not in row:
            lines.append(f"| {row['name']} | failed (exit {row['exit']}) |" + " |" * (4 + len(PARTS)))
            continue
        base = rows.get(row["base"] or "", {})
        versus = f"{base['step_s'] / row['step_s']:.2f}x {row['base']}" if base.get("step_s") else ""
        memory = f"{row['peak_gpu_memory_gib']:.2f}" if row.get("peak_gpu_memory_gib") is not None else "-"
        parts = row.get("breakdown_s", {})
        cells = [f"{parts[c]:.3f}" if c in parts else "-" for c in PARTS]
        lines.append(
            f"| {row['name']} | {row['step_s']:.3f} | {row['images_per_s']:.1f} | {versus} | {memory} | "
            f"{row['wall_s']:.1f} | " + " | ".join(cells) + " |"
        )
    lines += ["", "| same-sized inverses | one call each, ms | one batched call, ms |", "|---|---|---|"]
    for row in result["batched_inverses"]:
        lines.append(f"| {row['count']} x {row['size']} | {row['each_s'] * 1e3:.2f} | {row['batched_s'] * 1e3:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "gpu_check")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: try the tool itself")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--steps", type=int, default=12, help="steps of each benchmark run (2 are warm-up)")
    parser.add_argument("--budget-s", type=float, default=480.0, help="seconds for the whole check")
    parser.add_argument("--no-tests", action="store_true", help="skip the CUDA-only tests")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: no CUDA device is visible; this check needs one (or --device cpu to try the tool)")
        return 2
    deadline = Deadline(args.budget_s)
    started = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    result: dict[str, Any] = {
        "versions": versions(device),
        "image_size": args.image_size,
        "steps": args.steps,
        "budget_s": args.budget_s,
    }
    print("1. CUDA-only tests", flush=True)
    if args.no_tests:
        result["tests"] = {"summary": "not run (--no-tests)"}
    else:
        pytest = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider"]
        code, tail, wall = run(pytest, max(deadline.allows(150), 1.0))
        last = [line for line in tail.splitlines() if re.search(r"\d+ (passed|failed|skipped)", line)]
        result["tests"] = {"exit": code, "summary": last[-1] if last else tail[-300:], "wall_s": round(wall, 1)}
        print(f"  {result['tests']['summary']}")
    print("2. quickstarts", flush=True)
    common = ["train.progress=false", f"dist.device={args.device}"]
    quick = ["recipes/quickstart.yaml", *common]
    result["quickstart"] = [
        train(args.out, "quickstart_1rank", [*quick, "launch.nproc=1"], deadline.allows(120)),
        train(args.out, "quickstart_2ranks_gloo", [*quick, "launch.nproc=2", "dist.engine=gloo"], deadline.allows(120)),
    ]
    print("3. ResNet-50", flush=True)
    bench = [
        "recipes/resnet50_spd.yaml",
        "launch.nproc=1",
        f"data.image_size={args.image_size}",
        f"data.train_size={BATCH * (args.steps + 1)}",
        f"data.val_size={BATCH}",
        f"train.steps={args.steps}",
        "train.checkpoint_every=0",
        "train.eval_every=1000",
        "train.log_every=1000",
        *common,
    ]
    result["bench"] = [
        train(args.out, name, [*bench, *extra], deadline.allows(120), base)
        for name, extra, base in cases(args.device, result["versions"]["cupy"] is not None)
    ]
    print("4. same-sized inverses", flush=True)
    result["batched_inverses"] = batched_inverses(device, count=64 if device.type == "cuda" else 16)
    result["seconds"] = time.monotonic() - started
    (args.out / "gpu_check.json").write_text(json.dumps(result, indent=2))
    text = table(result)
    (args.out / "gpu_check.md").write_text(text)
    print(text)
    failed = [r["name"] for r in result["quickstart"] + result["bench"] if r["exit"] not in (0, None)]
    return 1 if failed or result["tests"].get("exit", 0) not in (0, 5) else 0


if __name__ == "__main__":
    sys.exit(main())
