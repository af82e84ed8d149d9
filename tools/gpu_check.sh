#!/usr/bin/env bash
# The GPU check in one command, on a machine with one CUDA GPU (8 minutes, after the first install):
#   bash tools/gpu_check.sh [OUT] [gpu_check.py options]   # default OUT runs/gpu_check: gpu_check.json, gpu_check.md
# See tools/gpu_check.py for what it runs. It brings what it needs: an interpreter (PYTHON, default
# python3) that already imports kfacflow's requirements is used as it is; otherwise a virtual
# environment (GPU_CHECK_VENV, default runs/gpu_check_venv) that sees that interpreter's packages
# (its CUDA torch, its CuPy) gets requirements.txt, and requirements-gpu.txt where CuPy does not
# import there. Never Horovod. Offline, pip takes wheels from a folder: PIP_NO_INDEX=1 PIP_FIND_LINKS=DIR.
# Where the pinned torch cannot be installed, the machine's own torch stays (the report names it).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/gpu_check}
[ $# -gt 0 ] && shift
PY=${PYTHON:-python3}
VENV=${GPU_CHECK_VENV:-runs/gpu_check_venv}
NEEDS='import torch, torchvision, omegaconf, yaml, sklearn, scipy, tensorboard, tqdm, timm, matplotlib, pytest'
NEEDS="$NEEDS, pytest_timeout, kfacflow"
export PYTHONUNBUFFERED=1

die() { echo "error: $*" >&2; exit 2; }
say() { echo "gpu_check: $*"; }

command -v "$PY" >/dev/null || die "no $PY on PATH; set PYTHON to an interpreter with torch."
"$PY" -c 'import torch' 2>/dev/null || die "$PY has no torch; install one for this machine's CUDA first."

if ! "$PY" -c "$NEEDS" 2>/dev/null; then
  if [ ! -x "$VENV/bin/python" ]; then
    say "creating $VENV, which sees $PY's packages"
    "$PY" -m venv "$VENV" || die "$PY cannot make a virtual environment (Debian: apt-get install python3-venv)."
    # A .pth file rather than --system-site-packages: where PY is itself a venv's (the usual CUDA
    # image), that flag would show the base interpreter's packages, without PY's torch.
    site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
    "$PY" -c 'import site; print("\n".join(site.getsitepackages()))' >"$site/gpu_check_parent.pth"
  fi
  PY=$VENV/bin/python
  if ! "$PY" -c "$NEEDS" 2>/dev/null; then
    say "pip install -r requirements.txt"
    if ! "$PY" -m pip install -q -r requirements.txt; then
      say "the pinned requirements did not install; keeping torch $("$PY" -c 'import torch; print(torch.__version__)')"
      others=$("$PY" - <<'EOF'
import re
text = open("pyproject.toml").read()
names = []
for key in ("dependencies", "dev"):
    names += re.findall(r'"([^"]+)"', re.search(rf"^{key} = \[(.*?)\]", text, re.S | re.M).group(1))
print(" ".join(n for n in names if not re.match(r"torch(vision)?\b", n)))
EOF
)
      # shellcheck disable=SC2086 - one requirement a word
      "$PY" -m pip install -q $others || true
    fi
  fi
  "$PY" -c "$NEEDS" || die "kfacflow's requirements do not import in $VENV (offline? PIP_NO_INDEX=1 PIP_FIND_LINKS=DIR)."
fi

if ! "$PY" -c 'import cupy; from cupy_backends.cuda.libs import cusolver' 2>/dev/null; then
  if [ "$PY" = "$VENV/bin/python" ]; then
    say "pip install -r requirements-gpu.txt (CuPy, for kfac.inverse=cupy_cholesky)"
    "$PY" -m pip install -q -r requirements-gpu.txt || say "CuPy did not install: its checks are skipped"
  else  # an interpreter that runs kfacflow is left as it is
    say "CuPy does not import in $PY: the cupy_cholesky checks are skipped (pip install -r requirements-gpu.txt)"
  fi
fi

exec "$PY" tools/gpu_check.py --out "$OUT" "$@"
