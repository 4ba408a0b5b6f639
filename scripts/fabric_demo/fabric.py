"""Lightning Fabric: setup_dataloaders puts a DistributedSampler in."""
from lightning.fabric import Fabric
from torch.utils.data import DataLoader

from common import Numbers, show

fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp")
fabric.launch()
show(fabric.global_rank, fabric.setup_dataloaders(DataLoader(Numbers(), batch_size=10, shuffle=False)))
