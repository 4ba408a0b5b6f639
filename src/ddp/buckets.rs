//! DDP's gradient buckets: which parameters travel together, and one
//! bucket's reduction (pack, all-reduce through the communication hook,
//! unpack; at ZeRO stage 2, pack rank by rank and reduce-scatter), shared
//! by the reduction after the backward and the one overlapped with it.

use candle_core::{DType, Device, Tensor, Var};

use super::ZeroStage;
use crate::comm::{all_gather_object, ProcessGroup, ReduceOp, ShardGroups};
use crate::error::{Error, Result};
use crate::sharding::{reduce_scatter_grads, ShardLayout};

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

/// One bucket, reduced: the averaged gradients this rank keeps (at ZeRO
/// stage 2, its pieces of them).
#[derive(Debug, Default)]
pub(crate) struct Reduced {
    pub(crate) grads: Vec<(usize, Tensor)>,
}

/// What a bucket's reduction reads of its DDP.
pub(crate) struct BucketReducer<'a> {
    pub(crate) pg: &'a dyn ProcessGroup,
    /// Under ZeRO, the ranks the pieces split over (and their replicas).
    pub(crate) zero_groups: Option<&'a ShardGroups>,
    pub(crate) comm_hook: CommHook,
    /// At stage 2 a rank keeps only its pieces of the gradients.
    pub(crate) zero: Option<ZeroStage>,
    pub(crate) params: &'a [(String, Var)],
    /// Each parameter's split into pieces, under ZeRO.
    pub(crate) layouts: &'a [ShardLayout],
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
        // Alone, a rank knows which gradients are present: no flags travel
        // (on a GPU, none is copied there and read back).
        let alone: Vec<f64>;
        let presence = match presence {
            None if self.pg.world_size() == 1 => {
                alone = local_presence(bucket, grads);
                Some(alone.as_slice())
            }
            other => other,
        };
        if self.zero == Some(ZeroStage::Two) {
            return self.reduce_scatter(bucket, grads, presence);
        }
        let mut pieces = Vec::with_capacity(bucket.params.len() + 1);
        for (k, &i) in bucket.params.iter().enumerate() {
            let var = &self.params[i].1;
            let flat = match grads.get(k).and_then(Option::as_ref) {
                Some(g) => g.to_dtype(bucket.dtype)?.flatten_all()?,
                None => Tensor::zeros(var.elem_count(), bucket.dtype, var.device())?,
            };
            pieces.push(flat);
        }
        if presence.is_none() {
            pieces.push(self.presence_flags(bucket, grads)?);
        }
        let reduced = self.through_hook(&pieces, bucket.dtype, |pieces, op| {
            Ok(self.pg.all_reduce_concat(pieces, op)?)
        })?;
        let flags = self.flags(bucket, &reduced, presence)?;
        let mut out = Reduced::default();
        let mut offset = 0;
        for (k, &i) in bucket.params.iter().enumerate() {
            let var = &self.params[i].1;
            let n = var.elem_count();
            if flags[k] > 0.0 {
                let grad = reduced
                    .narrow(0, offset, n)?
                    .reshape(var.shape())?
                    .to_dtype(var.dtype())?;
                out.grads.push((i, grad));
            }
            offset += n;
        }
        Ok(out)
    }

    /// ZeRO stage 2's reduction of one bucket: laid out rank by rank (each
    /// rank's pieces of the bucket's parameters, then the presence flags,
    /// which every rank thus gets summed), and reduce-scattered, so that
    /// this rank receives the average of its pieces only: half the bytes
    /// of an all-reduce on a network. Each piece's gradient has the
    /// piece's shape.
    fn reduce_scatter(
        &self,
        bucket: &Bucket,
        grads: &[Option<Tensor>],
        presence: Option<&[f64]>,
    ) -> Result<Reduced> {
        let layouts: Vec<&ShardLayout> = bucket.params.iter().map(|&i| &self.layouts[i]).collect();
        let dtypes: Vec<DType> = bucket
            .params
            .iter()
            .map(|&i| self.params[i].1.dtype())
            .collect();
        let grads: Vec<Option<Tensor>> = (0..bucket.params.len())
            .map(|k| grads.get(k).cloned().flatten())
            .collect();
        let device = self.params[bucket.params[0]].1.device();
        let groups = self
            .zero_groups
            .ok_or_else(|| Error::Zero("a ZeRO stage 2 reduction without ZeRO's groups".into()))?;
        // A shard group of one on a mesh: the replicas' flags summed first.
        let across = match presence {
            Some(_) => None,
            None => groups.presence_across_replicas(&grads)?,
        };
        let pieces = reduce_scatter_grads(
            &grads,
            &layouts,
            bucket.dtype,
            device,
            &dtypes,
            presence.or(across.as_deref()),
            groups.shard().world_size(),
            |table, section| {
                self.through_hook(std::slice::from_ref(table), bucket.dtype, |pieces, op| {
                    Ok(groups.reduce_scatter(&pieces[0], op, section)?)
                })
            },
        )?;
        let grads = bucket
            .params
            .iter()
            .zip(pieces)
            .filter_map(|(&i, piece)| piece.map(|g| (i, g)))
            .collect();
        Ok(Reduced { grads })
    }

    /// One flag per parameter of `bucket`: whether this rank has its
    /// gradient, in the bucket's dtype.
    fn presence_flags(&self, bucket: &Bucket, grads: &[Option<Tensor>]) -> Result<Tensor> {
        let present = local_presence(bucket, grads);
        let device = self.params[bucket.params[0]].1.device();
        Ok(Tensor::new(present, device)?.to_dtype(bucket.dtype)?)
    }

    /// The reduced presence flags: `presence` (summed on the host) or the
    /// last elements of the reduced bucket.
    fn flags(
        &self,
        bucket: &Bucket,
        reduced: &Tensor,
        presence: Option<&[f64]>,
    ) -> Result<Vec<f64>> {
        Ok(match presence {
            Some(flags) => flags.to_vec(),
            None => {
                let n = bucket.params.len();
                reduced
                    .narrow(0, reduced.elem_count() - n, n)?
                    .to_dtype(DType::F64)?
                    .to_vec1::<f64>()?
            }
        })
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

    /// One bucket (its pieces of `dtype`) through the communication hook,
    /// reduced by `collective` (an all-reduce of their concatenation, or a
    /// reduce-scatter).
    fn through_hook(
        &self,
        pieces: &[Tensor],
        dtype: DType,
        collective: impl FnOnce(&[Tensor], ReduceOp) -> Result<Tensor>,
    ) -> Result<Tensor> {
        let wire = match self.comm_hook {
            CommHook::Average => dtype,
            CommHook::Fp16Compress => DType::F16,
            CommHook::Bf16Compress => DType::BF16,
        };
        let world = self.pg.world_size() as f64;
        let reduced = if wire == dtype && self.divisor == world {
            // Divide once, at the end of the reduction, instead of a pass
            // over the whole bucket before it.
            collective(pieces, ReduceOp::Avg)?
        } else {
            // Compressed: divide first so the sum cannot overflow f16.
            let scaled = pieces
                .iter()
                .map(|piece| piece.to_dtype(wire)? / self.divisor)
                .collect::<candle_core::Result<Vec<_>>>()?;
            collective(&scaled, ReduceOp::Sum)?
        };
        Ok(reduced.to_dtype(dtype)?)
    }
}

/// One flag per parameter of `bucket`: 1 where this rank has its gradient.
fn local_presence(bucket: &Bucket, grads: &[Option<Tensor>]) -> Vec<f64> {
    (0..bucket.params.len())
        .map(|k| match grads.get(k).and_then(Option::as_ref) {
            Some(_) => 1.,
            None => 0.,
        })
        .collect()
}

/// The order in which `params` fill the buckets, as indices: the names of
/// `order` first, then the others by name. Where `strict` (an order the
/// user gave), a name that is not a parameter is an error; a name given
/// twice always is.
pub(super) fn bucket_order(
    params: &[(String, Var)],
    order: &[String],
    strict: bool,
) -> Result<Vec<usize>> {
    let mut taken = vec![false; params.len()];
    let mut indices = Vec::with_capacity(params.len());
    for name in order {
        let Ok(i) = params.binary_search_by(|(n, _)| n.as_str().cmp(name)) else {
            if !strict {
                continue;
            }
            return Err(Error::BucketOrder(format!(
                "`{name}` is not a parameter of the model (buffers are not bucketed)"
            )));
        };
        if std::mem::replace(&mut taken[i], true) {
            return Err(Error::BucketOrder(format!("`{name}` is named twice")));
        }
        indices.push(i);
    }
    indices.extend((0..params.len()).filter(|&i| !taken[i]));
    Ok(indices)
}

/// Checks that every rank fills its buckets in the same order as rank 0:
/// buckets that differ would reduce one rank's gradient with another's.
pub(super) fn verify_same_order(pg: &dyn ProcessGroup, order: &[usize]) -> Result<()> {
    let all = all_gather_object(pg, &order.to_vec())?;
    match all.iter().position(|theirs| theirs != &all[0]) {
        None => Ok(()),
        Some(rank) => Err(Error::ModelMismatch {
            rank,
            detail: "fills its gradient buckets in another order than rank 0 (a model given \
                     as units on one rank and whole on another, or another \
                     DdpConfig::bucket_order)"
                .into(),
        }),
    }
}
