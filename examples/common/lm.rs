//! What `train_lm` reports around its one loop: a run's outcome, its
//! held-out loss and a sample of its text, its name, and the table,
//! memory lines and chart comparing its runs.

use std::path::Path;
use std::time::Duration;

use anyhow::bail;
use candle_core::{DType, Device, Tensor, Var};
use candle_dp::fabric::{Devices, FabricArgs, FabricConfig, Memory, Precision};
use candle_dp::launch::Backend;
use candle_dp::optim::{AdamW, AdamWConfig, LrScheduler};
use candle_dp::precision::{MixedPrecision, MixedPrecisionModel};
use candle_nn::VarMap;

use crate::flags;
use crate::gpt::{adamw_groups, lm_loss, lm_loss_composite, Gpt, GptConfig};
use crate::report::{self, Curve, Schedule};
use crate::text::Windows;

/// The model's flags.
#[derive(Debug, Clone, clap::Args)]
pub struct GptArgs {
    /// Bytes the model sees at once (at least 1).
    #[arg(long, default_value_t = 128, value_parser = flags::at_least_one::<usize>)]
    pub context: usize,
    /// The model's width (at least 1; a multiple of `--heads`).
    #[arg(long, default_value_t = 128, value_parser = flags::at_least_one::<usize>)]
    pub width: usize,
    /// Transformer blocks (at least 1).
    #[arg(long, default_value_t = 4, value_parser = flags::at_least_one::<usize>)]
    pub layers: usize,
    /// Attention heads (at least 1).
    #[arg(long, default_value_t = 4, value_parser = flags::at_least_one::<usize>)]
    pub heads: usize,
    /// candle's composite ops instead of the crate's fused ones
    /// (`candle_dp::ops`), for comparison.
    #[arg(long)]
    pub no_fused_ops: bool,
    /// Dropout on each block's residual branches in training, keyed by the
    /// sample (kept by `--deterministic`) [default: 0, none].
    #[arg(long, default_value_t = 0.0, value_parser = flags::fraction)]
    pub dropout: f64,
}

impl GptArgs {
    /// The model they describe (bytes: a vocabulary of 256).
    pub fn config(&self) -> GptConfig {
        GptConfig {
            vocab: 256,
            context: self.context,
            width: self.width,
            layers: self.layers,
            heads: self.heads,
            fused_ops: !self.no_fused_ops,
            dropout: self.dropout,
        }
    }

    /// The training loss: fused unless `--no-fused-ops`.
    pub fn loss(&self) -> fn(&Tensor, &Tensor) -> candle_core::Result<Tensor> {
        match self.no_fused_ops {
            true => lm_loss_composite,
            false => lm_loss,
        }
    }
}

/// The optimizer's flags: AdamW over two parameter groups, and its
/// schedule.
#[derive(Debug, Clone, clap::Args)]
pub struct OptimArgs {
    /// AdamW's peak learning rate (a finite number above 0).
    #[arg(long, default_value_t = 1e-3, value_parser = flags::positive_f64)]
    pub lr: f64,
    /// AdamW's weight decay (a finite number, 0 or more; 0: none), on the
    /// weight matrices only (embeddings and linear weights; not biases or
    /// LayerNorm weights), as GPT-2 is trained: two parameter groups.
    #[arg(long, default_value_t = 0.1, value_parser = flags::non_negative_f64)]
    pub weight_decay: f64,
    /// Decay every parameter, biases and LayerNorm weights too (one
    /// parameter group).
    #[arg(long)]
    pub decay_all: bool,
    /// The learning rate over the run.
    #[arg(long, value_enum, default_value_t = Schedule::WarmupCosine)]
    pub lr_schedule: Schedule,
    /// Warm-up steps of `--lr-schedule warmup-cosine` (fewer than
    /// `--steps`) [default: 5% of `--steps`, at least 1].
    #[arg(long, value_name = "N")]
    pub warmup_steps: Option<u64>,
}

impl OptimArgs {
    /// AdamW over `params`, in GPT-2's two groups unless `--decay-all`.
    pub fn adamw(&self, params: Vec<(String, Var)>) -> candle_core::Result<AdamW> {
        let config = AdamWConfig {
            lr: self.lr,
            weight_decay: self.weight_decay,
            ..Default::default()
        };
        adamw_groups(params, config, self.decay_all)
    }

    /// The schedule over `steps` steps (`None`: a constant rate).
    pub fn schedule(&self, steps: u64) -> anyhow::Result<Option<LrScheduler>> {
        self.lr_schedule.over(self.lr, self.warmup_steps, steps)
    }

    /// `AdamW lr L (schedule), decay D on matrices`.
    pub fn describe(&self) -> String {
        let on = if self.decay_all { "all" } else { "matrices" };
        let (lr, schedule, decay) = (self.lr, self.lr_schedule, self.weight_decay);
        format!("AdamW lr {lr} ({schedule:?}), decay {decay} on {on}")
    }
}

/// `GPT, L layers, width W, H heads, context C: P M parameters`.
pub fn describe(gpt: &GptConfig) -> String {
    let millions = gpt.parameters() as f64 / 1e6;
    format!(
        "GPT, {} layers, width {}, {} heads, context {}: {millions:.2}M parameters",
        gpt.layers, gpt.width, gpt.heads, gpt.context
    )
}

/// The Fabric's configuration of `train_lm`: its flags, with the
/// example's defaults (two replicas or ranks, or mpirun's processes; 4
/// micro-batches; clipping at 1), `--replicas` counting the ranks of
/// `ddp-pipeline`, a `pipeline` under mpirun on its processes, and
/// `--gpus` naming the devices.
pub fn fabric_config(args: &FabricArgs, gpus: Option<&Devices>) -> anyhow::Result<FabricConfig> {
    let mut fabric = args.clone();
    let mpi = Backend::from_env() != Backend::Threads;
    fabric.chunks.get_or_insert(4);
    fabric.gradient_clip.get_or_insert(1.0);
    // `--pipeline-zero 3` over `dp` replicas: FSDP across them, `dp_shard`.
    if let (Some(3), Some(mesh)) = (fabric.zero, fabric.mesh.as_mut()) {
        if mesh.pp > 1 && mesh.dp_shard == 1 {
            (mesh.dp_shard, mesh.dp_replicate) = (mesh.dp_replicate, 1);
        }
    }
    if fabric.config.is_none() && fabric.mesh.is_none() {
        let strategy = fabric.strategy.unwrap_or(FabricConfig::default().strategy);
        // Under mpirun the launcher's processes are the ranks.
        let ranks = match mpi {
            true => Backend::world_size(),
            false => fabric.devices.as_ref().map_or(2, Devices::len),
        };
        let stages = fabric.stages.unwrap_or(2);
        match strategy.name() {
            "single" => {}
            "pipeline-ddp" => fabric.devices = Some(Devices::Count(ranks * stages)),
            "pipeline" if mpi => fabric.mesh = Some(format!("pp={ranks}").parse()?),
            _ => fabric.devices = Some(Devices::Count(ranks)),
        }
    }
    let mut config = fabric.config()?;
    if let (Some(gpus), Devices::Count(n)) = (gpus, &config.devices) {
        config.devices = Devices::Ids(gpus.ordinals().into_iter().take(*n).collect());
    }
    if mpi && args.mesh.is_some() && config.ranks() != Backend::world_size() {
        let (mesh, ranks) = (config.degrees(), config.ranks());
        let processes = Backend::world_size();
        bail!("--mesh {mesh} lays out {ranks} ranks, but mpirun started {processes} processes");
    }
    Ok(config)
}

/// What a restart's ranks must divide (the global batch, so that a
/// restart on fewer slots starts on the most ranks that share it), or
/// `None` where shard groups, a mesh or a pipeline on ranks fix numbers
/// of their own.
pub fn ranks_dividing(config: &FabricConfig, mesh_given: bool, batch: usize) -> Option<usize> {
    let name = config.effective_strategy().name();
    let own_numbers = mesh_given
        || config.shard_size.is_some()
        || ["hsdp", "pipeline", "pipeline-ranks"].contains(&name);
    (!own_numbers).then_some(batch)
}

/// Writes the initial weights of `gpt` drawn from `seed` (the Fabric draws
/// the same) to `path`, and says so.
pub fn save_init(gpt: GptConfig, seed: u64, path: &Path) -> anyhow::Result<()> {
    let init = candle_dp::seeded_varmap(seed, DType::F32, &Device::Cpu, |vb| Gpt::new(gpt, vb))?;
    candle_dp::checkpoint::save(&init, path, candle_dp::checkpoint::Prefix::None)?;
    println!("initial weights saved to {}", path.display());
    Ok(())
}

/// The held-out loss of `model` after `step`, said.
pub fn evaluate(
    model: &MixedPrecisionModel<Gpt>,
    held_out: &Windows,
    step: u64,
) -> anyhow::Result<f32> {
    let loss = held_out_loss(model, held_out)?;
    let perplexity = f64::from(loss).exp();
    println!("step {step:>5}  held-out loss {loss:.5}  perplexity {perplexity:.2}");
    Ok(loss)
}

/// With FSDP, what a rank holds and the most a step gathered.
pub fn say_what_fsdp_gathered(memory: &Memory) {
    let Some(peak) = memory.peak_gathered else {
        return;
    };
    let mb = |b: usize| b as f64 / 1e6;
    let whole = memory
        .whole_model
        .map_or_else(String::new, |w| format!(" (the model: {:.2} MB)", mb(w)));
    println!(
        "FSDP: each rank holds {:.2} MB of parameters; a step gathered at most {:.2} MB of whole parameters at once{whole}",
        mb(memory.parameters),
        mb(peak)
    );
}

/// What a run reports (rank 0's).
pub struct Outcome {
    /// The global batch's loss at every step.
    pub losses: Vec<f32>,
    /// (step, held-out loss).
    pub held_out: Vec<(u64, f32)>,
    /// Training time, evaluations excluded.
    pub training: Duration,
    /// Tokens trained on, every rank's.
    pub tokens: u64,
    /// The weights at the last evaluation.
    pub varmap: VarMap,
    /// Steps the f16 loss scaler skipped.
    pub skipped: u64,
    /// Bytes held after the last step (the most on any rank).
    pub memory: Memory,
}

impl Default for Outcome {
    fn default() -> Self {
        Self {
            losses: Vec::new(),
            held_out: Vec::new(),
            training: Duration::ZERO,
            tokens: 0,
            varmap: VarMap::new(),
            skipped: 0,
            memory: Memory::default(),
        }
    }
}

/// The model computing in `precision` over `varmap`'s f32 variables.
pub fn in_precision(
    config: GptConfig,
    precision: Precision,
    varmap: &VarMap,
) -> anyhow::Result<MixedPrecisionModel<Gpt>> {
    let policy = precision
        .policy()
        .unwrap_or_else(|| MixedPrecision::new(DType::F32));
    let model = MixedPrecisionModel::new(varmap, DType::F32, &Device::Cpu, policy, |vb| {
        Gpt::new(config, vb)
    })?;
    Ok(model)
}

/// The mean loss over the held-out windows.
pub fn held_out_loss(model: &MixedPrecisionModel<Gpt>, held_out: &Windows) -> anyhow::Result<f32> {
    let all: Vec<usize> = (0..held_out.len()).collect();
    let (mut sum, mut count) = (0f64, 0usize);
    for chunk in all.chunks(32) {
        let (x, y) = held_out.batch(chunk)?;
        let loss = lm_loss(&model.forward(&x)?, &y)?.to_scalar::<f32>()?;
        sum += f64::from(loss) * chunk.len() as f64;
        count += chunk.len();
    }
    Ok((sum / count.max(1) as f64) as f32)
}

/// A continuation of `prompt` by `bytes` bytes, each drawn from the
/// model's distribution at temperature 0.8 (greedy decoding of so small a
/// model repeats one word), with a generator seeded by `seed`.
pub fn generate(
    model: &MixedPrecisionModel<Gpt>,
    context: usize,
    prompt: &str,
    bytes: usize,
    seed: u64,
) -> anyhow::Result<String> {
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut text: Vec<u8> = prompt.bytes().collect();
    for _ in 0..bytes {
        let start = text.len().saturating_sub(context);
        let ids: Vec<u32> = text[start..].iter().map(|&b| u32::from(b)).collect();
        let n = ids.len();
        let logits = model.forward(&Tensor::from_vec(ids, (1, n), &Device::Cpu)?)?;
        let last = logits
            .narrow(1, n - 1, 1)?
            .flatten_all()?
            .to_dtype(DType::F32)?;
        let p = candle_nn::ops::softmax(&(last / 0.8)?, 0)?.to_vec1::<f32>()?;
        let mut draw = rng.random::<f32>();
        let next = p
            .iter()
            .position(|&q| {
                draw -= q;
                draw <= 0.0
            })
            .unwrap_or(p.len() - 1);
        text.push(next as u8);
    }
    Ok(String::from_utf8_lossy(&text).into_owned())
}

/// What the rank holding the most holds, of every rank's `memory`.
pub fn most(all: &[Memory]) -> Memory {
    let most = |f: fn(&Memory) -> usize| all.iter().map(f).max().unwrap_or(0);
    Memory {
        parameters: most(|m| m.parameters),
        gradients: most(|m| m.gradients),
        optimizer_state: most(|m| m.optimizer_state),
        peak_gathered: all.iter().filter_map(|m| m.peak_gathered).max(),
        whole_model: all.first().and_then(|m| m.whole_model),
    }
}

/// How a run of `config` is named: `DDP x2 (thread ranks)`, `FSDP x4
/// (MPI processes)`, `HSDP x4 (thread ranks, shard groups of 2)`, `1
/// pipeline(s) of 4 stages on MPI processes, 4 micro-batches` ...
pub fn label(config: &FabricConfig) -> String {
    let tp = config.tensor_parallel_size();
    if tp == 1 {
        return data_parallel_label(config);
    }
    let split = match config.sequence_parallel {
        true => "tensor + sequence parallel",
        false => "tensor parallel",
    };
    let dp = FabricConfig {
        devices: candle_dp::fabric::Devices::Count(config.devices.len() / tp),
        mesh: config
            .mesh
            .map(|m| candle_dp::fabric::Degrees { tp: 1, ..m }),
        ..config.clone()
    };
    match data_parallel_label(&dp).as_str() {
        "one device" => format!("{split} x{tp}"),
        other => format!("{other} x {split} {tp}"),
    }
}

/// [`label`] of the data-parallel strategy.
fn data_parallel_label(config: &FabricConfig) -> String {
    let strategy = config.effective_strategy();
    let degrees = config.degrees();
    let n = match Backend::from_env() {
        Backend::Threads => config.devices.len(),
        Backend::Mpi { .. } => Backend::world_size(),
    };
    let on = match Backend::from_env() {
        Backend::Threads => "thread ranks",
        Backend::Mpi { .. } => "MPI processes",
    };
    let chunks = config.chunks.unwrap_or(config.stages);
    if strategy.name() == "single" {
        return "one device".into();
    }
    if !strategy.is_distributed() {
        return match degrees.pp > 1 {
            true => format!("pipeline x{n} stages, {chunks} micro-batches"),
            false => format!("{} x{n}", strategy.title()),
        };
    }
    if strategy.name() == "pipeline-ddp" {
        let ranks = config.ranks();
        return format!(
            "DDP over {ranks} {on}, each a pipeline of {} stages",
            config.stages
        );
    }
    if degrees.pp > 1 {
        let sharded = match (config.zero, config.shard_size) {
            (Some(3), Some(shard)) if degrees.dp_replicate > 1 => {
                format!(", HSDP across the pipelines (shard groups of {shard})")
            }
            (Some(3), _) => ", FSDP across the pipelines".to_string(),
            (Some(stage), _) => format!(", ZeRO-{stage} across the pipelines"),
            (None, _) => String::new(),
        };
        let pipelines = n / config.stages.max(1);
        let stages = config.stages;
        return format!(
            "{pipelines} pipeline(s) of {stages} stages on {on}, {chunks} micro-batches{sharded}"
        );
    }
    match config.shard_size {
        Some(shard) => format!("{} x{n} ({on}, shard groups of {shard})", strategy.title()),
        None => format!("{} x{n} ({on})", strategy.title()),
    }
}

/// The runs' table and memory, how far the first run's losses are from
/// one device's (the second run, if any), the first run's losses as CSV
/// at `losses` and weights at `save`, and the chart at `chart`.
pub fn compare(
    runs: &[(String, &Outcome)],
    steps: u64,
    losses: Option<&Path>,
    save: Option<&Path>,
    chart: &Path,
) -> anyhow::Result<()> {
    println!("\n| run | training loss (last 10 steps) | held-out loss | perplexity | tokens/s |");
    println!("|---|---|---|---|---|");
    for (label, o) in runs {
        let tail = &o.losses[o.losses.len().saturating_sub(10)..];
        let recent = tail.iter().sum::<f32>() / tail.len().max(1) as f32;
        let held = o.held_out.last().map_or(f32::NAN, |&(_, l)| l);
        let rate = o.tokens as f64 / o.training.as_secs_f64().max(1e-9);
        let perplexity = f64::from(held).exp();
        println!("| {label} | {recent:.4} | {held:.4} | {perplexity:.2} | {rate:.0} |");
        if o.skipped > 0 {
            println!("{label}: the f16 loss scaler skipped {} steps", o.skipped);
        }
    }
    for (label, o) in runs {
        let mb = |b: usize| b as f64 / 1e6;
        let m = &o.memory;
        println!(
            "{label}: held after a step (the most on a rank): parameters {:.2} MB, gradients {:.2} MB, optimizer state {:.2} MB",
            mb(m.parameters),
            mb(m.gradients),
            mb(m.optimizer_state)
        );
    }
    let first = steps - runs.first().map_or(0, |(_, o)| o.losses.len() as u64);
    if let [(_, run), (_, one)] = runs {
        let gap = run.losses.iter().zip(&one.losses);
        let gap = gap.map(|(a, b)| ((a - b) / b).abs()).fold(0f32, f32::max);
        println!("largest relative difference of a step's loss from one device's: {gap:.2e}");
    }
    if let (Some(path), Some((_, o))) = (losses, runs.first()) {
        let rows = o.losses.iter().enumerate();
        let rows: String = rows
            .map(|(i, l)| format!("{},{l}\n", first + i as u64 + 1))
            .collect();
        std::fs::write(path, format!("step,loss\n{rows}"))?;
    }
    if let (Some(path), Some((_, o))) = (save, runs.first()) {
        candle_dp::checkpoint::save(&o.varmap, path, candle_dp::checkpoint::Prefix::None)?;
        println!("weights saved to {}", path.display());
    }
    let train: Vec<Curve> = runs
        .iter()
        .map(|(label, o)| {
            let points = o.losses.iter().enumerate();
            let points = points.map(|(i, &l)| ((first + i as u64 + 1) as f64, f64::from(l)));
            (label.clone(), points.collect())
        })
        .collect();
    let held: Vec<Curve> = runs
        .iter()
        .map(|(label, o)| {
            let points = o.held_out.iter().map(|&(s, l)| (s as f64, f64::from(l)));
            (label.clone(), points.collect())
        })
        .collect();
    let title = "loss per step (thin: the step's batch; thick: held out)";
    let axes = ("step", "cross-entropy (nats per byte)");
    report::chart(chart, &[(title, axes, train, held)])?;
    println!("loss curves: {}", chart.display());
    Ok(())
}
