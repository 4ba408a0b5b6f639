//! The strategy names ([`Strategy`]): what each one is called, what it
//! needs and serves, and the settings that belong to it. With
//! `mesh_aliases.rs` (the names as degrees of a mesh), the one table the
//! rest of the crate asks about a strategy instead of matching its name;
//! how each one trains lives in `strategies/`.

use std::fmt;
use std::str::FromStr;

use super::config::{Devices, FabricConfig, Strategy};
use crate::error::{Error, Result};

impl Strategy {
    /// Every strategy, in the order of the documentation.
    pub const ALL: [Strategy; 11] = [
        Strategy::Single,
        Strategy::Dp,
        Strategy::Ddp,
        Strategy::DdpOverlap,
        Strategy::Zero1,
        Strategy::Zero2,
        Strategy::Fsdp,
        Strategy::Hsdp,
        Strategy::Pipeline,
        Strategy::PipelineDdp,
        Strategy::PipelineRanks,
    ];

    /// Its name on the command line and in files.
    pub fn name(self) -> &'static str {
        match self {
            Strategy::Single => "single",
            Strategy::Dp => "dp",
            Strategy::Ddp => "ddp",
            Strategy::DdpOverlap => "ddp-overlap",
            Strategy::Zero1 => "zero1",
            Strategy::Zero2 => "zero2",
            Strategy::Fsdp => "fsdp",
            Strategy::Hsdp => "hsdp",
            Strategy::Pipeline => "pipeline",
            Strategy::PipelineDdp => "pipeline-ddp",
            Strategy::PipelineRanks => "pipeline-ranks",
        }
    }

    /// Whether it runs one rank per device (or per pipeline): the ranks
    /// of [`launch`](super::Fabric::launch) are threads or `mpirun`'s
    /// processes. The others run in one process.
    pub fn is_distributed(self) -> bool {
        !matches!(self, Strategy::Single | Strategy::Dp | Strategy::Pipeline)
    }

    /// Whether it needs the model as units (a plain module cannot serve it).
    pub fn needs_units(self) -> bool {
        matches!(
            self,
            Strategy::DdpOverlap
                | Strategy::Fsdp
                | Strategy::Hsdp
                | Strategy::Pipeline
                | Strategy::PipelineDdp
                | Strategy::PipelineRanks
        )
    }

    /// Its name in a report: `DataParallel`, `DDP`, `DDP with ZeRO stage
    /// 2`, `FSDP`, `HSDP`, `pipeline` ...
    pub fn title(self) -> &'static str {
        match self {
            Strategy::Single => "one device",
            Strategy::Dp => "DataParallel",
            Strategy::Ddp => "DDP",
            Strategy::DdpOverlap => "DDP (overlapped)",
            Strategy::Zero1 => "DDP with ZeRO stage 1",
            Strategy::Zero2 => "DDP with ZeRO stage 2",
            Strategy::Fsdp => "FSDP",
            Strategy::Hsdp => "HSDP",
            Strategy::Pipeline => "pipeline",
            Strategy::PipelineDdp => "DDP of pipelines",
            Strategy::PipelineRanks => "pipeline on ranks",
        }
    }

    /// How its states are laid out: states of one layout load into any
    /// strategy of the same layout, on any number of ranks.
    pub(crate) fn state_layout(self) -> &'static str {
        match self {
            Strategy::Zero1 | Strategy::Zero2 => "ZeRO shards",
            Strategy::Fsdp | Strategy::Hsdp => "FSDP shards",
            Strategy::PipelineRanks => "pipeline stages",
            _ => "whole",
        }
    }

    /// What serves a plain module instead of it (it needs units).
    pub(crate) fn for_a_plain_module(self) -> &'static str {
        match self {
            Strategy::Fsdp | Strategy::Hsdp => "zero2 (sharded optimizer state and gradients)",
            Strategy::DdpOverlap => "ddp (the reduction after the backward)",
            _ => "dp or ddp",
        }
    }

    /// Whether each rank keeps only its pieces of some state (its
    /// checkpoints are sharded; a pipeline on ranks: each rank its stages).
    pub fn shards(self) -> bool {
        matches!(
            self,
            Strategy::Zero1
                | Strategy::Zero2
                | Strategy::Fsdp
                | Strategy::Hsdp
                | Strategy::PipelineRanks
        )
    }
}

impl fmt::Display for Strategy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Strategy {
    type Err = Error;

    /// A strategy by its [`name`](Strategy::name); Fabric's and
    /// Accelerate's spellings (`single_device`, `ddp_overlap`, `zero-2`,
    /// `deepspeed_stage_2`, `fsdp`, `DDP`) are accepted too, and
    /// `train_lm`'s older names (`zero` for zero2, `ddp-pipeline`).
    fn from_str(s: &str) -> Result<Self> {
        let key = s.trim().to_ascii_lowercase().replace('_', "-");
        let found = match key.as_str() {
            "single" | "single-device" | "no" => Strategy::Single,
            "dp" | "data-parallel" => Strategy::Dp,
            "ddp" | "multi-cpu" | "multi-gpu" => Strategy::Ddp,
            "ddp-overlap" | "overlap" => Strategy::DdpOverlap,
            "zero1" | "zero-1" | "deepspeed-stage-1" => Strategy::Zero1,
            "zero2" | "zero-2" | "zero" | "deepspeed-stage-2" => Strategy::Zero2,
            "fsdp" => Strategy::Fsdp,
            "hsdp" | "hybrid-shard" => Strategy::Hsdp,
            "pipeline" | "pp" => Strategy::Pipeline,
            "pipeline-ddp" | "pp-ddp" | "ddp-pipeline" => Strategy::PipelineDdp,
            "pipeline-ranks" | "pp-ranks" | "pipeline-parallel" => Strategy::PipelineRanks,
            _ => {
                let names: Vec<&str> = Strategy::ALL.iter().map(|s| s.name()).collect();
                return Err(Error::Config(format!(
                    "unknown strategy `{s}`: one of {}",
                    names.join(", ")
                )));
            }
        };
        Ok(found)
    }
}

impl FabricConfig {
    /// The strategy in force: `ddp` with a [`zero`](Self::zero) stage is
    /// `zero1` or `zero2`.
    pub fn effective_strategy(&self) -> Strategy {
        match (self.strategy, self.zero, self.overlap) {
            (Strategy::Ddp, Some(1), _) => Strategy::Zero1,
            (Strategy::Ddp, Some(2), _) => Strategy::Zero2,
            (Strategy::Ddp, None, true) => Strategy::DdpOverlap,
            (strategy, _, _) => strategy,
        }
    }

    /// Whether DDP reduces during the backward: `ddp-overlap`, or
    /// `overlap` with a ZeRO stage.
    pub fn overlaps(&self) -> bool {
        let strategy = self.effective_strategy();
        strategy == Strategy::DdpOverlap
            || (self.overlap && matches!(strategy, Strategy::Zero1 | Strategy::Zero2))
    }

    /// How many ranks run this configuration on thread ranks (under
    /// `mpirun`, the launcher decides).
    pub fn ranks(&self) -> usize {
        let strategy = self.effective_strategy();
        match strategy {
            // Tensor parallelism alone: one rank per piece.
            Strategy::Single => self.tensor_parallel_size(),
            Strategy::Dp | Strategy::Pipeline => 1,
            Strategy::PipelineDdp => self.devices.len() / self.stages.max(1),
            _ => self.devices.len(),
        }
    }

    /// The same run on one device (the reference a parallel run is
    /// compared with): strategy `single`, one device, the settings of a
    /// strategy (ZeRO, shard groups, stages, the mesh, the overlap) cleared,
    /// the rest (precision, clipping, accumulation, seed) kept.
    ///
    /// ```
    /// use candle_dp::fabric::{FabricConfig, Strategy};
    ///
    /// let zero = FabricConfig { zero: Some(2), ..FabricConfig::new(Strategy::Ddp, 4) };
    /// let one = zero.on_one_device();
    /// assert_eq!((one.effective_strategy(), one.ranks(), one.zero), (Strategy::Single, 1, None));
    /// ```
    pub fn on_one_device(&self) -> FabricConfig {
        let defaults = FabricConfig::default();
        FabricConfig {
            strategy: Strategy::Single,
            devices: match &self.devices {
                Devices::Ids(ids) => Devices::Ids(ids.iter().take(1).copied().collect()),
                Devices::Count(_) => Devices::Count(1),
            },
            zero: None,
            shard_size: None,
            stages: defaults.stages,
            overlap: false,
            mesh: None,
            sequence_parallel: false,
            ..self.clone()
        }
    }

    /// [`Error::Strategy`] naming the strategy in force and `reason`.
    pub(crate) fn refuse<T>(&self, reason: String) -> Result<T> {
        Err(Error::Strategy {
            strategy: self.effective_strategy().name().into(),
            reason,
        })
    }

    /// How many devices each rank drives: its replicas (`dp`), its
    /// stages (`pipeline`, `pipeline-ddp`), or one.
    pub(crate) fn devices_per_rank(&self) -> usize {
        match self.effective_strategy() {
            Strategy::Dp | Strategy::Pipeline => self.devices.len(),
            Strategy::PipelineDdp => self.stages,
            _ => 1,
        }
    }

    /// How many consecutive ranks train on one share of the data: a
    /// pipeline's stages with `pipeline-ranks`, else 1.
    pub(crate) fn ranks_per_data_share(&self) -> usize {
        let tp = self.tensor_parallel_size();
        match self.effective_strategy() {
            Strategy::PipelineRanks => self.stages.max(1) * tp,
            _ => tp,
        }
    }

    /// The tensor-parallel ranks that split each matrix (the mesh's `tp`
    /// degree; 1 without a mesh).
    pub fn tensor_parallel_size(&self) -> usize {
        self.mesh.map_or(1, |mesh| mesh.tp.max(1))
    }

    /// Checks the settings that belong to some strategies only (the ZeRO
    /// stage, the pipeline's stages, the shard groups, the overlap),
    /// naming the strategy and what it cannot serve.
    /// The deterministic setting ([`deterministic`](Self::deterministic))
    /// fits the strategy and the ranks: strategies whose every rank can
    /// hand over each chunk's gradients whole (`single`, `dp`, `ddp`,
    /// `ddp-overlap`, `zero1`, `zero2`, `fsdp`, `hsdp`), without tensor
    /// parallelism, on a
    /// number of ranks that divides the chunks.
    pub(crate) fn check_deterministic(&self) -> Result<()> {
        let Some(chunks) = self.deterministic else {
            return Ok(());
        };
        let strategy = self.effective_strategy();
        if chunks == 0 {
            return self.refuse("deterministic needs at least 1 chunk a batch".into());
        }
        if !matches!(
            strategy,
            Strategy::Single
                | Strategy::Dp
                | Strategy::Ddp
                | Strategy::DdpOverlap
                | Strategy::Zero1
                | Strategy::Zero2
                | Strategy::Fsdp
                | Strategy::Hsdp
        ) {
            return self.refuse(
                "deterministic training is built for single, dp, ddp, ddp-overlap, zero1, zero2, \
                 fsdp and hsdp (their ranks hand over each chunk's whole gradients); the \
                 pipelines reduce inside their schedules"
                    .into(),
            );
        }
        if self.tensor_parallel_size() > 1 {
            return self.refuse(
                "deterministic training with tp above 1: the tensor-parallel split changes the \
                 sums inside each layer, so no other tp gives the same bits"
                    .into(),
            );
        }
        let ranks = self.ranks();
        if !chunks.is_multiple_of(ranks) {
            return self.refuse(format!(
                "deterministic {chunks} chunks a batch do not split over {ranks} ranks: give a \
                 number of chunks that every world size you train on divides"
            ));
        }
        Ok(())
    }

    pub(crate) fn check_strategy_settings(&self) -> Result<()> {
        let strategy = self.effective_strategy();
        let refuse = |reason: String| self.refuse(reason);
        let devices = self.devices.len();
        match self.zero {
            None => {}
            Some(1 | 2) if matches!(self.strategy, Strategy::Ddp | Strategy::PipelineRanks) => {}
            Some(3) if self.strategy == Strategy::PipelineRanks => {}
            Some(3) => {
                return Err(Error::Strategy {
                    strategy: self.strategy.name().into(),
                    reason: "ZeRO stage 3 (FSDP across the replicas) is a setting of \
                             pipeline-ranks; the other strategies shard their variables with \
                             the strategy fsdp (or hsdp)"
                        .into(),
                })
            }
            Some(stage @ (1 | 2)) => {
                return Err(Error::Strategy {
                    strategy: self.strategy.name().into(),
                    reason: format!(
                        "ZeRO stage {stage} is a setting of ddp (the strategies zero1 and \
                         zero2) and of pipeline-ranks (--zero shards their optimizer state); \
                         {} cannot take it: use --strategy ddp --zero {stage}, or zero{stage}",
                        self.strategy.name()
                    ),
                })
            }
            Some(other) => {
                return refuse(format!(
                    "ZeRO stage {other}: 1, 2 (or 3 with pipeline-ranks)"
                ))
            }
        }
        if self.tensor_parallel_size() > 1 && self.overlaps() {
            return refuse(
                "it reduces the gradients on a thread of its own during the backward, which runs \
                 the tensor-parallel collectives too (an MPI process makes its calls one at a \
                 time, so the two could run in different orders on different ranks): use ddp \
                 beside tp"
                    .into(),
            );
        }
        match strategy {
            Strategy::Single if devices != self.tensor_parallel_size() => {
                return refuse(match self.tensor_parallel_size() {
                    1 => format!("one device only, got {devices}: use dp or ddp for several"),
                    tp => format!(
                        "one device per tensor-parallel piece ({tp}), got {devices}: give a \
                         dp_replicate or dp_shard degree for more"
                    ),
                })
            }
            Strategy::Pipeline if devices * self.pipeline_schedule.stages_per_device() < 2 => {
                return refuse(format!(
                    "a pipeline of {} stage: give at least 2 devices (one stage each), or an \
                     interleaved schedule of 2 stages per device",
                    devices * self.pipeline_schedule.stages_per_device()
                ))
            }
            Strategy::PipelineDdp
                if self.stages * self.pipeline_schedule.stages_per_device() < 2 =>
            {
                return refuse(format!(
                    "a pipeline of {} stage on each rank: stages must be at least 2",
                    self.stages * self.pipeline_schedule.stages_per_device()
                ))
            }
            Strategy::PipelineDdp if !devices.is_multiple_of(self.stages) => {
                return refuse(format!(
                    "{devices} devices do not split into pipelines of {} stages (ranks x stages)",
                    self.stages
                ))
            }
            Strategy::PipelineRanks
                if self.stages * self.pipeline_schedule.stages_per_device() < 2 =>
            {
                return refuse(format!(
                    "a pipeline of {} stage: stages (ranks per pipeline) must be at least 2, or \
                     1 with an interleaved schedule",
                    self.stages * self.pipeline_schedule.stages_per_device()
                ))
            }
            Strategy::PipelineRanks if !devices.is_multiple_of(self.stages) => {
                return refuse(format!(
                    "{devices} ranks do not split into pipelines of {} ranks: devices must be a \
                     multiple of stages (replicas x stages)",
                    self.stages
                ))
            }
            Strategy::Hsdp | Strategy::Zero1 | Strategy::Zero2 => match self.shard_size {
                Some(0) => return refuse("shard_size must be at least 1 rank".into()),
                Some(s) if !devices.is_multiple_of(s) => {
                    return refuse(format!(
                        "{devices} ranks do not split into shard groups of {s}: shard_size must \
                         divide the number of ranks"
                    ))
                }
                _ => {}
            },
            // HSDP across a pipeline's replicas: groups of its replicas.
            Strategy::PipelineRanks if self.shard_size.is_some() => {
                let replicas = devices / self.stages.max(1);
                match self.shard_size {
                    Some(s) if self.zero != Some(3) => {
                        return refuse(format!(
                            "shard_size {s} splits FSDP's pieces across a pipeline's replicas \
                             into shard groups: set ZeRO stage 3 (FSDP across the replicas) too"
                        ))
                    }
                    Some(1) => {
                        return refuse(
                            "shard_size 1: a shard group of one replica holds its stages whole; \
                             give the replicas as dp_replicate without ZeRO stage 3, or groups \
                             of 2 or more"
                                .into(),
                        )
                    }
                    Some(s) if s == 0 || !replicas.is_multiple_of(s) => {
                        return refuse(format!(
                            "{replicas} replicas of the pipeline do not split into shard groups \
                             of {s}: shard_size must divide them"
                        ))
                    }
                    _ => {}
                }
            }
            _ if self.shard_size.is_some() => {
                return refuse(
                    "shard_size splits the ranks into shard groups for hsdp, zero1 and zero2 \
                     only (and a pipeline's replicas for pipeline-ranks with ZeRO stage 3)"
                        .into(),
                )
            }
            _ => {}
        }
        if self.overlap
            && !matches!(
                strategy,
                Strategy::DdpOverlap | Strategy::Zero1 | Strategy::Zero2
            )
        {
            return refuse(
                "overlap reduces DDP's buckets during the backward: use it with ddp, zero1 or \
                 zero2"
                    .into(),
            );
        }
        Ok(())
    }
}
