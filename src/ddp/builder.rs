//! [`DdpBuilder`]: configures a [`DistributedDataParallel`] one setting at a
//! time, in the style of [`DataParallel::builder`](crate::DataParallel::builder).

use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;

use candle_core::{DType, Device};
use candle_nn::{VarBuilder, VarMap};

use super::{CommHook, DdpConfig, DistributedDataParallel, JoinDivisor, ZeroStage};
use crate::comm::{DeviceMesh, ProcessGroup, ShardGroups};
use crate::error::Result;
use crate::precision::MixedPrecision;
use crate::units::{UnitFactory, Units};

impl<M> DistributedDataParallel<M> {
    /// Starts configuring this rank's [`DistributedDataParallel`] (buckets,
    /// buffers, communication hook, join divisor); every setting not given
    /// keeps its [`DdpConfig::default`] value.
    pub fn builder(
        pg: Arc<dyn ProcessGroup>,
        varmap: &VarMap,
        dtype: DType,
        device: &Device,
    ) -> DdpBuilder<M> {
        DdpBuilder {
            model: PhantomData,
            pg,
            varmap: varmap.clone(),
            dtype,
            device: device.clone(),
            config: DdpConfig::default(),
        }
    }
}

/// Configures a [`DistributedDataParallel`]; made by
/// [`DistributedDataParallel::builder`], one setter per [`DdpConfig`] field.
///
/// ```
/// use candle_core::{DType, Device};
/// use candle_nn::{linear, VarMap};
/// use candle_dp::{launch::spawn, CommHook, DistributedDataParallel};
///
/// spawn(2, |ctx| {
///     let varmap = VarMap::new();
///     let ddp = DistributedDataParallel::builder(ctx.process_group(), &varmap, DType::F32, &Device::Cpu)
///         .bucket_cap_bytes(4 << 20)
///         .comm_hook(CommHook::Bf16Compress)
///         .broadcast_buffers(false)
///         .build(|vb| linear(4, 2, vb))?;
///     assert_eq!(ddp.params().len(), 2); // weight and bias
///     Ok(())
/// })?;
/// # Ok::<(), anyhow::Error>(())
/// ```
pub struct DdpBuilder<M> {
    model: PhantomData<fn() -> M>,
    pg: Arc<dyn ProcessGroup>,
    varmap: VarMap,
    dtype: DType,
    device: Device,
    config: DdpConfig,
}

impl<M> DdpBuilder<M> {
    /// Largest bucket, in bytes (default 25 MiB).
    pub fn bucket_cap_bytes(mut self, bytes: usize) -> Self {
        self.config.bucket_cap_bytes = bytes;
        self
    }

    /// Largest first bucket, in bytes (default 1 MiB).
    pub fn first_bucket_cap_bytes(mut self, bytes: usize) -> Self {
        self.config.first_bucket_cap_bytes = bytes;
        self
    }

    /// Broadcast buffers from rank 0 before every forward (default on).
    pub fn broadcast_buffers(mut self, broadcast: bool) -> Self {
        self.config.broadcast_buffers = broadcast;
        self
    }

    /// Shards the optimizer state (stage 1) and the gradients (stage 2)
    /// across the ranks: build the optimizer as a
    /// [`ZeroOptimizer`](crate::zero::ZeroOptimizer). See [`crate::zero`].
    pub fn zero(mut self, stage: ZeroStage) -> Self {
        self.config.zero = Some(stage);
        self
    }

    /// ZeRO on a mesh: the pieces split along the mesh's shard dimension
    /// (within a machine) and replicated along its replicate dimension
    /// (across machines), as HSDP shards FSDP. At stage 2 each bucket is
    /// reduce-scattered within the shard group, then each piece averaged
    /// across the replicas; at both stages the updated pieces are
    /// all-gathered within the shard group only. A mesh of one dimension
    /// is plain ZeRO over it. The builder's group must be the mesh's whole
    /// group (checked at build).
    ///
    /// ```
    /// use candle_core::{DType, Device};
    /// use candle_dp::comm::DeviceMesh;
    /// use candle_dp::optim::{AdamW, AdamWConfig};
    /// use candle_dp::zero::{ZeroOptimizer, ZeroStage};
    /// use candle_dp::{launch::spawn, DistributedDataParallel};
    /// use candle_nn::{linear, VarMap};
    ///
    /// spawn(4, |ctx| {
    ///     let mesh = DeviceMesh::new(ctx.process_group(), &[("replicate", 2), ("shard", 2)])?;
    ///     let varmap = VarMap::new();
    ///     let ddp = DistributedDataParallel::builder(mesh.world().clone(), &varmap, DType::F32, &Device::Cpu)
    ///         .zero_on_mesh(ZeroStage::Two, &mesh)?
    ///         .build(|vb| linear(4, 6, vb))?;
    ///     let opt = ZeroOptimizer::new(&ddp, |mine| AdamW::new_named(mine, AdamWConfig::default()))?;
    ///     // Half of the weight's 6 rows: split over the 2 ranks of a shard group.
    ///     assert_eq!(opt.shard_vars()[1].1.dims(), [3, 4]);
    ///     Ok(())
    /// })?;
    /// # Ok::<(), anyhow::Error>(())
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::Mesh`](crate::Error::Mesh) for a mesh of more than two
    /// dimensions.
    pub fn zero_on_mesh(mut self, stage: ZeroStage, mesh: &DeviceMesh) -> Result<Self> {
        self.config.zero = Some(stage);
        self.config.zero_groups = Some(ShardGroups::from_mesh(mesh)?);
        Ok(self)
    }

    /// How buckets are reduced (default [`CommHook::Average`]).
    pub fn comm_hook(mut self, hook: CommHook) -> Self {
        self.config.comm_hook = hook;
        self
    }

    /// What to divide by while ranks have joined (default
    /// [`JoinDivisor::InitialWorldSize`]).
    pub fn join_divisor(mut self, divisor: JoinDivisor) -> Self {
        self.config.join_divisor = divisor;
        self
    }

    /// Which variables are buffers, broadcast instead of reduced (default:
    /// [`is_batch_norm_buffer`](crate::is_batch_norm_buffer), candle-nn's
    /// BatchNorm statistics). The same setting as
    /// [`DataParallelBuilder::buffers`](crate::DataParallelBuilder::buffers).
    pub fn buffers(mut self, is_buffer: impl Fn(&str) -> bool + Send + Sync + 'static) -> Self {
        self.config.is_buffer = Arc::new(is_buffer);
        self
    }

    /// Mixed precision (see [`crate::precision`]): the master variables in
    /// the builder's dtype (f32), the model computing on copies in
    /// `policy.param_dtype`, the buckets reduced in `policy.reduce_dtype`,
    /// the gradients handed to the optimizer in the masters' dtype.
    pub fn mixed_precision(mut self, policy: MixedPrecision) -> Self {
        self.config.mixed_precision = Some(policy);
        self
    }

    /// The order in which parameters fill the gradient buckets, by name:
    /// see [`DdpConfig::bucket_order`].
    pub fn bucket_order<S: Into<String>>(mut self, names: impl IntoIterator<Item = S>) -> Self {
        self.config.bucket_order = Some(names.into_iter().map(Into::into).collect());
        self
    }

    /// The settings so far.
    pub fn config(&self) -> &DdpConfig {
        &self.config
    }

    /// Builds this rank's model with these settings: see
    /// [`DistributedDataParallel::new`]. Every rank must call it.
    pub fn build<F>(self, factory: F) -> Result<DistributedDataParallel<M>>
    where
        F: FnOnce(VarBuilder) -> candle_core::Result<M>,
    {
        DistributedDataParallel::new(
            self.pg,
            &self.varmap,
            self.dtype,
            &self.device,
            factory,
            self.config,
        )
    }
}

impl DdpBuilder<Units> {
    /// Builds this rank's model from `units` with these settings: see
    /// [`DistributedDataParallel::from_units`]. Every rank must call it.
    pub fn build_units(self, units: Vec<UnitFactory>) -> Result<DistributedDataParallel<Units>> {
        DistributedDataParallel::from_units(
            self.pg,
            &self.varmap,
            self.dtype,
            &self.device,
            units,
            self.config,
        )
    }
}

impl<M> fmt::Debug for DdpBuilder<M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DdpBuilder")
            .field("rank", &self.pg.rank())
            .field("world_size", &self.pg.world_size())
            .field("dtype", &self.dtype)
            .field("device", &self.device)
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}
