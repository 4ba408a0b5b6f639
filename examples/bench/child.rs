//! The child side: runs one `Spec` in this process and measures its steps.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use candle_core::{DType, Device, Module, Tensor};
use candle_dp::comm::GroupOptions;
use candle_dp::launch;
use candle_dp::optim::{Sgd, SgdConfig};
use candle_dp::{DataParallel, DdpConfig, DistributedDataParallel, LossReduction};
use candle_nn::{loss, Optimizer, VarBuilder, VarMap};
use serde::{Deserialize, Serialize};

use crate::memory_floor;
use crate::net::Net;
use crate::plan::{DeviceKind, Kind, Spec};
use crate::stats::{median, ms};

/// What a child reports: per-step wall times and per-phase times (ms).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Measured {
    pub step_ms: Vec<f64>,
    pub phases: BTreeMap<String, Vec<f64>>,
    /// DDP: the gradient bytes all-reduced per step.
    pub grad_bytes: Option<usize>,
    /// DDP: one memcpy of `grad_bytes` (ms, median), for scale.
    pub memcpy_ms: Option<f64>,
    /// DDP on thread ranks: the reduction's bytes moved by as many threads
    /// with none of them in a cache (ms, every pass of every round;
    /// [`memory_floor::reduction_passes_ms`]).
    #[serde(default)]
    pub cold_reduction_ms: Vec<f64>,
}

impl Measured {
    fn phase(&mut self, name: &str, d: Duration) {
        self.phases.entry(name.into()).or_default().push(ms(d))
    }

    /// Adds another round's measurements of the same configuration.
    pub fn merge(&mut self, got: Measured) {
        self.step_ms.extend(got.step_ms);
        self.grad_bytes = got.grad_bytes.or(self.grad_bytes);
        if let Some(t) = got.memcpy_ms {
            self.memcpy_ms = Some(self.memcpy_ms.map_or(t, |old| old.min(t)));
        }
        self.cold_reduction_ms.extend(got.cold_reduction_ms);
        for (k, v) in got.phases {
            self.phases.entry(k).or_default().extend(v);
        }
    }
}

fn data(spec: &Spec, device: &Device) -> Result<(Tensor, Tensor)> {
    let x = Tensor::randn(
        0f32,
        1.,
        Net::input_shape(spec.model, spec.batch),
        &Device::Cpu,
    )?;
    let y = Tensor::from_vec(
        (0..spec.batch as u32).map(|i| i % 10).collect(),
        spec.batch,
        &Device::Cpu,
    )?;
    Ok((x.to_device(device)?, y.to_device(device)?))
}

/// Runs one configuration in this process (the child side).
pub fn run_child(spec: &Spec) -> Result<Measured> {
    let first = spec.device(0)?;
    let (x, y) = data(spec, &first)?;
    match spec.kind {
        Kind::Single => run_single(spec, first, &x, &y),
        // The same code on thread ranks and, under mpirun, on processes.
        Kind::Ddp | Kind::DdpMpi | Kind::DdpNccl => run_ddp(spec, &x, &y),
        Kind::DpFast | Kind::DpDropin | Kind::DpFromloss => run_dp(spec, &x, &y),
    }
}

fn run_single(spec: &Spec, first: Device, x: &Tensor, y: &Tensor) -> Result<Measured> {
    let mut m = Measured::default();
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(spec.threads)
        .build()?;
    pool.install(|| -> Result<()> {
        let varmap = VarMap::new();
        let net = Net::new(
            spec.model,
            VarBuilder::from_varmap(&varmap, DType::F32, &first),
        )?;
        let mut sgd = sgd(&varmap)?;
        let devices = [first.clone()];
        for step in 0..spec.warmup + spec.steps {
            let t0 = Instant::now();
            let loss = loss::cross_entropy(&net.forward(x)?, y)?;
            let t1 = Instant::now();
            let grads = loss.backward()?;
            let t2 = Instant::now();
            sgd.step(&grads)?;
            spec.sync(&devices)?;
            if step >= spec.warmup {
                m.phase("forward", t1 - t0);
                m.phase("backward", t2 - t1);
                m.phase("optimizer", t2.elapsed());
                m.step_ms.push(ms(t0.elapsed()));
            }
        }
        Ok(())
    })?;
    Ok(m)
}

fn run_ddp(spec: &Spec, x: &Tensor, y: &Tensor) -> Result<Measured> {
    let options = GroupOptions {
        timeout: Some(Duration::from_secs(120)),
        ..Default::default()
    };
    // Thread ranks get their share of the cores from `launch`.
    let mut results = match spec.kind {
        Kind::DdpNccl => run_on_nccl(spec, options, x, y)?,
        _ => launch::run(spec.replicas, options, |ctx| {
            let device = spec.device(ctx.rank)?;
            ddp_rank(spec, ctx, device, x, y)
        })?,
    };
    let mut m = results.swap_remove(0);
    // Once every rank is done, so that nothing else runs beside it.
    if spec.kind == Kind::Ddp && spec.device == DeviceKind::Cpu {
        let cold = m
            .grad_bytes
            .and_then(|bytes| memory_floor::reduction_passes_ms(bytes, spec.replicas));
        m.cold_reduction_ms.extend(cold.into_iter().flatten());
    }
    Ok(m)
}

/// DDP on thread ranks reducing with NCCL, a GPU (stream) per rank.
#[cfg(feature = "nccl")]
fn run_on_nccl(
    spec: &Spec,
    options: GroupOptions,
    x: &Tensor,
    y: &Tensor,
) -> Result<Vec<Measured>> {
    Ok(launch::run_on_gpus(spec.replicas, options, |ctx, gpu| {
        ddp_rank(spec, ctx, gpu, x, y)
    })?)
}

#[cfg(not(feature = "nccl"))]
fn run_on_nccl(_: &Spec, _: GroupOptions, _: &Tensor, _: &Tensor) -> Result<Vec<Measured>> {
    bail!("ddp-nccl needs a build with --features nccl")
}

/// One DDP rank's training loop, timed.
fn ddp_rank(
    spec: &Spec,
    ctx: launch::RankContext,
    device: Device,
    x: &Tensor,
    y: &Tensor,
) -> Result<Measured> {
    let per_rank = spec.batch / spec.replicas;
    let mut m = Measured::default();
    let varmap = VarMap::new();
    let model = spec.model;
    let mut ddp = DistributedDataParallel::new(
        ctx.process_group(),
        &varmap,
        DType::F32,
        &device,
        |vb| Net::new(model, vb),
        DdpConfig::default(),
    )?;
    let mut sgd = sgd(&varmap)?;
    let grad_bytes: usize = varmap
        .all_vars()
        .iter()
        .map(|v| v.elem_count() * v.dtype().size_in_bytes())
        .sum();
    m.grad_bytes = Some(grad_bytes);
    m.memcpy_ms = Some(memcpy_ms(grad_bytes));
    let (x, y) = (
        x.narrow(0, ctx.rank * per_rank, per_rank)?
            .to_device(&device)?,
        y.narrow(0, ctx.rank * per_rank, per_rank)?
            .to_device(&device)?,
    );
    let devices = [device.clone()];
    for step in 0..spec.warmup + spec.steps {
        let t0 = Instant::now();
        let loss = loss::cross_entropy(&ddp.forward(&x)?, &y)?;
        let t1 = Instant::now();
        let grads = ddp.backward(&loss)?;
        let t2 = Instant::now();
        sgd.step(&grads)?;
        spec.sync(&devices)?;
        if step >= spec.warmup {
            let t = ddp.last_timings();
            m.phase("forward", t1 - t0);
            m.phase("backward", t.backward);
            m.phase("reduce", t.all_reduce);
            m.phase("optimizer", t2.elapsed());
            m.step_ms.push(ms(t0.elapsed()));
        }
    }
    Ok(m)
}

fn run_dp(spec: &Spec, x: &Tensor, y: &Tensor) -> Result<Measured> {
    let mut m = Measured::default();
    let varmap = VarMap::new();
    let model = spec.model;
    // On a GPU the replicas share its one stream: candle-dp refuses two
    // streams of one GPU (nothing could order them).
    let devices = vec![spec.device(0)?; spec.replicas];
    let (x, y) = (x.to_device(&devices[0])?, y.to_device(&devices[0])?);
    let dp = DataParallel::new(&varmap, DType::F32, &devices, move |vb| Net::new(model, vb))?;
    let mut sgd = sgd(&varmap)?;
    for step in 0..spec.warmup + spec.steps {
        let t0 = Instant::now();
        let grads = match spec.kind {
            Kind::DpFast => {
                dp.forward_backward(
                    (x.clone(), y.clone()),
                    LossReduction::Mean,
                    |m: &Net, (x, y)| loss::cross_entropy(&m.forward(&x)?, &y),
                )?
                .grads
            }
            Kind::DpFromloss => {
                let out = dp.forward(&x)?;
                dp.backward_from_loss(&out, |o| loss::cross_entropy(o, &y))?
                    .grads
            }
            Kind::DpDropin => {
                let out = dp.forward(&x)?;
                let loss = loss::cross_entropy(&out, &y)?;
                let t = Instant::now();
                let grads = loss.backward()?;
                // As every phase, the timed steps only.
                if step >= spec.warmup {
                    m.phase("backward-serial", t.elapsed());
                }
                grads
            }
            other => bail!("{other} is not a DataParallel configuration"),
        };
        let t1 = Instant::now();
        sgd.step(&grads)?;
        spec.sync(&devices)?;
        if step >= spec.warmup {
            let t = dp.last_timings();
            m.phase("scatter", t.scatter);
            m.phase("replicate", t.replicate);
            m.phase("forward", t.forward);
            m.phase("backward", t.backward);
            m.phase("reduce", t.reduce);
            m.phase("gather", t.gather);
            m.phase("optimizer", t1.elapsed());
            m.step_ms.push(ms(t0.elapsed()));
        }
    }
    Ok(m)
}

/// The optimizer of every configuration: candle-dp's SGD (PyTorch's
/// `torch.optim.SGD`, as the PyTorch script's), lr 0.01, which updates a
/// parameter in place on the CPU.
fn sgd(varmap: &VarMap) -> Result<Sgd> {
    let config = SgdConfig {
        lr: 0.01,
        ..SgdConfig::default()
    };
    Ok(Sgd::from_varmap(varmap, config)?)
}

/// The median time of copying `bytes` bytes once (ms).
fn memcpy_ms(bytes: usize) -> f64 {
    let src = vec![1u8; bytes];
    let mut dst = vec![0u8; bytes];
    let times: Vec<f64> = (0..7)
        .map(|_| {
            let t = Instant::now();
            dst.copy_from_slice(std::hint::black_box(&src));
            std::hint::black_box(&dst);
            ms(t.elapsed())
        })
        .collect();
    median(&times)
}
