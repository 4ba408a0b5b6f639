"""mp.spawn: two processes, a DistributedSampler each."""
import os

import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from common import Numbers, show


def run(rank, world):
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29512")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    data = Numbers()
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=False)
    show(rank, DataLoader(data, batch_size=10, sampler=sampler))
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(run, args=(2,), nprocs=2)
