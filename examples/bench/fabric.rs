//! The Fabric part of the benchmark (`--fabric`): the same training through
//! a `Fabric` and through the engines called directly (DDP, ZeRO-2 and
//! FSDP on thread ranks, and one device), side by side: the step time of
//! each and whether both end at the same bytes. The wrapper should cost
//! nothing measurable.
//!
//! Each configuration runs in its own child process (this binary with
//! `--fabric-child`), configurations interleaved over the rounds.

use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use candle_dp::comm::GroupOptions;
use candle_dp::fabric::{Accelerator, Devices, Fabric, FabricConfig, ModelRecipe, Strategy};
use candle_dp::fsdp::{FsdpConfig, FullyShardedDataParallel};
use candle_dp::optim::{AdamW, AdamWConfig};
use candle_dp::pipeline::{unit, UnitFactory};
use candle_dp::units::Units;
use candle_dp::zero::{ZeroOptimizer, ZeroStage};
use candle_dp::{launch, seeded_varmap, DistributedDataParallel};
use candle_nn::{linear, loss, Activation, Optimizer, VarBuilder, VarMap};
use serde::{Deserialize, Serialize};

use crate::inputs::global_batch;
use crate::stats::median;

const SEED: u64 = 7;

/// One configuration, sent to its child process as JSON.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct FabricSpec {
    /// `single`, `ddp`, `zero2` or `fsdp`.
    pub strategy: String,
    pub world: usize,
    /// Through a Fabric, or the engine called directly.
    pub wrapped: bool,
    pub hidden: usize,
    pub batch: usize,
    pub warmup: usize,
    pub steps: usize,
    /// Every rank on GPU 0 (through a Fabric only; the device checks
    /// count the host transfers of a step this way).
    #[serde(default)]
    pub cuda: bool,
}

impl FabricSpec {
    fn label(&self) -> String {
        let how = if self.wrapped { "Fabric" } else { "direct" };
        format!("{} x{} ({how})", self.strategy, self.world)
    }
}

/// What a child measured: rank 0's step times and its final weights' hash.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct FabricMeasured {
    pub step_ms: Vec<f64>,
    pub weights_hash: u64,
}

/// The MLP of the other measurements, 784-h, 4 x h-h, h-10, as units.
fn units(hidden: usize) -> Vec<UnitFactory> {
    let mut units = vec![unit(move |vb| linear(784, hidden, vb.pp("l0")))];
    for i in 1..=4 {
        units.push(unit(|_| Ok(Activation::Relu)));
        units.push(unit(move |vb| {
            linear(hidden, hidden, vb.pp(format!("l{i}")))
        }));
    }
    units.push(unit(|_| Ok(Activation::Relu)));
    units.push(unit(move |vb| linear(hidden, 10, vb.pp("l5"))));
    units
}

fn adamw() -> AdamWConfig {
    AdamWConfig {
        lr: 1e-3,
        ..Default::default()
    }
}

/// Runs one configuration in this process.
pub fn run_child(spec: &FabricSpec) -> Result<FabricMeasured> {
    let (x, y) = global_batch(spec.batch)?;
    let strategy: Strategy = spec.strategy.parse()?;
    let answers = if spec.wrapped {
        let mut config = FabricConfig {
            seed: SEED,
            timeout_secs: Some(300.0),
            ..FabricConfig::new(strategy, spec.world)
        };
        if spec.cuda {
            config.accelerator = Accelerator::Cuda;
            config.devices = Devices::Ids(vec![0; spec.world]);
        }
        Fabric::launch(config, |fabric| {
            let module = ModelRecipe::units(units(spec.hidden));
            let mut model = fabric.setup(module, |p| AdamW::new_named(p, adamw()))?;
            let (rows, labels) = share(&x, &y, fabric.rank(), fabric.world_size())?;
            let (rows, labels) = (fabric.to_device(&rows)?, fabric.to_device(&labels)?);
            let mut m = FabricMeasured::default();
            for step in 0..spec.warmup + spec.steps {
                let start = Instant::now();
                model.backward(&rows, &labels, loss::cross_entropy)?;
                model.step()?;
                if step >= spec.warmup {
                    m.step_ms.push(start.elapsed().as_secs_f64() * 1e3);
                }
            }
            m.weights_hash = hash(model.full_state()?)?;
            Ok(m)
        })?
    } else {
        anyhow::ensure!(!spec.cuda, "the direct engines run on the CPU only here");
        let options = GroupOptions {
            timeout: Some(Duration::from_secs(300)),
            ..Default::default()
        };
        launch::spawn_with(spec.world, options, |ctx| {
            let (rows, labels) = share(&x, &y, ctx.rank, ctx.world_size)?;
            let parts = units(spec.hidden);
            let whole = |vb: VarBuilder| Units::build(vb, &parts).map_err(candle_core::Error::wrap);
            let varmap = seeded_varmap(SEED, DType::F32, &Device::Cpu, whole)?;
            let mut m = FabricMeasured::default();
            let mut time = |step: usize, start: Instant| {
                if step >= spec.warmup {
                    m.step_ms.push(start.elapsed().as_secs_f64() * 1e3);
                }
            };
            let total = spec.warmup + spec.steps;
            match strategy {
                Strategy::Fsdp => {
                    let mut fsdp = FullyShardedDataParallel::from_units(
                        ctx.process_group(),
                        &varmap,
                        DType::F32,
                        &Device::Cpu,
                        parts.clone(),
                        FsdpConfig::default(),
                    )?;
                    let mut opt = AdamW::new_named(fsdp.shards().to_vec(), adamw())?;
                    for step in 0..total {
                        let start = Instant::now();
                        let done = fsdp.forward_backward(&rows, &labels, loss::cross_entropy)?;
                        opt.step(&done.grads)?;
                        time(step, start);
                    }
                    m.weights_hash = hash(fsdp.full_state()?)?;
                }
                _ => {
                    // One device is DDP on one rank: the same calls.
                    let mut builder = DistributedDataParallel::builder(
                        ctx.process_group(),
                        &varmap,
                        DType::F32,
                        &Device::Cpu,
                    );
                    if strategy == Strategy::Zero2 {
                        builder = builder.zero(ZeroStage::Two);
                    }
                    let mut ddp = builder.build(whole)?;
                    let mut zero = match strategy {
                        Strategy::Zero2 => {
                            Some(ZeroOptimizer::new(&ddp, |p| AdamW::new_named(p, adamw()))?)
                        }
                        _ => None,
                    };
                    let mut opt = AdamW::from_varmap(&varmap, adamw())?;
                    for step in 0..total {
                        let start = Instant::now();
                        let loss = loss::cross_entropy(&ddp.forward_t(&rows, true)?, &labels)?;
                        let grads = ddp.backward(&loss)?;
                        match &mut zero {
                            Some(zero) => zero.step(&grads)?,
                            None => opt.step(&grads)?,
                        }
                        time(step, start);
                    }
                    m.weights_hash = hash_varmap(&varmap)?;
                }
            }
            Ok(m)
        })?
    };
    Ok(answers.into_iter().next().unwrap_or_default())
}

/// Rank `rank`'s rows of the global batch.
fn share(x: &Tensor, y: &Tensor, rank: usize, world: usize) -> Result<(Tensor, Tensor)> {
    let per_rank = x.dim(0)? / world;
    Ok((
        x.narrow(0, rank * per_rank, per_rank)?,
        y.narrow(0, rank * per_rank, per_rank)?,
    ))
}

fn hash_varmap(varmap: &VarMap) -> Result<u64> {
    let data = varmap.data().lock().map_err(|_| anyhow::anyhow!("lock"))?;
    hash(
        data.iter()
            .map(|(n, v)| (n.clone(), v.as_tensor().clone()))
            .collect(),
    )
}

/// FNV-1a over every weight's bits, in name order.
fn hash(weights: std::collections::HashMap<String, Tensor>) -> Result<u64> {
    let mut named: Vec<_> = weights.into_iter().collect();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    let mut hash = 0xcbf2_9ce4_8422_2325u64;
    for (_, t) in named {
        for v in t.flatten_all()?.to_vec1::<f32>()? {
            for byte in v.to_bits().to_le_bytes() {
                hash = (hash ^ byte as u64).wrapping_mul(0x100_0000_01b3);
            }
        }
    }
    Ok(hash)
}

fn specs(quick: bool, steps: usize) -> Vec<FabricSpec> {
    let configs: &[(&str, usize)] = if quick {
        &[("ddp", 2)]
    } else {
        &[("single", 1), ("ddp", 2), ("zero2", 2), ("fsdp", 2)]
    };
    configs
        .iter()
        .flat_map(|&(strategy, world)| {
            [false, true].map(|wrapped| FabricSpec {
                strategy: strategy.into(),
                world,
                wrapped,
                hidden: 512,
                batch: 256,
                warmup: 2,
                steps,
                cuda: false,
            })
        })
        .collect()
}

/// Every configuration, interleaved over `rounds`; the report.
pub fn run(quick: bool, steps: usize, rounds: usize) -> Result<String> {
    let specs = specs(quick, steps);
    let mut measured = vec![FabricMeasured::default(); specs.len()];
    for _ in 0..rounds {
        for (spec, m) in specs.iter().zip(&mut measured) {
            let mut cmd = Command::new(std::env::current_exe()?);
            cmd.arg("--fabric-child").arg(serde_json::to_string(spec)?);
            let got: FabricMeasured = crate::child_answer(cmd, &spec.label())?;
            m.step_ms.extend(got.step_ms);
            m.weights_hash = got.weights_hash;
        }
    }
    let mut s = String::from(
        "## The Fabric wrapper against the engines called directly (AdamW, MLP 784-512, \
         4 x 512-512, 512-10 as units; global batch 256)\n\n\
         The same model, initial weights and batches, trained once through `Fabric` \
         (`setup`, `backward`, `step`) and once with the engine's own calls; each in its \
         own process, interleaved over the rounds. `Fabric / direct` is the ratio of the \
         median step times.\n\n\
         | strategy | direct ms/step | Fabric ms/step | Fabric / direct | same bytes |\n\
         |---|---:|---:|---:|---|\n",
    );
    for pair in specs.chunks(2).zip(measured.chunks(2)) {
        let ((direct_spec, _), (direct, wrapped)) =
            ((&pair.0[0], &pair.0[1]), (&pair.1[0], &pair.1[1]));
        let (d, w) = (median(&direct.step_ms), median(&wrapped.step_ms));
        s += &format!(
            "| {} x{} | {d:.2} | {w:.2} | {:.3} | {} |\n",
            direct_spec.strategy,
            direct_spec.world,
            w / d,
            if direct.weights_hash == wrapped.weights_hash {
                "yes"
            } else {
                "NO"
            }
        );
    }
    Ok(s)
}
