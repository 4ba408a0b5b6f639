//! Sharded data parallelism (ZeRO, arXiv 1910.02054): the optimizer state
//! (stage 1) and the gradients (stage 2) split across the ranks of a
//! [`DistributedDataParallel`](crate::DistributedDataParallel), each
//! parameter owned by one rank ([`Partition`]).
//!
//! Build the DDP with [`zero`](crate::DdpBuilder::zero), and the optimizer
//! as a [`ZeroOptimizer`] over the parameters this rank owns. A step is
//! DDP's: the gradients are averaged across ranks exactly as DDP averages
//! them (the same buckets, the same reductions); at stage 2 each rank then
//! keeps only its own parameters' gradients, as from a reduce-scatter of
//! each bucket. Each rank's optimizer updates its parameters, and an
//! all-gather into one flat buffer per dtype and device gives every rank
//! all of them. The weights are bitwise DDP's with the same optimizer.
//!
//! | per rank, f32 Adam, Ψ parameter bytes, N ranks | parameters | gradients after a step | optimizer state |
//! |---|---:|---:|---:|
//! | DDP | Ψ | Ψ | 2Ψ |
//! | stage 1 | Ψ | Ψ | about 2Ψ/N |
//! | stage 2 | Ψ | about Ψ/N | about 2Ψ/N |
//!
//! (About: whole parameters are owned, balanced by bytes, as PyTorch's
//! `ZeroRedundancyOptimizer` does.) candle computes every gradient of a
//! backward before DDP reduces them, so during the backward a rank still
//! holds all of them; stage 2 frees the others' once the step's buckets
//! are reduced. The communication is DDP's all-reduce plus the
//! parameters' all-gather.
//!
//! What DDP offers works alike: `no_sync` (gradients accumulate locally,
//! whole, until the synchronised step), communication hooks, buffers.
//! `join` is refused: a joined rank would not take part in the
//! optimizer's all-gather.
//!
//! Checkpoints: each rank saves [`ZeroOptimizer::shard_state`]; a resumed
//! run loads all the shards with [`ZeroOptimizer::load_shards`], on the
//! same or another number of ranks (each keeps the entries of the
//! parameters it owns then).

mod optimizer;
mod partition;

pub use optimizer::{grad_bytes, ZeroOptimizer};
pub use partition::Partition;

/// How much ZeRO shards.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ZeroStage {
    /// The optimizer state.
    One,
    /// The optimizer state and the gradients.
    Two,
}

impl ZeroStage {
    /// The stage from its number (1 or 2), for command lines.
    pub fn from_number(n: u8) -> Option<Self> {
        match n {
            1 => Some(Self::One),
            2 => Some(Self::Two),
            _ => None,
        }
    }
}
