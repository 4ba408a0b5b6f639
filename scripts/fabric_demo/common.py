"""The data of the demonstration: the numbers 0..19, batch 10, 2 devices."""
import torch
from torch.utils.data import Dataset


class Numbers(Dataset):
    def __len__(self):
        return 20

    def __getitem__(self, i):
        return torch.tensor(i)


def show(rank, loader):
    for i, batch in enumerate(loader):
        print(f"rank {rank} batch {i}: {batch.tolist()}", flush=True)
