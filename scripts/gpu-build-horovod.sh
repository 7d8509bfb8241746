#!/usr/bin/env bash
# Build Horovod 0.28.1 with NCCL against the PyTorch of a GPU machine that has no TensorFlow
# (such as the project's lent device machine: Python 3.12, PyTorch, CUDA 13, no network), so
# that scripts/gpu-check.sh can still measure Horovod's NCCL allreduce and its failure handling
# there. It is a check-only build: the product's image builds Horovod against TensorFlow
# (Dockerfile.gpu). Horovod's C++ core (controller, Gloo, NCCL operations) is the same for both
# frameworks; only the thin framework adapter differs.
#
#   scripts/gpu-build-horovod.sh SDIST TARGET [--cpu]
#
# SDIST: horovod-0.28.1.tar.gz (`pip download --no-binary :all: --no-deps horovod==0.28.1`).
# TARGET: a folder to install into (put it on PYTHONPATH). --cpu: without CUDA and NCCL (to
# try the PyTorch adapter's build where there is no GPU). $PYTHON: the interpreter with PyTorch
# (default python3). The project's patch set is applied (as by elastic_allreduce.horovod_build);
# Horovod 0.28.1 also predates PyTorch 2.1 and CUDA 13, so three lines of its CMake files are
# changed here: C++17 for the core and the PyTorch adapter (PyTorch >= 2.1
# needs it) and for the CUDA kernels (CUDA 13's headers need it). The kernels are built for the
# GPUs present (compute capability from nvidia-smi; $HOROVOD_BUILD_CUDA_CC_LIST overrides), as
# CUDA 13 no longer builds the old ones Horovod lists by default. NCCL is the one PyTorch's
# wheels bring (nvidia-nccl-*), else $HOROVOD_NCCL_HOME.
set -euo pipefail
sdist=$1
target=$2
cpu=${3:-}
python=${PYTHON:-python3}
work=$(mktemp -d "${TMPDIR:-/tmp}/hvd-build.XXXXXX")
trap 'rm -rf "$work"' EXIT

tar -xzf "$sdist" -C "$work"
src=$(echo "$work"/horovod-*)
# The project's own patch set first, as every build of Horovod here gets it
# (elastic_allreduce/horovod_build/patches: TensorFlow and Keras changes, harmless to PyTorch's).
for patch in "$(dirname "$0")"/../elastic_allreduce/horovod_build/patches/*.patch; do
  patch -p1 --forward --batch --silent -d "$src" -i "$(realpath "$patch")"
done
sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' \
  "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt"
sed -i 's/set(CMAKE_CUDA_STANDARD 11)/set(CMAKE_CUDA_STANDARD 17)/' \
  "$src/horovod/common/ops/cuda/CMakeLists.txt"
if [ "$(grep -c 'STANDARD 17' "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt" \
  "$src/horovod/common/ops/cuda/CMakeLists.txt" | awk -F: '{s += ($2 > 0)} END {print s}')" != 3 ]; then
  echo "gpu-build-horovod: the C++17 changes did not apply: is $sdist Horovod 0.28.1?" >&2
  exit 2
fi

export HOROVOD_WITH_PYTORCH=1 HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1
export HOROVOD_WITHOUT_MPI=1 HOROVOD_WITH_GLOO=1
export MAKEFLAGS="-j$(nproc)"
# CMake 4 refuses Horovod's bundled Gloo (cmake_minimum_required 2.8.12) without this.
export CMAKE_POLICY_VERSION_MINIMUM=${CMAKE_POLICY_VERSION_MINIMUM:-3.5}
# GCC 13 no longer includes these headers through others; Horovod 0.28.1's sources assume it.
export CXXFLAGS="${CXXFLAGS:-} -include cstdint -include string -include stdexcept"
if [ "$cpu" != --cpu ]; then
  export HOROVOD_GPU_OPERATIONS=NCCL HOROVOD_NCCL_LINK=SHARED
  if [ -z "${HOROVOD_NCCL_HOME:-}" ]; then
    nccl=$("$python" -c 'import nvidia.nccl, os; print(os.path.dirname(nvidia.nccl.__file__) if nvidia.nccl.__file__ else list(nvidia.nccl.__path__)[0])')
    # Horovod's FindNCCL looks for libnccl.so; the wheel has libnccl.so.2 only.
    mkdir -p "$work/nccl/lib"
    ln -s "$nccl/lib/libnccl.so.2" "$work/nccl/lib/libnccl.so"
    ln -s "$nccl/include" "$work/nccl/include"
    export HOROVOD_NCCL_HOME=$work/nccl
  fi
  if [ -z "${HOROVOD_BUILD_CUDA_CC_LIST:-}" ]; then
    HOROVOD_BUILD_CUDA_CC_LIST=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader |
      tr -d . | sort -u | paste -sd,)
    export HOROVOD_BUILD_CUDA_CC_LIST
  fi
  if [ -z "${HOROVOD_CUDA_HOME:-}" ]; then
    nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
    HOROVOD_CUDA_HOME=$(dirname "$(dirname "$(readlink -f "$nvcc")")")
  fi
  export HOROVOD_CUDA_HOME CUDA_HOME=${CUDA_HOME:-$HOROVOD_CUDA_HOME}
  echo "gpu-build-horovod: CUDA $HOROVOD_CUDA_HOME, NCCL $HOROVOD_NCCL_HOME," \
    "compute capabilities $HOROVOD_BUILD_CUDA_CC_LIST" >&2
fi
"$python" -m pip install --no-deps --no-build-isolation --no-cache-dir --target "$target" "$src"
