//! The language model part of the benchmark (`--lm`): `train_lm`'s model
//! and step (AdamW in its two groups, the warm-up + cosine schedule,
//! clipping at 1, the loss averaged over the ranks) timed per strategy
//! through a `Fabric`, and, given a Python with PyTorch
//! (`--torch-python`), the PyTorch twin (`scripts/train_lm_torch.py`) on
//! one process and as DDP (gloo) over two, from the same initial weights,
//! in the same rounds: tokens/s of each and the ratios.
//!
//! Each configuration runs in its own process (this binary with
//! `--lm-child`, or the twin), configurations interleaved over the rounds;
//! the first `WARMUP` steps of each run are not timed.

use std::path::Path;
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, Result};
use candle_core::{DType, Device};
use candle_dp::checkpoint::{self, Prefix};
use candle_dp::fabric::{Fabric, FabricConfig, Strategy};
use candle_dp::optim::{AdamWConfig, LrScheduler};
use candle_dp::seeded_varmap;
use candle_dp_examples::gpt::{
    adamw_groups, lm_loss, lm_loss_composite, loss_on, model_recipe, Gpt, GptConfig,
};
use candle_dp_examples::text::{load_text, split, windows_at};
use serde::{Deserialize, Serialize};

use crate::mfu::{lm_flops_per_token, Peak};
use crate::plan::cores;
use crate::stats::median;

/// `train_lm`'s defaults.
const SEED: u64 = 0;
pub(crate) const BATCH: usize = 8;
const LR: f64 = 1e-3;
/// Steps run before the timed ones (allocations, first-touch pages).
const WARMUP: usize = 2;

pub(crate) fn config(fused_ops: bool) -> GptConfig {
    GptConfig {
        vocab: 256,
        context: 128,
        width: 128,
        layers: 4,
        heads: 4,
        fused_ops,
        dropout: 0.0,
    }
}

/// One candle-dp configuration, sent to its child process as JSON.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct LmSpec {
    /// A Fabric strategy: `single`, `ddp`, `zero2`, `fsdp`, `hsdp`,
    /// `pipeline-ranks`.
    pub strategy: String,
    pub world: usize,
    /// `candle_dp::ops`' fused ops (the model's default) or candle's.
    pub fused_ops: bool,
    /// Steps timed after the warm-up.
    pub steps: usize,
    /// On simulated machines (`bench --mesh`): also count the bytes each
    /// machine's link carried over the timed steps.
    #[serde(default)]
    pub count_link_bytes: bool,
    /// `pipeline-ranks`: the ranks of one pipeline (the rest replicate
    /// it), with 4 micro-batches.
    #[serde(default)]
    pub stages: Option<usize>,
    /// `fsdp`: keep each unit's gathered parameters and graph from its
    /// forward to its backward (`false`: no recomputation) rather than the
    /// default, resharding after the forward.
    #[serde(default)]
    pub reshard_after_forward: Option<bool>,
    /// `fsdp`: recompute each resharded unit for its backward (the former
    /// default) instead of keeping its activations.
    #[serde(default)]
    pub recompute_activations: bool,
    /// `hsdp`, `zero1`, `zero2`: ranks per shard group (the Fabric's
    /// `shard_size`; none: HSDP's default, plain ZeRO).
    #[serde(default)]
    pub shard_size: Option<usize>,
    /// `pipeline-ranks`: ZeRO across the pipelines' replicas (1, 2; 3:
    /// FSDP), the Fabric's `zero`.
    #[serde(default)]
    pub zero: Option<u8>,
    /// The parallelism as the degrees of a mesh (`dp_replicate=2,tp=2`),
    /// instead of `strategy`'s name: the rows with tensor parallelism.
    #[serde(default)]
    pub mesh: Option<String>,
    /// With a mesh's `tp`: sequence parallelism.
    #[serde(default)]
    pub sequence_parallel: bool,
}

/// What one run measured: rank 0's step times, and with
/// `count_link_bytes` each machine's bytes sent and received over the
/// timed steps, in rank order of the machines' first ranks.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct LmMeasured {
    pub step_ms: Vec<f64>,
    #[serde(default)]
    pub link_bytes: Vec<(u64, u64)>,
}

/// The bytes this machine's network links (every interface but the
/// loopback) have sent and received: inside a network namespace of
/// `scripts/netcluster.sh`, the simulated machine's one link.
fn link_counters() -> Result<(u64, u64)> {
    let mut sent_received = (0, 0);
    for entry in std::fs::read_dir("/sys/class/net")? {
        let path = entry?.path();
        if path.file_name().is_some_and(|n| n == "lo") {
            continue;
        }
        let read = |what: &str| -> Result<u64> {
            let file = path.join("statistics").join(what);
            Ok(std::fs::read_to_string(&file)
                .with_context(|| file.display().to_string())?
                .trim()
                .parse()?)
        };
        sent_received.0 += read("tx_bytes")?;
        sent_received.1 += read("rx_bytes")?;
    }
    Ok(sent_received)
}

/// Runs one configuration in this process: `train_lm`'s loop without its
/// evaluations.
pub fn run_child(spec: &LmSpec) -> Result<LmMeasured> {
    let gpt = config(spec.fused_ops);
    let (train, _) = split(&load_text()?, gpt.context);
    let strategy: Strategy = spec.strategy.parse()?;
    let total = WARMUP + spec.steps;
    let fabric_config = FabricConfig {
        seed: SEED,
        gradient_clip: Some(1.0),
        timeout_secs: Some(300.0),
        stages: spec.stages.unwrap_or(2),
        chunks: spec.stages.map(|_| 4),
        reshard_after_forward: spec.reshard_after_forward.unwrap_or(true),
        recompute_activations: spec.recompute_activations,
        shard_size: spec.shard_size,
        zero: spec.zero,
        sequence_parallel: spec.sequence_parallel,
        ..FabricConfig::new(strategy, spec.world)
    };
    let fabric_config = match &spec.mesh {
        Some(mesh) => FabricConfig {
            devices: candle_dp::fabric::Devices::Count(1),
            ..fabric_config
        }
        .with_mesh(mesh.parse()?)?,
        None => fabric_config,
    };
    let answers = Fabric::launch(fabric_config, |fabric| {
        // The data's shares: one per rank, or per pipeline of ranks.
        let (share, shares) = (fabric.data_parallel_rank(), fabric.data_parallel_size());
        let per_rank = BATCH / shares;
        let adamw = AdamWConfig {
            lr: LR,
            weight_decay: 0.1,
            ..Default::default()
        };
        // With a tp degree each rank builds its pieces.
        let module = model_recipe(gpt, fabric.tensor_parallel());
        let mut model = fabric.setup(module, |p| adamw_groups(p, adamw, false))?;
        model.set_schedule(LrScheduler::warmup_cosine(LR, 1, total as u64)?)?;
        let mut measured = LmMeasured::default();
        // The first rank of each machine counts its link (the ranks of a
        // machine are neighbours: netcluster's --block).
        let counts = spec.count_link_bytes && candle_dp::launch::Backend::local_rank() == 0;
        let mut before = (0, 0);
        for step in 0..total {
            if step == WARMUP && spec.count_link_bytes {
                fabric.barrier()?;
                if counts {
                    before = link_counters()?;
                }
            }
            let start = Instant::now();
            let indices = windows_at(&train, shares, share, SEED, per_rank, step as u64)?;
            let (x, y) = train.batch(&indices)?;
            let whole = match spec.fused_ops {
                true => lm_loss,
                false => lm_loss_composite,
            };
            let loss = model.backward(&x, &y, loss_on(fabric.tensor_parallel(), whole))?;
            model.step()?;
            fabric.global_mean(&loss, x.dim(0)?)?;
            if step >= WARMUP {
                measured.step_ms.push(start.elapsed().as_secs_f64() * 1e3);
            }
        }
        if spec.count_link_bytes {
            fabric.barrier()?;
            let mine = match counts {
                true => {
                    let after = link_counters()?;
                    Some((after.0 - before.0, after.1 - before.1))
                }
                false => None,
            };
            measured.link_bytes = fabric
                .all_gather_object(&mine)?
                .into_iter()
                .flatten()
                .collect();
        }
        Ok(measured)
    })?;
    Ok(answers.into_iter().next().unwrap_or_default())
}

/// A row of the report: a candle-dp configuration or the twin.
#[derive(Debug, Clone)]
enum Run {
    CandleDp(LmSpec),
    /// The PyTorch twin over this many processes (1: one process with
    /// every core's threads; more: DDP over gloo).
    Torch {
        world: usize,
    },
}

impl Run {
    fn label(&self) -> String {
        match self {
            Run::CandleDp(spec) if spec.strategy == "single" => format!(
                "candle-dp, one device ({})",
                if spec.fused_ops {
                    "fused ops"
                } else {
                    "candle's ops"
                }
            ),
            Run::CandleDp(spec) => format!(
                "candle-dp, {} x{} thread ranks{}",
                spec.strategy,
                spec.world,
                match (spec.reshard_after_forward, spec.recompute_activations) {
                    (Some(false), _) => " (no reshard after forward)",
                    (_, true) => " (resharded units recomputed)",
                    _ => "",
                }
            ),
            Run::Torch { world: 1 } => format!("PyTorch, one process, {} threads", cores()),
            Run::Torch { world } => format!(
                "PyTorch DDP (gloo), {world} processes x {} thread(s)",
                (cores() / world).max(1)
            ),
        }
    }

    /// The PyTorch run this one is compared with: one process for one
    /// device, DDP for the parallel strategies.
    fn torch_twin(&self) -> Option<usize> {
        match self {
            Run::CandleDp(spec) if spec.strategy == "single" => Some(1),
            Run::CandleDp(spec) => Some(spec.world),
            Run::Torch { .. } => None,
        }
    }
}

/// The twin's answer (`--json`): its per-step seconds.
#[derive(Debug, Deserialize)]
struct TwinJson {
    step_seconds: Vec<f64>,
}

/// One run of the twin: rank 0's timed step times, in ms.
fn run_torch(
    python: &Path,
    init: &Path,
    out: &Path,
    world: usize,
    steps: usize,
) -> Result<Vec<f64>> {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/train_lm_torch.py");
    let json = out.join(format!("lm-torch-{world}.json"));
    let mut cmd = Command::new(python);
    cmd.arg(script)
        .arg("--init")
        .arg(init)
        .args(["--steps", &(WARMUP + steps).to_string()])
        .args(["--world", &world.to_string()])
        .arg("--json")
        .arg(&json);
    if world == 1 {
        cmd.args(["--threads", &cores().to_string()]);
    }
    let label = Run::Torch { world }.label();
    crate::run_ok(&mut cmd, &label)?;
    let twin: TwinJson = serde_json::from_str(&std::fs::read_to_string(&json)?)
        .with_context(|| format!("{label}: {}", json.display()))?;
    Ok(twin
        .step_seconds
        .iter()
        .skip(WARMUP)
        .map(|s| s * 1e3)
        .collect())
}

fn runs(quick: bool, steps: usize, torch: bool) -> Vec<Run> {
    let spec = |strategy: &str, world, fused_ops| {
        Run::CandleDp(LmSpec {
            strategy: strategy.into(),
            world,
            fused_ops,
            steps,
            ..LmSpec::default()
        })
    };
    let mut runs = vec![spec("single", 1, true)];
    if !quick {
        runs.push(spec("single", 1, false));
        runs.extend([
            spec("ddp", 2, true),
            spec("zero2", 2, true),
            spec("fsdp", 2, true),
        ]);
        // FSDP without its recomputation: the gathered parameters kept
        // from each unit's forward to its backward (FSDP2's
        // `reshard_after_forward=False`).
        // And with its resharded units recomputed for the backward
        // (activation checkpointing per unit, the former default).
        if let Some(Run::CandleDp(fsdp)) = runs.last().cloned() {
            runs.push(Run::CandleDp(LmSpec {
                reshard_after_forward: Some(false),
                ..fsdp.clone()
            }));
            runs.push(Run::CandleDp(LmSpec {
                recompute_activations: true,
                ..fsdp
            }));
        }
    }
    if torch {
        runs.push(Run::Torch { world: 1 });
        if !quick {
            runs.push(Run::Torch { world: 2 });
        }
    }
    runs
}

/// Every configuration, interleaved over `rounds`; the report.
pub fn run(
    quick: bool,
    steps: usize,
    rounds: usize,
    torch_python: Option<&Path>,
    out: &Path,
) -> Result<String> {
    let runs = runs(quick, steps, torch_python.is_some());
    let init = out.join("lm-init.safetensors");
    if torch_python.is_some() {
        // The twin starts from the weights the Fabric draws from the seed.
        let varmap = seeded_varmap(SEED, DType::F32, &Device::Cpu, |vb| {
            Gpt::new(config(true), vb)
        })?;
        checkpoint::save(&varmap, &init, Prefix::None)?;
    }
    let mut step_ms = vec![Vec::new(); runs.len()];
    for _ in 0..rounds {
        for (run, times) in runs.iter().zip(&mut step_ms) {
            eprintln!("lm: {}", run.label());
            match (run, torch_python) {
                (Run::CandleDp(spec), _) => {
                    let mut cmd = Command::new(std::env::current_exe()?);
                    cmd.arg("--lm-child").arg(serde_json::to_string(spec)?);
                    let got: LmMeasured = crate::child_answer(cmd, &run.label())?;
                    times.extend(got.step_ms);
                }
                (Run::Torch { world }, Some(python)) => {
                    times.extend(run_torch(python, &init, out, *world, steps)?);
                }
                (Run::Torch { .. }, None) => {}
            }
        }
    }
    Ok(report(&runs, &step_ms, steps, rounds))
}

fn report(runs: &[Run], step_ms: &[Vec<f64>], steps: usize, rounds: usize) -> String {
    let gpt = config(true);
    let peak = Peak::of_this_cpu();
    let tokens = (BATCH * gpt.context) as f64;
    let per_s: Vec<f64> = step_ms.iter().map(|t| tokens / median(t) * 1e3).collect();
    let torch_of = |world: usize| {
        runs.iter()
            .position(|r| matches!(r, Run::Torch { world: w } if *w == world))
            .map(|i| per_s[i])
    };
    let mut s = format!(
        "## The language model (`train_lm`'s defaults: {} layers, width {}, context {}, \
         global batch {BATCH}; AdamW in two groups, warm-up + cosine, clipping at 1)\n\n\
         Each run in its own process, {rounds} round(s) of {steps} timed steps after {WARMUP} \
         untimed ones, interleaved; tokens/s from the median step. `vs PyTorch`: against \
         PyTorch's one process for one device, against PyTorch's DDP of as many processes \
         for the parallel runs. {}.\n\n\
         | run | ms/step | tokens/s | vs PyTorch | GFLOP/s | MFU |\n|---|---:|---:|---:|---:|---:|\n",
        gpt.layers,
        gpt.width,
        gpt.context,
        crate::machine(crate::plan::DeviceKind::Cpu),
    );
    for (i, run) in runs.iter().enumerate() {
        let ratio = run
            .torch_twin()
            .and_then(torch_of)
            .map_or_else(|| "".to_string(), |t| format!("{:.2}x", per_s[i] / t));
        let (gflops, mfu) = peak.cells(Some(per_s[i] * lm_flops_per_token(&gpt)));
        s += &format!(
            "| {} | {:.1} | {:.0} | {ratio} | {gflops} | {mfu} |\n",
            run.label(),
            median(&step_ms[i]),
            per_s[i]
        );
    }
    s + "\n" + &peak.describe() + ".\n"
}
