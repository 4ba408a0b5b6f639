#!/usr/bin/env bash
# The checks that need an NVIDIA GPU, in one command (CUDA toolkit on PATH):
#   bash scripts/gpu_check.sh
# Runs every test gated on the `cuda` feature: DataParallel's master-device
# check (tests/errors.rs) and a pipeline with a CPU stage and a GPU stage
# sharing a weight (tests/pipeline.rs), with the rest of those files.
set -euo pipefail
cd "$(dirname "$0")/.."
nvidia-smi -L
cargo test --features cuda --test errors --test pipeline
