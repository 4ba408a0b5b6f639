//! Which rank owns (updates, and holds the optimizer state and, at stage
//! 2, the gradient of) each parameter.

use candle_core::Var;

use crate::comm::{all_gather_object, ProcessGroup};
use crate::error::{Error, Result};

/// The owner of every parameter, as PyTorch's `ZeroRedundancyOptimizer`
/// partitions them: parameters are taken largest first (by bytes; equal
/// sizes in their order), each given to the rank that owns the fewest bytes
/// so far (the lowest such rank on a tie). A parameter is never split, so
/// with more ranks than parameters some ranks own none.
///
/// ```
/// use candle_dp::zero::Partition;
///
/// // Four parameters' bytes on 2 ranks: 400 -> rank 0, 300 and 100 -> rank 1,
/// // then 40 -> rank 0 (both own 400: the lower rank).
/// let p = Partition::by_size(&[40, 400, 300, 100], 2);
/// assert_eq!(p.owners(), &[0, 0, 1, 1]);
/// assert_eq!((p.bytes_of(0), p.bytes_of(1)), (440, 400));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Partition {
    owners: Vec<usize>,
    bytes: Vec<usize>,
}

impl Partition {
    /// The partition of parameters of `sizes` bytes (in their order) among
    /// `world` ranks.
    pub fn by_size(sizes: &[usize], world: usize) -> Self {
        let world = world.max(1);
        let mut order: Vec<usize> = (0..sizes.len()).collect();
        // Stable: equal sizes keep their order, as PyTorch's `sorted`.
        order.sort_by(|&a, &b| sizes[b].cmp(&sizes[a]));
        let mut bytes = vec![0usize; world];
        let mut owners = vec![0usize; sizes.len()];
        for i in order {
            // The first of the smallest totals: ties go to the lowest rank.
            let rank = (0..world).fold(0, |best, r| if bytes[r] < bytes[best] { r } else { best });
            owners[i] = rank;
            bytes[rank] += sizes[i];
        }
        Self { owners, bytes }
    }

    /// The partition of `params` (their bytes) among `world` ranks.
    pub fn of_vars(params: &[(String, Var)], world: usize) -> Self {
        let sizes: Vec<usize> = params
            .iter()
            .map(|(_, v)| v.elem_count() * v.dtype().size_in_bytes())
            .collect();
        Self::by_size(&sizes, world)
    }

    /// The owning rank of each parameter, in the parameters' order.
    pub fn owners(&self) -> &[usize] {
        &self.owners
    }

    /// Whether `rank` owns parameter `index`.
    pub fn owns(&self, rank: usize, index: usize) -> bool {
        self.owners.get(index) == Some(&rank)
    }

    /// The bytes of parameters `rank` owns.
    pub fn bytes_of(&self, rank: usize) -> usize {
        self.bytes.get(rank).copied().unwrap_or(0)
    }

    /// The number of ranks.
    pub fn world_size(&self) -> usize {
        self.bytes.len()
    }

    /// Checks that every rank of `pg` computed this same partition of
    /// `params`: [`Error::ZeroPartitionMismatch`] naming the first rank
    /// and parameter that differ, on every rank.
    pub fn check_agreed(&self, pg: &dyn ProcessGroup, params: &[(String, Var)]) -> Result<()> {
        let all = all_gather_object(pg, &self.owners)?;
        for (rank, owners) in all.iter().enumerate() {
            if owners == &all[0] {
                continue;
            }
            let detail = match owners.iter().zip(&all[0]).position(|(a, b)| a != b) {
                Some(i) => format!(
                    "`{}` goes to rank {} there and to rank {} on rank 0",
                    params.get(i).map_or("?", |(name, _)| name.as_str()),
                    owners[i],
                    all[0][i]
                ),
                None => format!(
                    "{} parameters there, {} on rank 0",
                    owners.len(),
                    all[0].len()
                ),
            };
            return Err(Error::ZeroPartitionMismatch { rank, detail });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_largest_go_first_to_the_least_loaded_rank_and_ties_to_the_lowest() {
        // PyTorch's _partition_parameters on numel [10, 30, 20, 20, 5]:
        // 30 -> 0, 20 -> 1, 20 -> 2, 10 -> 1 (1 and 2 tie at 20: lowest), 5 -> 2.
        let p = Partition::by_size(&[10, 30, 20, 20, 5], 3);
        assert_eq!(p.owners(), &[1, 0, 1, 2, 2]);
        assert_eq!((p.bytes_of(0), p.bytes_of(1), p.bytes_of(2)), (30, 30, 25));
    }

    #[test]
    fn more_ranks_than_parameters_leave_ranks_without_any() {
        let p = Partition::by_size(&[8, 4], 4);
        assert_eq!(p.owners(), &[0, 1]);
        assert_eq!(p.bytes_of(3), 0);
        assert!(!p.owns(3, 0) && !p.owns(3, 1));
    }

    #[test]
    fn one_rank_owns_everything() {
        let p = Partition::by_size(&[3, 1, 2], 1);
        assert_eq!(p.owners(), &[0, 0, 0]);
    }
}
