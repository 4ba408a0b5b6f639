//! Fully sharded data parallelism: each rank keeps its pieces of the
//! parameters, gradients and optimizer state; the weights are DDP's.

use crate::common;
use crate::example_gpt;
use crate::overlap::{
    adamw, batches, bounded, deep_units, init_deep, init_gpt, normed_units, normed_whole, share,
    tokens, DeepMlp, FailingAt, TINY,
};

use std::collections::HashMap;
use std::sync::atomic::AtomicUsize;
use std::sync::Arc;

use candle_core::{DType, Device, Module, Tensor};
use candle_dp::comm::{ProcessGroup, ThreadGroup};
use candle_dp::fsdp::{FsdpConfig, FullyShardedDataParallel};
use candle_dp::launch::spawn_with;
use candle_dp::pipeline::{unit, UnitFactory};
use candle_dp::{DdpConfig, DistributedDataParallel, Error};
use candle_nn::{linear, loss, Linear, Optimizer, VarBuilder, VarMap};
use common::*;

type Weights = HashMap<String, Tensor>;

/// Any of the test models, whole.
struct Whole(Box<dyn Module>);

impl Module for Whole {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.0.forward(x)
    }
}

/// DDP over the whole model: every rank's weights.
fn ddp_run(
    world: usize,
    init: &Weights,
    data: &[(Tensor, Tensor)],
    build: fn(VarBuilder) -> candle_core::Result<Box<dyn Module>>,
    loss_fn: fn(&Tensor, &Tensor) -> candle_core::Result<Tensor>,
) -> Vec<Weights> {
    let (init, data) = (init.clone(), data.to_vec());
    spawn_with(world, bounded(), move |ctx| {
        let varmap = varmap_from(&init);
        let mut opt = adamw(&varmap)?;
        let mut ddp = DistributedDataParallel::new(
            ctx.process_group(),
            &varmap,
            DType::F32,
            &Device::Cpu,
            |vb| build(vb).map(Whole),
            DdpConfig::default(),
        )?;
        for (x, y) in &data {
            let (x, y) = share(&ctx, x, y)?;
            let loss = loss_fn(&ddp.forward(&x)?, &y)?;
            ddp.backward_step(&loss, &mut opt)?;
        }
        Ok(snapshot(&varmap))
    })
    .unwrap()
}

/// FSDP over `units`: every rank's whole weights (gathered) and memory.
/// What a unit keeps from its forward to its backward.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Reshard {
    /// Its graph, its parameters' storage freed and refilled (the default).
    Release,
    /// Only its input: it is recomputed (`recompute_activations`).
    Recompute,
    /// Everything (`reshard_after_forward: false`).
    Keep,
}

const RESHARDS: [Reshard; 3] = [Reshard::Release, Reshard::Recompute, Reshard::Keep];

fn fsdp_run(
    world: usize,
    init: &Weights,
    data: &[(Tensor, Tensor)],
    units: fn() -> Vec<UnitFactory>,
    loss_fn: fn(&Tensor, &Tensor) -> candle_core::Result<Tensor>,
    reshard: Reshard,
) -> Vec<(Weights, candle_dp::fsdp::FsdpMemory)> {
    let (init, data) = (init.clone(), data.to_vec());
    spawn_with(world, bounded(), move |ctx| {
        let varmap = varmap_from(&init);
        let config = FsdpConfig {
            reshard_after_forward: reshard != Reshard::Keep,
            recompute_activations: reshard == Reshard::Recompute,
            ..Default::default()
        };
        let mut fsdp = FullyShardedDataParallel::from_units(
            ctx.process_group(),
            &varmap,
            DType::F32,
            &Device::Cpu,
            units(),
            config,
        )?;
        // The optimizer over the VarMap's variables: the pieces now.
        let mut opt = adamw(&varmap)?;
        for (x, y) in &data {
            let (x, y) = share(&ctx, x, y)?;
            let step = fsdp.forward_backward(&x, &y, loss_fn)?;
            anyhow::ensure!(
                step.vars_without_grad().is_empty(),
                "{:?}",
                step.vars_without_grad()
            );
            opt.step(&step.grads)?;
        }
        Ok((fsdp.full_state()?, fsdp.last_memory()))
    })
    .unwrap()
}

fn deep_whole(vb: VarBuilder) -> candle_core::Result<Box<dyn Module>> {
    Ok(Box::new(DeepMlp::new(vb)?))
}

#[test]
fn fsdp_trains_to_the_bytes_of_ddp_on_1_to_4_ranks_released_recomputed_or_kept() {
    within(240, || {
        let init = init_deep();
        let data = batches(3, 12, 8);
        for world in 1..=4 {
            let ddp = ddp_run(world, &init, &data, deep_whole, loss::cross_entropy);
            for reshard in RESHARDS {
                let fsdp = fsdp_run(
                    world,
                    &init,
                    &data,
                    deep_units,
                    loss::cross_entropy,
                    reshard,
                );
                for (rank, (weights, _)) in fsdp.iter().enumerate() {
                    assert!(
                        identical(weights, &ddp[rank]),
                        "world {world}, reshard {reshard:?}, rank {rank}: {}",
                        diff_report(weights, &ddp[rank])
                    );
                }
            }
            assert!(!identical(&ddp[0], &init));
        }
    });
}

#[test]
fn each_rank_holds_its_share_and_the_peak_adds_at_most_two_units() {
    within(120, || {
        let init = init_deep();
        let data = batches(1, 8, 9);
        let full: usize = init.values().map(|t| t.elem_count() * 4).sum();
        let largest_unit: usize = (0..5)
            .map(|l| {
                ["weight", "bias"]
                    .iter()
                    .map(|p| init[&format!("l{l}.{p}")].elem_count() * 4)
                    .sum::<usize>()
            })
            .max()
            .unwrap();
        for world in [2, 4] {
            for reshard in RESHARDS {
                let runs = fsdp_run(
                    world,
                    &init,
                    &data,
                    deep_units,
                    loss::cross_entropy,
                    reshard,
                );
                let memory = runs[0].1;
                assert_eq!(memory.full_bytes, full);
                // Pieces are padded to equal rows: within a row per parameter.
                let share = full as f64 / world as f64;
                assert!(
                    (memory.shard_bytes as f64) <= share * 1.05 + (10 * 12 * 4) as f64,
                    "world {world}: {} bytes held, {share} a share",
                    memory.shard_bytes
                );
                if reshard != Reshard::Keep {
                    assert!(
                        memory.peak_gathered_bytes <= 2 * largest_unit,
                        "world {world}: peak {} > two units {}",
                        memory.peak_gathered_bytes,
                        2 * largest_unit
                    );
                } else {
                    assert_eq!(memory.peak_gathered_bytes, full, "world {world}");
                }
            }
        }
    });
}

/// A unit with a 0-dim parameter and a layer of 3 rows, on 4 ranks: more
/// ranks than rows (rank 3 holds only padding) and a scalar held by rank 0.
struct Scaled {
    linear: Linear,
    scale: Tensor,
}

impl Module for Scaled {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.linear.forward(x)?.broadcast_mul(&self.scale)
    }
}

fn odd_units() -> Vec<UnitFactory> {
    vec![
        unit(|vb| linear(6, 7, vb.pp("a"))),
        unit(|_| Ok(candle_nn::Activation::Relu)),
        unit(|vb| {
            Ok(Scaled {
                linear: linear(7, 3, vb.pp("b"))?,
                scale: vb.get_with_hints((), "scale", candle_nn::init::Init::Const(1.5))?,
            })
        }),
    ]
}

struct Odd(Linear, Scaled);

impl Module for Odd {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.1.forward(&self.0.forward(x)?.relu()?)
    }
}

fn odd_whole(vb: VarBuilder) -> candle_core::Result<Box<dyn Module>> {
    Ok(Box::new(Odd(
        linear(6, 7, vb.pp("a"))?,
        Scaled {
            linear: linear(7, 3, vb.pp("b"))?,
            scale: vb.get_with_hints((), "scale", candle_nn::init::Init::Const(1.5))?,
        },
    )))
}

/// The odd model has 3 outputs: every row's target is class 0.
fn class_0_loss(out: &Tensor, y: &Tensor) -> candle_core::Result<Tensor> {
    loss::cross_entropy(out, &(y.to_dtype(DType::F32)? * 0.0)?.to_dtype(DType::U32)?)
}

#[test]
fn uneven_rows_a_zero_dim_parameter_and_more_ranks_than_rows_train_as_under_ddp() {
    within(120, || {
        let init = {
            let varmap = VarMap::new();
            odd_whole(VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu)).unwrap();
            snapshot(&varmap)
        };
        assert_eq!(init["scale"].dims(), &[] as &[usize]);
        let data = batches(3, 12, 10);
        for world in [3, 4] {
            let ddp = ddp_run(world, &init, &data, odd_whole, class_0_loss);
            let fsdp = fsdp_run(
                world,
                &init,
                &data,
                odd_units,
                class_0_loss,
                Reshard::Release,
            );
            assert!(
                identical(&fsdp[world - 1].0, &ddp[world - 1]),
                "world {world}: {}",
                diff_report(&fsdp[world - 1].0, &ddp[world - 1])
            );
            assert_eq!(fsdp[0].0["scale"].dims(), &[] as &[usize]);
            assert_ne!(fsdp[0].0["scale"].to_scalar::<f32>().unwrap(), 1.5);
        }
    });
}

fn gpt_units() -> Vec<UnitFactory> {
    example_gpt::units(TINY)
}

fn gpt_whole(vb: VarBuilder) -> candle_core::Result<Box<dyn Module>> {
    Ok(Box::new(example_gpt::Gpt::new(TINY, vb)?))
}

/// The language model, its head tied to the embedding (gathered for both
/// units, its gradients summed before the reduce-scatter): DDP's bytes
/// when no token repeats in a batch (see the overlap's tests for why).
#[test]
fn the_language_model_with_its_tied_head_trains_to_the_bytes_of_ddp() {
    within(240, || {
        let init = init_gpt();
        let data = tokens(2, 6, 251);
        for world in [2, 3] {
            let ddp = ddp_run(world, &init, &data, gpt_whole, example_gpt::lm_loss);
            for reshard in [Reshard::Release, Reshard::Recompute] {
                let fsdp = fsdp_run(
                    world,
                    &init,
                    &data,
                    gpt_units,
                    example_gpt::lm_loss,
                    reshard,
                );
                assert!(
                    identical(&fsdp[0].0, &ddp[0]),
                    "world {world}, {reshard:?}: {}",
                    diff_report(&fsdp[0].0, &ddp[0])
                );
            }
        }
    });
}

/// A unit that draws random numbers gives another output when recomputed:
/// resharded with `recompute_activations`, the step fails naming the unit
/// on every rank (the group is failed: the others' collectives of the
/// step cannot all come), and the pieces are as before; kept (no
/// reshard), or resharded with its activations kept (the default: only
/// its parameters' storage freed and refilled), it trains. So does it as
/// the unit before the last, which is kept even with resharding when the
/// walk prefetches (never recomputed); without prefetch that unit is
/// resharded and recomputed as the others.
#[test]
fn a_random_unit_recomputed_for_the_backward_fails_the_step_named() {
    // Bounded: a hang fails the test instead of stalling CI.
    within(60, || {
        fn noisy_units(dropout_at: usize) -> Vec<UnitFactory> {
            let mut units = vec![
                unit(|vb| linear(6, 8, vb.pp("a"))),
                unit(|vb| linear(8, 8, vb.pp("b"))),
                unit(|vb| linear(8, 5, vb.pp("c"))),
            ];
            units.insert(dropout_at, unit(|_| Ok(candle_nn::Dropout::new(0.5))));
            units
        }
        let run = |pg: Arc<dyn ProcessGroup>, dropout_at, reshard, prefetch, recompute| {
            let varmap = VarMap::new();
            let mut fsdp = FullyShardedDataParallel::from_units(
                pg.clone(),
                &varmap,
                DType::F32,
                &Device::Cpu,
                noisy_units(dropout_at),
                FsdpConfig {
                    reshard_after_forward: reshard,
                    recompute_activations: recompute,
                    prefetch,
                    ..Default::default()
                },
            )
            .unwrap();
            let before = snapshot(&varmap);
            let (x, y) = batches(1, 8, 11).remove(0);
            let rank = pg.rank();
            let (x, y) = (
                x.narrow(0, rank * 4, 4).unwrap(),
                y.narrow(0, rank * 4, 4).unwrap(),
            );
            let result = fsdp.forward_backward(&x, &y, loss::cross_entropy);
            (
                result.map(|_| ()).map_err(|e| e.to_string()),
                identical(&before, &snapshot(&varmap)),
            )
        };
        // (where the Dropout is of 4 units, resharded, prefetched,
        // recompute_activations, recomputed)
        for (dropout_at, reshard, prefetch, recompute, recomputed) in [
            (1, true, true, true, true),
            (1, true, true, false, false),
            (1, false, true, true, false),
            (2, true, true, true, false),
            (2, true, false, true, true),
            (2, true, false, false, false),
        ] {
            let ranks = ThreadGroup::with_options(2, bounded());
            let outcomes: Vec<_> = std::thread::scope(|s| {
                let handles: Vec<_> = ranks
                    .into_iter()
                    .map(|pg| {
                        s.spawn(move || run(Arc::new(pg), dropout_at, reshard, prefetch, recompute))
                    })
                    .collect();
                handles.into_iter().map(|h| h.join().unwrap()).collect()
            });
            for (rank, (result, unchanged)) in outcomes.into_iter().enumerate() {
                let case = format!(
                    "rank {rank}, the Dropout unit {dropout_at}, reshard {reshard:?}, prefetch \
                     {prefetch}, recompute {recompute}"
                );
                if recomputed {
                    let message = result.expect_err("a recomputed Dropout must fail");
                    assert!(
                        message.contains("Dropout") || message.contains("failed"),
                        "{case}: {message}"
                    );
                    assert!(unchanged, "{case}");
                } else {
                    assert!(result.is_ok(), "{case}: {result:?}");
                }
            }
        }
    });
}

#[test]
fn a_rank_failing_inside_a_gather_is_named_on_every_rank_and_changes_nothing() {
    within(60, || {
        let init = init_deep();
        let data = batches(1, 8, 12);
        let outcomes = on_own_threads(2, bounded(), |rank_pg| {
            let rank = rank_pg.rank();
            // The 4th gather or scatter: inside the forward.
            let pg: Arc<dyn ProcessGroup> = Arc::new(FailingAt {
                fail_at: (rank == 1).then_some(3),
                inner: Arc::new(rank_pg),
                calls: AtomicUsize::new(0),
            });
            let varmap = varmap_from(&init);
            let mut fsdp = FullyShardedDataParallel::from_units(
                pg,
                &varmap,
                DType::F32,
                &Device::Cpu,
                deep_units(),
                FsdpConfig::default(),
            )
            .unwrap();
            let before = snapshot(&varmap);
            let b = data[0].0.dim(0).unwrap() / 2;
            let x = data[0].0.narrow(0, rank * b, b).unwrap();
            let y = data[0].1.narrow(0, rank * b, b).unwrap();
            let err = fsdp
                .forward_backward(&x, &y, loss::cross_entropy)
                .expect_err("the step must fail");
            (err.to_string(), identical(&before, &snapshot(&varmap)))
        });
        for (rank, (message, unchanged)) in outcomes.into_iter().enumerate() {
            assert!(message.contains(&format!("rank {rank}")), "{message}");
            assert!(message.contains("rank 1 lost its network"), "{message}");
            assert!(unchanged, "rank {rank}");
        }
    });
}

#[test]
fn no_units_or_buffers_with_mixed_precision_are_refused_naming_why() {
    // Bounded: a hang fails the test instead of stalling CI.
    within(60, || {
        let errors = spawn_with(1, bounded(), |ctx| {
            let none = FullyShardedDataParallel::from_units(
                ctx.process_group(),
                &VarMap::new(),
                DType::F32,
                &Device::Cpu,
                Vec::new(),
                FsdpConfig::default(),
            )
            .expect_err("no units");
            let bn = FullyShardedDataParallel::from_units(
                ctx.process_group(),
                &VarMap::new(),
                DType::F32,
                &Device::Cpu,
                vec![unit(|vb| {
                    candle_nn::batch_norm(4, candle_nn::BatchNormConfig::default(), vb.pp("bn"))
                })],
                FsdpConfig {
                    mixed_precision: Some(candle_dp::precision::MixedPrecision::bf16()),
                    ..Default::default()
                },
            )
            .expect_err("a buffer with mixed precision");
            Ok((
                none.to_string(),
                bn.to_string(),
                matches!(bn, Error::Rank { .. }),
            ))
        })
        .unwrap()
        .remove(0);
        assert!(errors.0.contains("at least one unit"), "{}", errors.0);
        assert!(
            errors.1.contains("bn.running_mean") && errors.1.contains("mixed precision"),
            "{}",
            errors.1
        );
        assert!(errors.2);
    });
}

#[test]
fn batch_norm_buffers_are_broadcast_updated_once_per_step_and_match_ddp() {
    within(240, || {
        let varmap = VarMap::new();
        normed_whole(VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu)).unwrap();
        let init = snapshot(&varmap);
        let data = batches(3, 12, 4);
        for world in 1..=3 {
            let ddp = ddp_run(world, &init, &data, normed_whole, loss::cross_entropy);
            assert!(
                bits(&ddp[0]["bn0.running_mean"]) != bits(&init["bn0.running_mean"]),
                "the statistics moved"
            );
            for reshard in RESHARDS {
                let fsdp = fsdp_run(
                    world,
                    &init,
                    &data,
                    normed_units,
                    loss::cross_entropy,
                    reshard,
                );
                for (rank, (weights, _)) in fsdp.iter().enumerate() {
                    // Weights and statistics: a recomputation that updated
                    // them again would show here.
                    assert_eq!(weights.len(), ddp[rank].len());
                    assert!(
                        identical(weights, &ddp[rank]),
                        "world {world}, reshard {reshard:?}, rank {rank}: {}",
                        diff_report(weights, &ddp[rank])
                    );
                }
            }
        }
    });
}

/// What each rank saved at the checkpoint: its pieces and optimizer state.
pub(crate) type Save = (HashMap<String, Tensor>, candle_dp::optim::OptimizerState);

/// FSDP over `world` ranks with the crate's AdamW (see [`sharded_adamw`]).
fn fsdp_adamw(
    units: fn() -> Vec<UnitFactory>,
    world: usize,
    init: &Weights,
    data: &[(Tensor, Tensor)],
    saves: Option<Vec<Save>>,
    save_after: Option<usize>,
) -> Vec<(Option<Save>, Weights)> {
    sharded_adamw(units, Ranks::Fsdp(world), init, data, saves, save_after)
}

/// How the ranks of [`sharded_adamw`] shard.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Ranks {
    /// FSDP over this many ranks.
    Fsdp(usize),
    /// HSDP on a `replicas x shards` mesh.
    Hsdp(usize, usize),
}

/// `units` under FSDP or HSDP with the crate's AdamW, from `init`: loads
/// `saves` first if given, saves before step `save_after`; every rank's
/// save and whole weights.
pub(crate) fn sharded_adamw(
    units: fn() -> Vec<UnitFactory>,
    ranks: Ranks,
    init: &Weights,
    data: &[(Tensor, Tensor)],
    saves: Option<Vec<Save>>,
    save_after: Option<usize>,
) -> Vec<(Option<Save>, Weights)> {
    use candle_dp::comm::DeviceMesh;
    use candle_dp::optim::{AdamW, AdamWConfig};
    let (init, data) = (init.clone(), data.to_vec());
    let world = match ranks {
        Ranks::Fsdp(world) => world,
        Ranks::Hsdp(r, s) => r * s,
    };
    spawn_with(world, bounded(), move |ctx| {
        let varmap = varmap_from(&init);
        let (dt, dev, config) = (DType::F32, Device::Cpu, FsdpConfig::default());
        let mut fsdp = match ranks {
            Ranks::Hsdp(r, s) => {
                let mesh = DeviceMesh::new(ctx.process_group(), &[("replicate", r), ("shard", s)])?;
                FullyShardedDataParallel::from_units_on_mesh(
                    &mesh,
                    &varmap,
                    dt,
                    &dev,
                    units(),
                    config,
                )?
            }
            Ranks::Fsdp(_) => FullyShardedDataParallel::from_units(
                ctx.process_group(),
                &varmap,
                dt,
                &dev,
                units(),
                config,
            )?,
        };
        let adamw = AdamWConfig {
            lr: 0.01,
            ..Default::default()
        };
        let mut opt = AdamW::new_named(fsdp.shards().to_vec(), adamw)?;
        if let Some(saves) = &saves {
            let (pieces, states): (Vec<_>, Vec<_>) = saves.iter().cloned().unzip();
            fsdp.load_resharded(&pieces, &states, &mut opt)?;
        }
        let mut saved = None;
        for (s, (x, y)) in data.iter().enumerate() {
            if Some(s) == save_after {
                saved = Some((fsdp.pieces()?, fsdp.shard_state(&opt)?));
            }
            let (x, y) = share(&ctx, x, y)?;
            let step = fsdp.forward_backward(&x, &y, loss::cross_entropy)?;
            opt.step(&step.grads)?;
        }
        Ok((saved, fsdp.full_state()?))
    })
    .unwrap()
}

#[test]
fn a_sharded_checkpoint_resumes_to_the_same_bytes_and_reshards_to_any_world_size() {
    within(240, || {
        let init = init_deep();
        let data = batches(4, 12, 13);
        // Uninterrupted, saving after 2 of 4 steps.
        let whole = fsdp_adamw(deep_units, 2, &init, &data, None, Some(2));
        let saves: Vec<Save> = whole.iter().map(|(s, _)| s.clone().unwrap()).collect();
        // The same world: the last 2 steps from the save, the same bytes.
        let resumed = fsdp_adamw(deep_units, 2, &init, &data[2..], Some(saves.clone()), None);
        assert!(
            identical(&resumed[0].1, &whole[0].1),
            "{}",
            diff_report(&resumed[0].1, &whole[0].1)
        );
        // Another world: the same whole weights at the save, then the same
        // training up to the reduction's order.
        for world in [1, 3, 4] {
            let at_save = fsdp_adamw(
                deep_units,
                world,
                &init,
                &data[..0],
                Some(saves.clone()),
                None,
            );
            let two = fsdp_adamw(deep_units, 2, &init, &data[..2], None, None);
            assert!(
                identical(&at_save[0].1, &two[0].1),
                "world {world}: {}",
                diff_report(&at_save[0].1, &two[0].1)
            );
            let resumed = fsdp_adamw(
                deep_units,
                world,
                &init,
                &data[2..],
                Some(saves.clone()),
                None,
            );
            let diff = max_rel_diff(&resumed[world - 1].1, &whole[0].1);
            assert!(diff < 1e-5, "world {world}: {diff}");
        }
    });
}

#[test]
fn batch_norm_statistics_are_saved_whole_and_resume_on_any_world_size() {
    within(240, || {
        let varmap = VarMap::new();
        normed_whole(VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu)).unwrap();
        let init = snapshot(&varmap);
        let data = batches(4, 12, 9);
        let whole = fsdp_adamw(normed_units, 2, &init, &data, None, Some(2));
        let saves: Vec<Save> = whole.iter().map(|(s, _)| s.clone().unwrap()).collect();
        let resumed = fsdp_adamw(
            normed_units,
            2,
            &init,
            &data[2..],
            Some(saves.clone()),
            None,
        );
        assert!(
            identical(&resumed[0].1, &whole[0].1),
            "{}",
            diff_report(&resumed[0].1, &whole[0].1)
        );
        // Loaded on 3 ranks: every rank holds rank 0's saved statistics.
        let loaded = fsdp_adamw(
            normed_units,
            3,
            &init,
            &data[..0],
            Some(saves.clone()),
            None,
        );
        for (rank, (_, state)) in loaded.iter().enumerate() {
            for name in ["bn0.running_mean", "bn0.running_var"] {
                assert_eq!(
                    bits(&state[name]),
                    bits(&saves[0].0[name]),
                    "rank {rank}: {name}"
                );
            }
        }
    });
}

#[test]
fn saves_of_an_incomplete_set_or_of_different_steps_are_refused_and_nothing_changes() {
    within(120, || {
        let init = init_deep();
        let data = batches(3, 12, 14);
        let a = fsdp_adamw(deep_units, 2, &init, &data, None, Some(1));
        let b = fsdp_adamw(deep_units, 2, &init, &data, None, Some(2));
        let at = |runs: &[(Option<Save>, Weights)], r: usize| runs[r].0.clone().unwrap();
        let errors = spawn_with(2, bounded(), move |ctx| {
            use candle_dp::optim::{AdamW, AdamWConfig};
            let varmap = varmap_from(&init);
            let mut fsdp = FullyShardedDataParallel::from_units(
                ctx.process_group(),
                &varmap,
                DType::F32,
                &Device::Cpu,
                deep_units(),
                FsdpConfig::default(),
            )?;
            let mut opt = AdamW::new_named(fsdp.shards().to_vec(), AdamWConfig::default())?;
            let before = snapshot(&varmap);
            let mut messages = Vec::new();
            for saves in [
                vec![at(&a, 0)],
                vec![at(&a, 0), at(&b, 1)],
                vec![at(&a, 1), at(&a, 0)],
            ] {
                let (pieces, states): (Vec<_>, Vec<_>) = saves.into_iter().unzip();
                let pieces = match pieces.len() {
                    1 => vec![pieces[0].clone(), HashMap::new()],
                    _ => pieces,
                };
                let err = fsdp
                    .load_resharded(&pieces, &states, &mut opt)
                    .expect_err("must be refused");
                messages.push(err.to_string());
            }
            // A save of a model whose rows differ (pieces of the same size).
            let (pieces, mut states): (Vec<_>, Vec<_>) =
                vec![at(&a, 0), at(&a, 1)].into_iter().unzip();
            states[0]
                .settings
                .insert("fsdp.rows.l0.weight".into(), 11.0);
            let err = fsdp
                .load_resharded(&pieces, &states, &mut opt)
                .expect_err("must be refused");
            messages.push(err.to_string());
            anyhow::ensure!(identical(&before, &snapshot(&varmap)), "the pieces changed");
            Ok(messages)
        })
        .unwrap()
        .remove(0);
        assert!(errors[0].contains("every rank's save"), "{}", errors[0]);
        assert!(
            errors[1].contains("different runs or steps"),
            "{}",
            errors[1]
        );
        assert!(errors[2].contains("rank order"), "{}", errors[2]);
        assert!(
            errors[3].contains("`l0.weight` has 12 rows") && errors[3].contains("11"),
            "{}",
            errors[3]
        );
    });
}

#[test]
fn the_full_state_exports_to_safetensors_and_loads_as_the_whole_model() {
    // Bounded: a hang fails the test instead of stalling CI.
    within(60, || {
        let init = init_deep();
        let data = batches(1, 8, 15);
        let runs = fsdp_run(
            2,
            &init,
            &data,
            deep_units,
            loss::cross_entropy,
            Reshard::Release,
        );
        let path = std::env::temp_dir().join(format!(
            "candle_dp_test_{}_fsdp_export.safetensors",
            std::process::id()
        ));
        candle_core::safetensors::save(&runs[0].0, &path).unwrap();
        let loaded = candle_core::safetensors::load(&path, &Device::Cpu).unwrap();
        let _ = std::fs::remove_file(&path);
        assert!(identical(&loaded, &runs[0].0));
        assert_eq!(loaded["l0.weight"].dims(), init["l0.weight"].dims());
        // The model loads it whole, with no FSDP.
        let varmap = varmap_from(&loaded);
        let model =
            DeepMlp::new(VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu)).unwrap();
        model.forward(&data[0].0).unwrap();
    });
}

/// Gradient accumulation: two micro-batches inside `no_sync` (no
/// reduce-scatter, whole gradients accumulated), the third reduces the
/// sum: DDP's bytes with its own `no_sync`.
#[test]
fn no_sync_accumulates_and_the_next_step_reduce_scatters_the_sum_as_ddp_does() {
    within(120, || {
        let init = init_deep();
        let data = batches(3, 8, 16);
        let scaled = |l: Tensor| l / 3.0;
        let (i1, d1) = (init.clone(), data.clone());
        let ddp = spawn_with(2, bounded(), move |ctx| {
            let varmap = varmap_from(&i1);
            let mut opt = adamw(&varmap)?;
            let mut ddp = DistributedDataParallel::new(
                ctx.process_group(),
                &varmap,
                DType::F32,
                &Device::Cpu,
                DeepMlp::new,
                DdpConfig::default(),
            )?;
            let parts: Vec<(Tensor, Tensor)> = d1
                .iter()
                .map(|(x, y)| share(&ctx, x, y))
                .collect::<candle_core::Result<_>>()?;
            ddp.no_sync(|ddp| -> anyhow::Result<()> {
                for (x, y) in &parts[..2] {
                    let l = scaled(loss::cross_entropy(&ddp.forward(x)?, y)?)?;
                    ddp.backward(&l)?;
                }
                Ok(())
            })?;
            let (x, y) = &parts[2];
            let l = scaled(loss::cross_entropy(&ddp.forward(x)?, y)?)?;
            ddp.backward_step(&l, &mut opt)?;
            Ok(snapshot(&varmap))
        })
        .unwrap();
        let fsdp = spawn_with(2, bounded(), move |ctx| {
            let varmap = varmap_from(&init);
            let mut fsdp = FullyShardedDataParallel::from_units(
                ctx.process_group(),
                &varmap,
                DType::F32,
                &Device::Cpu,
                deep_units(),
                FsdpConfig::default(),
            )?;
            let mut opt = adamw(&varmap)?;
            let parts: Vec<(Tensor, Tensor)> = data
                .iter()
                .map(|(x, y)| share(&ctx, x, y))
                .collect::<candle_core::Result<_>>()?;
            fsdp.no_sync(|fsdp| -> anyhow::Result<()> {
                for (x, y) in &parts[..2] {
                    let step =
                        fsdp.forward_backward(x, y, |o, y| scaled(loss::cross_entropy(o, y)?))?;
                    anyhow::ensure!(step.grads.get_ids().next().is_none());
                }
                Ok(())
            })?;
            let (x, y) = &parts[2];
            let step = fsdp.forward_backward(x, y, |o, y| scaled(loss::cross_entropy(o, y)?))?;
            opt.step(&step.grads)?;
            Ok(fsdp.full_state()?)
        })
        .unwrap();
        for rank in 0..2 {
            assert!(
                identical(&fsdp[rank], &ddp[rank]),
                "rank {rank}: {}",
                diff_report(&fsdp[rank], &ddp[rank])
            );
        }
    });
}

/// A test model as one module and as units.
type Model = (
    fn(VarBuilder) -> candle_core::Result<Box<dyn Module>>,
    fn() -> Vec<UnitFactory>,
);

/// DDP and FSDP under the same mixed-precision `policy`, from `init`, each
/// rank on its share of `data`, the first `accumulate` micro-batches
/// inside `no_sync` (the step after reduces their sum): every rank's
/// weights under DDP, then under FSDP, and FSDP's memory of its last step.
fn mixed_precision_runs(
    policy: &candle_dp::precision::MixedPrecision,
    init: &Weights,
    data: &[(Tensor, Tensor)],
    (whole, units): Model,
    accumulate: usize,
) -> (Vec<Weights>, Vec<(Weights, candle_dp::fsdp::FsdpMemory)>) {
    let loss_fn = |o: &Tensor, y: &Tensor| loss::cross_entropy(&flat_logits(o)?, &y.flatten_all()?);
    let (i1, d1, p1) = (init.clone(), data.to_vec(), policy.clone());
    let ddp = spawn_with(2, bounded(), move |ctx| {
        let varmap = varmap_from(&i1);
        let mut opt = adamw(&varmap)?;
        let mut ddp = DistributedDataParallel::new(
            ctx.process_group(),
            &varmap,
            DType::F32,
            &Device::Cpu,
            |vb| whole(vb).map(Whole),
            DdpConfig {
                mixed_precision: Some(p1.clone()),
                ..Default::default()
            },
        )?;
        let parts: Vec<(Tensor, Tensor)> = d1
            .iter()
            .map(|(x, y)| share(&ctx, x, y))
            .collect::<candle_core::Result<_>>()?;
        ddp.no_sync(|ddp| -> anyhow::Result<()> {
            for (x, y) in &parts[..accumulate] {
                let l = loss_fn(&ddp.forward(x)?, y)?;
                ddp.backward(&l)?;
            }
            Ok(())
        })?;
        for (x, y) in &parts[accumulate..] {
            let l = loss_fn(&ddp.forward(x)?, y)?;
            ddp.backward_step(&l, &mut opt)?;
        }
        Ok(snapshot(&varmap))
    })
    .unwrap();
    let (i2, d2, p2) = (init.clone(), data.to_vec(), policy.clone());
    let fsdp = spawn_with(2, bounded(), move |ctx| {
        let varmap = varmap_from(&i2);
        let mut fsdp = FullyShardedDataParallel::from_units(
            ctx.process_group(),
            &varmap,
            DType::F32,
            &Device::Cpu,
            units(),
            FsdpConfig {
                mixed_precision: Some(p2.clone()),
                ..Default::default()
            },
        )?;
        let mut opt = adamw(&varmap)?;
        let parts: Vec<(Tensor, Tensor)> = d2
            .iter()
            .map(|(x, y)| share(&ctx, x, y))
            .collect::<candle_core::Result<_>>()?;
        fsdp.no_sync(|fsdp| -> anyhow::Result<()> {
            for (x, y) in &parts[..accumulate] {
                fsdp.forward_backward(x, y, loss_fn)?;
            }
            Ok(())
        })?;
        for (x, y) in &parts[accumulate..] {
            opt.step(&fsdp.forward_backward(x, y, loss_fn)?.grads)?;
        }
        Ok((fsdp.full_state()?, fsdp.last_memory()))
    })
    .unwrap();
    (ddp, fsdp)
}

/// The logits as rows of classes, in f32: a language model's `(b, t, v)`
/// as `(b * t, v)` (its targets flattened alike), a classifier's as they
/// are.
fn flat_logits(o: &Tensor) -> candle_core::Result<Tensor> {
    let v = o.dim(o.rank() - 1)?;
    o.to_dtype(DType::F32)?.reshape(((), v))
}

/// bf16 compute, gradients reduce-scattered in f32 (`MixedPrecision::bf16`)
/// or in bf16: the pieces and AdamW stay f32, and the weights are those of
/// DDP under the same policy, bit for bit.
#[test]
fn mixed_precision_trains_to_the_bytes_of_ddp_under_the_same_policy() {
    use candle_dp::precision::MixedPrecision;
    within(180, || {
        let init = init_deep();
        let data = batches(2, 8, 18);
        for policy in [
            MixedPrecision::bf16(),
            MixedPrecision::bf16().reduce_dtype(DType::BF16),
        ] {
            let (ddp, fsdp) =
                mixed_precision_runs(&policy, &init, &data, (deep_whole, deep_units), 0);
            let gathered = fsdp[0].1.peak_gathered_bytes;
            assert!(gathered > 0 && gathered < fsdp[0].1.full_bytes);
            assert!(
                identical(&fsdp[0].0, &ddp[0]),
                "{policy:?}: {}",
                diff_report(&fsdp[0].0, &ddp[0])
            );
            assert!(!identical(&fsdp[0].0, &init));
            assert_eq!(fsdp[0].0["l0.weight"].dtype(), DType::F32);
        }
    });
}

/// The same variables split into other units on rank 1 (one unit holding
/// both linear layers, where rank 0 has three units), or another number
/// of units over the same split: FSDP would gather and reduce-scatter
/// different parameters at the same point of the walk. Refused at
/// construction on every rank, naming rank 1 and the unit.
#[test]
fn ranks_that_split_the_variables_into_other_units_are_refused_naming_the_rank() {
    within(60, || {
        fn both(vb: VarBuilder) -> candle_core::Result<(Linear, Linear)> {
            Ok((linear(6, 8, vb.pp("a"))?, linear(8, 2, vb.pp("b"))?))
        }
        struct Both(Linear, Linear);
        impl Module for Both {
            fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
                self.1.forward(&self.0.forward(x)?.relu()?)
            }
        }
        let split = || -> Vec<UnitFactory> {
            vec![
                unit(|vb| linear(6, 8, vb.pp("a"))),
                unit(|_| Ok(candle_nn::Activation::Relu)),
                unit(|vb| linear(8, 2, vb.pp("b"))),
            ]
        };
        type Factories = fn() -> Vec<UnitFactory>;
        let cases: Vec<(&str, Factories)> = vec![
            ("one unit", || {
                vec![unit(|vb| both(vb).map(|(a, b)| Both(a, b)))]
            }),
            ("no activation unit", || {
                vec![
                    unit(|vb| linear(6, 8, vb.pp("a"))),
                    unit(|vb| linear(8, 2, vb.pp("b"))),
                ]
            }),
        ];
        for (case, other) in cases {
            let mismatches = mismatch_on_every_rank(move |rank| match rank {
                0 => (split(), FsdpConfig::default()),
                _ => (other(), FsdpConfig::default()),
            });
            for (me, (rank, detail)) in mismatches.into_iter().enumerate() {
                assert_eq!(rank, 1, "{case}, rank {me}: {detail}");
                assert!(detail.contains("unit"), "{case}, rank {me}: {detail}");
            }
        }
    });
}

/// Builds FSDP on 2 thread ranks, each from what `model_of(rank)` gives,
/// and returns the `ModelMismatch` every rank got (the rank it names and
/// its words); a rank that built, or failed otherwise, fails the test.
fn mismatch_on_every_rank(
    model_of: impl Fn(usize) -> (Vec<UnitFactory>, FsdpConfig) + Send + Sync + 'static,
) -> Vec<(usize, String)> {
    let outcomes = spawn_with(2, bounded(), move |ctx| {
        let (units, config) = model_of(ctx.rank);
        let built = FullyShardedDataParallel::from_units(
            ctx.process_group(),
            &VarMap::new(),
            DType::F32,
            &Device::Cpu,
            units,
            config,
        );
        Ok(match built {
            Err(Error::ModelMismatch { rank, detail }) => Ok((rank, detail)),
            Ok(_) => Err("built".to_string()),
            Err(other) => Err(other.to_string()),
        })
    })
    .unwrap();
    outcomes
        .into_iter()
        .enumerate()
        .map(|(me, outcome)| outcome.unwrap_or_else(|why| panic!("rank {me}: {why}")))
        .collect()
}

/// One rule for a set of sharded states, FSDP's and ZeRO's alike: a
/// rank's state that lacks a parameter's moments (which rank 0's has, or
/// the other way round) or holds another setting (another lr at the same
/// step) is refused, naming the rank and the entry, and nothing is loaded.
#[test]
fn a_sharded_load_refuses_a_rank_whose_state_lacks_an_entry_or_has_other_settings() {
    within(120, || {
        let init = init_deep();
        let data = batches(2, 12, 21);
        let run = fsdp_adamw(deep_units, 2, &init, &data, None, Some(1));
        let saves: Vec<Save> = run.iter().map(|(s, _)| s.clone().unwrap()).collect();
        let key = "l0.weight.exp_avg";
        assert!(saves[1].1.tensors.contains_key(key));
        let mut cases: Vec<(String, Vec<Save>)> = Vec::new();
        for r in 0..2 {
            let mut lacking = saves.clone();
            lacking[r].1.tensors.remove(key);
            cases.push((format!("rank {r} lacks"), lacking));
        }
        let mut other_lr = saves.clone();
        other_lr[1].1.settings.insert("lr".into(), 0.5);
        cases.push(("another lr".into(), other_lr));
        let messages = spawn_with(2, bounded(), move |ctx| {
            use candle_dp::optim::{AdamW, AdamWConfig, StatefulOptimizer};
            let varmap = varmap_from(&init);
            let mut fsdp = FullyShardedDataParallel::from_units(
                ctx.process_group(),
                &varmap,
                DType::F32,
                &Device::Cpu,
                deep_units(),
                FsdpConfig::default(),
            )?;
            let mut opt = AdamW::new_named(fsdp.shards().to_vec(), AdamWConfig::default())?;
            let (before, state_before) = (snapshot(&varmap), opt.state()?);
            let mut messages = Vec::new();
            for (case, saves) in &cases {
                let (pieces, states): (Vec<_>, Vec<_>) = saves.iter().cloned().unzip();
                let err = fsdp
                    .load_resharded(&pieces, &states, &mut opt)
                    .expect_err(case);
                anyhow::ensure!(
                    identical(&before, &snapshot(&varmap)),
                    "{case}: pieces moved"
                );
                anyhow::ensure!(
                    opt.state()?.steps == state_before.steps,
                    "{case}: state moved"
                );
                anyhow::ensure!(opt.state()?.tensors.is_empty(), "{case}: state loaded");
                messages.push(err.to_string());
            }
            Ok(messages)
        })
        .unwrap()
        .remove(0);
        for (r, message) in messages[..2].iter().enumerate() {
            assert!(
                message.contains(&format!("rank {r}'s state lacks `{key}`")),
                "{message}"
            );
        }
        assert!(
            messages[2].contains("rank 1") && messages[2].contains("`lr`"),
            "{}",
            messages[2]
        );
    });
}

/// A step whose loss fails after the forward updated BatchNorm's running
/// statistics (on rank 0 only here; rank 1's step then fails at the
/// reduce-scatter): every rank's buffers are as before the step.
#[test]
fn a_step_whose_loss_fails_leaves_the_batch_norm_statistics_untouched_on_every_rank() {
    within(60, || {
        let varmap = VarMap::new();
        normed_whole(VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu)).unwrap();
        let init = snapshot(&varmap);
        let data = batches(2, 12, 4);
        // Threads of their own: the failed step fails the group, which a
        // launcher would report instead of the ranks' outcomes.
        let outcomes = on_own_threads(2, bounded(), |pg| -> anyhow::Result<bool> {
            let rank = pg.rank();
            let varmap = varmap_from(&init);
            let mut fsdp = FullyShardedDataParallel::from_units(
                Arc::new(pg),
                &varmap,
                DType::F32,
                &Device::Cpu,
                normed_units(),
                FsdpConfig::default(),
            )?;
            let mut opt = adamw(&varmap)?;
            let mine = |x: &Tensor, y: &Tensor| -> candle_core::Result<_> {
                Ok((x.narrow(0, rank * 6, 6)?, y.narrow(0, rank * 6, 6)?))
            };
            // One good step first: rank 1's statistics then differ from
            // rank 0's (each updated with its rows).
            let (x, y) = mine(&data[0].0, &data[0].1)?;
            opt.step(&fsdp.forward_backward(&x, &y, loss::cross_entropy)?.grads)?;
            let before = snapshot(&varmap);
            let (x, y) = mine(&data[1].0, &data[1].1)?;
            let failed = fsdp.forward_backward(&x, &y, |o, y| match rank {
                0 => candle_core::bail!("the loss failed"),
                _ => loss::cross_entropy(o, y),
            });
            anyhow::ensure!(failed.is_err(), "rank {rank}: the step succeeded");
            Ok(identical(&before, &snapshot(&varmap)))
        });
        for (rank, outcome) in outcomes.into_iter().enumerate() {
            assert!(outcome.unwrap(), "rank {rank}: the buffers moved");
        }
    });
}

/// bf16 compute with a weight tied across units (the language model's
/// embedding and head) and gradient accumulation under `no_sync`: each
/// use's gradient and each micro-batch's are added in f32, as DDP's mixed
/// precision adds them, so the weights are DDP's bytes, with an f32 or a
/// bf16 reduction.
#[test]
fn mixed_precision_with_a_tied_weight_and_no_sync_trains_to_the_bytes_of_ddp() {
    use candle_dp::precision::MixedPrecision;
    within(240, || {
        let init = init_gpt();
        let data = tokens(4, 4, 251);
        for policy in [
            MixedPrecision::bf16(),
            MixedPrecision::bf16().reduce_dtype(DType::BF16),
        ] {
            let (ddp, fsdp) =
                mixed_precision_runs(&policy, &init, &data, (gpt_whole, gpt_units), 2);
            assert!(!identical(&fsdp[0].0, &init));
            for rank in 0..2 {
                assert!(
                    identical(&fsdp[rank].0, &ddp[rank]),
                    "{policy:?}, rank {rank}: {}",
                    diff_report(&fsdp[rank].0, &ddp[rank])
                );
            }
        }
    });
}

/// `prefetch` orders a step's collectives (the gather of the unit before
/// comes ahead of the reduce-scatter after the unit): ranks that differ on
/// it would issue them in two orders, so they are refused at construction.
#[test]
fn ranks_that_differ_on_prefetch_are_refused_naming_the_rank() {
    within(60, || {
        let mismatches = mismatch_on_every_rank(|rank| {
            let config = FsdpConfig {
                prefetch: rank == 0,
                ..Default::default()
            };
            (deep_units(), config)
        });
        for (me, (rank, detail)) in mismatches.into_iter().enumerate() {
            assert_eq!(rank, 1, "rank {me}: {detail}");
            assert!(detail.contains("prefetch"), "rank {me}: {detail}");
        }
    });
}
