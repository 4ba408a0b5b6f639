"""Reference runs of PyTorch's SGD, Adam and AdamW (CPU, float32).

Writes tests/data/optim_reference.safetensors (see tests/data/FIXTURES.md),
which tests/suite/optim.rs reproduces with candle_dp::optim.

Parameters (shapes chosen so that both ATen's 16-wide vector loop and its
scalar tail run): a [5], b [3, 7], c [33], d [4, 4, 3], e [] (one number),
f [64], skip [6]. `skip` has no gradient in steps 3, 7 and 12 (counted from
0), so its own step count falls behind the others', as PyTorch keeps it.
Every run starts from `init.<param>` and takes the same 25 steps, step s
using the gradients `grad.<s>.<param>`.

Tensors: init.<param>, grad.<step>.<param>, and per run <run>.final.<param>
and <run>.state.<param>.<slot> (the optimizer's state after the last step:
step, exp_avg, exp_avg_sq, max_exp_avg_sq, momentum_buffer).
The metadata entry "runs" holds each run's optimizer and settings (JSON).

Run with one thread (ATen splits large tensors per thread, which moves the
vector loop's tails):
  python3 scripts/gen_optim_reference.py   (PyTorch and safetensors
  installed, see scripts/requirements-bench.txt)
"""
import json
import os

import torch
from safetensors.torch import save_file

STEPS = 25
SKIPPED = {3, 7, 12}
SHAPES = {
    "a": (5,),
    "b": (3, 7),
    "c": (33,),
    "d": (4, 4, 3),
    "e": (),
    "f": (64,),
    "skip": (6,),
}

# name -> (optimizer, settings), settings named as candle_dp's configs.
RUNS = {
    "sgd_plain": ("sgd", {"lr": 0.1}),
    "sgd_momentum": ("sgd", {"lr": 0.05, "momentum": 0.9}),
    "sgd_dampening": ("sgd", {"lr": 0.05, "momentum": 0.9, "dampening": 0.3}),
    "sgd_nesterov": ("sgd", {"lr": 0.05, "momentum": 0.8, "nesterov": True}),
    "sgd_weight_decay": ("sgd", {"lr": 0.1, "momentum": 0.5, "weight_decay": 0.01}),
    "sgd_maximize": (
        "sgd",
        {"lr": 0.02, "momentum": 0.9, "weight_decay": 0.05, "maximize": True},
    ),
    "adam_default": ("adam", {}),
    "adam_weight_decay": ("adam", {"lr": 0.01, "weight_decay": 0.1}),
    "adam_amsgrad": (
        "adam",
        {"lr": 0.01, "beta1": 0.8, "beta2": 0.99, "eps": 1e-6, "amsgrad": True},
    ),
    "adam_maximize": ("adam", {"lr": 0.005, "maximize": True}),
    "adamw_default": ("adamw", {}),
    "adamw_amsgrad": ("adamw", {"lr": 0.01, "weight_decay": 0.05, "amsgrad": True}),
    # beta1 0.5: lerp's weight is 0.5, ATen's other form of lerp.
    "adamw_betas": (
        "adamw",
        {"lr": 0.003, "beta1": 0.5, "beta2": 0.9, "eps": 1e-4, "weight_decay": 0.1},
    ),
    "adamw_maximize": ("adamw", {"lr": 0.004, "weight_decay": 0.02, "maximize": True}),
}


def optimizer(kind, settings, params):
    s = dict(settings)
    if kind == "sgd":
        return torch.optim.SGD(params, foreach=False, **s)
    betas = (s.pop("beta1", 0.9), s.pop("beta2", 0.999))
    cls = torch.optim.Adam if kind == "adam" else torch.optim.AdamW
    return cls(params, betas=betas, foreach=False, **s)


def main():
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(2026)
    init = {n: torch.randn(s, generator=gen) for n, s in SHAPES.items()}
    grads = []
    for step in range(STEPS):
        # Gradients of a few scales, as training sees them.
        scale = [1.0, 0.01, 10.0, 0.3][step % 4]
        grads.append(
            {
                n: torch.randn(s, generator=gen) * scale
                for n, s in SHAPES.items()
                if not (n == "skip" and step in SKIPPED)
            }
        )
    out = {f"init.{n}": t.clone() for n, t in init.items()}
    for step, g in enumerate(grads):
        out.update({f"grad.{step}.{n}": t.clone() for n, t in g.items()})
    for run, (kind, settings) in RUNS.items():
        params = {n: torch.nn.Parameter(t.clone()) for n, t in init.items()}
        names = list(params)
        opt = optimizer(kind, settings, list(params.values()))
        for g in grads:
            for n, p in params.items():
                p.grad = g[n].clone() if n in g else None
            opt.step()
        out.update({f"{run}.final.{n}": p.detach().clone() for n, p in params.items()})
        for index, state in opt.state_dict()["state"].items():
            for slot, value in state.items():
                tensor = value if torch.is_tensor(value) else torch.tensor(value)
                out[f"{run}.state.{names[index]}.{slot}"] = tensor.detach().clone()
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.path.join(here, "..", "tests", "data", "optim_reference.safetensors")
    save_file(
        {k: v.contiguous() for k, v in out.items()},
        path,
        metadata={"runs": json.dumps(RUNS), "torch": torch.__version__},
    )
    print(f"wrote {path}: {len(out)} tensors, torch {torch.__version__}")


if __name__ == "__main__":
    main()
