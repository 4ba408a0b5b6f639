//! The language model of `examples/train_lm.rs` through the Fabric's one
//! loop on any mesh (tensor parallelism among them), shared by the
//! thread-rank tests (`tests/suite/tensor_parallel.rs`) and the MPI ones
//! (`tests/mpi.rs`).

use std::collections::HashMap;

use candle_core::Tensor;
use candle_dp::fabric::{Fabric, FabricModel, Memory, ModelRecipe};
use candle_dp::optim::{AdamWConfig, StatefulOptimizer};
use candle_dp_examples::gpt::{adamw_groups, lm_loss, loss_on, model_recipe, GptConfig};
use candle_dp_examples::text::{load_text, share_at, split, Windows};

/// A small GPT: 256 bytes, 2 blocks of width 32 with 4 heads.
pub const GPT: GptConfig = GptConfig {
    vocab: 256,
    context: 16,
    width: 32,
    layers: 2,
    heads: 4,
    fused_ops: true,
    dropout: 0.0,
};

/// The global batch, in windows.
pub const BATCH: usize = 8;

/// What a rank saw: every step's loss, the whole model at the end, its
/// memory.
pub struct Run {
    pub losses: Vec<f32>,
    pub weights: HashMap<String, Tensor>,
    pub memory: Memory,
}

/// The model on `fabric`'s ranks: each rank's pieces with its tensor
/// parallelism, with the plan that places them; whole without.
pub fn module(fabric: &Fabric, gpt: GptConfig) -> ModelRecipe {
    model_recipe(gpt, fabric.tensor_parallel())
}

/// The book's training windows of `gpt`'s context.
pub fn windows(gpt: GptConfig) -> anyhow::Result<Windows> {
    let text = load_text()?;
    Ok(split(&text, gpt.context).0)
}

/// `steps` steps of one rank's loop from `from`: its share of each
/// step's global batch, the vocabulary-parallel loss under tensor
/// parallelism.
pub fn rank_loop<O: StatefulOptimizer>(
    fabric: &Fabric,
    model: &mut FabricModel<O>,
    train: &Windows,
    (from, steps): (u64, u64),
) -> anyhow::Result<Vec<f32>> {
    let shared = (fabric.data_parallel_size(), fabric.data_parallel_rank());
    // Deterministic training takes consecutive shares, and its loss is
    // already the global batch's.
    let deterministic = fabric.config().deterministic.is_some();
    let mut losses = Vec::new();
    for step in from..steps {
        let rows = share_at(train, shared, 7, BATCH, step, deterministic)?;
        let (x, y) = train.batch(&rows)?;
        let loss = model.backward(&x, &y, loss_on(fabric.tensor_parallel(), lm_loss))?;
        model.step()?;
        losses.push(match deterministic {
            true => loss.to_scalar::<f32>()?,
            false => fabric.global_mean(&loss, x.dim(0)?)?,
        });
    }
    Ok(losses)
}

/// AdamW over GPT-2's groups.
pub fn adamw() -> AdamWConfig {
    AdamWConfig {
        lr: 3e-3,
        weight_decay: 0.1,
        ..Default::default()
    }
}

/// `steps` AdamW steps of [`GPT`] on this rank: its losses, the whole
/// model, its memory.
pub fn adamw_run(fabric: &Fabric, steps: u64) -> anyhow::Result<Run> {
    adamw_run_of(fabric, GPT, steps)
}

/// [`adamw_run`] of `gpt`.
pub fn adamw_run_of(fabric: &Fabric, gpt: GptConfig, steps: u64) -> anyhow::Result<Run> {
    let train = windows(gpt)?;
    let mut model = fabric.setup(module(fabric, gpt), |p| adamw_groups(p, adamw(), false))?;
    let losses = rank_loop(fabric, &mut model, &train, (0, steps))?;
    Ok(Run {
        losses,
        weights: model.full_state()?,
        memory: model.memory()?,
    })
}
