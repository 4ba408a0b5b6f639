//! The strategy names as degrees of a mesh, and degrees as the strategy
//! that trains them ([`FabricConfig::degrees`],
//! [`FabricConfig::with_mesh`]): with `aliases.rs`, the one table between
//! the Fabric's 11 strategy names and [`Degrees`].

use super::config::{Devices, FabricConfig, Strategy};
use super::degrees::Degrees;
use crate::error::{Error, Result};
use crate::process_env::Backend;

/// The dimensions of the ranks' mesh ([`Fabric::mesh`](super::Fabric::mesh)),
/// outermost first: the replicas, the shard groups, the pipeline's
/// stages, the tensor-parallel pieces.
pub const RANK_MESH: [&str; 4] = ["dp_replicate", "dp_shard", "pp", "tp"];

/// The dimensions a strategy's data-parallel and pipeline groups span:
/// all but `tp`.
pub(crate) const DATA_DIMS: [&str; 3] = ["dp_replicate", "dp_shard", "pp"];

/// The strategy names as degrees, and degrees as the strategy that trains
/// them: the one table between the two.
impl FabricConfig {
    /// The degrees this configuration trains with (its strategy name is
    /// an alias of them): `ddp`, `zero1`, `zero2` and `dp` (replicas in one
    /// process) `dp_replicate`; `fsdp` `dp_shard`; `hsdp` both (its shard
    /// groups of [`shard_size`](Self::shard_size), all the ranks when
    /// unset); `pipeline-ranks` `pp` = its stages times its replicas
    /// (`dp_shard` with ZeRO stage 3, split with `dp_replicate` by a
    /// `shard_size`; else `dp_replicate`); `pipeline` `pp`
    /// = its devices, `pipeline-ddp` its ranks' pipelines of `stages`.
    /// The ZeRO stage of `ddp` and `pipeline-ranks` is a setting on top.
    ///
    /// ```
    /// use candle_dp::fabric::{FabricConfig, Strategy};
    ///
    /// let hsdp = FabricConfig { shard_size: Some(2), ..FabricConfig::new(Strategy::Hsdp, 4) };
    /// assert_eq!(hsdp.degrees().to_string(), "dp_replicate=2,dp_shard=2");
    /// ```
    pub fn degrees(&self) -> Degrees {
        // The tensor-parallel ranks are innermost: the rest is the
        // strategy's, over the ranks of one tensor-parallel place.
        let tp = self.tensor_parallel_size();
        let n = self.devices.len() / tp;
        let one = Degrees::one();
        let stages = self.stages.max(1);
        let degrees = match self.effective_strategy() {
            Strategy::Single => one,
            Strategy::Dp
            | Strategy::Ddp
            | Strategy::DdpOverlap
            | Strategy::Zero1
            | Strategy::Zero2 => Degrees {
                dp_replicate: n,
                ..one
            },
            Strategy::Fsdp => Degrees { dp_shard: n, ..one },
            // Without a shard size, all the ranks on threads (on MPI the
            // engine's default is the processes per machine).
            Strategy::Hsdp => {
                let shard = self.shard_size.unwrap_or(n).max(1);
                Degrees {
                    dp_replicate: n / shard,
                    dp_shard: shard,
                    ..one
                }
            }
            Strategy::Pipeline => Degrees { pp: n, ..one },
            Strategy::PipelineDdp => Degrees {
                dp_replicate: n / stages,
                pp: stages,
                ..one
            },
            Strategy::PipelineRanks => {
                let replicas = n / stages;
                match self.zero {
                    Some(3) => {
                        let shard = self.shard_size.unwrap_or(replicas).max(1);
                        Degrees {
                            dp_replicate: replicas / shard,
                            dp_shard: shard,
                            pp: stages,
                            ..one
                        }
                    }
                    _ => Degrees {
                        dp_replicate: replicas,
                        pp: stages,
                        ..one
                    },
                }
            }
        };
        Degrees { tp, ..degrees }
    }

    /// The mesh `world` ranks are laid out in ([`Fabric::mesh`]): every
    /// degree, 1s included, named as [`RANK_MESH`] (outermost first, `cp`
    /// left out while it is reserved). It is [`degrees`](Self::degrees)
    /// for the strategies of several ranks, but for two groupings the
    /// degrees do not name: ZeRO given a `shard_size` (its pieces split
    /// within shard groups, `dp_replicate x dp_shard`), and HSDP without
    /// one under `mpirun` (shard groups of the processes per machine).
    /// The strategies of one process (`single`, `dp`, `pipeline`) have
    /// only their `tp` ranks.
    ///
    /// # Errors
    ///
    /// [`Error::Strategy`] when the ranks do not split into the shard
    /// groups.
    pub(crate) fn rank_mesh(&self, world: usize) -> Result<Vec<(&'static str, usize)>> {
        if world != self.ranks() && self.effective_strategy().is_distributed() {
            // Under mpirun the launcher decides the ranks: the mesh is
            // this configuration's on as many.
            let launched = FabricConfig {
                devices: Devices::Count(world * self.devices_per_rank()),
                ..self.clone()
            };
            return launched.rank_mesh(world);
        }
        let tp = self.tensor_parallel_size();
        let degrees = self.degrees();
        let data = self.ranks() / tp;
        let strategy = self.effective_strategy();
        let shard_groups = |shard: usize| match shard > 0 && data.is_multiple_of(shard) {
            true => Ok((data / shard, shard, 1)),
            false => Err(Error::Strategy {
                strategy: strategy.name().into(),
                reason: format!(
                    "{data} ranks do not split into shard groups of {shard}: give a shard_size \
                     that divides the number of ranks"
                ),
            }),
        };
        let (replicate, shard, pp) = match strategy {
            _ if !strategy.is_distributed() => (1, 1, 1),
            Strategy::Zero1 | Strategy::Zero2 if self.shard_size.is_some() => {
                shard_groups(self.shard_size.unwrap_or(data))?
            }
            Strategy::Hsdp => shard_groups(self.shard_size.unwrap_or(match Backend::from_env() {
                Backend::Threads => data,
                Backend::Mpi { .. } => Backend::local_processes(),
            }))?,
            // Each rank's pipeline runs over its own devices.
            Strategy::PipelineDdp => (data, 1, 1),
            _ => (degrees.dp_replicate, degrees.dp_shard, degrees.pp),
        };
        if replicate * shard * pp != data {
            return Err(Error::Config(format!(
                "mesh {degrees}: dp_replicate {replicate} x dp_shard {shard} x pp {pp} is not \
                 the {data} ranks at one tensor-parallel place"
            )));
        }
        Ok(RANK_MESH
            .into_iter()
            .zip([replicate, shard, pp, tp])
            .collect())
    }

    /// This configuration training with `degrees` on thread ranks or
    /// `mpirun`'s processes: the strategy, the number of ranks, the shard
    /// groups, the pipeline's stages and (FSDP across a pipeline's
    /// replicas) the ZeRO stage set from them. `dp_replicate` alone is
    /// `ddp` (with this configuration's `zero` stage, `zero1` or `zero2`);
    /// `dp_shard` alone `fsdp` (`hsdp` of one replica if the configuration
    /// names hsdp); both `hsdp`; `pp` with `dp_replicate`
    /// `pipeline-ranks` across replicas (with `zero` 1 or 2, ZeRO across
    /// them), with `dp_shard` FSDP across them, with both HSDP across them
    /// (a mesh of three dimensions). A `tp` degree multiplies the ranks:
    /// the strategy runs over the ranks holding the same tensor-parallel
    /// pieces ([`crate::tensor_parallel`]). Accelerate's
    /// `ParallelismConfig(dp_replicate_size=2, dp_shard_size=2, tp_size=2)`.
    ///
    /// ```
    /// use candle_dp::fabric::{FabricConfig, Strategy};
    ///
    /// let config = FabricConfig::default().with_mesh("dp_shard=2,pp=2".parse()?)?;
    /// assert_eq!(config.strategy, Strategy::PipelineRanks);
    /// assert_eq!((config.ranks(), config.stages, config.zero), (4, 2, Some(3)));
    /// # Ok::<(), candle_dp::Error>(())
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::Config`] for a degree of 0, `cp` above 1 (reserved), or a
    /// strategy, number of devices or ZeRO stage already set in this
    /// configuration that the degrees contradict (naming both).
    pub fn with_mesh(mut self, degrees: Degrees) -> Result<Self> {
        degrees.check()?;
        let refuse = |why: String| Err(Error::Config(format!("mesh {degrees}: {why}")));
        let world = degrees.world_size();
        let (replicate, shard, pp) = (degrees.dp_replicate, degrees.dp_shard, degrees.pp);
        let (strategy, shard_size, zero) = match (pp > 1, replicate > 1, shard > 1) {
            (false, false, false) => (Strategy::Single, None, self.zero),
            (false, true, false) => (Strategy::Ddp, None, self.zero),
            (false, false, true) => (Strategy::Fsdp, None, None),
            (false, true, true) => (Strategy::Hsdp, Some(shard), None),
            (true, _, false) if self.zero == Some(3) => {
                return refuse(
                    "ZeRO stage 3 shards the parameters across the pipeline's replicas: give \
                     them as dp_shard, not dp_replicate"
                        .into(),
                )
            }
            (true, _, false) => (Strategy::PipelineRanks, None, self.zero),
            (true, false, true) => (Strategy::PipelineRanks, None, Some(3)),
            // The pipeline's replicas HSDP: FSDP within groups of
            // dp_shard replicas, replicated across dp_replicate.
            (true, true, true) => (Strategy::PipelineRanks, Some(shard), Some(3)),
        };
        // HSDP of one replica is FSDP's degrees; ddp's variants (ZeRO, the
        // overlap) are DDP's.
        let strategy = match (self.strategy, strategy) {
            (Strategy::Hsdp, Strategy::Fsdp) => Strategy::Hsdp,
            // A pipeline given degrees has its stages on the ranks.
            (Strategy::Pipeline, Strategy::PipelineRanks) => Strategy::PipelineRanks,
            (named @ (Strategy::DdpOverlap | Strategy::Zero1 | Strategy::Zero2), Strategy::Ddp) => {
                named
            }
            (_, strategy) => strategy,
        };
        let shard_size = match strategy {
            Strategy::Hsdp => Some(shard),
            _ => shard_size,
        };
        let named_so = match self.strategy {
            Strategy::Single => true,
            Strategy::Pipeline => strategy == Strategy::PipelineRanks,
            named => named == strategy,
        };
        if !named_so {
            return refuse(format!(
                "it trains as strategy {strategy}, and the configuration names strategy {}: give \
                 one of them",
                self.strategy
            ));
        }
        if self.devices.len() != 1 && self.devices.len() != world {
            return refuse(format!(
                "it spans {world} ranks, and the configuration names {} devices: give one of \
                 them",
                self.devices.len()
            ));
        }
        if self.zero.is_some() && self.zero != zero {
            return refuse(format!(
                "ZeRO stage {} does not go with it (dp_shard shards the parameters: FSDP)",
                self.zero.unwrap_or_default()
            ));
        }
        if let (Some(given), Some(shard)) = (self.shard_size, shard_size) {
            if given != shard {
                return refuse(format!(
                    "shard groups of {shard} ranks, and the configuration names shard_size \
                     {given}: give one of them"
                ));
            }
        }
        let ddp_family = matches!(
            strategy,
            Strategy::Ddp | Strategy::DdpOverlap | Strategy::Zero1 | Strategy::Zero2
        );
        if let (Some(given), None, false) = (self.shard_size, shard_size, ddp_family) {
            return refuse(format!(
                "the configuration names shard groups of {given} ranks (shard_size), and the mesh \
                 has none: give dp_replicate and dp_shard both"
            ));
        }
        self.strategy = strategy;
        if self.devices.len() != world {
            self.devices = Devices::Count(world);
        }
        self.shard_size = shard_size.or(self.shard_size.filter(|_| ddp_family));
        self.zero = zero;
        if pp > 1 {
            self.stages = pp;
        }
        self.mesh = Some(degrees);
        Ok(self)
    }

    /// A configuration read from a file or flags with a `mesh`: the
    /// fields set from it ([`with_mesh`](Self::with_mesh)).
    pub(crate) fn with_its_mesh(mut self) -> Result<Self> {
        match self.mesh.take() {
            Some(degrees) => self.with_mesh(degrees),
            None => Ok(self),
        }
    }

    /// With a `mesh`, the fields agree with it (a configuration written
    /// field by field with a mesh beside them).
    pub(crate) fn check_mesh(&self) -> Result<()> {
        let Some(degrees) = self.mesh else {
            return Ok(());
        };
        // What the mesh makes of this configuration's other settings (its
        // strategy name among them, which must agree).
        let from_mesh = FabricConfig {
            mesh: None,
            devices: Devices::Count(1),
            ..self.clone()
        }
        .with_mesh(degrees)?;
        let seen = |c: &FabricConfig| {
            (
                c.effective_strategy(),
                c.devices.len(),
                c.shard_size,
                c.zero,
                (c.strategy == Strategy::PipelineRanks).then_some(c.stages),
            )
        };
        if seen(self) != seen(&from_mesh) {
            return Err(Error::Config(format!(
                "mesh {degrees} trains as {} on {} ranks (shard size {:?}, ZeRO {:?}, {} stages), \
                 but the configuration's fields say {} on {} (shard size {:?}, ZeRO {:?}, {} \
                 stages): set it with FabricConfig::with_mesh",
                from_mesh.effective_strategy(),
                from_mesh.devices.len(),
                from_mesh.shard_size,
                from_mesh.zero,
                from_mesh.stages,
                self.effective_strategy(),
                self.devices.len(),
                self.shard_size,
                self.zero,
                self.stages
            )));
        }
        Ok(())
    }
}
