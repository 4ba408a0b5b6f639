//! Hybrid sharding (HSDP) across the replicas of a [`RankPipeline`]'s
//! stages ([`RankPipelineConfig::shard_size`]): the pieces split within
//! shard groups of consecutive replicas (a mesh's `dp_shard`) and held
//! alike by the groups (its `dp_replicate`), as FSDP2's HSDP does for a
//! whole model. The replicas still average the data's gradients over all
//! of them; only the pieces' group changes.

use super::on_ranks::{HybridReplicas, RankPipeline, RankPipelineConfig};
use crate::comm::{Color, SubGroup};
use crate::error::{Error, Result};

impl HybridReplicas {
    /// With [`RankPipelineConfig::shard_size`], `replicas` split into shard
    /// groups of that many consecutive replicas and the groups across them
    /// (every replica calls it); `None` without it.
    pub(super) fn split(replicas: &SubGroup, config: &RankPipelineConfig) -> Result<Option<Self>> {
        let Some(size) = config.shard_size else {
            return Ok(None);
        };
        let n = replicas.world_size();
        if !config.fsdp {
            return Err(Error::Zero(format!(
                "shard_size {size} splits FSDP's pieces within groups of replicas: set \
             RankPipelineConfig::fsdp too"
            )));
        }
        if size == 0 || !n.is_multiple_of(size) {
            return Err(Error::Zero(format!(
                "{n} replicas of each stage do not split into shard groups of {size}: give a \
             shard_size that divides them"
            )));
        }
        let r = replicas.rank();
        let split = |color: usize, key: usize| -> Result<SubGroup> {
            replicas
                .split(Color::new(color as u32), key as i64)?
                .ok_or_else(|| Error::Zero("a coloured split gave this replica no group".into()))
        };
        Ok(Some(Self {
            shard: split(r / size, r % size)?,
            replicate: split(r % size, r / size)?,
        }))
    }
}

impl RankPipeline {
    /// The replicas this rank's pieces are split over (with ZeRO or FSDP):
    /// its shard group with hybrid sharding, else every replica.
    pub(super) fn piece_group(&self) -> Option<&SubGroup> {
        match &self.hybrid {
            Some(hybrid) => Some(&hybrid.shard),
            None => self.replicas.as_ref(),
        }
    }

    /// Which piece this rank holds: its rank in [`piece_group`](Self::piece_group).
    pub(super) fn piece_rank(&self) -> usize {
        self.piece_group().map_or(0, |g| g.rank())
    }

    /// With hybrid sharding, which copy of the pieces this rank's shard
    /// group holds; 0 otherwise.
    pub(super) fn replicate_rank(&self) -> usize {
        self.hybrid.as_ref().map_or(0, |h| h.replicate.rank())
    }
}
