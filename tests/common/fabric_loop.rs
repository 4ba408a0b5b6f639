//! The one training loop of the Fabric tests, shared by the thread-rank
//! tests (`tests/suite/fabric.rs`) and the MPI ones (`tests/mpi.rs`): the
//! same function whatever the strategy, the ranks or the processes.

use std::collections::HashMap;
use std::sync::Arc;

use candle_core::{Device, Tensor};
use candle_dp::fabric::{DataOptions, Fabric, FabricModel, ModelRecipe, StepOutcome, Strategy};
use candle_dp::loader::TensorDataset;
use candle_dp::optim::{Sgd, SgdConfig};
use candle_dp::pipeline::unit;
use candle_nn::{linear, loss, Activation};

pub const SAMPLES: usize = 48;
pub const GLOBAL_BATCH: usize = 12;
pub const EPOCHS: u64 = 2;

/// How many devices `strategy` takes for two ranks, replicas or stages
/// (`single`: one; `pipeline-ddp`: two ranks of two stages).
pub fn devices_for_two(strategy: Strategy) -> usize {
    match strategy {
        Strategy::Single => 1,
        Strategy::PipelineDdp => 4,
        _ => 2,
    }
}

/// A small classifier as units (every strategy can build it).
pub fn classifier() -> ModelRecipe {
    ModelRecipe::units(vec![
        unit(|vb| linear(6, 16, vb.pp("l1"))),
        unit(|_| Ok(Activation::Relu)),
        unit(|vb| linear(16, 16, vb.pp("l2"))),
        unit(|_| Ok(Activation::Relu)),
        unit(|vb| linear(16, 3, vb.pp("l3"))),
    ])
}

/// 48 samples of 6 features and 3 classes, the same in every run.
pub fn dataset() -> Arc<TensorDataset> {
    let xs: Vec<f32> = (0..SAMPLES * 6)
        .map(|i| ((i * 37 % 101) as f32 / 50.0 - 1.0) * 1.5)
        .collect();
    let ys: Vec<u32> = (0..SAMPLES as u32).map(|i| (i * 7 + i / 5) % 3).collect();
    let x = Tensor::from_vec(xs, (SAMPLES, 6), &Device::Cpu).unwrap();
    let y = Tensor::from_vec(ys, SAMPLES, &Device::Cpu).unwrap();
    Arc::new(TensorDataset::new(vec![x, y]).unwrap())
}

/// What one run gives back: the whole model's final weights and the
/// global loss of every step.
pub type Trained = (HashMap<String, Tensor>, Vec<f32>);

/// The classifier and its optimizer set up for `fabric`'s strategy: SGD
/// with momentum, whose update (unlike Adam's) scales with the gradient,
/// so that a gradient averaged wrong cannot go unseen.
pub fn setup(fabric: &Fabric) -> anyhow::Result<FabricModel<Sgd>> {
    Ok(fabric.setup(classifier(), |params| {
        Sgd::new_named(
            params,
            SgdConfig {
                lr: 0.05,
                momentum: 0.9,
                ..Default::default()
            },
        )
    })?)
}

/// THE loop: the same code whatever the strategy.
pub fn train(fabric: Fabric, data: Arc<TensorDataset>) -> anyhow::Result<Trained> {
    let model = setup(&fabric)?;
    train_model(fabric, data, model)
}

/// [`train`]'s loop over a model set up by the caller.
pub fn train_model(
    fabric: Fabric,
    data: Arc<TensorDataset>,
    mut model: FabricModel<Sgd>,
) -> anyhow::Result<Trained> {
    let options = DataOptions {
        shuffle: true,
        ..DataOptions::default()
    };
    // The global batch of a step is GLOBAL_BATCH samples, whatever the
    // ranks and the accumulation.
    let per_batch =
        GLOBAL_BATCH / fabric.data_parallel_size() / fabric.config().accumulation_steps as usize;
    let mut loader = fabric.setup_dataloader(data, per_batch, options)?;
    let (mut losses, mut steps) = (Vec::new(), 0);
    for epoch in 0..EPOCHS {
        loader.set_epoch(epoch);
        for batch in loader.iter()? {
            let batch = batch?;
            let loss = model.backward(&batch[0], &batch[1], loss::cross_entropy)?;
            if model.step()? != StepOutcome::Accumulating {
                steps += 1;
            }
            losses.push(fabric.all_reduce_mean(&loss)?);
        }
    }
    anyhow::ensure!(model.skipped_steps() == 0, "the loss scaler skipped a step");
    anyhow::ensure!(
        steps == model.steps(),
        "{steps} steps counted, {} taken",
        model.steps()
    );
    Ok((model.full_state()?, losses))
}

/// What [`train_resumable`] does after a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AfterStep {
    /// Goes on.
    Go,
    /// Saves the state, then goes on.
    Save,
    /// Saves the state and stops (a run killed right after its save).
    SaveAndStop,
}

/// The loop of [`train`] with resuming and saving: it continues from the
/// newest state in the checkpoint folder, if there is one, and after each
/// step (counted from 1) does what `after_step` says, or fails with its
/// error.
pub fn train_resumable(
    fabric: Fabric,
    data: Arc<TensorDataset>,
    after_step: impl Fn(&Fabric, u64) -> anyhow::Result<AfterStep>,
) -> anyhow::Result<Trained> {
    use candle_dp::training_state::Progress;
    let mut model = setup(&fabric)?;
    let from = model.load()?.map(|r| r.progress).unwrap_or_default();
    let options = DataOptions {
        shuffle: true,
        ..DataOptions::default()
    };
    let per_batch = GLOBAL_BATCH / fabric.data_parallel_size();
    let mut loader = fabric.setup_dataloader(data, per_batch, options)?;
    let (mut losses, mut step) = (Vec::new(), from.step);
    for epoch in from.epoch..EPOCHS {
        loader.set_epoch(epoch);
        let skip = if epoch == from.epoch { from.batch } else { 0 };
        loader.skip_batches(skip as usize);
        for (batch_index, batch) in (skip..).zip(loader.iter()?) {
            let batch = batch?;
            let loss = model.backward(&batch[0], &batch[1], loss::cross_entropy)?;
            model.step()?;
            losses.push(fabric.all_reduce_mean(&loss)?);
            step += 1;
            let progress = Progress {
                epoch,
                batch: batch_index + 1,
                step,
            };
            match after_step(&fabric, step)? {
                AfterStep::Go => {}
                AfterStep::Save => model.save(progress)?,
                AfterStep::SaveAndStop => {
                    model.save(progress)?;
                    return Ok((model.full_state()?, losses));
                }
            }
        }
    }
    Ok((model.full_state()?, losses))
}

/// Deterministic training's chunks (1, 2, 3, 4, 6 and 8 ranks divide
/// them), global batch (two rows a chunk) and passes (one step each).
pub const CHUNKS: usize = 24;
pub const CHUNKED_BATCH: usize = 48;
pub const CHUNKED_EPOCHS: u64 = 30;

/// Each rank's consecutive share of every global batch, shuffled.
pub fn split_batches() -> DataOptions {
    DataOptions {
        shuffle: true,
        sharding: candle_dp::fabric::Sharding::BatchWise {
            split_batches: true,
            even_batches: true,
        },
        ..DataOptions::default()
    }
}

/// `strategy` on `ranks`, clipped to 0.5, deterministic with `chunks`.
pub fn deterministic_config(
    strategy: Strategy,
    ranks: usize,
    chunks: Option<usize>,
) -> candle_dp::fabric::FabricConfig {
    candle_dp::fabric::FabricConfig {
        deterministic: chunks,
        gradient_clip: Some(0.5),
        timeout_secs: Some(120.0),
        ..candle_dp::fabric::FabricConfig::new(strategy, ranks)
    }
}

/// The classifier trained for [`CHUNKED_EPOCHS`] steps of
/// [`CHUNKED_BATCH`] samples, each rank on its consecutive share, with
/// the setting or without: the whole model and the global losses (the
/// deterministic backward's own; without, the ranks' mean).
pub fn train_chunked(
    fabric: Fabric,
    data: Arc<TensorDataset>,
    deterministic: bool,
) -> anyhow::Result<Trained> {
    let mut model = setup(&fabric)?;
    let mut loader = fabric.setup_dataloader(data, CHUNKED_BATCH, split_batches())?;
    let mut losses = Vec::new();
    for epoch in 0..CHUNKED_EPOCHS {
        loader.set_epoch(epoch);
        for rows in loader.iter()? {
            let rows = rows?;
            let loss = model.backward(&rows[0], &rows[1], loss::cross_entropy)?;
            model.step()?;
            losses.push(match deterministic {
                true => loss.to_scalar::<f32>()?,
                false => fabric.all_reduce_mean(&loss)?,
            });
        }
    }
    Ok((model.full_state()?, losses))
}

/// [`train_chunked`] deterministic, resuming from the newest state in the
/// configuration's checkpoint folder if there is one, and at step
/// `stop_at` (counted from 1) saving its state and stopping: the losses
/// of the steps it ran, and the whole model.
pub fn train_chunked_resumable(
    fabric: Fabric,
    data: Arc<TensorDataset>,
    stop_at: Option<u64>,
) -> anyhow::Result<Trained> {
    use candle_dp::training_state::Progress;
    let mut model = setup(&fabric)?;
    let from = model.load()?.map(|r| r.progress).unwrap_or_default();
    let mut loader = fabric.setup_dataloader(data, CHUNKED_BATCH, split_batches())?;
    let (mut losses, mut step) = (Vec::new(), from.step);
    for epoch in from.epoch..CHUNKED_EPOCHS {
        loader.set_epoch(epoch);
        let skip = if epoch == from.epoch { from.batch } else { 0 };
        loader.skip_batches(skip as usize);
        for (batch_index, rows) in (skip..).zip(loader.iter()?) {
            let rows = rows?;
            let loss = model.backward(&rows[0], &rows[1], loss::cross_entropy)?;
            model.step()?;
            losses.push(loss.to_scalar::<f32>()?);
            step += 1;
            if stop_at == Some(step) {
                let batch = batch_index + 1;
                model.save(Progress { epoch, batch, step })?;
                return Ok((model.full_state()?, losses));
            }
        }
    }
    Ok((model.full_state()?, losses))
}
