#!/usr/bin/env bash
# Build and install Horovod 0.28.1 (its last release) for the installed torch, then cache the wheel.
#
#   bash tools/install_horovod.sh            # build (about 5 minutes on 2 cores) or reuse the cached wheel
#   KFACFLOW_WHEELS=/shared/wheels bash tools/install_horovod.sh
#
# Why a script: torch >= 2.14's headers need C++20, while Horovod's CMake forces -std=c++14 after any
# CXXFLAGS. A small compiler wrapper rewrites -std=c++11/14/17 to -std=c++20 for host compiles and
# leaves the calls nvcc makes unchanged. Gloo is always built; MPI when an MPI compiler is found;
# NCCL (GPU operations) when a CUDA toolkit is found (such a build also runs on CPU).
set -euo pipefail

VERSION=0.28.1
PYTHON=${PYTHON:-python}
CACHE=${KFACFLOW_WHEELS:-${XDG_CACHE_HOME:-$HOME/.cache}/kfacflow/wheels}

die() { echo "error: $*" >&2; exit 1; }

command -v "$PYTHON" >/dev/null || die "no $PYTHON on PATH"
TORCH=$("$PYTHON" -c 'import torch; print(torch.__version__)' 2>/dev/null) \
  || die "torch is not installed: run pip install -r requirements.txt first"
PYTAG=$("$PYTHON" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
SLOT="$CACHE/horovod-$VERSION-torch-${TORCH//+/_}-$PYTAG"

if "$PYTHON" -c 'import horovod.torch' 2>/dev/null \
  && [ "$("$PYTHON" -c 'import horovod; print(horovod.__version__)')" = "$VERSION" ]; then
  echo "horovod $VERSION is already installed and imports with torch $TORCH"
  exit 0
fi

if ! ls "$SLOT"/horovod-*.whl >/dev/null 2>&1; then
  command -v g++ >/dev/null || die "no g++: install a C++ compiler (apt-get install g++)"
  command -v cmake >/dev/null || "$PYTHON" -m pip install --quiet cmake || die "cmake is missing and pip could not install it"
  WRAP=$(mktemp -d)
  trap 'rm -rf "$WRAP"' EXIT
  cat >"$WRAP/c++" <<'EOF'
#!/usr/bin/env bash
# Host compiles get C++20 (torch's headers need it); what nvcc runs through here stays as it is.
for a in "$@"; do  # nvcc's host passes define these: its own front end parses in the original dialect
  case "$a" in *__NVCC__*|*__CUDACC__*|*cuda_runtime.h*) exec g++ "$@" ;; esac
done
pid=$PPID
for _ in 1 2 3 4; do
  case "$(ps -o comm= -p "$pid" 2>/dev/null)" in *nvcc*|cudafe*|cicc*) exec g++ "$@" ;; esac
  pid=$(ps -o ppid= -p "$pid" 2>/dev/null | tr -d ' '); [ -n "$pid" ] && [ "$pid" != 0 ] || break
done
args=()
for a in "$@"; do
  case "$a" in
    -std=c++11|-std=c++14|-std=c++17|-std=gnu++11|-std=gnu++14|-std=gnu++17) args+=("-std=c++20") ;;
    *) args+=("$a") ;;
  esac
done
exec g++ "${args[@]}"
EOF
  chmod +x "$WRAP/c++"
  export CXX="$WRAP/c++" CC=gcc
  export HOROVOD_WITH_PYTORCH=1 HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 HOROVOD_WITH_GLOO=1
  if command -v mpicxx >/dev/null; then
    export HOROVOD_WITH_MPI=1; echo "building with MPI ($(command -v mpicxx))"
  else
    export HOROVOD_WITHOUT_MPI=1
  fi
  CUDA_ROOT=""
  NVCC=$(command -v nvcc || true)
  for root in "${CUDA_HOME:-}" /usr/local/cuda ${NVCC:+"$(dirname "$(dirname "$(readlink -f "$NVCC")")")"}; do
    if [ -n "$root" ] && [ -f "$root/include/cuda_runtime.h" ] && [ -x "$root/bin/nvcc" ]; then CUDA_ROOT=$root; break; fi
  done
  if [ -n "$CUDA_ROOT" ]; then
    export HOROVOD_CUDA_HOME="$CUDA_ROOT" CUDA_HOME="$CUDA_ROOT" HOROVOD_GPU_OPERATIONS=NCCL
    # NCCL as torch's pip wheels ship it (nvidia-nccl-*): headers plus libnccl.so.2 without the
    # unversioned name CMake looks for; a small folder of links gives it one.
    NCCL_PKG=$("$PYTHON" -c 'import nvidia.nccl as n; print(list(n.__path__)[0])' 2>/dev/null || true)
    if [ -z "${HOROVOD_NCCL_HOME:-}" ] && [ -n "$NCCL_PKG" ] && [ -f "$NCCL_PKG/lib/libnccl.so.2" ]; then
      mkdir -p "$WRAP/nccl/lib"
      ln -s "$NCCL_PKG/include" "$WRAP/nccl/include"
      ln -s "$NCCL_PKG/lib/libnccl.so.2" "$WRAP/nccl/lib/libnccl.so"
      export HOROVOD_NCCL_HOME="$WRAP/nccl" HOROVOD_NCCL_LINK=SHARED
    fi
    echo "building with CUDA from $CUDA_ROOT (NCCL for GPU tensors, Gloo for CPU tensors)"
  else
    export HOROVOD_CPU_OPERATIONS=gloo
  fi
  mkdir -p "$SLOT"
  echo "building horovod $VERSION for torch $TORCH (several minutes) ..."
  MAKEFLAGS="-j$(nproc)" "$PYTHON" -m pip wheel --no-build-isolation --no-deps --no-cache-dir \
    -w "$SLOT" "horovod==$VERSION" >"$SLOT/build.log" 2>&1 \
    || { tail -30 "$SLOT/build.log" >&2; rm -f "$SLOT"/horovod-*.whl; die "the horovod build failed; full log: $SLOT/build.log"; }
fi

"$PYTHON" -m pip install --quiet --no-deps --force-reinstall "$SLOT"/horovod-*.whl
"$PYTHON" -m pip install --quiet cloudpickle psutil pyyaml packaging  # horovodrun's own needs
"$PYTHON" -c 'import horovod.torch as hvd; print("horovod", __import__("horovod").__version__, "ok; gloo built:", hvd.gloo_built(), "mpi built:", hvd.mpi_built())' \
  || die "horovod installed but does not import; rebuild after removing $SLOT"
