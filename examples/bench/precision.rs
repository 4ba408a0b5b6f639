//! The mixed-precision part of the benchmark (`--precision`): the same
//! training in f32, bf16 and f16 (f16 with a GradScaler), on one device
//! and on DDP's thread ranks: the step time, the memory a step allocates
//! above the resting state (activations, gradients and the temporaries of
//! the forward and backward, counted by the allocator on one step outside
//! the timing), and how far the weights end from the f32 run's.
//!
//! Each configuration runs in its own child process (this binary with
//! `--precision-child`); configurations are interleaved over the rounds.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{bail, Result};
use candle_core::{DType, Device, Module, Tensor};
use candle_dp::comm::GroupOptions;
use candle_dp::launch;
use candle_dp::optim::{AdamW, AdamWConfig, GradScaler, GradScalerConfig};
use candle_dp::precision::{MixedPrecision, MixedPrecisionModel};
use candle_dp::{seeded_varmap, DistributedDataParallel};
use candle_nn::{linear, loss, Linear, Optimizer, VarBuilder, VarMap};
use serde::{Deserialize, Serialize};

use crate::alloc_count;
use crate::stats::{median, ms};

const INPUT: usize = 784;
const HIDDEN: usize = 1024;
const LAYERS: usize = 4;
const CLASSES: usize = 10;

/// One configuration, sent to its child process as JSON.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PrecisionSpec {
    /// `f32`, `bf16` or `f16`.
    pub precision: String,
    /// 1: one device; more: DDP thread ranks.
    pub world: usize,
    pub batch: usize,
    pub warmup: usize,
    pub steps: usize,
    /// Where the child writes its final weights (one-device rows).
    pub weights: Option<PathBuf>,
}

impl PrecisionSpec {
    fn label(&self) -> String {
        match self.world {
            1 => format!("{} one device", self.precision),
            w => format!("{} DDP x{w} (thread ranks)", self.precision),
        }
    }

    fn policy(&self) -> Result<MixedPrecision> {
        Ok(match self.precision.as_str() {
            "f32" => MixedPrecision::new(DType::F32),
            "bf16" => MixedPrecision::bf16(),
            "f16" => MixedPrecision::f16(),
            other => bail!("unknown precision {other}"),
        })
    }
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct PrecisionMeasured {
    pub step_ms: Vec<f64>,
    /// Bytes allocated above the resting state at the peak of one step's
    /// forward and backward (0 where not measured).
    pub step_peak_bytes: usize,
    pub final_loss: f32,
    pub skipped: usize,
}

/// A deep MLP: 784 -> 1024, `LAYERS` x (1024 -> 1024), 1024 -> 10, ReLU.
struct Deep {
    layers: Vec<Linear>,
}

fn deep(vb: VarBuilder) -> candle_core::Result<Deep> {
    let mut layers = vec![linear(INPUT, HIDDEN, vb.pp("in"))?];
    for i in 0..LAYERS {
        layers.push(linear(HIDDEN, HIDDEN, vb.pp(format!("h{i}")))?);
    }
    layers.push(linear(HIDDEN, CLASSES, vb.pp("out"))?);
    Ok(Deep { layers })
}

impl Module for Deep {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let last = self.layers.len() - 1;
        let mut h = x.clone();
        for (i, l) in self.layers.iter().enumerate() {
            h = l.forward(&h)?;
            if i < last {
                h = h.relu()?;
            }
        }
        Ok(h)
    }
}

/// The global batch of step `t` (the same in every process).
fn batch(t: usize, rows: usize) -> Result<(Tensor, Tensor)> {
    let x: Vec<f32> = (0..rows * INPUT)
        .map(|i| (((i * 7919 + t * 104_729) % 1000) as f32 / 1000.0) - 0.5)
        .collect();
    // A learnable label: which of the first CLASSES inputs is largest.
    let y: Vec<u32> = x
        .chunks(INPUT)
        .map(|row| {
            let first = &row[..CLASSES];
            (0..CLASSES).fold(0, |best, i| if first[i] > first[best] { i } else { best }) as u32
        })
        .collect();
    Ok((
        Tensor::from_vec(x, (rows, INPUT), &Device::Cpu)?,
        Tensor::new(y, &Device::Cpu)?,
    ))
}

fn adamw(varmap: &VarMap) -> Result<AdamW> {
    Ok(AdamW::from_varmap(
        varmap,
        AdamWConfig {
            lr: 1e-3,
            ..Default::default()
        },
    )?)
}

fn loss_of(logits: &Tensor, y: &Tensor) -> candle_core::Result<Tensor> {
    loss::cross_entropy(&logits.to_dtype(DType::F32)?, y)
}

fn scaler(spec: &PrecisionSpec) -> Result<GradScaler> {
    Ok(GradScaler::new(GradScalerConfig {
        enabled: spec.precision == "f16",
        ..Default::default()
    })?)
}

pub fn run_child(spec: &PrecisionSpec) -> Result<PrecisionMeasured> {
    if spec.world == 1 {
        one_device(spec)
    } else {
        ddp(spec)
    }
}

fn one_device(spec: &PrecisionSpec) -> Result<PrecisionMeasured> {
    let varmap = seeded_varmap(0, DType::F32, &Device::Cpu, deep)?;
    let model = MixedPrecisionModel::new(&varmap, DType::F32, &Device::Cpu, spec.policy()?, deep)?;
    let params = varmap.all_vars();
    let mut opt = adamw(&varmap)?;
    let mut scaler = scaler(spec)?;
    let mut m = PrecisionMeasured::default();
    for t in 0..spec.warmup + spec.steps {
        let (x, y) = batch(t, spec.batch)?;
        // The last warm-up step (untimed) has its allocations counted.
        let counting = t + 1 == spec.warmup;
        if counting {
            alloc_count::start();
        }
        let start = Instant::now();
        let loss = loss_of(&model.forward(&x)?, &y)?;
        let mut grads = scaler.scale(&loss)?.backward()?;
        if counting {
            m.step_peak_bytes = alloc_count::stop_peak();
        }
        if !scaler.step(&mut grads, &params, |g| opt.step(g))? {
            m.skipped += 1;
        }
        scaler.update()?;
        if t >= spec.warmup {
            m.step_ms.push(ms(start.elapsed()));
        }
        m.final_loss = loss.to_scalar::<f32>()?;
    }
    if let Some(path) = &spec.weights {
        varmap.save(path)?;
    }
    Ok(m)
}

fn ddp(spec: &PrecisionSpec) -> Result<PrecisionMeasured> {
    let policy = spec.policy()?;
    let spec2 = spec.clone();
    let ranks = launch::run(spec.world, GroupOptions::default(), move |ctx| {
        let spec = &spec2;
        let varmap = seeded_varmap(0, DType::F32, &Device::Cpu, deep)?;
        let mut ddp = DistributedDataParallel::builder(
            ctx.process_group(),
            &varmap,
            DType::F32,
            &Device::Cpu,
        )
        .mixed_precision(policy.clone())
        .build(deep)?;
        let params: Vec<_> = ddp.params().iter().map(|(_, v)| v.clone()).collect();
        let mut opt = adamw(&varmap)?;
        let mut scaler = scaler(spec)?;
        let rows = spec.batch / spec.world;
        let mut m = PrecisionMeasured::default();
        for t in 0..spec.warmup + spec.steps {
            let (x, y) = batch(t, spec.batch)?;
            let (x, y) = (
                x.narrow(0, ctx.rank * rows, rows)?,
                y.narrow(0, ctx.rank * rows, rows)?,
            );
            let start = Instant::now();
            let loss = loss_of(&ddp.forward(&x)?, &y)?;
            let mut grads = ddp.backward(&scaler.scale(&loss)?)?;
            if !scaler.step(&mut grads, &params, |g| opt.step(g))? {
                m.skipped += 1;
            }
            scaler.update()?;
            if t >= spec.warmup {
                m.step_ms.push(ms(start.elapsed()));
            }
            m.final_loss = loss.to_scalar::<f32>()?;
        }
        Ok(m)
    })?;
    ranks
        .into_iter()
        .next()
        .ok_or_else(|| anyhow::anyhow!("no rank answered"))
}

fn specs(quick: bool, steps: usize, out: &Path) -> Vec<PrecisionSpec> {
    let batch = if quick { 64 } else { 256 };
    let mut specs = Vec::new();
    for world in [1, 2] {
        for precision in ["f32", "bf16", "f16"] {
            specs.push(PrecisionSpec {
                precision: precision.into(),
                world,
                batch,
                warmup: 2,
                steps,
                weights: (world == 1)
                    .then(|| out.join(format!("precision-{precision}.safetensors"))),
            });
        }
    }
    specs
}

fn run_in_child(spec: &PrecisionSpec) -> Result<PrecisionMeasured> {
    let mut cmd = Command::new(std::env::current_exe()?);
    cmd.arg("--precision-child")
        .arg(serde_json::to_string(spec)?);
    crate::child_answer(cmd, &spec.label())
}

/// How far `a`'s weights are from `b`'s, against how far `b`'s moved
/// from `init`: the 2-norms over all weights of `a - b` and `b - init`, and
/// the largest single difference.
fn weight_gap(
    a: &HashMap<String, Tensor>,
    b: &HashMap<String, Tensor>,
    init: &VarMap,
) -> Result<(f64, f64, f32)> {
    let init = init
        .data()
        .lock()
        .map_err(|_| anyhow::anyhow!("lock"))?
        .clone();
    let (mut gap, mut change, mut largest) = (0f64, 0f64, 0f32);
    for (name, tb) in b {
        let (Some(ta), Some(t0)) = (a.get(name), init.get(name)) else {
            bail!("{name} is missing from a run's weights");
        };
        let squares = |t: &Tensor| -> Result<f64> {
            Ok(t.to_dtype(DType::F64)?
                .sqr()?
                .sum_all()?
                .to_scalar::<f64>()?)
        };
        let d = (ta - tb)?;
        gap += squares(&d)?;
        change += squares(&(tb - t0.as_tensor())?)?;
        largest = largest.max(d.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?);
    }
    Ok((gap.sqrt(), change.sqrt(), largest))
}

pub fn run(quick: bool, steps: usize, rounds: usize, out: &Path) -> Result<String> {
    let specs = specs(quick, steps, out);
    let mut measured = vec![PrecisionMeasured::default(); specs.len()];
    for _ in 0..rounds {
        for (spec, m) in specs.iter().zip(&mut measured) {
            let got = run_in_child(spec)?;
            m.step_ms.extend(got.step_ms);
            m.step_peak_bytes = got.step_peak_bytes;
            m.final_loss = got.final_loss;
            m.skipped = got.skipped;
        }
    }
    let batch = specs.first().map_or(0, |s| s.batch);
    let mut s = format!(
        "## Mixed precision (AdamW lr 1e-3, MLP {INPUT}-{HIDDEN}, {LAYERS} x {HIDDEN}-{HIDDEN}, \
         {HIDDEN}-{CLASSES}: {:.1}M parameters; global batch {batch}; {} timed steps x {rounds} rounds)\n\n\
         f32 masters and AdamW state in every row; bf16 and f16 compute the forward and backward \
         (the loss in f32), f16 with a GradScaler (init 2^16). \"Step peak\" is what one step's \
         forward and backward allocate above the resting state, at their peak (activations, \
         gradients, temporaries), counted by the allocator on one untimed step of the one-device \
         runs.\n\n\
         | config | median ms/step | vs f32 | step peak MB | vs f32 | loss after | steps skipped |\n\
         |---|---:|---:|---:|---:|---:|---:|\n",
        ((INPUT + 1) * HIDDEN + LAYERS * (HIDDEN + 1) * HIDDEN + (HIDDEN + 1) * CLASSES) as f64
            / 1e6,
        specs.first().map_or(0, |s| s.steps),
    );
    for (spec, m) in specs.iter().zip(&measured) {
        let f32_row = specs
            .iter()
            .zip(&measured)
            .find(|(s, _)| s.precision == "f32" && s.world == spec.world)
            .map(|(_, m)| m);
        let (time_ratio, mem_ratio) = match f32_row {
            Some(f) => (
                format!("{:.2}x", median(&m.step_ms) / median(&f.step_ms)),
                if m.step_peak_bytes > 0 && f.step_peak_bytes > 0 {
                    format!(
                        "{:.2}x",
                        m.step_peak_bytes as f64 / f.step_peak_bytes as f64
                    )
                } else {
                    String::new()
                },
            ),
            None => (String::new(), String::new()),
        };
        let peak = if m.step_peak_bytes > 0 {
            format!("{:.1}", m.step_peak_bytes as f64 / 1e6)
        } else {
            "-".into()
        };
        writeln!(
            s,
            "| {} | {:.1} | {time_ratio} | {peak} | {mem_ratio} | {:.4} | {} |",
            spec.label(),
            median(&m.step_ms),
            m.final_loss,
            m.skipped
        )?;
    }
    // The weights after the last round against f32's, from the same init.
    let init = seeded_varmap(0, DType::F32, &Device::Cpu, deep)?;
    let load = |p: &str| -> Result<HashMap<String, Tensor>> {
        Ok(candle_core::safetensors::load(
            out.join(format!("precision-{p}.safetensors")),
            &Device::Cpu,
        )?)
    };
    let reference = load("f32")?;
    let total = specs.first().map_or(0, |s| s.warmup + s.steps);
    writeln!(
        s,
        "\nWeights after {total} steps on one device against the f32 run's (same init, same batches):\n\n\
         | precision | norm of w - w_f32 | norm of w_f32 - w_init | ratio | largest element difference |\n\
         |---|---:|---:|---:|---:|"
    )?;
    for p in ["bf16", "f16"] {
        let (gap, change, largest) = weight_gap(&load(p)?, &reference, &init)?;
        writeln!(
            s,
            "| {p} | {gap:.3e} | {change:.3e} | {:.3} | {largest:.3e} |",
            gap / change
        )?;
    }
    Ok(s)
}
