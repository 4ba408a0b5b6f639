//! The element loops of a reduction: combining one rank's values into the
//! partial result of the ranks before it, in the reduction's order, and
//! the division of an average. Each loop is compiled for AVX2 as well and
//! picked at run time (the same operations on each element, so the same
//! bits), and the average divides by a multiplication where that gives
//! the same bits.

use std::mem::MaybeUninit;

use super::buffer::{match_buffer, Buffer, Element};
use super::shared_output::fill_zip;
use super::ReduceOp;

/// `acc[i] = acc[i] ⊕ x[i]`, with `acc` holding the partial result of the
/// ranks before. One loop per op so that each one vectorizes.
#[multiversion::multiversion(targets("x86_64+avx2"))]
pub(crate) fn combine_into<T: Element>(op: ReduceOp, acc: &mut [T], x: &[T]) {
    debug_assert_eq!(acc.len(), x.len());
    let pairs = acc.iter_mut().zip(x);
    match op {
        ReduceOp::Sum | ReduceOp::Avg => pairs.for_each(|(a, &b)| *a = T::reduce_sum(*a, b)),
        ReduceOp::Max => pairs.for_each(|(a, &b)| *a = T::reduce_max(*a, b)),
        ReduceOp::Min => pairs.for_each(|(a, &b)| *a = T::reduce_min(*a, b)),
    }
}

/// `x[i] = earlier[i] ⊕ x[i]`: [`combine_into`] with the result written
/// over the later operand, so a ring can reduce in its input buffer while
/// keeping the thread group's operand order.
#[cfg(feature = "mpi")]
#[multiversion::multiversion(targets("x86_64+avx2"))]
pub(crate) fn combine_over<T: Element>(op: ReduceOp, earlier: &[T], x: &mut [T]) {
    debug_assert_eq!(earlier.len(), x.len());
    let pairs = x.iter_mut().zip(earlier);
    match op {
        ReduceOp::Sum | ReduceOp::Avg => pairs.for_each(|(x, &a)| *x = T::reduce_sum(a, *x)),
        ReduceOp::Max => pairs.for_each(|(x, &a)| *x = T::reduce_max(a, *x)),
        ReduceOp::Min => pairs.for_each(|(x, &a)| *x = T::reduce_min(a, *x)),
    }
}

/// [`combine_into`] then [`finish`] in one pass: the last combination of
/// a ring's chunk. The same operations on each element as the two passes,
/// so the same bits, without reading and writing the chunk a second time.
#[cfg(feature = "mpi")]
#[multiversion::multiversion(targets("x86_64+avx2"))]
pub(crate) fn combine_into_finished<T: Element>(
    op: ReduceOp,
    acc: &mut [T],
    x: &[T],
    world_size: usize,
) {
    debug_assert_eq!(acc.len(), x.len());
    let divide = divider(world_size);
    match op {
        ReduceOp::Avg => acc
            .iter_mut()
            .zip(x)
            .for_each(|(a, &b)| *a = divide(T::reduce_sum(*a, b))),
        _ => combine_into(op, acc, x),
    }
}

/// [`combine_over`] then [`finish`] in one pass, as
/// [`combine_into_finished`].
#[cfg(feature = "mpi")]
#[multiversion::multiversion(targets("x86_64+avx2"))]
pub(crate) fn combine_over_finished<T: Element>(
    op: ReduceOp,
    earlier: &[T],
    x: &mut [T],
    world_size: usize,
) {
    debug_assert_eq!(earlier.len(), x.len());
    let divide = divider(world_size);
    match op {
        ReduceOp::Avg => x
            .iter_mut()
            .zip(earlier)
            .for_each(|(x, &a)| *x = divide(T::reduce_sum(a, *x))),
        _ => combine_over(op, earlier, x),
    }
}

/// Appends `a[i] ⊕ b[i]` to `out`, with `a` holding the values of the
/// earlier rank in the reduction order. One loop per op, as
/// [`combine_into`].
#[multiversion::multiversion(targets("x86_64+avx2"))]
pub(crate) fn extend_combined<T: Element>(op: ReduceOp, out: &mut Vec<T>, a: &[T], b: &[T]) {
    debug_assert_eq!(a.len(), b.len());
    let pairs = a.iter().zip(b);
    match op {
        ReduceOp::Sum | ReduceOp::Avg => out.extend(pairs.map(|(&a, &b)| T::reduce_sum(a, b))),
        ReduceOp::Max => out.extend(pairs.map(|(&a, &b)| T::reduce_max(a, b))),
        ReduceOp::Min => out.extend(pairs.map(|(&a, &b)| T::reduce_min(a, b))),
    }
}

/// Writes `a[i] ⊕ b[i]` into `out` (of their length) and returns it
/// initialized, as [`extend_combined`] appends them; `None` if the lengths
/// differ.
#[multiversion::multiversion(targets("x86_64+avx2"))]
pub(crate) fn fill_combined<'a, T: Element>(
    op: ReduceOp,
    out: &'a mut [MaybeUninit<T>],
    a: &[T],
    b: &[T],
) -> Option<&'a mut [T]> {
    match op {
        ReduceOp::Sum | ReduceOp::Avg => fill_zip(out, a, b, T::reduce_sum),
        ReduceOp::Max => fill_zip(out, a, b, T::reduce_max),
        ReduceOp::Min => fill_zip(out, a, b, T::reduce_min),
    }
}

/// [`fill_combined`] of `Avg` and [`finish`] in one pass: `(a + b) /
/// world_size`, the same operations on each element as the two passes.
#[multiversion::multiversion(targets("x86_64+avx2"))]
pub(crate) fn fill_combined_finished<'a, T: Element>(
    out: &'a mut [MaybeUninit<T>],
    a: &[T],
    b: &[T],
    world_size: usize,
) -> Option<&'a mut [T]> {
    let divide = divider(world_size);
    fill_zip(out, a, b, |a, b| divide(T::reduce_sum(a, b)))
}

/// The last step of a reduction: divides by the world size for `Avg`.
#[multiversion::multiversion(targets("x86_64+avx2"))]
pub(crate) fn finish<T: Element>(op: ReduceOp, values: &mut [T], world_size: usize) {
    if op == ReduceOp::Avg {
        let divide = divider(world_size);
        values.iter_mut().for_each(|v| *v = divide(*v));
    }
}

/// `x / world_size` as [`Element::divide`] gives it, by a multiplication
/// where that gives the same bits ([`Element::exact_reciprocal`]): a
/// vector division costs several times a multiplication, and held the
/// two-rank average to about one cycle an element.
fn divider<T: Element>(world_size: usize) -> impl Fn(T) -> T + Copy {
    let reciprocal = T::exact_reciprocal(world_size);
    move |x| match reciprocal {
        Some(r) => x.times(r),
        None => x.divide(world_size),
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

#[cfg(test)]
mod tests {
    use super::*;

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

    /// Every float type's values, subnormals, extremes and random bits.
    fn values<T: Element>() -> Vec<T> {
        let mut bits: u32 = 0x2545_f491;
        let mut v: Vec<f64> = vec![0.0, -0.0, 1.0, -3.0, 1e-40, f64::MAX, f64::MIN_POSITIVE];
        v.extend([f64::INFINITY, f64::NEG_INFINITY, 65504.0, 6e-8, 1e-300]);
        for _ in 0..2000 {
            bits ^= bits << 13;
            bits ^= bits >> 17;
            bits ^= bits << 5;
            v.push(f64::from(f32::from_bits(bits)));
        }
        v.into_iter().map(T::from_f64).collect()
    }

    fn same_bits_as_division<T: Element>() {
        for world in [
            1,
            2,
            3,
            4,
            5,
            7,
            8,
            64,
            1000,
            1024,
            1 << 16,
            1 << 20,
            1 << 30,
        ] {
            let divide = divider::<T>(world);
            for x in values::<T>() {
                let (got, want) = (divide(x).to_f64(), x.divide(world).to_f64());
                assert!(
                    got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                    "{:?} {} / {world}: {got} against {want}",
                    T::DTYPE,
                    x.to_f64()
                );
            }
        }
    }

    #[test]
    fn an_average_divided_by_multiplication_has_the_bits_of_the_division() {
        same_bits_as_division::<f32>();
        same_bits_as_division::<f64>();
        same_bits_as_division::<half::f16>();
        same_bits_as_division::<half::bf16>();
        // The multiplication only where it is exact: a power of two that
        // the type and its reciprocal both hold.
        assert!(<f32 as Element>::exact_reciprocal(3).is_none());
        assert!(<half::f16 as Element>::exact_reciprocal(1 << 20).is_none());
        assert_eq!(<f32 as Element>::exact_reciprocal(4), Some(0.25));
        assert!(<i64 as Element>::exact_reciprocal(2).is_none());
    }
}
