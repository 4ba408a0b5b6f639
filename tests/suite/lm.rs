//! The GPT-style language model of `examples/train_lm.rs`: its first steps
//! against real PyTorch 2.15 (`tests/data/lm_reference.json`, written by
//! `scripts/train_lm_torch.py` from the same initial weights and batches),
//! and one step on every strategy against one device's.

use std::collections::HashMap;

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Module, Tensor};
use candle_dp::launch::spawn;
use candle_dp::optim::AdamWConfig;
use candle_dp::pipeline::Pipeline;
use candle_dp::zero::ZeroStage;
use candle_dp::{cpu_devices, seeded_varmap, DataParallel, DistributedDataParallel, LossReduction};
use candle_nn::{VarBuilder, VarMap};

use crate::common::{max_rel_diff, snapshot, varmap_from, within};
use crate::example_gpt::{adamw_groups, lm_loss, lm_loss_composite, units, Gpt, GptConfig};
use crate::example_text::{load_text, split, windows_at, Windows};

#[derive(serde::Deserialize)]
struct Args {
    steps: u64,
    batch: usize,
    context: usize,
    heads: usize,
    lr: f64,
    weight_decay: f64,
    warmup_steps: u64,
    clip_grad_norm: f64,
    seed: u64,
    layers: usize,
    width: usize,
    /// Every parameter decayed (else the weight matrices only).
    #[serde(default)]
    decay_all: bool,
}

#[derive(serde::Deserialize)]
struct Reference {
    torch: String,
    args: Args,
    losses: Vec<f64>,
}

fn reference() -> Reference {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/data/lm_reference.json");
    let reference: Reference = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
    assert!(reference.torch.starts_with("2.15"), "{}", reference.torch);
    reference
}

fn config_of(args: &Args) -> GptConfig {
    GptConfig {
        vocab: 256,
        context: args.context,
        width: args.width,
        layers: args.layers,
        heads: args.heads,
        fused_ops: true,
        dropout: 0.0,
    }
}

/// f32 on one device, AdamW (weight matrices decayed, biases and norms
/// not: two parameter groups) with warm-up + cosine and clipping, as
/// `train_lm --strategy single` runs it (through a `Fabric`): within 1e-4
/// of PyTorch's loss at every step.
#[test]
fn the_language_model_reproduces_pytorchs_first_steps() {
    use candle_dp::fabric::{Fabric, FabricConfig, ModelRecipe, Strategy};
    use candle_dp::optim::LrScheduler;
    let reference = reference();
    let args = &reference.args;
    let config = config_of(args);
    let (train, _) = split(&load_text().unwrap(), args.context);
    let fabric_config = FabricConfig {
        gradient_clip: Some(args.clip_grad_norm),
        seed: args.seed,
        ..FabricConfig::new(Strategy::Single, 1)
    };
    let steps = reference.losses.len();
    let losses = Fabric::launch(fabric_config, |fabric| {
        let adamw = AdamWConfig {
            lr: args.lr,
            weight_decay: args.weight_decay,
            ..Default::default()
        };
        let mut model = fabric.setup(ModelRecipe::units(units(config)), |p| {
            adamw_groups(p, adamw, args.decay_all)
        })?;
        model.set_schedule(LrScheduler::warmup_cosine(
            args.lr,
            args.warmup_steps,
            args.steps,
        )?)?;
        let mut losses = Vec::new();
        for step in 0..steps {
            let indices = windows_at(&train, 1, 0, args.seed, args.batch, step as u64)?;
            let (x, y) = train.batch(&indices)?;
            let loss = model.backward(&x, &y, lm_loss)?;
            model.step()?;
            losses.push(f64::from(loss.to_scalar::<f32>()?));
        }
        Ok(losses)
    })
    .unwrap()
    .swap_remove(0);
    let mut worst = 0f64;
    for (step, (&got, &expected)) in losses.iter().zip(&reference.losses).enumerate() {
        let rel = ((got - expected) / expected).abs();
        assert!(
            rel <= 1e-4,
            "step {}: {got} against PyTorch's {expected}",
            step + 1
        );
        worst = worst.max(rel);
    }
    assert!(reference.losses.len() >= 30);
    println!("largest relative difference from PyTorch: {worst:e}");
}

const TINY: GptConfig = GptConfig {
    vocab: 256,
    context: 16,
    width: 32,
    layers: 2,
    heads: 2,
    fused_ops: true,
    dropout: 0.0,
};
const BATCH: usize = 4;

fn tiny_init() -> HashMap<String, Tensor> {
    snapshot(&seeded_varmap(2, DType::F32, &Device::Cpu, |vb| Gpt::new(TINY, vb)).unwrap())
}

fn data() -> Windows {
    split(&load_text().unwrap(), TINY.context).0
}

/// The gradients in `grads` of `varmap`'s variables, by name.
fn by_name(varmap: &VarMap, grads: &GradStore) -> HashMap<String, Tensor> {
    varmap
        .data()
        .lock()
        .unwrap()
        .iter()
        .filter_map(|(n, v)| {
            grads
                .get(v.as_tensor())
                .map(|g| (n.clone(), g.copy().unwrap()))
        })
        .collect()
}

/// The first step's gradients of the whole model on one device.
fn one_device() -> HashMap<String, Tensor> {
    one_device_with(TINY, lm_loss).1
}

/// The first step's loss and gradients of the model of `config` on one
/// device with `loss`.
fn one_device_with(
    config: GptConfig,
    loss: fn(&Tensor, &Tensor) -> candle_core::Result<Tensor>,
) -> (f32, HashMap<String, Tensor>) {
    let varmap = varmap_from(&tiny_init());
    let model = Gpt::new(
        config,
        VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu),
    )
    .unwrap();
    let (x, y) = data()
        .batch(&windows_at(&data(), 1, 0, 0, BATCH, 0).unwrap())
        .unwrap();
    let loss = loss(&model.forward(&x).unwrap(), &y).unwrap();
    let grads = loss.backward().unwrap();
    (loss.to_scalar().unwrap(), by_name(&varmap, &grads))
}

/// `--no-fused-ops` (candle's composite ops and loss) and the fused ops
/// are the same model: one step's loss and every gradient within 1e-5
/// (each tensor against its largest element).
#[test]
fn the_fused_ops_and_candles_composite_ops_compute_the_same_step() {
    let (fused_loss, fused) = one_device_with(TINY, lm_loss);
    let composite_config = GptConfig {
        fused_ops: false,
        ..TINY
    };
    let (composite_loss, composite) = one_device_with(composite_config, lm_loss_composite);
    assert_eq!(fused.len(), composite.len());
    let gap = max_rel_diff(&fused, &composite);
    println!("fused against composite: loss {fused_loss} / {composite_loss}, gradients {gap:.1e}");
    assert!(((fused_loss - composite_loss) / composite_loss).abs() <= 1e-6);
    assert!(gap <= 1e-5, "gradients differ by {gap:e}");
}

/// Every strategy computes the first step's gradients of the same global
/// batch (DDP's ranks their `DistributedSampler` shards of it) to within
/// 1e-5 of one device's, each tensor against its largest element: the
/// splits only change the order of the sums.
#[test]
fn one_step_of_the_language_model_on_every_strategy_equals_one_devices() {
    let expected = one_device();
    assert_eq!(
        expected.len(),
        4 + 12 * TINY.layers,
        "every variable has a gradient"
    );
    let (x, y) = data()
        .batch(&windows_at(&data(), 1, 0, 0, BATCH, 0).unwrap())
        .unwrap();

    let varmap = varmap_from(&tiny_init());
    let dp = DataParallel::new(&varmap, DType::F32, &cpu_devices(2), |vb| {
        Gpt::new(TINY, vb)
    })
    .unwrap();
    let step = dp
        .forward_backward((x.clone(), y.clone()), LossReduction::Mean, |m, (x, y)| {
            lm_loss(&m.forward(&x)?, &y)
        })
        .unwrap();
    let mut results = vec![("DataParallel x2", by_name(&varmap, &step.grads))];

    let varmap = varmap_from(&tiny_init());
    let pipe = Pipeline::builder(&varmap, DType::F32, &cpu_devices(2))
        .chunks(2)
        .build(units(TINY))
        .unwrap();
    let step = pipe
        .forward_backward(&x, &y, LossReduction::Mean, lm_loss)
        .unwrap();
    results.push((
        "pipeline x2, 2 micro-batches",
        by_name(&varmap, &step.grads),
    ));

    for zero in [None, Some(ZeroStage::Two)] {
        let init = tiny_init();
        let ranks = within(120, move || {
            spawn(2, move |ctx| {
                let varmap = varmap_from(&init);
                let mut builder = DistributedDataParallel::builder(
                    ctx.process_group(),
                    &varmap,
                    DType::F32,
                    &Device::Cpu,
                );
                if let Some(stage) = zero {
                    builder = builder.zero(stage);
                }
                let mut ddp = builder.build(|vb| Gpt::new(TINY, vb))?;
                let train = data();
                let (x, y) = train.batch(&windows_at(&train, 2, ctx.rank, 0, BATCH / 2, 0)?)?;
                let loss = lm_loss(&ddp.forward(&x)?, &y)?;
                let grads = ddp.backward(&loss)?;
                Ok(by_name(&varmap, &grads))
            })
            .unwrap()
        });
        let name = if zero.is_some() {
            "ZeRO-2 x2 (rank 0's pieces)"
        } else {
            "DDP x2"
        };
        results.push((name, ranks.into_iter().next().unwrap()));
    }

    for (name, grads) in results {
        // ZeRO-2's rank 0 keeps only its piece of each gradient: the first
        // ceil(rows / 2) rows (padded where there are fewer).
        let mut grads = grads;
        let mut expected = expected.clone();
        for (n, got) in grads.iter_mut() {
            let want = expected.get_mut(n).unwrap();
            if got.dims() != want.dims() {
                let rows = got.dim(0).unwrap().min(want.dim(0).unwrap());
                *got = got.narrow(0, 0, rows).unwrap();
                *want = want.narrow(0, 0, rows).unwrap();
            }
        }
        assert!(!expected.is_empty(), "{name}: no gradients");
        let gap = max_rel_diff(&grads, &expected);
        assert!(
            gap <= 1e-5,
            "{name}: gradients differ from one device's by {gap:e}"
        );
    }
}

/// docs/language-model.md's promise: a step's global batch is the same
/// windows whatever the number of ranks, at every step, the passes after
/// the first included (the sampler pads a pass for the ranks; that padding
/// must never be trained on, or two ranks repeat a window and fall a step
/// behind one device from the second pass on).
#[test]
fn every_number_of_ranks_trains_one_devices_global_batch_at_every_step_of_every_pass() {
    let train = split(&load_text().unwrap(), 128).0;
    // 2607 windows, 8 a step: 325 whole steps a pass, where two ranks'
    // padded shares (1304 each) would count 326.
    let (global, seed) = (8, 3);
    let per_pass = (train.len() / global) as u64;
    // A remainder to drop, and padding for every rank count but 1.
    assert!(!train.len().is_multiple_of(global) && !train.len().is_multiple_of(4));
    let mut steps = vec![0, 1];
    for pass in 1..4 {
        steps.extend([pass * per_pass - 1, pass * per_pass, pass * per_pass + 1]);
    }
    for step in steps {
        let mut one = windows_at(&train, 1, 0, seed, global, step).unwrap();
        one.sort_unstable();
        for world in [2, 4] {
            let mut all: Vec<usize> = (0..world)
                .flat_map(|rank| {
                    windows_at(&train, world, rank, seed, global / world, step).unwrap()
                })
                .collect();
            all.sort_unstable();
            assert_eq!(
                all, one,
                "step {step} on {world} ranks (a pass is {per_pass} steps)"
            );
        }
        let mut unique = one.clone();
        unique.dedup();
        assert_eq!(
            unique.len(),
            global,
            "step {step}: a window twice in one batch"
        );
    }
}
