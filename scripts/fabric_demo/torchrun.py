"""torchrun --nproc_per_node 2: the launcher's environment, a DistributedSampler."""
import torch.distributed as dist
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from common import Numbers, show

dist.init_process_group("gloo")
rank = dist.get_rank()
data = Numbers()
sampler = DistributedSampler(data, shuffle=False)
show(rank, DataLoader(data, batch_size=10, sampler=sampler))
dist.destroy_process_group()
