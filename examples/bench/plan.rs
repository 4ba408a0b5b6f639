//! The configurations a run measures: which kinds, models, global batches
//! and replica counts, each as a `Spec` that travels to its child process.

use std::fmt;

use candle_core::Device;
use clap::ValueEnum;
use serde::{Deserialize, Serialize};

/// How a configuration trains; its JSON name is the one the table prints.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Kind {
    /// One device, no data parallelism.
    Single,
    /// DataParallel, `forward_backward` (backward on the replicas' threads).
    DpFast,
    /// DataParallel, forward then `loss.backward()` on the caller's thread.
    DpDropin,
    /// DataParallel, `forward` then `backward_from_loss`.
    DpFromloss,
    /// DistributedDataParallel on thread ranks.
    Ddp,
    /// DistributedDataParallel on MPI processes under `mpirun`.
    DdpMpi,
    /// DistributedDataParallel on thread ranks reducing with NCCL
    /// (`launch::run_on_gpus`; feature `nccl`).
    DdpNccl,
}

impl Kind {
    /// The parallel kinds, in the order the table lists them.
    pub const PARALLEL: [Kind; 6] = [
        Kind::DpFast,
        Kind::DpFromloss,
        Kind::DpDropin,
        Kind::Ddp,
        Kind::DdpMpi,
        Kind::DdpNccl,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Single => "single",
            Kind::DpFast => "dp-fast",
            Kind::DpDropin => "dp-dropin",
            Kind::DpFromloss => "dp-fromloss",
            Kind::Ddp => "ddp",
            Kind::DdpMpi => "ddp-mpi",
            Kind::DdpNccl => "ddp-nccl",
        }
    }

    /// DistributedDataParallel, on threads or processes.
    pub fn is_ddp(self) -> bool {
        matches!(self, Kind::Ddp | Kind::DdpMpi | Kind::DdpNccl)
    }
}

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The network trained (see `net.rs`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Model {
    /// MLP 784-1024-1024-10.
    Mlp,
    /// The same MLP through candle-nn's `Linear` and `relu` instead of the
    /// fused layers (`--candle-ops`: the fused ops' side-by-side).
    MlpCandleOps,
    /// MLP 784-4096-4096-10: compute-bound on a GPU at a large batch.
    MlpWide,
    /// A small conv net on 1x28x28.
    Conv,
}

impl Model {
    pub fn as_str(self) -> &'static str {
        match self {
            Model::Mlp => "mlp",
            Model::MlpCandleOps => "mlp-candle-ops",
            Model::MlpWide => "mlp-wide",
            Model::Conv => "conv",
        }
    }
}

impl fmt::Display for Model {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Where the replicas or ranks run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DeviceKind {
    /// CPU replicas (the cores split between them).
    Cpu,
    /// GPU 0 (a build with `--features cuda`).
    Cuda,
}

/// One configuration, as passed to a child process.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Spec {
    pub kind: Kind,
    pub model: Model,
    /// Global batch (per step, all replicas together).
    pub batch: usize,
    pub replicas: usize,
    /// Threads for a single-device run (1 = one core).
    pub threads: usize,
    pub warmup: usize,
    pub steps: usize,
    /// cpu, or cuda: GPU 0 (DataParallel's replicas share its stream, DDP's
    /// ranks have a stream each, and so do ddp-nccl's, through
    /// `run_on_gpus`).
    pub device: DeviceKind,
}

impl Spec {
    /// The device of replica (or rank) `i`.
    pub fn device(&self, i: usize) -> candle_core::Result<Device> {
        match (self.device, i) {
            (DeviceKind::Cuda, 0) if self.kind == Kind::Single => Device::new_cuda(0),
            (DeviceKind::Cuda, _) => Device::new_cuda_with_stream(0),
            (DeviceKind::Cpu, _) => Ok(Device::Cpu),
        }
    }

    pub fn sync(&self, devices: &[Device]) -> candle_core::Result<()> {
        devices.iter().try_for_each(|d| d.synchronize())
    }

    pub fn label(&self) -> String {
        match self.kind {
            Kind::Single => format!("single, {} thread(s)", self.threads),
            kind => format!("{kind} x{}", self.replicas),
        }
    }
}

pub fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Every configuration of a run, in table order.
pub fn specs(quick: bool, steps: usize, device: DeviceKind, candle_ops: bool) -> Vec<Spec> {
    // On a GPU the reference MLP is launch-bound (tens of microseconds of
    // math per step): the wide MLP and the conv net at a large batch are the
    // compute-bound configurations where the engine's overhead shows.
    let plan: &[(Model, &[usize])] = match (device, quick) {
        (DeviceKind::Cpu, true) => &[(Model::Mlp, &[256])],
        (DeviceKind::Cpu, false) => &[
            (Model::Mlp, &[64, 256, 1024]),
            (Model::Conv, &[64, 256, 1024]),
        ],
        (DeviceKind::Cuda, true) => &[(Model::MlpWide, &[8192])],
        (DeviceKind::Cuda, false) => &[
            (Model::Mlp, &[256]),
            (Model::MlpWide, &[8192]),
            (Model::Conv, &[8192]),
        ],
    };
    let replicas: &[usize] = match (device, quick) {
        (_, true) => &[2],
        (DeviceKind::Cpu, false) => &[1, 2, 4],
        (DeviceKind::Cuda, false) => &[1, 2],
    };
    // The MLP through candle's ops beside it, at the same batches.
    let with_candle_ops: Vec<(Model, &[usize])> = plan
        .iter()
        .flat_map(|&(model, batches)| {
            let twin =
                (candle_ops && model == Model::Mlp).then_some((Model::MlpCandleOps, batches));
            std::iter::once((model, batches)).chain(twin)
        })
        .collect();
    let plan = &with_candle_ops[..];
    let warmup = if quick { 3 } else { 5 };
    let mut out = Vec::new();
    for &(model, batches) in plan {
        for &batch in batches {
            let spec = |kind: Kind, batch: usize, replicas: usize, threads: usize| Spec {
                kind,
                model,
                batch,
                replicas,
                threads,
                warmup,
                steps,
                device,
            };
            out.push(spec(Kind::Single, batch, 1, cores()));
            if device == DeviceKind::Cpu {
                out.push(spec(Kind::Single, batch, 1, 1));
                out.push(spec(Kind::Single, batch / 2, 1, 1)); // per-replica baseline for 2 replicas
            }
            for &r in replicas {
                for kind in Kind::PARALLEL {
                    if r == 4 && kind != Kind::DpFast && kind != Kind::Ddp {
                        continue;
                    }
                    // Processes need the feature, and MPI on this machine.
                    if kind == Kind::DdpMpi
                        && (!cfg!(feature = "mpi") || device != DeviceKind::Cpu || r == 1)
                    {
                        continue;
                    }
                    // NCCL needs the feature and a GPU.
                    if kind == Kind::DdpNccl
                        && (!cfg!(feature = "nccl") || device != DeviceKind::Cuda)
                    {
                        continue;
                    }
                    out.push(spec(kind, batch, r, 0));
                }
            }
        }
    }
    out
}
