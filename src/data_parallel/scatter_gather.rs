//! Scatter a mini-batch across replicas and gather their outputs back.
//!
//! Mirrors `torch/nn/parallel/scatter_gather.py` and `comm.py`:
//! - [`chunk_sizes`] is `torch.chunk`'s size rule;
//! - [`Scatter`] splits every tensor leaf of a nested input along one dim and
//!   replicates everything else;
//! - [`Gather`] concatenates replica outputs along the dim onto one device.
//!
//! Both directions stay on candle's autograd graph (`narrow`, `to_device` and
//! `cat` are differentiable), so the backward of gather is the scatter of the
//! output gradient, exactly as in PyTorch.

use std::collections::{BTreeMap, HashMap};
use std::hash::BuildHasher;
use std::sync::Arc;

use candle_core::{Device, Tensor};

use crate::error::{Error, Result};

/// How a batch is split across replicas.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Split {
    /// `torch.chunk` semantics: chunks of `ceil(N / devices)` rows, the last
    /// one shorter, and fewer chunks than devices when `N` is small.
    #[default]
    Even,
    /// Explicit chunk sizes (`torch.split_with_sizes`): one entry per replica,
    /// at most one per device, summing to the batch size, none zero.
    Sizes(Vec<usize>),
}

/// `torch.chunk`'s chunk sizes for `len` rows split into at most `chunks` parts.
///
/// Every chunk has `ceil(len / chunks)` rows except the last, and there are
/// fewer chunks than asked for when `len` is small (9 rows on 4 devices give
/// `[3, 3, 3]`: only three replicas run). `len == 0` gives `chunks` empty
/// chunks, as `torch.chunk` does; [`DataParallel`](crate::DataParallel) then
/// runs the model once, on the first device only.
///
/// Note that candle's own `Tensor::chunk` splits differently (10 rows in 4
/// chunks: candle `[3, 3, 2, 2]`, torch `[3, 3, 3, 1]`); this function is the
/// PyTorch rule.
///
/// ```
/// use candle_dp::chunk_sizes;
/// assert_eq!(chunk_sizes(10, 4), vec![3, 3, 3, 1]);
/// assert_eq!(chunk_sizes(9, 4), vec![3, 3, 3]);
/// assert_eq!(chunk_sizes(2, 8), vec![1, 1]);
/// assert_eq!(chunk_sizes(0, 3), vec![0, 0, 0]);
/// ```
pub fn chunk_sizes(len: usize, chunks: usize) -> Vec<usize> {
    if chunks == 0 {
        return Vec::new();
    }
    if len == 0 {
        return vec![0; chunks];
    }
    let size = len.div_ceil(chunks);
    let count = len.div_ceil(size);
    let mut sizes = vec![size; count];
    sizes[count - 1] = len - size * (count - 1);
    sizes
}

/// Rows along `dim` of the first tensor leaf, if any.
pub(crate) fn batch_rows<I: Scatter>(input: &I, dim: usize) -> Option<usize> {
    let mut rows = None;
    input.for_each_tensor(&mut |t| {
        if rows.is_none() {
            rows = t.dim(dim).ok();
        }
    });
    rows
}

/// A value that can be split across replicas.
///
/// Tensors are split along the scatter dim; containers (tuples, `Vec`,
/// string-keyed maps, `Option`) recurse; everything else (numbers, strings,
/// [`Replicated`], `Arc<T>`) is handed unchanged to every replica.
pub trait Scatter: Sized {
    /// Calls `f` on every tensor leaf, depth-first, in a fixed order.
    fn for_each_tensor<'a>(&'a self, f: &mut dyn FnMut(&'a Tensor));

    /// Splits the value into `sizes.len()` parts: part `i` takes rows
    /// `offsets[i] .. offsets[i] + sizes[i]` along `dim` of every tensor leaf
    /// and is moved to `devices[i]`.
    fn scatter_parts(&self, plan: &ScatterPlan) -> candle_core::Result<Vec<Self>>;
}

/// Where each chunk of a scattered batch goes.
#[derive(Debug, Clone)]
pub struct ScatterPlan {
    /// The scatter dimension.
    pub dim: usize,
    /// Rows per replica along `dim`; its length is the number of replicas used.
    pub sizes: Vec<usize>,
    /// Target device of each chunk.
    pub devices: Vec<Device>,
}

impl ScatterPlan {
    /// Works out the plan for `input`: validates every tensor leaf against
    /// `dim` and returns `None` when the input holds no tensor at all (the
    /// model then runs once, on the first device, as in PyTorch).
    pub fn for_input<I: Scatter>(
        input: &I,
        dim: usize,
        split: &Split,
        devices: &[Device],
    ) -> Result<Option<Self>> {
        let mut leaves = Vec::new();
        input.for_each_tensor(&mut |t| leaves.push(t));
        let Some(first) = leaves.first() else {
            return Ok(None);
        };
        let mut len = 0;
        for (leaf, t) in leaves.iter().enumerate() {
            if dim >= t.rank() {
                return Err(Error::ScatterDimOutOfRange {
                    dim,
                    leaf,
                    rank: t.rank(),
                    shape: t.dims().to_vec(),
                });
            }
            len = first.dim(dim)?;
            let found = t.dim(dim)?;
            if found != len {
                return Err(Error::ScatterSizeMismatch {
                    dim,
                    expected: len,
                    leaf,
                    found,
                    shape: t.dims().to_vec(),
                });
            }
        }
        if devices.is_empty() {
            return Err(Error::NoDevices);
        }
        let sizes = match split {
            // An empty batch runs once, on the first device: k replicas of
            // nothing would only cost time (and give NaN mean losses).
            Split::Even if len == 0 => vec![0],
            Split::Even => chunk_sizes(len, devices.len()),
            Split::Sizes(sizes) => {
                validate_sizes(sizes, len, devices.len())?;
                sizes.clone()
            }
        };
        Ok(Some(Self {
            dim,
            devices: devices[..sizes.len()].to_vec(),
            sizes,
        }))
    }

    /// Start row of each chunk along `dim`.
    pub fn offsets(&self) -> Vec<usize> {
        self.sizes
            .iter()
            .scan(0, |start, size| {
                let offset = *start;
                *start += size;
                Some(offset)
            })
            .collect()
    }

    /// Number of replicas this plan uses.
    pub fn replicas(&self) -> usize {
        self.sizes.len()
    }

    /// Total rows along `dim`.
    pub fn len(&self) -> usize {
        self.sizes.iter().sum()
    }

    /// Whether the batch is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

fn validate_sizes(sizes: &[usize], len: usize, devices: usize) -> Result<()> {
    let invalid = |reason| Error::InvalidChunkSizes {
        sizes: sizes.to_vec(),
        len,
        devices,
        reason,
    };
    if sizes.is_empty() {
        return Err(invalid("no chunk given"));
    }
    if sizes.len() > devices {
        return Err(invalid("more chunks than devices"));
    }
    match sizes
        .iter()
        .try_fold(0usize, |sum, &size| sum.checked_add(size))
    {
        None => return Err(invalid("the sizes add up to more than usize::MAX")),
        Some(sum) if sum != len => {
            return Err(invalid("the sizes do not add up to the batch size"))
        }
        Some(_) => {}
    }
    if len > 0 && sizes.contains(&0) {
        return Err(invalid(
            "an empty chunk would run a replica on no input; leave it out",
        ));
    }
    Ok(())
}

impl Scatter for Tensor {
    fn for_each_tensor<'a>(&'a self, f: &mut dyn FnMut(&'a Tensor)) {
        f(self)
    }

    fn scatter_parts(&self, plan: &ScatterPlan) -> candle_core::Result<Vec<Self>> {
        plan.offsets()
            .into_iter()
            .zip(&plan.sizes)
            .zip(&plan.devices)
            .map(|((start, &len), device)| {
                move_rows(
                    &self.narrow(plan.dim, start, len)?,
                    device,
                    len,
                    self.dim(plan.dim)?,
                )
            })
            .collect()
    }
}

/// `chunk` (`len` of the input's `total` rows) on `device`. A narrowed
/// view keeps the whole input's storage, and candle's `to_device` copies
/// that whole storage (between GPUs and from the host alike): each replica
/// would receive the entire batch. So a strict part bound for another
/// device is first copied into a storage of its own where it is (a local
/// copy of exactly its rows), and only that crosses over. On one device
/// the view is kept: no copy at all, as on CPU replicas.
fn move_rows(
    chunk: &Tensor,
    device: &Device,
    len: usize,
    total: usize,
) -> candle_core::Result<Tensor> {
    if chunk.device().same_device(device) || len == total {
        crate::device_copy::to_device(chunk, device)
    } else {
        crate::device_copy::to_device(&chunk.force_contiguous()?, device)
    }
}

impl<T: Scatter> Scatter for Vec<T> {
    fn for_each_tensor<'a>(&'a self, f: &mut dyn FnMut(&'a Tensor)) {
        self.iter().for_each(|item| item.for_each_tensor(f))
    }

    fn scatter_parts(&self, plan: &ScatterPlan) -> candle_core::Result<Vec<Self>> {
        let per_item = self
            .iter()
            .map(|item| one_per_replica(item.scatter_parts(plan)?, plan))
            .collect::<candle_core::Result<Vec<_>>>()?;
        Ok(transpose(per_item, plan.replicas()))
    }
}

impl<T: Scatter> Scatter for Option<T> {
    fn for_each_tensor<'a>(&'a self, f: &mut dyn FnMut(&'a Tensor)) {
        if let Some(item) = self {
            item.for_each_tensor(f)
        }
    }

    fn scatter_parts(&self, plan: &ScatterPlan) -> candle_core::Result<Vec<Self>> {
        Ok(match self {
            Some(item) => one_per_replica(item.scatter_parts(plan)?, plan)?
                .into_iter()
                .map(Some)
                .collect(),
            None => (0..plan.replicas()).map(|_| None).collect(),
        })
    }
}

impl<T: Scatter, S: BuildHasher + Default> Scatter for HashMap<String, T, S> {
    fn for_each_tensor<'a>(&'a self, f: &mut dyn FnMut(&'a Tensor)) {
        // Sorted keys: the leaf order (and so error messages) is deterministic.
        let mut keys: Vec<_> = self.keys().collect();
        keys.sort();
        keys.into_iter().for_each(|k| self[k].for_each_tensor(f))
    }

    fn scatter_parts(&self, plan: &ScatterPlan) -> candle_core::Result<Vec<Self>> {
        scatter_entries(self, plan)
    }
}

impl<T: Scatter> Scatter for BTreeMap<String, T> {
    fn for_each_tensor<'a>(&'a self, f: &mut dyn FnMut(&'a Tensor)) {
        self.values().for_each(|v| v.for_each_tensor(f))
    }

    fn scatter_parts(&self, plan: &ScatterPlan) -> candle_core::Result<Vec<Self>> {
        scatter_entries(self, plan)
    }
}

/// A map's parts: every value scattered, and each replica's chunks under
/// their keys, in a map of the same kind.
fn scatter_entries<'a, T, M>(
    entries: impl IntoIterator<Item = (&'a String, &'a T)>,
    plan: &ScatterPlan,
) -> candle_core::Result<Vec<M>>
where
    T: Scatter + 'a,
    M: Default + Extend<(String, T)>,
{
    let mut parts: Vec<M> = (0..plan.replicas()).map(|_| M::default()).collect();
    for (key, value) in entries {
        for (part, chunk) in parts
            .iter_mut()
            .zip(one_per_replica(value.scatter_parts(plan)?, plan)?)
        {
            part.extend([(key.clone(), chunk)]);
        }
    }
    Ok(parts)
}

/// Turns `items[i][r]` (item, replica) into `parts[r][i]` (replica, item).
fn transpose<T>(items: Vec<Vec<T>>, replicas: usize) -> Vec<Vec<T>> {
    let mut parts: Vec<Vec<T>> = (0..replicas)
        .map(|_| Vec::with_capacity(items.len()))
        .collect();
    for chunks in items {
        for (part, chunk) in parts.iter_mut().zip(chunks) {
            part.push(chunk);
        }
    }
    parts
}

/// A value handed unchanged (cloned) to every replica, whatever it holds,
/// tensors included: use it for per-step constants such as a class-weight
/// tensor that must not be split.
#[derive(Debug, Clone, PartialEq)]
pub struct Replicated<T>(pub T);

impl<T: Clone> Scatter for Replicated<T> {
    fn for_each_tensor<'a>(&'a self, _f: &mut dyn FnMut(&'a Tensor)) {}

    fn scatter_parts(&self, plan: &ScatterPlan) -> candle_core::Result<Vec<Self>> {
        Ok(vec![self.clone(); plan.replicas()])
    }
}

impl<T: ?Sized> Scatter for Arc<T> {
    fn for_each_tensor<'a>(&'a self, _f: &mut dyn FnMut(&'a Tensor)) {}

    fn scatter_parts(&self, plan: &ScatterPlan) -> candle_core::Result<Vec<Self>> {
        Ok(vec![self.clone(); plan.replicas()])
    }
}

macro_rules! replicated_values {
    ($($t:ty),*) => {$(
        impl Scatter for $t {
            fn for_each_tensor<'a>(&'a self, _f: &mut dyn FnMut(&'a Tensor)) {}

            fn scatter_parts(&self, plan: &ScatterPlan) -> candle_core::Result<Vec<Self>> {
                Ok(vec![self.clone(); plan.replicas()])
            }
        }
    )*};
}
replicated_values!(
    (),
    bool,
    char,
    i8,
    i16,
    i32,
    i64,
    u8,
    u16,
    u32,
    u64,
    usize,
    isize,
    f32,
    f64,
    String,
    &'static str
);

/// The parts of one element, if there is one per replica of `plan`; a
/// user's [`Scatter`] implementation may return any number.
fn one_per_replica<T>(parts: Vec<T>, plan: &ScatterPlan) -> candle_core::Result<Vec<T>> {
    if parts.len() == plan.replicas() {
        Ok(parts)
    } else {
        Err(candle_core::Error::Msg(
            Error::ScatterParts {
                expected: plan.replicas(),
                found: parts.len(),
            }
            .to_string(),
        ))
    }
}

/// Invokes the macro `$m` once per tuple arity that [`Scatter`] and
/// [`Gather`] support, one to six, with each element's type name and index.
macro_rules! for_each_tuple_arity {
    ($m:ident) => {
        $m!(A.0);
        $m!(A.0, B.1);
        $m!(A.0, B.1, C.2);
        $m!(A.0, B.1, C.2, D.3);
        $m!(A.0, B.1, C.2, D.3, E.4);
        $m!(A.0, B.1, C.2, D.3, E.4, F.5);
    };
}

/// Zips equally long vectors of parts into a vector of tuples.
macro_rules! zip_parts {
    ($a:ident) => { $a.into_iter().map(|a| (a,)).collect() };
    ($($name:ident),+) => {{
        $(let mut $name = $name.into_iter();)+
        let mut parts = Vec::new();
        while let ($(Some($name),)+) = ($($name.next(),)+) {
            parts.push(($($name,)+));
        }
        parts
    }};
}

macro_rules! tuple_scatter {
    ($($name:ident . $idx:tt),+) => {
        impl<$($name: Scatter),+> Scatter for ($($name,)+) {
            fn for_each_tensor<'a>(&'a self, f: &mut dyn FnMut(&'a Tensor)) {
                $(self.$idx.for_each_tensor(f);)+
            }

            #[allow(non_snake_case)]
            fn scatter_parts(&self, plan: &ScatterPlan) -> candle_core::Result<Vec<Self>> {
                $(let $name = one_per_replica(self.$idx.scatter_parts(plan)?, plan)?;)+
                // Every element has one part per replica (checked above).
                Ok(zip_parts!($($name),+))
            }
        }
    };
}
for_each_tuple_arity!(tuple_scatter);

/// Splits `input` according to `plan` (PyTorch's `scatter`): one part per
/// replica, each on its device.
pub fn scatter<I: Scatter>(input: &I, plan: &ScatterPlan) -> Result<Vec<I>> {
    let parts = input.scatter_parts(plan)?;
    if parts.len() != plan.replicas() {
        return Err(Error::ScatterParts {
            expected: plan.replicas(),
            found: parts.len(),
        });
    }
    Ok(parts)
}

/// Combines replica outputs along `dim` onto `device` (PyTorch's `gather`).
///
/// ```
/// use candle_core::{Device, Tensor};
/// let parts = vec![Tensor::new(&[1f32, 2.], &Device::Cpu)?, Tensor::new(&[3f32], &Device::Cpu)?];
/// let all = candle_dp::gather(parts, 0, &Device::Cpu)?;
/// assert_eq!(all.to_vec1::<f32>()?, vec![1., 2., 3.]);
/// # Ok::<(), candle_dp::Error>(())
/// ```
pub fn gather<O: Gather>(parts: Vec<O>, dim: usize, device: &Device) -> Result<O> {
    O::gather_parts(parts, dim, device)
}

/// Replica outputs that can be combined into one value.
pub trait Gather: Sized {
    /// Combines `parts` (one per replica, in replica order) along `dim` onto
    /// `device`. An output that does not fit replica 0's is an error naming
    /// the replica.
    fn gather_parts(parts: Vec<Self>, dim: usize, device: &Device) -> Result<Self>;
}

impl Gather for Tensor {
    /// Concatenates along `dim` (differentiably). When every part is 0-dim
    /// and `dim == 0`, the result is a vector with one entry per replica
    /// (PyTorch does the same, with a warning; here it is documented instead).
    ///
    /// Parts that do not fit together are an [`Error::Gather`] naming a
    /// replica whose part differs from most others' (replica 0's on a tie)
    /// in rank, in size outside `dim`, or in dtype.
    fn gather_parts(parts: Vec<Self>, dim: usize, device: &Device) -> Result<Self> {
        let reference = check_parts_fit(&parts, dim)?;
        let reshaped: Vec<Tensor> = if reference.rank() == 0 && dim == 0 {
            parts
                .iter()
                .map(|t| t.reshape(1))
                .collect::<candle_core::Result<_>>()?
        } else {
            parts
        };
        let mut moved = reshaped
            .iter()
            .map(|t| crate::device_copy::to_device(t, device))
            .collect::<candle_core::Result<Vec<_>>>()?;
        if moved.len() == 1 {
            if let Some(only) = moved.pop() {
                return Ok(only);
            }
        }
        Ok(Tensor::cat(&moved, dim)?)
    }
}

/// Whether two replica outputs can be concatenated along `dim`: same rank,
/// same dtype, same sizes outside `dim`.
fn fits(a: &Tensor, b: &Tensor, dim: usize) -> bool {
    a.rank() == b.rank()
        && a.dtype() == b.dtype()
        && a.dims()
            .iter()
            .zip(b.dims())
            .enumerate()
            .all(|(d, (x, y))| d == dim || x == y)
}

/// Checks that `parts` gather along `dim` and returns the part they agree
/// with. The reference is the part most others fit (the first such on a
/// tie), so that the error names the replica that is odd one out, not
/// replica 0 because it came first.
fn check_parts_fit(parts: &[Tensor], dim: usize) -> Result<&Tensor> {
    let agreeing = |part: &Tensor| parts.iter().filter(|p| fits(p, part, dim)).count();
    let mut best: Option<(usize, usize)> = None;
    for (replica, part) in parts.iter().enumerate() {
        let count = agreeing(part);
        if best.is_none_or(|(most, _)| count > most) {
            best = Some((count, replica));
        }
    }
    let Some((agree, first_agreeing)) = best else {
        return Err(Error::Gather {
            replica: 0,
            reason: "no replica output".into(),
        });
    };
    let describe = |t: &Tensor| match t.rank() {
        0 => format!("a 0-dim {:?} output", t.dtype()),
        _ => format!("a {:?} output of shape {:?}", t.dtype(), t.dims()),
    };
    let reference = &parts[first_agreeing];
    if let Some(replica) = parts.iter().position(|p| !fits(p, reference, dim)) {
        return Err(Error::Gather {
            replica,
            reason: format!(
                "it returned {}; replica {first_agreeing} returned {}, as {agree} of the {} replicas did (gather dim {dim})",
                describe(&parts[replica]),
                describe(reference),
                parts.len(),
            ),
        });
    }
    let in_range = match reference.rank() {
        // 0-dim outputs become one entry each along dim 0.
        0 => dim == 0,
        rank => dim < rank,
    };
    if !in_range {
        return Err(Error::Gather {
            replica: 0,
            reason: format!(
                "gather dim {dim} is out of range for its output of shape {:?}",
                reference.dims()
            ),
        });
    }
    Ok(reference)
}

impl<T: Gather> Gather for Vec<T> {
    fn gather_parts(parts: Vec<Self>, dim: usize, device: &Device) -> Result<Self> {
        let len = parts.first().map_or(0, Vec::len);
        if let Some((replica, part)) = parts.iter().enumerate().find(|(_, p)| p.len() != len) {
            return Err(Error::Gather {
                replica,
                reason: format!("it returned {} items, replica 0 returned {len}", part.len()),
            });
        }
        transpose(parts, len)
            .into_iter()
            .map(|item| T::gather_parts(item, dim, device))
            .collect()
    }
}

impl<T: Gather> Gather for Option<T> {
    /// All `None` gathers to `None`; a mix of `None` and `Some` is an error.
    fn gather_parts(parts: Vec<Self>, dim: usize, device: &Device) -> Result<Self> {
        if parts.iter().all(Option::is_none) {
            return Ok(None);
        }
        let mut somes = Vec::with_capacity(parts.len());
        for (replica, part) in parts.into_iter().enumerate() {
            match part {
                Some(value) => somes.push(value),
                None => {
                    return Err(Error::Gather {
                        replica,
                        reason: "it returned None where other replicas returned a value".into(),
                    })
                }
            }
        }
        T::gather_parts(somes, dim, device).map(Some)
    }
}

fn gather_map<T: Gather, M>(
    parts: Vec<M>,
    dim: usize,
    device: &Device,
    keys_of: impl Fn(&M) -> Vec<String>,
    mut take: impl FnMut(&mut M, &str) -> Option<T>,
) -> Result<Vec<(String, T)>> {
    let keys = parts.first().map(&keys_of).unwrap_or_default();
    for (replica, part) in parts.iter().enumerate() {
        let got = keys_of(part);
        if got != keys {
            return Err(Error::Gather {
                replica,
                reason: format!("its keys {got:?} differ from replica 0's {keys:?}"),
            });
        }
    }
    let mut parts = parts;
    keys.into_iter()
        .map(|key| {
            // Every part has every key (checked above).
            let values = parts
                .iter_mut()
                .enumerate()
                .map(|(replica, p)| {
                    take(p, &key).ok_or_else(|| Error::Gather {
                        replica,
                        reason: format!("it has no `{key}`"),
                    })
                })
                .collect::<Result<_>>()?;
            T::gather_parts(values, dim, device).map(|v| (key, v))
        })
        .collect()
}

impl<T: Gather, S: BuildHasher + Default> Gather for HashMap<String, T, S> {
    fn gather_parts(parts: Vec<Self>, dim: usize, device: &Device) -> Result<Self> {
        let sorted_keys = |m: &Self| {
            let mut keys: Vec<String> = m.keys().cloned().collect();
            keys.sort();
            keys
        };
        Ok(
            gather_map(parts, dim, device, sorted_keys, |m, k| m.remove(k))?
                .into_iter()
                .collect(),
        )
    }
}

impl<T: Gather> Gather for BTreeMap<String, T> {
    fn gather_parts(parts: Vec<Self>, dim: usize, device: &Device) -> Result<Self> {
        let keys = |m: &Self| m.keys().cloned().collect();
        Ok(gather_map(parts, dim, device, keys, |m, k| m.remove(k))?
            .into_iter()
            .collect())
    }
}

macro_rules! tuple_gather {
    ($($name:ident . $idx:tt),+) => {
        impl<$($name: Gather),+> Gather for ($($name,)+) {
            #[allow(non_snake_case)]
            fn gather_parts(parts: Vec<Self>, dim: usize, device: &Device) -> Result<Self> {
                $(let mut $name = Vec::with_capacity(parts.len());)+
                for part in parts {
                    $($name.push(part.$idx);)+
                }
                Ok(($($name::gather_parts($name, dim, device)?,)+))
            }
        }
    };
}
for_each_tuple_arity!(tuple_gather);
