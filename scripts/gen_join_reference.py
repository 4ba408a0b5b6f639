"""Reference runs of real PyTorch DDP `join` (gloo, CPU) with uneven inputs and BatchNorm.

Writes tests/data/join_reference.safetensors (see tests/data/FIXTURES.md).

Model, with candle-nn names: l1 = Linear(12,16), bn = BatchNorm1d(16) (eps 1e-5,
momentum 0.1, training mode), l2 = Linear(16,4); forward l2(relu(bn(l1(x)))).
World 3. Rank r trains on `batches[r]` batches of 4 rows; its rows start at
4 * sum(batches[:r]) (x [48,12], y [48] int64). SGD lr 0.05, cross-entropy
mean, inside `with Join([ddp])` (divide by the initial world size).

What the runs pin (torch/nn/parallel/distributed.py):
- inside a join, buffers are broadcast before each forward from the highest
  rank still training (`_find_common_rank(rank, True)`), not from rank 0;
- at the end every rank takes the model of the last joiner, ties broken
  toward the larger rank (`_sync_final_model`); buffers only when
  broadcast_buffers is on.

Runs (each saves every rank's final parameters and buffers: final_<run>.r<k>.*):
- J1: batches [2, 4, 3], broadcast_buffers=True  (one last joiner: rank 1)
- J2: batches [3, 1, 3], broadcast_buffers=True  (ranks 0 and 2 tie: rank 2)
- J3: batches [2, 4, 3], broadcast_buffers=False (final sync of parameters only)

Run: python3 scripts/gen_join_reference.py   (PyTorch and safetensors installed,
see scripts/requirements-bench.txt)
"""
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from safetensors.torch import save_file
from torch.distributed.algorithms.join import Join

WORLD = 3
BATCH = 4
RUNS = {
    "J1": ([2, 4, 3], True),
    "J2": ([3, 1, 3], True),
    "J3": ([2, 4, 3], False),
}
# torch name -> candle-nn name
NAMES = {
    "0.weight": "l1.weight", "0.bias": "l1.bias",
    "1.weight": "bn.weight", "1.bias": "bn.bias",
    "1.running_mean": "bn.running_mean", "1.running_var": "bn.running_var",
    "3.weight": "l2.weight", "3.bias": "l2.bias",
}


def model():
    return nn.Sequential(nn.Linear(12, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))


def candle_names(state):
    return {NAMES[k]: v.detach().clone().contiguous() for k, v in state.items() if k in NAMES}


def worker(rank, batches, broadcast_buffers, port, init, x, y, queue):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    m = model()
    m.load_state_dict({k: init[v] for k, v in NAMES.items()}, strict=False)
    ddp = nn.parallel.DistributedDataParallel(m, broadcast_buffers=broadcast_buffers)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    loss_fn = nn.CrossEntropyLoss()
    start = BATCH * sum(batches[:rank])
    with Join([ddp]):
        for b in range(batches[rank]):
            rows = slice(start + b * BATCH, start + (b + 1) * BATCH)
            opt.zero_grad()
            loss_fn(ddp(x[rows]), y[rows]).backward()
            opt.step()
    queue.put((rank, {k: v.numpy() for k, v in candle_names(m.state_dict()).items()}))
    dist.destroy_process_group()


def run(batches, broadcast_buffers, port, init, x, y):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=worker, args=(r, batches, broadcast_buffers, port, init, x, y, queue))
        for r in range(WORLD)
    ]
    for p in procs:
        p.start()
    results = dict(queue.get() for _ in range(WORLD))
    for p in procs:
        p.join()
    return {r: {k: torch.from_numpy(v) for k, v in results[r].items()} for r in range(WORLD)}


if __name__ == "__main__":
    out_path = sys.argv[1] if len(sys.argv) > 1 else "tests/data/join_reference.safetensors"
    torch.manual_seed(17)
    m = model()
    with torch.no_grad():
        # Non-trivial BatchNorm parameters and statistics.
        m[1].weight.uniform_(0.5, 1.5)
        m[1].bias.normal_(0, 0.2)
        m[1].running_mean.normal_(0, 0.5)
        m[1].running_var.uniform_(0.5, 2.0)
    init = candle_names(m.state_dict())
    rows = BATCH * max(sum(b) for b, _ in RUNS.values())
    x = torch.randn(rows, 12) * 1.5 + 0.3
    y = torch.randint(0, 4, (rows,))
    out = {f"init.{k}": v for k, v in init.items()}
    out["x"] = x.contiguous()
    out["y"] = y.to(torch.int64).contiguous()
    for i, (name, (batches, broadcast_buffers)) in enumerate(RUNS.items()):
        finals = run(batches, broadcast_buffers, 29641 + i, init, x, y)
        for rank, state in finals.items():
            out.update({f"final_{name}.r{rank}.{k}": v for k, v in state.items()})
    save_file(out, out_path)
    print(out_path, len(out), "tensors")
