//! FSDP across the replicas of a pipeline on stage ranks (a dp x pp mesh,
//! `RankPipelineConfig::fsdp`): ZeRO-2's bytes with the variables held as
//! pieces between steps, padded pieces, BatchNorm statistics and mixed
//! precision included; checkpoints that resume with or without it; and
//! the refusals and failures, named, on every rank. Bounded: every rank
//! has a timeout, every test a deadline.

use crate::common::*;
use crate::overlap::{batches, bounded};
use crate::pipeline_ranks::{
    assert_close_to_one_device, checkpoint_dir, lm_through_the_fabric, on_two_by_two, tied_init,
    tied_layers, LmRun,
};
use crate::pipeline_zero::{adamw, run, Split, ONE_F_ONE_B};

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor};
use candle_dp::launch::spawn_with;
use candle_dp::optim::{AdamW, StatefulOptimizer};
use candle_dp::pipeline::{Checkpoint, RankPipeline, RankPipelineConfig, Schedule};
use candle_dp::zero::ZeroStage;
use candle_dp::Error;

#[test]
fn fsdp_across_a_pipelines_replicas_trains_to_zero_twos_bytes_holding_only_pieces_between_steps() {
    within(240, || {
        let (init, data) = (tied_init(), batches(4, 8, 3));
        let replicated = run(&init, &data, Split::Replicated, ONE_F_ONE_B);
        let two = run(&init, &data, Split::Zero(ZeroStage::Two), ONE_F_ONE_B);
        let fsdp = run(&init, &data, Split::Fsdp, ONE_F_ONE_B);
        for rank in 0..4 {
            let (want, two, fsdp) = (&replicated[rank], &two[rank], &fsdp[rank]);
            // The same pieces' gradients, norm and updates as ZeRO-2: only
            // where the whole values live between steps differs.
            assert!(
                identical(&fsdp.weights, &two.weights),
                "rank {rank}: FSDP is not ZeRO-2's bytes\n{}",
                diff_report(&fsdp.weights, &two.weights)
            );
            assert_eq!(fsdp.norms, two.norms, "rank {rank}: the norms");
            let d = max_rel_diff(&fsdp.weights, &want.weights);
            assert!(d < 1e-5, "rank {rank}: FSDP is {d:e} from the replicas'");
            assert_eq!(fsdp.state_bytes, two.state_bytes, "rank {rank}");
            assert_eq!(fsdp.grad_dims, two.grad_dims, "rank {rank}");
            // What a step gathers: the stages whole, 4 bytes an element.
            let whole: usize = want
                .grad_dims
                .values()
                .map(|d| 4 * d.iter().product::<usize>())
                .sum();
            assert_eq!(
                (fsdp.stage_bytes, two.stage_bytes),
                (whole, whole),
                "rank {rank}"
            );
            // Between steps: ZeRO-2 holds each variable whole, FSDP half
            // of its 8 rows.
            assert!(!fsdp.held_dims.is_empty());
            for (name, dims) in &want.grad_dims {
                assert_eq!(&two.held_dims[name], dims, "rank {rank}: {name}");
                let mut half = dims.clone();
                half[0] /= 2;
                assert_eq!(fsdp.held_dims[name], half, "rank {rank}: {name} at rest");
            }
        }
        assert!(identical(&fsdp[0].weights, &fsdp[2].weights));
    });
}

/// Two stages per rank (interleaved 1F1B: the tied weight's two users,
/// stages 0 and 3, on ranks 0 and 1), every micro-batch recomputed.
#[test]
fn fsdp_across_replicas_of_interleaved_recomputed_stages_trains_to_zero_twos_bytes() {
    within(240, || {
        let (init, data) = (tied_init(), batches(3, 8, 3));
        let interleaved = (
            Schedule::Interleaved1F1B {
                stages_per_device: 2,
            },
            Checkpoint::Always,
        );
        let two = run(&init, &data, Split::Zero(ZeroStage::Two), interleaved);
        let fsdp = run(&init, &data, Split::Fsdp, interleaved);
        for rank in 0..4 {
            assert!(
                identical(&fsdp[rank].weights, &two[rank].weights),
                "rank {rank}\n{}",
                diff_report(&fsdp[rank].weights, &two[rank].weights)
            );
            assert_eq!(fsdp[rank].norms, two[rank].norms, "rank {rank}");
        }
    });
}

/// The variables a pipeline's rank holds, as a `VarMap`.
fn pipe_varmap(pipe: &RankPipeline) -> candle_nn::VarMap {
    let varmap = candle_nn::VarMap::new();
    for (name, var) in pipe.variables() {
        varmap
            .data()
            .lock()
            .unwrap()
            .insert(name.clone(), var.clone());
    }
    varmap
}

#[test]
fn fsdp_on_a_pipeline_refuses_zero_one_whole_state_calls_a_zero_optimizer_and_a_misfit_save_naming_why(
) {
    within(60, || {
        let init = tied_init();
        let refusals = spawn_with(4, bounded(), move |ctx| {
            // The error is the crate's, matched below.
            #[allow(clippy::result_large_err)]
            let build = |config: RankPipelineConfig| {
                let varmap = varmap_from(&init);
                on_two_by_two(ctx.process_group(), &varmap, tied_layers(), config).map(|(_, p)| p)
            };
            let fsdp = RankPipelineConfig {
                fsdp: true,
                ..Default::default()
            };
            let with_one = build(RankPipelineConfig {
                zero: Some(ZeroStage::One),
                ..fsdp.clone()
            })
            .err();
            let flat = RankPipeline::new(
                ctx.process_group(),
                &varmap_from(&init),
                DType::F32,
                &Device::Cpu,
                tied_layers(),
                fsdp.clone(),
            )
            .err();
            let pipe = build(fsdp)?;
            let mut opt = AdamW::new_named(pipe.variables().to_vec(), adamw())?;
            let zero = pipe
                .zero_optimizer(|mine| AdamW::new_named(mine, adamw()))
                .err();
            let save = pipe.stage_state(&opt).err();
            let load = pipe.load_stages(&[], &[], &mut opt).err();
            let whole = build(RankPipelineConfig::default())?;
            let fsdp_save = whole.fsdp_stage_state(&opt).err();
            // A save whose variable has another shape changes no piece.
            let before = snapshot(&pipe_varmap(&pipe));
            let mut values: HashMap<String, Tensor> = pipe
                .variable_names()
                .into_iter()
                .map(|n| (n, Tensor::zeros((3, 3), DType::F32, &Device::Cpu).unwrap()))
                .collect();
            values.extend(pipe.buffers().iter().map(|(n, v)| (n.clone(), v.as_tensor().clone())));
            let misfit = pipe.load_fsdp_stages(&[values], &[opt.state()?], &mut opt);
            assert!(
                matches!(&misfit, Err(Error::Checkpoint(m)) if m.contains("saved with shape [3, 3]")),
                "{misfit:?}"
            );
            assert!(identical(&snapshot(&pipe_varmap(&pipe)), &before));
            Ok([with_one, flat, zero, save, load, fsdp_save])
        })
        .unwrap();
        let why = [
            "ZeroStage::One",
            "on a mesh",
            "variables are its pieces",
            "fsdp_stage_state",
            "load_fsdp_stages",
            "keeps its variables whole",
        ];
        for errors in refusals {
            for (error, why) in errors.iter().zip(why) {
                assert!(
                    matches!(error, Some(Error::Zero(m)) if m.contains(why)),
                    "{error:?}: wanted {why}"
                );
            }
        }
    });
}

/// Shard groups of a pipeline's replicas (`RankPipelineConfig::shard_size`,
/// hybrid sharding) that the replicas cannot form, or without FSDP, are
/// refused on every rank before any step, naming why.
#[test]
fn shard_groups_that_a_pipelines_replicas_cannot_form_are_refused_naming_why() {
    within(60, || {
        let init = tied_init();
        let refusals = spawn_with(4, bounded(), move |ctx| {
            let build = |shard_size, fsdp| {
                let config = RankPipelineConfig {
                    shard_size: Some(shard_size),
                    fsdp,
                    ..Default::default()
                };
                let varmap = varmap_from(&init);
                on_two_by_two(ctx.process_group(), &varmap, tied_layers(), config).err()
            };
            Ok([build(2, false), build(3, true), build(0, true)])
        })
        .unwrap();
        let why = [
            "set RankPipelineConfig::fsdp too",
            "2 replicas of each stage do not split into shard groups of 3",
            "do not split into shard groups of 0",
        ];
        for errors in refusals {
            for (error, why) in errors.iter().zip(why) {
                assert!(
                    matches!(error, Some(Error::Zero(m)) if m.contains(why)),
                    "{error:?}: wanted {why}"
                );
            }
        }
    });
}

/// Through the Fabric (`pipeline-ranks` with `zero` 3): the language model
/// with FSDP across 2 pipelines of 2 stage ranks trains to ZeRO-2's bytes;
/// its state resumes with FSDP to the bytes of the run without a stop, and
/// on 4 stages without it (the checkpoint is a plain pipeline's) to one
/// device's weights; a plain pipeline's state resumes under FSDP.
#[test]
fn the_language_model_with_fsdp_across_pipelines_trains_to_zero_twos_bytes_and_resumes_with_or_without_it(
) {
    use candle_dp::fabric::{FabricConfig, Strategy};
    within(600, || {
        let steps = 4;
        let ranks = |replicas: usize, stages: usize, zero: Option<u8>| FabricConfig {
            stages,
            zero,
            ..FabricConfig::new(Strategy::PipelineRanks, replicas * stages)
        };
        let two = lm_through_the_fabric(ranks(2, 2, Some(2)), steps, None);
        let fsdp = lm_through_the_fabric(ranks(2, 2, Some(3)), steps, None);
        assert!(
            identical(&fsdp.0, &two.0),
            "FSDP across the pipelines is not ZeRO-2's bytes\n{}",
            diff_report(&fsdp.0, &two.0)
        );
        assert_eq!(fsdp.1, two.1, "the losses");
        let saving = |name: &str| {
            let dir = checkpoint_dir(name);
            move |config: FabricConfig| FabricConfig {
                checkpoint_dir: Some(dir.path()),
                ..config
            }
        };
        let same = saving("fsdp-lm");
        lm_through_the_fabric(same(ranks(2, 2, Some(3))), steps, Some(2));
        let resumed = lm_through_the_fabric(same(ranks(2, 2, Some(3))), steps, None);
        assert!(
            identical(&resumed.0, &fsdp.0),
            "resumed on 2 x 2 with FSDP\n{}",
            diff_report(&resumed.0, &fsdp.0)
        );
        let single = lm_through_the_fabric(FabricConfig::new(Strategy::Single, 1), steps, None);
        let close = |label: &str, run: &LmRun| assert_close_to_one_device(label, run, &single);
        close("FSDP on 2 x 2", &fsdp);
        let split = saving("fsdp-lm-split");
        lm_through_the_fabric(split(ranks(2, 2, Some(3))), steps, Some(2));
        let mut other = lm_through_the_fabric(split(ranks(1, 4, None)), steps, None);
        // The resumed run records only its own steps' losses.
        other.1 = single.1[..2].iter().copied().chain(other.1).collect();
        close("FSDP on 2 x 2 resumed on 4 stages without it", &other);
        let plain = saving("fsdp-lm-plain");
        lm_through_the_fabric(plain(ranks(1, 4, None)), steps, Some(2));
        let mut back = lm_through_the_fabric(plain(ranks(2, 2, Some(3))), steps, None);
        back.1 = single.1[..2].iter().copied().chain(back.1).collect();
        close("4 stages resumed on 2 x 2 with FSDP", &back);
        let refused = FabricConfig {
            zero: Some(3),
            ..FabricConfig::new(Strategy::Fsdp, 2)
        }
        .check();
        assert!(
            matches!(&refused, Err(candle_dp::Error::Strategy { reason, .. }) if reason.contains("pipeline-ranks")),
            "{refused:?}"
        );
    });
}

/// A stage's save: its variables and buffers whole, and its optimizer
/// state.
type Save = (HashMap<String, Tensor>, candle_dp::optim::OptimizerState);

/// A model whose variables do not split evenly over 2 replicas (5 rows:
/// pieces of 3 and 2 rows, the second padded), with a BatchNorm on the
/// first stage (`norm`) or an identity in its place.
fn odd_layers(norm: bool) -> Vec<candle_dp::pipeline::UnitFactory> {
    use candle_dp::pipeline::unit;
    let bn = candle_nn::BatchNormConfig {
        momentum: 0.3,
        ..Default::default()
    };
    vec![
        unit(|vb| candle_nn::linear(6, 5, vb.pp("l1"))),
        match norm {
            true => unit(move |vb| candle_nn::batch_norm(5, bn, vb.pp("bn"))),
            false => unit(|_| Ok(candle_nn::Activation::Relu)),
        },
        unit(|_| Ok(candle_nn::Activation::Relu)),
        unit(|vb| candle_nn::linear(5, 5, vb.pp("l2"))),
    ]
}

/// [`odd_layers`]' initial values, drawn once.
fn odd_init() -> HashMap<String, Tensor> {
    static INIT: std::sync::OnceLock<HashMap<String, Tensor>> = std::sync::OnceLock::new();
    INIT.get_or_init(|| {
        let varmap = candle_nn::VarMap::new();
        let vb = candle_nn::VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
        for f in odd_layers(true) {
            f(vb.clone()).unwrap();
        }
        snapshot(&varmap)
    })
    .clone()
}

/// The odd model on 2 x 2 (ZeRO-2, or FSDP, across the replicas; 2
/// micro-batches of each pipeline's 4 rows) for `data`'s steps in
/// `precision` (with the BatchNorm in f32 only), from `resume` (the first pipeline's stage ranks' saves)
/// when given: every rank's whole model after, buffers included, and the
/// first pipeline's saves.
fn odd_model_run(
    data: &[(Tensor, Tensor)],
    fsdp: bool,
    precision: Option<candle_dp::MixedPrecision>,
    resume: Option<Vec<Save>>,
) -> Vec<(HashMap<String, Tensor>, Option<Save>)> {
    let data = data.to_vec();
    let init = odd_init();
    spawn_with(4, bounded(), move |ctx| {
        let varmap = varmap_from(&init);
        let config = RankPipelineConfig {
            chunks: Some(2),
            zero: Some(ZeroStage::Two),
            fsdp,
            mixed_precision: precision.clone(),
            ..Default::default()
        };
        let layers = odd_layers(precision.is_none());
        let (mesh, pipe) = on_two_by_two(ctx.process_group(), &varmap, layers, config)?;
        enum Opt {
            Fsdp(AdamW),
            Zero(Box<candle_dp::zero::ZeroOptimizer<AdamW>>),
        }
        let mut opt = match fsdp {
            true => Opt::Fsdp(AdamW::new_named(pipe.variables().to_vec(), adamw())?),
            false => Opt::Zero(Box::new(
                pipe.zero_optimizer(|mine| AdamW::new_named(mine, adamw()))?,
            )),
        };
        if let Some(saves) = &resume {
            let (values, states): (Vec<_>, Vec<_>) = saves.iter().cloned().unzip();
            match &mut opt {
                Opt::Fsdp(adamw) => pipe.load_fsdp_stages(&values, &states, adamw)?,
                Opt::Zero(zero) => pipe.load_zero_stages(&values, &states, zero)?,
            }
        }
        let replica = mesh.local_rank("dp")?;
        for (x, y) in &data {
            let (x, y) = (x.narrow(0, replica * 4, 4)?, y.narrow(0, replica * 4, 4)?);
            let mut step = pipe.forward_backward(
                Some(&x),
                Some(&y),
                candle_dp::LossReduction::Mean,
                |out, y| candle_nn::loss::cross_entropy(&out.to_dtype(DType::F32)?, y),
            )?;
            match &mut opt {
                Opt::Fsdp(adamw) => {
                    pipe.clip_grad_norm(&mut step.grads, 0.05, 2.0, false)?;
                    candle_nn::Optimizer::step(adamw, &step.grads)?;
                }
                Opt::Zero(zero) => {
                    zero.clip_grad_norm(&mut step.grads, 0.05, 2.0, false)?;
                    zero.step(&step.grads)?;
                }
            }
        }
        let save = match &opt {
            Opt::Fsdp(adamw) => pipe.fsdp_stage_state(adamw)?,
            Opt::Zero(zero) => pipe.zero_stage_state(zero)?,
        };
        Ok((pipe.full_state()?, save))
    })
    .unwrap()
}

#[test]
fn fsdp_with_padded_pieces_batch_norm_and_mixed_precision_trains_and_resumes_to_zero_twos_bytes() {
    within(300, || {
        let data = batches(4, 8, 1);
        for precision in [None, Some(candle_dp::MixedPrecision::bf16())] {
            let label = format!("{:?}", precision.as_ref().map(|p| p.param_dtype));
            let two = odd_model_run(&data, false, precision.clone(), None);
            let fsdp = odd_model_run(&data, true, precision.clone(), None);
            for rank in 0..4 {
                assert!(
                    identical(&fsdp[rank].0, &two[rank].0),
                    "{label}, rank {rank}: FSDP is not ZeRO-2's bytes\n{}",
                    diff_report(&fsdp[rank].0, &two[rank].0)
                );
            }
            if precision.is_none() {
                assert!(fsdp[0].0.keys().any(|n| n.contains("running_mean")));
            }
            // Saved after 2 steps, resumed for the other 2: the bytes of
            // the run without a stop, with FSDP and into ZeRO-2 alike.
            let first: Vec<Save> = odd_model_run(&data[..2], true, precision.clone(), None)
                .into_iter()
                .filter_map(|(_, save)| save)
                .collect();
            assert_eq!(first.len(), 2, "the first pipeline's two ranks save");
            for (into_fsdp, want) in [(true, &fsdp), (false, &two)] {
                let rest = &data[2..];
                let resumed =
                    odd_model_run(rest, into_fsdp, precision.clone(), Some(first.clone()));
                for rank in 0..4 {
                    assert!(
                        identical(&resumed[rank].0, &want[rank].0),
                        "{label}, rank {rank}: resumed into fsdp = {into_fsdp}\n{}",
                        diff_report(&resumed[rank].0, &want[rank].0)
                    );
                }
            }
        }
    });
}

#[test]
fn a_stage_that_fails_to_build_on_one_replica_ends_every_ranks_step_naming_it() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    within(120, || {
        let init = tied_init();
        let errors = std::sync::Arc::new(std::sync::Mutex::new(vec![String::new(); 4]));
        let seen = errors.clone();
        let launch = spawn_with(4, bounded(), move |ctx| {
            let mut layers = tied_layers();
            // On rank 2 only (the second replica of stage 0), the first
            // layer asks for another variable when the step builds it again.
            let calls = std::sync::Arc::new(AtomicUsize::new(0));
            let fickle = ctx.rank == 2;
            let first = layers[0].clone();
            layers[0] = std::sync::Arc::new(move |vb: candle_nn::VarBuilder| {
                if fickle && calls.fetch_add(1, Ordering::SeqCst) > 0 {
                    vb.get(3, "surprise")?;
                }
                first(vb)
            });
            let config = RankPipelineConfig {
                fsdp: true,
                ..Default::default()
            };
            let (_, pipe) =
                on_two_by_two(ctx.process_group(), &varmap_from(&init), layers, config)?;
            let (x, y) = batches(1, 8, 2).remove(0);
            let (x, y) = (x.narrow(0, 0, 4)?, y.narrow(0, 0, 4)?);
            let step = pipe.forward_backward(
                Some(&x),
                Some(&y),
                candle_dp::LossReduction::Mean,
                candle_nn::loss::cross_entropy,
            );
            seen.lock().unwrap()[ctx.rank] = match step {
                Ok(_) => "no error".into(),
                Err(e) => e.to_string(),
            };
            Ok(())
        });
        // The launch fails with the group, naming the rank and why.
        let launch = format!("{:?}", launch.err());
        assert!(
            launch.contains("rank: 2") && launch.contains("`surprise`"),
            "{launch}"
        );
        // Every rank's step ended with rank 2's reason, none by a timeout.
        for (rank, error) in errors.lock().unwrap().iter().enumerate() {
            let relayed = rank == 2 || error.contains("rank 2 could not build its stages");
            assert!(
                relayed && error.contains("`surprise`"),
                "rank {rank}: {error}"
            );
        }
    });
}
