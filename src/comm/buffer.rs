//! Host buffers: the form in which tensor data travels between ranks, and the
//! element-wise reductions on them.
//!
//! A tensor is flattened into a typed `Vec` once on the sending side and
//! rebuilt once on the receiving side; in between, buffers move (or are
//! shared through an `Arc`) without copies.

use std::ops::Range;

use candle_core::{DType, Device, Tensor, WithDType};
use half::{bf16, f16};

use super::ReduceOp;

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

impl Buffer {
    /// Copies a tensor's elements (in row-major order) to the host.
    ///
    /// The error is a message for [`CommError::InvalidInput`](super::CommError),
    /// which every rank reports.
    pub(crate) fn from_tensor(tensor: &Tensor) -> Result<Buffer, String> {
        let flat = tensor.flatten_all().map_err(|e| e.to_string())?;
        let buffer = match tensor.dtype() {
            DType::U8 => flat.to_vec1().map(Buffer::U8),
            DType::U32 => flat.to_vec1().map(Buffer::U32),
            DType::I16 => flat.to_vec1().map(Buffer::I16),
            DType::I32 => flat.to_vec1().map(Buffer::I32),
            DType::I64 => flat.to_vec1().map(Buffer::I64),
            DType::BF16 => flat.to_vec1().map(Buffer::BF16),
            DType::F16 => flat.to_vec1().map(Buffer::F16),
            DType::F32 => flat.to_vec1().map(Buffer::F32),
            DType::F64 => flat.to_vec1().map(Buffer::F64),
            other => {
                return Err(format!(
                    "dtype {} is not supported by collectives",
                    other.as_str()
                ))
            }
        };
        buffer.map_err(|e| e.to_string())
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

/// An element type that buffers hold and reductions combine.
pub(crate) trait Element: WithDType {
    /// Wraps a vector in its [`Buffer`] variant.
    fn into_buffer(values: Vec<Self>) -> Buffer;
    /// The vector of a buffer of this type, `None` for another type.
    fn from_buffer(buffer: Buffer) -> Option<Vec<Self>>;
    /// The elements of a buffer of this type, `None` for another type.
    fn slice_of(buffer: &Buffer) -> Option<&[Self]>;
    /// `acc ⊕ x` for `Sum` and `Avg` (the division comes last).
    fn reduce_sum(acc: Self, x: Self) -> Self;
    /// The larger of the two (NaN wins, for floats).
    fn reduce_max(acc: Self, x: Self) -> Self;
    /// The smaller of the two (NaN wins, for floats).
    fn reduce_min(acc: Self, x: Self) -> Self;
    /// `self / world_size`, the last step of `Avg`.
    fn divide(self, world_size: usize) -> Self;
}

macro_rules! buffer_variant {
    ($t:ty, $variant:ident) => {
        fn into_buffer(values: Vec<Self>) -> Buffer {
            Buffer::$variant(values)
        }
        fn from_buffer(buffer: Buffer) -> Option<Vec<Self>> {
            match buffer {
                Buffer::$variant(values) => Some(values),
                _ => None,
            }
        }
        fn slice_of(buffer: &Buffer) -> Option<&[Self]> {
            match buffer {
                Buffer::$variant(values) => Some(values),
                _ => None,
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

/// `acc[i] = acc[i] ⊕ x[i]`, with `acc` holding the partial result of the
/// ranks before. One loop per op so that each one vectorizes.
pub(crate) fn combine_into<T: Element>(op: ReduceOp, acc: &mut [T], x: &[T]) {
    debug_assert_eq!(acc.len(), x.len());
    let pairs = acc.iter_mut().zip(x);
    match op {
        ReduceOp::Sum | ReduceOp::Avg => pairs.for_each(|(a, &b)| *a = T::reduce_sum(*a, b)),
        ReduceOp::Max => pairs.for_each(|(a, &b)| *a = T::reduce_max(*a, b)),
        ReduceOp::Min => pairs.for_each(|(a, &b)| *a = T::reduce_min(*a, b)),
    }
}

/// The last step of a reduction: divides by the world size for `Avg`.
pub(crate) fn finish<T: Element>(op: ReduceOp, values: &mut [T], world_size: usize) {
    if op == ReduceOp::Avg {
        values.iter_mut().for_each(|v| *v = v.divide(world_size));
    }
}

/// Reduces the ranks' buffers in rank order:
/// `((x_0 ⊕ x_1) ⊕ x_2) ⊕ … ⊕ x_{n-1}`, then [`finish`].
///
/// `None` when the buffers differ in type or length (the caller has checked
/// that they do not) or there are none.
pub(crate) fn reduce_in_rank_order(parts: &[&Buffer], op: ReduceOp) -> Option<Buffer> {
    let (first, rest) = parts.split_first()?;
    match_buffer!(first, v => reduce_typed(v, rest, op, parts.len()))
}

fn reduce_typed<T: Element>(
    first: &[T],
    rest: &[&Buffer],
    op: ReduceOp,
    world_size: usize,
) -> Option<Buffer> {
    let mut acc = first.to_vec();
    for part in rest {
        let x = T::slice_of(part).filter(|x| x.len() == acc.len())?;
        combine_into(op, &mut acc, x);
    }
    finish(op, &mut acc, world_size);
    Some(T::into_buffer(acc))
}

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

    #[test]
    fn rank_order_reduction_rejects_mismatched_buffers() {
        let a = Buffer::F32(vec![1.0]);
        let b = Buffer::F64(vec![1.0]);
        let c = Buffer::F32(vec![1.0, 2.0]);
        assert_eq!(reduce_in_rank_order(&[&a, &b], ReduceOp::Sum), None);
        assert_eq!(reduce_in_rank_order(&[&a, &c], ReduceOp::Sum), None);
        assert_eq!(reduce_in_rank_order(&[], ReduceOp::Sum), None);
        assert_eq!(
            reduce_in_rank_order(&[&a, &a, &a], ReduceOp::Avg),
            Some(Buffer::F32(vec![1.0]))
        );
    }
}
