"""kfac.inverse=cupy_cholesky: rejected before start without CUDA or CuPy, imported on use only, equal to cholesky.

The tests named ``cuda`` need a CUDA device and CuPy (``pip install -r requirements-gpu.txt``) and
are skipped without them; ``pytest -k cuda`` selects them.
"""

from __future__ import annotations

import contextlib
import logging
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from helpers import ROOT, run_cli
from torch import Tensor, nn

import kfacflow
from kfacflow import UserError, library
from kfacflow.cli import list_entries, main
from kfacflow.configuration.schema import KFACConfig
from kfacflow.kfac.stages import cupy_inverse
from kfacflow.kfac.stages.cupy_inverse import cupy_cholesky
from kfacflow.kfac.stages.inverse import DenseInverse, cholesky_inverse
from kfacflow.kfac.variants import resolve
from kfacflow.perf import Profile
from kfacflow.running import build

NEEDS = "kfac.inverse=cupy_cholesky needs a CUDA device and CuPy (pip install -r requirements-gpu.txt)"
ON_CPU = f"error: {NEEDS}, but this run's device is cpu; on CPU use kfac.inverse=cholesky."
CUDA_AND_CUPY = torch.cuda.is_available() and cupy_inverse._import_error() is None
needs_cuda = pytest.mark.skipif(not CUDA_AND_CUPY, reason="needs a CUDA device and CuPy (requirements-gpu.txt)")
SIZES = [1, 7, 64, 513]


def spd(d: int, seed: int, dtype: torch.dtype = torch.float32, device: str = "cpu") -> Tensor:
    """A well-conditioned SPD factor: eigenvalues within about [0.09, 2.9]."""
    g = torch.Generator().manual_seed(seed)
    b = torch.randn(d, 2 * d, generator=g, dtype=torch.float64)
    return (b @ b.T / (2 * d)).to(device, dtype)


def rel(a: Tensor, b: Tensor) -> float:
    return float(torch.linalg.norm((a - b).double()) / torch.linalg.norm(b.double()))


# --- rejected before anything starts ---------------------------------------------------------------


@pytest.mark.slow
def test_the_cli_rejects_it_on_cpu_before_any_worker_starts(tmp_path: Path) -> None:
    proc = run_cli(
        "recipes/quickstart.yaml",
        "launch.nproc=2",
        "train.steps=1",
        "train.progress=false",
        "dist.device=cpu",
        "kfac.inverse=cupy_cholesky",
        f"out_dir={tmp_path / 'runs'}",
    )
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stderr
    assert lines == [ON_CPU]
    assert not (tmp_path / "runs").exists(), "a run folder was made: the check came after the start"


@pytest.fixture
def root_logging() -> Iterator[None]:
    """The command line configures logging in-process; put it back."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.mark.usefixtures("root_logging")
@pytest.mark.skipif(torch.cuda.is_available(), reason="dist.device=auto picks CUDA here")
def test_the_cli_rejects_it_where_auto_finds_no_gpu(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    argv = ["recipes/quickstart.yaml", "launch.nproc=1", "train.steps=1", "kfac.inverse=cupy_cholesky"]
    assert main([*argv, f"out_dir={tmp_path}"]) == 2
    assert capsys.readouterr().err.splitlines() == [ON_CPU]
    assert list(tmp_path.iterdir()) == []


def test_a_missing_cupy_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken() -> Any:
        raise ImportError("libcusolver.so.11: cannot open shared object file\nmore")

    monkeypatch.setattr(cupy_inverse, "_import", broken)
    expected = f"{NEEDS}, but CuPy does not import (ImportError: libcusolver.so.11: cannot open shared object file)"
    with pytest.raises(UserError) as err:
        build.check_device(resolve(KFACConfig(inverse="cupy_cholesky")), "cuda")
    assert str(err.value) == f"{expected}; install it, or use kfac.inverse=cholesky."


def test_only_a_preconditioning_variant_that_inverts_with_it_is_checked() -> None:
    build.check_device(resolve(KFACConfig(variant="sgd", inverse="cupy_cholesky")), "cpu")
    build.check_device(resolve(KFACConfig(inverse="cholesky")), "cpu")
    for variant in ("d", "spd", "flow", "auto"):
        with pytest.raises(UserError, match="but this run's device is cpu"):
            build.check_device(resolve(KFACConfig(variant=variant, inverse="cupy_cholesky")), "cpu")


@pytest.fixture
def one_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)


@pytest.mark.usefixtures("one_rank")
@pytest.mark.parametrize("variant", ["d", "spd"])
def test_the_library_rejects_it_on_cpu(variant: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # spd plans with a profile it would measure first: the rejection comes before that calibration.
    calibrated: list[Profile] = []
    real = library.calibrate

    def calibrate(*args: Any, **kwargs: Any) -> Profile:
        calibrated.append(real(*args, **kwargs))
        return calibrated[-1]

    monkeypatch.setattr(library, "calibrate", calibrate)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    with pytest.raises(UserError) as err:
        kfacflow.KFACPreconditioner(model, variant, device="cpu", inverse="cupy_cholesky")
    assert str(err.value) == ON_CPU.removeprefix("error: ")
    assert calibrated == []
    assert not model._forward_hooks and not model[0]._forward_hooks, "hooks were left on the model"


# --- registered, and optional ------------------------------------------------------------------------


def test_it_is_listed() -> None:
    listed = list_entries("inverse").splitlines()
    assert any(line.split()[0] == "cupy_cholesky" and "requirements-gpu.txt" in line for line in listed[1:])
    lines = (ROOT / "requirements-gpu.txt").read_text().splitlines()
    assert lines[0].startswith("#") and "pip install -r requirements-gpu.txt" in lines[0]
    assert [line.split()[0] for line in lines if line.strip() and not line.startswith("#")][0].startswith("cupy-cuda")


def test_importing_kfacflow_never_imports_cupy(tmp_path: Path) -> None:
    # An importable stand-in, so that an import of CuPy would show in sys.modules (a missing one would not).
    (tmp_path / "cupy").mkdir()
    (tmp_path / "cupy" / "__init__.py").write_text("")
    code = (
        "import sys; sys.path.insert(0, sys.argv[1])\n"
        "import kfacflow, kfacflow.cli, kfacflow.library\n"
        "from kfacflow.running import build\n"
        "build.load_plugins()\n"
        "print(kfacflow.cli.list_entries('all').count('cupy_cholesky'))\n"
        "from kfacflow.configuration.schema import KFACConfig\n"
        "from kfacflow.kfac.variants import resolve\n"
        "try:\n"
        "    build.check_device(resolve(KFACConfig(inverse='cupy_cholesky')), 'cpu')\n"
        "except kfacflow.UserError:\n"
        "    pass\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('cupy', 'cupy_backends', 'cupyx')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["1", "[]"]


def test_a_run_of_our_own_model_and_data_imports_no_torchvision_scipy_or_sklearn() -> None:
    """Every process of every run imports what it builds: torchvision alone costs 1.5 s of CPU at start."""
    code = (
        "import sys\n"
        "import kfacflow.cli, kfacflow.library, kfacflow.running.trainer\n"
        "from kfacflow.running import build\n"
        "from kfacflow.configuration.schema import DataConfig\n"
        "from kfacflow.data.sets import build_datasets\n"
        "from kfacflow.models.builtin import build_model\n"
        "build.load_plugins()\n"
        "build_model('digits_cnn', 10, 1); build_datasets(DataConfig(name='digits'))\n"
        "heavy = sorted({m.split('.')[0] for m in sys.modules} & {'torchvision', 'scipy', 'sklearn'})\n"
        "build_model('resnet18', 10, 3)  # a torchvision model: registered when it is asked for\n"
        "print(heavy, 'torchvision' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[0] == "[] True"


def test_on_cpu_it_is_cholesky_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    # What a calibration or tools/fit_perf_models.py meets on the CPU: no failure, cholesky's numbers.
    f = spd(9, 0, torch.float64)
    with caplog.at_level(logging.WARNING):
        inv = cupy_cholesky(f, 0.01)
        cupy_cholesky(f, 0.02)
    assert isinstance(inv, DenseInverse) and cupy_cholesky.result is DenseInverse
    assert torch.equal(inv.matrix, cholesky_inverse(f, 0.01).dense())
    assert sum("cupy_cholesky" in r.getMessage() for r in caplog.records) <= 1  # earlier tests may have logged it


# --- the cuSOLVER calls, against a stand-in that follows cuSOLVER's column-major contract ------------


class FakeCusolver:
    """``potrf`` and ``potrs`` as cuSOLVER computes them (column-major, one triangle), on CPU tensors by address."""

    def __init__(self) -> None:
        self.tensors: dict[int, Tensor] = {}
        self.calls: list[str] = []

    def from_dlpack(self, t: Tensor) -> Any:
        self.tensors[t.data_ptr()] = t
        return SimpleNamespace(data=SimpleNamespace(ptr=t.data_ptr()))

    def column_major(self, ptr: int, n: int, ld: int) -> Tensor:
        t = self.tensors[ptr]
        assert t.is_contiguous() and t.shape == (n, n) and ld == n
        return t.T  # element (i, j) at ptr + i + j * ld

    def __getattr__(self, name: str) -> Any:
        if name.endswith("potrf_bufferSize"):
            return lambda handle, uplo, n, a, lda: 3
        if name.endswith("potrf"):
            return lambda *args: self.potrf(name, *args)
        if name.endswith("potrs"):
            return lambda *args: self.potrs(name, *args)
        raise AttributeError(name)

    def potrf(
        self, name: str, handle: int, uplo: int, n: int, a: int, lda: int, work: int, lwork: int, info: int
    ) -> None:
        assert uplo == 0 and lwork == 3 and self.tensors[work].numel() >= lwork
        self.calls.append(name)
        m = self.column_major(a, n, lda)
        lower = m.tril()
        chol, code = torch.linalg.cholesky_ex(lower + lower.tril(-1).T)
        if int(code) == 0:
            m.copy_(torch.where(torch.ones_like(m, dtype=torch.bool).tril(), chol, m))  # the other triangle stays
        self.tensors[info].fill_(int(code))

    def potrs(
        self, name: str, handle: int, uplo: int, n: int, nrhs: int, a: int, lda: int, b: int, ldb: int, info: int
    ) -> None:
        assert uplo == 0 and nrhs == n
        self.calls.append(name)
        chol = self.column_major(a, n, lda).tril()
        rhs = self.column_major(b, n, ldb)
        rhs.copy_(torch.cholesky_solve(rhs.clone(), chol))


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeCusolver:
    solver = FakeCusolver()
    cu = cupy_inverse._CuPy(cupy=solver, cusolver=solver, lower=0)

    @contextlib.contextmanager
    def no_stream(cu: Any, device: torch.device) -> Iterator[int]:
        yield 7

    monkeypatch.setattr(cupy_inverse, "_on_torch_stream", no_stream)
    monkeypatch.setattr(cupy_inverse, "_cupy_for", lambda factor: cu)
    return solver


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("d", SIZES)
def test_the_cusolver_calls_give_cholesky(fake: FakeCusolver, d: int, dtype: torch.dtype) -> None:
    f = spd(d, d, dtype)
    inv = cupy_cholesky(f, 0.01)
    assert fake.calls == [f"{'s' if dtype == torch.float32 else 'd'}{r}" for r in ("potrf", "potrs")]
    assert isinstance(inv, DenseInverse) and inv.matrix.dtype == dtype
    assert torch.equal(inv.matrix, inv.matrix.T) and inv.round_trip_exact()
    assert rel(inv.matrix, cholesky_inverse(f, 0.01).dense()) < (1e-5 if dtype == torch.float32 else 1e-12)


def test_the_retries_and_the_eigen_fallback_are_choleskys(fake: FakeCusolver) -> None:
    q, _ = torch.linalg.qr(spd(6, 1, torch.float64))
    needs_boost = (q * torch.tensor([-0.005, 0.1, 0.5, 1, 2, 3], dtype=torch.float64)) @ q.T
    indefinite = (q * torch.tensor([-5.0, 0.1, 0.5, 1, 2, 3], dtype=torch.float64)) @ q.T
    for f in (needs_boost, indefinite):
        torch.testing.assert_close(cupy_cholesky(f, 0.001).dense(), cholesky_inverse(f, 0.001).dense())
    assert fake.calls.count("dpotrf") == 2 + 3 and fake.calls.count("dpotrs") == 1


# --- on a CUDA device, with CuPy ---------------------------------------------------------------------


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("d", SIZES)
def test_cuda_cupy_matches_cholesky(d: int) -> None:
    f = spd(d, d, device="cuda")
    inv = cupy_cholesky(f, 0.01)
    ref = cholesky_inverse(f, 0.01).dense()
    exact = torch.linalg.inv(f.double() + 0.01 * torch.eye(d, dtype=torch.float64, device="cuda"))
    assert isinstance(inv, DenseInverse) and inv.matrix.dtype == torch.float32
    assert rel(inv.matrix, ref) < 1e-4 and rel(inv.matrix, exact) < 1e-4
    assert torch.equal(inv.matrix, inv.matrix.T)


@pytest.mark.cuda
@needs_cuda
def test_cuda_cupy_float64_and_retries_match_cholesky() -> None:
    f = spd(64, 3, torch.float64, "cuda")
    assert rel(cupy_cholesky(f, 1e-3).dense(), cholesky_inverse(f, 1e-3).dense()) < 1e-10
    q, _ = torch.linalg.qr(spd(6, 1, torch.float64, "cuda"))
    for smallest in (-0.005, -5.0):  # needs 10x damping; stays indefinite (eigendecomposition)
        scales = torch.tensor([smallest, 0.1, 0.5, 1, 2, 3], dtype=torch.float64, device="cuda")
        g = (q * scales) @ q.T
        assert rel(cupy_cholesky(g, 1e-3).dense(), cholesky_inverse(g, 1e-3).dense()) < 1e-10


@pytest.mark.cuda
@needs_cuda
def test_cuda_cupy_shares_memory_without_copies() -> None:
    cu = cupy_inverse._import()
    f = spd(64, 0, device="cuda")
    with cupy_inverse._on_torch_stream(cu, f.device):
        assert cupy_inverse._ptr(cu.cupy, f) == f.data_ptr()  # CuPy's view is torch's memory
    inv = cupy_cholesky(f, 0.01)
    assert isinstance(inv, DenseInverse) and inv.matrix.device == f.device and inv.matrix.is_contiguous()


@pytest.mark.cuda
@needs_cuda
def test_cuda_cupy_runs_on_a_non_default_stream() -> None:
    cu = cupy_inverse._import()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        # Made on the side stream and inverted at once: cuSOLVER must queue behind these kernels.
        f = spd(513, 5, device="cuda") * 2.0
        inv = cupy_cholesky(f, 0.01).dense()
        handle = cu.cupy.cuda.device.get_cusolver_handle()
        assert cu.cusolver.getStream(handle) == side.cuda_stream
        out = inv.clone()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    assert rel(out, cholesky_inverse(f, 0.01).dense()) < 1e-4
