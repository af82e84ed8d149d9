#!/usr/bin/env bash
# The GPU check in one command, on a machine with one CUDA GPU (about 8 minutes):
#   bash tools/gpu_check.sh [OUT]        # default runs/gpu_check; writes OUT/gpu_check.json and OUT/gpu_check.md
# CUDA-only tests, a 1-rank and a 2-rank (gloo on CUDA tensors) quickstart, and ResNet-50 at 224 px,
# batch 32, 20 steps: SGD, D-KFAC, SPD-KFAC, bf16 autocast off and on, step timing on and off.
# kfac.inverse=cupy_cholesky is checked where CuPy imports (pip install -r requirements-gpu.txt).
set -euo pipefail
cd "$(dirname "$0")/.."
python tools/gpu_check.py --out "${1:-runs/gpu_check}"
