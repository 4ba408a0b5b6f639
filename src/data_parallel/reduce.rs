//! Reducing replica gradients onto the master: the backward of PyTorch's
//! `Broadcast` (`comm.reduce_add`), a sum per variable.
//!
//! The sum always runs in replica order, so the result does not depend on
//! which thread computes it: [`DataParallel`](crate::DataParallel) splits
//! the variables between its idle replica workers and reduces them in
//! parallel, with results bit-identical to a serial reduction.

use candle_core::{Device, Tensor};

/// Sums the gradients of one variable from every replica (skipping replicas
/// that produced none), in replica order, on `device`.
///
/// ```
/// use candle_core::{Device, Tensor};
/// use candle_dp::reduce::sum_gradients;
///
/// let a = Tensor::new(&[1f32, 2.], &Device::Cpu)?;
/// let b = Tensor::new(&[10f32, 20.], &Device::Cpu)?;
/// let sum = sum_gradients(&[Some(a), None, Some(b)], &Device::Cpu)?.unwrap();
/// assert_eq!(sum.to_vec1::<f32>()?, vec![11., 22.]);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn sum_gradients(
    parts: &[Option<Tensor>],
    device: &Device,
) -> candle_core::Result<Option<Tensor>> {
    let mut sum: Option<Tensor> = None;
    for grad in parts.iter().flatten() {
        let grad = crate::device_copy::to_device(grad, device)?;
        sum = Some(match sum {
            None => grad,
            Some(acc) => (acc + grad)?,
        });
    }
    Ok(sum)
}

/// Splits variable indices `0..sizes.len()` into `parts` groups of about
/// equal total size (largest first, each to the lightest group), so that
/// reducing them takes about the same time on every worker.
pub(crate) fn balanced_partition(sizes: &[usize], parts: usize) -> Vec<Vec<usize>> {
    let mut order: Vec<usize> = (0..sizes.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(sizes[i]));
    let mut groups: Vec<(usize, Vec<usize>)> = vec![(0, Vec::new()); parts.max(1)];
    for i in order {
        // `groups` has at least one entry (`parts.max(1)`).
        if let Some(lightest) = groups.iter_mut().min_by_key(|g| g.0) {
            lightest.0 += sizes[i];
            lightest.1.push(i);
        }
    }
    groups.into_iter().map(|g| g.1).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partition_covers_every_variable_once_and_balances_sizes() {
        let sizes = [1000, 10, 800, 200, 5, 5];
        let groups = balanced_partition(&sizes, 2);
        let mut all: Vec<usize> = groups.concat();
        all.sort();
        assert_eq!(all, (0..sizes.len()).collect::<Vec<_>>());
        let totals: Vec<usize> = groups
            .iter()
            .map(|g| g.iter().map(|&i| sizes[i]).sum())
            .collect();
        assert_eq!(totals, vec![1010, 1010]);
    }
}
