//! Host buffers: the form in which tensor data travels between ranks, and the
//! element-wise reductions on them.
//!
//! A tensor is flattened into a typed `Vec` once on the sending side and
//! rebuilt once on the receiving side; in between, buffers move (or are
//! shared through an `Arc`) without copies. The inputs of large reductions
//! are not even copied once when they are contiguous CPU tensors: the ranks
//! read them in place ([`Input`]).

use std::any::Any;
use std::ops::Range;
use std::sync::{Arc, OnceLock};

use candle_core::{DType, Device, Storage, StorageRef, Tensor, WithDType};
use half::{bf16, f16};

use super::shared_output::SharedOutput;

/// The flattened elements of a tensor, one variant per supported dtype.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Buffer {
    U8(Vec<u8>),
    U32(Vec<u32>),
    I16(Vec<i16>),
    I32(Vec<i32>),
    I64(Vec<i64>),
    BF16(Vec<bf16>),
    F16(Vec<f16>),
    F32(Vec<f32>),
    F64(Vec<f64>),
}

/// Runs `$body` with `$v` bound to the buffer's vector, whatever its element
/// type: the one place that lists the variants, so that the code using it
/// can stay generic over [`Element`].
macro_rules! match_buffer {
    ($buffer:expr, $v:ident => $body:expr) => {
        match $buffer {
            Buffer::U8($v) => $body,
            Buffer::U32($v) => $body,
            Buffer::I16($v) => $body,
            Buffer::I32($v) => $body,
            Buffer::I64($v) => $body,
            Buffer::BF16($v) => $body,
            Buffer::F16($v) => $body,
            Buffer::F32($v) => $body,
            Buffer::F64($v) => $body,
        }
    };
}
pub(crate) use match_buffer;

impl<T: Element> From<Vec<T>> for Buffer {
    fn from(values: Vec<T>) -> Buffer {
        T::into_buffer(values)
    }
}

/// Runs `$body` with `$t` the element type of `$dtype`, or `$other` for a
/// dtype that collectives do not support.
macro_rules! match_dtype {
    ($dtype:expr, $t:ident => $body:expr, _ => $other:expr) => {
        match $dtype {
            ::candle_core::DType::U8 => {
                type $t = u8;
                $body
            }
            ::candle_core::DType::U32 => {
                type $t = u32;
                $body
            }
            ::candle_core::DType::I16 => {
                type $t = i16;
                $body
            }
            ::candle_core::DType::I32 => {
                type $t = i32;
                $body
            }
            ::candle_core::DType::I64 => {
                type $t = i64;
                $body
            }
            ::candle_core::DType::BF16 => {
                type $t = ::half::bf16;
                $body
            }
            ::candle_core::DType::F16 => {
                type $t = ::half::f16;
                $body
            }
            ::candle_core::DType::F32 => {
                type $t = f32;
                $body
            }
            ::candle_core::DType::F64 => {
                type $t = f64;
                $body
            }
            _ => $other,
        }
    };
}

pub(crate) use match_dtype;

fn unsupported(dtype: DType) -> String {
    format!("dtype {} is not supported by collectives", dtype.as_str())
}

impl Buffer {
    /// The dtype of the elements.
    #[cfg_attr(not(feature = "mpi"), allow(dead_code))]
    pub(crate) fn dtype(&self) -> DType {
        fn of<T: Element>(_: &[T]) -> DType {
            T::DTYPE
        }
        match_buffer!(self, v => of(v))
    }

    /// The number of elements.
    #[cfg_attr(not(feature = "mpi"), allow(dead_code))]
    pub(crate) fn len(&self) -> usize {
        match_buffer!(self, v => v.len())
    }

    /// Copies a tensor's elements (in row-major order) to the host.
    ///
    /// The error is a message for [`CommError::InvalidInput`](super::CommError),
    /// which every rank reports.
    pub(crate) fn from_tensor(tensor: &Tensor) -> Result<Buffer, String> {
        let flat = tensor.flatten_all().map_err(|e| e.to_string())?;
        let buffer = match_dtype!(tensor.dtype(), T => flat.to_vec1::<T>().map(T::into_buffer), _ => {
            return Err(unsupported(tensor.dtype()))
        });
        buffer.map_err(|e| e.to_string())
    }

    /// The concatenation of `tensors` (flattened, all of `dtype`), copied
    /// once into one buffer.
    #[cfg(feature = "mpi")]
    pub(crate) fn concat(tensors: &[Tensor], dtype: DType) -> Result<Buffer, String> {
        Buffer::of_input(&Input::concat(tensors, dtype)?, dtype)
    }

    /// The elements of `input` (of `dtype`), copied once into one buffer.
    #[cfg(feature = "mpi")]
    pub(crate) fn of_input(input: &Input, dtype: DType) -> Result<Buffer, String> {
        let len = input.len();
        match_dtype!(dtype, T => {
            let mut values: Vec<T> = Vec::with_capacity(len);
            read_inputs(&[input], 0..len, |xs: &[&[T]]| values.extend_from_slice(xs[0]))
                .map_err(|_| format!("cannot read the {len} elements of the tensors"))?;
            Ok(T::into_buffer(values))
        }, _ => Err(unsupported(dtype)))
    }

    /// A new tensor holding a copy of these elements.
    pub(crate) fn to_tensor(&self, dims: &[usize], device: &Device) -> candle_core::Result<Tensor> {
        match_buffer!(self, v => Tensor::from_slice(v, dims, device))
    }

    /// A tensor made from these elements, without a copy on the CPU.
    pub(crate) fn into_tensor(
        self,
        dims: &[usize],
        device: &Device,
    ) -> candle_core::Result<Tensor> {
        match_buffer!(self, v => Tensor::from_vec(v, dims, device))
    }

    /// The elements of a `u8` buffer.
    pub(crate) fn as_bytes(&self) -> Option<&[u8]> {
        match self {
            Buffer::U8(bytes) => Some(bytes),
            _ => None,
        }
    }
}

/// Whether collectives support `dtype`.
fn is_supported(dtype: DType) -> bool {
    match_dtype!(dtype, _T => true, _ => false)
}

/// A rank's input to a large reduction, shared with the other ranks, which
/// read it directly (see [`ring`](super::ring)).
///
/// A contiguous CPU tensor is shared as it is and read in place; any other
/// tensor (on a GPU, or a strided view) is copied to the host once.
#[derive(Debug, Clone)]
pub(crate) struct Input {
    source: Source,
    /// Where the ranks find the [`SharedOutput`] of an all-reduce: the
    /// first rank that needs it creates it in rank 0's input, which every
    /// rank sees.
    output: Arc<OnceLock<Arc<dyn Any + Send + Sync>>>,
}

/// Where an input's elements are.
#[derive(Debug, Clone)]
enum Source {
    InPlace {
        tensor: Tensor,
        /// Identifies the tensor's storage, and so its lock: the address of
        /// the storage inside its lock, which the tensor keeps alive.
        key: usize,
    },
    Copied(Arc<Buffer>),
    /// Several sources read as one, their concatenation (a DDP bucket, read
    /// where each gradient is instead of copied into one buffer first).
    Concat(Vec<Source>),
}

impl Input {
    /// The error is a message for [`CommError::InvalidInput`](super::CommError),
    /// as for [`Buffer::from_tensor`].
    pub(crate) fn new(tensor: &Tensor) -> Result<Input, String> {
        Source::new(tensor).map(Input::from)
    }

    /// The concatenation of `tensors` (flattened), which all have `dtype`.
    pub(crate) fn concat(tensors: &[Tensor], dtype: DType) -> Result<Input, String> {
        tensors
            .iter()
            .enumerate()
            .map(|(i, tensor)| match tensor.dtype() {
                d if d == dtype => Source::new(tensor),
                d => Err(format!(
                    "tensor {i} is {}, not {} like the first",
                    d.as_str(),
                    dtype.as_str()
                )),
            })
            .collect::<Result<_, _>>()
            .map(|parts| Input::from(Source::Concat(parts)))
    }

    /// The number of elements.
    pub(crate) fn len(&self) -> usize {
        self.source.len()
    }

    /// The all-reduce result of `len` elements that every rank holding a
    /// clone of this input shares; `None` if it was created for another
    /// element type or length (the ranks agreed on both, so they do not).
    pub(crate) fn shared_output<T: Element>(&self, len: usize) -> Option<Arc<SharedOutput<T>>> {
        let any = self
            .output
            .get_or_init(|| Arc::new(SharedOutput::<T>::new(len)))
            .clone();
        // Every rank asks for the same length (the ranks agreed on the
        // tensor); one that does not must not get chunks of another buffer.
        any.downcast::<SharedOutput<T>>()
            .ok()
            .filter(|output| output.len() == len)
    }
}

impl From<Source> for Input {
    fn from(source: Source) -> Input {
        Input {
            source,
            output: Arc::default(),
        }
    }
}

impl Source {
    fn new(tensor: &Tensor) -> Result<Source, String> {
        if tensor.device().is_cpu() && tensor.is_contiguous() && is_supported(tensor.dtype()) {
            let (storage, _) = tensor.storage_and_layout();
            let key = std::ptr::from_ref::<Storage>(&storage) as usize;
            Ok(Source::InPlace {
                tensor: tensor.clone(),
                key,
            })
        } else {
            Buffer::from_tensor(tensor).map(|b| Source::Copied(Arc::new(b)))
        }
    }

    fn len(&self) -> usize {
        match self {
            Source::InPlace { tensor, .. } => tensor.elem_count(),
            Source::Copied(buffer) => match_buffer!(buffer.as_ref(), v => v.len()),
            Source::Concat(parts) => parts.iter().map(Source::len).sum(),
        }
    }

    /// The single sources this one is made of, in order.
    fn leaves(&self) -> Vec<&Source> {
        match self {
            Source::Concat(parts) => parts.iter().flat_map(Source::leaves).collect(),
            single => vec![single],
        }
    }

    /// Where each leaf's elements start, and the total, as [`leaves`](Self::leaves).
    fn starts(leaves: &[&Source]) -> Vec<usize> {
        let mut at = 0;
        let mut starts: Vec<usize> = leaves
            .iter()
            .map(|leaf| {
                let start = at;
                at += leaf.len();
                start
            })
            .collect();
        starts.push(at);
        starts
    }
}

/// The elements `range` of a single (not concatenated) source, whose
/// storage is locked in `guards` if it is read in place.
fn leaf_slice<'a, T: Element>(
    leaf: &'a Source,
    guards: &'a [(usize, StorageRef<'a>)],
    range: Range<usize>,
) -> Option<&'a [T]> {
    match leaf {
        Source::InPlace { tensor, key } => {
            let at = guards.binary_search_by_key(key, |&(key, _)| key).ok()?;
            match (&*guards[at].1, tensor.layout().contiguous_offsets()) {
                (Storage::Cpu(cpu), Some((start, _))) => cpu
                    .as_slice::<T>()
                    .ok()?
                    .get(start + range.start..start + range.end),
                _ => None,
            }
        }
        Source::Copied(buffer) => T::slice_of(buffer)?.get(range),
        Source::Concat(_) => None,
    }
}

/// The read locks of the storages that `leaves` read in place, each taken
/// once (candle's lock is fair: a second read lock on the same storage
/// behind a waiting writer would deadlock), in a fixed order, keyed for
/// [`leaf_slice`].
fn lock_in_place<'a>(leaves: impl Iterator<Item = &'a Source>) -> Vec<(usize, StorageRef<'a>)> {
    let mut locked: Vec<(usize, &Tensor)> = leaves
        .filter_map(|leaf| match leaf {
            Source::InPlace { tensor, key } => Some((*key, tensor)),
            _ => None,
        })
        .collect();
    locked.sort_by_key(|&(key, _)| key);
    locked.dedup_by_key(|&mut (key, _)| key);
    locked
        .into_iter()
        .map(|(key, tensor)| (key, tensor.storage_and_layout().0))
        .collect()
}

/// `f` of the elements `range` of every input, called on consecutive
/// pieces of the range: one call when no input is a concatenation,
/// otherwise one per stretch in which no input crosses from one part into
/// the next. The pieces cover the range in order.
///
/// Tensors are read in place, under their storage's read lock, taken once
/// per storage (candle's lock is fair: a second read lock on the same
/// storage behind a waiting writer would deadlock), in a fixed order, and
/// released when the last call returns. Callers do not wait for other ranks
/// while holding them.
///
/// `Err(i)` when input `i` holds no such elements, which cannot happen for
/// inputs of `T`'s dtype and a range within their length.
pub(crate) fn read_inputs<T: Element>(
    inputs: &[&Input],
    range: Range<usize>,
    mut f: impl FnMut(&[&[T]]),
) -> Result<(), usize> {
    let leaves: Vec<Vec<&Source>> = inputs.iter().map(|input| input.source.leaves()).collect();
    let starts: Vec<Vec<usize>> = leaves.iter().map(|l| Source::starts(l)).collect();
    let guards = lock_in_place(leaves.iter().flatten().copied());
    let mut slices: Vec<&[T]> = Vec::with_capacity(inputs.len());
    if range.is_empty() {
        for (i, leaves) in leaves.iter().enumerate() {
            let len: usize = leaves.iter().map(|leaf| leaf.len()).sum();
            if range.start > len {
                return Err(i);
            }
            slices.push(&[]);
        }
        f(&slices);
        return Ok(());
    }
    let mut at = range.start;
    while at < range.end {
        // The piece ends where the range ends or any input's part does.
        let mut end = range.end;
        for starts in &starts {
            let next = starts.partition_point(|&s| s <= at);
            if let Some(&s) = starts.get(next) {
                end = end.min(s);
            }
        }
        slices.clear();
        for (i, (leaves, starts)) in leaves.iter().zip(&starts).enumerate() {
            // The last part that starts at or before `at` (skipping empty ones).
            let part = starts.partition_point(|&s| s <= at).saturating_sub(1);
            let slice = leaves
                .get(part)
                .and_then(|leaf| leaf_slice(leaf, &guards, at - starts[part]..end - starts[part]));
            slices.push(slice.ok_or(i)?);
        }
        f(&slices);
        at = end;
    }
    Ok(())
}

/// `f` of the elements of each part of `input` (one slice per tensor of a
/// concatenation, in order), all lent at once: tensors are read in place
/// under their storages' read locks, taken as [`read_inputs`] takes them
/// and held until `f` returns. `Err(i)` when part `i` holds no elements of
/// `T`.
///
/// The MPI engine holds them while it waits for other processes, which
/// cannot need them; in this process, the rank's caller is waiting for the
/// result. A collective given up while MPI still reads the tensors keeps
/// them locked (for reading) until MPI lets go.
#[cfg(feature = "mpi")]
pub(crate) fn read_parts<T: Element, R>(
    input: &Input,
    f: impl FnOnce(&[&[T]]) -> R,
) -> Result<R, usize> {
    let leaves = input.source.leaves();
    let guards = lock_in_place(leaves.iter().copied());
    let parts = leaves
        .iter()
        .enumerate()
        .map(|(i, leaf)| leaf_slice::<T>(leaf, &guards, 0..leaf.len()).ok_or(i))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(f(&parts))
}

/// The number of elements of each part of `input`, as [`read_parts`]
/// lends them.
#[cfg(feature = "mpi")]
pub(crate) fn part_lens(input: &Input) -> Vec<usize> {
    input
        .source
        .leaves()
        .iter()
        .map(|leaf| leaf.len())
        .collect()
}

/// An element type that buffers hold and reductions combine.
pub(crate) trait Element: WithDType {
    /// Wraps a vector in its [`Buffer`] variant.
    fn into_buffer(values: Vec<Self>) -> Buffer;
    /// The elements of a buffer of this type, `None` for another type.
    fn slice_of(buffer: &Buffer) -> Option<&[Self]>;
    /// The vector inside a buffer of this type, the buffer back for
    /// another type.
    #[cfg(feature = "mpi")]
    fn vec_of(buffer: Buffer) -> Result<Vec<Self>, Buffer>;
    /// `acc ⊕ x` for `Sum` and `Avg` (the division comes last).
    fn reduce_sum(acc: Self, x: Self) -> Self;
    /// The larger of the two (NaN wins, for floats).
    fn reduce_max(acc: Self, x: Self) -> Self;
    /// The smaller of the two (NaN wins, for floats).
    fn reduce_min(acc: Self, x: Self) -> Self;
    /// `self / world_size`, the last step of `Avg`.
    fn divide(self, world_size: usize) -> Self;
    /// `1 / world_size` where multiplying by it gives `divide`'s bits: in
    /// a float type, for a power of two exact in it with its reciprocal
    /// (both operations then round the same exact quotient); `None`
    /// otherwise.
    fn exact_reciprocal(world_size: usize) -> Option<Self>;
    /// `self * factor`.
    fn times(self, factor: Self) -> Self;
}

macro_rules! buffer_variant {
    ($t:ty, $variant:ident) => {
        fn into_buffer(values: Vec<Self>) -> Buffer {
            Buffer::$variant(values)
        }
        fn slice_of(buffer: &Buffer) -> Option<&[Self]> {
            match buffer {
                Buffer::$variant(values) => Some(values),
                _ => None,
            }
        }
        #[cfg(feature = "mpi")]
        fn vec_of(buffer: Buffer) -> Result<Vec<Self>, Buffer> {
            match buffer {
                Buffer::$variant(values) => Ok(values),
                other => Err(other),
            }
        }
    };
}

macro_rules! float_element {
    ($t:ty, $variant:ident) => {
        impl Element for $t {
            buffer_variant!($t, $variant);
            fn reduce_sum(acc: Self, x: Self) -> Self {
                acc + x
            }
            fn reduce_max(acc: Self, x: Self) -> Self {
                if acc.is_nan() || x.is_nan() {
                    // Propagate NaN, as torch.max does; which NaN is kept is
                    // fixed by the reduction order.
                    if acc.is_nan() {
                        acc
                    } else {
                        x
                    }
                } else if x > acc {
                    x
                } else {
                    acc
                }
            }
            fn reduce_min(acc: Self, x: Self) -> Self {
                if acc.is_nan() || x.is_nan() {
                    if acc.is_nan() {
                        acc
                    } else {
                        x
                    }
                } else if x < acc {
                    x
                } else {
                    acc
                }
            }
            fn divide(self, world_size: usize) -> Self {
                // World sizes are small integers, exact in every float type
                // up to f16's 2048.
                self / <$t as WithDType>::from_f64(world_size as f64)
            }
            fn exact_reciprocal(world_size: usize) -> Option<Self> {
                let (w, r) = (world_size as f64, 1.0 / world_size as f64);
                let exact = |x: f64| <$t as WithDType>::from_f64(x).to_f64() == x;
                (world_size.is_power_of_two() && exact(w) && exact(r))
                    .then(|| <$t as WithDType>::from_f64(r))
            }
            fn times(self, factor: Self) -> Self {
                self * factor
            }
        }
    };
}

macro_rules! int_element {
    ($t:ty, $variant:ident) => {
        impl Element for $t {
            buffer_variant!($t, $variant);
            fn reduce_sum(acc: Self, x: Self) -> Self {
                acc.wrapping_add(x)
            }
            fn reduce_max(acc: Self, x: Self) -> Self {
                Ord::max(acc, x)
            }
            fn reduce_min(acc: Self, x: Self) -> Self {
                Ord::min(acc, x)
            }
            fn divide(self, world_size: usize) -> Self {
                // In i128 so that a world size beyond the type's range gives
                // the true quotient; it fits back since |q| <= |self|.
                (i128::from(self) / world_size as i128) as $t
            }
            fn exact_reciprocal(_: usize) -> Option<Self> {
                None
            }
            fn times(self, factor: Self) -> Self {
                self.wrapping_mul(factor)
            }
        }
    };
}

float_element!(f32, F32);
float_element!(f64, F64);
float_element!(f16, F16);
float_element!(bf16, BF16);
int_element!(u8, U8);
int_element!(u32, U32);
int_element!(i16, I16);
int_element!(i32, I32);
int_element!(i64, I64);

/// The elements of chunk `chunk` when `len` elements are split into
/// `chunks` contiguous chunks whose sizes differ by at most one (the first
/// `len % chunks` chunks have one more element). `chunks` must be non-zero.
pub(crate) fn chunk_range(len: usize, chunks: usize, chunk: usize) -> Range<usize> {
    let start = |c: usize| c * (len / chunks) + c.min(len % chunks);
    start(chunk)..start(chunk + 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunk_ranges_tile_the_buffer_with_sizes_differing_by_at_most_one() {
        for len in [0, 1, 5, 7, 8, 100] {
            for chunks in 1..=8 {
                let ranges: Vec<_> = (0..chunks).map(|c| chunk_range(len, chunks, c)).collect();
                assert_eq!(ranges[0].start, 0);
                assert_eq!(ranges[chunks - 1].end, len);
                for pair in ranges.windows(2) {
                    assert_eq!(pair[0].end, pair[1].start);
                    assert!(pair[0].len() >= pair[1].len());
                    assert!(pair[0].len() - pair[1].len() <= 1);
                }
            }
        }
    }

    #[test]
    fn float_max_and_min_propagate_nan() {
        assert!(<f32 as Element>::reduce_max(1.0, f32::NAN).is_nan());
        assert!(<f32 as Element>::reduce_min(f32::NAN, 1.0).is_nan());
        assert_eq!(<f32 as Element>::reduce_max(1.0, 2.0), 2.0);
        assert_eq!(<f32 as Element>::reduce_min(1.0, 2.0), 1.0);
    }

    #[test]
    fn integer_sum_wraps_and_avg_truncates_toward_zero() {
        assert_eq!(<u8 as Element>::reduce_sum(200, 100), 44);
        assert_eq!(<i64 as Element>::divide(-7, 2), -3);
        assert_eq!(<u8 as Element>::divide(255, 1000), 0);
    }
}
