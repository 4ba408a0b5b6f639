//! Weights tied across a [`RankPipeline`](super::RankPipeline)'s ranks: a
//! variable that stages on several ranks use (the language model's
//! embedding and head) gets a group of those ranks, in which its
//! gradients are summed.

use candle_core::Var;

use crate::comm::{all_gather_object, ProcessGroup, SubGroup};
use crate::error::{Error, Result};

/// The variables of `own` that stages on other ranks use too (tied
/// weights), each with a group of the ranks that use it, made here (every
/// rank takes part in every group's making, in name order), and its value
/// copied from the lowest of them, so that all start equal.
pub(super) fn tie_across_ranks(
    pg: &dyn ProcessGroup,
    own: &[(String, Var)],
) -> Result<Vec<(String, SubGroup)>> {
    let mine: Vec<String> = own.iter().map(|(name, _)| name.clone()).collect();
    let all: Vec<Vec<String>> = all_gather_object(pg, &mine)?;
    let mut users: std::collections::BTreeMap<&String, Vec<usize>> = Default::default();
    for (rank, names) in all.iter().enumerate() {
        for name in names {
            users.entry(name).or_default().push(rank);
        }
    }
    let mut tied = Vec::new();
    for (name, ranks) in users.into_iter().filter(|(_, r)| r.len() > 1) {
        let Some(group) = pg.new_group(&ranks)? else {
            continue;
        };
        let var = own
            .iter()
            .find(|(own_name, _)| own_name == name)
            .map(|(_, var)| var.clone())
            .ok_or_else(|| {
                Error::Candle(candle_core::Error::Msg(format!("`{name}` is not held")))
            })?;
        var.set(&group.broadcast(var.as_tensor(), 0)?)?;
        tied.push((name.clone(), group));
    }
    Ok(tied)
}
