//! DDP's gradient buckets: which parameters travel together, and one
//! bucket's reduction (pack, all-reduce through the communication hook,
//! unpack), shared by the reduction after the backward and the one
//! overlapped with it.

use candle_core::{DType, Device, Tensor, Var};

use crate::comm::{ProcessGroup, ReduceOp};
use crate::error::Result;
use crate::zero::{Partition, ZeroStage};

/// How a bucket of gradients travels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CommHook {
    /// The average in the gradients' dtype (PyTorch's default
    /// `allreduce_hook`; here the division happens once, after the sum).
    #[default]
    Average,
    /// Cast to f16, divide, all-reduce, cast back (`fp16_compress_hook`).
    Fp16Compress,
    /// Cast to bf16, divide, all-reduce, cast back (`bf16_compress_hook`).
    Bf16Compress,
}

/// Parameters (of one dtype and device) reduced in one collective.
#[derive(Debug, Clone)]
pub(crate) struct Bucket {
    /// Indices into the DDP's parameters, in the bucket's order.
    pub(crate) params: Vec<usize>,
    pub(crate) dtype: DType,
}

/// Groups the parameters, taken in `order` (indices into `params`), into
/// buckets of at most the cap, each of one reduce dtype and device (a
/// parameter larger than the cap gets a bucket of its own).
pub(crate) fn make_buckets(
    params: &[(String, Var)],
    order: &[usize],
    first_cap: usize,
    cap: usize,
    reduce_dtype: impl Fn(&str, &Var) -> DType,
) -> Vec<Bucket> {
    let mut buckets: Vec<Bucket> = Vec::new();
    let mut bytes = 0;
    for &i in order {
        let (name, var) = &params[i];
        let dtype = reduce_dtype(name, var);
        let size = var.elem_count() * dtype.size_in_bytes();
        let limit = if buckets.len() <= 1 { first_cap } else { cap };
        match buckets.last_mut() {
            Some(b)
                if b.dtype == dtype
                    && params[b.params[0]].1.device().same_device(var.device())
                    && bytes + size <= limit =>
            {
                b.params.push(i);
                bytes += size;
            }
            _ => {
                buckets.push(Bucket {
                    params: vec![i],
                    dtype,
                });
                bytes = size;
            }
        }
    }
    buckets
}

/// One bucket, reduced: the averaged gradients this rank keeps, and the
/// parameters whose gradient it reduced but does not keep (at ZeRO stage
/// 2, the other ranks' parameters).
#[derive(Debug, Default)]
pub(crate) struct Reduced {
    pub(crate) grads: Vec<(usize, Tensor)>,
    pub(crate) not_kept: Vec<usize>,
}

/// What a bucket's reduction reads of its DDP.
pub(crate) struct BucketReducer<'a> {
    pub(crate) pg: &'a dyn ProcessGroup,
    pub(crate) comm_hook: CommHook,
    /// At stage 2 a rank keeps only its own parameters' gradients.
    pub(crate) zero: Option<ZeroStage>,
    pub(crate) params: &'a [(String, Var)],
    pub(crate) zero_partition: Option<&'a Partition>,
    /// What the sum is divided by (the world size, or the ranks still
    /// training inside a join).
    pub(crate) divisor: f64,
}

impl BucketReducer<'_> {
    /// Averages one bucket across ranks: `grads` has this rank's optional
    /// gradient of each of the bucket's parameters, in its order. A
    /// parameter without a gradient on some rank counts as zero there, and
    /// one without a gradient anywhere gets none: the bucket carries one
    /// presence flag per parameter or, where the group reduces on the
    /// GPUs, `presence` has the flags summed on the host (in the bucket's
    /// order), so that no bucket needs a copy between host and device.
    pub(crate) fn reduce(
        &self,
        bucket: &Bucket,
        grads: &[Option<Tensor>],
        presence: Option<&[f64]>,
    ) -> Result<Reduced> {
        let mut pieces = Vec::with_capacity(bucket.params.len() + 1);
        let mut present = Vec::with_capacity(bucket.params.len());
        for (k, &i) in bucket.params.iter().enumerate() {
            let var = &self.params[i].1;
            let grad = grads.get(k).and_then(Option::as_ref);
            let flat = match grad {
                Some(g) => g.to_dtype(bucket.dtype)?.flatten_all()?,
                None => Tensor::zeros(var.elem_count(), bucket.dtype, var.device())?,
            };
            pieces.push(flat);
            present.push(if grad.is_some() { 1f64 } else { 0. });
        }
        if presence.is_none() {
            let device = self.params[bucket.params[0]].1.device();
            pieces.push(Tensor::new(present, device)?.to_dtype(bucket.dtype)?);
        }
        let reduced = self.reduce_pieces(&pieces, bucket.dtype)?;
        let flags = match presence {
            Some(flags) => flags.to_vec(),
            None => {
                let flags_at = reduced.elem_count() - bucket.params.len();
                reduced
                    .narrow(0, flags_at, bucket.params.len())?
                    .to_dtype(DType::F64)?
                    .to_vec1::<f64>()?
            }
        };
        let mut out = Reduced::default();
        let mut offset = 0;
        for (k, &i) in bucket.params.iter().enumerate() {
            let var = &self.params[i].1;
            let n = var.elem_count();
            if flags[k] > 0.0 && !self.keeps_grad_of(i) {
                out.not_kept.push(i);
            } else if flags[k] > 0.0 {
                let grad = reduced
                    .narrow(0, offset, n)?
                    .reshape(var.shape())?
                    .to_dtype(var.dtype())?;
                // At stage 2, a copy of just these elements: a view would
                // keep the whole reduced bucket alive, other ranks'
                // gradients included (and `copy` would clone the whole
                // bucket).
                let grad = match self.zero {
                    Some(ZeroStage::Two) => grad.force_contiguous()?,
                    _ => grad,
                };
                out.grads.push((i, grad));
            }
            offset += n;
        }
        Ok(out)
    }

    /// Whether this rank keeps parameter `i`'s reduced gradient: always,
    /// but at ZeRO stage 2 only for the parameters it owns.
    fn keeps_grad_of(&self, i: usize) -> bool {
        match (self.zero_partition, self.zero) {
            (Some(partition), Some(ZeroStage::Two)) => partition.owns(self.pg.rank(), i),
            _ => true,
        }
    }

    /// For each of `grads`, on how many ranks it is present: one
    /// all-reduce of a CPU tensor (a device group passes it to its host
    /// group).
    pub(crate) fn presence_on_host(&self, grads: &[Option<Tensor>]) -> Result<Vec<f64>> {
        let mine: Vec<f32> = grads
            .iter()
            .map(|g| if g.is_some() { 1. } else { 0. })
            .collect();
        let mine = Tensor::new(mine, &Device::Cpu)?;
        let all = self.pg.all_reduce(&mine, ReduceOp::Sum)?;
        Ok(all.to_dtype(DType::F64)?.to_vec1::<f64>()?)
    }

    /// One bucket (its pieces of `dtype`, reduced as their concatenation)
    /// through the communication hook.
    fn reduce_pieces(&self, pieces: &[Tensor], dtype: DType) -> Result<Tensor> {
        let wire = match self.comm_hook {
            CommHook::Average => dtype,
            CommHook::Fp16Compress => DType::F16,
            CommHook::Bf16Compress => DType::BF16,
        };
        let world = self.pg.world_size() as f64;
        let reduced = if wire == dtype && self.divisor == world {
            // Divide once, at the end of the reduction, instead of a pass
            // over the whole bucket before it.
            self.pg.all_reduce_concat(pieces, ReduceOp::Avg)?
        } else {
            // Compressed: divide first so the sum cannot overflow f16.
            let scaled = pieces
                .iter()
                .map(|piece| piece.to_dtype(wire)? / self.divisor)
                .collect::<candle_core::Result<Vec<_>>>()?;
            self.pg.all_reduce_concat(&scaled, ReduceOp::Sum)?
        };
        Ok(reduced.to_dtype(dtype)?)
    }
}
