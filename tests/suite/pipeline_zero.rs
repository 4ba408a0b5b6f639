//! ZeRO across the replicas of a pipeline on stage ranks (a dp x pp mesh,
//! `RankPipelineConfig::zero`): stage 1 trains to the replicated
//! pipelines' bytes, stage 2 to their weights within rounding, each rank
//! holding its pieces' optimizer state (and at stage 2 gradients), the
//! norm clipped over the whole model with a weight tied across stages
//! counted once. Bounded: every rank has a timeout, every test a deadline.

use crate::common::*;
use crate::overlap::{batches, bounded};
use crate::pipeline_ranks::{
    assert_close_to_one_device, checkpoint_dir, lm_through_the_fabric, on_two_by_two, tied_init,
    tied_layers, LmRun,
};

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor};
use candle_dp::launch::spawn_with;
use candle_dp::optim::{AdamW, AdamWConfig, StatefulOptimizer};
use candle_dp::pipeline::{Checkpoint, RankPipeline, RankPipelineConfig, Schedule};
use candle_dp::zero::ZeroStage;
use candle_dp::{Error, LossReduction};
use candle_nn::{loss, Optimizer};

/// What one rank of a run ends with: its stages' weights (whole), every
/// step's clipped total norm, its optimizer state's bytes, the shape of
/// each of its gradients in the last step, and of what its `VarMap`
/// holds of each variable between steps.
pub(crate) struct RankRun {
    pub(crate) weights: HashMap<String, Tensor>,
    pub(crate) norms: Vec<f64>,
    pub(crate) state_bytes: usize,
    pub(crate) grad_dims: HashMap<String, Vec<usize>>,
    pub(crate) held_dims: HashMap<String, Vec<usize>>,
    /// `RankPipeline::stage_bytes`: its stages' variables whole.
    pub(crate) stage_bytes: usize,
}

/// How a stage's replicas split it.
#[derive(Clone, Copy, PartialEq)]
pub(crate) enum Split {
    /// The replicas average whole gradients; a plain AdamW steps.
    Replicated,
    /// ZeRO at this stage, a `ZeroOptimizer` over the pieces.
    Zero(ZeroStage),
    /// FSDP: the variables held as pieces, a plain AdamW over them.
    Fsdp,
}

pub(crate) fn adamw() -> AdamWConfig {
    AdamWConfig {
        lr: 0.01,
        weight_decay: 0.1,
        ..Default::default()
    }
}

/// 1F1B, nothing recomputed.
pub(crate) const ONE_F_ONE_B: (Schedule, Checkpoint) = (Schedule::OneFOneB, Checkpoint::Never);

/// Each step's inputs and targets (random inputs: made once per test).
pub(crate) type Batches = Vec<(Tensor, Tensor)>;

/// 4 steps of the tied model on 2 pipelines of 2 stage ranks (a 2 x 2
/// mesh), each pipeline its half of 8 rows, AdamW, the gradients clipped
/// to a norm every step exceeds; the stages split as `split` says, run
/// by `schedule` (`checkpoint`: which micro-batches are recomputed).
pub(crate) fn run(
    init: &HashMap<String, Tensor>,
    data: &Batches,
    split: Split,
    (schedule, checkpoint): (Schedule, Checkpoint),
) -> Vec<RankRun> {
    let (init, data) = (init.clone(), data.clone());
    spawn_with(4, bounded(), move |ctx| {
        let varmap = varmap_from(&init);
        let config = RankPipelineConfig {
            chunks: Some(2),
            schedule,
            checkpoint,
            zero: match split {
                Split::Zero(stage) => Some(stage),
                _ => None,
            },
            fsdp: split == Split::Fsdp,
            ..Default::default()
        };
        let (mesh, pipe) = on_two_by_two(ctx.process_group(), &varmap, tied_layers(), config)?;
        enum Opt {
            Whole(AdamW),
            Zero(Box<candle_dp::zero::ZeroOptimizer<AdamW>>),
        }
        let mut opt = match split {
            Split::Replicated | Split::Fsdp => {
                Opt::Whole(AdamW::new_named(pipe.variables().to_vec(), adamw())?)
            }
            Split::Zero(_) => Opt::Zero(Box::new(
                pipe.zero_optimizer(|mine| AdamW::new_named(mine, adamw()))?,
            )),
        };
        let replica = mesh.local_rank("dp")?;
        let (mut norms, mut grad_dims) = (Vec::new(), HashMap::new());
        for (x, y) in &data {
            let x = x.narrow(0, replica * 4, 4)?;
            let y = y.narrow(0, replica * 4, 4)?;
            let mut step = pipe.forward_backward(
                Some(&x),
                Some(&y),
                LossReduction::Mean,
                loss::cross_entropy,
            )?;
            let clipped = match &opt {
                Opt::Whole(_) => pipe.clip_grad_norm(&mut step.grads, 0.05, 2.0, false)?,
                Opt::Zero(zero) => {
                    // The pipeline's own clip and the optimizer's agree.
                    let mut again = GradCopy::of(&pipe, &step.grads);
                    let by_pipe = pipe.clip_grad_norm(&mut again.0, 0.05, 2.0, false)?;
                    let by_zero = zero.clip_grad_norm(&mut step.grads, 0.05, 2.0, false)?;
                    assert_eq!(by_pipe.total_norm, by_zero.total_norm);
                    by_zero
                }
            };
            norms.push(clipped.total_norm);
            for (name, var) in pipe.variables() {
                if let Some(g) = step.grads.get(var.as_tensor()) {
                    grad_dims.insert(name.clone(), g.dims().to_vec());
                }
            }
            match &mut opt {
                Opt::Whole(adamw) => adamw.step(&step.grads)?,
                Opt::Zero(zero) => zero.step(&step.grads)?,
            }
        }
        let held = snapshot(&varmap);
        let held_dims = pipe
            .variable_names()
            .into_iter()
            .map(|n| (n.clone(), held[&n].dims().to_vec()))
            .collect();
        let all = pipe.full_state()?;
        let weights = pipe
            .variable_names()
            .into_iter()
            .map(|n| (n.clone(), all[&n].clone()))
            .collect();
        let state_bytes = match &opt {
            Opt::Whole(adamw) => bytes_of(&adamw.state()?),
            Opt::Zero(zero) => zero.state_bytes()?,
        };
        Ok(RankRun {
            weights,
            norms,
            state_bytes,
            grad_dims,
            held_dims,
            stage_bytes: pipe.stage_bytes(),
        })
    })
    .unwrap()
}

/// A copy of a step's gradients, for a second clip.
struct GradCopy(candle_core::backprop::GradStore);

impl GradCopy {
    fn of(pipe: &RankPipeline, grads: &candle_core::backprop::GradStore) -> Self {
        let mut copy = candle_core::backprop::GradStore::default();
        for (_, var) in pipe.variables() {
            if let Some(g) = grads.get(var.as_tensor()) {
                copy.insert(var.as_tensor(), g.copy().unwrap());
            }
        }
        GradCopy(copy)
    }
}

fn bytes_of(state: &candle_dp::optim::OptimizerState) -> usize {
    state
        .tensors
        .values()
        .map(|t| t.elem_count() * t.dtype().size_in_bytes())
        .sum()
}

#[test]
fn zero_across_a_pipelines_replicas_trains_to_the_replicated_pipelines_weights() {
    within(240, || {
        let (init, data) = (tied_init(), batches(4, 8, 3));
        let replicated = run(&init, &data, Split::Replicated, ONE_F_ONE_B);
        let one = run(&init, &data, Split::Zero(ZeroStage::One), ONE_F_ONE_B);
        let two = run(&init, &data, Split::Zero(ZeroStage::Two), ONE_F_ONE_B);
        for rank in 0..4 {
            let (want, one, two) = (&replicated[rank], &one[rank], &two[rank]);
            // Stage 1: the same whole gradients, the same norm, each
            // element's update the same: the same bytes.
            assert!(
                identical(&one.weights, &want.weights),
                "rank {rank}: stage 1 is not the replicated pipelines' bytes\n{}",
                diff_report(&one.weights, &want.weights)
            );
            assert_eq!(one.norms, want.norms, "rank {rank}: stage 1's norms");
            // Stage 2: the pieces summed in another order.
            let d = max_rel_diff(&two.weights, &want.weights);
            assert!(d < 1e-5, "rank {rank}: stage 2 is {d:e} from the replicas'");
            for (a, b) in two.norms.iter().zip(&want.norms) {
                assert!(
                    (a - b).abs() <= 1e-6 * b,
                    "rank {rank}: norm {a} against {b}"
                );
            }
            // Every step clipped (a tied weight counted twice would clip
            // by another factor and miss the bytes above).
            assert!(want.norms.iter().all(|&n| n > 0.05), "{:?}", want.norms);
            // Each replica holds half the rows' moments (8 rows in 2 pieces
            // of 4, the stages' vectors alike; each parameter's step count,
            // 8 bytes, whole), and at stage 2 half the rows' gradients.
            let counts = 8 * want.grad_dims.len();
            for zero in [one, two] {
                assert_eq!(
                    (zero.state_bytes - counts) * 2,
                    want.state_bytes - counts,
                    "rank {rank}"
                );
            }
            for (name, dims) in &want.grad_dims {
                assert_eq!(&one.grad_dims[name], dims, "rank {rank}: {name} at stage 1");
                let mut half = dims.clone();
                half[0] /= 2;
                assert_eq!(two.grad_dims[name], half, "rank {rank}: {name} at stage 2");
            }
        }
        // The two replicas of a stage end alike, and the run moved the
        // weights (the comparison is not of the start).
        assert!(identical(&two[0].weights, &two[2].weights));
        let start: HashMap<String, Tensor> = replicated[0]
            .weights
            .keys()
            .map(|n| (n.clone(), init[n].clone()))
            .collect();
        assert!(max_rel_diff(&replicated[0].weights, &start) > 1e-3);
    });
}

#[test]
fn zero_on_a_pipeline_without_replicas_or_without_zero_is_refused_naming_why() {
    within(60, || {
        let init = tied_init();
        let refusals = spawn_with(2, bounded(), move |ctx| {
            let varmap = varmap_from(&init);
            let config = RankPipelineConfig {
                zero: Some(ZeroStage::Two),
                ..Default::default()
            };
            let flat = RankPipeline::new(
                ctx.process_group(),
                &varmap,
                DType::F32,
                &Device::Cpu,
                tied_layers(),
                config,
            );
            let plain = RankPipeline::new(
                ctx.process_group(),
                &varmap,
                DType::F32,
                &Device::Cpu,
                tied_layers(),
                RankPipelineConfig::default(),
            )?;
            let no_zero = plain.zero_optimizer(|mine| AdamW::new_named(mine, adamw()));
            Ok((flat.err(), no_zero.err()))
        })
        .unwrap();
        for (flat, no_zero) in refusals {
            assert!(
                matches!(&flat, Some(Error::Zero(why)) if why.contains("on a mesh")),
                "{flat:?}"
            );
            assert!(
                matches!(&no_zero, Some(Error::Zero(why)) if why.contains("shards nothing")),
                "{no_zero:?}"
            );
        }
    });
}

/// Through the Fabric (`pipeline-ranks` with `zero`): the language model
/// on 2 pipelines of 2 stage ranks trains to one device's weights, stage
/// 1 to the replicated pipelines' bytes; a state saved with ZeRO-2 resumes
/// to the bytes of the run without a stop, and on 4 stages without ZeRO
/// (the checkpoint is a plain pipeline's) to one device's weights.
#[test]
fn the_language_model_with_zero_across_pipelines_trains_to_one_devices_weights_and_resumes_without_it(
) {
    use candle_dp::fabric::{FabricConfig, Strategy};
    within(600, || {
        let steps = 4;
        let single = lm_through_the_fabric(FabricConfig::new(Strategy::Single, 1), steps, None);
        let ranks = |replicas: usize, stages: usize, zero: Option<u8>| FabricConfig {
            stages,
            zero,
            ..FabricConfig::new(Strategy::PipelineRanks, replicas * stages)
        };
        let close = |label: &str, run: &LmRun| assert_close_to_one_device(label, run, &single);
        let replicated = lm_through_the_fabric(ranks(2, 2, None), steps, None);
        let one = lm_through_the_fabric(ranks(2, 2, Some(1)), steps, None);
        assert!(
            identical(&one.0, &replicated.0),
            "ZeRO-1 across the pipelines is not the replicated pipelines' bytes\n{}",
            diff_report(&one.0, &replicated.0)
        );
        let two = lm_through_the_fabric(ranks(2, 2, Some(2)), steps, None);
        close("ZeRO-2 on 2 x 2", &two);
        let dir = checkpoint_dir("zero-lm");
        let saving = |config: FabricConfig| FabricConfig {
            checkpoint_dir: Some(dir.path()),
            ..config
        };
        lm_through_the_fabric(saving(ranks(2, 2, Some(2))), steps, Some(2));
        let stages = std::fs::read_dir(dir.join("zero-shards")).unwrap().count();
        assert_eq!(stages, 2, "the first pipeline's two ranks write its stages");
        let resumed = lm_through_the_fabric(saving(ranks(2, 2, Some(2))), steps, None);
        assert!(
            identical(&resumed.0, &two.0),
            "resumed on 2 x 2 with ZeRO-2\n{}",
            diff_report(&resumed.0, &two.0)
        );
        let dir2 = checkpoint_dir("zero-lm-split");
        let saving2 = |config: FabricConfig| FabricConfig {
            checkpoint_dir: Some(dir2.path()),
            ..config
        };
        lm_through_the_fabric(saving2(ranks(2, 2, Some(2))), steps, Some(2));
        let mut other = lm_through_the_fabric(saving2(ranks(1, 4, None)), steps, None);
        // The resumed run records only its own steps' losses.
        other.1 = single.1[..2].iter().copied().chain(other.1).collect();
        close("ZeRO-2 on 2 x 2 resumed on 4 stages without ZeRO", &other);
        // And a plain pipeline's state resumes under ZeRO-1.
        let dir3 = checkpoint_dir("zero-lm-plain");
        let saving3 = |config: FabricConfig| FabricConfig {
            checkpoint_dir: Some(dir3.path()),
            ..config
        };
        lm_through_the_fabric(saving3(ranks(1, 4, None)), steps, Some(2));
        let mut back = lm_through_the_fabric(saving3(ranks(2, 2, Some(1))), steps, None);
        back.1 = single.1[..2].iter().copied().chain(back.1).collect();
        close("4 stages resumed on 2 x 2 with ZeRO-1", &back);
        // zero is refused where it means nothing.
        let refused = FabricConfig {
            zero: Some(2),
            ..FabricConfig::new(Strategy::Fsdp, 2)
        }
        .check();
        assert!(
            matches!(&refused, Err(candle_dp::Error::Strategy { reason, .. }) if reason.contains("pipeline-ranks")),
            "{refused:?}"
        );
    });
}
