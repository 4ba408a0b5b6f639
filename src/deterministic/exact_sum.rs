//! Sums whose bits do not depend on how the terms are shared among ranks,
//! nor on the order they are added in.
//!
//! Floating-point addition is not associative: one device adding a batch's
//! gradients and two ranks adding halves then each other's give different
//! bits. Here every term is first rounded onto a grid of integers, the
//! same grid on every rank: per element, the largest magnitude any term
//! has (an all-reduce of the maximum, which is exact) fixes its step, fine
//! enough that `terms` integers never exceed 2^53. Integers below 2^53 add
//! exactly in `f64`, in any order and on any rank, so the all-reduced sum
//! of the rounded terms is the same number wherever it was computed; it is
//! scaled back once. The rounding is `2^-(51 - ceil(log2 terms))` of the
//! largest term: for 64 terms about 3e-14 of it, far below `f32`'s 6e-8.
//! The idea is Demmel and Nguyen's pre-rounded reproducible summation.

use candle_core::{DType, Device, Tensor};

use crate::comm::{ProcessGroup, ReduceOp};
use crate::error::{Error, Result};

/// One quantity summed over the chunks: this rank's terms (`None` for a
/// chunk that gave none, as a parameter no chunk's loss reached), and
/// what its sum looks like.
#[derive(Debug)]
pub(crate) struct Terms<'a> {
    /// This rank's terms, in its chunks' order (the order does not matter).
    pub(crate) mine: Vec<Option<&'a Tensor>>,
    /// Its shape.
    pub(crate) dims: &'a [usize],
    /// The dtype and device of its sum.
    pub(crate) dtype: DType,
    pub(crate) device: &'a Device,
}

/// The sums over every rank of `pg` of each quantity's terms, where
/// `total` terms of each are spread over the ranks: each `None` where no
/// rank had a term. Two collectives over the host (`f64`), whatever the
/// number of quantities. Every rank calls it with the same quantities, in
/// the same order.
///
/// # Errors
///
/// [`Error::Fabric`] naming the rank that `failed` (every rank gets it:
/// one that failed before calls it with no terms) or a term of another
/// size than its quantity's; a collective's; a term that cannot be read.
pub(crate) fn exact_sums(
    pg: &dyn ProcessGroup,
    quantities: &[Terms<'_>],
    total: usize,
    failed: bool,
) -> Result<Vec<Option<Tensor>>> {
    let values: Vec<Vec<Vec<f64>>> = quantities
        .iter()
        .map(|q| q.mine.iter().flatten().map(|t| host_f64(t)).collect())
        .collect::<Result<_>>()?;
    let sizes: Vec<usize> = quantities.iter().map(|q| q.dims.iter().product()).collect();
    for ((q, terms), &size) in quantities.iter().zip(&values).zip(&sizes) {
        if let Some(term) = terms.iter().find(|t| t.len() != size) {
            return Err(Error::Fabric(format!(
                "deterministic training: a chunk's term of {} values where {:?} takes {size}",
                term.len(),
                q.dims
            )));
        }
    }
    // The largest magnitude of each element, and after them whether the
    // quantity has a term anywhere (1) or nowhere (0).
    let mut largest: Vec<f64> = Vec::with_capacity(sizes.iter().sum::<usize>() + quantities.len());
    for (terms, &size) in values.iter().zip(&sizes) {
        let start = largest.len();
        largest.resize(start + size, 0.0);
        for term in terms {
            for (l, v) in largest[start..].iter_mut().zip(term) {
                *l = l.max(v.abs());
            }
        }
    }
    largest.extend(
        values
            .iter()
            .map(|terms| f64::from(u8::from(!terms.is_empty()))),
    );
    // Last, whether this rank failed before the sum (its rank + 1): every
    // rank then fails alike instead of waiting in the second all-reduce.
    largest.push(if failed { (pg.rank() + 1) as f64 } else { 0.0 });
    let mut largest = all_reduce_host(pg, largest, ReduceOp::Max)?;
    let failure = largest.pop().unwrap_or(0.0);
    if failure > 0.0 {
        return Err(Error::Fabric(format!(
            "deterministic training: rank {} failed its chunks, so no rank sums this step",
            failure as usize - 1
        )));
    }
    let (largest, present) = largest.split_at(largest.len() - quantities.len());
    let headroom = headroom_bits(total);
    // Each element's grid step (its inverse), once.
    let steps: Vec<f64> = largest.iter().map(|&l| step_inverse(l, headroom)).collect();
    let mut grid = vec![0.0f64; largest.len()];
    let mut offset = 0;
    for (terms, &size) in values.iter().zip(&sizes) {
        let span = offset..offset + size;
        for term in terms {
            for ((g, &v), &step) in grid[span.clone()]
                .iter_mut()
                .zip(term)
                .zip(&steps[span.clone()])
            {
                *g += (v * step).round();
            }
        }
        offset += size;
    }
    let summed = all_reduce_host(pg, grid, ReduceOp::Sum)?;
    let mut out = Vec::with_capacity(quantities.len());
    let mut offset = 0;
    for ((q, &size), &present) in quantities.iter().zip(&sizes).zip(present) {
        let span = offset..offset + size;
        offset += size;
        if present == 0.0 {
            out.push(None);
            continue;
        }
        let sum: Vec<f64> = summed[span.clone()]
            .iter()
            .zip(&steps[span])
            .map(|(&s, &step)| match step {
                // Every term of the element was 0, or NaN (which the
                // maximum passes over): the grid's sum keeps the NaN.
                0.0 if s.is_nan() => f64::NAN,
                0.0 => 0.0,
                step => s / step,
            })
            .collect();
        out.push(Some(
            Tensor::from_vec(sum, q.dims, &Device::Cpu)?
                .to_dtype(q.dtype)?
                .to_device(q.device)?,
        ));
    }
    Ok(out)
}

/// The bits each rounded term keeps below the sum's limit of 2^53:
/// `51 - ceil(log2 total)` (one bit for a term's own magnitude reaching
/// twice its exponent's power, one for the rounding).
fn headroom_bits(total: usize) -> i32 {
    let log2 = usize::BITS - total.max(1).saturating_sub(1).leading_zeros();
    51 - log2 as i32
}

/// `2^(headroom - e)` for `largest` in `[2^e, 2^(e+1))`: the factor that
/// puts a term of magnitude at most `largest` onto the integers below
/// `2^(headroom + 1)`. An exact power of two, so that scaling a term is
/// exact and only the rounding to an integer loses bits. 0 where every
/// term is 0.
fn step_inverse(largest: f64, headroom: i32) -> f64 {
    if largest == 0.0 || !largest.is_finite() {
        // Zeros sum to zero; an inf or NaN is carried through as it is.
        return if largest == 0.0 { 0.0 } else { 1.0 };
    }
    let exponent = ((largest.to_bits() >> 52) & 0x7ff) as i32 - 1023;
    // f64's tiniest values would ask for more than its largest power:
    // a coarser grid there, still the same on every rank.
    2f64.powi((headroom - exponent).min(1000))
}

/// A tensor's values as `f64`, read on the host (exact from any float
/// dtype).
fn host_f64(t: &Tensor) -> Result<Vec<f64>> {
    Ok(t.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?)
}

/// An all-reduce of host values.
fn all_reduce_host(pg: &dyn ProcessGroup, values: Vec<f64>, op: ReduceOp) -> Result<Vec<f64>> {
    let n = values.len();
    if n == 0 {
        return Ok(values);
    }
    let t = Tensor::from_vec(values, n, &Device::Cpu)?;
    Ok(pg.all_reduce(&t, op)?.to_vec1::<f64>()?)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 12 terms of 5 elements: the first two cancel at 1e30, the rest
    /// spread over 6 orders (plain addition then depends on the order),
    /// the same on every call.
    fn terms() -> Vec<Vec<f32>> {
        (0..12)
            .map(|t| {
                (0..5)
                    .map(|e| match t {
                        0 => 1e30 * (e + 1) as f32,
                        1 => -1e30 * (e + 1) as f32,
                        t => {
                            let sign = if (t * 7 + e * 3) % 5 < 2 { -1.0 } else { 1.0 };
                            let scale = 10f32.powi((t * 11 + e * 5) % 7 - 3);
                            sign * scale * (1.0 + (t * 13 + e) as f32 / 17.0)
                        }
                    })
                    .collect()
            })
            .collect()
    }

    /// The sum of `terms` shared over `ranks` thread ranks, each adding
    /// its consecutive share in reverse order.
    fn summed_on(ranks: usize) -> Vec<u32> {
        let all = terms();
        let out = crate::launch::spawn(ranks, move |ctx| {
            let per = all.len() / ranks;
            let mine: Vec<Tensor> = all[ctx.rank * per..(ctx.rank + 1) * per]
                .iter()
                .rev()
                .map(|v| Tensor::new(v.as_slice(), &Device::Cpu))
                .collect::<candle_core::Result<_>>()?;
            let dims = [5];
            let quantity = Terms {
                mine: mine.iter().map(Some).collect(),
                dims: &dims,
                dtype: DType::F32,
                device: &Device::Cpu,
            };
            let sum = exact_sums(ctx.process_group().as_ref(), &[quantity], all.len(), false)?;
            let sum = sum[0].as_ref().map(|t| t.to_vec1::<f32>()).transpose()?;
            Ok(sum.unwrap_or_default())
        })
        .expect("the ranks");
        out[0].iter().map(|v| v.to_bits()).collect()
    }

    #[test]
    fn the_sum_is_the_same_bits_on_any_split_and_order_where_plain_addition_is_not() {
        let one = summed_on(1);
        for ranks in [2, 3, 4, 6, 12] {
            assert_eq!(summed_on(ranks), one, "{ranks} ranks");
        }
        // Plain f64 addition of the same terms, forwards and backwards,
        // differs: the test above could fail.
        let all = terms();
        let plain = |order: &mut dyn Iterator<Item = &Vec<f32>>| {
            let mut sum = [0f64; 5];
            for term in order {
                for (s, &v) in sum.iter_mut().zip(term) {
                    *s += f64::from(v);
                }
            }
            sum.iter()
                .map(|&s| (s as f32).to_bits())
                .collect::<Vec<_>>()
        };
        assert_ne!(plain(&mut all.iter()), plain(&mut all.iter().rev()));
    }

    #[test]
    fn a_nan_or_inf_term_is_carried_into_the_sum_on_every_split() {
        // Element 0: NaN in one chunk, zeros elsewhere; element 1: NaN
        // everywhere; element 2: +inf; element 3: finite.
        let out = crate::launch::spawn(2, |ctx| {
            let term = match ctx.rank {
                0 => [f32::NAN, f32::NAN, f32::INFINITY, 1.5],
                _ => [0.0, f32::NAN, 2.0, 2.5],
            };
            let t = Tensor::new(&term, &Device::Cpu)?;
            let dims = [4];
            let quantity = Terms {
                mine: vec![Some(&t)],
                dims: &dims,
                dtype: DType::F32,
                device: &Device::Cpu,
            };
            let sum = exact_sums(ctx.process_group().as_ref(), &[quantity], 2, false)?;
            Ok(sum[0].as_ref().map(|t| t.to_vec1::<f32>()).transpose()?)
        })
        .expect("the ranks");
        let sum = out[0].clone().expect("a sum");
        assert!(sum[0].is_nan() && sum[1].is_nan(), "{sum:?}");
        assert_eq!(sum[2], f32::INFINITY);
        assert_eq!(sum[3], 4.0);
    }

    #[test]
    fn a_rank_that_failed_fails_every_rank_naming_it() {
        let out = crate::launch::spawn(3, |ctx| {
            let dims = [2];
            let t = Tensor::new(&[1f32, 2.0], &Device::Cpu)?;
            let mine = match ctx.rank {
                1 => vec![],
                _ => vec![Some(&t)],
            };
            let quantity = Terms {
                mine,
                dims: &dims,
                dtype: DType::F32,
                device: &Device::Cpu,
            };
            let failed = ctx.rank == 1;
            let sum = exact_sums(ctx.process_group().as_ref(), &[quantity], 3, failed);
            Ok(sum.map(|_| ()).map_err(|e| e.to_string()))
        })
        .expect("the ranks");
        for error in out {
            let error = error.expect_err("every rank fails");
            assert!(error.contains("rank 1 failed its chunks"), "{error}");
        }
    }

    #[test]
    fn headroom_leaves_the_sum_of_every_term_below_two_to_the_53() {
        assert_eq!(headroom_bits(1), 51);
        assert_eq!(headroom_bits(2), 50);
        assert_eq!(headroom_bits(8), 48);
        assert_eq!(headroom_bits(9), 47);
        // Every term below 2^(headroom + 1): their sum below 2^52.
        for total in 1..=1024usize {
            let bound = total as f64 * 2f64.powi(headroom_bits(total) + 1);
            assert!(bound <= 2f64.powi(52), "{total}");
        }
    }

    #[test]
    fn the_step_is_a_power_of_two_that_puts_the_largest_below_the_bound() {
        for largest in [1e-30, 3.5e-8, 0.75, 1.0, 1.5, 1e20, f64::from(f32::MAX)] {
            let s = step_inverse(largest, 40);
            assert_eq!(
                s.to_bits() & ((1 << 52) - 1),
                0,
                "{largest}: not a power of two"
            );
            assert!(largest * s < 2f64.powi(41) && largest * s >= 2f64.powi(40));
        }
        assert_eq!(step_inverse(0.0, 40), 0.0);
    }
}
