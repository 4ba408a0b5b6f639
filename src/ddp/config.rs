//! DDP's settings ([`DdpConfig`], with [`JoinDivisor`] and [`ZeroStage`])
//! and what it measures of a step ([`DdpTimings`]).

use std::sync::Arc;
use std::time::Duration;

use super::timeline::{hidden_fraction, Span};
use super::CommHook;
use crate::buffers::{is_batch_norm_buffer, BufferPredicate};
use crate::comm::ShardGroups;
use crate::precision::MixedPrecision;

/// How much ZeRO shards (see [`crate::zero`]): a setting of DDP's, which
/// shards its gradients at stage 2.
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

/// What to divide the gradient sum by while some ranks have joined.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum JoinDivisor {
    /// The world size at construction: joined ranks count as zero
    /// gradients (PyTorch's `divide_by_initial_world_size=True`).
    #[default]
    InitialWorldSize,
    /// The number of ranks still training this step.
    ActiveRanks,
}

/// Settings of a [`DistributedDataParallel`](super::DistributedDataParallel).
#[derive(Clone)]
pub struct DdpConfig {
    /// Largest bucket, in bytes (default 25 MiB).
    pub bucket_cap_bytes: usize,
    /// Largest first bucket, in bytes (default 1 MiB), so the first
    /// reduction can start early once reduction overlaps backward.
    pub first_bucket_cap_bytes: usize,
    /// Broadcast buffers from rank 0 at construction and before every
    /// forward (default on; inside [`join`](super::DistributedDataParallel::join)
    /// from the highest rank still training). Off, buffers stay rank-local
    /// throughout, as with PyTorch's `broadcast_buffers=False`.
    pub broadcast_buffers: bool,
    /// How buckets are reduced (default [`CommHook::Average`]).
    pub comm_hook: CommHook,
    /// Divisor while ranks have joined (default the initial world size).
    pub join_divisor: JoinDivisor,
    /// Which variables are buffers (default BatchNorm statistics).
    pub is_buffer: BufferPredicate,
    /// Shard the optimizer state (and gradients) across ranks (default
    /// none): see [`crate::zero`].
    pub zero: Option<ZeroStage>,
    /// ZeRO on a 2-D mesh (default none: the pieces split over every
    /// rank): the pieces split over the mesh's shard group and replicated
    /// across its replicas, as HSDP shards FSDP; see
    /// [`DdpBuilder::zero_on_mesh`](super::DdpBuilder::zero_on_mesh). The
    /// groups' whole group must be the DDP's group.
    pub zero_groups: Option<ShardGroups>,
    /// Compute in a low dtype over the master variables, and reduce the
    /// buckets in the policy's reduce dtype (default none): see
    /// [`crate::precision`]. Applies to models built by
    /// [`DistributedDataParallel::new`](super::DistributedDataParallel::new), not to
    /// [`from_module`](super::DistributedDataParallel::from_module).
    pub mixed_precision: Option<MixedPrecision>,
    /// The order in which parameters fill the buckets, by name (default
    /// none: sorted by name, or, for a model given as [`Units`](crate::units::Units), the
    /// reverse of the units' order, so that the buckets fill in the order
    /// the backward finishes their gradients, as PyTorch's reverse
    /// registration order does). Parameters not named follow, sorted.
    /// Naming a variable that is not a parameter is an error at
    /// construction.
    pub bucket_order: Option<Vec<String>>,
}

impl Default for DdpConfig {
    fn default() -> Self {
        Self {
            bucket_cap_bytes: 25 * 1024 * 1024,
            first_bucket_cap_bytes: 1024 * 1024,
            broadcast_buffers: true,
            comm_hook: CommHook::Average,
            join_divisor: JoinDivisor::InitialWorldSize,
            is_buffer: Arc::new(is_batch_norm_buffer),
            zero: None,
            zero_groups: None,
            mixed_precision: None,
            bucket_order: None,
        }
    }
}

impl std::fmt::Debug for DdpConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DdpConfig")
            .field("bucket_cap_bytes", &self.bucket_cap_bytes)
            .field("first_bucket_cap_bytes", &self.first_bucket_cap_bytes)
            .field("broadcast_buffers", &self.broadcast_buffers)
            .field("comm_hook", &self.comm_hook)
            .field("join_divisor", &self.join_divisor)
            .field("zero", &self.zero)
            .field("zero_groups", &self.zero_groups)
            .field("mixed_precision", &self.mixed_precision)
            .field("bucket_order", &self.bucket_order)
            .finish_non_exhaustive()
    }
}

/// Where the time of the latest synchronised backward went.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DdpTimings {
    /// The local backward pass. Around a
    /// [`Pipeline`](crate::pipeline::Pipeline), whose forwards and
    /// backwards interleave, the whole of its
    /// [`forward_backward`](crate::DistributedDataParallel::forward_backward).
    pub backward: Duration,
    /// Packing, all-reducing and unpacking the gradient buckets. With a
    /// model given as [`Units`](crate::units::Units), the time the communication thread spent
    /// on them, most of it while the backward still ran.
    pub all_reduce: Duration,
    /// With a model given as [`Units`](crate::units::Units)
    /// (`forward_backward`):
    /// the step's forward, each unit's backward, each bucket's reduction
    /// and the wait for the last ones, in order of their start; empty
    /// otherwise.
    pub timeline: Vec<Span>,
}

impl DdpTimings {
    /// The share of the reduction time hidden behind the backward (see
    /// [`timeline`](Self::timeline)): 1 when the backward never waited
    /// for a reduction. Without a timeline (a plain module, which reduces
    /// after its backward), 0.
    pub fn hidden_fraction(&self) -> f64 {
        if self.timeline.is_empty() {
            return 0.0;
        }
        hidden_fraction(&self.timeline)
    }
}
