"""Reference learning-rate sequences of PyTorch's schedulers.

Writes tests/data/lr_reference.json: for each case, the scheduler and its
arguments, and the learning rate (and, for OneCycleLR, the momentum) that
the optimizer holds before each of its first STEPS steps (a step is
`optimizer.step()` then `scheduler.step()`, PyTorch's order); under
`groups`, the same of every schedule over an SGD of two parameter groups
(rates `group_lrs`), each step's rates (and momenta) in group order. The Rust
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


def sgd_groups(lrs):
    groups = [{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": lr} for lr in lrs]
    return torch.optim.SGD(groups, lr=lrs[0], momentum=0.9)


GROUP_LRS = [0.1, 0.01]


def group_cases():
    """Every schedule over two parameter groups of rates 0.1 and 0.01:
    each group's rate comes from the schedule's formula over its own base
    rate (a cosine's eta_min is every group's floor)."""
    lr = torch.optim.lr_scheduler
    opt = sgd_groups(GROUP_LRS)
    yield "cosine", {"T_max": 30, "eta_min": 1e-3}, opt, lr.CosineAnnealingLR(opt, T_max=30, eta_min=1e-3)
    opt = sgd_groups(GROUP_LRS)
    yield "linear", {"start_factor": 1 / 3, "end_factor": 1.0, "total_iters": 5}, opt, lr.LinearLR(opt)
    opt = sgd_groups(GROUP_LRS)
    yield "step", {"step_size": 7, "gamma": 0.5}, opt, lr.StepLR(opt, step_size=7, gamma=0.5)
    opt = sgd_groups(GROUP_LRS)
    yield "exponential", {"gamma": 0.97}, opt, lr.ExponentialLR(opt, gamma=0.97)
    opt = sgd_groups(GROUP_LRS)
    yield "lambda", {"factor": "0.95 ** step"}, opt, lr.LambdaLR(opt, lambda e: 0.95 ** e)
    opt = sgd_groups(GROUP_LRS)
    yield "one_cycle", {"max_lr": 1.0, "total_steps": STEPS}, opt, \
        lr.OneCycleLR(opt, max_lr=1.0, total_steps=STEPS)
    opt = sgd_groups(GROUP_LRS)
    yield "one_cycle_per_group", {"max_lr": [1.0, 0.5], "total_steps": STEPS}, opt, \
        lr.OneCycleLR(opt, max_lr=[1.0, 0.5], total_steps=STEPS)
    opt = sgd_groups(GROUP_LRS)
    warm = lr.LinearLR(opt, start_factor=0.1, total_iters=10)
    cos = lr.CosineAnnealingLR(opt, T_max=60, eta_min=1e-4)
    yield "warmup_cosine", {"start_factor": 0.1, "total_iters": 10, "T_max": 60,
                            "eta_min": 1e-4, "milestone": 10}, opt, \
        lr.SequentialLR(opt, [warm, cos], milestones=[10])


def main():
    out = {"torch": torch.__version__, "steps": STEPS, "cases": {}, "group_lrs": GROUP_LRS, "groups": {}}
    for name, args, opt, sched in group_cases():
        lrs, momenta = [], []
        for _ in range(STEPS):
            lrs.append([g["lr"] for g in opt.param_groups])
            momenta.append([g["momentum"] for g in opt.param_groups])
            opt.step()
            sched.step()
        out["groups"][name] = {"args": args, "lr": lrs, "momentum": momenta}
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
