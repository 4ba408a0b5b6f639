//! Deterministic training: the same bits on any number of thread ranks
//! (issue 74), not the same without the setting, and the refusals.

use candle_dp::fabric::{DataOptions, Fabric, FabricConfig, Strategy};
use candle_nn::loss;

use crate::common::fabric_loop::{
    classifier, dataset, deterministic_config, setup, split_batches, train_chunked,
    train_chunked_resumable, Trained, CHUNKED_BATCH as BATCH, CHUNKED_EPOCHS as EPOCHS, CHUNKS,
};
use crate::common::{identical, max_rel_diff, within};

/// 30 steps on `ranks` thread ranks; every rank's losses must be the
/// global batch's.
fn trained(strategy: Strategy, ranks: usize, deterministic: Option<usize>) -> Trained {
    trained_with(deterministic_config(strategy, ranks, deterministic))
}

/// [`trained`] of `config`.
fn trained_with(config: FabricConfig) -> Trained {
    let (strategy, ranks, deterministic) = (config.strategy, config.ranks(), config.deterministic);
    let data = dataset();
    let mut runs = Fabric::launch(config, move |fabric| {
        train_chunked(fabric, data.clone(), deterministic.is_some())
    })
    .unwrap_or_else(|e| panic!("{strategy} on {ranks}: {e}"));
    let first = runs.remove(0);
    for (rank, run) in runs.iter().enumerate() {
        assert_eq!(run.1, first.1, "rank {}'s losses", rank + 1);
    }
    first
}

#[test]
fn deterministic_training_gives_one_devices_bits_on_1_to_8_ranks_of_dp_ddp_zero_fsdp_and_hsdp() {
    let one = within(600, || trained(Strategy::Single, 1, Some(CHUNKS)));
    assert_eq!(one.1.len(), EPOCHS as usize);
    for strategy in [
        Strategy::Ddp,
        Strategy::DdpOverlap,
        Strategy::Zero1,
        Strategy::Zero2,
        Strategy::Fsdp,
        Strategy::Hsdp,
    ] {
        for ranks in [1, 2, 3, 4, 6, 8] {
            let run = within(600, move || trained(strategy, ranks, Some(CHUNKS)));
            assert_eq!(run.1, one.1, "{strategy} on {ranks}: losses");
            assert!(identical(&run.0, &one.0), "{strategy} on {ranks}: weights");
        }
    }
    // dp: the replicas of one process, each chunk on the first.
    for replicas in [2, 3] {
        let run = within(600, move || trained(Strategy::Dp, replicas, Some(CHUNKS)));
        assert_eq!(run.1, one.1, "dp on {replicas}: losses");
        assert!(identical(&run.0, &one.0), "dp on {replicas}: weights");
    }
    // HSDP of shard groups of 2, replicated 2, 3 and 4 times.
    for ranks in [4, 6, 8] {
        let config = FabricConfig {
            shard_size: Some(2),
            ..deterministic_config(Strategy::Hsdp, ranks, Some(CHUNKS))
        };
        let run = within(600, move || trained_with(config));
        assert_eq!(run.1, one.1, "hsdp 2 x {}: losses", ranks / 2);
        assert!(identical(&run.0, &one.0), "hsdp 2 x {}: weights", ranks / 2);
    }
}

#[test]
fn without_the_setting_ranks_differ_from_one_device_in_the_last_bits() {
    // The test above could not fail if every world size summed alike
    // anyway: without the setting, some do not (within rounding).
    let one = trained(Strategy::Single, 1, None);
    let mut differ = 0;
    for ranks in [2, 3, 4] {
        let run = trained(Strategy::Ddp, ranks, None);
        assert!(max_rel_diff(&run.0, &one.0) < 1e-4, "ddp on {ranks}");
        differ += usize::from(!identical(&run.0, &one.0));
    }
    assert!(
        differ > 0,
        "every world size gave one device's bits without the setting"
    );
}

fn refused(config: FabricConfig) -> String {
    Fabric::launch(config, |fabric| {
        let model = fabric.setup(classifier(), |p| {
            candle_dp::optim::Sgd::new_named(p, Default::default())
        })?;
        let data = dataset();
        let mut loader = fabric.setup_dataloader(data, BATCH, DataOptions::default())?;
        let _ = (&model, loader.iter()?);
        loader.set_epoch(0);
        Ok(())
    })
    .unwrap_err()
    .to_string()
}

#[test]
fn chunks_ranks_strategies_and_shardings_that_do_not_fit_are_refused_naming_them() {
    // Bounded: a rank that waits past 60 s fails the run.
    let with = |strategy, ranks, chunks| FabricConfig {
        deterministic: Some(chunks),
        timeout_secs: Some(60.0),
        ..FabricConfig::new(strategy, ranks)
    };
    let cases = [
        (
            with(Strategy::Ddp, 4, 6),
            "6 chunks a batch do not split over 4 ranks",
        ),
        (with(Strategy::Ddp, 2, 0), "at least 1 chunk"),
        (
            with(Strategy::PipelineRanks, 4, 4),
            "built for single, dp, ddp, ddp-overlap, zero1, zero2, fsdp and hsdp",
        ),
        (with(Strategy::PipelineDdp, 4, 4), "strategy pipeline-ddp"),
        // The loader of DistributedSampler's interleaved rows.
        (with(Strategy::Ddp, 2, 4), "split_batches: true"),
    ];
    for (config, why) in cases {
        let error = refused(config);
        assert!(error.contains(why), "{why}: {error}");
    }
    let tp = FabricConfig {
        deterministic: Some(4),
        ..FabricConfig::default()
            .with_mesh("dp_replicate=2,tp=2".parse().unwrap())
            .unwrap()
    };
    assert!(tp.check().unwrap_err().to_string().contains("tp above 1"));
}

#[test]
fn a_batch_the_chunks_do_not_cut_is_refused_naming_rows_and_chunks() {
    let config = FabricConfig {
        deterministic: Some(8),
        timeout_secs: Some(60.0),
        ..FabricConfig::new(Strategy::Ddp, 2)
    };
    let errors = Fabric::launch(config, |fabric| {
        let data = dataset();
        let loader = fabric.setup_dataloader(data, 12, split_batches());
        let loader_error = loader.unwrap_err().to_string();
        let mut model = setup(&fabric)?;
        // A batch of 6 rows on each rank: 6 does not cut into 4 chunks.
        let x = candle_core::Tensor::zeros((6, 6), candle_core::DType::F32, fabric.device())?;
        let y = candle_core::Tensor::zeros(6, candle_core::DType::U32, fabric.device())?;
        let step_error = model.backward(&x, &y, loss::cross_entropy).unwrap_err();
        Ok((loader_error, step_error.to_string()))
    })
    .unwrap();
    let (loader, step) = &errors[1];
    assert!(
        loader.contains("global batch of 12 rows does not cut into 8 chunks"),
        "{loader}"
    );
    assert!(
        step.contains("rank 1's batch of 6 rows does not cut into its 4 of the 8"),
        "{step}"
    );
}

#[test]
fn a_model_with_batch_statistics_is_refused_naming_the_buffer() {
    use candle_dp::fabric::ModelRecipe;
    let config = FabricConfig {
        deterministic: Some(2),
        timeout_secs: Some(60.0),
        ..FabricConfig::new(Strategy::Ddp, 2)
    };
    let error = Fabric::launch(config, |fabric| {
        let recipe = ModelRecipe::module(|vb| {
            candle_nn::batch_norm(6, candle_nn::BatchNormConfig::default(), vb.pp("bn"))
        });
        fabric.setup(recipe, |p| {
            candle_dp::optim::Sgd::new_named(p, Default::default())
        })?;
        Ok(())
    })
    .unwrap_err()
    .to_string();
    assert!(error.contains("`bn.running_mean`"), "{error}");
}

/// `strategy` on `ranks`, deterministic, its states in `dir`: from the
/// newest state there, stopping after step `stop_at` if given.
fn resumed(
    strategy: Strategy,
    ranks: usize,
    dir: &std::path::Path,
    stop_at: Option<u64>,
) -> Trained {
    let config = FabricConfig {
        checkpoint_dir: Some(dir.to_path_buf()),
        ..deterministic_config(strategy, ranks, Some(CHUNKS))
    };
    let data = dataset();
    Fabric::launch(config, move |fabric| {
        train_chunked_resumable(fabric, data.clone(), stop_at)
    })
    .unwrap_or_else(|e| panic!("{strategy} on {ranks}: {e}"))
    .remove(0)
}

#[test]
fn a_state_saved_on_4_ranks_resumes_on_4_2_or_1_to_the_uninterrupted_runs_bits() {
    let one = within(600, || trained(Strategy::Single, 1, Some(CHUNKS)));
    let cases = [
        (Strategy::Ddp, Strategy::Ddp, 2),
        (Strategy::Ddp, Strategy::Single, 1),
        (Strategy::Ddp, Strategy::Ddp, 4),
        (Strategy::Zero2, Strategy::Zero2, 2),
        (Strategy::Zero1, Strategy::Zero1, 1),
        (Strategy::Fsdp, Strategy::Fsdp, 2),
        (Strategy::Hsdp, Strategy::Fsdp, 1),
    ];
    for (saved_by, resumed_by, ranks) in cases {
        let what = format!("{saved_by} x4 resumed by {resumed_by} x{ranks}");
        let dir = std::env::temp_dir().join(format!(
            "candle-dp-deterministic-{}-{saved_by}-{resumed_by}-{ranks}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        let first = resumed(saved_by, 4, &dir, Some(11));
        let rest = resumed(resumed_by, ranks, &dir, None);
        assert_eq!(first.1, one.1[..11], "{what}: the first losses");
        assert_eq!(rest.1, one.1[11..], "{what}: the resumed losses");
        assert!(identical(&rest.0, &one.0), "{what}: the weights");
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// The language model with dropout on, deterministic over 8 chunks: its
/// losses and whole weights on `ranks` thread ranks of `strategy`.
fn lm_run(
    strategy: Strategy,
    ranks: usize,
) -> (
    Vec<f32>,
    std::collections::HashMap<String, candle_core::Tensor>,
) {
    use crate::common::gpt_loop::{adamw_run_of, GPT};
    let gpt = crate::example_gpt::GptConfig {
        dropout: 0.1,
        ..GPT
    };
    let config = FabricConfig {
        gradient_clip: Some(1.0),
        ..deterministic_config(strategy, ranks, Some(8))
    };
    let mut runs = Fabric::launch(config, move |fabric| {
        let run = adamw_run_of(&fabric, gpt, 30)?;
        Ok((run.losses, run.weights))
    })
    .unwrap_or_else(|e| panic!("{strategy} on {ranks}: {e}"));
    let first = runs.remove(0);
    for (rank, run) in runs.iter().enumerate() {
        assert_eq!(
            run.0,
            first.0,
            "{strategy} on {ranks}: rank {}'s losses",
            rank + 1
        );
    }
    first
}

#[test]
fn the_language_model_with_dropout_keeps_one_devices_bits_on_1_2_4_and_8_ranks() {
    let one = within(600, || lm_run(Strategy::Single, 1));
    for strategy in [
        Strategy::Dp,
        Strategy::Ddp,
        Strategy::Zero1,
        Strategy::Zero2,
        Strategy::Fsdp,
        Strategy::Hsdp,
    ] {
        for ranks in [1, 2, 4, 8] {
            let run = within(600, move || lm_run(strategy, ranks));
            assert_eq!(run.0, one.0, "{strategy} on {ranks}: losses");
            assert!(identical(&run.1, &one.1), "{strategy} on {ranks}: weights");
        }
    }
    // Dropout is on: without it the losses differ.
    let without = within(600, || {
        let config = FabricConfig {
            gradient_clip: Some(1.0),
            ..deterministic_config(Strategy::Single, 1, Some(8))
        };
        Fabric::launch(config, |fabric| {
            Ok(crate::common::gpt_loop::adamw_run(&fabric, 30)?.losses)
        })
        .unwrap()
        .remove(0)
    });
    assert_ne!(without, one.0, "dropout changed nothing");
}

#[test]
fn a_rank_whose_chunks_fail_fails_every_ranks_step_within_the_timeout() {
    let config = FabricConfig {
        timeout_secs: Some(30.0),
        ..deterministic_config(Strategy::Ddp, 2, Some(4))
    };
    let errors = within(120, move || {
        Fabric::launch(config, |fabric| {
            let mut model = setup(&fabric)?;
            let before = model.full_state()?;
            // Rank 1's share of 5 rows does not cut into its 2 chunks.
            let rows = if fabric.rank() == 1 { 5 } else { 4 };
            let x =
                candle_core::Tensor::zeros((rows, 6), candle_core::DType::F32, fabric.device())?;
            let y = candle_core::Tensor::zeros(rows, candle_core::DType::U32, fabric.device())?;
            let error = model.backward(&x, &y, loss::cross_entropy).unwrap_err();
            anyhow::ensure!(model.step().is_err(), "a step after the failed backward");
            anyhow::ensure!(
                identical(&model.full_state()?, &before),
                "the weights moved"
            );
            Ok(error.to_string())
        })
        .unwrap()
    });
    assert!(
        errors[1].contains("rank 1's batch of 5 rows"),
        "{}",
        errors[1]
    );
    assert!(
        errors[0].contains("rank 1 failed its chunks"),
        "{}",
        errors[0]
    );
}

#[test]
fn the_global_loader_gives_each_rank_its_share_of_the_global_batch() {
    let config = FabricConfig {
        timeout_secs: Some(60.0),
        ..FabricConfig::new(Strategy::Ddp, 2)
    };
    let rows = Fabric::launch(config, |fabric| {
        let mut seen = Vec::new();
        for options in [DataOptions::default(), split_batches()] {
            let loader = fabric.setup_global_dataloader(dataset(), 12, options)?;
            let first = loader.iter()?.next().expect("a batch")?;
            seen.push(first[0].dim(0)?);
        }
        Ok(seen)
    })
    .unwrap();
    assert_eq!(rows[0], [6, 6]);
}
