"""Reference dynamic loss scaling by PyTorch's torch.amp.GradScaler.

Writes tests/data/scaler_reference.json: runs of a float32 parameter w
(8 elements) trained by SGD (lr 0.1, momentum 0.9) on the loss
(w * x_t).sum(), scaled by a GradScaler, where x_t is a fixed input per step
with an inf, a NaN or values whose scaled gradient overflows at chosen
steps. For each step: the input x_t, whether the optimizer stepped, the
scale and the growth tracker after update(), the parameter after the step;
and the scaler's state_dict() halfway (to resume from). One run goes through
step() alone, one unscales first and clips the gradient norm (PyTorch's
recipe: unscale_, clip_grad_norm_, step, update). Every float32 value is
written as its bit pattern (a u32), NaN and the infinities included.
tests/suite/grad_scaler.rs reproduces them through candle_dp::optim::GradScaler.

Run: python3 scripts/gen_scaler_reference.py   (PyTorch installed, see
scripts/requirements-bench.txt)
"""
import json
import os
import struct

import torch

N = 8
STEPS = 24


def bits(x):
    return struct.unpack("<I", struct.pack("<f", x))[0]


def flat(t):
    return [bits(float(v)) for v in t.reshape(-1).tolist()]


def inputs(seed):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(N, generator=g, dtype=torch.float32) for _ in range(STEPS)]
    xs[3][2] = float("inf")
    xs[7][5] = float("nan")
    # Finite, but overflows once multiplied by the scale.
    xs[12][0] = 3.0e38
    xs[13][1] = -float("inf")
    return xs


def run(name, config, clip=None):
    xs = inputs(7)
    w = torch.nn.Parameter(torch.linspace(-1.0, 1.0, N, dtype=torch.float32))
    w0 = w.detach().clone()
    opt = torch.optim.SGD([w], lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", **config)
    steps = []
    halfway = None
    for t, x in enumerate(xs):
        opt.zero_grad()
        loss = (w * x).sum()
        scaler.scale(loss).backward()
        total = None
        if clip is not None:
            scaler.unscale_(opt)
            total = float(torch.nn.utils.clip_grad_norm_([w], clip))
        scaler.step(opt)
        state = scaler._per_optimizer_states[id(opt)]
        found = sum(v.item() for v in state["found_inf_per_device"].values())
        scaler.update()
        stepped = found == 0
        steps.append(
            {
                "x": flat(x),
                "stepped": stepped,
                "scale": bits(scaler.get_scale()),
                "growth_tracker": int(scaler._growth_tracker.item()),
                "w": flat(w.detach()),
                "total_norm": None if total is None else bits(total),
            }
        )
        if t == STEPS // 2 - 1:
            sd = scaler.state_dict()
            halfway = {
                "after_step": t + 1,
                "scale": bits(sd["scale"]),
                "growth_tracker": int(sd["_growth_tracker"]),
            }
    return {
        "name": name,
        "config": config,
        "clip": clip,
        "w0": flat(w0),
        "steps": steps,
        "halfway": halfway,
    }


def main():
    runs = [
        run("interval4", {"init_scale": 1024.0, "growth_interval": 4}),
        run(
            "factors",
            {
                "init_scale": 3.0,
                "growth_factor": 3.0,
                "backoff_factor": 0.25,
                "growth_interval": 2,
            },
        ),
        run("defaults", {}),
        run("clipped", {"init_scale": 256.0, "growth_interval": 3}, clip=0.5),
    ]
    out = {"torch": torch.__version__, "lr": 0.1, "momentum": 0.9, "runs": runs}
    path = os.path.join(
        os.path.dirname(__file__), "..", "tests", "data", "scaler_reference.json"
    )
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    print("wrote", path)


if __name__ == "__main__":
    main()
