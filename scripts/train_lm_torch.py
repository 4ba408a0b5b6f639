"""The PyTorch twin of examples/train_lm.rs: the same GPT-style model, loaded
from the Rust run's initial weights (`train_lm --save-init FILE`), trained on
the same batches (PyTorch's DistributedSampler over the same windows of the
same text) with the same AdamW, warm-up + cosine schedule and clipping.
Prints its loss per step and its tokens/s; with --json, writes them (and each step's seconds).
--world 2 runs DDP (gloo) over 2 processes, each its DistributedSampler shard
(rank 0's loss printed), as train_lm --strategy ddp.

Run (PyTorch from scripts/requirements-bench.txt):
  cargo run --release --example train_lm -- --steps 50 --save-init /tmp/init.safetensors --losses /tmp/rust.csv
  python3 scripts/train_lm_torch.py --init /tmp/init.safetensors --steps 50 --json /tmp/torch.json

The model and data are described in examples/common/gpt.rs and
data/text/README.md; every flag below has train_lm's default.
"""
import argparse
import gzip
import json
import math
import os
import struct
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DistributedSampler

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def read_safetensors(path):
    """The tensors of a safetensors file (f32 only), without the package."""
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    data = raw[8 + n :]
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        assert meta["dtype"] == "F32", (name, meta["dtype"])
        a, b = meta["data_offsets"]
        t = torch.frombuffer(bytearray(data[a:b]), dtype=torch.float32)
        out[name] = t.reshape(meta["shape"]).clone()
    return out


class Gpt(torch.nn.Module):
    def __init__(self, weights, heads):
        super().__init__()
        self.p = torch.nn.ParameterDict(
            {k.replace(".", "__"): torch.nn.Parameter(v) for k, v in weights.items()}
        )
        self.heads = heads
        self.layers = sum(1 for k in weights if k.endswith("ln_1.weight"))

    def w(self, name):
        return self.p[name.replace(".", "__")]

    def linear(self, x, name):
        return F.linear(x, self.w(name + ".weight"), self.w(name + ".bias"))

    def norm(self, x, name):
        return F.layer_norm(
            x, x.shape[-1:], self.w(name + ".weight"), self.w(name + ".bias"), 1e-5
        )

    def forward(self, ids):
        b, t = ids.shape
        x = self.w("wte.weight")[ids] + self.w("wpe.weight")[:t]
        mask = torch.full((t, t), float("-inf")).triu(1)
        for i in range(self.layers):
            h = f"h.{i}."
            qkv = self.linear(self.norm(x, h + "ln_1"), h + "attn.c_attn")
            w = x.shape[-1]
            d = w // self.heads
            q, k, v = (
                qkv[..., j * w : (j + 1) * w].reshape(b, t, self.heads, d).transpose(1, 2)
                for j in range(3)
            )
            scores = q @ k.transpose(-1, -2) * (1.0 / math.sqrt(d)) + mask
            y = (torch.softmax(scores, -1) @ v).transpose(1, 2).reshape(b, t, w)
            x = x + self.linear(y, h + "attn.c_proj")
            m = F.gelu(self.linear(self.norm(x, h + "ln_2"), h + "mlp.c_fc"), approximate="tanh")
            x = x + self.linear(m, h + "mlp.c_proj")
        return self.norm(x, "ln_f") @ self.w("wte.weight").t()


def main():
    a = parse()
    if a.world > 1:
        import torch.multiprocessing as mp

        mp.spawn(train, args=(a,), nprocs=a.world, join=True)
    else:
        train(0, a)


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--init", required=True)
    ap.add_argument("--steps", type=int, default=250)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument(
        "--decay-all",
        action="store_true",
        help="decay every parameter (default: the weight matrices only, GPT-2's recipe)",
    )
    ap.add_argument("--warmup-steps", type=int, default=None)
    ap.add_argument("--clip-grad-norm", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--bf16",
        action="store_true",
        help="the forward and backward under torch.autocast(bfloat16), f32 weights: "
        "PyTorch's own bf16-to-f32 gap, beside candle-dp's bf16-mixed",
    )
    ap.add_argument(
        "--world",
        type=int,
        default=1,
        help="DDP (gloo) over this many processes, each its DistributedSampler shard",
    )
    return ap.parse_args()


def train(rank, a):
    if a.world > 1:
        import torch.distributed as dist

        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        dist.init_process_group("gloo", rank=rank, world_size=a.world)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // a.world))
    if a.threads:
        torch.set_num_threads(a.threads)

    text = gzip.open(os.path.join(ROOT, "data/text/eighty-days.txt.gz")).read()
    train = text[: len(text) * 9 // 10]
    T = a.context
    windows = (len(train) - 1) // T
    data = torch.tensor(list(train), dtype=torch.long)

    model = Gpt(read_safetensors(a.init), a.heads)
    net = model
    if a.world > 1:
        net = torch.nn.parallel.DistributedDataParallel(model)
    if a.decay_all:
        groups = [{"params": list(model.parameters()), "weight_decay": a.weight_decay}]
    else:
        # nanoGPT's configure_optimizers: matrices (2 dimensions or more:
        # embeddings and linear weights) decayed, biases and norms not.
        params = list(model.parameters())
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": a.weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
    opt = torch.optim.AdamW(groups, lr=a.lr)
    warmup = a.warmup_steps if a.warmup_steps is not None else max(a.steps // 20, 1)
    sched = torch.optim.lr_scheduler.SequentialLR(
        opt,
        [
            torch.optim.lr_scheduler.LinearLR(opt, 0.01, 1.0, max(warmup, 1)),
            torch.optim.lr_scheduler.CosineAnnealingLR(opt, a.steps - warmup, 0.0),
        ],
        [warmup],
    )
    sampler = DistributedSampler(
        range(windows), num_replicas=a.world, rank=rank, shuffle=True, seed=a.seed
    )
    per_rank = a.batch // a.world
    # A pass is the whole global batches the windows fill (the remainder
    # dropped), so a step's global batch is the same for every world size:
    # the sampler's padding for the ranks is never reached.
    per_epoch = max(windows // (per_rank * a.world), 1)
    losses = []
    step_seconds = []
    start = time.perf_counter()
    for step in range(a.steps):
        step_start = time.perf_counter()
        sampler.set_epoch(step // per_epoch)
        at = (step % per_epoch) * per_rank
        idx = list(sampler)[at : at + per_rank]
        rows = torch.stack([data[i * T : (i + 1) * T + 1] for i in idx])
        x, y = rows[:, :-1], rows[:, 1:]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.bf16):
            logits = net(x)
        logits = logits.float()
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        if a.clip_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), a.clip_grad_norm)
        opt.step()
        sched.step()
        losses.append(loss.item())
        step_seconds.append(time.perf_counter() - step_start)
        if rank == 0:
            print(f"step {step + 1} loss {loss.item():.6f}", flush=True)
    seconds = time.perf_counter() - start
    tokens = a.steps * a.batch * T
    if rank != 0:
        return
    print(
        f"tokens/s {tokens / seconds:.0f} ({a.world} process(es), "
        f"{torch.get_num_threads()} threads each)"
    )
    if a.json:
        with open(a.json, "w") as f:
            args = {k: v for k, v in vars(a).items() if k not in ("init", "json", "threads")}
            args["warmup_steps"] = warmup
            args["layers"] = model.layers
            args["width"] = model.w("wte.weight").shape[1]
            json.dump(
                {
                    "torch": torch.__version__,
                    "args": args,
                    "losses": losses,
                    "step_seconds": step_seconds,
                },
                f,
                indent=1,
            )
            f.write("\n")


if __name__ == "__main__":
    main()
