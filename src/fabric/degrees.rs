//! [`Degrees`]: parallelism as the degrees of one mesh, as torchtitan's
//! `ParallelDims` and Accelerate's `ParallelismConfig` take it
//! (`dp_replicate`, `dp_shard`, `cp`, `tp`, `pp`), their product the
//! number of ranks. The Fabric's strategy names are aliases of degrees
//! ([`FabricConfig::degrees`](super::FabricConfig::degrees)); degrees
//! become the strategy that trains them
//! ([`FabricConfig::with_mesh`](super::FabricConfig::with_mesh)).

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// How many ranks each form of parallelism spans; every degree is at
/// least 1 and their product is the number of ranks.
///
/// - `dp_replicate`: data-parallel replicas holding whole copies (DDP,
///   ZeRO's replicas, HSDP's replicate dimension, a pipeline's replicas);
/// - `dp_shard`: data-parallel ranks that shard the parameters among
///   them (FSDP, HSDP's shard dimension, FSDP across a pipeline's
///   replicas);
/// - `cp`: context parallelism, reserved (refused above 1);
/// - `tp`: tensor parallelism (the innermost: neighbouring ranks split
///   each matrix, [`crate::tensor_parallel`]);
/// - `pp`: pipeline stages, one rank each.
///
/// ```
/// use candle_dp::fabric::Degrees;
///
/// let degrees: Degrees = "dp_replicate=2,dp_shard=2".parse()?;
/// assert_eq!(degrees.world_size(), 4);
/// assert_eq!(degrees.mesh_dims(), vec![("dp_replicate", 2), ("dp_shard", 2)]);
/// assert_eq!(degrees.to_string(), "dp_replicate=2,dp_shard=2");
/// # Ok::<(), candle_dp::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Degrees {
    /// Replicas holding whole copies (default 1).
    pub dp_replicate: usize,
    /// Ranks sharding the parameters among them (default 1).
    pub dp_shard: usize,
    /// Context parallelism: reserved (default 1).
    pub cp: usize,
    /// Tensor parallelism (default 1).
    pub tp: usize,
    /// Pipeline stages (default 1).
    pub pp: usize,
}

impl Default for Degrees {
    fn default() -> Self {
        Self {
            dp_replicate: 1,
            dp_shard: 1,
            cp: 1,
            tp: 1,
            pp: 1,
        }
    }
}

/// The dimensions' names, outermost first, as the Fabric lays its ranks
/// out: the data-parallel replicas outermost (a pipeline's stages, and a
/// shard group, on neighbouring ranks: one machine), the tensor-parallel
/// ranks innermost. (torchtitan puts `pp` outermost.)
const ORDER: [&str; 5] = ["dp_replicate", "dp_shard", "pp", "cp", "tp"];

impl Degrees {
    /// One rank: every degree 1.
    pub fn one() -> Self {
        Self::default()
    }

    /// The degree named `name` (one of `pp`, `dp_replicate`, `dp_shard`,
    /// `cp`, `tp`).
    pub fn get(&self, name: &str) -> Option<usize> {
        Some(match name {
            "pp" => self.pp,
            "dp_replicate" => self.dp_replicate,
            "dp_shard" => self.dp_shard,
            "cp" => self.cp,
            "tp" => self.tp,
            _ => return None,
        })
    }

    fn slot(&mut self, name: &str) -> Option<&mut usize> {
        Some(match name {
            "pp" => &mut self.pp,
            "dp_replicate" => &mut self.dp_replicate,
            "dp_shard" => &mut self.dp_shard,
            "cp" => &mut self.cp,
            "tp" => &mut self.tp,
            _ => return None,
        })
    }

    /// The number of ranks: the product of the degrees (`usize::MAX` if
    /// it overflows, which [`check`](Self::check) refuses).
    pub fn world_size(&self) -> usize {
        self.checked_world_size().unwrap_or(usize::MAX)
    }

    fn checked_world_size(&self) -> Option<usize> {
        ORDER
            .iter()
            .filter_map(|n| self.get(n))
            .try_fold(1usize, usize::checked_mul)
    }

    /// The data-parallel ranks: `dp_replicate x dp_shard` (each trains on
    /// its share of the batch).
    pub fn data_parallel(&self) -> usize {
        self.dp_replicate * self.dp_shard
    }

    /// The mesh's dimensions: the degrees above 1, outermost first
    /// (`dp_replicate`, `dp_shard`, `pp`, `cp`, `tp`), as
    /// [`DeviceMesh::new`](crate::comm::DeviceMesh::new) takes them; one
    /// rank is `[("dp_replicate", 1)]`.
    pub fn mesh_dims(&self) -> Vec<(&'static str, usize)> {
        let dims: Vec<(&'static str, usize)> = ORDER
            .iter()
            .filter_map(|&n| self.get(n).filter(|&d| d > 1).map(|d| (n, d)))
            .collect();
        if dims.is_empty() {
            vec![("dp_replicate", 1)]
        } else {
            dims
        }
    }

    /// Checks every degree is at least 1 and the reserved or unbuilt ones
    /// are 1, naming the degree.
    ///
    /// # Errors
    ///
    /// [`Error::Config`] naming the degree.
    pub fn check(&self) -> Result<()> {
        if let Some(name) = ORDER.iter().find(|n| self.get(n) == Some(0)) {
            return Err(Error::Config(format!(
                "mesh {self}: the degree {name} is 0; every degree is at least 1"
            )));
        }
        if self.checked_world_size().is_none() {
            return Err(Error::Config(format!(
                "mesh {self}: the degrees' product overflows"
            )));
        }
        if self.cp > 1 {
            return Err(Error::Config(format!(
                "mesh {self}: context parallelism (cp = {}) is reserved, not built: give cp=1",
                self.cp
            )));
        }
        Ok(())
    }
}

impl fmt::Display for Degrees {
    /// The degrees above 1, `name=degree` joined by commas (`dp_replicate=1`
    /// for one rank): what [`FromStr`] reads back.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let parts: Vec<String> = self
            .mesh_dims()
            .iter()
            .map(|(n, d)| format!("{n}={d}"))
            .collect();
        f.write_str(&parts.join(","))
    }
}

impl FromStr for Degrees {
    type Err = Error;

    /// `name=degree` pairs separated by commas, each name once; the names
    /// are `dp_replicate` (or `dp`, `replicate`), `dp_shard` (or `shard`,
    /// `fsdp`), `cp`, `tp` and `pp` (or `pipeline`); the degrees not named
    /// are 1.
    fn from_str(s: &str) -> Result<Self> {
        let mut degrees = Degrees::default();
        let mut seen: Vec<&str> = Vec::new();
        for part in s.split(',').map(str::trim) {
            let refuse = |why: String| Err(Error::Config(format!("mesh `{s}`: {why}")));
            let Some((name, value)) = part.split_once('=') else {
                return refuse(format!(
                    "`{part}` is not name=degree (like dp_replicate=2,dp_shard=2)"
                ));
            };
            let canonical = match name.trim() {
                "dp" | "replicate" | "dp_replicate" => "dp_replicate",
                "shard" | "fsdp" | "dp_shard" => "dp_shard",
                "pipeline" | "pp" => "pp",
                other @ ("cp" | "tp") => other,
                other => {
                    return refuse(format!(
                        "no degree `{other}`: dp_replicate, dp_shard, cp, tp or pp"
                    ))
                }
            };
            if seen.contains(&canonical) {
                return refuse(format!("{canonical} given twice"));
            }
            seen.push(canonical);
            let degree: usize = match value.trim().parse() {
                Ok(d) if d >= 1 => d,
                _ => {
                    return refuse(format!(
                        "{canonical}={}: a degree is a whole number, at least 1",
                        value.trim()
                    ))
                }
            };
            if let Some(slot) = degrees.slot(canonical) {
                *slot = degree;
            }
        }
        Ok(degrees)
    }
}
