"""Reference gradient clipping by PyTorch's torch.nn.utils.clip_grad_norm_.

Writes tests/data/clip_reference.json: for each case, the gradients of four
float32 parameters (shapes [5], [3, 7], [33], [] as flat lists), the
arguments (max_norm, norm_type, error_if_nonfinite), and what
clip_grad_norm_ returned (the total norm) and left in the gradients, or the
error it raised. Every float32 value is written as its bit pattern (a u32),
so each bit is kept, NaN and the infinities included. tests/suite/clip.rs reproduces them through
candle_dp::optim::clip_grad_norm.

Run: python3 scripts/gen_clip_reference.py   (PyTorch installed, see
scripts/requirements-bench.txt)
"""
import json
import math
import os
import struct

import torch

SHAPES = [[5], [3, 7], [33], []]


def grads(seed, scale):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g, dtype=torch.float32) * scale for s in SHAPES]


def bits(x):
    return struct.unpack("<I", struct.pack("<f", x))[0]


def flat(t):
    return [bits(float(x)) for x in t.reshape(-1).tolist()]


def case(name, gs, max_norm, norm_type, error_if_nonfinite=False):
    params = []
    for g in gs:
        p = torch.nn.Parameter(torch.zeros_like(g))
        p.grad = g.clone()
        params.append(p)
    out = {
        "name": name,
        "shapes": SHAPES,
        "grads": [flat(g) for g in gs],
        "max_norm": max_norm,
        "norm_type": "inf" if math.isinf(norm_type) else norm_type,
        "error_if_nonfinite": error_if_nonfinite,
    }
    try:
        total = torch.nn.utils.clip_grad_norm_(
            params, max_norm, norm_type=norm_type, error_if_nonfinite=error_if_nonfinite
        )
        out["total_norm"] = bits(float(total))
        out["clipped"] = [flat(p.grad) for p in params]
    except RuntimeError as e:
        out["error"] = str(e)
    return out


def main():
    cases = []
    for norm_type in [1.0, 2.0, float("inf"), 3.0, 0.5]:
        cases.append(case(f"clips p={norm_type}", grads(1, 1.0), 0.5, norm_type))
        cases.append(case(f"below max p={norm_type}", grads(2, 1e-3), 100.0, norm_type))
    # Squares of 1e-30 underflow in float32: PyTorch's 2-norm is 0.
    cases.append(case("tiny p=2", grads(3, 1e-30), 1.0, 2.0))
    cases.append(case("tiny p=1", grads(3, 1e-30), 1e-31, 1.0))
    cases.append(case("large p=2", grads(4, 1e18), 1.0, 2.0))
    nan = grads(5, 1.0)
    nan[2][7] = float("nan")
    cases.append(case("nan, no error", nan, 1.0, 2.0))
    cases.append(case("nan, error_if_nonfinite", nan, 1.0, 2.0, True))
    inf = grads(6, 1.0)
    inf[0][1] = float("inf")
    cases.append(case("inf, error_if_nonfinite", inf, 1.0, 2.0, True))
    out = {"torch": torch.__version__, "cases": cases}
    path = os.path.join(os.path.dirname(__file__), "..", "tests", "data", "clip_reference.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
