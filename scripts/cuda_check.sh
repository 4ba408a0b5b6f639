#!/usr/bin/env bash
# The GPU code compiles, on a machine without a GPU: clippy of the `cuda`
# and `nccl` features (`nccl` implies `cuda`), every target, warnings as
# errors. What only a GPU can show (that the code runs) is
# scripts/gpu_check.sh's.
#
# The CUDA compiler comes from PyPI (`nvidia-cuda-nvcc`, and
# `nvidia-cuda-cccl` for the headers it includes) when `nvcc` is
# not on PATH, into a virtual environment outside the checkout; the build
# goes to a target directory outside the checkout too, so later runs on
# the same machine reuse it. Both live in $CANDLE_DP_CUDA_CACHE
# (default /var/cache/candle-dp). Measured on the 2-core development
# machine: the first run builds candle's CUDA kernels (about 9 minutes),
# a later one rechecks candle-dp only (about 1 minute).
#
# If the compiler cannot be installed (PyPI out of reach), the check says
# so and is skipped: that is a missing tool, not a compile error.
set -euo pipefail
cd "$(dirname "$0")/.."

CACHE=${CANDLE_DP_CUDA_CACHE:-/var/cache/candle-dp}
mkdir -p "$CACHE"

nvcc_bin() {
    local dir
    for dir in "$CACHE"/cudaenv/lib/python3*/site-packages/nvidia/cu13/bin; do
        [ -x "$dir/nvcc" ] && echo "$dir" && return
    done
    return 0
}

if ! command -v nvcc >/dev/null 2>&1; then
    bin=$(nvcc_bin)
    if [ -z "$bin" ]; then
        echo "cuda_check: installing the CUDA compiler from PyPI (nvidia-cuda-nvcc 13) into $CACHE/cudaenv"
        if ! { python3 -m venv "$CACHE/cudaenv" &&
            "$CACHE/cudaenv/bin/pip" install -q "nvidia-cuda-nvcc==13.*" "nvidia-cuda-cccl==13.*"; }; then
            echo "cuda_check: SKIPPED: could not install the CUDA compiler from PyPI" >&2
            exit 0
        fi
        bin=$(nvcc_bin)
    fi
    export PATH="$bin:$PATH"
fi
# No GPU to ask: compile for the H100/H200 (compute capability 9.0), and
# tell cudarc a CUDA version it knows (the wheel's 13.5 is newer).
export CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-90}
export CUDARC_CUDA_VERSION=${CUDARC_CUDA_VERSION:-13040}

start=$(date +%s)
CARGO_TARGET_DIR="$CACHE/cuda-target" cargo clippy --features nccl --all-targets -- -D warnings
echo "cuda_check: the cuda and nccl features compile without a warning ($(($(date +%s) - start)) s)"
