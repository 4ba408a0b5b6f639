//! What one pass of a loader loads, batch by batch.

use std::sync::Arc;

use super::{Batch, Dataset, LoaderError};

/// The sample order of one pass.
#[derive(Clone)]
pub(super) enum Indices {
    /// `0..n`, walked lazily: a dataset may report a huge (or unbounded,
    /// `usize::MAX`) length, as PyTorch's samplers allow.
    Range(usize),
    /// An explicit list (a sampler's shard).
    List(Arc<[usize]>),
}

impl Indices {
    fn len(&self) -> usize {
        match self {
            Indices::Range(n) => *n,
            Indices::List(list) => list.len(),
        }
    }

    /// The index at `position` (< `len()`).
    fn at(&self, position: usize) -> usize {
        match self {
            Indices::Range(_) => position,
            Indices::List(list) => list[position],
        }
    }
}

/// What one pass loads: shared by the caller and the prefetch thread.
#[derive(Clone)]
pub(super) struct Plan {
    pub(super) dataset: Arc<dyn Dataset>,
    pub(super) indices: Indices,
    pub(super) batch_size: usize,
    /// The first batch of the pass (a resumed epoch skips the ones before
    /// it without loading them).
    pub(super) first: usize,
    pub(super) num_batches: usize,
    /// Full batches, positions taken modulo the number of indices.
    pub(super) cycle: bool,
}

impl Plan {
    fn batch_indices(&self, batch: usize) -> Result<Vec<usize>, LoaderError> {
        let n = self.indices.len();
        // u128 so that no batch number can overflow the position.
        let start = batch as u128 * self.batch_size as u128;
        let len = if self.cycle {
            if n == 0 {
                return Err(LoaderError::NothingToCycle {
                    num_batches: self.num_batches,
                });
            }
            self.batch_size
        } else {
            // Here batch < ceil(n / batch_size), so start < n: the last
            // batch may be short.
            (n as u128)
                .saturating_sub(start)
                .min(self.batch_size as u128) as usize
        };
        // A batch size beyond memory (over a lazily walked, huge range) is
        // an error, not an abort.
        let mut indices = Vec::new();
        indices
            .try_reserve_exact(len)
            .map_err(|_| LoaderError::BatchTooLarge {
                batch_size: self.batch_size,
            })?;
        indices.extend(
            (start..start + len as u128).map(|p| self.indices.at((p % n as u128) as usize)),
        );
        Ok(indices)
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
