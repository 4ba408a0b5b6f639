//! The sample keys each replica's part of a batch carries, so that keyed
//! dropout ([`crate::ops::dropout`]) on a replica's thread draws, for its
//! rows, the masks one device draws for them.

use super::scatter_gather::{batch_rows, Scatter};
use crate::ops::dropout::{sample_keys, SampleKeys};

/// This thread's sample keys (a Fabric step's) moved on, for each part, by
/// the rows of the parts before it. `None` for every part where the
/// caller set no keys, or where the batch is split along another
/// dimension than its rows (the keys name rows).
pub(super) fn part_keys<I: Scatter>(parts: &[I], dim: usize) -> Vec<Option<SampleKeys>> {
    let Some(keys) = sample_keys().filter(|_| dim == 0) else {
        return vec![None; parts.len()];
    };
    let mut first = keys.first;
    parts
        .iter()
        .map(|part| {
            let part_keys = SampleKeys { first, ..keys };
            first += batch_rows(part, dim).unwrap_or(0) as u64;
            Some(part_keys)
        })
        .collect()
}
