"""Writes tests/data/fabric_reference.json: what real PyTorch, Lightning
Fabric and Accelerate give each rank.

1. The demonstration: the four scripts of scripts/fabric_demo (mp.spawn,
   torchrun, Fabric's setup_dataloaders, Accelerate's prepare) load the
   numbers 0..19, batch 10, on two CPU processes; their printed lines.
2. Accelerate's batch-wise dispatch (accelerate.data_loader.BatchSamplerShard,
   the sampler `prepare` puts in) over a grid of dataset sizes, batch sizes,
   process counts and its options, each rank's batches.

Needs torch, lightning and accelerate (pip install -r
scripts/requirements-bench.txt lightning accelerate, in a venv outside the
repository). Run from the repository root:
    python scripts/gen_fabric_reference.py
"""
import itertools
import json
import os
import subprocess
import sys

import accelerate
import lightning
import torch
from accelerate.data_loader import BatchSamplerShard
from torch.utils.data import BatchSampler, SequentialSampler

HERE = os.path.dirname(os.path.abspath(__file__))
DEMO = os.path.join(HERE, "fabric_demo")


def launched(name, command):
    env = dict(os.environ, PYTHONPATH=DEMO, OMP_NUM_THREADS="1")
    out = subprocess.run(
        command, cwd=DEMO, env=env, check=True, capture_output=True, text=True, timeout=300
    ).stdout
    lines = sorted(line for line in out.splitlines() if line.startswith("rank "))
    print(f"{name}: {lines}", file=sys.stderr)
    return lines


def torchrun(script):
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
            "--master_port", "29513", script]


def main():
    demo = {
        "spawn": launched("spawn", [sys.executable, "spawn.py"]),
        "torchrun": launched("torchrun", torchrun("torchrun.py")),
        "fabric": launched("fabric", [sys.executable, "fabric.py"]),
        "accelerate": launched("accelerate", torchrun("accelerate_prepare.py")),
    }
    cases = []
    for n, batch, world, split, even, drop_last in itertools.product(
        [1, 5, 7, 20, 23, 24], [1, 2, 3, 4, 10], [1, 2, 3, 4],
        [False, True], [True, False], [False, True],
    ):
        if split and batch % world != 0:
            continue
        sampler = BatchSampler(SequentialSampler(range(n)), batch, drop_last)
        ranks = [
            [list(b) for b in BatchSamplerShard(sampler, num_processes=world, process_index=r,
                                                split_batches=split, even_batches=even)]
            for r in range(world)
        ]
        cases.append({"n": n, "batch": batch, "world": world, "split_batches": split,
                      "even_batches": even, "drop_last": drop_last, "ranks": ranks})
    out = {
        "versions": {"torch": torch.__version__, "lightning": lightning.__version__,
                     "accelerate": accelerate.__version__},
        "demo": demo,
        "batch_wise": cases,
    }
    path = os.path.join(HERE, "..", "tests", "data", "fabric_reference.json")
    with open(path, "w") as f:
        json.dump(out, f, separators=(",", ":"))
        f.write("\n")
    print(f"wrote {len(cases)} cases to {os.path.normpath(path)}", file=sys.stderr)


if __name__ == "__main__":
    main()
