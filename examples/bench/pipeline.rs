//! The pipeline part of the benchmark (`--pipeline`): one device against
//! naive model parallelism (one micro-batch), GPipe and 1F1B at 2 to 16
//! micro-batches, activation checkpointing and interleaved 1F1B (2 and 3
//! stages per device), on an MLP whose stages are all compute; then a run
//! under a per-device memory budget that one device cannot meet.
//!
//! Each configuration runs in its own child process (this binary with
//! `--pipeline-child`): the pipeline sizes candle's thread pools for its
//! stages once per process, and one device must keep all the cores.

use std::fmt::Write as _;
use std::process::Command;
use std::time::Instant;

use anyhow::{bail, Result};
use candle_core::{DType, Device, Tensor};
use candle_dp::pipeline::{unit, Balance, Checkpoint, Pipeline, Schedule, UnitFactory};
use candle_dp::{cpu_devices, seeded_varmap, LossReduction};
use candle_nn::{linear, loss, Activation, AdamW, Optimizer, ParamsAdamW, VarBuilder, VarMap, SGD};
use serde::{Deserialize, Serialize};

use crate::plan::cores;
use crate::stats::median;

/// One configuration, sent to its child process as JSON.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PipeSpec {
    /// `None`: one device.
    pub stages: Option<usize>,
    pub chunks: usize,
    pub gpipe: bool,
    pub width: usize,
    pub depth: usize,
    pub batch: usize,
    pub steps: usize,
    /// Activation checkpointing: 0 never, 1 all micro-batches but the
    /// last, 2 always.
    #[serde(default)]
    pub checkpoint: u8,
    /// Stages per device: above 1, interleaved 1F1B.
    #[serde(default = "one")]
    pub stages_per_device: usize,
    /// The stages on thread ranks (`RankPipeline`, messages between
    /// ranks) instead of the devices of one pipeline.
    #[serde(default)]
    pub on_ranks: bool,
}

fn one() -> usize {
    1
}

impl PipeSpec {
    fn label(&self) -> String {
        match (self.on_ranks, self.stages) {
            (true, Some(k)) => format!("{}, on {k} thread ranks", self.in_process_label()),
            _ => self.in_process_label(),
        }
    }

    fn in_process_label(&self) -> String {
        match self.stages {
            None => "one device".into(),
            Some(_) if self.chunks == 1 => "naive model parallel (1 micro-batch)".into(),
            Some(_) => format!(
                "{} {} micro-batches{}",
                match (self.gpipe, self.stages_per_device) {
                    (true, _) => "GPipe".to_string(),
                    (false, 1) => "1F1B".to_string(),
                    (false, v) => format!("interleaved 1F1B, {v} stages per device,"),
                },
                self.chunks,
                match self.checkpoint {
                    0 => "",
                    1 => ", checkpoint except-last",
                    _ => ", checkpoint always",
                }
            ),
        }
    }
}

/// What a child measured: per-step wall time, bubble, the share of the
/// devices' busy time spent checking recomputations, activation peaks.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct PipeMeasured {
    pub step_ms: Vec<f64>,
    pub bubble: Vec<f64>,
    pub check_share: Vec<f64>,
    pub peak_saved_bytes: Vec<usize>,
}

/// `depth` blocks of linear(width, width) and relu, then linear(width, 10).
fn layers(width: usize, depth: usize) -> Vec<UnitFactory> {
    let mut layers = Vec::new();
    for i in 0..depth {
        layers.push(unit(move |vb| linear(width, width, vb.pp(format!("l{i}")))));
        layers.push(unit(|_| Ok(Activation::Relu)));
    }
    layers.push(unit(move |vb| linear(width, 10, vb.pp("out"))));
    layers
}

/// The same layers on one device, applied in order.
fn one_device(
    list: &[UnitFactory],
    varmap: &VarMap,
    dtype: DType,
) -> Result<impl Fn(&Tensor) -> Result<Tensor>> {
    let vb = VarBuilder::from_varmap(varmap, dtype, &Device::Cpu);
    let built = list
        .iter()
        .map(|f| f(vb.clone()))
        .collect::<candle_core::Result<Vec<_>>>()?;
    Ok(move |x: &Tensor| {
        Ok(built
            .iter()
            .try_fold(x.clone(), |h, l| l.forward_t(&h, true))?)
    })
}

fn init(width: usize, depth: usize, dtype: DType) -> Result<VarMap> {
    let list = layers(width, depth);
    Ok(seeded_varmap(7, dtype, &Device::Cpu, |vb| {
        list.iter().try_for_each(|f| f(vb.clone()).map(|_| ()))
    })?)
}

fn batch(rows: usize, width: usize, seed: u32) -> Result<(Tensor, Tensor)> {
    let x: Vec<f32> = (0..rows * width)
        .map(|i| (((i as u32).wrapping_mul(2654435761) ^ seed) % 1000) as f32 / 500.0 - 1.0)
        .collect();
    let y: Vec<u32> = (0..rows as u32).map(|i| (i * 7 + seed) % 10).collect();
    Ok((
        Tensor::from_vec(x, (rows, width), &Device::Cpu)?,
        Tensor::from_vec(y, rows, &Device::Cpu)?,
    ))
}

/// The child side: trains `spec.steps` timed steps (after one warm-up).
pub fn run_child(spec: &PipeSpec) -> Result<PipeMeasured> {
    let varmap = init(spec.width, spec.depth, DType::F32)?;
    let (x, y) = batch(spec.batch, spec.width, 1)?;
    let mut sgd = SGD::new(varmap.all_vars(), 0.01)?;
    let mut measured = PipeMeasured::default();
    match spec.stages {
        None => {
            let model = one_device(&layers(spec.width, spec.depth), &varmap, DType::F32)?;
            for step in 0..=spec.steps {
                let start = Instant::now();
                let l = loss::cross_entropy(&model(&x)?, &y)?;
                sgd.backward_step(&l)?;
                if step > 0 {
                    measured.step_ms.push(start.elapsed().as_secs_f64() * 1e3);
                }
            }
        }
        Some(_) if spec.on_ranks => return on_ranks(spec),
        Some(stages) => {
            // Stages of equal work (the relus weigh nothing), so that the
            // bubble measured is the schedule's, not an uneven split's.
            let pipe = Pipeline::builder(&varmap, DType::F32, &cpu_devices(stages))
                .balance(Balance::ParameterBytes)
                .chunks(spec.chunks)
                .schedule(schedule_of(spec))
                .checkpoint(checkpoint_of(spec))
                .build(layers(spec.width, spec.depth))?;
            for step in 0..=spec.steps {
                let start = Instant::now();
                let s = pipe.forward_backward(&x, &y, LossReduction::Mean, loss::cross_entropy)?;
                sgd.step(&s.grads)?;
                if step > 0 {
                    measured.step_ms.push(start.elapsed().as_secs_f64() * 1e3);
                    let t = pipe.last_timings();
                    measured.bubble.push(t.bubble());
                    measured.check_share.push(check_share(&t));
                    measured.peak_saved_bytes = t.peak_saved_bytes;
                }
            }
        }
    }
    Ok(measured)
}

/// `spec` with its stages on thread ranks (`RankPipeline`): each rank
/// builds its stages from the same seeded values, steps its variables,
/// and the bubble is the whole pipeline's (every rank's busy time).
fn on_ranks(spec: &PipeSpec) -> Result<PipeMeasured> {
    use candle_dp::pipeline::{RankPipeline, RankPipelineConfig};
    let stages = spec.stages.unwrap_or(2);
    let (x, y) = batch(spec.batch, spec.width, 1)?;
    let config = RankPipelineConfig {
        balance: Balance::ParameterBytes,
        chunks: Some(spec.chunks),
        schedule: schedule_of(spec),
        checkpoint: checkpoint_of(spec),
        ..Default::default()
    };
    let per_rank = candle_dp::launch::spawn(stages, |ctx| {
        let varmap = init(spec.width, spec.depth, DType::F32)?;
        let pipe = RankPipeline::new(
            ctx.process_group(),
            &varmap,
            DType::F32,
            &Device::Cpu,
            layers(spec.width, spec.depth),
            config.clone(),
        )?;
        let vars = pipe.variables().iter().map(|(_, v)| v.clone()).collect();
        let mut sgd = SGD::new(vars, 0.01)?;
        let mut measured = PipeMeasured::default();
        for step in 0..=spec.steps {
            let start = Instant::now();
            let s = pipe.forward_backward(
                Some(&x),
                Some(&y),
                LossReduction::Mean,
                loss::cross_entropy,
            )?;
            sgd.step(&s.grads)?;
            let elapsed = start.elapsed();
            let t = pipe.gather_timings()?;
            if step > 0 {
                measured.step_ms.push(elapsed.as_secs_f64() * 1e3);
                measured.bubble.push(t.bubble());
                measured.check_share.push(check_share(&t));
                measured.peak_saved_bytes = t.peak_saved_bytes;
            }
        }
        Ok(measured)
    })?;
    Ok(per_rank.into_iter().next().unwrap_or_default())
}

/// The share of the devices' busy time spent checking recomputations.
fn check_share(t: &candle_dp::pipeline::PipelineTimings) -> f64 {
    let total =
        |d: &[std::time::Duration]| d.iter().map(std::time::Duration::as_secs_f64).sum::<f64>();
    total(&t.checking) / total(&t.busy).max(f64::MIN_POSITIVE)
}

/// The schedule `spec` asks for.
fn schedule_of(spec: &PipeSpec) -> Schedule {
    match (spec.gpipe, spec.stages_per_device) {
        (true, _) => Schedule::GPipe,
        (false, 1) => Schedule::OneFOneB,
        (false, v) => Schedule::Interleaved1F1B {
            stages_per_device: v,
        },
    }
}

/// The activation checkpointing `spec` asks for.
fn checkpoint_of(spec: &PipeSpec) -> Checkpoint {
    match spec.checkpoint {
        0 => Checkpoint::Never,
        1 => Checkpoint::ExceptLast,
        _ => Checkpoint::Always,
    }
}

fn run_in_child(spec: &PipeSpec) -> Result<PipeMeasured> {
    let mut cmd = Command::new(std::env::current_exe()?);
    cmd.arg("--pipeline-child")
        .arg(serde_json::to_string(spec)?);
    if spec.stages.is_none() {
        // One device gets every core (see `run_in_child` in main.rs).
        cmd.env("RAYON_NUM_THREADS", cores().to_string());
        cmd.env("CANDLE_NUM_THREADS", cores().to_string());
    }
    crate::child_answer(cmd, &spec.label())
}

/// The parent side: every configuration over `rounds`, interleaved; returns
/// the markdown report.
pub fn run(quick: bool, steps: usize, rounds: usize) -> Result<String> {
    let (width, depth, rows, stages) = if quick {
        (256, 4, 256, 2)
    } else {
        // 12 blocks: 2, 4 and 6 stages (interleaved) of equal work.
        (768, 12, 1024, 2)
    };
    let chunk_counts: &[usize] = if quick { &[1, 4] } else { &[1, 2, 4, 8, 16] };
    let spec = |stages, chunks, gpipe, checkpoint| PipeSpec {
        stages,
        chunks,
        gpipe,
        width,
        depth,
        batch: rows,
        steps,
        checkpoint,
        stages_per_device: 1,
        on_ranks: false,
    };
    let mut specs = vec![spec(None, 1, false, 0)];
    for &chunks in chunk_counts {
        specs.push(spec(Some(stages), chunks, true, 0));
        if chunks > 1 {
            specs.push(spec(Some(stages), chunks, false, 0));
        }
    }
    // Interleaved 1F1B beside the 1F1B rows of the same micro-batches.
    let interleavings: &[(usize, usize)] = if quick {
        &[(2, 4)]
    } else {
        &[(2, 2), (2, 4), (2, 8), (3, 4), (3, 8)]
    };
    for &(per_device, chunks) in interleavings {
        specs.push(PipeSpec {
            stages_per_device: per_device,
            ..spec(Some(stages), chunks, false, 0)
        });
    }
    // The stages on thread ranks (messages between ranks instead of
    // channels), beside the in-process rows of the same schedules.
    for per_device in [1, 2] {
        specs.push(PipeSpec {
            stages_per_device: per_device,
            on_ranks: true,
            ..spec(Some(stages), 4, false, 0)
        });
    }
    // Activation checkpointing, every schedule, at 4 micro-batches.
    for (gpipe, per_device) in [(true, 1), (false, 1), (false, 2)] {
        for checkpoint in [1, 2] {
            specs.push(PipeSpec {
                stages_per_device: per_device,
                ..spec(Some(stages), 4, gpipe, checkpoint)
            });
        }
    }
    let mut measured = vec![PipeMeasured::default(); specs.len()];
    for round in 0..rounds {
        for (s, m) in specs.iter().zip(measured.iter_mut()) {
            eprintln!("pipeline round {}/{rounds}: {}", round + 1, s.label());
            let got = run_in_child(s)?;
            m.step_ms.extend(got.step_ms);
            m.bubble.extend(got.bubble);
            m.check_share.extend(got.check_share);
            m.peak_saved_bytes = got.peak_saved_bytes;
        }
    }
    let single_ms = median(&measured[0].step_ms);
    let mut md = format!(
        "## Pipeline: MLP {width}x{depth} layers + head, batch {rows}, {stages} CPU devices ({} cores), SGD\n\n\
         S devices, m micro-batches, v stages per device (1 unless interleaved).\n\n\
         The check column: the share of the devices' busy time spent \
         fingerprinting checkpointed forwards and their recomputations \
         (`PipelineTimings::checking`).\n\n\
         | configuration | ms/step | samples/s | vs one device | bubble measured | bubble (S-1)/(v·m+S-1) | check | peak activations held for the backward per device (KiB) |\n\
         |---|---:|---:|---:|---:|---:|---:|---|\n",
        cores()
    );
    for (s, m) in specs.iter().zip(&measured) {
        let ms = median(&m.step_ms);
        let rate = rows as f64 / (ms / 1e3);
        let (bubble, ideal, check, peaks) = match s.stages {
            None => ("-".into(), "-".into(), "-".into(), "-".into()),
            Some(k) => (
                format!("{:.2}", median(&m.bubble)),
                format!(
                    "{:.2}",
                    (k - 1) as f64 / (s.stages_per_device * s.chunks + k - 1) as f64
                ),
                format!("{:.1}%", 100.0 * median(&m.check_share)),
                m.peak_saved_bytes
                    .iter()
                    .map(|b| format!("{}", b / 1024))
                    .collect::<Vec<_>>()
                    .join(" / "),
            ),
        };
        let _ = writeln!(
            md,
            "| {} | {ms:.1} | {rate:.0} | {:.2}x | {bubble} | {ideal} | {check} | {peaks} |",
            s.label(),
            single_ms / ms
        );
    }
    md += &budget_run(quick)?;
    Ok(md)
}

/// Parameters, gradients and AdamW's two moments: four times the bytes of
/// the variables a device holds.
fn training_bytes(vars: &[candle_core::Var]) -> usize {
    4 * vars
        .iter()
        .map(|v| v.elem_count() * v.dtype().size_in_bytes())
        .sum::<usize>()
}

/// A model whose training state does not fit one device's budget, trained
/// by the pipeline anyway, against the unbounded one-device run. In f64:
/// AdamW's first updates are about `lr * sign(g)`, so in f32 the rounding
/// differences of near-zero gradients (a sum in another order) would show
/// as differences of up to `2 * lr` in the weights, which says nothing
/// about the pipeline.
fn budget_run(quick: bool) -> Result<String> {
    let dtype = DType::F64;
    let (width, depth, rows, steps) = if quick {
        (256, 4, 128, 3)
    } else {
        (768, 8, 256, 5)
    };
    let adamw = |vars| {
        AdamW::new(
            vars,
            ParamsAdamW {
                lr: 1e-3,
                ..Default::default()
            },
        )
    };
    let data: Vec<(Tensor, Tensor)> = (0..steps as u32)
        .map(|s| {
            let (x, y) = batch(rows, width, s)?;
            Ok((x.to_dtype(dtype)?, y))
        })
        .collect::<Result<_>>()?;
    // One device, no budget: the reference.
    let reference = init(width, depth, dtype)?;
    let model = one_device(&layers(width, depth), &reference, dtype)?;
    let mut opt = adamw(reference.all_vars())?;
    for (x, y) in &data {
        opt.backward_step(&loss::cross_entropy(&model(x)?, y)?)?;
    }
    let whole = training_bytes(&reference.all_vars());
    let budget = whole * 6 / 10;
    // The pipeline under the budget: stages balanced by parameter bytes.
    let varmap = init(width, depth, dtype)?;
    let pipe = Pipeline::builder(&varmap, dtype, &cpu_devices(2))
        .balance(Balance::ParameterBytes)
        .chunks(4)
        .build(layers(width, depth))?;
    let data_vars = varmap
        .data()
        .lock()
        .map_err(|_| anyhow::anyhow!("poisoned"))?
        .clone();
    let per_stage: Vec<usize> = pipe
        .stage_vars()
        .iter()
        .map(|names| {
            let vars: Vec<_> = names
                .iter()
                .filter_map(|n| data_vars.get(n).cloned())
                .collect();
            training_bytes(&vars)
        })
        .collect();
    if let Some(over) = per_stage.iter().position(|&b| b > budget) {
        bail!(
            "stage {over} needs {} bytes, over the budget of {budget}",
            per_stage[over]
        );
    }
    let mut opt = adamw(varmap.all_vars())?;
    for (x, y) in &data {
        let step = pipe.forward_backward(x, y, LossReduction::Mean, loss::cross_entropy)?;
        opt.step(&step.grads)?;
    }
    let mut diff = 0f64;
    for (name, var) in varmap
        .data()
        .lock()
        .map_err(|_| anyhow::anyhow!("poisoned"))?
        .iter()
    {
        let want = reference
            .data()
            .lock()
            .map_err(|_| anyhow::anyhow!("poisoned"))?[name]
            .as_tensor()
            .clone();
        let d = (var.as_tensor() - want)?
            .abs()?
            .max_all()?
            .to_scalar::<f64>()?;
        diff = diff.max(d);
    }
    let mib = |b: usize| b as f64 / (1 << 20) as f64;
    Ok(format!(
        "\n## Pipeline under a memory budget\n\n\
         MLP {width}x{depth} + head in f64, AdamW, {steps} steps of {rows} rows. Budget per device \
         (parameters + gradients + AdamW moments): {:.1} MiB. One device needs {:.1} MiB: it \
         does not fit. 2 stages balanced by parameter bytes need {} MiB: they fit. Largest \
         weight difference from the unbounded one-device run: {diff:.2e}.\n",
        mib(budget),
        mib(whole),
        per_stage
            .iter()
            .map(|&b| format!("{:.1}", mib(b)))
            .collect::<Vec<_>>()
            .join(" and "),
    ))
}
