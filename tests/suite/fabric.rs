//! The front door: one training loop, unchanged, under every strategy
//! string, against one device's training of the same global batches.

use std::collections::HashMap;
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use candle_dp::fabric::{
    DataOptions, Fabric, FabricConfig, FabricModule, Precision, StepOutcome, Strategy,
};
use candle_dp::loader::TensorDataset;
use candle_dp::optim::{Sgd, SgdConfig};
use candle_dp::pipeline::layer;
use candle_nn::{linear, loss, Activation};

use crate::common::{diff_report, identical, max_rel_diff};

const SAMPLES: usize = 48;
const GLOBAL_BATCH: usize = 12;
const EPOCHS: u64 = 2;

/// A small classifier as units (every strategy can build it).
fn classifier() -> FabricModule {
    FabricModule::units(vec![
        layer(|vb| linear(6, 16, vb.pp("l1"))),
        layer(|_| Ok(Activation::Relu)),
        layer(|vb| linear(16, 16, vb.pp("l2"))),
        layer(|_| Ok(Activation::Relu)),
        layer(|vb| linear(16, 3, vb.pp("l3"))),
    ])
}

/// 48 samples of 6 features and 3 classes, the same in every run.
fn dataset() -> Arc<TensorDataset> {
    let xs: Vec<f32> = (0..SAMPLES * 6)
        .map(|i| ((i * 37 % 101) as f32 / 50.0 - 1.0) * 1.5)
        .collect();
    let ys: Vec<u32> = (0..SAMPLES as u32).map(|i| (i * 7 + i / 5) % 3).collect();
    let x = Tensor::from_vec(xs, (SAMPLES, 6), &Device::Cpu).unwrap();
    let y = Tensor::from_vec(ys, SAMPLES, &Device::Cpu).unwrap();
    Arc::new(TensorDataset::new(vec![x, y]).unwrap())
}

/// What one run gives back: the whole model's final weights and the
/// global loss of every step.
type Trained = (HashMap<String, Tensor>, Vec<f32>);

/// THE loop: the same code whatever the strategy.
fn train(fabric: Fabric, data: Arc<TensorDataset>) -> anyhow::Result<Trained> {
    // SGD with momentum: unlike Adam's, its update scales with the
    // gradient, so a gradient averaged wrong cannot go unseen.
    let mut model = fabric.setup(classifier(), |params| {
        Sgd::new_named(
            params,
            SgdConfig {
                lr: 0.05,
                momentum: 0.9,
                ..Default::default()
            },
        )
    })?;
    let options = DataOptions {
        shuffle: true,
        ..DataOptions::default()
    };
    // The global batch of a step is GLOBAL_BATCH samples, whatever the
    // ranks and the accumulation.
    let per_batch =
        GLOBAL_BATCH / fabric.world_size() / fabric.config().accumulation_steps as usize;
    let mut loader = fabric.setup_dataloader(data, per_batch, options)?;
    let (mut losses, mut steps) = (Vec::new(), 0);
    for epoch in 0..EPOCHS {
        loader.set_epoch(epoch);
        for batch in loader.iter()? {
            let batch = batch?;
            let loss = model.backward(&batch[0], &batch[1], loss::cross_entropy)?;
            if model.step()? != StepOutcome::Accumulating {
                steps += 1;
            }
            losses.push(fabric.all_reduce_mean(&loss)?);
        }
    }
    anyhow::ensure!(model.skipped_steps() == 0, "the loss scaler skipped a step");
    anyhow::ensure!(
        steps == model.steps(),
        "{steps} steps counted, {} taken",
        model.steps()
    );
    Ok((model.full_state()?, losses))
}

/// `strategy` on as many CPU devices as it needs for two ranks, replicas
/// or stages (`pipeline-ddp`: two ranks of two stages).
fn config(strategy: Strategy, precision: Precision) -> FabricConfig {
    let devices = match strategy {
        Strategy::Single => 1,
        Strategy::PipelineDdp => 4,
        _ => 2,
    };
    FabricConfig {
        chunks: Some(2),
        // A first scale no step of this model overflows at, in any
        // strategy: a rank's half batch can overflow at PyTorch's 65536
        // where the whole batch does not, and a skipped step is no
        // difference of precision.
        init_scale: 1024.0,
        ..FabricConfig::new(strategy, devices).precision(precision)
    }
}

fn run(strategy: Strategy, precision: Precision) -> Trained {
    run_with(strategy, precision, |_| {})
}

/// [`run`] with `tweak` applied to the configuration.
fn run_with(
    strategy: Strategy,
    precision: Precision,
    tweak: impl Fn(&mut FabricConfig),
) -> Trained {
    let data = dataset();
    let mut config = config(strategy, precision);
    tweak(&mut config);
    let mut ranks = Fabric::launch(config, |fabric| train(fabric, data.clone()))
        .unwrap_or_else(|e| panic!("{strategy} {precision}: {e}"));
    let first = ranks.remove(0);
    for (rank, other) in ranks.iter().enumerate() {
        assert!(
            identical(&first.0, &other.0),
            "{strategy} {precision}: rank {} holds other weights than rank 0",
            rank + 1
        );
    }
    first
}

/// Every strategy against one device, in `precision`, printing the
/// differences measured; `tolerance` bounds the weights' relative
/// difference and the losses' absolute one.
fn every_strategy_matches_one_device(precision: Precision, tolerance: f32) {
    let single = run(Strategy::Single, precision);
    let ddp = run(Strategy::Ddp, precision);
    for strategy in Strategy::ALL.into_iter().skip(1) {
        let trained = if strategy == Strategy::Ddp {
            ddp.clone()
        } else {
            run(strategy, precision)
        };
        let weights = max_rel_diff(&trained.0, &single.0);
        let losses = trained
            .1
            .iter()
            .zip(&single.1)
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        println!("{precision} {strategy}: weights {weights:.2e}, losses {losses:.2e}");
        assert_eq!(trained.1.len(), single.1.len(), "{strategy}: steps");
        assert!(
            weights <= tolerance && losses <= tolerance,
            "{precision} {strategy}: weights {weights:.2e}, losses {losses:.2e} from one \
             device's (tolerance {tolerance:.0e})\n{}",
            diff_report(&trained.0, &single.0)
        );
        // ZeRO, FSDP and the overlap promise DDP's bytes (on 2 ranks).
        if matches!(
            strategy,
            Strategy::Zero1 | Strategy::Zero2 | Strategy::Fsdp | Strategy::DdpOverlap
        ) {
            assert!(
                identical(&trained.0, &ddp.0),
                "{precision} {strategy}: not DDP's bytes\n{}",
                diff_report(&trained.0, &ddp.0)
            );
        }
    }
}

#[test]
fn one_loop_trains_every_strategy_to_one_devices_weights_in_f32() {
    every_strategy_matches_one_device(Precision::F32, 1e-6);
}

#[test]
fn one_loop_trains_every_strategy_to_one_devices_weights_in_bf16() {
    every_strategy_matches_one_device(Precision::Bf16Mixed, 1e-2);
}

#[test]
fn one_loop_trains_every_strategy_to_one_devices_weights_in_f16() {
    every_strategy_matches_one_device(Precision::F16Mixed, 1e-3);
}

/// `single` is plain candle: the loop written by hand, without Fabric,
/// from the same seeded weights over the same batches, gives its bytes.
#[test]
fn single_strategy_is_a_plain_candle_loop_bit_for_bit() {
    use candle_core::ModuleT;
    use candle_dp::sampler::randperm;
    use candle_dp::units::Units;
    use candle_nn::{Optimizer, VarBuilder};

    let (fabric_weights, fabric_losses) = run(Strategy::Single, Precision::F32);

    let parts = classifier();
    let build = |vb: VarBuilder| Units::build(vb, parts.parts()).map_err(candle_core::Error::wrap);
    let varmap = candle_dp::seeded_varmap(0, DType::F32, &Device::Cpu, build).unwrap();
    let model = build(VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu)).unwrap();
    let mut named: Vec<_> = varmap
        .data()
        .lock()
        .unwrap()
        .iter()
        .map(|(n, v)| (n.clone(), v.clone()))
        .collect();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    let config = SgdConfig {
        lr: 0.05,
        momentum: 0.9,
        ..Default::default()
    };
    let mut sgd = Sgd::new_named(named, config).unwrap();
    let data = dataset();
    let (x, y) = (&data.tensors()[0], &data.tensors()[1]);
    let mut losses = Vec::new();
    for epoch in 0..EPOCHS {
        let order = randperm(SAMPLES, epoch);
        for batch in order.chunks(GLOBAL_BATCH) {
            let index = Tensor::from_vec(
                batch.iter().map(|&i| i as u32).collect::<Vec<_>>(),
                batch.len(),
                &Device::Cpu,
            )
            .unwrap();
            let out = model
                .forward_t(&x.index_select(&index, 0).unwrap(), true)
                .unwrap();
            let loss = loss::cross_entropy(&out, &y.index_select(&index, 0).unwrap()).unwrap();
            sgd.step(&loss.backward().unwrap()).unwrap();
            losses.push(loss.to_scalar::<f32>().unwrap());
        }
    }
    let weights: HashMap<String, Tensor> = varmap
        .data()
        .lock()
        .unwrap()
        .iter()
        .map(|(n, v)| (n.clone(), v.as_tensor().copy().unwrap()))
        .collect();
    assert!(
        identical(&fabric_weights, &weights),
        "{}",
        diff_report(&fabric_weights, &weights)
    );
    assert_eq!(fabric_losses, losses);
}

/// Accumulation over two batches of half the size, and clipping (over
/// every rank's pieces where the strategy shards), give one device's
/// unaccumulated, clipped training of the same global batches.
#[test]
fn accumulation_and_clipping_match_one_device_under_every_strategy() {
    let clipped = |accumulation_steps| {
        move |config: &mut FabricConfig| {
            config.gradient_clip = Some(0.5);
            config.accumulation_steps = accumulation_steps;
        }
    };
    let single = run_with(Strategy::Single, Precision::F32, clipped(1));
    let unclipped = run(Strategy::Single, Precision::F32);
    assert!(
        max_rel_diff(&single.0, &unclipped.0) > 1e-3,
        "the clipping never bit: the test would not see it missing"
    );
    for strategy in Strategy::ALL {
        let trained = run_with(strategy, Precision::F32, clipped(2));
        // One loss per batch: two per step.
        assert_eq!(trained.1.len(), 2 * single.1.len(), "{strategy}");
        let weights = max_rel_diff(&trained.0, &single.0);
        println!("accumulated and clipped {strategy}: weights {weights:.2e}");
        assert!(
            weights <= 1e-6,
            "{strategy}: {weights:.2e} from one device's\n{}",
            diff_report(&trained.0, &single.0)
        );
    }
}
