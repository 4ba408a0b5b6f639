//! Sub-groups: the colour a rank passes to
//! [`ProcessGroup::split`](super::ProcessGroup::split), who ends up in which
//! sub-group (written once for every group type), and `new_group` on top
//! of the split.

use std::sync::Arc;

use super::{all_gather_object, CommError, ProcessGroup, Result};

/// A sub-group made by [`ProcessGroup::split`] or
/// [`ProcessGroup::new_group`]: a group like any other.
pub type SubGroup = Arc<dyn ProcessGroup>;

/// Which sub-group a rank joins in [`ProcessGroup::split`]: ranks of one
/// colour form one group; [`Color::NONE`] (MPI's `MPI_UNDEFINED`) joins
/// none.
///
/// ```
/// use candle_dp::comm::Color;
///
/// assert_eq!(Color::new(3).value(), Some(3));
/// assert_eq!(Color::NONE.value(), None);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct Color(Option<u32>);

impl Color {
    /// No sub-group: the rank takes part in the split and gets `None`.
    pub const NONE: Color = Color(None);

    /// The colour `value`.
    pub const fn new(value: u32) -> Color {
        Color(Some(value))
    }

    /// The colour's value; `None` for [`Color::NONE`].
    pub const fn value(self) -> Option<u32> {
        self.0
    }
}

/// The members of `color`'s sub-group, as ranks of the parent, in their
/// order in the sub-group: by key, ties by parent rank. `choices[r]` is
/// rank `r`'s colour and key. Empty for [`Color::NONE`].
pub(crate) fn members(choices: &[(Color, i64)], color: Color) -> Vec<usize> {
    if color == Color::NONE {
        return Vec::new();
    }
    let mut members: Vec<usize> = (0..choices.len())
        .filter(|&r| choices[r].0 == color)
        .collect();
    members.sort_by_key(|&r| (choices[r].1, r));
    members
}

/// [`ProcessGroup::new_group`] through [`ProcessGroup::split`]: the ranks
/// first agree on the list, then the members split off in its order.
pub(crate) fn new_group_by_split<P: ProcessGroup + ?Sized>(
    pg: &P,
    ranks: &[usize],
) -> Result<Option<SubGroup>> {
    let me = pg.rank();
    let invalid = |culprit: usize, reason: String| CommError::InvalidInput {
        rank: me,
        op: "new_group",
        culprit,
        reason,
    };
    let lists = all_gather_object(pg, &ranks.to_vec())?;
    if let Some(culprit) = lists.iter().position(|list| list != &lists[0]) {
        return Err(invalid(
            culprit,
            format!(
                "its ranks {:?} differ from rank 0's {:?}; every rank must pass the same list",
                lists[culprit], lists[0]
            ),
        ));
    }
    let world = pg.world_size();
    if let Some(&bad) = ranks.iter().find(|&&r| r >= world) {
        return Err(invalid(
            0,
            format!("rank {bad} is not in a group of {world}"),
        ));
    }
    if let Some((i, &r)) = ranks
        .iter()
        .enumerate()
        .find(|(i, r)| ranks[..*i].contains(r))
    {
        return Err(invalid(0, format!("rank {r} is listed twice (at {i})")));
    }
    let position = ranks.iter().position(|&r| r == me);
    let color = position.map_or(Color::NONE, |_| Color::new(0));
    pg.split(color, position.unwrap_or(0) as i64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn members_are_ordered_by_key_then_by_rank() {
        let a = Color::new(1);
        let b = Color::new(2);
        let choices = [(a, 5), (b, 0), (a, -1), (Color::NONE, 0), (a, 5)];
        assert_eq!(members(&choices, a), [2, 0, 4]);
        assert_eq!(members(&choices, b), [1]);
        assert!(members(&choices, Color::NONE).is_empty());
    }
}
