//! What one pass of a loader loads, batch by batch.

use std::sync::Arc;

use super::{Batch, Dataset, LoaderError};

/// What one pass loads: shared by the caller and the prefetch thread.
#[derive(Clone)]
pub(super) struct Plan {
    pub(super) dataset: Arc<dyn Dataset>,
    pub(super) indices: Arc<[usize]>,
    pub(super) batch_size: usize,
    pub(super) num_batches: usize,
    /// Full batches, positions taken modulo the number of indices.
    pub(super) cycle: bool,
}

impl Plan {
    fn batch_indices(&self, batch: usize) -> Result<Vec<usize>, LoaderError> {
        let n = self.indices.len();
        if self.cycle {
            if n == 0 {
                return Err(LoaderError::NothingToCycle {
                    num_batches: self.num_batches,
                });
            }
            // u128 so that no batch number can overflow the position.
            let start = batch as u128 * self.batch_size as u128;
            let mut indices = Vec::new();
            indices
                .try_reserve_exact(self.batch_size)
                .map_err(|_| LoaderError::BatchTooLarge {
                    batch_size: self.batch_size,
                })?;
            indices.extend(
                (0..self.batch_size as u128)
                    .map(|i| self.indices[((start + i) % n as u128) as usize]),
            );
            Ok(indices)
        } else {
            // Here batch < ceil(n / batch_size), so start < n.
            let start = batch * self.batch_size;
            let end = n.min(start + self.batch_size);
            Ok(self.indices[start..end].to_vec())
        }
    }

    pub(super) fn load(&self, batch: usize) -> Result<Batch, LoaderError> {
        let indices = self.batch_indices(batch)?;
        let len = self.dataset.len();
        if let Some(&index) = indices.iter().find(|&&i| i >= len) {
            return Err(LoaderError::IndexOutOfRange { index, len });
        }
        self.dataset.get_batch(&indices)
    }
}
