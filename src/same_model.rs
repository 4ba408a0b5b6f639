//! Every rank holds the same model: checked at construction (names,
//! shapes, dtypes and device placement of the variables, compared with
//! rank 0's), then made so (rank 0's values copied to every rank). What
//! DDP and FSDP both do before their first step.

use candle_core::{DType, Device, Tensor, Var};
use serde::{Deserialize, Serialize};

use crate::comm::{all_gather_object, ProcessGroup};
use crate::error::{Error, Result};

/// A variable as the construction-time check compares it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct VarSignature {
    name: String,
    shape: Vec<usize>,
    dtype: String,
    /// Which of the rank's devices holds it, by first appearance: buckets
    /// and broadcasts are made per device, so every rank must place the
    /// variables alike.
    device: usize,
}

/// Checks that every rank has the same variables (names, shapes, dtypes)
/// as rank 0; the error names the first rank and variable that differ. All
/// ranks see all signatures, so all return the same verdict.
pub(crate) fn verify_same_vars(pg: &dyn ProcessGroup, vars: &[(String, Var)]) -> Result<()> {
    let mut devices: Vec<&Device> = Vec::new();
    let mine: Vec<VarSignature> = vars
        .iter()
        .map(|(name, v)| {
            let device = match devices.iter().position(|d| d.same_device(v.device())) {
                Some(i) => i,
                None => {
                    devices.push(v.device());
                    devices.len() - 1
                }
            };
            VarSignature {
                name: name.clone(),
                shape: v.dims().to_vec(),
                dtype: v.dtype().as_str().to_string(),
                device,
            }
        })
        .collect();
    let all = all_gather_object(pg, &mine)?;
    let Some(reference) = all.first() else {
        return Err(Error::Comm(crate::comm::CommError::Protocol {
            rank: pg.rank(),
            op: "all_gather_object",
            peer: 0,
            detail: "the process group returned no rank's variable list".into(),
        }));
    };
    for (rank, theirs) in all.iter().enumerate().skip(1) {
        for (a, b) in reference.iter().zip(theirs) {
            if a != b {
                return Err(Error::ModelMismatch {
                    rank,
                    detail: if a.name != b.name {
                        format!("has variable `{}` where rank 0 has `{}`", b.name, a.name)
                    } else if a.device != b.device {
                        format!(
                            "has `{}` on its device {} (counting devices as its variables first use them) where rank 0 has it on its device {}: every rank must place the variables on its devices alike",
                            b.name, b.device, a.device
                        )
                    } else {
                        format!(
                            "has `{}` with shape {:?} ({}) where rank 0 has {:?} ({})",
                            b.name, b.shape, b.dtype, a.shape, a.dtype
                        )
                    },
                });
            }
        }
        if theirs.len() != reference.len() {
            let extra = if theirs.len() > reference.len() {
                format!("has `{}`, which rank 0 lacks", theirs[reference.len()].name)
            } else {
                format!("lacks `{}`, which rank 0 has", reference[theirs.len()].name)
            };
            return Err(Error::ModelMismatch {
                rank,
                detail: extra,
            });
        }
    }
    Ok(())
}

/// Copies `root`'s values of `vars` into this rank's, one collective per
/// dtype and device.
pub(crate) fn broadcast_vars(
    pg: &dyn ProcessGroup,
    vars: &[(String, Var)],
    root: usize,
) -> Result<()> {
    // In order of first appearance: the same on every rank.
    let mut groups: Vec<(DType, &Device)> = Vec::new();
    for (_, v) in vars {
        if !groups
            .iter()
            .any(|(d, dev)| *d == v.dtype() && dev.same_device(v.device()))
        {
            groups.push((v.dtype(), v.device()));
        }
    }
    for (dtype, device) in groups {
        let group: Vec<&Var> = vars
            .iter()
            .map(|(_, v)| v)
            .filter(|v| v.dtype() == dtype && v.device().same_device(device))
            .collect();
        let flats = group
            .iter()
            .map(|v| v.as_tensor().flatten_all())
            .collect::<candle_core::Result<Vec<_>>>()?;
        let flat = Tensor::cat(&flats, 0)?;
        let value = pg.broadcast(&flat, root)?;
        let mut offset = 0;
        for var in group {
            let n = var.elem_count();
            var.set(&value.narrow(0, offset, n)?.reshape(var.shape())?)?;
            offset += n;
        }
    }
    Ok(())
}
