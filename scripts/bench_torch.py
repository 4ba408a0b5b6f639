#!/usr/bin/env python3
"""PyTorch side of the candle-dp data-parallel benchmark (CPU).

Trains the reference MLP 784-1024-1024-10 (ReLU, cross-entropy mean, SGD lr
0.01, f32) on random data generated once up front (torch.manual_seed(0)) and
times training steps for each global batch size in these configurations:

  torch-1proc-2thr       one process, torch.set_num_threads(2), global batch
  torch-1proc-1thr       one process, 1 thread, global batch
  torch-1proc-1thr-half  one process, 1 thread, HALF the global batch
                         (the per-replica baseline for scaling efficiency)
  torch-ddp-gloo-2x1     DistributedDataParallel, gloo backend, 2 processes
                         (torch.multiprocessing spawn) of 1 thread each, each
                         rank taking half the global batch

Per configuration: --warmup untimed steps, then --steps timed steps; the
median step wall time is reported (for DDP: rank 0's median, no barrier in
the loop).  samples/s = samples per step / median step time; the "global
batch" column is the number of samples one step processes (so it is half the
group's global batch for the -half row).  Scaling efficiency (DDP only) =
samples/s(DDP) / (2 x samples/s(torch-1proc-1thr-half)), i.e. throughput with
R replicas divided by R times the throughput of one replica on 1/R of the
cores at the same per-replica batch.

Usage:
  /work/torchenv/bin/python scripts/bench_torch.py [--quick] [--steps N]
      [--warmup N] [--batches 64,256,1024] [--csv PATH]

Install (see scripts/requirements-bench.txt):
  python3 -m venv /work/torchenv
  /work/torchenv/bin/pip install -r scripts/requirements-bench.txt
"""

import argparse
import csv
import os
import platform
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

IN, HIDDEN, OUT = 784, 1024, 10
LR = 0.01
MODEL_NAME = f"MLP {IN}-{HIDDEN}-{HIDDEN}-{OUT}"
DEFAULT_BATCHES = (64, 256, 1024)
HEADER = ["config", "model", "global_batch", "replicas", "median_ms",
          "samples_per_s", "scaling_efficiency"]


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def make_model():
    return nn.Sequential(
        nn.Linear(IN, HIDDEN), nn.ReLU(),
        nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
        nn.Linear(HIDDEN, OUT),
    )


def make_setup(global_batch):
    """Seed, build the model, then generate the global batch once (f32)."""
    torch.manual_seed(0)
    model = make_model()
    x = torch.randn(global_batch, IN, dtype=torch.float32)
    y = torch.randint(0, OUT, (global_batch,))
    return model, x, y


def train_loop(model, x, y, warmup, steps):
    """Returns (per-step wall times in ms for the timed steps, last loss)."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    times = []
    loss = None
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)  # reduction="mean"
        loss.backward()
        opt.step()
        t1 = time.perf_counter()
        if i >= warmup:
            times.append((t1 - t0) * 1e3)
    return times, float(loss.detach())


def bench_single(global_batch, threads, half, warmup, steps):
    torch.set_num_threads(threads)
    model, x, y = make_setup(global_batch)
    if half:
        n = global_batch // 2
        x, y = x[:n].contiguous(), y[:n].contiguous()
    times, loss = train_loop(model, x, y, warmup, steps)
    if not loss == loss:  # NaN
        raise RuntimeError("loss is NaN")
    return statistics.median(times), x.shape[0]


def _ddp_worker(rank, world, port, global_batch, warmup, steps, queue):
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model, x, y = make_setup(global_batch)
        per = global_batch // world
        x = x[rank * per:(rank + 1) * per].contiguous()
        y = y[rank * per:(rank + 1) * per].contiguous()
        ddp = DDP(model)
        times, loss = train_loop(ddp, x, y, warmup, steps)
        queue.put((rank, statistics.median(times), loss,
                   torch.get_num_threads()))
    finally:
        dist.destroy_process_group()


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bench_ddp(global_batch, world, warmup, steps):
    if global_batch % world:
        raise ValueError(f"global batch {global_batch} not divisible by {world}")
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.spawn(_ddp_worker,
             args=(world, free_port(), global_batch, warmup, steps, queue),
             nprocs=world, join=True)
    results = {}
    while not queue.empty():
        rank, med, loss, thr = queue.get()
        results[rank] = (med, loss, thr)
    if 0 not in results:
        raise RuntimeError("rank 0 reported no result")
    med, loss, thr = results[0]
    if not loss == loss:
        raise RuntimeError("loss is NaN")
    log("    ddp ranks: " + ", ".join(
        f"rank {r}: median {m:.3f} ms, threads {t}"
        for r, (m, _, t) in sorted(results.items())))
    return med


def row(config, batch, replicas, median_ms, eff=None):
    return {
        "config": config,
        "model": MODEL_NAME,
        "global_batch": batch,
        "replicas": replicas,
        "median_ms": median_ms,
        "samples_per_s": batch / (median_ms / 1e3),
        "scaling_efficiency": eff,
    }


def fmt(r):
    return [
        r["config"], r["model"], str(r["global_batch"]), str(r["replicas"]),
        f"{r['median_ms']:.3f}", f"{r['samples_per_s']:.1f}",
        "" if r["scaling_efficiency"] is None
        else f"{r['scaling_efficiency']:.3f}",
    ]


def header_line(default_threads, warmup, steps):
    env = " ".join(f"{k}={os.environ.get(k, 'unset')}"
                   for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS",
                             "OPENBLAS_NUM_THREADS"))
    return (f"torch {torch.__version__} | python {platform.python_version()}"
            f" | cpus {os.cpu_count()} | default intra-op threads"
            f" {default_threads}, interop threads"
            f" {torch.get_num_interop_threads()} | mkldnn"
            f" {torch.backends.mkldnn.is_available()} | {env}"
            f" | threads via torch.set_num_threads: 1proc-2thr=2,"
            f" 1proc-1thr=1, ddp=1 per rank | warmup {warmup},"
            f" timed steps {steps}, f32, SGD lr {LR}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=None,
                    help="timed steps (default 30, 10 with --quick)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--batches", type=str, default=None,
                    help="comma-separated global batch sizes "
                         "(default 64,256,1024; 256 with --quick)")
    ap.add_argument("--quick", action="store_true",
                    help="only global batch 256, 10 timed steps")
    ap.add_argument("--csv", type=str, default=None,
                    help="also write the rows as CSV to PATH")
    args = ap.parse_args()

    steps = args.steps if args.steps is not None else (10 if args.quick else 30)
    if args.batches:
        batches = [int(b) for b in args.batches.split(",") if b]
    else:
        batches = [256] if args.quick else list(DEFAULT_BATCHES)
    if steps < 1 or args.warmup < 0:
        ap.error("--steps must be >= 1 and --warmup >= 0")
    for b in batches:
        if b < 2 or b % 2:
            ap.error(f"global batch {b} must be even and >= 2")

    default_threads = torch.get_num_threads()
    rows = []
    for b in batches:
        log(f"global batch {b}:")
        log("  torch-1proc-2thr")
        ms2, n = bench_single(b, 2, False, args.warmup, steps)
        rows.append(row("torch-1proc-2thr", n, 1, ms2))
        log("  torch-1proc-1thr")
        ms1, n = bench_single(b, 1, False, args.warmup, steps)
        rows.append(row("torch-1proc-1thr", n, 1, ms1))
        log("  torch-1proc-1thr-half")
        msh, nh = bench_single(b, 1, True, args.warmup, steps)
        half = row("torch-1proc-1thr-half", nh, 1, msh)
        rows.append(half)
        log("  torch-ddp-gloo-2x1")
        msd = bench_ddp(b, 2, args.warmup, steps)
        ddp = row("torch-ddp-gloo-2x1", b, 2, msd)
        ddp["scaling_efficiency"] = (ddp["samples_per_s"]
                                     / (2 * half["samples_per_s"]))
        rows.append(ddp)
    torch.set_num_threads(default_threads)

    cols = ["config", "model", "global batch", "replicas", "median ms/step",
            "samples/s", "scaling eff."]
    print(header_line(default_threads, args.warmup, steps))
    print()
    print("| " + " | ".join(cols) + " |")
    print("|" + "|".join(["---"] * 2 + ["---:"] * 5) + "|")
    for r in rows:
        print("| " + " | ".join(fmt(r)) + " |")
    sys.stdout.flush()

    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(HEADER)
            for r in rows:
                w.writerow(fmt(r))
        log(f"wrote {args.csv}")


if __name__ == "__main__":
    main()
