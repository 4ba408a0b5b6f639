#!/usr/bin/env bash
# The checks that need an NVIDIA GPU, in one command, output under OUT:
#
#   bash scripts/gpu_check.sh OUT                 # build here, then run
#   bash scripts/gpu_check.sh --build-only BIN    # build here, no GPU needed
#   bash scripts/gpu_check.sh --prebuilt BIN OUT  # run what --build-only made
#
# The last two are for a GPU machine without Rust: build on another x86-64
# machine, carry BIN over (about 45 MB, compressed), run there from the
# repository's root. --prebuilt runs the binaries BIN holds and says which
# it lacks, so BIN can also travel in parts.
#
# What runs (release profile, so tests and benchmark share one build of
# candle's CUDA kernels):
# - every test gated on the `cuda` feature, with the rest of their files:
#   DataParallel on GPU replicas (sharing GPU 0, or one GPU per replica
#   where the machine has several) for every backward path against one GPU,
#   40 steps of a wide MLP that would expose a missing ordering between
#   streams (tests/equivalence.rs); replicas in another dtype with a 0-dim
#   parameter and BatchNorm buffers (tests/hardening.rs); per-thread-stream
#   devices and two streams of one GPU refused (tests/errors.rs,
#   tests/pipeline.rs); scatter moving
#   only each replica's rows (tests/scatter_gather.rs); a pipeline with a CPU
#   and a GPU stage sharing a weight (tests/pipeline.rs); `NcclGroup` on two
#   thread ranks: collectives against the host group's, agreed errors, a
#   lost rank named, DDP on NCCL against one GPU (tests/nccl.rs; on a
#   one-GPU machine both ranks share it, NCCL_MULTI_RANK_GPU_ENABLE=1);
# - the training benchmark on the GPU (`bench --device cuda`): the
#   reference MLP (launch-bound), a wide MLP 784-4096-4096-10 and the conv
#   net at batch 8192 (compute-bound), one device against DataParallel
#   (replicas sharing GPU 0) and DDP (two thread ranks, a stream each).
# OUT gets device.txt (nvidia-smi, topology), tests.txt, and bench/
# (bench.md, bench.csv, bench.svg). Under 10 minutes on an H100 once built.
#
# Building needs the CUDA compiler. Without a CUDA toolkit it comes from
# PyPI (checked 2026-11-24: `cargo clippy --features cuda --all-targets`
# passes with it on a machine without a GPU; a first build takes about 9
# minutes on 2 cores, most of it candle's kernels):
#   python3 -m venv /work/cudaenv && /work/cudaenv/bin/pip install "nvidia-cuda-nvcc==13.*" "nvidia-cuda-cccl==13.*"
#   (nvidia-cuda-cccl: the headers nvcc 13.x includes, such as <nv/target>; checked 2026-11-25)
#   export PATH=/work/cudaenv/lib/python3.11/site-packages/nvidia/cu13/bin:$PATH
#   export CUDA_COMPUTE_CAP=90        # H100 / H200; no GPU to ask on a build machine
#   export CUDARC_CUDA_VERSION=13040  # cudarc 0.19.10 knows CUDA up to 13.4, the wheel is 13.5
# (the cu12 wheel, nvidia-cuda-nvcc-cu12, ships ptxas but no nvcc).
# Linking (--build-only) also needs the libraries candle links by name:
# libcuda, libcudart, libcublas, libcublasLt, libcurand, libnvrtc, and
# libnccl for the `nccl` feature. Checked 2026-11-24 on a machine without a
# GPU (first release build 10 min on 2 cores, then 42 MB in BIN): the wheels
# hold them as `lib*.so.N` only, and libcuda comes with the driver, so link
# through a folder of unversioned names and a stub libcuda (SONAME
# libcuda.so.1: the GPU machine's driver is loaded at run time):
#   pip install "nvidia-cublas==13.*" nvidia-curand "nvidia-cuda-nvrtc==13.*" nvidia-nccl-cu13
#   W=/work/cudaenv/lib/python3.11/site-packages/nvidia; mkdir -p /tmp/cuda-link; cd /tmp/cuda-link
#   grep -ohE '^\s+fn cu[A-Za-z0-9_]+\(' ~/.cargo/registry/src/*/cudarc-0.19.10/src/driver/sys/mod.rs |
#     grep -oE 'cu[A-Za-z0-9_]+' | sort -u | sed 's/.*/void &(void) {}/' > stub.c
#   gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o libcuda.so stub.c
#   for l in $W/cu13/lib/lib{cudart,cublas,cublasLt,curand,nvrtc}.so.* $W/nccl/lib/libnccl.so.2; do
#     b=$(basename $l); ln -sf $l ${b%%.so*}.so; done
#   export LIBRARY_PATH=/tmp/cuda-link LD_LIBRARY_PATH=$W/cu13/lib:$W/nccl/lib
# At run time the script finds the same libraries in the nvidia-* wheels of
# the machine's Python (the device machines' torch image has them).
set -euo pipefail
cd "$(dirname "$0")/.."

TESTS=(equivalence hardening errors pipeline scatter_gather nccl)
FEATURES=nccl # implies cuda

usage() {
    sed -n '2,7p' "$0" >&2
    exit 2
}

# Builds the CUDA tests and the benchmark into $1 (test binaries named after
# their files, and `bench`).
build() {
    local bin=$1
    mkdir -p "$bin"
    local test_args=()
    for t in "${TESTS[@]}"; do test_args+=(--test "$t"); done
    cargo build --release --features "$FEATURES" --example bench
    cp target/release/examples/bench "$bin/bench"
    # The test executables' paths, from cargo's JSON messages.
    cargo test --release --features "$FEATURES" "${test_args[@]}" --no-run \
        --message-format=json |
        python3 -c '
import json, os, shutil, sys
bin = sys.argv[1]
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and "test" in m["target"]["kind"]:
        shutil.copy(m["executable"], os.path.join(bin, m["target"]["name"]))
' "$bin"
    # Tests find their data through the path they were built in.
    pwd >"$bin/built-in"
    # Stripped and compressed, each binary is about 6 MB instead of 140:
    # what a device machine's 64 MiB carry takes.
    for f in "$bin"/*; do
        case "$f" in *.xz | */built-in) continue ;; esac
        strip "$f" && xz -T0 -6 -f "$f"
    done
    ls -l "$bin"
}

# Unpacks what build() compressed (Python's lzma: no xz needed there).
unpack() {
    python3 - "$1" <<'PY'
import lzma, os, sys
for name in os.listdir(sys.argv[1]):
    if name.endswith(".xz"):
        path = os.path.join(sys.argv[1], name)
        with lzma.open(path) as src, open(path[:-3], "wb") as dst:
            dst.write(src.read())
        os.chmod(path[:-3], 0o755)
PY
}

# Runs what build() made in $1, writing under $2.
run() {
    local bin=$1 out=$2
    mkdir -p "$out"
    local built_in
    built_in=$(cat "$bin/built-in")
    if [ ! -e "$built_in" ]; then
        mkdir -p "$(dirname "$built_in")" && ln -s "$PWD" "$built_in"
    fi
    { nvidia-smi; nvidia-smi topo -m; } >"$out/device.txt" 2>&1 || true
    # Two NCCL ranks on one GPU are refused unless NCCL (2.30+) is told.
    export NCCL_MULTI_RANK_GPU_ENABLE=1
    # CUDA's libraries (cudart, cublas, curand, nvrtc, nccl) from the
    # nvidia-* wheels, where Python has them.
    local wheel_libs
    wheel_libs=$(python3 -c 'import glob, nvidia; print(":".join(d for p in nvidia.__path__ for d in glob.glob(p + "/*/lib")))' 2>/dev/null || true)
    if [ -n "$wheel_libs" ]; then
        export LD_LIBRARY_PATH="$wheel_libs:${LD_LIBRARY_PATH:-}"
    fi
    unpack "$bin"
    local failed=0
    for t in "${TESTS[@]}"; do
        if [ ! -x "$bin/$t" ]; then
            echo "== $t: not in $bin, not run" | tee -a "$out/tests.txt"
            continue
        fi
        echo "== $t" | tee -a "$out/tests.txt"
        "$bin/$t" --test-threads 1 2>&1 | tee -a "$out/tests.txt" || failed=1
    done
    if [ -x "$bin/bench" ]; then
        "$bin/bench" --device cuda --rounds 2 --steps 20 --out "$out/bench" 2>&1 |
            tee "$out/bench.txt" || failed=1
    fi
    return $failed
}

case "${1:-}" in
--build-only)
    [ $# -eq 2 ] || usage
    build "$2"
    ;;
--prebuilt)
    [ $# -eq 3 ] || usage
    run "$2" "$3"
    ;;
"" | -*) usage ;;
*)
    [ $# -eq 1 ] || usage
    nvidia-smi -L
    build target/gpu-check-bin
    run target/gpu-check-bin "$1"
    ;;
esac
