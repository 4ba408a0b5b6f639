//! # candle-dp
//!
//! PyTorch-style parallel training for [candle](https://github.com/huggingface/candle):
//! data parallelism in one process or across processes and machines,
//! sharded optimizer state, gradients and parameters, pipelines, mixed
//! precision, and whole-run checkpoints that resume to the same bytes.
//!
//! | strategy | PyTorch's | type | module | manual page |
//! |---|---|---|---|---|
//! | replicas in one process | `nn.DataParallel` | [`DataParallel`] | [`data_parallel`](DataParallel) | `docs/data-parallel.md` |
//! | one model per rank (threads, `mpirun`, NCCL) | `DistributedDataParallel` | [`DistributedDataParallel`] ([`DdpConfig`], [`DdpBuilder`]) | [`ddp`](DistributedDataParallel) | `docs/ddp.md`, `docs/mpi.md` |
//! | DDP reducing during the backward (a model as [`units::Units`]) | DDP's reducer hooks | [`DistributedDataParallel::from_units`] | [`units`] | `docs/ddp.md` |
//! | sharded optimizer state (stage 1) and gradients (stage 2) | `ZeroRedundancyOptimizer`, DeepSpeed ZeRO | [`ZeroOptimizer`] over a DDP built with [`DdpBuilder::zero`] | [`zero`] | `docs/zero.md` |
//! | sharded parameters too | FSDP2's `fully_shard` | [`FullyShardedDataParallel`] ([`FsdpConfig`]) | [`fsdp`] | `docs/fsdp.md` |
//! | stages across devices (GPipe, 1F1B, interleaved) | `torch.distributed.pipelining` | [`Pipeline`] | [`pipeline`] | `docs/pipelines.md` |
//! | bf16 / f16 compute over f32 masters | `autocast`, `GradScaler`, `MixedPrecisionPolicy` | [`MixedPrecision`] | [`precision`], [`optim`] | `docs/mixed-precision.md` |
//!
//! **One loop for every strategy.** [`fabric`] is the front door, as
//! Lightning Fabric and Accelerate are to PyTorch: a [`Fabric`] names the
//! strategy by a string (`single`, `dp`, `ddp`, `ddp-overlap`, `zero1`,
//! `zero2`, `fsdp`, `pipeline`, `pipeline-ddp`), launches the ranks, sets up
//! the model, optimizer and data for it, and the loop (`backward`, `step`)
//! stays the same for all of them (`docs/fabric.md`).
//!
//! Around them: [`launch`] runs one function on every rank (thread ranks,
//! or the processes of `mpirun`/`srun`), [`comm`] holds the collectives,
//! [`sampler`] and [`loader`] give each rank its share of the data
//! (`DistributedSampler`'s order), [`optim`] has SGD, Adam and AdamW with
//! saveable state, schedules, clipping and the loss scaler, and
//! [`training_state`] and [`checkpoint`] save a run. The crate root names
//! each strategy's entry type and settings and what every loop touches
//! ([`Step`], [`Error`]); the rest lives in its module.
//!
//! [`DataParallel`] keeps the master model on `devices[0]`, splits every
//! mini-batch along a dimension across one replica per device, runs the
//! replicas on their own persistent threads, gathers the outputs and
//! reduces the gradients back onto the master: `torch.nn.DataParallel`'s
//! semantics, for any candle model built from a `VarBuilder`.
//!
//! Several `Device::Cpu` entries are several replicas, so everything runs
//! (and is tested) without a GPU.
//!
//! ```
//! use candle_core::{DType, Device, Module, Tensor};
//! use candle_nn::{linear, loss, Linear, Optimizer, VarBuilder, VarMap, SGD};
//! use candle_dp::{cpu_devices, DataParallel};
//!
//! // The user's own model code, unchanged.
//! struct Mlp { l1: Linear, l2: Linear }
//! impl Mlp {
//!     fn new(vb: VarBuilder) -> candle_core::Result<Self> {
//!         Ok(Self { l1: linear(8, 16, vb.pp("l1"))?, l2: linear(16, 4, vb.pp("l2"))? })
//!     }
//! }
//! impl Module for Mlp {
//!     fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
//!         self.l2.forward(&self.l1.forward(x)?.relu()?)
//!     }
//! }
//!
//! # fn main() -> anyhow::Result<()> {
//! let varmap = VarMap::new();
//! let dp = DataParallel::new(&varmap, DType::F32, &cpu_devices(2), Mlp::new)?;
//! let mut opt = SGD::new(varmap.all_vars(), 0.05)?; // any candle optimizer
//!
//! let x = Tensor::randn(0f32, 1., (32, 8), &Device::Cpu)?;
//! let y = Tensor::from_vec((0..32u32).map(|i| i % 4).collect(), 32, &Device::Cpu)?;
//! for _ in 0..5 {
//!     let logits = dp.forward(&x)?;                 // scatter -> replicas -> gather
//!     let loss = loss::cross_entropy(&logits, &y)?;
//!     opt.backward_step(&loss)?;                    // full-batch gradient on the master
//! }
//! # Ok(())
//! # }
//! ```
//!
//! See [`DataParallel`] for the parallel backward paths
//! ([`DataParallel::forward_backward`], [`DataParallel::backward_from_loss`])
//! and [`checkpoint`] for saving and loading with or without the `module.`
//! prefix.
//!
//! [`DistributedDataParallel`] runs one model per rank on any
//! [`comm::ProcessGroup`]: thread ranks of this process, or (feature `mpi`)
//! the processes of an MPI job on one machine or many. [`launch::run`] picks
//! between them from the environment, so one program runs both ways, and
//! [`seeded_varmap`] gives every rank and every run the same initial weights.
//!
//! [`Pipeline`] splits a model into stages across devices and pipelines
//! micro-batches through them (GPipe, 1F1B, interleaved 1F1B): model
//! parallelism for models too large for one device.
//!
//! [`optim`] has SGD, Adam and AdamW with PyTorch's formulas and a state
//! that can be saved, and [`training_state`] saves a whole run (weights,
//! optimizer, schedule, loss scale, progress, sampler) atomically, so that
//! a killed job resumes to the same bytes, with any of the above.
//!
//! **CPU threads.** Several CPU replicas or thread ranks share the cores by
//! themselves: each gets its own rayon pool of `cores / workers` threads,
//! and candle's process-wide elementwise pool is left empty
//! (`CANDLE_NUM_THREADS=1`, unless set) so they do not take turns on it.
//! Under `mpirun`, each process takes its share of the machine's cores.
//!
//! **The manual.** The repository's `docs/` folder has a page per topic
//! (getting started, DataParallel, DDP, MPI and several machines,
//! checkpoints, GPUs, pipelines, performance, guarantees and limitations,
//! architecture); its `README.md` is the front page.
//!
//! **Features.** `avx512` (default): `gemm`'s AVX-512 matmul kernels, chosen
//! at run time only on CPUs that have AVX-512F. `mpi`: `MpiGroup`. `cuda`:
//! candle's CUDA backend. `mimalloc`: the allocator of the examples.

#![deny(missing_docs)]

mod buffers;
pub mod comm;
mod cpu_threads;
mod cuda_setup;
mod cuda_stream;
mod data_parallel;
mod ddp;
pub mod deterministic;
mod device_copy;
mod error;
pub mod fabric;
pub mod fsdp;
pub mod launch;
pub mod loader;
mod no_grad;
pub mod ops;
pub mod optim;
pub mod pipeline;
pub mod precision;
mod process_env;
mod replicate;
mod report_lines;
mod same_model;
pub mod sampler;
mod saving;
mod seeded_init;
mod sharding;
mod step;
pub mod tensor_parallel;
pub mod units;
mod util;
mod worker_pool;
pub mod zero;

pub use buffers::{is_batch_norm_buffer, BufferPredicate};
pub use data_parallel::reduce;
pub use data_parallel::scatter_gather::{
    chunk_sizes, gather, scatter, Gather, Replicated, Scatter, ScatterPlan, Split,
};
pub use data_parallel::{DataParallel, DataParallelBuilder, StepTimings};
pub use ddp::{
    Activity, CommHook, DdpBuilder, DdpConfig, DdpTimings, DistributedDataParallel, JoinDivisor,
    Span,
};
pub use error::{Error, Result};
pub use fabric::{Fabric, FabricConfig};
pub use fsdp::{FsdpConfig, FullyShardedDataParallel};
pub use pipeline::{Pipeline, Schedule};
pub use precision::MixedPrecision;
pub use step::{LossReduction, Step};
pub use util::device_label::device_label;
pub use zero::{ZeroOptimizer, ZeroStage};

pub use saving::{checkpoint, training_state};
pub use seeded_init::seeded_varmap;

use candle_core::Device;

/// `n` CPU devices: `n` replicas on the CPU, with the cores split between them.
///
/// ```
/// assert_eq!(candle_dp::cpu_devices(3).len(), 3);
/// ```
pub fn cpu_devices(n: usize) -> Vec<Device> {
    vec![Device::Cpu; n]
}
