"""Where PyTorch's time goes in one training step of the benchmark's MLP.

The same step as scripts/bench_torch.py (MLP 784-1024-1024-10, ReLU,
cross-entropy mean, SGD lr 0.01, f32, random data), profiled with
torch.profiler: the self CPU time of each operator per step, for comparing
op by op with candle's profile (README, Performance).

Usage:
  /work/torchenv/bin/python scripts/profile_torch_step.py [--batch 256] [--threads 2] [--steps 20]
"""

import argparse

import torch
import torch.nn as nn
from torch.profiler import ProfilerActivity, profile


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    model = nn.Sequential(
        nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10)
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(args.batch, 784)
    y = torch.randint(0, 10, (args.batch,))
    loss_fn = nn.CrossEntropyLoss()

    def step():
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        opt.step()

    for _ in range(args.warmup):
        step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            step()

    rows = [
        (e.key, e.self_cpu_time_total / args.steps / 1e3, e.count // args.steps)
        for e in prof.key_averages()
        if e.self_cpu_time_total > 0
    ]
    rows.sort(key=lambda r: -r[1])
    total = sum(r[1] for r in rows)
    print(
        f"torch {torch.__version__}, batch {args.batch}, {args.threads} thread(s), "
        f"{args.steps} steps: {total:.2f} ms self CPU time per step"
    )
    print("| op | ms/step | calls/step |")
    print("|---|---:|---:|")
    for name, ms, calls in rows[:15]:
        print(f"| {name} | {ms:.3f} | {calls} |")


if __name__ == "__main__":
    main()
