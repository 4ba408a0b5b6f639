//! PyTorch's training recipe, loss scaling then clipping (scale, backward,
//! unscale, clip_grad_norm, step, update), on every strategy: one device,
//! `DataParallel`, DDP, ZeRO-2 and the pipeline train the same global batch
//! to the same weights, and skip the same step when an input holds an inf;
//! under ZeRO-2 an inf in one rank's own gradients skips every rank's step.

// The ZeroOptimizer's step returns candle_dp::Result inside the scaler's closure.
#![allow(clippy::result_large_err)]

use std::collections::HashMap;

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Module, Tensor, Var};
use candle_dp::launch::spawn;
use candle_dp::optim::{clip_grad_norm, GradScaler, GradScalerConfig, Sgd, SgdConfig};
use candle_dp::pipeline::{unit, Pipeline};
use candle_dp::zero::{ZeroOptimizer, ZeroStage};
use candle_dp::{cpu_devices, seeded_varmap, DataParallel, DistributedDataParallel, LossReduction};
use candle_nn::{linear, loss, Optimizer, VarBuilder};

use crate::common::{max_rel_diff, snapshot, varmap_from, within, Mlp};

const SIZES: (usize, usize, usize) = (10, 24, 4);
const BATCH: usize = 8;
const STEPS: usize = 5;
/// The step whose input holds an inf (in row 5: rank 1's, replica 1's,
/// the pipeline's third micro-batch).
const INF_STEP: usize = 2;
const MAX_NORM: f64 = 0.5;

fn mlp(vb: VarBuilder) -> candle_core::Result<Mlp> {
    Mlp::new(vb, SIZES)
}

fn init() -> HashMap<String, Tensor> {
    snapshot(&seeded_varmap(21, DType::F32, &Device::Cpu, mlp).unwrap())
}

fn batch(t: usize) -> (Tensor, Tensor) {
    let n = BATCH * SIZES.0;
    let mut x: Vec<f32> = (0..n)
        .map(|i| (((i * 53 + t * 29) % 89) as f32 / 89.0 - 0.5) * 4.0)
        .collect();
    if t == INF_STEP {
        x[5 * SIZES.0 + 3] = f32::INFINITY;
    }
    let y: Vec<u32> = (0..BATCH).map(|i| ((i * 5 + t) % SIZES.2) as u32).collect();
    (
        Tensor::from_vec(x, (BATCH, SIZES.0), &Device::Cpu).unwrap(),
        Tensor::new(y, &Device::Cpu).unwrap(),
    )
}

fn sgd_config() -> SgdConfig {
    SgdConfig {
        lr: 0.1,
        momentum: 0.9,
        ..Default::default()
    }
}

fn scaler() -> GradScaler {
    GradScaler::new(GradScalerConfig {
        init_scale: 1024.0,
        ..Default::default()
    })
    .unwrap()
}

/// The loss times the scaler's current scale (inside the closures of
/// `DataParallel` and the pipeline, which compute the loss themselves).
fn scaled_loss(logits: &Tensor, y: &Tensor, scale: f32) -> candle_core::Result<Tensor> {
    loss::cross_entropy(logits, y)?.broadcast_mul(&Tensor::new(scale, logits.device())?)
}

/// Unscale, clip, step, update; whether it stepped.
fn finish_step(
    scaler: &mut GradScaler,
    grads: &mut GradStore,
    params: &[Var],
    opt: &mut Sgd,
) -> bool {
    scaler.unscale(grads, params).unwrap();
    clip_grad_norm(grads, params, MAX_NORM, 2.0, false).unwrap();
    let stepped = scaler.step(grads, params, |g| opt.step(g)).unwrap();
    scaler.update().unwrap();
    stepped
}

type Outcome = (Vec<bool>, HashMap<String, Tensor>);

fn one_device() -> Outcome {
    let varmap = varmap_from(&init());
    let model = mlp(VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu)).unwrap();
    let params = crate::common::sorted_var_list(&varmap);
    let mut opt = Sgd::from_varmap(&varmap, sgd_config()).unwrap();
    let mut scaler = scaler();
    let mut stepped = Vec::new();
    for t in 0..STEPS {
        let (x, y) = batch(t);
        let loss = loss::cross_entropy(&model.forward(&x).unwrap(), &y).unwrap();
        let mut grads = scaler.scale(&loss).unwrap().backward().unwrap();
        stepped.push(finish_step(&mut scaler, &mut grads, &params, &mut opt));
    }
    (stepped, snapshot(&varmap))
}

fn data_parallel() -> Outcome {
    let varmap = varmap_from(&init());
    let dp = DataParallel::new(&varmap, DType::F32, &cpu_devices(2), mlp).unwrap();
    let params = crate::common::sorted_var_list(&varmap);
    let mut opt = Sgd::from_varmap(&varmap, sgd_config()).unwrap();
    let mut scaler = scaler();
    let mut stepped = Vec::new();
    for t in 0..STEPS {
        let scale = scaler.scale_factor();
        let step = dp
            .forward_backward(batch(t), LossReduction::Mean, move |m, (x, y)| {
                scaled_loss(&m.forward(&x)?, &y, scale)
            })
            .unwrap();
        let mut grads = step.grads;
        stepped.push(finish_step(&mut scaler, &mut grads, &params, &mut opt));
    }
    (stepped, snapshot(&varmap))
}

fn pipeline() -> Outcome {
    let varmap = varmap_from(&init());
    let (i, h, o) = SIZES;
    let layers = vec![
        unit(move |vb| linear(i, h, vb.pp("l1"))),
        unit(|_| Ok(candle_nn::Activation::Relu)),
        unit(move |vb| linear(h, o, vb.pp("l2"))),
    ];
    let pipe = Pipeline::builder(&varmap, DType::F32, &cpu_devices(2))
        .chunks(4)
        .build(layers)
        .unwrap();
    let params = crate::common::sorted_var_list(&varmap);
    let mut opt = Sgd::from_varmap(&varmap, sgd_config()).unwrap();
    let mut scaler = scaler();
    let mut stepped = Vec::new();
    for t in 0..STEPS {
        let (x, y) = batch(t);
        let scale = scaler.scale_factor();
        let step = pipe
            .forward_backward(&x, &y, LossReduction::Mean, move |out, y| {
                scaled_loss(out, y, scale)
            })
            .unwrap();
        let mut grads = step.grads;
        stepped.push(finish_step(&mut scaler, &mut grads, &params, &mut opt));
    }
    (stepped, snapshot(&varmap))
}

/// DDP over 2 thread ranks, or ZeRO-2 (each rank unscales and clips the
/// gradients it owns, with one all-reduce each); rank 0's outcome, after
/// checking that rank 1's is the same.
fn ddp(zero: bool) -> Outcome {
    let values = init();
    let ranks = within(120, move || {
        spawn(2, move |ctx| {
            let varmap = varmap_from(&values);
            let mut builder = DistributedDataParallel::builder(
                ctx.process_group(),
                &varmap,
                DType::F32,
                &Device::Cpu,
            );
            if zero {
                builder = builder.zero(ZeroStage::Two);
            }
            let mut ddp = builder.build(mlp)?;
            let all: Vec<Var> = ddp.params().iter().map(|(_, v)| v.clone()).collect();
            let mut opt = Sgd::from_varmap(&varmap, sgd_config())?;
            let mut sharded = match zero {
                true => Some(ZeroOptimizer::new(&ddp, |mine| {
                    Sgd::new_named(mine, sgd_config())
                })?),
                false => None,
            };
            let mine: Vec<Var> = match &sharded {
                Some(z) => z.grad_vars(),
                None => all.clone(),
            };
            let mut scaler = scaler();
            let mut stepped = Vec::new();
            let rows = BATCH / 2;
            for t in 0..STEPS {
                let (x, y) = batch(t);
                let x = x.narrow(0, ctx.rank * rows, rows)?;
                let y = y.narrow(0, ctx.rank * rows, rows)?;
                let loss = loss::cross_entropy(&ddp.forward(&x)?, &y)?;
                let mut grads = ddp.backward(&scaler.scale(&loss)?)?;
                let took = match &mut sharded {
                    Some(z) => {
                        scaler.unscale_across(&mut grads, &mine, ctx.pg.as_ref())?;
                        z.clip_grad_norm(&mut grads, MAX_NORM, 2.0, false)?;
                        let took = scaler.step(&mut grads, &mine, |g| z.step(g))?;
                        scaler.update()?;
                        took
                    }
                    None => finish_step(&mut scaler, &mut grads, &all, &mut opt),
                };
                stepped.push(took);
            }
            Ok((stepped, snapshot(&varmap)))
        })
        .unwrap()
    });
    assert_eq!(ranks[0].0, ranks[1].0, "both ranks skip the same steps");
    assert!(crate::common::identical(&ranks[0].1, &ranks[1].1));
    ranks.into_iter().next().unwrap()
}

#[test]
fn scaling_and_clipping_train_every_strategy_to_one_devices_weights() {
    let (one_stepped, one) = one_device();
    let expected: Vec<bool> = (0..STEPS).map(|t| t != INF_STEP).collect();
    assert_eq!(
        one_stepped, expected,
        "one device skips the step with the inf"
    );
    for (name, (stepped, weights)) in [
        ("DataParallel", data_parallel()),
        ("DDP", ddp(false)),
        ("ZeRO-2", ddp(true)),
        ("pipeline", pipeline()),
    ] {
        assert_eq!(stepped, expected, "{name}: the steps taken");
        let gap = max_rel_diff(&weights, &one);
        assert!(
            gap <= 1e-5,
            "{name}: weights differ from one device's by {gap:e}"
        );
    }
}

/// Under ZeRO-2 each rank holds only its own parameters' reduced
/// gradients: an inf put into rank 1's alone (after the all-reduce) is
/// seen by rank 0 through `unscale_across`, and both skip and back off.
#[test]
fn an_inf_in_one_zero_ranks_own_gradients_skips_the_step_on_every_rank() {
    let values = init();
    let ranks = within(120, move || {
        spawn(2, move |ctx| {
            let varmap = varmap_from(&values);
            let mut ddp = DistributedDataParallel::builder(
                ctx.process_group(),
                &varmap,
                DType::F32,
                &Device::Cpu,
            )
            .zero(ZeroStage::Two)
            .build(mlp)?;
            let mut zero = ZeroOptimizer::new(&ddp, |mine| Sgd::new_named(mine, sgd_config()))?;
            let mine: Vec<Var> = zero.grad_vars();
            let before = snapshot(&varmap);
            let mut scaler = scaler();
            let (x, y) = batch(0);
            let x = x.narrow(0, ctx.rank * 4, 4)?;
            let y = y.narrow(0, ctx.rank * 4, 4)?;
            let loss = loss::cross_entropy(&ddp.forward(&x)?, &y)?;
            let mut grads = ddp.backward(&scaler.scale(&loss)?)?;
            if ctx.rank == 1 {
                let p = &mine[0];
                let g = grads.get(p.as_tensor()).unwrap();
                let bad = g.affine(0.0, f64::INFINITY)?;
                grads.insert(p.as_tensor(), bad);
            }
            let found = scaler.unscale_across(&mut grads, &mine, ctx.pg.as_ref())?;
            let stepped = scaler.step(&mut grads, &mine, |g| zero.step(g))?;
            scaler.update()?;
            let unchanged = crate::common::identical(&snapshot(&varmap), &before);
            Ok((found, stepped, scaler.scale_factor(), unchanged))
        })
        .unwrap()
    });
    for (rank, outcome) in ranks.iter().enumerate() {
        assert_eq!(outcome, &(true, false, 512.0, true), "rank {rank}");
    }
}
