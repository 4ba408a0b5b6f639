//! Gradient clipping against real PyTorch's `clip_grad_norm_`
//! (`tests/data/clip_reference.json`, `scripts/gen_clip_reference.py`):
//! norm types 1, 2, inf and p, gradients above and below the limit, tiny
//! gradients whose squares underflow, and NaN and infinite gradients with
//! and without `error_if_nonfinite`.

use candle_core::{DType, Device, Tensor, Var};
use candle_dp::optim::clip_grad_norm;
use candle_dp::Error;

#[derive(serde::Deserialize)]
struct Case {
    name: String,
    shapes: Vec<Vec<usize>>,
    grads: Vec<Vec<u32>>,
    max_norm: f64,
    norm_type: serde_json::Value,
    error_if_nonfinite: bool,
    total_norm: Option<u32>,
    clipped: Option<Vec<Vec<u32>>>,
    error: Option<String>,
}

#[derive(serde::Deserialize)]
struct File {
    torch: String,
    cases: Vec<Case>,
}

fn f32s(bits: &[u32]) -> Vec<f32> {
    bits.iter().map(|&b| f32::from_bits(b)).collect()
}

/// `|a - b| / |b|`, 0 where both are equal (NaN with NaN included).
fn rel(a: f32, b: f32) -> f64 {
    if a == b || (a.is_nan() && b.is_nan()) {
        0.0
    } else {
        ((a as f64 - b as f64) / b as f64).abs()
    }
}

#[test]
fn clipping_reproduces_pytorchs_clip_grad_norm() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/data/clip_reference.json");
    let file: File = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
    assert!(file.torch.starts_with("2.15"), "{}", file.torch);
    let mut worst = 0f64;
    for case in &file.cases {
        let norm_type = match &case.norm_type {
            serde_json::Value::String(s) if s == "inf" => f64::INFINITY,
            v => v.as_f64().unwrap(),
        };
        let params: Vec<Var> = case
            .shapes
            .iter()
            .map(|s| Var::zeros(s.as_slice(), DType::F32, &Device::Cpu).unwrap())
            .collect();
        let mut grads = params[0].as_tensor().sum_all().unwrap().backward().unwrap();
        for ((p, shape), g) in params.iter().zip(&case.shapes).zip(&case.grads) {
            let g = Tensor::from_vec(f32s(g), shape.as_slice(), &Device::Cpu).unwrap();
            grads.insert(p.as_tensor(), g);
        }
        let got = clip_grad_norm(
            &mut grads,
            &params,
            case.max_norm,
            norm_type,
            case.error_if_nonfinite,
        );
        match (&case.error, got) {
            (Some(_), Err(err)) => {
                assert!(matches!(err, Error::Clip(_)), "{}: {err}", case.name);
                // Nothing changed.
                for ((p, shape), g) in params.iter().zip(&case.shapes).zip(&case.grads) {
                    let now = grads.get(p.as_tensor()).unwrap().flatten_all().unwrap();
                    let now: Vec<u32> = now
                        .to_vec1::<f32>()
                        .unwrap()
                        .iter()
                        .map(|x| x.to_bits())
                        .collect();
                    assert_eq!(
                        &now, g,
                        "{}: a gradient of shape {shape:?} changed",
                        case.name
                    );
                }
            }
            (Some(want), Ok(c)) => {
                panic!("{}: clipped ({c:?}) where PyTorch said: {want}", case.name)
            }
            (None, Err(err)) => panic!("{}: {err}", case.name),
            (None, Ok(c)) => {
                let want_total = f32::from_bits(case.total_norm.unwrap());
                let d = rel(c.total_norm as f32, want_total);
                worst = worst.max(d);
                assert!(
                    d <= 1e-6,
                    "{}: total norm {} against PyTorch's {want_total}",
                    case.name,
                    c.total_norm
                );
                for ((p, want), shape) in params
                    .iter()
                    .zip(case.clipped.as_ref().unwrap())
                    .zip(&case.shapes)
                {
                    let got = grads
                        .get(p.as_tensor())
                        .unwrap()
                        .flatten_all()
                        .unwrap()
                        .to_vec1::<f32>()
                        .unwrap();
                    for (k, (g, w)) in got.iter().zip(f32s(want)).enumerate() {
                        let d = rel(*g, w);
                        worst = worst.max(d);
                        assert!(
                            d <= 1e-6,
                            "{}: gradient {shape:?}[{k}] {g} against PyTorch's {w}",
                            case.name
                        );
                    }
                }
            }
        }
    }
    eprintln!("largest relative difference from PyTorch 2.15: {worst:.2e}");
}

#[test]
fn a_norm_type_or_max_norm_that_is_not_a_number_is_refused() {
    let w = Var::zeros(2, DType::F32, &Device::Cpu).unwrap();
    let mut grads = w.as_tensor().sum_all().unwrap().backward().unwrap();
    for (max_norm, norm_type) in [(1.0, 0.0), (1.0, -2.0), (1.0, f64::NAN), (f64::NAN, 2.0)] {
        let err = clip_grad_norm(
            &mut grads,
            std::slice::from_ref(&w),
            max_norm,
            norm_type,
            false,
        )
        .unwrap_err();
        assert!(matches!(err, Error::Clip(_)), "{err}");
    }
}

/// A bf16 and an f32 parameter with gradients of known values, in one
/// store: `(a, b, ga, gb, grads)`.
fn bf16_beside_f32() -> (Var, Var, Tensor, Tensor, candle_core::backprop::GradStore) {
    let dev = Device::Cpu;
    let a = Var::zeros(6, DType::BF16, &dev).unwrap();
    let b = Var::zeros(5, DType::F32, &dev).unwrap();
    let ga = Tensor::new(&[3.1f32, -7.3, 2.2, 9.9, 0.7, 4.4], &dev)
        .unwrap()
        .to_dtype(DType::BF16)
        .unwrap();
    let gb = Tensor::new(&[1.3f32, 5.5, -2.7, 8.1, 0.2], &dev).unwrap();
    let loss = (a
        .as_tensor()
        .to_dtype(DType::F32)
        .unwrap()
        .sum_all()
        .unwrap()
        + b.as_tensor().sum_all().unwrap())
    .unwrap();
    let mut grads = loss.backward().unwrap();
    grads.insert(a.as_tensor(), ga.clone());
    grads.insert(b.as_tensor(), gb.clone());
    (a, b, ga, gb, grads)
}

/// bf16 and f32 gradients together: each norm is taken in its gradient's
/// dtype (bf16's accumulated in f32 and rounded, as PyTorch reduces bf16)
/// and the total in the promoted dtype, f32, whichever parameter comes
/// first (it used to be taken in the first gradient's dtype: 14.5625 in
/// bf16 or 14.6045 in f32 for one set).
#[test]
fn a_total_over_bf16_and_f32_gradients_is_taken_in_f32_whatever_the_order() {
    let total_of = |first_bf16: bool| {
        let (a, b, _, _, mut grads) = bf16_beside_f32();
        let order = match first_bf16 {
            true => [a, b],
            false => [b, a],
        };
        clip_grad_norm(&mut grads, &order, 1e9, 2.0, false)
            .unwrap()
            .total_norm
    };
    let (ab, ba) = (total_of(true), total_of(false));
    assert_eq!(ab.to_bits(), ba.to_bits(), "{ab} against {ba}");
    let (_, _, ga, gb, _) = bf16_beside_f32();
    let norm = |g: &Tensor| -> f32 {
        g.to_dtype(DType::F32)
            .unwrap()
            .sqr()
            .unwrap()
            .sum_all()
            .unwrap()
            .sqrt()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap()
    };
    // bf16's norm rounded to bf16, then widened; f32's as it is.
    let na = Tensor::new(norm(&ga), &Device::Cpu)
        .unwrap()
        .to_dtype(DType::BF16)
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    let nb = norm(&gb);
    let expected = (na * na + nb * nb).sqrt();
    assert_eq!(ab as f32, expected, "{ab} against {expected}");
    assert_eq!(ab, ab as f32 as f64, "an f32 total");
}

/// The factor multiplies a bf16 gradient in f32, rounded once, as
/// PyTorch's `_foreach_mul_` by an f32 factor does (not the factor rounded
/// to bf16 first).
#[test]
fn a_bf16_gradient_is_scaled_by_the_f32_factor_rounded_once() {
    let (a, b, ga, _, mut grads) = bf16_beside_f32();
    let clipped = clip_grad_norm(&mut grads, &[a.clone(), b], 1.0, 2.0, false).unwrap();
    let factor = (1.0f32 / (clipped.total_norm as f32 + 1e-6)).min(1.0);
    assert_eq!(clipped.factor as f32, factor);
    let bf16_bits = |t: &Tensor| -> Vec<u16> {
        t.to_vec1::<half::bf16>()
            .unwrap()
            .into_iter()
            .map(|x| x.to_bits())
            .collect()
    };
    let expected = ga
        .to_dtype(DType::F32)
        .unwrap()
        .affine(factor as f64, 0.0)
        .unwrap()
        .to_dtype(DType::BF16)
        .unwrap();
    assert_eq!(
        bf16_bits(grads.get(a.as_tensor()).unwrap()),
        bf16_bits(&expected)
    );
}
