"""Reference runs of PyTorch's SGD, Adam and AdamW with parameter groups
(CPU, float32, one thread), under a LambdaLR schedule.

Writes tests/data/optim_groups_reference.json (see tests/data/FIXTURES.md),
which tests/suite/optim.rs reproduces with candle_dp::optim's `with_groups`.

Parameters a [5], b [3, 7], c [33], e [] (one number), skip [6]; `skip`
has no gradient in steps 2 and 5. Two groups: a, b and skip in group 0,
c and e in group 1, each with its own settings. After every step the
schedule sets each group's rate to its initial rate times 0.9 ** steps
(LambdaLR), as the Rust side's `LrScheduler::lambda` scales group 0's and
the optimizer the others' by the same factor.

JSON: "torch", "init" {param: values}, "shapes", "grads" [step][param],
and "runs" {run: {"kind", "groups": [{"params", "settings"}], "final"
{param: values}, "lrs" [[group 0's, group 1's] after each step],
"state" {param.slot: values}}}.

  python3 scripts/gen_optim_groups_reference.py   (PyTorch installed, see
  scripts/requirements-bench.txt)
"""

import torch

from fixture import write_fixture

STEPS = 8
SKIPPED = {2, 5}
SHAPES = {"a": (5,), "b": (3, 7), "c": (33,), "e": (), "skip": (6,)}
GROUPS = [["a", "b", "skip"], ["c", "e"]]
GAMMA = 0.9

# name -> (optimizer, [group 0's settings, group 1's]), named as candle_dp's configs.
RUNS = {
    "sgd_groups": (
        "sgd",
        [
            {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01},
            {"lr": 0.02, "momentum": 0.5, "dampening": 0.1, "weight_decay": 0.0},
        ],
    ),
    "adam_groups": (
        "adam",
        [
            {"lr": 0.01, "weight_decay": 0.1},
            {"lr": 0.003, "beta1": 0.8, "beta2": 0.99, "amsgrad": True},
        ],
    ),
    # The GPT-2 recipe: decay in one group, none in the other.
    "adamw_groups": (
        "adamw",
        [
            {"lr": 0.01, "weight_decay": 0.1},
            {"lr": 0.01, "weight_decay": 0.0, "eps": 1e-6},
        ],
    ),
}


def torch_group(kind, settings, params):
    s = dict(settings)
    if kind != "sgd":
        s["betas"] = (s.pop("beta1", 0.9), s.pop("beta2", 0.999))
    return {"params": params, **s}


def main():
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(56)
    init = {n: torch.randn(s, generator=gen) for n, s in SHAPES.items()}
    grads = []
    for step in range(STEPS):
        scale = [1.0, 0.1, 3.0][step % 3]
        grads.append(
            {
                n: torch.randn(s, generator=gen) * scale
                for n, s in SHAPES.items()
                if not (n == "skip" and step in SKIPPED)
            }
        )
    out = {
        "torch": torch.__version__,
        "shapes": {n: list(s) for n, s in SHAPES.items()},
        "init": {n: t.flatten().tolist() for n, t in init.items()},
        "grads": [{n: t.flatten().tolist() for n, t in g.items()} for g in grads],
        "gamma": GAMMA,
        "runs": {},
    }
    for run, (kind, settings) in RUNS.items():
        params = {n: torch.nn.Parameter(t.clone()) for n, t in init.items()}
        groups = [
            torch_group(kind, s, [params[n] for n in names])
            for names, s in zip(GROUPS, settings)
        ]
        cls = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[kind]
        opt = cls(groups, foreach=False)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: GAMMA**s)
        lrs = []
        for g in grads:
            for n, p in params.items():
                p.grad = g[n].clone() if n in g else None
            opt.step()
            sched.step()
            lrs.append([group["lr"] for group in opt.param_groups])
        order = [n for names in GROUPS for n in names]
        state = {}
        for index, slots in opt.state_dict()["state"].items():
            for slot, value in slots.items():
                tensor = value if torch.is_tensor(value) else torch.tensor(value)
                state[f"{order[index]}.{slot}"] = tensor.flatten().tolist()
        out["runs"][run] = {
            "kind": kind,
            "groups": [{"params": names, "settings": s} for names, s in zip(GROUPS, settings)],
            "final": {n: p.detach().flatten().tolist() for n, p in params.items()},
            "lrs": lrs,
            "state": state,
        }
    path = write_fixture("optim_groups_reference.json", out)
    print(f"wrote {path}: {len(RUNS)} runs, torch {torch.__version__}")


if __name__ == "__main__":
    main()
