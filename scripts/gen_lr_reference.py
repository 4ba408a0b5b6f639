"""Reference learning-rate sequences of PyTorch's schedulers.

Writes tests/data/lr_reference.json: for each case, the scheduler and its
arguments, and the learning rate (and, for OneCycleLR, the momentum) that
the optimizer holds before each of its first STEPS steps (a step is
`optimizer.step()` then `scheduler.step()`, PyTorch's order). The Rust
test that reproduces them through candle_dp::optim::LrScheduler reads the
same file.

Run: python3 scripts/gen_lr_reference.py   (PyTorch installed, see
scripts/requirements-bench.txt)
"""
import json
import os

import torch

STEPS = 100


def sgd(lr):
    p = torch.nn.Parameter(torch.zeros(1))
    return torch.optim.SGD([p], lr=lr, momentum=0.9)


def cases():
    opt = sgd(0.5)
    yield "cosine", {"base_lr": 0.5, "T_max": 30, "eta_min": 0.01}, opt, \
        torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=30, eta_min=0.01)
    opt = sgd(0.2)
    yield "linear", {"base_lr": 0.2, "start_factor": 1 / 3, "end_factor": 1.0, "total_iters": 5}, opt, \
        torch.optim.lr_scheduler.LinearLR(opt)
    opt = sgd(0.1)
    yield "step", {"base_lr": 0.1, "step_size": 7, "gamma": 0.5}, opt, \
        torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.5)
    opt = sgd(0.1)
    yield "exponential", {"base_lr": 0.1, "gamma": 0.97}, opt, \
        torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.97)
    opt = sgd(1.0)
    yield "one_cycle", {"max_lr": 1.0, "total_steps": STEPS}, opt, \
        torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1.0, total_steps=STEPS)
    opt = sgd(0.01)
    warm = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=10)
    cos = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=60, eta_min=1e-4)
    yield "warmup_cosine", {"base_lr": 0.01, "start_factor": 0.1, "total_iters": 10,
                            "T_max": 60, "eta_min": 1e-4, "milestone": 10}, opt, \
        torch.optim.lr_scheduler.SequentialLR(opt, [warm, cos], milestones=[10])


def main():
    out = {"torch": torch.__version__, "steps": STEPS, "cases": {}}
    for name, args, opt, sched in cases():
        lrs, momenta = [], []
        for _ in range(STEPS):
            lrs.append(opt.param_groups[0]["lr"])
            momenta.append(opt.param_groups[0]["momentum"])
            opt.step()
            sched.step()
        out["cases"][name] = {"args": args, "lr": lrs, "momentum": momenta}
    path = os.path.join(os.path.dirname(__file__), "..", "tests", "data", "lr_reference.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
