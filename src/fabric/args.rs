//! [`FabricArgs`]: the one set of command-line flags every program built on
//! a [`Fabric`](super::Fabric) takes (as `fabric run` and `accelerate
//! launch` take theirs), flattened into the program's own `clap` parser.

use std::path::PathBuf;

use super::config::{Accelerator, Devices, DpBackward, FabricConfig, Precision, Strategy};
use super::degrees::Degrees;
use crate::error::Result;

/// The strategy, devices, precision and step settings as flags; each one
/// given overrides the `--config` file (JSON), which overrides the
/// defaults. Flatten it into a program's parser:
///
/// ```
/// use clap::Parser;
/// use candle_dp::fabric::{FabricArgs, Precision, Strategy};
///
/// #[derive(Parser)]
/// struct Cli {
///     #[command(flatten)]
///     fabric: FabricArgs,
///     /// The program's own flags.
///     #[arg(long, default_value_t = 3)]
///     epochs: usize,
/// }
///
/// let cli = Cli::parse_from(["train", "--strategy", "zero2", "--devices", "2", "--precision", "bf16-mixed"]);
/// let config = cli.fabric.config()?;
/// assert_eq!(config.strategy, Strategy::Zero2);
/// assert_eq!(config.precision, Precision::Bf16Mixed);
/// assert_eq!(config.ranks(), 2);
/// # Ok::<(), candle_dp::Error>(())
/// ```
#[derive(Debug, Clone, Default, clap::Args)]
pub struct FabricArgs {
    /// A configuration file (JSON, the fields of `FabricConfig`); the
    /// flags below override it.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// single, dp, ddp, ddp-overlap, zero1, zero2, fsdp, hsdp, pipeline,
    /// pipeline-ddp or pipeline-ranks [default: single].
    #[arg(long)]
    pub strategy: Option<Strategy>,
    /// The parallelism as degrees of one mesh, `dp_replicate=2,dp_shard=2`
    /// (also dp_shard, pp, tp; their product the ranks): sets the
    /// strategy, the ranks, the shard groups, the stages and the
    /// tensor-parallel ranks.
    #[arg(long, value_name = "DEGREES")]
    pub mesh: Option<Degrees>,
    /// With a mesh's tp above 1: the activations between the layers split
    /// along the sequence over the tensor-parallel ranks.
    #[arg(long)]
    pub sequence_parallel: bool,
    /// World-size-invariant training: each global batch cut into this many
    /// chunks, so that any number of ranks dividing it trains to the same
    /// bits.
    #[arg(long, value_name = "CHUNKS")]
    pub deterministic: Option<usize>,
    /// cpu or cuda [default: cpu].
    #[arg(long)]
    pub accelerator: Option<Accelerator>,
    /// How many devices (replicas, ranks or stages), or which CUDA
    /// ordinals (0,1) [default: 1]. Under mpirun, the launcher decides the
    /// ranks.
    #[arg(long, alias = "replicas")]
    pub devices: Option<Devices>,
    /// 32-true, bf16-mixed or 16-mixed (also 32, bf16, 16, f32, f16)
    /// [default: 32-true].
    #[arg(long)]
    pub precision: Option<Precision>,
    /// 16-mixed: the loss scaler's first scale [default: 65536].
    #[arg(long)]
    pub init_scale: Option<f64>,
    /// A ZeRO stage (1 or 2) with --strategy ddp; 1, 2 or 3 (FSDP across
    /// the replicas) with pipeline-ranks.
    #[arg(long, alias = "pipeline-zero")]
    pub zero: Option<u8>,
    /// hsdp, zero1 and zero2: ranks per shard group, each group holding
    /// one copy of the pieces [default: hsdp the ranks per machine under
    /// mpirun, every rank on threads; zero every rank].
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    pub shard_size: Option<u64>,
    /// pipeline-ddp: stages per rank; pipeline-ranks: ranks per pipeline
    /// [default: 2].
    #[arg(long)]
    pub stages: Option<usize>,
    /// Pipelines: micro-batches per batch [default: one per stage].
    #[arg(long)]
    pub chunks: Option<usize>,
    /// ddp, zero: reduce each gradient bucket during the backward (the
    /// model given as units).
    #[arg(long)]
    pub overlap: bool,
    /// dp: parallel (each replica its loss and backward; also fast) or
    /// gathered (the loss of the gathered output; also dropin) [default:
    /// parallel].
    #[arg(long, alias = "backward")]
    pub dp_backward: Option<DpBackward>,
    /// FSDP: keep each unit gathered from its forward to its backward.
    #[arg(long)]
    pub no_reshard_after_forward: bool,
    /// FSDP: recompute each resharded unit for its backward instead of
    /// keeping its activations (less memory, a forward more).
    #[arg(long)]
    pub recompute_activations: bool,
    /// Clips the total 2-norm of the gradients to X (a finite number; 0:
    /// no clipping) before every step.
    #[arg(long = "clip-grad-norm", alias = "gradient-clip", value_name = "X", value_parser = clip_norm)]
    pub gradient_clip: Option<f64>,
    /// Batches per optimizer step [default: 1].
    #[arg(long)]
    pub accumulation_steps: Option<u64>,
    /// Where the training states are saved.
    #[arg(long)]
    pub checkpoint_dir: Option<PathBuf>,
    /// How many of the newest states to keep [default: 3].
    #[arg(long, value_name = "K", requires = "checkpoint_dir", value_parser = clap::value_parser!(u64).range(1..))]
    pub keep: Option<u64>,
    /// Seconds a rank waits in a collective before the job fails (none or
    /// inf: no limit) [default: 1800, or CANDLE_DP_TIMEOUT].
    #[arg(long, alias = "timeout", value_name = "SECONDS", value_parser = timeout_secs)]
    pub timeout_secs: Option<f64>,
    /// How many times the thread ranks start again after one fails,
    /// resuming from the newest state in --checkpoint-dir [default: 0].
    #[arg(long, value_name = "N")]
    pub max_restarts: Option<usize>,
    /// Seeds the initial weights and the data order [default: 0].
    #[arg(long)]
    pub seed: Option<u64>,
}

impl FabricArgs {
    /// The configuration: the defaults, then the `--config` file, then
    /// the flags given; checked.
    ///
    /// # Errors
    ///
    /// An unreadable or malformed file (naming it); what
    /// [`FabricConfig::check`] refuses.
    pub fn config(&self) -> Result<FabricConfig> {
        let mut config = match &self.config {
            Some(path) => FabricConfig::from_file(path)?,
            None => FabricConfig::default(),
        };
        macro_rules! given {
            ($($field:ident),*) => {$(
                if let Some(value) = self.$field.clone() {
                    config.$field = value;
                }
            )*};
        }
        given!(
            strategy,
            accelerator,
            devices,
            precision,
            init_scale,
            dp_backward,
            stages,
            accumulation_steps,
            max_restarts,
            seed
        );
        if self.zero.is_some() {
            config.zero = self.zero;
        }
        if let Some(size) = self.shard_size {
            config.shard_size = Some(usize::try_from(size).unwrap_or(usize::MAX));
        }
        if self.chunks.is_some() {
            config.chunks = self.chunks;
        }
        if let Some(clip) = self.gradient_clip {
            config.gradient_clip = (clip > 0.0).then_some(clip);
        }
        if let Some(keep) = self.keep {
            config.keep = usize::try_from(keep).unwrap_or(usize::MAX);
        }
        if self.checkpoint_dir.is_some() {
            config.checkpoint_dir = self.checkpoint_dir.clone();
        }
        if self.timeout_secs.is_some() {
            config.timeout_secs = self.timeout_secs;
        }
        if self.overlap {
            config.overlap = true;
        }
        if self.no_reshard_after_forward {
            config.reshard_after_forward = false;
        }
        if self.recompute_activations {
            config.recompute_activations = true;
        }
        if self.sequence_parallel {
            config.sequence_parallel = true;
        }
        if self.deterministic.is_some() {
            config.deterministic = self.deterministic;
        }
        if let Some(degrees) = self.mesh {
            // The flag's mesh replaces the file's, and what the file's set.
            if config.mesh.take().is_some() {
                let defaults = FabricConfig::default();
                config.strategy = self.strategy.unwrap_or(defaults.strategy);
                config.devices = self.devices.clone().unwrap_or(defaults.devices);
                config.stages = self.stages.unwrap_or(defaults.stages);
                // The file's ZeRO stage stays unless its mesh set it (3).
                config.zero = self.zero.or(config.zero.filter(|&z| z != 3));
                config.shard_size = defaults.shard_size;
            }
            config = config.with_mesh(degrees)?;
        }
        config.check()?;
        Ok(config)
    }
}

/// `--clip-grad-norm`: a finite number, 0 or more (0: no clipping).
fn clip_norm(value: &str) -> std::result::Result<f64, String> {
    let x: f64 = value
        .trim()
        .parse()
        .map_err(|_| format!("must be a number, got '{value}'"))?;
    match x {
        x if x.is_nan() => Err("must be a finite number, got NaN".into()),
        x if x.is_infinite() => Err(format!("must be a finite number, got {x}")),
        x if x < 0.0 => Err(format!("must be 0 or more (0: no clipping), got {x}")),
        x => Ok(x),
    }
}

/// `--timeout-secs`: seconds above 0, or `none` / `inf` for no limit.
fn timeout_secs(value: &str) -> std::result::Result<f64, String> {
    let value = value.trim();
    if value.eq_ignore_ascii_case("none") {
        return Ok(f64::INFINITY);
    }
    match value.parse::<f64>() {
        Ok(x) if x > 0.0 => Ok(x),
        _ => Err(format!(
            "must be a number of seconds above 0, or none, got '{value}'"
        )),
    }
}
