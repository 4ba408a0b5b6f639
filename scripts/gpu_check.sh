#!/usr/bin/env bash
# The checks that need an NVIDIA GPU, in one command (CUDA toolkit on PATH):
#   bash scripts/gpu_check.sh
# Runs every test gated on the `cuda` feature: DataParallel's master-device
# check (tests/errors.rs) and a pipeline with a CPU stage and a GPU stage
# sharing a weight (tests/pipeline.rs), a replica on a GPU receiving only its
# rows (tests/scatter_gather.rs), with the rest of those files.
#
# Without a CUDA toolkit, the compiler comes from PyPI (checked 2026-11-24:
# `cargo check --features cuda --all-targets` and clippy pass with it on a
# machine without a GPU, 8.6 min on 2 cores, most of it candle's kernels):
#   python3 -m venv /work/cudaenv && /work/cudaenv/bin/pip install "nvidia-cuda-nvcc==13.*"
#   export PATH=/work/cudaenv/lib/python3.11/site-packages/nvidia/cu13/bin:$PATH
#   export CUDA_COMPUTE_CAP=90        # H100 / H200; no GPU to ask on a build machine
#   export CUDARC_CUDA_VERSION=13040  # cudarc 0.19.10 knows CUDA up to 13.4, the wheel is 13.5
# (the cu12 wheel, nvidia-cuda-nvcc-cu12, ships ptxas but no nvcc).
set -euo pipefail
cd "$(dirname "$0")/.."
nvidia-smi -L
cargo test --features cuda --test errors --test pipeline --test scatter_gather
