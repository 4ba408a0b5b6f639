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
#   streams (tests/suite/equivalence.rs); replicas in another dtype with a 0-dim
#   parameter and BatchNorm buffers (tests/suite/hardening.rs); per-thread-stream
#   devices and two streams of one GPU refused (tests/suite/errors.rs,
#   tests/suite/pipeline.rs); scatter moving
#   only each replica's rows (tests/suite/scatter_gather.rs); a pipeline with a CPU
#   and a GPU stage sharing a weight, and an interleaved one whose
#   stages alternate between the CPU and the GPU (tests/suite/pipeline.rs);
#   `NcclGroup` on two
#   thread ranks: collectives against the host group's, agreed errors, a
#   lost rank named, DDP on NCCL against one GPU (tests/suite/nccl.rs; on a
#   one-GPU machine both ranks share it, NCCL_MULTI_RANK_GPU_ENABLE=1, and
#   an NCCL older than 2.30 skips them, saying so); the one Fabric loop
#   under every strategy in f32, bf16 and f16 (tests/suite/fabric.rs);
#   the optimizers and the fused ops on the GPU (optim.rs, ops.rs);
# - the language model on the GPU (`train_lm`, lm.txt): one GPU against
#   the CPU, then FSDP, ZeRO, DDP, HSDP, ZeRO on a mesh and pipelines on
#   stage ranks beside one GPU (GPU_CHECK_LM=0 leaves it out);
# - the training benchmark on the GPU (`bench --device cuda`): the
#   reference MLP (launch-bound), a wide MLP 784-4096-4096-10 and the conv
#   net at batch 8192 (compute-bound), one device against DataParallel
#   (replicas sharing GPU 0) and DDP (two thread ranks, a stream each).
# - the host transfers of a step, counted: each training kind of the
#   benchmark (MLP, batch 256, 2 replicas or ranks) runs twice under
#   scripts/cuda_api_count.c (CUPTI's driver-API callbacks), 10 and 30
#   steps; the difference over 20 steps is the count per step; then the
#   Fabric's strategies, a pipeline on stage ranks among them.
# OUT gets device.txt (nvidia-smi, topology), tests.txt, transfers.md and
# bench/ (bench.md, bench.csv, bench.svg). Under 10 minutes on an H100
# once built.
#
# Building needs the CUDA compiler. Without a CUDA toolkit it comes from
# PyPI, and its version must not be newer than the GPU machine's driver
# (nvidia-smi's "CUDA Version"): candle's kernels travel as PTX, which the
# driver compiles when they are loaded, and a driver for CUDA 13.0 refuses
# the PTX of nvcc 13.5 (CUDA_ERROR_UNSUPPORTED_PTX_VERSION, seen 2026-11-25
# on the H100 with driver 580.159.04). Pin every compiler wheel:
#   python3 -m venv /work/cuda130env && /work/cuda130env/bin/pip install "nvidia-cuda-nvcc==13.0.*" \
#     "nvidia-cuda-cccl==13.0.*" "nvidia-cuda-runtime==13.0.*" "nvidia-nvvm==13.0.*" "nvidia-cuda-crt==13.0.*"
#   (nvidia-cuda-cccl: the headers nvcc 13.x includes, such as <nv/target>; nvvm and crt
#   would otherwise come as the newest 13.x, and nvvm writes the PTX)
#   export PATH=/work/cuda130env/lib/python3.11/site-packages/nvidia/cu13/bin:$PATH
#   export CUDA_COMPUTE_CAP=90        # H100 / H200; no GPU to ask on a build machine
#   export CUDARC_CUDA_VERSION=13000  # the driver's CUDA version
#   (a first release build: 7 minutes on 2 cores, most of it candle's kernels)
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
# The transfer counter (scripts/cuda_api_count.c) is built where CUPTI's
# headers are: pip install "nvidia-cuda-cupti==13.*" and
# export CUPTI_DIR=$W/cu13.
# At run time the script finds the same libraries in the nvidia-* wheels of
# the machine's Python (the device machines' torch image has them), after
# LD_LIBRARY_PATH's own. Two NCCL ranks on one GPU need NCCL 2.30 or later;
# the device image's is 2.28.9 ("Duplicate GPU detected"), so the run of
# 2026-11-25 put the nvidia-nccl-cu13 2.32.3 wheel's libnccl.so.2 first in
# LD_LIBRARY_PATH (268 MB compressed: carried in five parts of 54 MB, one
# call each, to a machine kept warm between the calls).
set -euo pipefail
cd "$(dirname "$0")/.."

# The subjects of tests/suite (one test binary) with CUDA tests: each runs
# as `suite --test-threads 1 <subject>::`.
# GPU_CHECK_TESTS="a b" runs those instead (the nccl subject needs NCCL
# 2.30+ for two ranks on one GPU: leave it out where the machine's is
# older and none is carried).
# A name with `::` is a filter of its own (one subject's GPU tests).
read -r -a TESTS <<<"${GPU_CHECK_TESTS:-equivalence hardening errors pipeline scatter_gather \
fabric::one_loop_trains_every_strategy_on_the_gpu optim::sgd_adam_and_adamw_follow_pytorch_on_the_gpu \
ops::fused_ops_on_the_gpu nccl}"
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
    local test_args=(--test suite)
    cargo build --release --features "$FEATURES" --example bench --example train_lm
    cp target/release/examples/bench "$bin/bench"
    cp target/release/examples/train_lm "$bin/train_lm"
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
    build_counter "$bin"
    # Tests find their data through the path they were built in.
    pwd >"$bin/built-in"
    # Stripped and compressed, each binary is about 6 MB instead of 140:
    # what a device machine's 64 MiB carry takes.
    for f in "$bin"/*; do
        case "$f" in *.xz | *.so | */built-in) continue ;; esac
        strip "$f" && xz -T0 -6 -f "$f"
    done
    ls -l "$bin"
}

# Builds scripts/cuda_api_count.c into $1, where CUPTI's headers are found:
# in $CUPTI_DIR (include/, lib/), or beside nvcc (the nvidia-cuda-cupti
# wheel's or a CUDA toolkit's); without them the transfers are not
# counted, and the run says so.
build_counter() {
    local nvcc_dir dir
    nvcc_dir=$(dirname "$(command -v nvcc)")
    for dir in ${CUPTI_DIR:-} "$nvcc_dir/.." "$nvcc_dir/../extras/CUPTI"; do
        if [ -f "$dir/include/cupti.h" ]; then
            # The wheel has libcupti.so.N only: link the file itself.
            local lib
            lib=$(ls "$dir"/lib*/libcupti.so* | head -1)
            gcc -shared -fPIC -O2 -I"$dir/include" -o "$1/libcuda_api_count.so" \
                scripts/cuda_api_count.c "$lib"
            return
        fi
    done
    echo "gpu_check: no cupti.h beside nvcc: host transfers will not be counted" >&2
}

# Counts each training kind's CUDA copies per step (see the top), into
# $2/transfers.md.
count_transfers() {
    local bin=$1 out=$2 counts kind replicas steps spec
    if [ ! -f "$bin/libcuda_api_count.so" ]; then
        echo "not counted: $bin has no libcuda_api_count.so" >"$out/transfers.md"
        return 0
    fi
    counts=$(mktemp -d)
    for kind in single dp-fast dp-fromloss dp-dropin ddp ddp-nccl; do
        replicas=2
        [ "$kind" = single ] && replicas=1
        for steps in 10 30; do
            spec="{\"kind\":\"$kind\",\"model\":\"mlp\",\"batch\":256,\"replicas\":$replicas,\"threads\":1,\"warmup\":3,\"steps\":$steps,\"device\":\"cuda\"}"
            CUDA_API_COUNT_OUT="$counts/$kind.$steps" LD_PRELOAD="$PWD/$bin/libcuda_api_count.so" \
                "$bin/bench" --child "$spec" >/dev/null || echo "$kind: failed" >>"$counts/failed"
        done
    done
    # Through a Fabric, every rank on GPU 0, the crate's AdamW: the
    # strategies at world size 1 (whose collectives should stay on the
    # GPU) and at 2 (a ThreadGroup: through host memory); a pipeline of 2
    # stages in one process and on 2 stage ranks (activations and
    # gradients sent point to point), and 2 such pipelines under DDP.
    for kind in single:1 ddp:1 zero2:1 fsdp:1 ddp:2 zero2:2 fsdp:2 \
        pipeline:2 pipeline-ranks:2 pipeline-ranks:4; do
        for steps in 10 30; do
            spec="{\"strategy\":\"${kind%:*}\",\"world\":${kind#*:},\"wrapped\":true,\"hidden\":1024,\"batch\":256,\"warmup\":3,\"steps\":$steps,\"cuda\":true}"
            CUDA_API_COUNT_OUT="$counts/fabric-${kind/:/-x}.$steps" LD_PRELOAD="$PWD/$bin/libcuda_api_count.so" \
                "$bin/bench" --fabric-child "$spec" >/dev/null || echo "fabric $kind: failed" >>"$counts/failed"
        done
    done
    python3 - "$counts" >"$out/transfers.md" <<'PY'
import os, sys
d = sys.argv[1]
def read(name):
    with open(os.path.join(d, name)) as f:
        return dict(kv.split("=") for kv in f.read().split())
kinds = ["single", "dp-fast", "dp-fromloss", "dp-dropin", "ddp", "ddp-nccl"]
fabric = ["fabric-single-x1", "fabric-ddp-x1", "fabric-zero2-x1", "fabric-fsdp-x1",
          "fabric-ddp-x2", "fabric-zero2-x2", "fabric-fsdp-x2",
          "fabric-pipeline-x2", "fabric-pipeline-ranks-x2", "fabric-pipeline-ranks-x4"]
cols = ["h2d", "d2h", "d2d", "copy", "memset", "launch", "sync", "alloc", "free"]
print("CUDA driver calls per training step (all replicas or ranks of the process together),")
print("MLP 784-1024-1024-10, global batch 256, 2 replicas or ranks on GPU 0, SGD;")
print("(count after 30 steps - count after 10) / 20, CUPTI driver-API callbacks.")
print()
print("| kind | " + " | ".join(cols) + " |")
print("|---|" + "---:|" * len(cols))
def table(kinds):
  for k in kinds:
    try:
        a, b = read(k + ".10"), read(k + ".30")
    except (OSError, ValueError):
        print(f"| {k} | " + " | ".join("n/a" for _ in cols) + " |")
        continue
    print(f"| {k} | " + " | ".join(f"{(int(b[c]) - int(a[c])) / 20:g}" for c in cols) + " |")
table(kinds)
print()
print("Through a Fabric (`bench --fabric-child`, `cuda`: every rank on GPU 0, its own stream),")
print("MLP 784-1024x5-10, 256 rows per rank, the crate's AdamW; ranks of one process together.")
print()
print("| kind | " + " | ".join(cols) + " |")
print("|---|" + "---:|" * len(cols))
table(fabric)
if os.path.exists(os.path.join(d, "failed")):
    print("\nfailed runs:\n" + open(os.path.join(d, "failed")).read())
PY
    cat "$out/transfers.md"
    rm -rf "$counts"
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
    # nvidia-* wheels, where Python has them, after LD_LIBRARY_PATH's own:
    # a newer libnccl.so.2 put there comes first (NCCL before 2.30 refuses
    # two ranks on one GPU, "Duplicate GPU detected").
    local wheel_libs
    wheel_libs=$(python3 -c 'import glob, nvidia; print(":".join(d for p in nvidia.__path__ for d in glob.glob(p + "/*/lib")))' 2>/dev/null || true)
    if [ -n "$wheel_libs" ]; then
        export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$wheel_libs"
    fi
    # NCCL prints its version at its first initialisation.
    export NCCL_DEBUG=${NCCL_DEBUG:-VERSION}
    unpack "$bin"
    # NCCL before 2.30 refuses two ranks on one GPU ("Duplicate GPU
    # detected"): on a one-GPU machine the nccl subject is then skipped,
    # and the log says why.
    local nccl gpus
    nccl=$(python3 -c 'import ctypes; v = ctypes.c_int(); ctypes.CDLL("libnccl.so.2").ncclGetVersion(ctypes.byref(v)); print(v.value)' 2>/dev/null || echo 0)
    gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
    echo "NCCL found: $nccl (major*10000+minor*100+patch), GPUs: $gpus" | tee -a "$out/tests.txt"
    local failed=0
    for t in "${TESTS[@]}"; do
        if [ ! -x "$bin/suite" ]; then
            echo "== $t: no test binary suite in $bin, not run" | tee -a "$out/tests.txt"
            continue
        fi
        if [[ $t == nccl* ]] && [ "${gpus:-0}" -lt 2 ] && [ "$nccl" -lt 23000 ]; then
            echo "== $t: skipped, NCCL $nccl refuses two ranks on one GPU (2.30+ needed)" | tee -a "$out/tests.txt"
            continue
        fi
        echo "== $t" | tee -a "$out/tests.txt"
        # A hung test is a failure, not the end of the machine's time.
        local filter="$t::"
        [[ $t == *::* ]] && filter=$t
        timeout 300 "$bin/suite" --test-threads 1 --nocapture "$filter" 2>&1 | tee -a "$out/tests.txt" || failed=1
    done
    if [ -x "$bin/bench" ]; then
        count_transfers "$bin" "$out"
        # GPU_CHECK_BENCH=0 leaves the benchmark out (a short lease).
        if [ "${GPU_CHECK_BENCH:-1}" != 0 ]; then
            "$bin/bench" --device cuda --rounds 2 --steps 20 --out "$out/bench" 2>&1 |
                tee "$out/bench.txt" || failed=1
        fi
    fi
    # GPU_CHECK_LM=0 leaves the language model out.
    if [ -x "$bin/train_lm" ] && [ "${GPU_CHECK_LM:-1}" != 0 ]; then
        # The language model on the GPU: one GPU against the CPU, and
        # FSDP, ZeRO and the overlapped DDP on two ranks of GPU 0 in bf16,
        # each beside its one-GPU run (--compare).
        {
            echo "== train_lm, one GPU"
            timeout 300 "$bin/train_lm" --steps 30 --eval-every 30 --accelerator cuda --gpus "[0]" ||
                echo "== failed"
            echo "== train_lm, CPU"
            timeout 300 "$bin/train_lm" --steps 30 --eval-every 30 || echo "== failed"
            # Then the mesh's strategies, 4 ranks on GPU 0: HSDP, ZeRO on
            # a 2 x 2 mesh, and 2 pipelines of 2 stage ranks; tensor
            # parallelism (tp = 2, in bf16, beside FSDP with sequence
            # parallelism).
            for s in "fsdp|0,0" "zero --overlap|0,0" "ddp --precision bf16|0,0" \
                "hsdp --mesh dp=2,shard=2|0,0,0,0" "zero --mesh dp=2,shard=2|0,0,0,0" \
                "pipeline --mesh dp=2,pp=2|0,0,0,0" "fsdp --precision f16|0,0" \
                "single --mesh tp=2|0,0" "single --mesh tp=2 --precision bf16|0,0" \
                "fsdp --mesh dp_shard=2,tp=2 --sequence-parallel|0,0,0,0"; do
                echo "== train_lm --strategy ${s%|*}, ranks on GPUs ${s#*|}, --compare"
                # shellcheck disable=SC2086
                timeout 300 "$bin/train_lm" --strategy ${s%|*} --steps 30 --eval-every 30 \
                    --accelerator cuda --gpus "${s#*|}" --compare || echo "== failed"
            done
        } 2>&1 | tee "$out/lm.txt" || failed=1
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
