//! Sharded data parallelism (ZeRO, arXiv 1910.02054): the optimizer state
//! (stage 1) and the gradients (stage 2) split across the ranks of a
//! [`DistributedDataParallel`](crate::DistributedDataParallel), each
//! parameter in one piece per rank along dim 0 (FSDP2's split: `torch.chunk`
//! sizes, padded to equal shape), so that even a model with one huge
//! parameter shards evenly.
//!
//! Build the DDP with [`zero`](crate::DdpBuilder::zero), and the optimizer
//! as a [`ZeroOptimizer`] over this rank's pieces. At stage 1 the
//! gradients are averaged as DDP averages them (all-reduced, whole); at
//! stage 2 each bucket is laid out rank by rank and reduce-scattered, so
//! each rank receives only the average of its pieces (half the bytes of an
//! all-reduce on a network). Each rank's optimizer updates its pieces, and
//! an all-gather into one flat buffer per dtype and device gives every
//! rank every whole parameter.
//!
//! | per rank, f32 Adam, Ψ parameter bytes, N ranks | parameters | gradients after a step | optimizer state |
//! |---|---:|---:|---:|
//! | DDP | Ψ | Ψ | 2Ψ |
//! | stage 1 | Ψ + Ψ/N (the pieces) | Ψ | 2Ψ/N |
//! | stage 2 | Ψ + Ψ/N | Ψ/N | 2Ψ/N |
//!
//! (Up to each parameter's padding to a multiple of N rows.) candle
//! computes every gradient of a backward before DDP reduces them, so
//! during the backward a rank still holds all of them; stage 2 frees them
//! bucket by bucket as they are reduce-scattered.
//!
//! What DDP offers works alike: `no_sync` (gradients accumulate locally,
//! whole, until the synchronised step), communication hooks, buffers.
//! `join` is refused: a joined rank would not take part in the
//! optimizer's all-gather.
//!
//! Checkpoints: each rank saves [`ZeroOptimizer::shard_state`]; a resumed
//! run loads all the shards with [`ZeroOptimizer::load_shards`], on the
//! same or another number of ranks (each takes its piece of the state
//! under the new split).

mod optimizer;

pub(crate) use optimizer::ZeroSplit;
pub use optimizer::{grad_bytes, ZeroOptimizer};

/// How much ZeRO shards: a setting of DDP's ([`DdpConfig::zero`](crate::DdpConfig::zero)),
/// named here too.
pub use crate::ddp::ZeroStage;
