//! What every rank's FSDP must agree on before the first collective of a
//! step: the units (how many, and which variables each uses, in order),
//! which variables are buffers, and the settings that decide which
//! collectives a step issues. Ranks whose factories split the same
//! variables into units differently would gather and reduce-scatter
//! different parameters at the same point of the walk, and train on
//! parameters spliced from both: they are refused at construction, as
//! DDP refuses ranks that fill their buckets in another order.

use serde::{Deserialize, Serialize};

use crate::comm::{all_gather_object, ProcessGroup};
use crate::error::{Error, Result};

/// One rank's plan of the walk.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Plan {
    /// Per unit, the names of the variables it uses (sorted).
    pub(crate) units: Vec<Vec<String>>,
    /// The variables kept whole as buffers, sorted.
    pub(crate) buffers: Vec<String>,
    pub(crate) reshard_after_forward: bool,
    /// Decides the order of a step's collectives: with it, the gather of
    /// unit k-1 comes before the reduce-scatter after unit k.
    pub(crate) prefetch: bool,
    pub(crate) broadcast_buffers: bool,
    /// The mixed-precision policy as it affects the collectives: the
    /// compute and reduce dtypes, and the parameters it keeps in their own
    /// dtype; `None` without a policy.
    pub(crate) precision: Option<(String, String, Vec<String>)>,
}

/// Checks that every rank's plan is rank 0's; the error names the first
/// rank that differs and how. Every rank sees every plan, so all return
/// the same verdict.
pub(crate) fn verify_same_plan(pg: &dyn ProcessGroup, mine: &Plan) -> Result<()> {
    let all = all_gather_object(pg, mine)?;
    let Some(reference) = all.first() else {
        return Ok(());
    };
    for (rank, theirs) in all.iter().enumerate().skip(1) {
        if let Some(detail) = difference(reference, theirs) {
            return Err(Error::ModelMismatch { rank, detail });
        }
    }
    Ok(())
}

/// How `theirs` differs from rank 0's plan `reference`, in words.
fn difference(reference: &Plan, theirs: &Plan) -> Option<String> {
    if theirs.units.len() != reference.units.len() {
        return Some(format!(
            "builds {} FSDP units where rank 0 builds {}: every rank must give the same units",
            theirs.units.len(),
            reference.units.len()
        ));
    }
    for (k, (a, b)) in reference.units.iter().zip(&theirs.units).enumerate() {
        if a != b {
            return Some(format!(
                "has FSDP unit {k} use {b:?} where rank 0's unit {k} uses {a:?}: every rank must \
                 split the model into the same units"
            ));
        }
    }
    if theirs.buffers != reference.buffers {
        return Some(format!(
            "keeps {:?} as buffers where rank 0 keeps {:?} (FsdpConfig::is_buffer)",
            theirs.buffers, reference.buffers
        ));
    }
    let setting = |name: &str, a: &dyn std::fmt::Debug, b: &dyn std::fmt::Debug| {
        format!("has FsdpConfig::{name} {b:?} where rank 0 has {a:?}")
    };
    if theirs.reshard_after_forward != reference.reshard_after_forward {
        return Some(setting(
            "reshard_after_forward",
            &reference.reshard_after_forward,
            &theirs.reshard_after_forward,
        ));
    }
    if theirs.prefetch != reference.prefetch {
        return Some(setting("prefetch", &reference.prefetch, &theirs.prefetch));
    }
    if theirs.broadcast_buffers != reference.broadcast_buffers {
        return Some(setting(
            "broadcast_buffers",
            &reference.broadcast_buffers,
            &theirs.broadcast_buffers,
        ));
    }
    if theirs.precision != reference.precision {
        let words = |p: &Option<(String, String, Vec<String>)>| match p {
            None => "no mixed precision".to_string(),
            Some((compute, reduce, kept)) => format!(
                "compute in {compute}, reduce in {reduce}, keeping {kept:?} in their own dtype"
            ),
        };
        return Some(format!(
            "has FsdpConfig::mixed_precision: {} where rank 0 has: {}",
            words(&theirs.precision),
            words(&reference.precision)
        ));
    }
    None
}
