//! The fused training ops (`candle_dp::ops`): each against candle's
//! composite ops, a finite-difference check in f64, and PyTorch's op
//! (`tests/data/ops_reference.json`, made by `scripts/gen_ops_reference.py`).
//!
//! In f32 an op "equals" another up to that other's own rounding: it is
//! within 1e-6 of the exact values (the op in f64 on the same inputs:
//! PyTorch's for the fixtures, the fused op's own, itself checked against
//! PyTorch and finite differences, for larger inputs) or no farther from
//! them than the other op, and no farther from the other op than the other
//! op is from them, plus 1e-6. candle's
//! composite LayerNorm, for one, sums the weight's gradient over rows in
//! f32 (8e-6 from the exact values over 700 rows), and PyTorch's f32
//! LayerNorm is 1e-4 from them on a near-constant row; the fused op is
//! within 6e-8 of them.

use candle_core::{DType, Device, Tensor, Var};
use candle_dp::ops;

/// An op's value and the gradients of its inputs, as PyTorch gave them.
#[derive(serde::Deserialize, Clone, Default)]
pub(crate) struct Outputs {
    y: Vec<f64>,
    dx: Vec<f64>,
    #[serde(default)]
    dw: Vec<f64>,
    #[serde(default)]
    db: Vec<f64>,
}

impl Outputs {
    pub(crate) fn run(&self) -> Run {
        let grads = [&self.dx, &self.dw, &self.db]
            .into_iter()
            .filter(|g| !g.is_empty())
            .cloned()
            .collect();
        (self.y.clone(), grads)
    }
}

/// One fixture case: the inputs, PyTorch's outputs in the case's dtype,
/// and `exact`, PyTorch's outputs in f64 from the same input values.
#[derive(serde::Deserialize, Default)]
pub(crate) struct Case {
    pub(crate) x: Vec<f64>,
    /// `x`'s.
    pub(crate) shape: Vec<usize>,
    #[serde(default)]
    pub(crate) w: Vec<f64>,
    #[serde(default)]
    pub(crate) b: Vec<f64>,
    pub(crate) dy: Vec<f64>,
    #[serde(default)]
    pub(crate) scale: f64,
    #[serde(default)]
    pub(crate) targets: Vec<u32>,
    /// Attention's heads.
    #[serde(default)]
    pub(crate) heads: usize,
    #[serde(flatten)]
    pub(crate) torch: Outputs,
    pub(crate) exact: Outputs,
}

#[derive(serde::Deserialize)]
pub(crate) struct Both {
    pub(crate) f32: Case,
    pub(crate) f64: Case,
}

#[derive(serde::Deserialize)]
pub(crate) struct Reference {
    torch: String,
    gelu: Both,
    layer_norm: Both,
    causal_softmax: Both,
    cross_entropy: Both,
    /// Logits of 30, 1e3 and 1e4.
    cross_entropy_large: Vec<Both>,
    linear: Both,
    causal_attention: Both,
    /// `relu(linear(...))` on odd shapes and large inputs.
    pub(crate) linear_relu: Vec<Both>,
}

pub(crate) fn reference() -> Reference {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/data/ops_reference.json");
    let reference: Reference = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
    assert!(reference.torch.starts_with("2.15"), "{}", reference.torch);
    reference
}

fn values(t: &Tensor) -> Vec<f64> {
    t.to_dtype(DType::F64)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

/// The largest |got - want| / max(|want|, floor).
fn rel(got: &[f64], want: &[f64], floor: f64) -> f64 {
    assert_eq!(got.len(), want.len());
    got.iter()
        .zip(want)
        .map(|(g, w)| (g - w).abs() / w.abs().max(floor))
        .fold(0.0, f64::max)
}

/// An op's value and its inputs' gradients.
pub(crate) type Run = (Vec<f64>, Vec<Vec<f64>>);

/// `f(x)`'s value and the gradient of `sum(f(x) * dy)` at `x`.
fn value_and_grad(
    f: impl Fn(&Tensor) -> candle_core::Result<Tensor>,
    x: &[f64],
    dy: &[f64],
    dtype: DType,
) -> (Vec<f64>, Vec<f64>) {
    let (y, mut grads) = values_and_grads(&|t| f(&t[0]), &[(x, &[x.len()])], dy, dtype);
    (y, grads.remove(0))
}

/// The largest relative difference (floor 1) over the value and every
/// gradient of two runs.
pub(crate) fn farthest(a: &Run, b: &Run) -> f64 {
    assert_eq!(a.1.len(), b.1.len());
    a.1.iter()
        .zip(&b.1)
        .map(|(x, y)| rel(x, y, 1.0))
        .fold(rel(&a.0, &b.0, 1.0), f64::max)
}

/// `got` equals `other` up to `other`'s own rounding: no farther from
/// `exact` than `tolerance` or than `other` is (whichever is more: the
/// linear layer's matrix products are candle's gemm in f32 either way,
/// 5e-5 from the exact values over 1024 rows), and no farther from
/// `other` than `other` is from `exact`, plus `tolerance`.
pub(crate) fn assert_equal_up_to_rounding(
    what: &str,
    got: &Run,
    other: &Run,
    exact: &Run,
    tolerance: f64,
) {
    let (to_exact, to_other, other_to_exact) = (
        farthest(got, exact),
        farthest(got, other),
        farthest(other, exact),
    );
    println!(
        "{what}: {to_exact:.1e} from the exact values, {to_other:.1e} from the other op \
         (itself {other_to_exact:.1e} from them)"
    );
    assert!(
        to_exact <= tolerance.max(other_to_exact),
        "{what}: {to_exact:e} from the exact values, the other op {other_to_exact:e}"
    );
    assert!(
        to_other <= other_to_exact + tolerance,
        "{what}: {to_other:e} from the other op, which is {other_to_exact:e} from the exact values"
    );
}

/// The op named `op` (the fused one, or candle's composite) on a case's
/// inputs, in `dtype`.
fn on_case(op: &str, fused: bool, case: &Case, dtype: DType) -> Run {
    on_case_on(op, fused, case, dtype, &Device::Cpu)
}

/// [`on_case`] with the inputs on `device`.
fn on_case_on(op: &str, fused: bool, case: &Case, dtype: DType, device: &Device) -> Run {
    let (x, w, b, shape) = (&case.x[..], &case.w[..], &case.b[..], &case.shape[..]);
    match op {
        "gelu" => {
            let f = |t: &[Tensor]| if fused { ops::gelu(&t[0]) } else { t[0].gelu() };
            values_and_grads_on(&f, &[(x, shape)], &case.dy, dtype, device)
        }
        "layer_norm" => {
            let f: &Op<'_> = if fused {
                &layer_norm
            } else {
                &layer_norm_composite
            };
            let inputs = [(x, shape), (w, &[w.len()][..]), (b, &[b.len()][..])];
            values_and_grads_on(f, &inputs, &case.dy, dtype, device)
        }
        "causal_softmax" => {
            let f = |t: &[Tensor]| match fused {
                true => ops::causal_softmax(&t[0], case.scale),
                false => causal_softmax_composite(&t[0], case.scale),
            };
            values_and_grads_on(&f, &[(x, shape)], &case.dy, dtype, device)
        }
        "cross_entropy" => {
            let labels = targets(&case.targets).to_device(device).unwrap();
            let f = |t: &[Tensor]| match fused {
                true => ops::cross_entropy(&t[0], &labels),
                false => candle_nn::loss::cross_entropy(&t[0], &labels),
            };
            values_and_grads_on(&f, &[(x, shape)], &case.dy, dtype, device)
        }
        "causal_attention" => {
            let f = |t: &[Tensor]| match fused {
                true => ops::causal_attention(&t[0], case.heads),
                false => ops::causal_attention_unfused(&t[0], case.heads),
            };
            values_and_grads_on(&f, &[(x, shape)], &case.dy, dtype, device)
        }
        "linear" => {
            let f: &Op<'_> = if fused { &linear } else { &linear_composite };
            let (o, i) = (b.len(), w.len() / b.len());
            let inputs = [(x, shape), (w, &[o, i][..]), (b, &[o][..])];
            values_and_grads_on(f, &inputs, &case.dy, dtype, device)
        }
        other => panic!("no op {other}"),
    }
}

const OPS: [&str; 6] = [
    "gelu",
    "layer_norm",
    "causal_softmax",
    "cross_entropy",
    "linear",
    "causal_attention",
];

fn cases<'a>(reference: &'a Reference, op: &str) -> &'a Both {
    match op {
        "gelu" => &reference.gelu,
        "layer_norm" => &reference.layer_norm,
        "causal_softmax" => &reference.causal_softmax,
        "cross_entropy" => &reference.cross_entropy,
        "causal_attention" => &reference.causal_attention,
        _ => &reference.linear,
    }
}

/// Every op against PyTorch's (`gelu(approximate="tanh")`, `layer_norm`,
/// the masked `softmax`, `cross_entropy`, `linear`,
/// `scaled_dot_product_attention(is_causal=True)`), value and gradients:
/// f64 within 1e-11 of PyTorch's (LayerNorm's different order of sums
/// over a row of 37 values at offset 50 is 1.3e-12 apart); f32 equal to PyTorch's f32 up to its
/// rounding (within 1e-6 of PyTorch's f64 on the same inputs).
#[test]
fn fused_ops_match_pytorchs_forward_and_backward() {
    let reference = reference();
    for op in OPS {
        let both = cases(&reference, op);
        let got = on_case(op, true, &both.f64, DType::F64);
        let d = farthest(&got, &both.f64.torch.run());
        println!("{op} f64: {d:.1e} from PyTorch");
        assert!(d <= 1e-11, "{op} f64: {d:e} from PyTorch");
        let got = on_case(op, true, &both.f32, DType::F32);
        let (torch, exact) = (both.f32.torch.run(), both.f32.exact.run());
        assert_equal_up_to_rounding(
            &format!("{op} f32 against PyTorch"),
            &got,
            &torch,
            &exact,
            1e-6,
        );
    }
}

/// The cross-entropy's loss and gradient at logits of 30, 1e3 and 1e4
/// (rows near +-scale, alternating, {2, 1, -1} x scale) are PyTorch's: in
/// f64 within 1e-11, in f32 no farther from the exact values than 1e-7 or
/// PyTorch's f32 (a softmax taken from `lse`, which rounds at the largest
/// logit's scale, was 4e-5 off at 1e4).
#[test]
fn fused_cross_entropy_gradient_matches_pytorchs_at_large_logits() {
    let reference = reference();
    assert_eq!(reference.cross_entropy_large.len(), 3);
    for both in &reference.cross_entropy_large {
        let scale = both.f32.scale;
        let got = on_case("cross_entropy", true, &both.f64, DType::F64);
        let d = farthest(&got, &both.f64.torch.run());
        println!("cross-entropy f64 at logits of {scale:e}: {d:.1e} from PyTorch");
        assert!(d <= 1e-11, "f64 at logits of {scale:e}: {d:e} from PyTorch");
        let got = on_case("cross_entropy", true, &both.f32, DType::F32);
        let (torch, exact) = (both.f32.torch.run(), both.f32.exact.run());
        let what = format!("cross-entropy f32 at logits of {scale:e}, against PyTorch");
        assert_equal_up_to_rounding(&what, &got, &torch, &exact, 1e-7);
    }
}

/// An empty batch's loss is NaN (PyTorch's mean over no rows), fused (f32,
/// f64) or not (bf16 on the CPU is candle's composite, which alone would
/// fail), and its backward gives the logits an empty gradient.
#[test]
fn cross_entropy_of_an_empty_batch_is_nan() {
    for dtype in [DType::F32, DType::F64, DType::BF16] {
        let logits = Var::zeros((0, 5), dtype, &Device::Cpu).unwrap();
        let targets = Tensor::zeros(0, DType::U32, &Device::Cpu).unwrap();
        let loss = ops::cross_entropy(logits.as_tensor(), &targets).unwrap();
        let value: f64 = loss.to_dtype(DType::F64).unwrap().to_scalar().unwrap();
        assert!(value.is_nan(), "{dtype:?}: {value}");
        let grads = loss.backward().unwrap();
        let grad = grads
            .get(logits.as_tensor())
            .expect("a gradient of the logits");
        assert_eq!(grad.dims(), &[0, 5], "{dtype:?}");
    }
}

/// Every op equals candle's composite ops in f32 up to their rounding, on
/// the fixtures' inputs (PyTorch's f64 the exact values) and on inputs
/// large enough to be split over threads (the fused op in f64 the exact
/// values).
#[test]
fn fused_ops_equal_candles_composite_ops_in_f32() {
    let reference = reference();
    for op in OPS {
        let case = &cases(&reference, op).f32;
        let fused = on_case(op, true, case, DType::F32);
        let composite = on_case(op, false, case, DType::F32);
        assert_equal_up_to_rounding(op, &fused, &composite, &case.exact.run(), 1e-6);
    }
    for op in OPS {
        let case = large_case(op);
        let exact = on_case(op, true, &case, DType::F64);
        let fused = on_case(op, true, &case, DType::F32);
        let composite = on_case(op, false, &case, DType::F32);
        let what = format!("{op}, input {:?}", case.shape);
        assert_equal_up_to_rounding(&what, &fused, &composite, &exact, 1e-6);
    }
}

/// On a GPU every op is candle's CUDA op (no fused kernel there): in f32
/// it equals candle's composite ops on the CPU up to their rounding, on
/// the fixtures' inputs and on the large ones (attention's 4 x 130
/// positions among them), value and every gradient.
#[cfg(feature = "cuda")]
#[test]
fn fused_ops_on_the_gpu_equal_candles_composite_ops_on_the_cpu_in_f32() {
    let gpu = Device::new_cuda(0).unwrap();
    let reference = reference();
    for op in OPS {
        let case = &cases(&reference, op).f32;
        let on_gpu = on_case_on(op, true, case, DType::F32, &gpu);
        let composite = on_case(op, false, case, DType::F32);
        let what = format!("{op} on the GPU");
        assert_equal_up_to_rounding(&what, &on_gpu, &composite, &case.exact.run(), 1e-5);
    }
    for op in OPS {
        let case = large_case(op);
        let exact = on_case(op, true, &case, DType::F64);
        let on_gpu = on_case_on(op, true, &case, DType::F32, &gpu);
        let composite = on_case(op, false, &case, DType::F32);
        let what = format!("{op} on the GPU, input {:?}", case.shape);
        assert_equal_up_to_rounding(&what, &on_gpu, &composite, &exact, 1e-5);
    }
}

/// Inputs of 1024 x 128 values (f32 values, so that f64 computes on the
/// same ones) shaped for `op`: attention scores 8 x 128 x 128, logits of
/// 128 classes, a linear layer of 128 to 96; for attention, 4 sequences of
/// 130 positions (past two of the backward's blocks of 64 queries, not a
/// whole number of tiles) in 2 heads of 32.
fn large_case(op: &str) -> Case {
    let (rows, width) = (1024, 128);
    let f32s = |v: Vec<f64>| -> Vec<f64> { v.into_iter().map(|a| a as f32 as f64).collect() };
    let case = Case {
        x: f32s(noise(rows * width, 1, 3.0)),
        shape: vec![rows, width],
        dy: f32s(noise(rows * width, 2, 1.0)),
        ..Case::default()
    };
    match op {
        "layer_norm" => Case {
            w: f32s(noise(width, 3, 1.5)),
            b: f32s(noise(width, 4, 0.5)),
            ..case
        },
        "causal_softmax" => Case {
            shape: vec![8, width, width],
            scale: 0.125,
            ..case
        },
        "cross_entropy" => Case {
            targets: (0..rows as u32)
                .map(|r| (r * 37 + 11) % width as u32)
                .collect(),
            dy: vec![1.3],
            ..case
        },
        "causal_attention" => Case {
            x: f32s(noise(4 * 130 * 3 * 64, 8, 1.5)),
            shape: vec![4, 130, 3 * 64],
            dy: f32s(noise(4 * 130 * 64, 9, 1.0)),
            heads: 2,
            ..case
        },
        "linear" => Case {
            w: f32s(noise(96 * width, 5, 0.2)),
            b: f32s(noise(96, 6, 0.5)),
            dy: f32s(noise(rows * 96, 7, 1.0)),
            ..case
        },
        _ => case,
    }
}

/// The backward is the derivative: central differences in f64.
#[test]
fn fused_gelu_backward_passes_a_finite_difference_check_in_f64() {
    let x: Vec<f64> = (0..401).map(|i| -8.0 + i as f64 * 0.04 + 1e-3).collect();
    let ones = vec![1.0; x.len()];
    let (_, dx) = value_and_grad(ops::gelu, &x, &ones, DType::F64);
    let h = 1e-6;
    let at = |shift: f64| {
        let shifted: Vec<f64> = x.iter().map(|v| v + shift).collect();
        value_and_grad(ops::gelu, &shifted, &ones, DType::F64).0
    };
    let (up, down) = (at(h), at(-h));
    let numeric: Vec<f64> = up
        .iter()
        .zip(&down)
        .map(|(u, d)| (u - d) / (2.0 * h))
        .collect();
    let d = rel(&dx, &numeric, 1.0);
    println!("gelu backward against central differences: {d:.1e}");
    assert!(d <= 1e-8, "{d:e}");
}

/// Where no fused kernel is written (here bf16 on the CPU; CUDA alike), it
/// is candle's own op, backward included.
#[test]
fn fused_gelu_falls_back_to_candles_op_where_it_has_no_kernel() {
    let x: Vec<f64> = (0..64).map(|i| i as f64 / 8.0 - 4.0).collect();
    let dy = vec![1.0; x.len()];
    let fused = value_and_grad(ops::gelu, &x, &dy, DType::BF16);
    let candle = value_and_grad(|x| x.gelu(), &x, &dy, DType::BF16);
    assert_eq!(fused, candle);
}

/// A strided input (a transposed view) is made contiguous first.
#[test]
fn fused_gelu_takes_a_strided_input() {
    let x = Tensor::arange(0f32, 12.0, &Device::Cpu)
        .unwrap()
        .affine(0.5, -3.0)
        .unwrap()
        .reshape((3, 4))
        .unwrap()
        .t()
        .unwrap();
    let fused = ops::gelu(&x).unwrap();
    assert!(rel(&values(&fused), &values(&x.gelu().unwrap()), 1.0) <= 1e-6);
    assert_eq!(fused.dims(), &[4, 3]);
}

/// An op of several inputs, each given as its values and shape.
pub(crate) type Op<'a> = dyn Fn(&[Tensor]) -> candle_core::Result<Tensor> + 'a;

/// `f(inputs)`'s value and the gradient of `sum(f(inputs) * dy)` for each
/// input, computed in `dtype`.
pub(crate) fn values_and_grads(
    f: &Op<'_>,
    inputs: &[(&[f64], &[usize])],
    dy: &[f64],
    dtype: DType,
) -> (Vec<f64>, Vec<Vec<f64>>) {
    values_and_grads_on(f, inputs, dy, dtype, &Device::Cpu)
}

/// [`values_and_grads`] with the inputs on `device`.
fn values_and_grads_on(
    f: &Op<'_>,
    inputs: &[(&[f64], &[usize])],
    dy: &[f64],
    dtype: DType,
    device: &Device,
) -> (Vec<f64>, Vec<Vec<f64>>) {
    let vars: Vec<Var> = inputs
        .iter()
        .map(|(v, shape)| {
            let t = Tensor::new(*v, device).unwrap().reshape(*shape).unwrap();
            Var::from_tensor(&t.to_dtype(dtype).unwrap()).unwrap()
        })
        .collect();
    let tensors: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let y = f(&tensors).unwrap();
    let dy = Tensor::new(dy, device)
        .unwrap()
        .reshape(y.shape())
        .unwrap()
        .to_dtype(dtype)
        .unwrap();
    let grads = (&y * &dy).unwrap().sum_all().unwrap().backward().unwrap();
    let grads = vars
        .iter()
        .map(|v| {
            values(
                grads
                    .get(v.as_tensor())
                    .expect("a gradient for every input"),
            )
        })
        .collect();
    (values(&y), grads)
}

/// Seeded values in about -scale..scale.
pub(crate) fn noise(n: usize, seed: u64, scale: f64) -> Vec<f64> {
    let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            ((state >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0) * scale
        })
        .collect()
}

/// The cross-entropy's targets as a tensor of `dtype`.
fn targets(values: &[u32]) -> Tensor {
    Tensor::new(values, &Device::Cpu).unwrap()
}

fn layer_norm(t: &[Tensor]) -> candle_core::Result<Tensor> {
    ops::layer_norm(&t[0], &t[1], &t[2], 1e-5)
}

fn layer_norm_composite(t: &[Tensor]) -> candle_core::Result<Tensor> {
    candle_nn::ops::layer_norm_slow(&t[0], &t[1], &t[2], 1e-5)
}

fn linear(t: &[Tensor]) -> candle_core::Result<Tensor> {
    ops::linear(&t[0], &t[1], Some(&t[2]))
}

fn linear_composite(t: &[Tensor]) -> candle_core::Result<Tensor> {
    use candle_core::Module;
    candle_nn::Linear::new(t[1].clone(), Some(t[2].clone())).forward(&t[0])
}

fn causal_softmax_composite(x: &Tensor, scale: f64) -> candle_core::Result<Tensor> {
    let mask = ops::causal_mask(x.dim(candle_core::D::Minus1)?, x)?;
    candle_nn::ops::softmax(&(x * scale)?.broadcast_add(&mask)?, candle_core::D::Minus1)
}

/// Each input's values and shape.
type Inputs = Vec<(Vec<f64>, Vec<usize>)>;

/// Every input's gradient against central differences of the op's value
/// (through `sum(f * dy)`), in f64.
#[test]
fn fused_ops_backward_passes_a_finite_difference_check_in_f64() {
    let (rows, width) = (5, 11);
    let x = noise(rows * width, 21, 2.0);
    let (w, b) = (noise(width, 22, 1.0), noise(width, 23, 1.0));
    let scores = noise(2 * 7 * 7, 24, 3.0);
    let logits = noise(6 * 9, 25, 3.0);
    let labels = [0u32, 8, 3, 3, 5, 1];
    let wide = noise(4 * width, 26, 1.0);
    let cases: Vec<(&str, Box<Op>, Inputs, Vec<f64>)> = vec![
        (
            "layer norm",
            Box::new(layer_norm),
            vec![
                (x.clone(), vec![rows, width]),
                (w.clone(), vec![width]),
                (b.clone(), vec![width]),
            ],
            noise(rows * width, 27, 1.0),
        ),
        (
            "causal softmax",
            Box::new(|t: &[Tensor]| ops::causal_softmax(&t[0], 0.7)),
            vec![(scores, vec![2, 7, 7])],
            noise(2 * 7 * 7, 28, 1.0),
        ),
        (
            "cross-entropy",
            Box::new(move |t: &[Tensor]| ops::cross_entropy(&t[0], &targets(&labels))),
            vec![(logits, vec![6, 9])],
            vec![0.9],
        ),
        (
            "causal attention",
            Box::new(|t: &[Tensor]| ops::causal_attention(&t[0], 2)),
            vec![(noise(2 * 5 * 12, 31, 1.5), vec![2, 5, 12])],
            noise(2 * 5 * 4, 32, 1.0),
        ),
        (
            "linear",
            Box::new(linear),
            vec![
                (x, vec![rows, width]),
                (wide, vec![4, width]),
                (noise(4, 29, 1.0), vec![4]),
            ],
            noise(rows * 4, 30, 1.0),
        ),
    ];
    let h = 1e-6;
    for (name, f, inputs, dy) in cases {
        let borrowed: Vec<(&[f64], &[usize])> =
            inputs.iter().map(|(v, s)| (&v[..], &s[..])).collect();
        let (_, grads) = values_and_grads(f.as_ref(), &borrowed, &dy, DType::F64);
        let objective = |shifted: &[(&[f64], &[usize])]| -> f64 {
            let (y, _) = values_and_grads(f.as_ref(), shifted, &dy, DType::F64);
            y.iter().zip(&dy).map(|(a, b)| a * b).sum()
        };
        let mut worst = 0.0f64;
        for (k, input_grad) in grads.iter().enumerate() {
            for (e, analytic) in input_grad.iter().enumerate() {
                let at = |shift: f64| {
                    let mut moved = inputs.clone();
                    moved[k].0[e] += shift;
                    let borrowed: Vec<(&[f64], &[usize])> =
                        moved.iter().map(|(v, s)| (&v[..], &s[..])).collect();
                    objective(&borrowed)
                };
                let numeric = (at(h) - at(-h)) / (2.0 * h);
                worst = worst.max((analytic - numeric).abs() / numeric.abs().max(1.0));
            }
        }
        println!("{name}: backward {worst:.1e} from central differences");
        assert!(worst <= 1e-7, "{name}: {worst:e}");
    }
}

/// The kernels split large inputs over the rayon pool they run in; the
/// bytes are the same on one thread and on several.
#[test]
fn fused_ops_give_the_same_bytes_on_one_thread_and_on_several() {
    let (rows, width) = (1024, 256);
    let x = noise(rows * width, 41, 3.0);
    let dy = noise(rows * width, 42, 1.0);
    let (w, b) = (noise(width, 43, 1.0), noise(width, 44, 1.0));
    let labels: Vec<u32> = (0..rows as u32).map(|r| r % width as u32).collect();
    let run = || {
        let shape = [rows, width];
        let norm = values_and_grads(
            &layer_norm,
            &[(&x, &shape), (&w, &[width]), (&b, &[width])],
            &dy,
            DType::F32,
        );
        let soft = values_and_grads(
            &|t| ops::causal_softmax(&t[0], 0.3),
            &[(&x, &[4, width, width])],
            &dy,
            DType::F32,
        );
        let loss = values_and_grads(
            &|t| ops::cross_entropy(&t[0], &targets(&labels)),
            &[(&x, &shape)],
            &[1.0],
            DType::F32,
        );
        let gelu = values_and_grads(&|t| ops::gelu(&t[0]), &[(&x, &shape)], &dy, DType::F32);
        // 8 sequences of 128 positions, 2 heads of 32: 16 heads to split.
        let attention = values_and_grads(
            &|t| ops::causal_attention(&t[0], 2),
            &[(&x[..8 * 128 * 192], &[8, 128, 192])],
            &dy[..8 * 128 * 64],
            DType::F32,
        );
        (norm, soft, loss, gelu, attention)
    };
    let pool = |threads| {
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap()
    };
    let one = pool(1).install(run);
    let four = pool(4).install(run);
    assert!(one == four, "the bytes changed with the number of threads");
}

/// Where no fused kernel is written (bf16 here; CUDA alike) each op is
/// candle's own.
#[test]
fn fused_ops_fall_back_to_candles_ops_where_they_have_no_kernel() {
    let (rows, width) = (4, 8);
    let x = noise(rows * width, 51, 2.0);
    let dy = noise(rows * width, 52, 1.0);
    let (w, b) = (noise(width, 53, 1.0), noise(width, 54, 1.0));
    let norm = [
        (&x[..], &[rows, width][..]),
        (&w[..], &[width][..]),
        (&b[..], &[width][..]),
    ];
    assert_eq!(
        values_and_grads(&layer_norm, &norm, &dy, DType::BF16),
        values_and_grads(&layer_norm_composite, &norm, &dy, DType::BF16)
    );
    let square = [(&x[..], &[2, 4, 4][..])];
    assert_eq!(
        values_and_grads(
            &|t| ops::causal_softmax(&t[0], 0.5),
            &square,
            &dy,
            DType::BF16
        ),
        values_and_grads(
            &|t| causal_softmax_composite(&t[0], 0.5),
            &square,
            &dy,
            DType::BF16
        )
    );
    let labels = [1u32, 0, 7, 3];
    let logits = [(&x[..], &[rows, width][..])];
    assert_eq!(
        values_and_grads(
            &|t| ops::cross_entropy(&t[0], &targets(&labels)),
            &logits,
            &[1.0],
            DType::BF16
        ),
        values_and_grads(
            &|t| candle_nn::loss::cross_entropy(&t[0], &targets(&labels)),
            &logits,
            &[1.0],
            DType::BF16
        )
    );
    let packed = noise(2 * 4 * 12, 55, 1.5);
    let packed = [(&packed[..], &[2, 4, 12][..])];
    let dy = noise(2 * 4 * 4, 56, 1.0);
    assert_eq!(
        values_and_grads(
            &|t| ops::causal_attention(&t[0], 2),
            &packed,
            &dy,
            DType::BF16
        ),
        values_and_grads(
            &|t| ops::causal_attention_unfused(&t[0], 2),
            &packed,
            &dy,
            DType::BF16
        )
    );
}

/// Bad input is refused with an error that names it.
#[test]
fn fused_ops_refuse_bad_input_naming_it() {
    let cpu = &Device::Cpu;
    let x = Tensor::zeros((3, 4), DType::F32, cpu).unwrap();
    let message = |r: candle_core::Result<Tensor>| r.unwrap_err().to_string();

    let e = message(ops::cross_entropy(
        &x,
        &Tensor::new(&[0u32, 9, 1], cpu).unwrap(),
    ));
    assert!(
        e.contains("target 9 at row 1") && e.contains("4 classes"),
        "{e}"
    );
    let e = message(ops::cross_entropy(
        &x,
        &Tensor::new(&[0i64, 1, -2], cpu).unwrap(),
    ));
    assert!(e.contains("target -2 at row 2"), "{e}");
    let e = message(ops::cross_entropy(
        &x,
        &Tensor::new(&[0u32, 1], cpu).unwrap(),
    ));
    assert!(e.contains("targets of shape [2] for 3 rows"), "{e}");

    let short = Tensor::zeros(3, DType::F32, cpu).unwrap();
    let four = Tensor::zeros(4, DType::F32, cpu).unwrap();
    let e = message(ops::layer_norm(&x, &short, &four, 1e-5));
    assert!(e.contains("weight of shape [3] for rows of width 4"), "{e}");
    let e = message(ops::layer_norm(&x, &four, &short, 1e-5));
    assert!(e.contains("bias of shape [3]"), "{e}");

    let e = message(ops::causal_softmax(&x, 1.0));
    assert!(e.contains("[3, 4]") && e.contains("T x T"), "{e}");

    let e = message(ops::causal_attention(&x, 1));
    assert!(
        e.contains("[3, 4]") && e.contains("(batch, positions"),
        "{e}"
    );
    let packed = Tensor::zeros((2, 3, 24), DType::F32, cpu).unwrap();
    let e = message(ops::causal_attention(&packed, 3));
    assert!(
        e.contains("last dimension of 24") && e.contains("3 head(s)"),
        "{e}"
    );
    let e = message(ops::causal_attention(&packed, 0));
    assert!(e.contains("0 head(s)"), "{e}");
    let odd = Tensor::zeros((2, 3, 25), DType::F32, cpu).unwrap();
    let e = message(ops::causal_attention(&odd, 1));
    assert!(e.contains("last dimension of 25"), "{e}");
    for empty in [(2, 0, 24), (2, 3, 0)] {
        let empty = Tensor::zeros(empty, DType::F32, cpu).unwrap();
        let e = message(ops::causal_attention(&empty, 1));
        assert!(e.contains("no positions or no columns"), "{e}");
    }
    // No sequences is not an error: nothing to attend, an empty output.
    let none = Tensor::zeros((0, 3, 24), DType::F32, cpu).unwrap();
    assert_eq!(ops::causal_attention(&none, 2).unwrap().dims(), &[0, 3, 8]);

    let weight = Tensor::zeros((5, 3), DType::F32, cpu).unwrap();
    let e = message(ops::linear(&x, &weight, None));
    assert!(e.contains("input of width 4") && e.contains("5 x 3"), "{e}");
    let e = message(ops::bias_add(&x, &short));
    assert!(e.contains("bias of shape [3] for rows of width 4"), "{e}");
}
