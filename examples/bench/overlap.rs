//! The overlap part of the benchmark (`--overlap`): DDP reducing after the
//! backward (`ddp`) against DDP over the same model given as units,
//! reducing each bucket while the earlier units' backward runs
//! (`ddp-overlap`), on thread ranks and (feature `mpi`) MPI processes,
//! beside one rank's compute alone (`compute`: the same per-rank batch and
//! threads, no DDP). Also the overlap where it cannot help: the whole
//! model as one unit, and one rank.
//!
//! Each configuration runs in its own child process (this binary with
//! `--overlap-child`), under `mpirun` for the MPI rows; rounds interleave
//! the configurations.

use std::fmt::Write as _;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::Result;
use candle_core::{DType, Device, Module, ModuleT, Tensor};
use candle_dp::comm::GroupOptions;
use candle_dp::launch;
use candle_dp::pipeline::{unit, UnitFactory};
use candle_dp::units::Units;
use candle_dp::{seeded_varmap, DdpConfig, DistributedDataParallel};
use candle_nn::{linear, loss, Linear, Optimizer, VarBuilder, SGD};
use serde::{Deserialize, Serialize};

use crate::inputs::{global_batch, hash_weights};
use crate::plan::cores;
use crate::stats::median;

/// How a configuration trains.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Way {
    /// Every rank training on its share of the batch at once, as under
    /// DDP, with no communication: the compute the others add to.
    Compute,
    /// DDP, the model whole, reduced after the backward.
    Ddp,
    /// DDP over the model given as units (one per layer).
    Overlap,
    /// DDP over the model given as one unit: nothing to overlap with.
    OneUnit,
}

/// One configuration, sent to its child process as JSON.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct OverlapSpec {
    pub way: Way,
    /// Hidden layers of `width` (the reference MLP has 1 besides its first).
    pub hidden_layers: usize,
    pub width: usize,
    pub world: usize,
    pub mpi: bool,
    /// Global batch.
    pub batch: usize,
    pub warmup: usize,
    pub steps: usize,
}

impl OverlapSpec {
    fn model(&self) -> String {
        format!(
            "MLP 784-{w}, {h} x {w}-{w}, {w}-10",
            w = self.width,
            h = self.hidden_layers
        )
    }

    fn label(&self) -> String {
        let on = if self.mpi { "MPI" } else { "threads" };
        match self.way {
            Way::Compute => format!("compute only, x{} ({on})", self.world),
            Way::Ddp => format!("ddp x{} ({on})", self.world),
            Way::Overlap => format!("ddp-overlap x{} ({on})", self.world),
            Way::OneUnit => format!("ddp-overlap, one unit, x{} ({on})", self.world),
        }
    }
}

/// What a child measured, on rank 0.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct OverlapMeasured {
    pub step_ms: Vec<f64>,
    pub backward_ms: Vec<f64>,
    pub all_reduce_ms: Vec<f64>,
    pub hidden: Vec<f64>,
    /// FNV-1a of the final weights' bits.
    pub weights_hash: u64,
}

/// Linear, then ReLU unless it is the last layer: one unit.
struct Dense {
    linear: Linear,
    relu: bool,
}

impl Module for Dense {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let h = self.linear.forward(x)?;
        if self.relu {
            h.relu()
        } else {
            Ok(h)
        }
    }
}

/// The layers' (input, output, name) sizes.
fn shapes(spec: &OverlapSpec) -> Vec<(usize, usize, String)> {
    let w = spec.width;
    let mut out = vec![(784, w, "in".to_string())];
    out.extend((0..spec.hidden_layers).map(|i| (w, w, format!("h{i}"))));
    out.push((w, 10, "out".to_string()));
    out
}

fn units(spec: &OverlapSpec) -> Vec<UnitFactory> {
    let shapes = shapes(spec);
    let last = shapes.len() - 1;
    shapes
        .into_iter()
        .enumerate()
        .map(|(i, (a, b, name))| {
            unit(move |vb: VarBuilder| {
                Ok(Dense {
                    linear: linear(a, b, vb.pp(&name))?,
                    relu: i < last,
                })
            })
        })
        .collect()
}

/// The model whole: the units chained in one graph.
fn whole(spec: &OverlapSpec, vb: VarBuilder) -> candle_core::Result<Units> {
    Units::build(vb, &units(spec)).map_err(candle_core::Error::wrap)
}

const SEED: u64 = 11;

/// Runs one configuration in this process (the child side); rank 0 answers.
pub fn run_child(spec: &OverlapSpec) -> Result<Option<OverlapMeasured>> {
    let per_rank = spec.batch / spec.world;
    let (x, y) = global_batch(spec.batch)?;
    let options = GroupOptions {
        timeout: Some(Duration::from_secs(300)),
        ..Default::default()
    };
    let ranks = launch::run(
        spec.world,
        options,
        |ctx| -> Result<Option<OverlapMeasured>> {
            let varmap = seeded_varmap(SEED, DType::F32, &Device::Cpu, |vb| whole(spec, vb))?;
            // Every way fills its buckets alike, so the weights can be compared.
            let order = whole(
                spec,
                candle_nn::VarBuilder::from_varmap(
                    &candle_nn::VarMap::new(),
                    DType::F32,
                    &Device::Cpu,
                ),
            )?
            .bucket_order();
            let config = DdpConfig {
                bucket_order: Some(order),
                ..Default::default()
            };
            let pg = ctx.process_group();
            let mut sgd = SGD::new(varmap.all_vars(), 0.01)?;
            let rows = x.narrow(0, ctx.rank * per_rank, per_rank)?;
            let labels = y.narrow(0, ctx.rank * per_rank, per_rank)?;
            let mut m = OverlapMeasured::default();
            let record = |m: &mut OverlapMeasured, t0: Instant, t: candle_dp::DdpTimings| {
                m.step_ms.push(t0.elapsed().as_secs_f64() * 1e3);
                m.backward_ms.push(t.backward.as_secs_f64() * 1e3);
                m.all_reduce_ms.push(t.all_reduce.as_secs_f64() * 1e3);
                m.hidden.push(t.hidden_fraction());
            };
            let params = match spec.way {
                Way::Ddp => {
                    let mut ddp = DistributedDataParallel::new(
                        pg,
                        &varmap,
                        DType::F32,
                        &Device::Cpu,
                        |vb| whole(spec, vb),
                        config,
                    )?;
                    for step in 0..spec.warmup + spec.steps {
                        let t0 = Instant::now();
                        let loss = loss::cross_entropy(&ddp.forward_t(&rows, true)?, &labels)?;
                        let grads = ddp.backward(&loss)?;
                        sgd.step(&grads)?;
                        if step >= spec.warmup {
                            record(&mut m, t0, ddp.last_timings());
                        }
                    }
                    ddp.params().to_vec()
                }
                Way::Overlap | Way::OneUnit => {
                    let units = match spec.way {
                        Way::OneUnit => {
                            let all = units(spec);
                            vec![unit(move |vb: VarBuilder| {
                                Units::build(vb, &all).map_err(candle_core::Error::wrap)
                            })]
                        }
                        _ => units(spec),
                    };
                    let mut ddp = DistributedDataParallel::from_units(
                        pg,
                        &varmap,
                        DType::F32,
                        &Device::Cpu,
                        units,
                        config,
                    )?;
                    for step in 0..spec.warmup + spec.steps {
                        let t0 = Instant::now();
                        let s = ddp.forward_backward(&rows, &labels, loss::cross_entropy)?;
                        sgd.step(&s.grads)?;
                        if step >= spec.warmup {
                            record(&mut m, t0, ddp.last_timings());
                        }
                    }
                    ddp.params().to_vec()
                }
                Way::Compute => {
                    let model = whole(
                        spec,
                        VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu),
                    )?;
                    for step in 0..spec.warmup + spec.steps {
                        let t0 = Instant::now();
                        let loss = loss::cross_entropy(&model.forward_t(&rows, true)?, &labels)?;
                        let t1 = Instant::now();
                        let grads = loss.backward()?;
                        let backward = t1.elapsed();
                        sgd.step(&grads)?;
                        if step >= spec.warmup {
                            m.step_ms.push(t0.elapsed().as_secs_f64() * 1e3);
                            m.backward_ms.push(backward.as_secs_f64() * 1e3);
                        }
                    }
                    Vec::new()
                }
            };
            m.weights_hash = hash_weights(&params)?;
            Ok((ctx.rank == 0).then_some(m))
        },
    )?;
    Ok(ranks.into_iter().flatten().next())
}

/// Every configuration of an `--overlap` run: the reference MLP and a deep
/// one, at 2 ranks on threads and MPI; world 1 and one unit on the deep one.
fn specs(quick: bool, steps: usize) -> Vec<OverlapSpec> {
    let models: &[(usize, usize)] = if quick {
        &[(8, 1024)]
    } else {
        &[(1, 1024), (8, 1024)]
    };
    let mut out = Vec::new();
    for &(hidden_layers, width) in models {
        let spec = |way, world, mpi| OverlapSpec {
            way,
            hidden_layers,
            width,
            world,
            mpi,
            batch: 256,
            warmup: 3,
            steps,
        };
        for mpi in [false, true] {
            if mpi && !cfg!(feature = "mpi") {
                continue;
            }
            out.push(spec(Way::Compute, 2, mpi));
            out.push(spec(Way::Ddp, 2, mpi));
            out.push(spec(Way::Overlap, 2, mpi));
        }
        if hidden_layers > 1 {
            out.push(spec(Way::OneUnit, 2, false));
            let one = |way| OverlapSpec {
                batch: 128,
                ..spec(way, 1, false)
            };
            out.push(one(Way::Compute));
            out.push(one(Way::Ddp));
            out.push(one(Way::Overlap));
        }
    }
    out
}

/// Runs every configuration `rounds` times in child processes and writes
/// the report (overlap.md).
pub fn run(quick: bool, steps: usize, rounds: usize) -> Result<String> {
    let specs = specs(quick, steps);
    let mut measured: Vec<OverlapMeasured> = vec![OverlapMeasured::default(); specs.len()];
    for _ in 0..rounds {
        for (spec, m) in specs.iter().zip(&mut measured) {
            let got = run_in_child(spec)?;
            m.step_ms.extend(got.step_ms);
            m.backward_ms.extend(got.backward_ms);
            m.all_reduce_ms.extend(got.all_reduce_ms);
            m.hidden.extend(got.hidden);
            m.weights_hash = got.weights_hash;
        }
    }
    let mut s = String::from(
        "## The reduction overlapped with the backward (SGD, global batch 256, 2 ranks)\n\n\
         `ddp` reduces after the backward; `ddp-overlap` gives the same model as units (one \
         per layer) and reduces each bucket (PyTorch's caps: 1 MiB first, 25 MiB after) on a \
         communication thread while the earlier layers' backward runs. Both fill the buckets \
         in the same order, so their weights can be compared. Overhead: the step against \
         `compute only`, the same ranks training on the same rows at the same time with no \
         communication (each its share of the cores). Hidden: the share of the all-reduce time \
         during which the backward still ran.\n\n\
         | model | config | median ms/step | overhead | backward ms | all-reduce ms | hidden | weights = ddp's |\n\
         |---|---|---:|---:|---:|---:|---:|---|\n",
    );
    for (spec, m) in specs.iter().zip(&measured) {
        let find = |way: Way| {
            specs
                .iter()
                .zip(&measured)
                .find(|(o, _)| {
                    o.way == way
                        && o.hidden_layers == spec.hidden_layers
                        && o.world == spec.world
                        && o.mpi == spec.mpi
                })
                .map(|(_, m)| m)
        };
        let compute = find(Way::Compute).map(|m| median(&m.step_ms));
        let overhead = match (spec.way, compute) {
            (Way::Compute, _) | (_, None) => String::new(),
            (_, Some(c)) => format!("{:+.1}%", (median(&m.step_ms) / c - 1.0) * 100.0),
        };
        let same = match (spec.way, find(Way::Ddp)) {
            (Way::Compute | Way::Ddp, _) => String::new(),
            (_, Some(d)) if d.weights_hash == m.weights_hash => "yes, bit for bit".into(),
            (_, Some(_)) => "NO".into(),
            (_, None) => String::new(),
        };
        let opt = |v: &[f64], f: &dyn Fn(f64) -> String| {
            if v.is_empty() {
                String::new()
            } else {
                f(median(v))
            }
        };
        writeln!(
            s,
            "| {} | {} | {:.2} | {overhead} | {} | {} | {} | {same} |",
            spec.model(),
            spec.label(),
            median(&m.step_ms),
            opt(&m.backward_ms, &|v| format!("{v:.2}")),
            opt(&m.all_reduce_ms, &|v| format!("{v:.2}")),
            match spec.way {
                Way::Overlap | Way::OneUnit => opt(&m.hidden, &|v| format!("{:.0}%", v * 100.0)),
                _ => String::new(),
            },
        )?;
    }
    Ok(s)
}

fn run_in_child(spec: &OverlapSpec) -> Result<OverlapMeasured> {
    let mut cmd = if spec.mpi {
        crate::mpirun_this(spec.world)?
    } else {
        Command::new(std::env::current_exe()?)
    };
    cmd.arg("--overlap-child").arg(serde_json::to_string(spec)?);
    if spec.mpi {
        let threads = (cores() / spec.world).max(1).to_string();
        cmd.env("RAYON_NUM_THREADS", &threads);
        cmd.env("CANDLE_NUM_THREADS", &threads);
    }
    crate::child_answer(cmd, &spec.label())
}
