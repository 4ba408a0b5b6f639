//! [`run_on_gpus`]: [`run`](super::run) with one GPU per rank and an
//! [`NcclGroup`] as every rank's group (feature `nccl`).

use std::sync::Arc;

use candle_core::cuda_backend::cudarc::driver::CudaContext;
use candle_core::Device;

use super::{run, Backend, LaunchError, RankContext};
use crate::comm::{GroupOptions, NcclGroup, ProcessGroup};

/// [`run`](super::run) on GPUs: each rank gets its GPU, as a device with a
/// stream of its own, and an [`NcclGroup`] over its host group (a thread
/// rank, or the `MpiGroup` under `mpirun`) as `ctx.pg`, so that
/// [`DistributedDataParallel`](crate::DistributedDataParallel) reduces on
/// the GPUs.
///
/// A rank's GPU is its local rank (under `mpirun`, the process's index on
/// its machine, [`Backend::local_rank`]; for thread ranks, the rank) modulo
/// the machine's GPUs. Several ranks on one GPU need NCCL 2.30 or later and
/// `NCCL_MULTI_RANK_GPU_ENABLE=1`.
///
/// ```no_run
/// use candle_core::Tensor;
/// use candle_dp::comm::{GroupOptions, ReduceOp};
/// use candle_dp::launch::run_on_gpus;
///
/// // `cargo run`: 2 thread ranks; `mpirun -np 8 prog` on two machines of
/// // four GPUs: one process per GPU.
/// let sums = run_on_gpus(2, GroupOptions::default(), |ctx, gpu| {
///     let x = Tensor::new(&[1f32], &gpu)?;
///     Ok(ctx.pg.all_reduce(&x, ReduceOp::Sum)?.to_vec1::<f32>()?)
/// })?;
/// # Ok::<(), candle_dp::launch::LaunchError>(())
/// ```
pub fn run_on_gpus<T, F>(threads: usize, options: GroupOptions, f: F) -> Result<Vec<T>, LaunchError>
where
    T: Send,
    F: Fn(RankContext, Device) -> anyhow::Result<T> + Sync,
{
    run(threads, options, |ctx| {
        let local = match Backend::from_env() {
            Backend::Threads => ctx.rank,
            Backend::Mpi { .. } => Backend::local_rank(),
        };
        let gpus = CudaContext::device_count()
            .map_err(|e| anyhow::anyhow!("cannot count the GPUs: {e:?}"))?;
        if gpus < 1 {
            anyhow::bail!("rank {} found no GPU", ctx.rank);
        }
        let device = Device::new_cuda_with_stream(local % gpus as usize)?;
        let pg: Arc<dyn ProcessGroup> = Arc::new(NcclGroup::new(ctx.process_group(), &device)?);
        f(RankContext { pg, ..ctx }, device)
    })
}
