//! `ops::fused_linear`: a linear layer and its ReLU as one op, against
//! PyTorch's `relu(linear(...))` (`data/ops_reference.json`'s
//! `linear_relu`, odd shapes and inputs of 1e3) and candle's composite
//! ops (`matmul`, `broadcast_add`, `relu`), value and every gradient.

use candle_core::{DType, Device, Tensor, Var};
use candle_dp::ops::{self, Activation};

use crate::ops::{
    assert_equal_up_to_rounding, farthest, noise, reference, values_and_grads, Case, Op, Run,
};

fn fused(act: Activation) -> impl Fn(&[Tensor]) -> candle_core::Result<Tensor> {
    move |t: &[Tensor]| ops::fused_linear(&t[0], &t[1], Some(&t[2]), act)
}

fn composite(act: Activation) -> impl Fn(&[Tensor]) -> candle_core::Result<Tensor> {
    move |t: &[Tensor]| {
        let y = t[0].broadcast_matmul(&t[1].t()?)?.broadcast_add(&t[2])?;
        match act {
            Activation::Identity => Ok(y),
            Activation::Relu => y.relu(),
            Activation::Gelu => y.gelu(),
        }
    }
}

/// `f` on a case's inputs (x, its weight and bias) in `dtype`.
fn on(f: &Op<'_>, case: &Case, dtype: DType) -> Run {
    let (o, i) = (case.b.len(), case.w.len() / case.b.len());
    let inputs = [
        (&case.x[..], &case.shape[..]),
        (&case.w[..], &[o, i][..]),
        (&case.b[..], &[o][..]),
    ];
    values_and_grads(f, &inputs, &case.dy, dtype)
}

/// PyTorch's value and gradients: in f64 within 1e-11; in f32 equal to
/// PyTorch's f32 up to its rounding, within 1e-5 of the exact values
/// (PyTorch's f64 on the same inputs) relative to them, on one row, on
/// widths of 7, 13, 19 and 70 (not multiples of 8 lanes) and at inputs of
/// 1e3.
#[test]
fn fused_linear_relu_matches_pytorchs_forward_and_backward_on_odd_shapes() {
    let reference = reference();
    assert_eq!(reference.linear_relu.len(), 4);
    let relu = fused(Activation::Relu);
    for both in &reference.linear_relu {
        let shape = &both.f64.shape;
        let got = on(&relu, &both.f64, DType::F64);
        let d = farthest(&got, &both.f64.torch.run());
        assert!(d <= 1e-11, "f64 {shape:?}: {d:e} from PyTorch");
        let got = on(&relu, &both.f32, DType::F32);
        let (torch, exact) = (both.f32.torch.run(), both.f32.exact.run());
        let what = format!("f32 {shape:?} against PyTorch");
        assert_equal_up_to_rounding(&what, &got, &torch, &exact, 1e-5);
        // Some outputs are cut by the ReLU, so its gradient is exercised.
        assert!(got.0.contains(&0.0) && got.0.iter().any(|&v| v > 0.0));
    }
}

/// candle's composite ops, in f32 up to their rounding (the fused op in
/// f64 the exact values), with and without the ReLU, on a batch large
/// enough to split over threads and on a 3-D input.
#[test]
fn fused_linear_equals_candles_composite_ops_in_f32() {
    for (shape, out) in [(vec![300, 77], 45), (vec![3, 5, 17], 6)] {
        let inner = shape[shape.len() - 1];
        let rows: usize = shape.iter().product::<usize>() / inner;
        let case = Case {
            x: noise(rows * inner, 1, 2.0),
            shape: shape.clone(),
            w: noise(out * inner, 2, 0.3),
            b: noise(out, 3, 0.5),
            dy: noise(rows * out, 4, 1.0),
            ..Case::default()
        };
        for act in [Activation::Identity, Activation::Relu] {
            let exact = on(&fused(act), &case, DType::F64);
            let got = on(&fused(act), &case, DType::F32);
            let other = on(&composite(act), &case, DType::F32);
            let what = format!("{act:?} {shape:?} onto {out}");
            assert_equal_up_to_rounding(&what, &got, &other, &exact, 1e-6);
        }
    }
}

/// A weight whose rows are 4 KiB long (1024 f32, 512 f64) with at least
/// 64 rows is transposed before the forward's product: the same bytes as
/// candle's product of the weight as it lies, on 2 to 130 rows (on either
/// side of gemm's small-product kernels, at 256 outputs), and the
/// gradients of the composite ops up to rounding.
#[test]
fn a_weight_of_4_kib_rows_is_transposed_for_the_same_bytes_as_candles_product() {
    let cpu = &Device::Cpu;
    for (dtype, inner) in [(DType::F32, 1024), (DType::F64, 512)] {
        for (rows, out) in [(2, 64), (4, 64), (5, 64), (2, 200), (7, 96), (130, 64)] {
            let tensor = |n: usize, seed: u64, dims: (usize, usize)| {
                Tensor::new(noise(n, seed, 1.0), cpu)?
                    .reshape(dims)?
                    .to_dtype(dtype)
            };
            let x = tensor(rows * inner, 7, (rows, inner)).unwrap();
            let w = tensor(out * inner, 8, (out, inner)).unwrap();
            let fused = ops::fused_linear(&x, &w, None, Activation::Identity).unwrap();
            let candle = x.matmul(&w.t().unwrap()).unwrap();
            let bits = |t: &Tensor| {
                t.to_dtype(DType::F64)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f64>()
                    .unwrap()
            };
            assert_eq!(
                bits(&fused),
                bits(&candle),
                "{dtype:?} {rows} x {inner} onto {out}"
            );
        }
    }
    let (rows, inner, out) = (5, 1024, 70);
    let case = Case {
        x: noise(rows * inner, 1, 2.0),
        shape: vec![rows, inner],
        w: noise(out * inner, 2, 0.3),
        b: noise(out, 3, 0.5),
        dy: noise(rows * out, 4, 1.0),
        ..Case::default()
    };
    let exact = on(&fused(Activation::Relu), &case, DType::F64);
    let got = on(&fused(Activation::Relu), &case, DType::F32);
    let other = on(&composite(Activation::Relu), &case, DType::F32);
    assert_equal_up_to_rounding("4 KiB rows", &got, &other, &exact, 1e-6);
}

/// GELU fused into the layer: the values and every gradient of
/// `ops::linear` then `ops::gelu`, bit for bit, in f32 and f64, on one
/// row, a 3-D input and a weight of 4 KiB rows; without a bias too; and a
/// second backward through the same graph gives the first one's.
#[test]
fn fused_linear_gelu_is_linear_then_gelu_bit_for_bit() {
    let fused_gelu = |t: &[Tensor]| ops::fused_linear(&t[0], &t[1], Some(&t[2]), Activation::Gelu);
    let separate = |t: &[Tensor]| ops::gelu(&ops::linear(&t[0], &t[1], Some(&t[2]))?);
    let fused_no_bias = |t: &[Tensor]| ops::fused_linear(&t[0], &t[1], None, Activation::Gelu);
    let separate_no_bias = |t: &[Tensor]| ops::gelu(&ops::linear(&t[0], &t[1], None)?);
    for (shape, out) in [(vec![1, 13], 11), (vec![2, 5, 7], 9), (vec![6, 1024], 70)] {
        let inner = shape[shape.len() - 1];
        let rows: usize = shape.iter().product::<usize>() / inner;
        let case = Case {
            x: noise(rows * inner, 11, 3.0),
            shape: shape.clone(),
            w: noise(out * inner, 12, 0.5),
            b: noise(out, 13, 0.5),
            dy: noise(rows * out, 14, 1.0),
            ..Case::default()
        };
        for dtype in [DType::F32, DType::F64] {
            let what = format!("{dtype:?} {shape:?} onto {out}");
            assert_eq!(
                on(&fused_gelu, &case, dtype),
                on(&separate, &case, dtype),
                "{what}"
            );
            let inputs = [(&case.x[..], &shape[..]), (&case.w[..], &[out, inner][..])];
            let no_bias = |f: &Op<'_>| values_and_grads(f, &inputs, &case.dy, dtype);
            assert_eq!(
                no_bias(&fused_no_bias),
                no_bias(&separate_no_bias),
                "{what}, no bias"
            );
        }
    }
    let cpu = &Device::Cpu;
    let x = Var::new(&[[0.5f32, -1.0, 2.0], [3.0, 0.25, -0.5]], cpu).unwrap();
    let w = Var::new(&[[1f32, -2.0, 0.5], [0.3, 0.2, 0.1]], cpu).unwrap();
    let y = ops::fused_linear(&x, &w, None, Activation::Gelu).unwrap();
    let loss = y.sqr().unwrap().sum_all().unwrap();
    let (first, second) = (loss.backward().unwrap(), loss.backward().unwrap());
    for v in [&x, &w] {
        let grad =
            |g: &candle_core::backprop::GradStore| g.get(v).unwrap().to_vec2::<f32>().unwrap();
        assert_eq!(grad(&first), grad(&second));
    }
}

/// An input that is data (no variable behind it, a first layer's) gets
/// no gradient, the weight and bias theirs; without a bias, the weight's
/// gradient is the same.
#[test]
fn fused_linear_gives_data_no_gradient_and_runs_without_a_bias() {
    let cpu = &Device::Cpu;
    let x = Tensor::new(noise(4 * 3, 5, 1.0), cpu)
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap();
    let x = x.reshape((4, 3)).unwrap();
    let w = Var::from_tensor(
        &Tensor::new(noise(2 * 3, 6, 1.0), cpu)
            .unwrap()
            .reshape((2, 3))
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap(),
    )
    .unwrap();
    let b = Var::zeros(2, DType::F32, cpu).unwrap();
    let with = ops::fused_linear(&x, &w, Some(&b), Activation::Relu).unwrap();
    let grads = with.sum_all().unwrap().backward().unwrap();
    assert!(grads.get(&x).is_none(), "the data got a gradient");
    let (dw, db) = (grads.get(&w).unwrap(), grads.get(&b).unwrap());
    assert_eq!(db.dims(), &[2]);
    let without = ops::fused_linear(&x, &w, None, Activation::Relu).unwrap();
    assert_eq!(
        with.to_vec2::<f32>().unwrap(),
        without.to_vec2::<f32>().unwrap()
    );
    let again = without.sum_all().unwrap().backward().unwrap();
    assert_eq!(
        again.get(&w).unwrap().to_vec2::<f32>().unwrap(),
        dw.to_vec2::<f32>().unwrap()
    );
}

/// Where it has no kernel (f16 here; any dtype but f32 and f64, any
/// device but the CPU) it is candle's ops, the same values.
#[test]
fn fused_linear_falls_back_to_candles_ops_where_it_has_no_kernel() {
    let case = Case {
        x: noise(6 * 5, 7, 1.0),
        shape: vec![6, 5],
        w: noise(4 * 5, 8, 1.0),
        b: noise(4, 9, 1.0),
        dy: noise(6 * 4, 10, 1.0),
        ..Case::default()
    };
    let got = on(&fused(Activation::Relu), &case, DType::F16);
    let other = on(&composite(Activation::Relu), &case, DType::F16);
    assert_eq!(got, other);
}

/// A weight that is not 2-D or of another width, a bias of another
/// length, dtypes that differ: errors naming them.
#[test]
fn fused_linear_refuses_bad_input_naming_it() {
    let cpu = &Device::Cpu;
    let x = Tensor::zeros((3, 4), DType::F32, cpu).unwrap();
    let message = |w: &Tensor, b: Option<&Tensor>| {
        ops::fused_linear(&x, w, b, Activation::Relu)
            .unwrap_err()
            .to_string()
    };
    let w = Tensor::zeros((5, 3), DType::F32, cpu).unwrap();
    let e = message(&w, None);
    assert!(e.contains("width 4") && e.contains("5 x 3"), "{e}");
    let w = Tensor::zeros((5, 4), DType::F32, cpu).unwrap();
    let e = message(&w, Some(&Tensor::zeros(4, DType::F32, cpu).unwrap()));
    assert!(e.contains("bias of shape [4]"), "{e}");
    let e = message(&w.to_dtype(DType::F64).unwrap(), None);
    assert!(e.contains("dtypes differ"), "{e}");
    let e = message(&Tensor::zeros(4, DType::F32, cpu).unwrap(), None);
    assert!(e.contains("rank") || e.contains("dims"), "{e}");
}

/// An input of no columns gives the bias on every row (PyTorch's `linear`
/// does), and a weight that is no variable (frozen) gets no gradient
/// while the input that is one gets its own.
#[test]
fn fused_linear_of_no_columns_is_the_bias_and_a_frozen_weight_gets_no_gradient() {
    let cpu = &Device::Cpu;
    let x = Tensor::zeros((5, 0), DType::F32, cpu).unwrap();
    let w = Tensor::zeros((3, 0), DType::F32, cpu).unwrap();
    let b = Tensor::new(&[1f32, -2.0, 3.0], cpu).unwrap();
    let y = ops::fused_linear(&x, &w, Some(&b), Activation::Relu).unwrap();
    assert_eq!(y.to_vec2::<f32>().unwrap(), vec![vec![1.0, 0.0, 3.0]; 5]);

    let x = Var::from_tensor(&Tensor::new(&[[1f32, 2.0], [3.0, -4.0]], cpu).unwrap()).unwrap();
    let frozen = Tensor::new(&[[0.5f32, 0.25]], cpu).unwrap();
    let y = ops::fused_linear(&x, &frozen, None, Activation::Identity).unwrap();
    let grads = y.sum_all().unwrap().backward().unwrap();
    assert!(
        grads.get(&frozen).is_none(),
        "the frozen weight got a gradient"
    );
    assert_eq!(
        grads.get(&x).unwrap().to_vec2::<f32>().unwrap(),
        vec![vec![0.5, 0.25]; 2]
    );
}
