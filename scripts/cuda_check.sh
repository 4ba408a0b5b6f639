#!/usr/bin/env bash
# The GPU code compiles, on a machine without a GPU: clippy of the `cuda`
# and `nccl` features (`nccl` implies `cuda`), every target, warnings as
# errors. What only a GPU can show (that the code runs) is
# scripts/gpu_check.sh's.
#
# candle's CUDA backend embeds kernels that nvcc compiles from C++ while
# candle-kernels builds. Checking candle-dp's Rust code needs those files
# to exist, not to hold kernels, so by default a stand-in compiler writes
# empty ones (scripts/cuda-stand-in/nvcc): the check then takes about 2
# minutes on a fresh 2-core machine instead of about 7. The trade: this
# check no longer compiles candle's own kernels; scripts/gpu_check.sh does,
# with the real compiler, on every GPU run.
#
# CANDLE_DP_CUDA_KERNELS=1 (or a real `nvcc` on PATH) builds them with the
# real compiler: `nvidia-cuda-nvcc` and `nvidia-cuda-cccl` from PyPI, into a
# virtual environment outside the checkout, when `nvcc` is not on PATH.
# The build goes to a target directory outside the checkout, so later runs
# on the same machine reuse it. Both live in $CANDLE_DP_CUDA_CACHE
# (default /var/cache/candle-dp).
#
# If the real compiler cannot be installed (PyPI out of reach), the check
# says so and is skipped: that is a missing tool, not a compile error.
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

if command -v nvcc >/dev/null 2>&1; then
    target="$CACHE/cuda-target"
elif [ "${CANDLE_DP_CUDA_KERNELS:-0}" = 1 ]; then
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
    target="$CACHE/cuda-target"
else
    echo "cuda_check: candle's kernels stand in empty (scripts/cuda-stand-in/nvcc); CANDLE_DP_CUDA_KERNELS=1 compiles them"
    export PATH="$(pwd)/scripts/cuda-stand-in:$PATH"
    # Its own target directory: candle-kernels' build script does not
    # rerun when the compiler changes, so empty kernels never meet real ones.
    target="$CACHE/cuda-target-stand-in"
fi
# No GPU to ask: compile for the H100/H200 (compute capability 9.0), and
# tell cudarc a CUDA version it knows (the wheel's 13.5 is newer).
export CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-90}
export CUDARC_CUDA_VERSION=${CUDARC_CUDA_VERSION:-13040}

start=$(date +%s)
CARGO_TARGET_DIR="$target" cargo clippy --features nccl --all-targets -- -D warnings
echo "cuda_check: the cuda and nccl features compile without a warning ($(($(date +%s) - start)) s)"
