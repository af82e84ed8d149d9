"""Test helpers: run the CLI in a subprocess, and run a function in N real gloo worker processes."""

from __future__ import annotations

import copy
import json
import multiprocessing as mp
import os
import pickle
import queue
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kfacflow.comm.torch_dist import TorchBackend
from kfacflow.configuration.schema import DistConfig, KFACConfig

if TYPE_CHECKING:
    from kfacflow.kfac.preconditioner import Preconditioner
    from kfacflow.perf import Profile
    from kfacflow.running.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
QUICK = str(ROOT / "recipes" / "quickstart.yaml")


def kfac_sgd_step(net: nn.Module, pre: Preconditioner, opt: torch.optim.Optimizer, x: Tensor, y: Tensor) -> None:
    """One training step as a library user writes it: forward, ``end_forward``, backward, precondition, SGD."""
    out = net(x)
    pre.end_forward()
    F.cross_entropy(out, y).backward()
    pre.step(lr=0.1)
    opt.step()
    opt.zero_grad()


def kfac_step(model: nn.Module, pre: Preconditioner, x: Tensor, y: Tensor, lr: float = 0.1) -> None:
    """One step's gradients, preconditioned: zero_grad, forward, end_forward, cross-entropy backward, step."""
    model.zero_grad()
    out = model(x)
    pre.end_forward()
    F.cross_entropy(out, y).backward()
    pre.step(lr=lr)


def run_cli(*args: str, cwd: Path | None = None, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Run ``python run.py ARGS`` from the repository root; outputs are captured as text."""
    return _run_python(ROOT / "run.py", args, cwd, timeout)


_BATCH = """
import contextlib, io, json, sys
from kfacflow.cli import main
results = []
for argv in json.load(sys.stdin):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else 1
    results.append([code, out.getvalue(), err.getvalue()])
print(json.dumps(results))
"""


def run_cli_batch(
    runs: list[list[str]], cwd: Path | None = None, timeout: float = 900
) -> list[subprocess.CompletedProcess[str]]:
    """Run several one-process ``python run.py ARGS`` one after another in ONE fresh interpreter.

    Importing torch and building the first optimizer (which imports torch's compiler) are most of
    a short one-worker run; here they are paid once. Every run gets its own exit code and outputs.
    Only for runs with ``launch.nproc=1`` (a run of several workers starts its own processes anyway).
    """
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    code = [sys.executable, "-c", _BATCH]
    proc = subprocess.run(
        code, input=json.dumps(runs), cwd=cwd or ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    return [
        subprocess.CompletedProcess(argv, code, out, err) for argv, (code, out, err) in zip(runs, results, strict=True)
    ]


def run_tool(name: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Run ``python tools/NAME ARGS`` from the repository root; outputs are captured as text."""
    return _run_python(ROOT / "tools" / name, args, None, timeout)


def _run_python(
    script: Path, args: tuple[str, ...], cwd: Path | None, timeout: float
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("RANK", None)  # not a worker of whatever launched the tests
    env.pop("WORLD_SIZE", None)
    return subprocess.run(
        [sys.executable, str(script), *args],
        cwd=cwd or ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def last_line(proc: subprocess.CompletedProcess[str]) -> str:
    """Return the last non-empty line of stdout (rank 0 prints the run folder there)."""
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert lines, f"no output; stderr:\n{proc.stderr[-3000:]}"
    return lines[-1]


def free_port() -> int:
    """Return a TCP port that was free a moment ago on localhost."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


GLOO_CONTEXT = mp.get_context("forkserver")
"""Where :func:`run_in_gloo`'s ranks come from: forked from one server process that imported torch and kfacflow
once, instead of each rank importing them again (a spawn's 2-3 s of start-up per rank, on most slow tests). The
server starts at the first call; each rank then takes the caller's environment, ``sys.path`` and working folder,
as a spawned rank would."""
GLOO_CONTEXT.set_forkserver_preload(["helpers", "kfacflow.running.trainer", "kfacflow.running.build"])


def _entry(
    fn: Callable[..., Any],
    rank: int,
    world: int,
    port: int,
    out: Any,
    args: tuple[Any, ...],
    caller: tuple[dict[str, str], list[str], str],
) -> None:
    env, path, cwd = caller
    os.environ.clear()
    os.environ.update(env)
    sys.path[:] = path
    os.chdir(cwd)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
    )
    torch.set_num_threads(1)
    try:
        # Plain pickle: tensors travel by value, not as shared memory that dies with this process.
        out.put((rank, True, pickle.dumps(fn(rank, world, *args))))
    except BaseException:  # noqa: BLE001 - the parent reports any failure with its traceback
        out.put((rank, False, traceback.format_exc()))


def run_in_gloo(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 120) -> list[Any]:
    """Run ``fn(rank, world, *args)`` in ``world`` new processes (:data:`GLOO_CONTEXT`) and return the results by rank.

    Each process has the torchrun-style environment (RANK, WORLD_SIZE, MASTER_ADDR/PORT), so
    ``TorchBackend`` joins a real gloo group. ``fn`` must be a module-level function and its
    result picklable. A failure or a hang (past ``timeout`` seconds) fails the test with the
    workers' tracebacks, and no process is left running.
    """
    ctx = GLOO_CONTEXT
    out = ctx.Queue()
    port = free_port()
    caller = (dict(os.environ), list(sys.path), os.getcwd())
    procs = [
        ctx.Process(target=_entry, args=(fn, r, world, port, out, args, caller), daemon=True) for r in range(world)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    deadline = time.monotonic() + timeout
    while len(results) < world and not errors:
        try:
            rank, ok, value = out.get(timeout=1.0)
        except queue.Empty:
            dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in results]
            if dead:
                errors.append(f"ranks {dead} died (exit codes {[procs[r].exitcode for r in dead]}) without a result")
            elif time.monotonic() > deadline:
                errors.append(f"timed out after {timeout} s with results from ranks {sorted(results)}")
            continue
        if ok:
            results[rank] = pickle.loads(value)
        else:
            errors.append(f"rank {rank}:\n{value}")
    for p in procs:
        p.join(timeout=5 if not errors else 0.1)
        if p.is_alive():
            p.kill()
            p.join()
    if errors:
        raise AssertionError("distributed test body failed:\n" + "\n".join(errors))
    return [results[r] for r in range(world)]


def local_backend(monkeypatch: Any, device: Literal["cpu", "cuda"] = "cpu") -> TorchBackend:
    """A one-process engine on ``device``, whatever launcher variables the tests run under."""
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    return TorchBackend(DistConfig(device=device))


@contextmanager
def recipe_trainer(out: str, overrides: list[str]) -> Iterator[Trainer]:
    """The quickstart's trainer with ``overrides``, in this (gloo worker) process; its engine closed after."""
    from kfacflow.configuration.recipe import load
    from kfacflow.running.trainer import Trainer

    cfg = load([QUICK], [f"out_dir={out}", *overrides])
    backend = TorchBackend(cfg.dist)
    run_dir = Path(out) / "run"
    run_dir.mkdir(parents=True, exist_ok=True)
    try:
        yield Trainer.from_recipe(cfg, backend, run_dir)
    finally:
        backend.close()


def variant_steps(
    backend: TorchBackend,
    model: nn.Module,
    cfg: KFACConfig,
    profile: Profile | None,
    batches: list[tuple[Tensor, Tensor]],
    part: slice,
) -> tuple[list[list[Tensor]], Preconditioner]:
    """Train ``model`` with K-FAC under ``cfg`` and SGD's momentum (lr 0.1), each step on this rank's ``part`` of a
    batch, its gradients averaged as ``cfg``'s variant does; return every step's parameters and the preconditioner
    (still on the model: the caller checks it, then removes it)."""
    from kfacflow.kfac.variants import resolve
    from kfacflow.registry import GRAD_SYNCS
    from kfacflow.running import build

    net = backend.wrap_model(model)
    pre = build.preconditioner(model, cfg, backend, profile)
    sync = GRAD_SYNCS.get(resolve(cfg).grad_sync)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    trail = []
    for x, y in batches:
        with sync.backward(backend, net, last=True):
            loss = F.cross_entropy(net(x[part]), y[part])
            pre.end_forward()
            loss.backward()
        pre.step(lr=0.1, gradients=sync.gradients(backend, list(model.parameters())))
        opt.step()
        opt.zero_grad()
        trail.append([p.detach().clone() for p in model.parameters()])
    return trail, pre


def double_batch_trails(
    rank: int,
    world: int,
    variants: tuple[str, ...],
    make: Callable[[], nn.Module],
    data: Callable[[int, int], tuple[Tensor, Tensor]],
    examples: int,
    check: Callable[[Preconditioner], None],
    profile: Profile | None,
    **kfac: Any,
) -> dict[str, list[list[Tensor]]]:
    """Each variant's parameters at every step (:func:`variant_steps`), this rank training on its share of
    ``data(10 + step, 2 * examples)``: 2 ranks ``examples`` each, or one rank the double batch. ``check`` looks at
    each preconditioner before it is removed; ``kfac``: keys of ``KFACConfig`` besides these tests' own."""
    backend = TorchBackend(DistConfig(device="cpu"))
    out: dict[str, list[list[Tensor]]] = {}
    local = 2 * examples // world
    try:
        for variant in variants:
            cfg = KFACConfig(variant=variant, damping=0.01, kl_clip=0.01, inv_update_freq=2, **kfac)
            batches = [data(10 + i, 2 * examples) for i in range(4)]
            part = slice(rank * local, (rank + 1) * local)
            trail, pre = variant_steps(backend, make(), cfg, profile, batches, part)
            check(pre)
            pre.remove()
            out[variant] = trail
    finally:
        backend.close()
    return out


def agree_with_one_process(
    monkeypatch: Any, train: Callable[[int, int, tuple[str, ...]], dict[str, Any]], variants: tuple[str, ...]
) -> None:
    """``train`` on 2 gloo ranks: the ranks hold one model at every step, every variant equals one process on the
    double batch (D-KFAC), and the parameters changed."""
    ranks = run_in_gloo(train, 2, variants)
    local_backend(monkeypatch).close()  # no launcher's variables: the one process below is alone
    alone = train(0, 1, ("d",))
    for variant in variants:
        for step_params, other_rank in zip(ranks[0][variant], ranks[1][variant], strict=True):
            for p, q in zip(step_params, other_rank, strict=True):
                assert torch.equal(p, q), f"{variant}: the ranks differ"
        for mine, one in zip(ranks[0][variant], alone["d"], strict=True):
            for p, q in zip(mine, one, strict=True):
                torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12, msg=f"{variant} against one process")
    first, last = ranks[0]["d"][0], ranks[0]["d"][-1]
    assert any(not torch.allclose(p, q) for p, q in zip(first, last, strict=True))


def resumed_as_uninterrupted(
    backend: TorchBackend, make: Callable[[], nn.Module], cfg: KFACConfig, batches: list[Any], cut: int = 3
) -> dict[str, Any]:
    """Train ``make()`` with K-FAC under ``cfg`` and SGD (lr 0.1) over ``batches``, and again through a checkpoint
    after ``cut`` of them into a new model and preconditioner: assert both end with the same parameters. Returns
    the checkpoint (``model``, ``kfac``) for the caller to look into."""
    from kfacflow.running import build

    def start() -> tuple[nn.Module, Preconditioner, torch.optim.Optimizer]:
        model = make()
        return model, build.preconditioner(model, cfg, backend), torch.optim.SGD(model.parameters(), lr=0.1)

    def train(model: nn.Module, pre: Preconditioner, opt: torch.optim.Optimizer, part: list[Any]) -> None:
        for x, y in part:
            kfac_step(model, pre, x, y)
            opt.step()

    model, pre, opt = start()
    train(model, pre, opt, batches)
    whole = [p.detach().clone() for p in model.parameters()]
    pre.remove()
    model, pre, opt = start()
    train(model, pre, opt, batches[:cut])
    saved = copy.deepcopy({"model": model.state_dict(), "kfac": pre.state_dict()})
    pre.remove()
    model, pre, opt = start()
    model.load_state_dict(saved["model"])
    pre.load_state_dict(saved["kfac"])
    train(model, pre, opt, batches[cut:])
    for p, q in zip(model.parameters(), whole, strict=True):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-14)
    pre.remove()
    return saved
