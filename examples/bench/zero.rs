//! The ZeRO part of the benchmark (`--zero`): DDP against ZeRO stages 1 and
//! 2, all with the crate's AdamW, on thread ranks and (feature `mpi`) MPI
//! processes: the step, its optimizer phase, and the bytes each rank holds
//! after a step (parameters, gradients, optimizer state), measured from
//! the tensors held. Then a run under a per-rank memory budget that DDP
//! cannot meet and stage 2 can, trained against one device.
//!
//! Each configuration runs in its own child process (this binary with
//! `--zero-child`), under `mpirun` for the MPI rows.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::Result;
use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Module, Tensor};
use candle_dp::comm::{all_gather_object, GroupOptions};
use candle_dp::fsdp::{FsdpConfig, FullyShardedDataParallel};
use candle_dp::launch;
use candle_dp::optim::{AdamW, AdamWConfig, StatefulOptimizer};
use candle_dp::pipeline::{unit, UnitFactory};
use candle_dp::zero::{grad_bytes, ZeroOptimizer, ZeroStage};
use candle_dp::{seeded_varmap, DistributedDataParallel};
use candle_nn::{linear, loss, Linear, Optimizer, VarBuilder};
use serde::{Deserialize, Serialize};

use crate::inputs::{global_batch, hash_weights};
use crate::plan::cores;
use crate::stats::median;

/// One configuration, sent to its child process as JSON.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ZeroSpec {
    /// `None`: plain DDP.
    pub stage: Option<u8>,
    pub world: usize,
    pub mpi: bool,
    pub hidden: usize,
    pub batch: usize,
    pub warmup: usize,
    pub steps: usize,
    /// Also train one device on the global batch and compare.
    pub against_one_device: bool,
    /// AdamW's epsilon.
    pub eps: f64,
    /// FSDP instead of DDP (`stage` unused): whether units are resharded
    /// after their forward.
    #[serde(default)]
    pub fsdp_reshard: Option<bool>,
}

impl ZeroSpec {
    fn label(&self) -> String {
        let zero = match (self.fsdp_reshard, self.stage) {
            (Some(true), _) => "fsdp".to_string(),
            (Some(false), _) => "fsdp, no reshard".to_string(),
            (None, None) => "ddp".to_string(),
            (None, Some(s)) => format!("ddp-zero{s}"),
        };
        let on = if self.mpi {
            "MPI processes"
        } else {
            "thread ranks"
        };
        format!("{zero} x{} ({on})", self.world)
    }
}

/// What a child measured. Bytes: the most any rank holds.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ZeroMeasured {
    pub step_ms: Vec<f64>,
    pub optimizer_ms: Vec<f64>,
    pub param_bytes: usize,
    pub grad_bytes: usize,
    pub state_bytes: usize,
    /// FNV-1a of the final weights' bits: equal hashes, equal bytes.
    pub weights_hash: u64,
    /// Largest relative weight difference from one device, if measured.
    pub vs_one_device: Option<f64>,
    /// FSDP: the most whole parameters gathered at once in a step.
    #[serde(default)]
    pub peak_gathered_bytes: usize,
}

/// A deep MLP: 784-hidden, then `DEPTH` layers hidden-hidden, then
/// hidden-10.
struct Mlp {
    layers: Vec<Linear>,
}

const DEPTH: usize = 6;

impl Mlp {
    fn new(vb: VarBuilder, hidden: usize) -> candle_core::Result<Self> {
        let mut layers = vec![linear(784, hidden, vb.pp("in"))?];
        for i in 0..DEPTH {
            layers.push(linear(hidden, hidden, vb.pp(format!("h{i}")))?);
        }
        layers.push(linear(hidden, 10, vb.pp("out"))?);
        Ok(Self { layers })
    }
}

impl Module for Mlp {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let last = self.layers.len() - 1;
        self.layers
            .iter()
            .enumerate()
            .try_fold(x.clone(), |h, (i, l)| {
                let h = l.forward(&h)?;
                if i < last {
                    h.relu()
                } else {
                    Ok(h)
                }
            })
    }
}

fn adamw(eps: f64) -> AdamWConfig {
    AdamWConfig {
        lr: 1e-3,
        eps,
        ..Default::default()
    }
}

const SEED: u64 = 7;

fn bytes_of<'a>(tensors: impl Iterator<Item = &'a Tensor>) -> usize {
    tensors
        .map(|t| t.elem_count() * t.dtype().size_in_bytes())
        .sum()
}

/// The MLP as units, one layer (with its ReLU) each, for FSDP.
fn mlp_units(hidden: usize) -> Vec<UnitFactory> {
    let mut shapes = vec![(784, hidden, "in".to_string())];
    shapes.extend((0..DEPTH).map(|i| (hidden, hidden, format!("h{i}"))));
    shapes.push((hidden, 10, "out".to_string()));
    let last = shapes.len() - 1;
    shapes
        .into_iter()
        .enumerate()
        .map(|(i, (a, b, name))| {
            unit(move |vb: VarBuilder| {
                let l = linear(a, b, vb.pp(&name))?;
                Ok(Relu(l, i < last))
            })
        })
        .collect()
}

/// A linear layer, then ReLU when `.1`.
struct Relu(Linear, bool);

impl Module for Relu {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let h = self.0.forward(x)?;
        if self.1 {
            h.relu()
        } else {
            Ok(h)
        }
    }
}

/// One FSDP configuration in this process; rank 0's measurements.
fn run_fsdp(spec: &ZeroSpec, reshard: bool) -> Result<Option<ZeroMeasured>> {
    let options = GroupOptions {
        timeout: Some(Duration::from_secs(300)),
        ..Default::default()
    };
    let per_rank = spec.batch / spec.world;
    let (x, y) = global_batch(spec.batch)?;
    let ranks = launch::run(spec.world, options, |ctx| -> Result<Option<ZeroMeasured>> {
        let hidden = spec.hidden;
        let varmap = seeded_varmap(SEED, DType::F32, &Device::Cpu, |vb| Mlp::new(vb, hidden))?;
        let config = FsdpConfig {
            reshard_after_forward: reshard,
            ..Default::default()
        };
        let mut fsdp = FullyShardedDataParallel::from_units(
            ctx.process_group(),
            &varmap,
            DType::F32,
            &Device::Cpu,
            mlp_units(hidden),
            config,
        )?;
        let mut opt = AdamW::from_varmap(&varmap, adamw(spec.eps))?;
        let rows = x.narrow(0, ctx.rank * per_rank, per_rank)?;
        let labels = y.narrow(0, ctx.rank * per_rank, per_rank)?;
        let mut m = ZeroMeasured::default();
        let mut held = GradStore::default();
        for step in 0..spec.warmup + spec.steps {
            let t0 = Instant::now();
            let s = fsdp.forward_backward(&rows, &labels, loss::cross_entropy)?;
            let t1 = Instant::now();
            opt.step(&s.grads)?;
            if step >= spec.warmup {
                m.optimizer_ms.push(t1.elapsed().as_secs_f64() * 1e3);
                m.step_ms.push(t0.elapsed().as_secs_f64() * 1e3);
            }
            held = s.grads;
        }
        let memory = fsdp.last_memory();
        let mine = (
            memory.shard_bytes,
            grad_bytes(&held),
            bytes_of(opt.state()?.tensors.values()),
            memory.peak_gathered_bytes,
        );
        let all = all_gather_object(ctx.pg.as_ref(), &mine)?;
        m.param_bytes = all.iter().map(|b| b.0).max().unwrap_or(0);
        m.grad_bytes = all.iter().map(|b| b.1).max().unwrap_or(0);
        m.state_bytes = all.iter().map(|b| b.2).max().unwrap_or(0);
        m.peak_gathered_bytes = all.iter().map(|b| b.3).max().unwrap_or(0);
        let full = fsdp.full_state()?;
        if ctx.rank == 0 {
            candle_core::safetensors::save(&full, weights_file(spec))?;
        }
        let mut whole: Vec<(String, candle_core::Var)> = full
            .into_iter()
            .map(|(n, t)| Ok((n, candle_core::Var::from_tensor(&t)?)))
            .collect::<candle_core::Result<_>>()?;
        whole.sort_by(|a, b| a.0.cmp(&b.0));
        m.weights_hash = hash_weights(&whole)?;
        Ok((ctx.rank == 0).then_some(m))
    })?;
    Ok(ranks.into_iter().flatten().next())
}

/// Runs one configuration in this process (the child side).
pub fn run_child(spec: &ZeroSpec) -> Result<Option<ZeroMeasured>> {
    if let Some(reshard) = spec.fsdp_reshard {
        return run_fsdp(spec, reshard);
    }
    let options = GroupOptions {
        timeout: Some(Duration::from_secs(300)),
        ..Default::default()
    };
    let per_rank = spec.batch / spec.world;
    let (x, y) = global_batch(spec.batch)?;
    type Answer = Option<(ZeroMeasured, Vec<(String, Tensor)>)>;
    let ranks = launch::run(spec.world, options, |ctx| -> Result<Answer> {
        let hidden = spec.hidden;
        let varmap = seeded_varmap(SEED, DType::F32, &Device::Cpu, |vb| Mlp::new(vb, hidden))?;
        let mut builder = DistributedDataParallel::builder(
            ctx.process_group(),
            &varmap,
            DType::F32,
            &Device::Cpu,
        );
        let stage = spec.stage.and_then(ZeroStage::from_number);
        if let Some(stage) = stage {
            builder = builder.zero(stage);
        }
        let mut ddp = builder.build(|vb| Mlp::new(vb, hidden))?;
        let mut whole = match stage {
            None => Some(AdamW::from_varmap(&varmap, adamw(spec.eps))?),
            Some(_) => None,
        };
        let mut sharded = match stage {
            Some(_) => Some(ZeroOptimizer::new(&ddp, |mine| {
                AdamW::new_named(mine, adamw(spec.eps))
            })?),
            None => None,
        };
        let rows = x.narrow(0, ctx.rank * per_rank, per_rank)?;
        let labels = y.narrow(0, ctx.rank * per_rank, per_rank)?;
        let mut m = ZeroMeasured::default();
        let mut held = GradStore::default();
        for step in 0..spec.warmup + spec.steps {
            let t0 = Instant::now();
            let loss = loss::cross_entropy(&ddp.forward(&rows)?, &labels)?;
            let grads = ddp.backward(&loss)?;
            let t1 = Instant::now();
            match (&mut whole, &mut sharded) {
                (Some(opt), _) => opt.step(&grads)?,
                (_, Some(opt)) => opt.step(&grads)?,
                _ => unreachable!("one optimizer is built"),
            }
            if step >= spec.warmup {
                m.optimizer_ms.push(t1.elapsed().as_secs_f64() * 1e3);
                m.step_ms.push(t0.elapsed().as_secs_f64() * 1e3);
            }
            held = grads;
        }
        let params = ddp.params();
        let state = match (&whole, &sharded) {
            (Some(opt), _) => bytes_of(opt.state()?.tensors.values()),
            (_, Some(opt)) => opt.state_bytes()?,
            _ => 0,
        };
        // ZeRO's optimizer steps pieces of its own beside the whole
        // parameters: they count.
        let pieces = sharded.as_ref().map_or(0, |opt| {
            bytes_of(opt.shard_vars().iter().map(|(_, v)| v.as_tensor()))
        });
        let mine = (
            bytes_of(params.iter().map(|(_, v)| v.as_tensor())) + pieces,
            grad_bytes(&held),
            state,
        );
        let all = all_gather_object(ctx.pg.as_ref(), &mine)?;
        m.param_bytes = all.iter().map(|b| b.0).max().unwrap_or(0);
        m.grad_bytes = all.iter().map(|b| b.1).max().unwrap_or(0);
        m.state_bytes = all.iter().map(|b| b.2).max().unwrap_or(0);
        m.weights_hash = hash_weights(params)?;
        if ctx.rank != 0 {
            return Ok(None);
        }
        let whole: HashMap<String, Tensor> = params
            .iter()
            .map(|(n, v)| Ok((n.clone(), v.as_tensor().copy()?)))
            .collect::<candle_core::Result<_>>()?;
        candle_core::safetensors::save(&whole, weights_file(spec))?;
        let weights = match spec.against_one_device {
            true => params
                .iter()
                .map(|(n, v)| Ok((n.clone(), v.as_tensor().copy()?)))
                .collect::<candle_core::Result<Vec<_>>>()?,
            false => Vec::new(),
        };
        Ok(Some((m, weights)))
    })?;
    let Some((mut measured, weights)) = ranks.into_iter().flatten().next() else {
        return Ok(None);
    };
    if spec.against_one_device {
        measured.vs_one_device = Some(one_device_difference(spec, &x, &y, &weights)?);
    }
    Ok(Some(measured))
}

/// Where a configuration's final weights go (rank 0), for the report to
/// compare FSDP's with DDP's where their bytes differ.
fn weights_file(spec: &ZeroSpec) -> std::path::PathBuf {
    let label: String = spec
        .label()
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect();
    std::env::temp_dir().join(format!("candle_dp_bench_zero_{label}.safetensors"))
}

/// The largest difference between two runs' weights, relative to each
/// tensor's largest value.
fn weights_difference(a: &ZeroSpec, b: &ZeroSpec) -> Result<f64> {
    let a = candle_core::safetensors::load(weights_file(a), &Device::Cpu)?;
    let b = candle_core::safetensors::load(weights_file(b), &Device::Cpu)?;
    let mut worst = 0f64;
    for (name, x) in &a {
        let y = b
            .get(name)
            .ok_or_else(|| anyhow::anyhow!("{name} missing"))?;
        let scale = y.abs()?.max_all()?.to_scalar::<f32>()?.max(1e-6) as f64;
        let diff = (x - y)?.abs()?.max_all()?.to_scalar::<f32>()? as f64;
        worst = worst.max(diff / scale);
    }
    Ok(worst)
}

/// Trains one device on the global batch as the ranks did and returns the
/// largest relative difference of `weights` (the ranks', sorted by name)
/// from its own (`max|a-b| / max|b|` per tensor).
fn one_device_difference(
    spec: &ZeroSpec,
    x: &Tensor,
    y: &Tensor,
    weights: &[(String, Tensor)],
) -> Result<f64> {
    let hidden = spec.hidden;
    let varmap = seeded_varmap(SEED, DType::F32, &Device::Cpu, |vb| Mlp::new(vb, hidden))?;
    let model = Mlp::new(
        VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu),
        hidden,
    )?;
    let mut opt = AdamW::from_varmap(&varmap, adamw(spec.eps))?;
    for _ in 0..spec.warmup + spec.steps {
        opt.backward_step(&loss::cross_entropy(&model.forward(x)?, y)?)?;
    }
    let one = varmap
        .data()
        .lock()
        .map_err(|_| anyhow::anyhow!("poisoned"))?
        .clone();
    let mut worst = 0f64;
    for (name, a) in weights {
        let b = one
            .get(name)
            .ok_or_else(|| anyhow::anyhow!("{name}: not on one device"))?
            .as_tensor();
        let scale = b.abs()?.max_all()?.to_scalar::<f32>()?.max(1e-6) as f64;
        let diff = (a - b)?.abs()?.max_all()?.to_scalar::<f32>()? as f64;
        anyhow::ensure!(diff.is_finite(), "{name}: not finite");
        worst = worst.max(diff / scale);
    }
    anyhow::ensure!(
        weights.len() == one.len(),
        "the ranks and one device trained different variables"
    );
    Ok(worst)
}

/// Every configuration of a `--zero` run.
fn specs(quick: bool, steps: usize) -> Vec<ZeroSpec> {
    let worlds: &[usize] = if quick { &[2] } else { &[2, 4] };
    let mut out = Vec::new();
    let spec = |stage, world, mpi| ZeroSpec {
        stage,
        world,
        mpi,
        hidden: 512,
        batch: 256,
        warmup: 3,
        steps,
        against_one_device: false,
        eps: 1e-8,
        fsdp_reshard: None,
    };
    let fsdp = |reshard, world, mpi| ZeroSpec {
        fsdp_reshard: Some(reshard),
        ..spec(None, world, mpi)
    };
    for &world in worlds {
        for stage in [None, Some(1), Some(2)] {
            out.push(spec(stage, world, false));
        }
        out.push(fsdp(true, world, false));
        out.push(fsdp(false, world, false));
    }
    if cfg!(feature = "mpi") {
        for stage in [None, Some(1), Some(2)] {
            out.push(spec(stage, 2, true));
        }
        out.push(fsdp(true, 2, true));
        out.push(fsdp(false, 2, true));
    }
    out
}

/// Runs every configuration `rounds` times in child processes and writes
/// the report (zero.md).
pub fn run(quick: bool, steps: usize, rounds: usize) -> Result<String> {
    let specs = specs(quick, steps);
    let mut measured: Vec<ZeroMeasured> = vec![ZeroMeasured::default(); specs.len()];
    for _ in 0..rounds {
        for (spec, m) in specs.iter().zip(&mut measured) {
            let got = run_in_child(spec)?;
            m.step_ms.extend(got.step_ms);
            m.optimizer_ms.extend(got.optimizer_ms);
            (m.param_bytes, m.grad_bytes, m.state_bytes) =
                (got.param_bytes, got.grad_bytes, got.state_bytes);
            m.peak_gathered_bytes = got.peak_gathered_bytes;
            m.weights_hash = got.weights_hash;
        }
    }
    let mut s = String::from(
        "## ZeRO against DDP (AdamW, MLP 784-512, 6 x 512-512, 512-10: 2.0M parameters; global batch 256)\n\n\
         Bytes are the most any rank holds after a step, summed over the tensors it \
         keeps: parameters (for ZeRO, the whole ones and the pieces its optimizer steps), \
         the gradients the step returned, the optimizer's state.\n\n\
         FSDP (ZeRO-3, `fsdp`) holds its pieces of every parameter and gathers a unit (a \
         layer) when it is used; `gathered MB` is the most whole parameters it held at once. \
         `vs DDP` is the step time against DDP's at the same world size and transport.\n\n\
         | config | median ms/step | vs DDP | optimizer ms | parameters MB | gradients MB | optimizer state MB | gathered MB | weights = DDP's |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|---|\n",
    );
    let measured = &measured;
    for (spec, m) in specs.iter().zip(measured) {
        let ddp = specs
            .iter()
            .zip(measured)
            .find(|(s, _)| {
                s.stage.is_none()
                    && s.fsdp_reshard.is_none()
                    && s.world == spec.world
                    && s.mpi == spec.mpi
            })
            .map(|(_, d)| d.weights_hash);
        let is_ddp = spec.stage.is_none() && spec.fsdp_reshard.is_none();
        let ddp_spec = specs.iter().find(|s| {
            s.stage.is_none()
                && s.fsdp_reshard.is_none()
                && s.world == spec.world
                && s.mpi == spec.mpi
        });
        let same = match (is_ddp, ddp) {
            (true, _) => "(DDP)".to_string(),
            (false, Some(h)) if h == m.weights_hash => "yes, bit for bit".to_string(),
            (false, Some(_)) => match ddp_spec.map(|d| weights_difference(spec, d)) {
                Some(Ok(diff)) => format!("no: within {diff:.1e}"),
                _ => "NO".to_string(),
            },
            (false, None) => String::new(),
        };
        let ddp_ms = specs
            .iter()
            .zip(measured)
            .find(|(s, _)| {
                s.stage.is_none()
                    && s.fsdp_reshard.is_none()
                    && s.world == spec.world
                    && s.mpi == spec.mpi
            })
            .map(|(_, d)| median(&d.step_ms));
        let vs = match ddp_ms {
            Some(d) if !is_ddp => format!("{:.2}x", median(&m.step_ms) / d),
            _ => String::new(),
        };
        let gathered = match spec.fsdp_reshard {
            Some(_) => format!("{:.2}", m.peak_gathered_bytes as f64 / 1e6),
            None => String::new(),
        };
        writeln!(
            s,
            "| {} | {:.2} | {vs} | {:.2} | {:.2} | {:.2} | {:.2} | {gathered} | {same} |",
            spec.label(),
            median(&m.step_ms),
            median(&m.optimizer_ms),
            m.param_bytes as f64 / 1e6,
            m.grad_bytes as f64 / 1e6,
            m.state_bytes as f64 / 1e6,
        )?;
    }
    s += &budget_run(&specs, measured, steps)?;
    s += &fsdp_budget_run(steps)?;
    Ok(s)
}

/// A per-rank budget between stage 2's bytes and DDP's at the largest
/// world: stage 2 trains under it, and against one device.
fn budget_run(specs: &[ZeroSpec], measured: &[ZeroMeasured], steps: usize) -> Result<String> {
    let world = specs.iter().map(|s| s.world).max().unwrap_or(2);
    let total = |stage: Option<u8>| {
        specs
            .iter()
            .zip(measured)
            .find(|(s, _)| {
                s.stage == stage && s.fsdp_reshard.is_none() && s.world == world && !s.mpi
            })
            .map(|(_, m)| m.param_bytes + m.grad_bytes + m.state_bytes)
    };
    let (Some(ddp), Some(zero2)) = (total(None), total(Some(2))) else {
        return Ok(String::new());
    };
    let budget = (ddp + zero2) / 2;
    let spec = |eps| ZeroSpec {
        stage: Some(2),
        world,
        mpi: false,
        hidden: 512,
        batch: 256,
        warmup: 3,
        steps,
        against_one_device: true,
        eps,
        fsdp_reshard: None,
    };
    let default_eps = run_in_child(&spec(1e-8))?;
    let large_eps = run_in_child(&spec(1e-3))?;
    let fits = |bytes: usize| {
        if bytes <= budget {
            "fits"
        } else {
            "does not fit"
        }
    };
    let mut s = String::new();
    writeln!(
        s,
        "\n## Under a per-rank budget of {:.1} MB ({world} thread ranks)\n\n\
         After a step, DDP holds {:.1} MB per rank ({}); ZeRO stage 2 holds {:.1} MB ({}); \
         during a step both hold more (candle computes every gradient before they are \
         reduced, and ZeRO's exchange holds the gathered parameters while it writes them). \
         Stage 2 trained {} steps there. Its weights against DDP's are in the table above; \
         they differ from one device's (the global batch, AdamW) by {:.2e} at most, relative to \
         each tensor's largest value: AdamW's first updates are +-lr whatever a gradient's \
         size, so a gradient element that rounding leaves near zero with either sign moves by \
         2 lr between the runs. With eps 1e-3 instead of 1e-8 (such gradients then give \
         small updates) the difference is {:.2e}.",
        budget as f64 / 1e6,
        ddp as f64 / 1e6,
        fits(ddp),
        zero2 as f64 / 1e6,
        fits(zero2),
        3 + steps,
        default_eps.vs_one_device.unwrap_or(f64::NAN),
        large_eps.vs_one_device.unwrap_or(f64::NAN),
    )?;
    Ok(s)
}

/// A per-rank budget below the model's parameters alone (90% of them):
/// DDP cannot hold the model under it at any world size; FSDP on 8 thread
/// ranks trains there, to DDP's weights.
fn fsdp_budget_run(steps: usize) -> Result<String> {
    let world = 8;
    let spec = |fsdp_reshard| ZeroSpec {
        stage: None,
        world,
        mpi: false,
        hidden: 512,
        batch: 256,
        warmup: 3,
        steps,
        against_one_device: false,
        eps: 1e-8,
        fsdp_reshard,
    };
    let ddp = run_in_child(&spec(None))?;
    let fsdp = run_in_child(&spec(Some(true)))?;
    let budget = ddp.param_bytes * 9 / 10;
    let held = fsdp.param_bytes + fsdp.grad_bytes + fsdp.state_bytes + fsdp.peak_gathered_bytes;
    let mut s = String::new();
    writeln!(
        s,
        "\n## FSDP under a per-rank budget below the parameters alone ({world} thread ranks)\n\n\
         The budget is {:.2} MB, 90% of the model's parameters ({:.2} MB), so no DDP rank (nor a \
         ZeRO one, which holds every parameter) can train under it. FSDP's rank holds {:.2} MB: \
         its pieces of the parameters ({:.2}), of the gradients ({:.2}) and of AdamW's state \
         ({:.2}), and the most whole parameters it gathered at once in a step ({:.2}): it {}. \
         The step's activations, and a unit's whole gradients until they are reduce-scattered, \
         come on top, as DDP's activations and whole gradients do. \
         Its weights after {} steps are DDP's on {world} ranks: {}. Step: {:.1} ms (DDP {:.1} ms).",
        budget as f64 / 1e6,
        ddp.param_bytes as f64 / 1e6,
        held as f64 / 1e6,
        fsdp.param_bytes as f64 / 1e6,
        fsdp.grad_bytes as f64 / 1e6,
        fsdp.state_bytes as f64 / 1e6,
        fsdp.peak_gathered_bytes as f64 / 1e6,
        if held <= budget {
            "fits"
        } else {
            "does NOT fit"
        },
        3 + steps,
        if fsdp.weights_hash == ddp.weights_hash {
            "yes, bit for bit".to_string()
        } else {
            match weights_difference(&spec(Some(true)), &spec(None)) {
                Ok(diff) => format!(
                    "not bit for bit (a bucket this large is reduced in ring order, which depends on \
                     each element's place in DDP's bucket and in FSDP's table): within {diff:.1e} of \
                     each tensor's largest value"
                ),
                Err(e) => format!("NO ({e})"),
            }
        },
        median(&fsdp.step_ms),
        median(&ddp.step_ms),
    )?;
    Ok(s)
}

fn run_in_child(spec: &ZeroSpec) -> Result<ZeroMeasured> {
    let mut cmd = if spec.mpi {
        crate::mpirun_this(spec.world)?
    } else {
        Command::new(std::env::current_exe()?)
    };
    cmd.arg("--zero-child").arg(serde_json::to_string(spec)?);
    if spec.mpi {
        let threads = (cores() / spec.world).max(1).to_string();
        cmd.env("RAYON_NUM_THREADS", &threads);
        cmd.env("CANDLE_NUM_THREADS", &threads);
    }
    crate::child_answer(cmd, &spec.label())
}
