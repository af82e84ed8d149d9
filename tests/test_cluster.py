"""tools/cluster.py: namespaces on a shaped bridge, one torchrun per node, cleanup, bandwidth shaping."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import ROOT, last_line, run_tool

_spec = importlib.util.spec_from_file_location("kfacflow_cluster_tool", ROOT / "tools" / "cluster.py")
assert _spec is not None and _spec.loader is not None
cluster = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cluster)


def _netns_usable() -> str | None:
    if os.geteuid() != 0:
        return "needs root (network namespaces and tc)"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "needs iproute2 (ip, tc)"
    probe = f"ktprobe{os.getpid()}"
    if subprocess.run(["ip", "netns", "add", probe], capture_output=True).returncode != 0:
        return "`ip netns add` is not permitted here"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


_REASON = _netns_usable()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=str(_REASON))

GLOO_SCRIPT = """
import os, sys, torch, torch.distributed as dist
dist.init_process_group("gloo")
x = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(x)
node = os.environ["KFACFLOW_NODE"]
ok = dist.get_world_size() == 2 and x.item() == 3.0 and os.environ["GLOO_SOCKET_IFNAME"] == "v" + node
print(f"node {node} rank {dist.get_rank()} sum {x.item()}", flush=True)
dist.destroy_process_group()
sys.exit(0 if ok else 1)
"""

FAIL_SCRIPT = """
import os, sys, time
if os.environ["KFACFLOW_NODE"] == "1":
    sys.exit(3)
time.sleep(120)
"""


@pytest.fixture
def prefix() -> Iterator[str]:
    """A namespace prefix of this test alone; asserts that nothing with it is left afterwards."""
    name = f"kt{os.getpid()}{os.urandom(2).hex()}x"
    yield name
    assert _namespaces(name) == []


def _namespaces(prefix: str) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return sorted(line.split()[0] for line in out.splitlines() if line.startswith(prefix))


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return run_tool("cluster.py", *args, timeout=timeout)


def test_context_manager_creates_and_removes_namespaces(prefix: str) -> None:
    with cluster.Cluster(nodes=2, rate="1gbit", prefix=prefix):
        assert _namespaces(prefix) == [f"{prefix}0", f"{prefix}1", f"{prefix}br"]
        qdisc = subprocess.run(["tc", "-n", f"{prefix}0", "qdisc", "show", "dev", "v0"], capture_output=True, text=True)
        assert "rate 1Gbit" in qdisc.stdout
    assert _namespaces(prefix) == []
    with pytest.raises(RuntimeError, match="boom"), cluster.Cluster(nodes=2, prefix=prefix):
        raise RuntimeError("boom")
    assert _namespaces(prefix) == []


def test_leftovers_of_a_crashed_run_are_removed(prefix: str) -> None:
    subprocess.run(["ip", "netns", "add", f"{prefix}7"], check=True)
    with cluster.Cluster(nodes=1, prefix=prefix):
        assert _namespaces(prefix) == [f"{prefix}0", f"{prefix}br"]


def test_gloo_all_reduce_between_two_nodes(prefix: str, tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    script = tmp_path / "allreduce.py"
    script.write_text(GLOO_SCRIPT)
    with cluster.Cluster(nodes=2, prefix=prefix) as c:
        assert c.run([str(script)], nproc_per_node=1, timeout=60) == 0
    out, err = capfd.readouterr()
    assert "node 0 rank 0 sum 3.0" in out
    assert "[node 1] node 1 rank 1 sum 3.0" in err


@pytest.mark.slow
def test_end_to_end_quickstart(prefix: str, tmp_path: Path) -> None:
    proc = _cli("--nodes", "2", "--prefix", prefix, "--timeout", "150", "--", "run.py", "recipes/quickstart.yaml",
                "train.steps=3", "train.progress=false", f"out_dir={tmp_path}", timeout=180)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((Path(last_line(proc)) / "summary.json").read_text())
    assert summary["world_size"] == 2


def test_failing_node_stops_the_others(prefix: str, tmp_path: Path) -> None:
    script = tmp_path / "fail.py"
    script.write_text(FAIL_SCRIPT)
    start = time.monotonic()
    proc = _cli("--prefix", prefix, "--", str(script), timeout=90)
    assert proc.returncode != 0
    assert "error: node 1 exited with code" in proc.stderr
    assert time.monotonic() - start < 45, "the healthy node was not stopped promptly"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signals_tear_down(sig: signal.Signals, prefix: str, tmp_path: Path) -> None:
    script = tmp_path / "sleep.py"
    script.write_text("import time\ntime.sleep(120)\n")
    proc = subprocess.Popen([sys.executable, str(ROOT / "tools" / "cluster.py"), "--prefix", prefix, "--", str(script)],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    deadline = time.monotonic() + 30
    while len(_namespaces(prefix)) < 3 and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(1.0)
    proc.send_signal(sig)
    assert proc.wait(timeout=30) == (143 if sig == signal.SIGTERM else 130)


def test_bad_arguments_exit_2() -> None:
    proc = _cli("--nodes", "0", "--", "run.py")
    assert proc.returncode == 2 and proc.stderr.startswith("error:")
    proc = _cli("--rate", "fast", "--", "run.py")
    assert proc.returncode == 2 and "error:" in proc.stderr


@pytest.mark.slow
def test_rate_shapes_bandwidth(prefix: str) -> None:
    with cluster.Cluster(nodes=2, rate="200mbit", prefix=prefix) as c:
        slow = c.bandwidth(size_mb=8, iters=3)
    with cluster.Cluster(nodes=2, rate="2gbit", prefix=prefix) as c:
        fast = c.bandwidth(size_mb=32, iters=3)
    assert slow < 0.035, slow  # 200 Mbit/s is 0.025 GB/s
    assert slow / fast < 0.5, (slow, fast)
