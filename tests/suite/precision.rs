//! Mixed precision: f32 masters, the forward and backward in bf16 or f16,
//! on one device, `DataParallel`, DDP and ZeRO; with a `GradScaler` and
//! clipping for f16.

use std::collections::HashMap;

use candle_core::{DType, Device, Module, Tensor};
use candle_dp::launch::spawn;
use candle_dp::optim::{clip_grad_norm, GradScaler, GradScalerConfig, Sgd, SgdConfig};
use candle_dp::precision::{MixedPrecision, MixedPrecisionModel};
use candle_dp::zero::{ZeroOptimizer, ZeroStage};
use candle_dp::{
    cpu_devices, seeded_varmap, DataParallel, DdpConfig, DistributedDataParallel, Error,
    LossReduction,
};
use candle_nn::{linear, loss, Optimizer, VarBuilder, VarMap};

use crate::common::{identical, snapshot, within, Mlp};

const SIZES: (usize, usize, usize) = (12, 32, 5);
const STEPS: usize = 4;
const BATCH: usize = 8;
const LR: f64 = 0.05;

fn mlp(vb: VarBuilder) -> candle_core::Result<Mlp> {
    Mlp::new(vb, SIZES)
}

fn init() -> VarMap {
    seeded_varmap(3, DType::F32, &Device::Cpu, mlp).unwrap()
}

fn copy_of(varmap: &VarMap) -> VarMap {
    crate::common::varmap_from(&snapshot(varmap))
}

/// Step `t`'s global batch: inputs and labels.
fn batch(t: usize) -> (Tensor, Tensor) {
    let n = BATCH * SIZES.0;
    let x: Vec<f32> = (0..n)
        .map(|i| (((i * 37 + t * 101) % 97) as f32 / 97.0 - 0.5) * 3.0)
        .collect();
    let y: Vec<u32> = (0..BATCH)
        .map(|i| ((i * 7 + t * 3) % SIZES.2) as u32)
        .collect();
    (
        Tensor::from_vec(x, (BATCH, SIZES.0), &Device::Cpu).unwrap(),
        Tensor::new(y, &Device::Cpu).unwrap(),
    )
}

/// The loss in f32 on the low-precision logits (what autocast does).
fn loss_of(logits: &Tensor, y: &Tensor) -> candle_core::Result<Tensor> {
    loss::cross_entropy(&logits.to_dtype(DType::F32)?, y)
}

fn sgd(varmap: &VarMap) -> Sgd {
    Sgd::from_varmap(
        varmap,
        SgdConfig {
            lr: LR,
            momentum: 0.9,
            ..Default::default()
        },
    )
    .unwrap()
}

/// `STEPS` steps on one device with `policy`; the weights after.
fn single(policy: MixedPrecision) -> HashMap<String, Tensor> {
    let varmap = copy_of(&init());
    let model = MixedPrecisionModel::new(&varmap, DType::F32, &Device::Cpu, policy, mlp).unwrap();
    let mut opt = sgd(&varmap);
    for t in 0..STEPS {
        let (x, y) = batch(t);
        let loss = loss_of(&model.forward(&x).unwrap(), &y).unwrap();
        opt.backward_step(&loss).unwrap();
    }
    snapshot(&varmap)
}

/// The same with plain f32.
fn single_f32() -> HashMap<String, Tensor> {
    let varmap = copy_of(&init());
    let model = mlp(VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu)).unwrap();
    let mut opt = sgd(&varmap);
    for t in 0..STEPS {
        let (x, y) = batch(t);
        let loss = loss_of(&model.forward(&x).unwrap(), &y).unwrap();
        opt.backward_step(&loss).unwrap();
    }
    snapshot(&varmap)
}

/// `STEPS` steps of DDP over `world` thread ranks (each its rows of the
/// global batch), optionally with ZeRO; rank 0's weights after.
fn ddp(world: usize, policy: MixedPrecision, zero: Option<ZeroStage>) -> HashMap<String, Tensor> {
    let init = init();
    let values = snapshot(&init);
    within(120, move || {
        let ranks = spawn(world, move |ctx| {
            let varmap = crate::common::varmap_from(&values);
            let config = DdpConfig {
                mixed_precision: Some(policy.clone()),
                zero,
                ..Default::default()
            };
            let mut ddp = DistributedDataParallel::new(
                ctx.process_group(),
                &varmap,
                DType::F32,
                &Device::Cpu,
                mlp,
                config,
            )?;
            let mut opt = sgd(&varmap);
            let mut sharded = match zero {
                Some(_) => Some(ZeroOptimizer::new(&ddp, |mine| {
                    Sgd::new_named(
                        mine,
                        SgdConfig {
                            lr: LR,
                            momentum: 0.9,
                            ..Default::default()
                        },
                    )
                })?),
                None => None,
            };
            let rows = BATCH / world;
            for t in 0..STEPS {
                let (x, y) = batch(t);
                let x = x.narrow(0, ctx.rank * rows, rows)?;
                let y = y.narrow(0, ctx.rank * rows, rows)?;
                let loss = loss_of(&ddp.forward(&x)?, &y)?;
                let grads = ddp.backward(&loss)?;
                match &mut sharded {
                    Some(z) => z.step(&grads)?,
                    None => opt.step(&grads)?,
                }
            }
            Ok(snapshot(&varmap))
        })
        .unwrap();
        ranks.into_iter().next().unwrap()
    })
}

/// `STEPS` steps of DataParallel over `replicas` CPU replicas.
fn data_parallel(replicas: usize, policy: MixedPrecision) -> HashMap<String, Tensor> {
    let varmap = copy_of(&init());
    let dp = DataParallel::builder(&varmap, DType::F32, &cpu_devices(replicas))
        .mixed_precision(policy)
        .build(mlp)
        .unwrap();
    let dtype = dp.compute_dtype().unwrap();
    let mut opt = sgd(&varmap);
    for t in 0..STEPS {
        let step = dp
            .forward_backward(batch(t), LossReduction::Mean, move |m, (x, y)| {
                loss_of(&m.forward(&x.to_dtype(dtype)?)?, &y)
            })
            .unwrap();
        opt.step(&step.grads).unwrap();
    }
    snapshot(&varmap)
}

/// The largest difference between `a` and `b` over the largest change any
/// weight made from the initial values in `b`'s run.
fn difference_over_change(a: &HashMap<String, Tensor>, b: &HashMap<String, Tensor>) -> f32 {
    let start = snapshot(&init());
    let (mut diff, mut change) = (0f32, 0f32);
    for (name, tb) in b {
        let ta = &a[name];
        let d = (ta - tb)
            .unwrap()
            .abs()
            .unwrap()
            .flatten_all()
            .unwrap()
            .max(0)
            .unwrap();
        let c = (tb - &start[name])
            .unwrap()
            .abs()
            .unwrap()
            .flatten_all()
            .unwrap()
            .max(0)
            .unwrap();
        diff = diff.max(d.to_scalar::<f32>().unwrap());
        change = change.max(c.to_scalar::<f32>().unwrap());
    }
    assert!(
        change > 1e-3,
        "the run did not train: largest change {change}"
    );
    diff / change
}

#[test]
fn a_mixed_precision_model_computes_in_bf16_and_trains_f32_masters_with_exact_gradients() {
    let varmap = copy_of(&init());
    let model = MixedPrecisionModel::new(
        &varmap,
        DType::F32,
        &Device::Cpu,
        MixedPrecision::bf16(),
        mlp,
    )
    .unwrap();
    let (x, y) = batch(0);
    let logits = model.forward(&x).unwrap();
    assert_eq!(logits.dtype(), DType::BF16);
    let grads = loss_of(&logits, &y).unwrap().backward().unwrap();

    // By hand: the same model on bf16 variables of the same values.
    let low = VarMap::new();
    for (name, t) in snapshot(&varmap) {
        low.data().lock().unwrap().insert(
            name,
            candle_core::Var::from_tensor(&t.to_dtype(DType::BF16).unwrap()).unwrap(),
        );
    }
    let by_hand = mlp(VarBuilder::from_varmap(&low, DType::BF16, &Device::Cpu)).unwrap();
    let hand_logits = by_hand.forward(&x.to_dtype(DType::BF16).unwrap()).unwrap();
    let hand_grads = loss_of(&hand_logits, &y).unwrap().backward().unwrap();
    let masters = varmap.data().lock().unwrap().clone();
    let lows = low.data().lock().unwrap().clone();
    for (name, master) in &masters {
        assert_eq!(master.dtype(), DType::F32, "{name}: the master stays f32");
        let g = grads.get(master.as_tensor()).expect("a master gradient");
        assert_eq!(g.dtype(), DType::F32, "{name}: its gradient is f32");
        let expected = hand_grads.get(lows[name].as_tensor()).unwrap();
        let widened = expected.to_dtype(DType::F32).unwrap();
        assert_eq!(
            crate::common::bits(g),
            crate::common::bits(&widened),
            "{name}: the bf16 gradient, widened"
        );
    }
}

#[test]
fn ddp_in_bf16_at_world_one_trains_to_the_bits_of_one_device_in_bf16() {
    let one = single(MixedPrecision::bf16());
    let ddp1 = ddp(1, MixedPrecision::bf16(), None);
    assert!(identical(&one, &ddp1));
    // And bf16 is not f32: the policy did change the computation.
    assert!(!identical(&one, &single_f32()));
}

#[test]
fn zero_in_bf16_trains_to_the_bits_of_ddp_in_bf16() {
    let plain = ddp(2, MixedPrecision::bf16(), None);
    for stage in [ZeroStage::One, ZeroStage::Two] {
        let zero = ddp(2, MixedPrecision::bf16(), Some(stage));
        assert!(identical(&plain, &zero), "{stage:?}");
    }
}

/// The same global batch split over 2 ranks or replicas computes each
/// half's gradient in bf16 and sums in f32: within a few bf16 roundings
/// (2^-8 relative) of the one-device run per step, so the weights agree to
/// 2% of how far they moved; f32 against bf16 differs by more than that
/// would say nothing, so that is checked too.
#[test]
fn bf16_on_ddp_and_data_parallel_matches_one_device_in_bf16() {
    let one = single(MixedPrecision::bf16());
    let ddp2 = ddp(2, MixedPrecision::bf16(), None);
    let dp2 = data_parallel(2, MixedPrecision::bf16());
    let ddp_gap = difference_over_change(&ddp2, &one);
    let dp_gap = difference_over_change(&dp2, &one);
    assert!(ddp_gap <= 0.02, "DDP vs one device: {ddp_gap}");
    assert!(dp_gap <= 0.02, "DataParallel vs one device: {dp_gap}");
    let f32_gap = difference_over_change(&single_f32(), &one);
    assert!(f32_gap > 0.0, "bf16 must differ from f32 at all");
}

#[test]
fn reducing_in_bf16_sends_bf16_buckets_and_still_trains_alike() {
    let f32_reduce = ddp(2, MixedPrecision::bf16(), None);
    let bf16_reduce = ddp(2, MixedPrecision::new(DType::BF16), None);
    let gap = difference_over_change(&bf16_reduce, &f32_reduce);
    assert!(gap <= 0.02, "{gap}");
}

#[test]
fn variables_kept_in_full_precision_are_the_masters_themselves() {
    // A model whose second layer stays in f32: its code converts.
    struct Mixed {
        low: candle_nn::Linear,
        full: candle_nn::Linear,
    }
    impl Module for Mixed {
        fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
            let h = self.low.forward(x)?.relu()?.to_dtype(DType::F32)?;
            self.full.forward(&h)
        }
    }
    let varmap = VarMap::new();
    let policy = MixedPrecision::bf16().keep_full_precision(|name| name.starts_with("full"));
    let model = MixedPrecisionModel::new(&varmap, DType::F32, &Device::Cpu, policy, |vb| {
        Ok(Mixed {
            low: linear(4, 6, vb.pp("low"))?,
            full: linear(6, 2, vb.pp("full"))?,
        })
    })
    .unwrap();
    let x = Tensor::ones((3, 4), DType::F32, &Device::Cpu).unwrap();
    let out = model.forward(&x).unwrap();
    assert_eq!(out.dtype(), DType::F32);
    let full = varmap.data().lock().unwrap()["full.weight"].clone();
    assert_eq!(model.module().full.weight().id(), full.as_tensor().id());
    let grads = out.sum_all().unwrap().backward().unwrap();
    assert!(grads.get(full.as_tensor()).is_some());
}

#[test]
fn a_policy_that_cannot_apply_is_refused_naming_why() {
    let varmap = VarMap::new();
    let e = MixedPrecisionModel::new(
        &varmap,
        DType::F32,
        &Device::Cpu,
        MixedPrecision::new(DType::U32),
        mlp,
    )
    .unwrap_err();
    assert!(matches!(e, Error::MixedPrecision(_)), "{e}");
    assert!(e.to_string().contains("param_dtype U32"), "{e}");
    let e = spawn(1, |ctx| {
        let varmap = init();
        let module = mlp(VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu))?;
        let config = DdpConfig {
            mixed_precision: Some(MixedPrecision::bf16()),
            ..Default::default()
        };
        Ok(
            DistributedDataParallel::from_module(ctx.process_group(), &varmap, module, config)
                .map(|_| ())
                .unwrap_err()
                .to_string(),
        )
    })
    .unwrap();
    assert!(e[0].contains("from_module"), "{}", e[0]);
}

/// What an f16 run with a scaler saw: per step, whether it stepped and the
/// scale after; the weights after.
type ScaledRun = (Vec<(bool, f32)>, HashMap<String, Tensor>);

const F16_STEPS: usize = 10;

/// f16 with a GradScaler and clipping (PyTorch's recipe: scale, backward,
/// unscale, clip, step, update) on one device.
fn f16_one_device(config: GradScalerConfig) -> ScaledRun {
    let varmap = copy_of(&init());
    let model = MixedPrecisionModel::new(
        &varmap,
        DType::F32,
        &Device::Cpu,
        MixedPrecision::f16(),
        mlp,
    )
    .unwrap();
    let params = crate::common::sorted_var_list(&varmap);
    let mut opt = sgd(&varmap);
    let mut scaler = GradScaler::new(config).unwrap();
    let mut seen = Vec::new();
    for t in 0..F16_STEPS {
        let (x, y) = batch(t);
        let loss = loss_of(&model.forward(&x).unwrap(), &y).unwrap();
        let mut grads = scaler.scale(&loss).unwrap().backward().unwrap();
        scaler.unscale(&mut grads, &params).unwrap();
        clip_grad_norm(&mut grads, &params, 1.0, 2.0, false).unwrap();
        let stepped = scaler.step(&mut grads, &params, |g| opt.step(g)).unwrap();
        scaler.update().unwrap();
        seen.push((stepped, scaler.scale_factor()));
    }
    (seen, snapshot(&varmap))
}

/// The same over 2 DDP thread ranks, each half of every batch.
fn f16_ddp(config: GradScalerConfig) -> Vec<ScaledRun> {
    let values = snapshot(&init());
    within(120, move || {
        spawn(2, move |ctx| {
            let varmap = crate::common::varmap_from(&values);
            let mut ddp = DistributedDataParallel::builder(
                ctx.process_group(),
                &varmap,
                DType::F32,
                &Device::Cpu,
            )
            .mixed_precision(MixedPrecision::f16())
            .build(mlp)?;
            let params: Vec<_> = ddp.params().iter().map(|(_, v)| v.clone()).collect();
            let mut opt = sgd(&varmap);
            let mut scaler = GradScaler::new(config)?;
            let mut seen = Vec::new();
            let rows = BATCH / 2;
            for t in 0..F16_STEPS {
                let (x, y) = batch(t);
                let x = x.narrow(0, ctx.rank * rows, rows)?;
                let y = y.narrow(0, ctx.rank * rows, rows)?;
                let loss = loss_of(&ddp.forward(&x)?, &y)?;
                let mut grads = ddp.backward(&scaler.scale(&loss)?)?;
                scaler.unscale(&mut grads, &params)?;
                clip_grad_norm(&mut grads, &params, 1.0, 2.0, false)?;
                let stepped = scaler.step(&mut grads, &params, |g| opt.step(g))?;
                scaler.update()?;
                seen.push((stepped, scaler.scale_factor()));
            }
            Ok((seen, snapshot(&varmap)))
        })
        .unwrap()
    })
}

/// A scale that overflows f16 in the backward now and then (2^16, growing
/// every 2 good steps): the ranks skip the same steps and keep the same
/// scale and weights. (One device's overflows differ: its backward sums
/// other rows in f16.)
#[test]
fn f16_ddp_ranks_with_a_grad_scaler_skip_the_same_overflowing_steps() {
    let config = GradScalerConfig {
        init_scale: 65536.0,
        growth_interval: 2,
        ..Default::default()
    };
    let ranks = f16_ddp(config);
    let (seen, weights) = &ranks[0];
    assert!(
        seen.iter().any(|(stepped, _)| !stepped),
        "none overflowed: {seen:?}"
    );
    assert!(
        seen.iter().any(|(stepped, _)| *stepped),
        "none stepped: {seen:?}"
    );
    assert_eq!(&ranks[1].0, seen, "rank 1's steps taken and scales");
    assert!(identical(&ranks[1].1, weights), "rank 1's weights");
}

/// A scale that never overflows (2^8): every step taken on both, and DDP
/// in f16 within 2% of the weights' change of one device in f16 (f16 has 3
/// more mantissa bits than bf16).
#[test]
fn f16_with_a_grad_scaler_and_clipping_trains_ddp_like_one_device() {
    let config = GradScalerConfig {
        init_scale: 256.0,
        ..Default::default()
    };
    let (one_seen, one) = f16_one_device(config);
    let ranks = f16_ddp(config);
    assert!(one_seen.iter().all(|(stepped, _)| *stepped), "{one_seen:?}");
    assert_eq!(ranks[0].0, one_seen);
    let gap = difference_over_change(&ranks[0].1, &one);
    assert!(gap <= 0.02, "DDP vs one device in f16: {gap}");
}

/// `STEPS` steps of a two-stage pipeline of the same MLP in `chunks`
/// micro-batches under `policy`.
fn pipeline(chunks: usize, policy: MixedPrecision) -> HashMap<String, Tensor> {
    use candle_dp::pipeline::{unit, Pipeline};
    let varmap = copy_of(&init());
    let (i, h, o) = SIZES;
    let layers = vec![
        unit(move |vb| linear(i, h, vb.pp("l1"))),
        unit(|_| Ok(candle_nn::Activation::Relu)),
        unit(move |vb| linear(h, o, vb.pp("l2"))),
    ];
    let pipe = Pipeline::builder(&varmap, DType::F32, &cpu_devices(2))
        .chunks(chunks)
        .mixed_precision(policy)
        .build(layers)
        .unwrap();
    let mut opt = sgd(&varmap);
    for t in 0..STEPS {
        let (x, y) = batch(t);
        let step = pipe
            .forward_backward(&x, &y, LossReduction::Mean, loss_of)
            .unwrap();
        opt.step(&step.grads).unwrap();
    }
    // The drop-in path cannot carry the copies' gradients: refused.
    let e = pipe.forward(&batch(0).0).unwrap_err();
    assert!(matches!(e, Error::MixedPrecision(_)), "{e}");
    snapshot(&varmap)
}

#[test]
fn a_bf16_pipeline_in_one_micro_batch_trains_to_the_bits_of_one_device_in_bf16() {
    assert!(identical(
        &pipeline(1, MixedPrecision::bf16()),
        &single(MixedPrecision::bf16())
    ));
}

#[test]
fn a_bf16_pipeline_in_micro_batches_matches_one_device_in_bf16() {
    let gap = difference_over_change(
        &pipeline(4, MixedPrecision::bf16()),
        &single(MixedPrecision::bf16()),
    );
    assert!(
        gap <= 0.02,
        "pipeline of 4 micro-batches vs one device: {gap}"
    );
}
