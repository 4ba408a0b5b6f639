"""Reference values of the fused ops (candle_dp::ops) from PyTorch (CPU,
float32 and float64, one thread).

Writes tests/data/ops_reference.json (see tests/data/FIXTURES.md), which
tests/suite/ops.rs matches:
Every case has the inputs, the outputs in its dtype, and `exact`: the
outputs computed in float64 from the same input values (for float32, what
the op would give without float32's rounding).
- gelu: `torch.nn.functional.gelu(x, approximate="tanh")` and its
  gradient for an upstream gradient `dy`, over 4,099 values from -12 to 12
  (both signs' tails, zero, and the steep middle) in float32 and float64.
- layer_norm: `layer_norm` over the last dimension (eps 1e-5) of 6 rows
  of 37 at different scales and offsets, with its weight and bias, and
  the gradients of all three.
- causal_softmax: `softmax(scale * x + mask)` (mask -inf above the
  diagonal) of 2 x 3 x 9 x 9 scores at scale 0.35, and its gradient.
- cross_entropy: `cross_entropy` of 13 rows of 29 logits (some near
  +-30) against class targets, times an upstream gradient of 1.7 (`dy`),
  and the logits' gradient.
- cross_entropy_large: the same at logits of 30, 1e3 and 1e4 (6 rows of
  23: near +-scale, alternating, {2, 1, -1} x scale, one row near 0).
- linear: `linear` of a 2 x 5 x 7 input with a 4 x 7 weight and a bias,
  and the gradients of all three.
- linear_relu: `relu(linear(x, w, b))` and the gradients of all three,
  on odd shapes: one row of 13 onto 11, 2 x 5 x 7 onto 9, 37 x 70 onto 33
  (widths not a multiple of the vector width), and 6 x 19 onto 5 at
  inputs of 1e3.
- causal_attention: `scaled_dot_product_attention(q, k, v,
  is_causal=True)` with q, k and v the thirds of a packed 2 x 11 x 24
  input in 2 heads of 4 (GPT-2's `c_attn` output), the heads put side by
  side again, and the packed input's gradient.

  python3 scripts/gen_ops_reference.py   (PyTorch installed, see
  scripts/requirements-bench.txt)
"""

import torch

from fixture import write_fixture


def flat(t):
    return t.detach().flatten().tolist()


def outputs(op, names, inputs, dy):
    """op(*inputs) and the gradients of sum(op * dy) (or op * dy for a
    scalar) for each input, keyed `y` and `d<name>`."""
    inputs = [t.detach().clone().requires_grad_(True) for t in inputs]
    y = op(*inputs)
    (y * dy).sum().backward()
    out = {"y": flat(y)}
    for name, t in zip(names, inputs):
        out["d" + name] = flat(t.grad)
    return out


def case(op, names, inputs, dy, **extra):
    """The inputs (as given), their outputs in their dtype, and `exact`: the
    outputs in float64 from the same values (float32's rounding apart)."""
    out = {name: flat(t) for name, t in zip(names, inputs)}
    out["shape"] = list(inputs[0].shape)
    out["dy"] = flat(dy)
    out.update(extra)
    out.update(outputs(op, names, inputs, dy))
    wide = [t.double() for t in inputs]
    out["exact"] = outputs(op, names, wide, dy.double())
    return out


def randn(gen, dtype, *shapes):
    return [torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype) for shape in shapes]


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
    gelu = lambda x: torch.nn.functional.gelu(x, approximate="tanh")  # noqa: E731
    return case(gelu, ["x"], [x], dy)


def layer_norm_case(dtype):
    gen = torch.Generator().manual_seed(531)
    (x, w, b, dy) = randn(gen, dtype, (6, 37), (37,), (37,), (6, 37))
    # Rows at different scales and offsets, one nearly constant.
    x = x * torch.tensor([[0.01], [1.0], [5.0], [100.0], [1.0], [1e-3]], dtype=dtype)
    x = x + torch.tensor([[0.0], [3.0], [-2.0], [50.0], [0.0], [7.0]], dtype=dtype)
    norm = lambda x, w, b: torch.nn.functional.layer_norm(x, (37,), w, b, 1e-5)  # noqa: E731
    return case(norm, ["x", "w", "b"], [x, w, b], dy)


def causal_softmax_case(dtype):
    gen = torch.Generator().manual_seed(532)
    (x, dy) = randn(gen, dtype, (2, 3, 9, 9), (2, 3, 9, 9))
    x = x * 4.0

    def softmax(x):
        mask = torch.full((9, 9), float("-inf"), dtype=x.dtype).triu(1)
        return torch.softmax(0.35 * x + mask, dim=-1)

    return case(softmax, ["x"], [x], dy, scale=0.35)


def cross_entropy_case(dtype):
    gen = torch.Generator().manual_seed(533)
    (x,) = randn(gen, dtype, (13, 29))
    x = x * 3.0
    x[2, 5] = 30.0
    x[7, 0] = -30.0
    targets = torch.randint(0, 29, (13,), generator=gen)
    targets[7] = 0
    loss = lambda x: torch.nn.functional.cross_entropy(x, targets)  # noqa: E731
    return case(loss, ["x"], [x], torch.tensor(1.7, dtype=dtype), targets=targets.tolist())


def cross_entropy_large_case(scale):
    """`cross_entropy` of 6 rows of 23 logits at `scale`: rows all near
    +scale, all near -scale, alternating +-scale, {2, 1, -1} x scale with
    the target on the second, near scale with one a unit above, and one
    row near 0 (the gradient's rounding must not grow with the logits)."""

    def make(dtype):
        gen = torch.Generator().manual_seed(536)
        base = torch.zeros(6, 23, dtype=torch.float64)
        base[0] = scale
        base[1] = -scale
        base[2, ::2] = scale
        base[2, 1::2] = -scale
        base[3, 0:3] = torch.tensor([2.0, 1.0, -1.0], dtype=torch.float64) * scale
        base[4] = scale
        base[4, 5] = scale + 1.0
        x = (base + 2.0 * torch.randn(6, 23, generator=gen, dtype=torch.float64)).to(dtype)
        targets = torch.randint(0, 23, (6,), generator=gen)
        targets[3] = 1
        loss = lambda x: torch.nn.functional.cross_entropy(x, targets)  # noqa: E731
        dy = torch.tensor(1.7, dtype=dtype)
        return case(loss, ["x"], [x], dy, targets=targets.tolist(), scale=scale)

    return make


def linear_case(dtype):
    gen = torch.Generator().manual_seed(534)
    (x, w, b, dy) = randn(gen, dtype, (2, 5, 7), (4, 7), (4,), (2, 5, 4))
    return case(torch.nn.functional.linear, ["x", "w", "b"], [x, w, b], dy)


def linear_relu_case(rows, inner, out, scale, seed):
    """`relu(linear(x, w, b))` of `rows` (a list: the leading dimensions)
    x `inner` inputs onto `out` features, the inputs times `scale`."""

    def make(dtype):
        gen = torch.Generator().manual_seed(seed)
        (x, w, b, dy) = randn(gen, dtype, (*rows, inner), (out, inner), (out,), (*rows, out))
        x = x * scale

        def op(x, w, b):
            return torch.relu(torch.nn.functional.linear(x, w, b))

        return case(op, ["x", "w", "b"], [x, w, b], dy)

    return make


def causal_attention_case(dtype):
    gen = torch.Generator().manual_seed(535)
    (batch, t, width, heads) = (2, 11, 8, 2)
    (x, dy) = randn(gen, dtype, (batch, t, 3 * width), (batch, t, width))
    x = x * 1.5

    def attention(qkv):
        def split(part):
            cols = qkv[..., part * width : (part + 1) * width]
            return cols.reshape(batch, t, heads, width // heads).transpose(1, 2)

        y = torch.nn.functional.scaled_dot_product_attention(
            split(0), split(1), split(2), is_causal=True
        )
        return y.transpose(1, 2).reshape(batch, t, width)

    return case(attention, ["x"], [x], dy, heads=heads)


def both(case):
    return {"f32": case(torch.float32), "f64": case(torch.float64)}


def main():
    torch.set_num_threads(1)
    out = {
        "torch": torch.__version__,
        "gelu": both(gelu_case),
        "layer_norm": both(layer_norm_case),
        "causal_softmax": both(causal_softmax_case),
        "cross_entropy": both(cross_entropy_case),
        "cross_entropy_large": [both(cross_entropy_large_case(s)) for s in (30.0, 1e3, 1e4)],
        "linear": both(linear_case),
        "linear_relu": [
            both(linear_relu_case(rows, inner, out, scale, 540 + i))
            for i, (rows, inner, out, scale) in enumerate(
                [([1], 13, 11, 1.0), ([2, 5], 7, 9, 1.0), ([37], 70, 33, 1.0), ([6], 19, 5, 1e3)]
            )
        ],
        "causal_attention": both(causal_attention_case),
    }
    path = write_fixture("ops_reference.json", out)
    print(f"wrote {path}, torch {torch.__version__}")


if __name__ == "__main__":
    main()
