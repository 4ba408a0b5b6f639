"""Reference values of the fused ops (candle_dp::ops) from PyTorch (CPU,
float32 and float64, one thread).

Writes tests/data/ops_reference.json (see tests/data/FIXTURES.md), which
tests/suite/ops.rs matches:
- gelu: `torch.nn.functional.gelu(x, approximate="tanh")` and its
  gradient for an upstream gradient `dy`, over 4,099 values from -12 to 12
  (both signs' tails, zero, and the steep middle) in float32 and float64.

  python3 scripts/gen_ops_reference.py   (PyTorch installed, see
  scripts/requirements-bench.txt)
"""
import json
import os

import torch


def gelu_case(dtype):
    gen = torch.Generator().manual_seed(53)
    x = torch.cat(
        [
            torch.linspace(-12.0, 12.0, 2049, dtype=torch.float64),
            torch.randn(2048, generator=gen, dtype=torch.float64) * 3.0,
            torch.tensor([0.0, -0.0], dtype=torch.float64),
        ]
    ).to(dtype)
    dy = (torch.randn(x.shape, generator=gen, dtype=torch.float64) + 0.5).to(dtype)
    x.requires_grad_(True)
    y = torch.nn.functional.gelu(x, approximate="tanh")
    (y * dy).sum().backward()
    return {
        "x": x.detach().tolist(),
        "dy": dy.tolist(),
        "y": y.detach().tolist(),
        "dx": x.grad.tolist(),
    }


def main():
    torch.set_num_threads(1)
    out = {
        "torch": torch.__version__,
        "gelu": {"f32": gelu_case(torch.float32), "f64": gelu_case(torch.float64)},
    }
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.path.join(here, "..", "tests", "data", "ops_reference.json")
    with open(path, "w") as f:
        json.dump(out, f)
    print(f"wrote {path}, torch {torch.__version__}")


if __name__ == "__main__":
    main()
