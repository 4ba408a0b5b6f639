//! The fused training ops (`candle_dp::ops`): each against candle's
//! composite ops, a finite-difference check in f64, and PyTorch's op
//! (`tests/data/ops_reference.json`, made by `scripts/gen_ops_reference.py`).

use candle_core::{DType, Device, Tensor, Var};
use candle_dp::ops;

#[derive(serde::Deserialize)]
struct Case {
    x: Vec<f64>,
    dy: Vec<f64>,
    y: Vec<f64>,
    dx: Vec<f64>,
}

#[derive(serde::Deserialize)]
struct Gelu {
    f32: Case,
    f64: Case,
}

#[derive(serde::Deserialize)]
struct Reference {
    torch: String,
    gelu: Gelu,
}

fn reference() -> Reference {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/ops_reference.json");
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

/// `f(x)`'s value and the gradient of `sum(f(x) * dy)` at `x`.
fn value_and_grad(
    f: impl Fn(&Tensor) -> candle_core::Result<Tensor>,
    x: &[f64],
    dy: &[f64],
    dtype: DType,
) -> (Vec<f64>, Vec<f64>) {
    let var = Var::from_tensor(
        &Tensor::new(x, &Device::Cpu)
            .unwrap()
            .to_dtype(dtype)
            .unwrap(),
    )
    .unwrap();
    let dy = Tensor::new(dy, &Device::Cpu)
        .unwrap()
        .to_dtype(dtype)
        .unwrap();
    let y = f(var.as_tensor()).unwrap();
    let grads = (&y * &dy).unwrap().sum_all().unwrap().backward().unwrap();
    (values(&y), values(grads.get(var.as_tensor()).unwrap()))
}

/// The forward is candle's `gelu`, element for element; the backward
/// within 1e-6 of candle's (whose derivative's constants are cut to six
/// digits), in f32.
#[test]
fn fused_gelu_equals_candles_composite_gelu() {
    let case = &reference().gelu.f32;
    let (y, dx) = value_and_grad(ops::gelu, &case.x, &case.dy, DType::F32);
    let (want_y, want_dx) = value_and_grad(|x| x.gelu(), &case.x, &case.dy, DType::F32);
    assert_eq!(y, want_y, "forward");
    let d = rel(&dx, &want_dx, 1.0);
    println!("gelu backward against candle's: {d:.1e}");
    assert!(d <= 1e-6, "backward {d:e} from candle's");
}

/// Against PyTorch's `gelu(approximate="tanh")` and its gradient, f32 and
/// f64, differences over max(|PyTorch's value|, 1): f32's tanh differs by
/// a few ulps between the libraries, and the derivative's `1 - t^2`
/// cancels near |x| = 2-3, so f32 is bounded at 5e-6; and no farther from
/// PyTorch than candle's own backward.
#[test]
fn fused_gelu_matches_pytorchs_forward_and_backward() {
    let reference = reference();
    for (dtype, case, tolerance) in [
        (DType::F32, &reference.gelu.f32, 5e-6),
        (DType::F64, &reference.gelu.f64, 1e-14),
    ] {
        let (y, dx) = value_and_grad(ops::gelu, &case.x, &case.dy, dtype);
        let (dy_rel, dx_rel) = (rel(&y, &case.y, 1.0), rel(&dx, &case.dx, 1.0));
        let (_, candle_dx) = value_and_grad(|x| x.gelu(), &case.x, &case.dy, dtype);
        let candle_rel = rel(&candle_dx, &case.dx, 1.0);
        println!(
            "{dtype:?}: forward {dy_rel:.1e}, backward {dx_rel:.1e} from PyTorch (candle's \
             composite backward {candle_rel:.1e})"
        );
        assert!(dy_rel <= tolerance, "{dtype:?} forward {dy_rel:e}");
        assert!(dx_rel <= tolerance, "{dtype:?} backward {dx_rel:e}");
        assert!(
            dx_rel <= candle_rel,
            "{dtype:?}: farther from PyTorch than candle's"
        );
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
    assert_eq!(values(&fused), values(&x.gelu().unwrap()));
    assert_eq!(fused.dims(), &[4, 3]);
}
