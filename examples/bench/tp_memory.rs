//! The tensor-parallel part of the benchmark (`--tp-memory`): what one
//! rank holds at the peak of a training step of the language model at
//! `tp` = 1, 2 and 4, with and without sequence parallelism, on thread
//! ranks: its parameters, gradients and AdamW state (the Fabric's
//! `memory`), and the bytes its forward and backward allocate above the
//! resting state (the activations, the gradients and the temporaries),
//! counted by the benchmark's allocator. The allocator counts the whole
//! process: the ranks run the same step at once, so a rank's share is the
//! process's peak over the ranks.

use anyhow::{bail, Result};
use candle_dp::fabric::{Degrees, Fabric, FabricConfig};
use candle_dp::optim::AdamWConfig;
use candle_dp_examples::gpt::{adamw_groups, lm_loss, loss_on, model_recipe};
use candle_dp_examples::text::{load_text, split, windows_at};

use crate::alloc_count;

/// One row: `tp` and sequence parallelism.
const ROWS: [(usize, bool); 5] = [(1, false), (2, false), (2, true), (4, false), (4, true)];

/// What one rank held.
#[derive(Debug, Clone, Copy, Default)]
struct Held {
    parameters: usize,
    optimizer_state: usize,
    step_peak: usize,
}

/// Every row; the report.
pub fn run() -> Result<String> {
    if cfg!(feature = "mimalloc") {
        bail!("--tp-memory counts with the benchmark's own allocator: build without mimalloc");
    }
    let gpt = crate::lm::config(true);
    let (train, _) = split(&load_text()?, gpt.context);
    let mut rows = Vec::new();
    for (tp, sequence_parallel) in ROWS {
        let config = FabricConfig {
            sequence_parallel,
            gradient_clip: Some(1.0),
            ..FabricConfig::default()
        }
        .with_mesh(Degrees {
            tp,
            ..Degrees::one()
        })?;
        let held = Fabric::spawn(config, |fabric| {
            let module = model_recipe(gpt, fabric.tensor_parallel());
            let adamw = AdamWConfig {
                lr: 1e-3,
                weight_decay: 0.1,
                ..Default::default()
            };
            let mut model = fabric.setup(module, |p| adamw_groups(p, adamw, false))?;
            let mut step_peak = 0;
            for step in 0..3u64 {
                let rows = windows_at(&train, 1, 0, 0, crate::lm::BATCH, step)?;
                let (x, y) = train.batch(&rows)?;
                // The last step's forward and backward, every rank at once.
                let counting = step == 2;
                if counting {
                    fabric.barrier()?;
                    if fabric.rank() == 0 {
                        alloc_count::start();
                    }
                    fabric.barrier()?;
                }
                model.backward(&x, &y, loss_on(fabric.tensor_parallel(), lm_loss))?;
                if counting {
                    fabric.barrier()?;
                    if fabric.rank() == 0 {
                        step_peak = alloc_count::stop_peak();
                    }
                }
                model.step()?;
            }
            let memory = model.memory()?;
            Ok(Held {
                parameters: memory.parameters,
                optimizer_state: memory.optimizer_state,
                step_peak,
            })
        })?;
        rows.push((tp, sequence_parallel, held[0]));
    }
    Ok(report(&rows))
}

fn report(rows: &[(usize, bool, Held)]) -> String {
    let gpt = crate::lm::config(true);
    let mb = |b: usize| b as f64 / 1e6;
    let mut s = format!(
        "## The language model's memory per rank with tensor parallelism\n\n\
         `train_lm`'s model ({} blocks of width {}, {} heads, context {}), a global batch of \
         {} windows, AdamW, on thread ranks; the forward and backward of the third step. \
         Parameters and AdamW's state: what a rank holds (the Fabric's `memory`). Step peak: the \
         most bytes the process's ranks allocated above the resting state during the forward \
         and backward (activations, gradients, temporaries), divided by the ranks (they run \
         the same step at once). {}.\n\n\
         | tp | sequence parallel | parameters, MB | AdamW state, MB | step peak per rank, MB | vs tp = 1 |\n\
         |---:|---|---:|---:|---:|---:|\n",
        gpt.layers,
        gpt.width,
        gpt.heads,
        gpt.context,
        crate::lm::BATCH,
        crate::machine(crate::plan::DeviceKind::Cpu),
    );
    let one = rows.first().map_or(0, |r| r.2.step_peak);
    for &(tp, sp, held) in rows {
        let peak = held.step_peak / tp;
        s += &format!(
            "| {tp} | {} | {:.2} | {:.2} | {:.2} | {:.2}x |\n",
            if sp { "yes" } else { "no" },
            mb(held.parameters),
            mb(held.optimizer_state),
            mb(peak),
            peak as f64 / one.max(1) as f64,
        );
    }
    s
}
