//! What a [`Fabric`](super::Fabric) runs: the strategy, the devices, the
//! precision and the step's settings ([`FabricConfig`]), from code, from a
//! JSON file (Accelerate's `accelerate config`), or from the command line
//! ([`FabricArgs`](super::FabricArgs)).

use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::degrees::Degrees;
use crate::error::{Error, Result};
use crate::pipeline::{Checkpoint, Schedule};
pub use crate::precision::Precision;

/// How the training is spread, by the name Fabric and Accelerate users
/// know it by.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Strategy {
    /// One device, one process (Fabric's `single_device`).
    Single,
    /// [`DataParallel`](crate::DataParallel): one process, a replica per
    /// device, each batch split between them (Fabric's `dp`).
    Dp,
    /// [`DistributedDataParallel`](crate::DistributedDataParallel): one
    /// rank per device (threads, or `mpirun`'s processes), gradients
    /// all-reduced after the backward.
    Ddp,
    /// DDP reducing each bucket while the backward still runs (the model
    /// given as [`units`](super::ModelRecipe::units)).
    DdpOverlap,
    /// DDP with the optimizer state sharded ([`ZeroStage::One`](crate::ZeroStage)).
    Zero1,
    /// DDP with the optimizer state and the gradients sharded
    /// ([`ZeroStage::Two`](crate::ZeroStage)).
    Zero2,
    /// [`FullyShardedDataParallel`](crate::FullyShardedDataParallel):
    /// parameters, gradients and optimizer state sharded (the model given
    /// as units).
    Fsdp,
    /// Hybrid sharding (HSDP): FSDP within groups of
    /// [`shard_size`](FabricConfig::shard_size) ranks (a machine's),
    /// replicated across the groups (the machines); see
    /// [`FullyShardedDataParallel::from_units_on_mesh`](crate::FullyShardedDataParallel::from_units_on_mesh).
    Hsdp,
    /// A [`Pipeline`](crate::Pipeline) over the devices, one stage each
    /// (the model given as units, at least two devices).
    Pipeline,
    /// A pipeline on every rank, the ranks' gradients all-reduced (DDP
    /// around it): `devices` = ranks x stages.
    PipelineDdp,
    /// A pipeline whose stages live on ranks (threads, or `mpirun`'s
    /// processes on several machines), one rank per stage
    /// ([`RankPipeline`](crate::pipeline::RankPipeline)): `stages` ranks
    /// per pipeline, and with more `devices` than `stages` the pipelines
    /// replicated by data parallelism (a `dp` x `pp` mesh, `devices` =
    /// replicas x stages; each replica trains on its share of the data, see
    /// [`Fabric::data_parallel_rank`](super::Fabric::data_parallel_rank)).
    PipelineRanks,
}

/// How `dp` (and `single`) computes the gradients.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum DpBackward {
    /// Each replica computes the loss of its rows and its backward, in
    /// parallel; the gradients are summed on the master
    /// ([`DataParallel::forward_backward`](crate::DataParallel::forward_backward)).
    #[default]
    Parallel,
    /// The loss of the gathered output, one backward through the gather
    /// (`nn.DataParallel`'s drop-in way).
    Gathered,
}

impl FromStr for DpBackward {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "parallel" | "fast" => Ok(DpBackward::Parallel),
            "gathered" | "dropin" | "drop-in" => Ok(DpBackward::Gathered),
            _ => Err(Error::Config(format!(
                "unknown dp backward `{s}`: parallel or gathered"
            ))),
        }
    }
}

/// Where the model runs (Fabric's `accelerator`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Accelerator {
    /// CPU devices: several are several replicas, ranks or stages sharing
    /// the cores.
    #[default]
    Cpu,
    /// CUDA GPUs (feature `cuda`).
    Cuda,
}

impl FromStr for Accelerator {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "cpu" => Ok(Accelerator::Cpu),
            "cuda" | "gpu" => Ok(Accelerator::Cuda),
            _ => Err(Error::Config(format!(
                "unknown accelerator `{s}`: cpu or cuda"
            ))),
        }
    }
}

/// How many devices, or which (Fabric's `devices=N` or `devices=[ids]`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Devices {
    /// The first `n` (CPU: `n` CPU devices).
    Count(usize),
    /// These CUDA ordinals, in order.
    Ids(Vec<usize>),
}

impl Default for Devices {
    fn default() -> Self {
        Devices::Count(1)
    }
}

impl Devices {
    /// How many.
    pub fn len(&self) -> usize {
        match self {
            Devices::Count(n) => *n,
            Devices::Ids(ids) => ids.len(),
        }
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The CUDA ordinals they name.
    pub fn ordinals(&self) -> Vec<usize> {
        match self {
            Devices::Count(n) => (0..*n).collect(),
            Devices::Ids(ids) => ids.clone(),
        }
    }
}

impl FromStr for Devices {
    type Err = Error;

    /// `2` (a count) or `0,1` / `[1]` (CUDA ordinals).
    fn from_str(s: &str) -> Result<Self> {
        let bad = || {
            Error::Config(format!(
                "devices `{s}`: a count (2) or a list of CUDA ordinals (0,1 or [1])"
            ))
        };
        let t = s.trim();
        let listed = t.starts_with('[') || t.contains(',');
        let t = t.trim_start_matches('[').trim_end_matches(']');
        if !listed {
            return t.parse().map(Devices::Count).map_err(|_| bad());
        }
        t.split(',')
            .map(|id| id.trim().parse::<usize>().map_err(|_| bad()))
            .collect::<Result<Vec<_>>>()
            .map(Devices::Ids)
    }
}

/// Everything a [`Fabric`](super::Fabric) needs to know before the loop:
/// Fabric's constructor arguments and Accelerate's settings in one place.
/// Every field has a default (one CPU device, f32, no clipping, no
/// accumulation), so a configuration names only what it changes.
///
/// ```
/// use candle_dp::fabric::{FabricConfig, Precision, Strategy};
///
/// let config = FabricConfig::from_json(r#"{"strategy": "fsdp", "devices": 2,
///     "precision": "bf16-mixed", "gradient_clip": 1.0}"#)?;
/// assert_eq!(config.strategy, Strategy::Fsdp);
/// assert_eq!(config.precision, Precision::Bf16Mixed);
/// assert_eq!(config.accumulation_steps, 1);
/// # Ok::<(), candle_dp::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FabricConfig {
    /// How the training is spread (default `single`).
    pub strategy: Strategy,
    /// CPU or CUDA (default CPU).
    pub accelerator: Accelerator,
    /// The devices: replicas (`dp`), ranks (`ddp`, `zero*`, `fsdp`),
    /// stages (`pipeline`), ranks x stages (`pipeline-ddp`), replicas x
    /// ranks per pipeline (`pipeline-ranks`). Under
    /// `mpirun` the number of ranks is the launcher's; each process uses
    /// the device of its local rank (default 1).
    pub devices: Devices,
    /// The pipeline's stages per rank (`pipeline-ddp`; `pipeline` uses
    /// one per device), or its ranks (`pipeline-ranks`, one stage each, or
    /// `v` interleaved), default 2.
    pub stages: usize,
    /// The pipeline's micro-batches per batch (default: one per stage).
    pub chunks: Option<usize>,
    /// The pipeline's schedule (default 1F1B; JSON `"gpipe"`, `"1f1b"`,
    /// `{"interleaved": {"stages_per_device": 2}}`).
    pub pipeline_schedule: Schedule,
    /// The pipeline's activation checkpointing: which micro-batches each
    /// stage recomputes before their backward (default never).
    pub activation_checkpoint: Checkpoint,
    /// The compute dtype (default f32).
    pub precision: Precision,
    /// `16-mixed`: the loss scaler's first scale (PyTorch's `GradScaler`
    /// `init_scale`, default 65536).
    pub init_scale: f64,
    /// A ZeRO stage on top of `ddp` (1 or 2): the same as the strategies
    /// `zero1` and `zero2`, for command lines that name it apart. With
    /// `pipeline-ranks`: ZeRO across each stage's replicas (the
    /// pipelines of a dp x pp mesh), each replica holding the optimizer
    /// state (and at 2 the gradients) of its piece of the stage
    /// ([`RankPipelineConfig::zero`](crate::pipeline::RankPipelineConfig::zero));
    /// at 3 its variables too, between steps (FSDP across the replicas:
    /// [`RankPipelineConfig::fsdp`](crate::pipeline::RankPipelineConfig::fsdp)).
    pub zero: Option<u8>,
    /// `ddp`, `zero1`, `zero2`: reduce each gradient bucket while the
    /// backward still runs (the model given as units); `ddp` with it is
    /// `ddp-overlap` (default false).
    pub overlap: bool,
    /// `dp`: how the gradients are computed (default in parallel, each
    /// replica its loss).
    pub dp_backward: DpBackward,
    /// FSDP: free each unit's gathered parameters after its forward
    /// (default true, FSDP2's default).
    pub reshard_after_forward: bool,
    /// FSDP: with `reshard_after_forward`, drop a resharded unit's
    /// activations too and recompute it for its backward (default false:
    /// the activations are kept, FSDP2's default; see
    /// [`FsdpConfig::recompute_activations`](crate::fsdp::FsdpConfig::recompute_activations)).
    pub recompute_activations: bool,
    /// FSDP: gather the next unit while this one computes (default true).
    pub prefetch: bool,
    /// HSDP, and ZeRO (`zero1`, `zero2`) on a mesh: how many ranks share
    /// one copy of the pieces (the shard group; the ranks `r` with the
    /// same `r / shard_size` form one), the copies replicated across the
    /// groups. HSDP's default: the ranks per machine as the MPI launcher
    /// says (`OMPI_COMM_WORLD_LOCAL_SIZE` and the like), every rank on
    /// thread ranks (one machine); ZeRO's: none, the pieces split over
    /// every rank. It must divide the number of ranks; refused with the
    /// other strategies.
    pub shard_size: Option<usize>,
    /// Clips the total 2-norm of the gradients to this before every step
    /// (default none).
    pub gradient_clip: Option<f64>,
    /// Batches whose gradients make one optimizer step (Accelerate's
    /// `gradient_accumulation_steps`, default 1).
    pub accumulation_steps: u64,
    /// Where [`FabricModel::save`](super::FabricModel::save) writes the
    /// training states (default none).
    pub checkpoint_dir: Option<PathBuf>,
    /// How many of the newest states to keep (default 3).
    pub keep: usize,
    /// How long a rank waits in a collective before the job fails, in
    /// seconds; infinite: no limit (default: the launcher's, 1800 or
    /// `CANDLE_DP_TIMEOUT`).
    pub timeout_secs: Option<f64>,
    /// How many times the thread ranks start again after one fails, each
    /// start resuming from the newest state in `checkpoint_dir` (the loop
    /// resumes when [`Fabric::restart`](super::Fabric::restart) is not 0;
    /// default 0). Processes are restarted from outside, by a supervisor:
    /// [`Elastic::supervise`](crate::launch::Elastic::supervise).
    pub max_restarts: usize,
    /// Seeds the initial weights and the data order (default 0;
    /// [`Fabric::seed_everything`](super::Fabric::seed_everything)
    /// changes it).
    pub seed: u64,
    /// The parallelism as degrees of one mesh (JSON `"mesh":
    /// {"dp_replicate": 2, "dp_shard": 2}`, the flag `--mesh
    /// dp_replicate=2,dp_shard=2`), which set the strategy, the ranks, the
    /// shard groups and the stages ([`with_mesh`](Self::with_mesh));
    /// default none: the strategy's name says it.
    pub mesh: Option<Degrees>,
    /// With a `tp` degree above 1: the activations between the layers
    /// split along the sequence over the tensor-parallel ranks (sequence
    /// parallelism); default off.
    #[serde(default)]
    pub sequence_parallel: bool,
    /// World-size-invariant training ([`crate::deterministic`]): each
    /// global batch cut into this many chunks, their gradients and losses
    /// summed so that the result is the same bits on any number of ranks
    /// that divides it (JSON `"deterministic": 8`, the flag
    /// `--deterministic 8`); default none, the fast path.
    #[serde(default)]
    pub deterministic: Option<usize>,
}

impl Default for FabricConfig {
    fn default() -> Self {
        Self {
            strategy: Strategy::Single,
            accelerator: Accelerator::Cpu,
            devices: Devices::Count(1),
            stages: 2,
            chunks: None,
            pipeline_schedule: Schedule::OneFOneB,
            activation_checkpoint: Checkpoint::Never,
            precision: Precision::F32,
            init_scale: 65536.0,
            zero: None,
            overlap: false,
            dp_backward: DpBackward::Parallel,
            reshard_after_forward: true,
            recompute_activations: false,
            prefetch: true,
            shard_size: None,
            gradient_clip: None,
            accumulation_steps: 1,
            checkpoint_dir: None,
            keep: 3,
            timeout_secs: None,
            max_restarts: 0,
            seed: 0,
            mesh: None,
            sequence_parallel: false,
            deterministic: None,
        }
    }
}

impl FabricConfig {
    /// The default configuration with `strategy` on `devices` CPU devices.
    ///
    /// ```
    /// use candle_dp::fabric::{FabricConfig, Strategy};
    /// let config = FabricConfig::new(Strategy::Ddp, 2);
    /// assert_eq!(config.ranks(), 2);
    /// ```
    pub fn new(strategy: Strategy, devices: usize) -> Self {
        Self {
            strategy,
            devices: Devices::Count(devices),
            ..Self::default()
        }
    }

    /// Sets the precision.
    pub fn precision(mut self, precision: Precision) -> Self {
        self.precision = precision;
        self
    }

    /// Parses a configuration written as JSON (the fields of this type;
    /// an unknown field is an error naming it).
    pub fn from_json(text: &str) -> Result<Self> {
        let config: Self = serde_json::from_str(text).map_err(|e| Error::Config(format!("{e}")))?;
        config.with_its_mesh()
    }

    /// Reads a configuration file (JSON), naming the file on any error.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path)
            .map_err(|e| Error::Config(format!("cannot read {}: {e}", path.display())))?;
        let config: Self = serde_json::from_str(&text)
            .map_err(|e| Error::Config(format!("{}: {e}", path.display())))?;
        config
            .with_its_mesh()
            .map_err(|e| Error::Config(format!("{}: {e}", path.display())))
    }

    /// Writes it as JSON (what [`from_file`](Self::from_file) reads).
    pub fn to_json(&self) -> String {
        // Every field is a plain value: serialising cannot fail.
        serde_json::to_string_pretty(self).unwrap_or_default()
    }

    /// The configured timeout: `None` for the default, `Some(None)` for
    /// no limit.
    pub fn timeout(&self) -> Option<Option<Duration>> {
        // Past what a Duration holds is no limit either.
        self.timeout_secs
            .map(|t| Duration::try_from_secs_f64(t).ok())
    }

    /// Checks that the strategy can serve these devices and settings,
    /// before anything runs: the error names the strategy and what it
    /// cannot serve.
    pub fn check(&self) -> Result<()> {
        let refuse = |reason: String| self.refuse(reason);
        let devices = self.devices.len();
        if devices == 0 {
            return refuse("no devices: give at least one".into());
        }
        self.check_mesh()?;
        self.check_strategy_settings()?;
        if let Devices::Ids(_) = self.devices {
            if self.accelerator == Accelerator::Cpu {
                return refuse(format!(
                    "devices {:?} are CUDA ordinals but the accelerator is cpu: give a count, or \
                     --accelerator cuda",
                    self.devices.ordinals()
                ));
            }
        }
        if self.sequence_parallel && self.tensor_parallel_size() < 2 {
            return refuse(
                "sequence_parallel splits the activations over the tensor-parallel ranks: give a \
                 mesh with tp of at least 2"
                    .into(),
            );
        }
        if self.chunks == Some(0) {
            return refuse("chunks must be at least 1".into());
        }
        self.check_deterministic()?;
        if self.accumulation_steps == 0 {
            return refuse("accumulation_steps must be at least 1".into());
        }
        if let Some(clip) = self.gradient_clip {
            if !(clip.is_finite() && clip > 0.0) {
                return refuse(format!("gradient_clip {clip}: a finite number above 0"));
            }
        }
        if !(self.init_scale.is_finite() && self.init_scale > 0.0) {
            return refuse(format!(
                "init_scale {}: a finite number above 0",
                self.init_scale
            ));
        }
        if self.keep == 0 {
            return refuse("keep must be at least 1 state".into());
        }
        if self.max_restarts > 0 && self.checkpoint_dir.is_none() {
            return refuse(format!(
                "max_restarts {}: a restart resumes from the newest state in checkpoint_dir, and \
                 none is set (each start would train from scratch)",
                self.max_restarts
            ));
        }
        if let Some(t) = self.timeout_secs {
            if t.is_nan() || t <= 0.0 {
                return refuse(format!(
                    "timeout_secs {t}: a number of seconds above 0 (infinite: no limit)"
                ));
            }
        }
        Ok(())
    }
}
