//! The hybrid mesh of HSDP and of ZeRO given a shard size: shard groups
//! within, replicas across.

use std::sync::Arc;

use crate::comm::{DeviceMesh, ProcessGroup};
use crate::error::{Error, Result};
use crate::fabric::Strategy;
use crate::process_env::Backend;

/// `(replicate, shard)` over `pg` for `strategy`: shard groups of
/// `shard_size` ranks (default: the ranks per machine the MPI launcher
/// reports, all ranks on threads).
pub(super) fn hybrid_mesh(
    strategy: Strategy,
    pg: Arc<dyn ProcessGroup>,
    shard_size: Option<usize>,
) -> Result<DeviceMesh> {
    let world = pg.world_size();
    let shard = shard_size.unwrap_or(match Backend::from_env() {
        Backend::Threads => world,
        Backend::Mpi { .. } => Backend::local_processes(),
    });
    if shard == 0 || !world.is_multiple_of(shard) {
        return Err(Error::Strategy {
            strategy: strategy.name().into(),
            reason: format!(
                "{world} ranks do not split into shard groups of {shard}: give a shard_size \
                 that divides the number of ranks"
            ),
        });
    }
    Ok(DeviceMesh::new(
        pg,
        &[("replicate", world / shard), ("shard", shard)],
    )?)
}
