//! The groups a [`RankPipeline`]'s pieces split over, with ZeRO or FSDP
//! across a stage's replicas: every replica (one piece each), or with
//! [`RankPipelineConfig::shard_size`] hybrid sharding (HSDP), shard groups
//! of consecutive replicas (a mesh's `dp_shard`) each holding one copy of
//! the pieces, the groups across them (its `dp_replicate`) holding the
//! same pieces, as FSDP2's HSDP for a whole model. They are the
//! [`ShardGroups`] FSDP and ZeRO work over; the replicas still average the
//! data's gradients over all of them.

use std::sync::Arc;

use super::on_ranks::{RankPipeline, RankPipelineConfig};
use crate::comm::{Color, ProcessGroup, ShardGroups, SubGroup};
use crate::error::{Error, Result};

impl RankPipeline {
    /// The groups `replicas` (a stage's, in the mesh `world`) split the pieces
    /// over with `config` (every replica calls it): `None` without ZeRO.
    pub(super) fn piece_groups(
        world: &Arc<dyn ProcessGroup>,
        replicas: &SubGroup,
        config: &RankPipelineConfig,
    ) -> Result<Option<ShardGroups>> {
        let world = Arc::clone(world);
        let Some(size) = config.shard_size else {
            let flat = ShardGroups::of(world, Arc::clone(replicas), None);
            return Ok((config.zero.is_some() || config.fsdp).then_some(flat));
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
        let shard = split(r / size, r % size)?;
        let replicate = split(r % size, r / size)?;
        Ok(Some(ShardGroups::of(world, shard, Some(replicate))))
    }

    /// The replicas this rank's pieces are split over (with ZeRO or FSDP):
    /// its shard group with hybrid sharding, else every replica.
    pub(super) fn piece_group(&self) -> Option<&Arc<dyn ProcessGroup>> {
        self.pieces.as_ref().map(|g| g.shard())
    }

    /// Which piece this rank holds: its rank in [`piece_group`](Self::piece_group).
    pub(super) fn piece_rank(&self) -> usize {
        self.piece_group().map_or(0, |g| g.rank())
    }

    /// With hybrid sharding, which copy of the pieces this rank's shard
    /// group holds; 0 otherwise.
    pub(super) fn replicate_rank(&self) -> usize {
        self.pieces.as_ref().map_or(0, |g| g.replica_rank())
    }
}
