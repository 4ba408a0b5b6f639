"""Hugging Face Accelerate: prepare deals whole batches to the processes."""
from accelerate import Accelerator
from torch.utils.data import DataLoader

from common import Numbers, show

accelerator = Accelerator(cpu=True)
show(accelerator.process_index, accelerator.prepare(DataLoader(Numbers(), batch_size=10, shuffle=False)))
