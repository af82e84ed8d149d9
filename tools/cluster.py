"""Emulate an N-node cluster on this machine: network namespaces on a shaped Linux bridge, one torchrun per node.

``python tools/cluster.py [--nodes 2] [--nproc-per-node 1] [--rate 1gbit] [--delay 0ms] [--prefix kfcl]
[--threads N] [--timeout S] [--check] -- run.py RECIPE.yaml key=value ...``

Each node ``i`` is a namespace ``{prefix}{i}`` holding ``lo`` and one end (``v{i}``, 10.77.0.{i+1}/24) of a veth
pair whose other end (``p{i}``) sits on bridge ``br0`` in a namespace ``{prefix}br`` of its own, so nothing is
added to the root namespace and no traffic leaves the machine. Both ends' egress is shaped (``tbf``; ``netem`` when
``--delay`` is given, if the kernel has it), so each node has a full-duplex link of ``--rate``. The program after
``--`` runs on every node as ``python -m torch.distributed.run --nnodes N --node-rank i --master-addr 10.77.0.1``
(static rendezvous, the default when a node rank is given) with ``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME`` set
to the node's veth, ``KFACFLOW_NODE=i`` and ``OMP_NUM_THREADS``. ``--check`` measures gloo all-reduce bandwidth
between nodes 0 and 1 instead. Each namespace gets an ``/etc/netns/{name}/hosts`` naming the nodes, so
no lookup goes to DNS. Everything is removed on exit, failure, Ctrl-C and SIGTERM (and leftovers with the same
prefix at start). Needs root, ``ip`` and ``tc``. At the end of a successful run torchrun may log "Error waiting on
exit barrier" on a node other than 0: a race in torch (pytorch/pytorch#69520); exit codes are unaffected.

Timing claims about pipelining (async all-reduce overlapping compute) belong on such a cluster: on plain loopback
the workers share the same cores and a near-infinite link, so communication costs CPU instead of wire time and an
overlapped schedule looks slower than a serial one.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

ROOT = Path(__file__).resolve().parents[1]
SUBNET = "10.77.0"
MASTER_PORT = 29500
BENCH_PORT = 29600
ETC_NETNS = Path("/etc/netns")
_SCALE = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_UNITS = {**{k + "bit": v for k, v in _SCALE.items()}, **{k + "bps": 8 * v for k, v in _SCALE.items()}}


class ClusterError(RuntimeError):
    """A cluster cannot be set up (not root, missing tools, bad arguments)."""


def _quantity(text: str, units: dict[str, float], example: str) -> float:
    """Parse a tc quantity (``1gbit``, ``5ms``) into base units (bit/s, s)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([a-z]*)\s*", text.lower())
    if not m or m.group(2) not in units or (units is _UNITS and float(m.group(1)) == 0):
        raise ClusterError(f"bad value {text!r}; use e.g. {example}")
    return float(m.group(1)) * units[m.group(2)]


def _sh(*cmd: str, check: bool = True) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise ClusterError(f"`{' '.join(cmd)}` failed: {proc.stderr.strip()}")
    return proc.stdout


class Cluster:
    """N network namespaces on a shaped bridge; a context manager that sets them up and always tears them down.

    Args:
        nodes: Number of nodes (namespaces), 1 to 253.
        rate: Link rate of every node, in tc syntax (``1gbit``); both directions are shaped.
        delay: One-way delay added on each egress (``0ms``: none; anything else needs ``netem``).
        prefix: Namespace name prefix: nodes are ``{prefix}0``..., the bridge lives in ``{prefix}br``.
    """

    def __init__(self, nodes: int = 2, rate: str = "1gbit", delay: str = "0ms", prefix: str = "kfcl") -> None:
        if not 1 <= nodes <= 253:
            raise ClusterError(f"--nodes must be between 1 and 253, got {nodes}")
        if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_-]{0,30}", prefix):
            raise ClusterError(f"bad prefix {prefix!r}; use letters, digits, - and _")
        self.nodes, self.rate, self.delay, self.prefix = nodes, rate, delay, prefix
        self.bits = _quantity(rate, _UNITS, "1gbit, 200mbit")
        self.delay_s = _quantity(delay, {"s": 1.0, "ms": 1e-3, "us": 1e-6, "": 1e-6}, "0ms, 5ms")
        self.names = [f"{prefix}{i}" for i in range(nodes)]
        self.bridge_ns = f"{prefix}br"

    @staticmethod
    def ip(node: int) -> str:
        """Return node ``node``'s address."""
        return f"{SUBNET}.{node + 1}"

    def __enter__(self) -> Cluster:
        if os.geteuid() != 0:
            raise ClusterError("tools/cluster.py needs root (network namespaces and tc)")
        missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
        if missing:
            raise ClusterError(f"missing {' and '.join(missing)} (install iproute2)")
        self.teardown(leftovers=True)
        try:
            self._setup()
        except BaseException:
            self.teardown()
            raise
        return self

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None) -> None:
        self.teardown()

    def _shape(self, ns: str, dev: str) -> None:
        if self.delay_s > 0:
            qdisc = ["netem", "rate", self.rate, "delay", self.delay, "limit", "100000"]
        else:  # tbf: burst of 4 ms (at least two 64 KiB GSO segments), queue of 50 ms
            burst = str(int(max(self.bits / 8 * 0.004, 140_000)))
            qdisc = ["tbf", "rate", self.rate, "burst", burst, "latency", "50ms"]
        try:
            _sh("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", *qdisc)
        except ClusterError as err:
            raise ClusterError(f"{err}{' (--delay needs the netem qdisc)' if self.delay_s > 0 else ''}") from None

    def _setup(self) -> None:
        br = self.bridge_ns
        hosts = Path("/etc/hosts").read_text() if Path("/etc/hosts").is_file() else "127.0.0.1 localhost\n"
        hosts += "".join(f"{self.ip(i)} {ns}\n::ffff:{self.ip(i)} {ns}\n" for i, ns in enumerate(self.names))
        steps = [f"netns add {br}", f"-n {br} link add br0 type bridge", f"-n {br} link set br0 up"]
        for i, ns in enumerate(self.names):
            (ETC_NETNS / ns).mkdir(parents=True, exist_ok=True)  # `ip netns exec` mounts it over /etc/hosts:
            (ETC_NETNS / ns / "hosts").write_text(hosts)  # node names resolve locally, no DNS lookups
            steps += [f"netns add {ns}", f"-n {ns} link set lo up"]
            steps += [f"-n {ns} link add v{i} type veth peer p{i} netns {br}"]
            steps += [f"-n {ns} addr add {self.ip(i)}/24 dev v{i}", f"-n {ns} link set v{i} up"]
            steps += [f"-n {br} link set p{i} master br0 up"]
        for step in steps:
            _sh("ip", *step.split())
        for i, ns in enumerate(self.names):
            self._shape(ns, f"v{i}")
            self._shape(br, f"p{i}")

    def teardown(self, leftovers: bool = False) -> None:
        """Kill what runs in this cluster's namespaces and delete them (all with this prefix if ``leftovers``)."""
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        try:
            pattern = re.compile(rf"{re.escape(self.prefix)}(\d+|br)")
            listed = [line.split()[0] for line in _sh("ip", "netns", "list", check=False).splitlines() if line.strip()]
            names = [n for n in listed if pattern.fullmatch(n)] if leftovers else self.names + [self.bridge_ns]
            for name in (n for n in names if n in listed):
                for pid in _sh("ip", "netns", "pids", name, check=False).split():
                    with contextlib.suppress(ProcessLookupError, ValueError):
                        os.kill(int(pid), signal.SIGKILL)
                _sh("ip", "netns", "del", name, check=False)
            etc = [p.name for p in ETC_NETNS.glob(f"{self.prefix}*")] if leftovers else self.names
            for name in (n for n in etc if pattern.fullmatch(n)):
                shutil.rmtree(ETC_NETNS / name, ignore_errors=True)
            with contextlib.suppress(OSError):  # not empty, or already gone (ip netns del may remove it)
                ETC_NETNS.rmdir()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)

    def _env(self, node: int, threads: int, env: dict[str, str] | None = None) -> dict[str, str]:
        out = {**os.environ, **(env or {}), "GLOO_SOCKET_IFNAME": f"v{node}", "NCCL_SOCKET_IFNAME": f"v{node}"}
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            out.pop(key, None)
        out.update(KFACFLOW_NODE=str(node), PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(threads))
        return out

    def spawn(self, node: int, cmd: Sequence[str], env: dict[str, str], **kw: object) -> subprocess.Popen[str]:
        """Start ``cmd`` inside node ``node``'s namespace (own session), from the repository root."""
        return subprocess.Popen(["ip", "netns", "exec", self.names[node], *cmd], cwd=ROOT, env=env, text=True,
                                start_new_session=True, **kw)  # type: ignore[call-overload]  # fmt: skip

    def run(self, argv: Sequence[str], nproc_per_node: int = 1, env: dict[str, str] | None = None,
            timeout: float | None = None, threads: int | None = None) -> int:  # fmt: skip
        """Run ``argv`` (a python script and its arguments) under one torchrun per node; wait for all.

        Node 0's output goes to stdout/stderr as is; other nodes' lines go to stderr prefixed ``[node i]``.
        If one node fails, the others are terminated.

        Args:
            argv: Script path (relative to the repository root or absolute) and arguments.
            nproc_per_node: Workers per node.
            env: Extra environment variables for every node.
            timeout: Seconds before everything is killed (exit code 124); None waits forever.
            threads: ``OMP_NUM_THREADS`` per worker; default: cores // (nodes * nproc_per_node), at least 1.

        Returns:
            The first failing node's exit code (128 + signal for a signal), 124 on timeout, else 0.
        """
        threads = threads or max(1, (os.cpu_count() or 1) // (self.nodes * nproc_per_node))
        procs: list[subprocess.Popen[str]] = []
        relays: list[threading.Thread] = []
        try:
            for i in range(self.nodes):
                cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(self.nodes),
                       "--nproc-per-node", str(nproc_per_node), "--node-rank", str(i), "--rdzv-backend", "static",
                       "--master-addr", self.ip(0), "--master-port", str(MASTER_PORT), *argv]  # fmt: skip
                pipe = {} if i == 0 else {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT}
                procs.append(self.spawn(i, cmd, self._env(i, threads, env), **pipe))
                if i:
                    relays.append(threading.Thread(target=_relay, args=(procs[-1], f"[node {i}] "), daemon=True))
                    relays[-1].start()
            node, code = _wait(procs, timeout)
        except TimeoutError:
            node, code = -1, 124
        finally:
            _stop(procs)
            for relay in relays:
                relay.join(timeout=5)
        if code == 124 and node < 0:
            print(f"error: timed out after {timeout:g} s; stopped all nodes", file=sys.stderr)
        elif code:
            print(f"error: node {node} exited with code {code}; stopped the others", file=sys.stderr)
        return code

    def bandwidth(self, size_mb: int = 64, iters: int = 3, timeout: float = 120) -> float:
        """Measure gloo all-reduce bandwidth between nodes 0 and 1, in GB/s (bytes each rank sends per second).

        Args:
            size_mb: Size of the float32 tensor all-reduced.
            iters: Timed all-reduces (after one warm-up).
            timeout: Seconds before giving up.
        """
        if self.nodes < 2:
            raise ClusterError("--check needs at least 2 nodes")
        procs = []
        try:
            for rank in (0, 1):
                cmd = [sys.executable, str(Path(__file__).resolve()), "_bench", str(rank), str(size_mb), str(iters)]
                env = self._env(rank, max(1, (os.cpu_count() or 1) // 2), {"TORCH_CPP_LOG_LEVEL": "ERROR"})
                procs.append(self.spawn(rank, cmd, env, stdout=subprocess.PIPE))
            if _wait(procs, timeout)[1] != 0:
                raise ClusterError("bandwidth check failed; see its output above")
            assert procs[0].stdout is not None
            return float(json.loads(procs[0].stdout.read().strip().splitlines()[-1])["gbps"])
        except TimeoutError:
            raise ClusterError(f"bandwidth check timed out after {timeout:g} s") from None
        finally:
            _stop(procs)


def _relay(proc: subprocess.Popen[str], prefix: str) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        sys.stderr.write(prefix + line)
        sys.stderr.flush()


def _wait(procs: list[subprocess.Popen[str]], timeout: float | None) -> tuple[int, int]:
    """Return (node, exit code) of the first process to fail, or (-1, 0) once all succeeded.

    Raises:
        TimeoutError: After ``timeout`` seconds.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        codes = [p.poll() for p in procs]
        for node, code in enumerate(codes):
            if code:
                return node, 128 - code if code < 0 else code
        if all(code == 0 for code in codes):
            return -1, 0
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError
        time.sleep(0.1)


def _stop(procs: list[subprocess.Popen[str]], grace: float = 5.0) -> None:
    """SIGTERM the still-running process groups, then SIGKILL what is left after ``grace`` seconds."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        live = [p for p in procs if p.poll() is None]
        for p in live:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, sig)
        end = time.monotonic() + grace
        while any(p.poll() is None for p in live) and time.monotonic() < end:
            time.sleep(0.05)


def _bench(rank: int, size_mb: int, iters: int) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://{Cluster.ip(0)}:{BENCH_PORT}", rank=rank, world_size=2)
    x = torch.ones(size_mb * 2**18)
    dist.all_reduce(x)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(x)
    seconds = time.perf_counter() - start
    if rank == 0:  # ring all-reduce on 2 ranks: each rank sends (and receives) the tensor's size
        print(json.dumps({"gbps": x.numel() * 4 * iters / seconds / 1e9, "seconds": seconds}), flush=True)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    """Parse the command line, set up the cluster, run the program (or ``--check``), tear down; return the code."""
    import argparse

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_bench"]:
        _bench(int(argv[1]), int(argv[2]), int(argv[3]))
        return 0
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(prog="tools/cluster.py", usage="%(prog)s [options] -- run.py RECIPE [k=v ...]",
                                     description=__doc__.split("\n\n")[0])  # fmt: skip
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--nproc-per-node", type=int, default=1)
    parser.add_argument("--rate", default="1gbit", help="link rate per node, tc syntax (default 1gbit)")
    parser.add_argument("--delay", default="0ms", help="one-way delay per egress (needs netem)")
    parser.add_argument("--prefix", default="kfcl", help="namespace name prefix")
    parser.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS per worker")
    parser.add_argument("--timeout", type=float, default=None, help="kill everything after this many seconds")
    parser.add_argument("--check", action="store_true", help="measure node 0 <-> node 1 bandwidth and exit")
    args = parser.parse_args(argv[:split])
    program = argv[split + 1 :]
    if not args.check and not program:
        parser.error("give a program after --, e.g. -- run.py recipes/quickstart.yaml")
    if args.nproc_per_node < 1 or (args.threads is not None and args.threads < 1):
        parser.error("--nproc-per-node and --threads must be at least 1")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even where started with SIGINT ignored
    try:
        with Cluster(args.nodes, args.rate, args.delay, args.prefix) as cluster:
            if args.check:
                gbps = cluster.bandwidth()
                print(f"node 0 <-> node 1 at {args.rate}: {gbps:.3f} GB/s all-reduce bandwidth", flush=True)
                return 0
            return cluster.run(program, args.nproc_per_node, timeout=args.timeout, threads=args.threads)
    except ClusterError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
