//! [`TpPlan`]: which of a model's parameters are split over the
//! tensor-parallel ranks, and how (PyTorch's `parallelize_module` plan,
//! written as the placements of the parameters it produces).

use std::fmt;

use super::placement::Placement;
use crate::error::{Error, Result};

/// The placements of a model's parameters, by name pattern: a pattern is
/// a parameter's dotted name in which `*` stands for any one part
/// (`h.*.mlp.c_fc.weight`). The first pattern that matches a name gives
/// its placement; a name that none matches is replicated.
///
/// ```
/// use candle_dp::tensor_parallel::{Placement, TpPlan};
///
/// let plan = TpPlan::new()
///     .with("h.*.mlp.c_fc.weight", Placement::Shard(0))
///     .with("h.*.mlp.c_proj.weight", Placement::Shard(1));
/// assert_eq!(plan.placement("h.3.mlp.c_fc.weight"), Placement::Shard(0));
/// assert_eq!(plan.placement("h.3.mlp.c_proj.bias"), Placement::Replicate);
/// assert!(plan.check_names(["h.0.mlp.c_fc.weight"].iter().copied()).is_err());
/// # Ok::<(), candle_dp::Error>(())
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TpPlan {
    rules: Vec<(String, Placement)>,
}

impl TpPlan {
    /// A plan that replicates everything.
    pub fn new() -> Self {
        Self::default()
    }

    /// This plan with `pattern`'s parameters placed as `placement`.
    pub fn with(mut self, pattern: &str, placement: Placement) -> Self {
        self.rules.push((pattern.to_string(), placement));
        self
    }

    /// The placement of the parameter `name`.
    pub fn placement(&self, name: &str) -> Placement {
        self.rules
            .iter()
            .find(|(pattern, _)| matches(pattern, name))
            .map_or(Placement::Replicate, |(_, placement)| *placement)
    }

    /// The patterns, in order, with their placements.
    pub fn rules(&self) -> &[(String, Placement)] {
        &self.rules
    }

    /// Every pattern names at least one of the model's parameters `names`.
    ///
    /// # Errors
    ///
    /// [`Error::TensorParallel`] naming the first pattern that matches
    /// none, and the names there are.
    pub fn check_names<'a>(&self, names: impl Iterator<Item = &'a str> + Clone) -> Result<()> {
        for (pattern, placement) in &self.rules {
            if !names.clone().any(|name| matches(pattern, name)) {
                let some: Vec<&str> = names.clone().take(6).collect();
                return Err(Error::TensorParallel(format!(
                    "the plan places `{pattern}` ({placement}), and the model has no parameter of \
                     that name (it has {some:?}...)"
                )));
            }
        }
        Ok(())
    }
}

impl fmt::Display for TpPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, (pattern, placement)) in self.rules.iter().enumerate() {
            let sep = if i == 0 { "" } else { "; " };
            write!(f, "{sep}{pattern}: {placement}")?;
        }
        Ok(())
    }
}

/// Whether the dotted `name` fits `pattern`, `*` standing for one part.
fn matches(pattern: &str, name: &str) -> bool {
    let (mut p, mut n) = (pattern.split('.'), name.split('.'));
    loop {
        match (p.next(), n.next()) {
            (None, None) => return true,
            (Some(a), Some(b)) if a == "*" || a == b => {}
            _ => return false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_star_stands_for_exactly_one_part() {
        assert!(matches("h.*.attn.c_attn.weight", "h.11.attn.c_attn.weight"));
        assert!(!matches("h.*.weight", "h.1.attn.weight"));
        assert!(!matches("h.*", "h"));
        assert!(matches("wte.weight", "wte.weight"));
    }
}
