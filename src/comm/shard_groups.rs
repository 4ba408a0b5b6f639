//! [`ShardGroups`]: the groups sharded training (ZeRO, FSDP) works over.
//! On one group every rank holds its own pieces; on a 2-D mesh (hybrid
//! sharding, FSDP2's HSDP) the pieces split along the mesh's shard
//! dimension (within a machine) and are replicated along its replicate
//! dimension (across machines): a gradient is reduce-scattered within the
//! shard group, then each piece averaged across the replicas.

use std::fmt;
use std::sync::Arc;

use candle_core::{Device, Tensor};

use super::{CommError, DeviceMesh, MeshError, ProcessGroup, ReduceOp};

/// Which ranks split a model's pieces among them, and which hold the same
/// pieces. Made from a group ([`flat`](Self::flat)) or a mesh
/// ([`from_mesh`](Self::from_mesh)).
///
/// ```
/// use candle_dp::comm::{DeviceMesh, ShardGroups};
/// use candle_dp::launch::spawn;
///
/// let seen = spawn(4, |ctx| {
///     let mesh = DeviceMesh::new(ctx.process_group(), &[("replicate", 2), ("shard", 2)])?;
///     let groups = ShardGroups::from_mesh(&mesh)?;
///     Ok((groups.shard().world_size(), groups.replica_rank()))
/// })?;
/// // Ranks 0, 1 are the first replica's two pieces; ranks 2, 3 the second's.
/// assert_eq!(seen, [(2, 0), (2, 0), (2, 1), (2, 1)]);
/// # Ok::<(), anyhow::Error>(())
/// ```
#[derive(Clone)]
pub struct ShardGroups {
    world: Arc<dyn ProcessGroup>,
    shard: Arc<dyn ProcessGroup>,
    replicate: Option<Arc<dyn ProcessGroup>>,
}

impl ShardGroups {
    /// Every rank of `pg` holds its own pieces.
    pub fn flat(pg: Arc<dyn ProcessGroup>) -> Self {
        Self {
            world: Arc::clone(&pg),
            shard: pg,
            replicate: None,
        }
    }

    /// Pieces split over `shard` (a group of `world`'s ranks) and, with
    /// `replicate`, held alike by its ranks: the groups of a pipeline's
    /// replicas, which no mesh of their own lays out.
    pub(crate) fn of(
        world: Arc<dyn ProcessGroup>,
        shard: Arc<dyn ProcessGroup>,
        replicate: Option<Arc<dyn ProcessGroup>>,
    ) -> Self {
        Self {
            world,
            shard,
            replicate,
        }
    }

    /// A mesh of one dimension shards over its group; a mesh of two,
    /// `(replicate, shard)` in that order (outermost first, as FSDP2's
    /// HSDP mesh), shards along `shard` and replicates along `replicate`.
    ///
    /// # Errors
    ///
    /// [`MeshError::Dims`] for a mesh of more than two dimensions.
    pub fn from_mesh(mesh: &DeviceMesh) -> Result<Self, MeshError> {
        let names = mesh.dim_names();
        let (shard, replicate) = match names {
            [shard] => (shard, None),
            [replicate, shard] => (shard, Some(Arc::clone(mesh.group(replicate)?))),
            _ => {
                return Err(MeshError::Dims {
                    expected: "sharding takes a mesh of one dimension (shard) or two \
                               (replicate, shard)"
                        .into(),
                    names: names.to_vec(),
                })
            }
        };
        Ok(Self {
            world: Arc::clone(mesh.world()),
            shard: Arc::clone(mesh.group(shard)?),
            replicate,
        })
    }

    /// Every rank of the job (the mesh's whole group).
    pub fn world(&self) -> &Arc<dyn ProcessGroup> {
        &self.world
    }

    /// The ranks this rank's pieces are split over.
    pub fn shard(&self) -> &Arc<dyn ProcessGroup> {
        &self.shard
    }

    /// The ranks holding the same pieces as this one (one per shard
    /// group), on a mesh of two dimensions.
    pub fn replicate(&self) -> Option<&Arc<dyn ProcessGroup>> {
        self.replicate.as_ref()
    }

    /// Which replica this rank's shard group is (its rank in the replicate
    /// group); 0 without replicas.
    pub fn replica_rank(&self) -> usize {
        self.replicate.as_ref().map_or(0, |g| g.rank())
    }

    /// Reduces `table` (every shard rank's section in turn, `section`
    /// elements each) with `op` to this rank's section: a reduce-scatter
    /// within the shard group, then, with replicas, an all-reduce of the
    /// section across them, so that each section is reduced over every
    /// rank of the job (an average of averages over groups of one size is
    /// the average).
    pub(crate) fn reduce_scatter(
        &self,
        table: &Tensor,
        op: ReduceOp,
        section: usize,
    ) -> Result<Tensor, CommError> {
        let world = self.shard.world_size();
        let piece = self
            .shard
            .reduce_scatter(table, op, &vec![section; world])?;
        match &self.replicate {
            Some(replicas) => replicas.all_reduce(&piece, op),
            None => Ok(piece),
        }
    }

    /// The presence flags of `grads` (1 where this rank has a gradient)
    /// summed across the replicas, where a shard group of one rank would
    /// read its own flags alone (the reduce-scatter sums them only within
    /// the shard group); `None` elsewhere (the flags ride in the reduced
    /// table). So all replicas keep the same pieces.
    pub(crate) fn presence_across_replicas(
        &self,
        grads: &[Option<Tensor>],
    ) -> Result<Option<Vec<f64>>, CommError> {
        let Some(replicas) = self
            .replicate
            .as_ref()
            .filter(|_| self.shard.world_size() == 1)
        else {
            return Ok(None);
        };
        let mine: Vec<f64> = grads
            .iter()
            .map(|g| f64::from(u8::from(g.is_some())))
            .collect();
        let tensor_error = |source| CommError::Tensor {
            rank: self.world.rank(),
            op: "presence flags",
            source,
        };
        let flags = Tensor::new(mine, &Device::Cpu).map_err(tensor_error)?;
        let summed = replicas.all_reduce(&flags, ReduceOp::Sum)?;
        summed.to_vec1::<f64>().map(Some).map_err(tensor_error)
    }
}

impl fmt::Debug for ShardGroups {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ShardGroups")
            .field("rank", &self.world.rank())
            .field("world_size", &self.world.world_size())
            .field("shard_rank", &self.shard.rank())
            .field("shard_size", &self.shard.world_size())
            .field("replicas", &self.replicate.as_ref().map(|g| g.world_size()))
            .finish()
    }
}
