//! Whole-run checkpoints: what a state holds, which one is found after a
//! crash (damaged and partial ones skipped), how many are kept, and ranks
//! that would resume from different states.
// Closures here return `candle_dp::Result` as the API requires.
#![allow(clippy::result_large_err)]

use crate::common;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use candle_core::{DType, Device, Tensor};
use candle_dp::comm::GroupOptions;
use candle_dp::launch::spawn_with;
use candle_dp::optim::{AdamW, AdamWConfig, GradScalerState, LrScheduler, StatefulOptimizer};
use candle_dp::sampler::DistributedSampler;
use candle_dp::training_state::{
    check_ranks_agree, Progress, SamplerState, StateDir, TrainingState,
};
use candle_dp::Error;
use candle_nn::{batch_norm, linear, Optimizer, VarBuilder, VarMap};
use common::*;

/// A fresh, empty directory under the system's temporary one.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("candle_dp_states_{name}_{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// A model with a buffer (BatchNorm), its variables seeded.
fn model() -> VarMap {
    candle_dp::seeded_varmap(7, DType::F32, &Device::Cpu, |vb: VarBuilder| {
        linear(3, 4, vb.pp("l"))?;
        batch_norm(4, 1e-5, vb.pp("bn"))?;
        Ok(())
    })
    .unwrap()
}

/// One AdamW step on every parameter (buffers get no gradient).
fn trained(varmap: &VarMap) -> AdamW {
    let mut opt = AdamW::from_varmap(varmap, AdamWConfig::default()).unwrap();
    let data = varmap.data().lock().unwrap();
    let loss = data["l.weight"].as_tensor().sum_all().unwrap();
    drop(data);
    opt.backward_step(&loss).unwrap();
    opt
}

fn state_at(step: u64, opt: &AdamW) -> TrainingState {
    TrainingState {
        progress: Progress {
            epoch: step / 10,
            batch: step % 10,
            step,
        },
        optimizer: Some(opt.state().unwrap()),
        sampler: Some(SamplerState {
            seed: 9,
            epoch: step / 10,
        }),
        lr_scheduler: Some(schedule_after(step).state()),
        grad_scaler: Some(GradScalerState {
            scale: 3.0 * 2f32.powi(-(step as i32 % 20)),
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2000,
            growth_tracker: step % 7,
        }),
        metadata: BTreeMap::from([("run".to_string(), "test".to_string())]),
    }
}

/// Warm-up then cosine, after `steps` steps: rates no decimal writes short.
fn schedule_after(steps: u64) -> LrScheduler {
    let warmup = LrScheduler::linear(3e-3, 0.1, 1.0, 5).unwrap();
    let cosine = LrScheduler::cosine_annealing(3e-3, 40, 1e-5).unwrap();
    let mut schedule = LrScheduler::sequential(3e-3, vec![warmup, cosine], vec![5]).unwrap();
    for _ in 0..steps {
        schedule.step().unwrap();
    }
    schedule
}

fn bytes(varmap: &VarMap) -> BTreeMap<String, Vec<f32>> {
    varmap
        .data()
        .lock()
        .unwrap()
        .iter()
        .map(|(n, v)| {
            (
                n.clone(),
                v.as_tensor().flatten_all().unwrap().to_vec1().unwrap(),
            )
        })
        .collect()
}

#[test]
fn a_saved_state_restores_the_model_buffers_optimizer_progress_and_sampler() {
    let dir = scratch("roundtrip");
    let states = StateDir::new(&dir).unwrap();
    assert!(
        states.latest().unwrap().is_none(),
        "an empty directory has no state"
    );
    let varmap = model();
    // A buffer away from its initial value: buffers are saved too.
    varmap.data().lock().unwrap()["bn.running_mean"]
        .set(&Tensor::new(&[0.5f32, -1., 2., 3.], &Device::Cpu).unwrap())
        .unwrap();
    let opt = trained(&varmap);
    states.save(&varmap, &state_at(23, &opt)).unwrap();

    let fresh = model();
    let mut resumed = AdamW::from_varmap(&fresh, AdamWConfig::default()).unwrap();
    let saved = states.latest().unwrap().unwrap();
    saved.restore(&fresh, Some(&mut resumed)).unwrap();
    assert_eq!(bytes(&fresh), bytes(&varmap));
    assert_eq!(
        format!(
            "{:?}",
            resumed.state().unwrap().tensors.keys().collect::<Vec<_>>()
        ),
        format!(
            "{:?}",
            opt.state().unwrap().tensors.keys().collect::<Vec<_>>()
        )
    );
    assert_eq!(resumed.state().unwrap().steps, 1);
    let s = &saved.state;
    assert_eq!(
        s.progress,
        Progress {
            epoch: 2,
            batch: 3,
            step: 23
        }
    );
    assert_eq!(s.metadata["run"], "test");
    // The schedule and the scaler come back to the bit.
    let written = state_at(23, &opt);
    assert_eq!(s.lr_scheduler, written.lr_scheduler);
    assert_eq!(s.grad_scaler, written.grad_scaler);
    let mut schedule = schedule_after(0);
    schedule
        .load_state(s.lr_scheduler.as_ref().unwrap())
        .unwrap();
    let (mut a, mut b) = (schedule, schedule_after(23));
    for _ in 0..30 {
        assert_eq!(a.lr().to_bits(), b.lr().to_bits());
        a.step().unwrap();
        b.step().unwrap();
    }
    let mut sampler = DistributedSampler::new(10, 2, 1).unwrap().seed(9);
    s.sampler.unwrap().apply_to(&mut sampler).unwrap();
    assert_eq!(sampler.epoch(), 2);
    let mut other_seed = DistributedSampler::new(10, 2, 1).unwrap().seed(8);
    let err = s.sampler.unwrap().apply_to(&mut other_seed).unwrap_err();
    assert!(
        err.to_string().contains("saved with sampler seed 9"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_newest_complete_state_is_found_and_damaged_or_partial_ones_are_skipped() {
    let dir = scratch("damaged");
    let states = StateDir::new(&dir).unwrap().keep(5);
    let varmap = model();
    let opt = trained(&varmap);
    let mut paths = Vec::new();
    for step in [10, 20, 30] {
        paths.push(states.save(&varmap, &state_at(step, &opt)).unwrap());
    }
    assert_eq!(states.latest().unwrap().unwrap().state.progress.step, 30);

    // One byte of the newest model flipped: skipped, the one before is used.
    let model_file = paths[2].join("model.safetensors");
    let mut data = std::fs::read(&model_file).unwrap();
    let last = data.len() - 1;
    data[last] ^= 0x40;
    std::fs::write(&model_file, data).unwrap();
    assert_eq!(states.latest().unwrap().unwrap().state.progress.step, 20);

    // A save that stopped before its manifest: skipped too.
    std::fs::remove_file(paths[1].join("MANIFEST.json")).unwrap();
    assert_eq!(states.latest().unwrap().unwrap().state.progress.step, 10);

    // A truncated optimizer file.
    let opt_file = paths[0].join("optimizer.safetensors");
    let len = std::fs::metadata(&opt_file).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&opt_file)
        .unwrap()
        .set_len(len / 2)
        .unwrap();
    assert!(states.latest().unwrap().is_none(), "no state checks out");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn only_the_newest_states_are_kept_and_crashed_saves_are_cleared() {
    let dir = scratch("keep");
    let states = StateDir::new(&dir).unwrap().keep(2);
    let varmap = model();
    let opt = trained(&varmap);
    // What a save killed midway leaves: a temporary folder, named with the
    // process that wrote it (here one that cannot exist: pids are below
    // 2^22 on Linux).
    std::fs::create_dir_all(dir.join(".tmp-state-000000000099-4294967295-0")).unwrap();
    // Another process's save in progress (this test's parent, alive) is
    // left alone.
    let parent = format!(
        ".tmp-state-000000000098-{}-0",
        std::os::unix::process::parent_id()
    );
    std::fs::create_dir_all(dir.join(&parent)).unwrap();
    for step in 1..=5 {
        states.save(&varmap, &state_at(step, &opt)).unwrap();
    }
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    assert_eq!(names.len(), 3, "{names:?}");
    assert_eq!(names[0], parent, "{names:?}");
    std::fs::remove_dir_all(dir.join(&parent)).unwrap();
    names.remove(0);
    assert!(names[0].starts_with("state-000000000004-"), "{names:?}");
    assert!(names[1].starts_with("state-000000000005-"), "{names:?}");
    // Saving the same step again (a resumed run) makes a newer state.
    states.save(&varmap, &state_at(5, &opt)).unwrap();
    let latest = states.latest().unwrap().unwrap();
    let latest_name = latest
        .path
        .file_name()
        .unwrap()
        .to_str()
        .unwrap()
        .to_string();
    assert!(
        latest_name.starts_with("state-000000000005-"),
        "{latest_name}"
    );
    assert_ne!(
        latest_name, names[1],
        "a new folder, not the old one rewritten"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The step of each state left in `dir`, in the order of their folders'
/// save numbers.
fn steps_left(dir: &std::path::Path) -> Vec<u64> {
    let mut states: Vec<(u64, u64)> = std::fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| {
            let name = e.unwrap().file_name().into_string().unwrap();
            let (step, n) = name.strip_prefix("state-")?.split_once('-')?;
            Some((n.parse().unwrap(), step.parse().unwrap()))
        })
        .collect();
    states.sort();
    states.into_iter().map(|(_, step)| step).collect()
}

#[test]
fn a_save_of_an_earlier_step_is_the_newest_state_and_is_never_pruned() {
    let dir = scratch("rollback");
    let varmap = model();
    let opt = trained(&varmap);

    // keep(1): step 30, then step 10 (a rollback, or a restart in the same
    // folder). The state just written survives its own save.
    let one = StateDir::new(&dir).unwrap().keep(1);
    one.save(&varmap, &state_at(30, &opt)).unwrap();
    let written = one.save(&varmap, &state_at(10, &opt)).unwrap();
    assert!(
        written.join("MANIFEST.json").exists(),
        "{written:?} was pruned"
    );
    assert_eq!(steps_left(&dir), [10]);
    let latest = one.latest().unwrap().unwrap();
    assert_eq!(
        (latest.path.as_path(), latest.state.progress.step),
        (written.as_path(), 10)
    );

    // keep(2): the states saved last stay, whatever their steps; `latest`
    // and `at_step` follow the order of the saves.
    let two = StateDir::new(&dir).unwrap().keep(2);
    two.save(&varmap, &state_at(50, &opt)).unwrap();
    two.save(&varmap, &state_at(20, &opt)).unwrap();
    assert_eq!(steps_left(&dir), [50, 20]);
    assert_eq!(two.latest().unwrap().unwrap().state.progress.step, 20);
    let again = two.save(&varmap, &state_at(50, &opt)).unwrap();
    assert_eq!(steps_left(&dir), [20, 50]);
    assert_eq!(two.at_step(50).unwrap().unwrap().path, again);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn saves_from_two_threads_into_one_directory_never_lose_every_state() {
    let dir = scratch("two_writers");
    let varmap = model();
    let opt = trained(&varmap);
    let states = StateDir::new(&dir).unwrap().keep(1);
    within(120, move || {
        std::thread::scope(|s| {
            for writer in 0..2u64 {
                let (states, varmap, opt) = (&states, &varmap, &opt);
                s.spawn(move || {
                    for k in 0..10 {
                        states
                            .save(varmap, &state_at(100 * writer + k, opt))
                            .unwrap();
                    }
                });
            }
        });
        assert_eq!(steps_left(states.path()).len(), 1, "keep(1) keeps one");
        assert!(states.latest().unwrap().is_some());
        std::fs::remove_dir_all(states.path()).unwrap();
    });
}

#[test]
fn a_restore_that_does_not_fit_changes_neither_the_model_nor_the_optimizer() {
    let dir = scratch("misfit");
    let states = StateDir::new(&dir).unwrap();
    let varmap = model();
    let opt = trained(&varmap);
    states.save(&varmap, &state_at(1, &opt)).unwrap();

    // Another model: the same parameter names for the optimizer, a
    // variable of another shape.
    let other = candle_dp::seeded_varmap(7, DType::F32, &Device::Cpu, |vb: VarBuilder| {
        linear(3, 4, vb.pp("l"))?;
        batch_norm(5, 1e-5, vb.pp("bn"))?;
        Ok(())
    })
    .unwrap();
    let mut fresh = AdamW::from_varmap(&other, AdamWConfig::default()).unwrap();
    let before = bytes(&other);
    let err = states
        .latest()
        .unwrap()
        .unwrap()
        .restore(&other, Some(&mut fresh))
        .unwrap_err();
    assert!(
        matches!(err, Error::Checkpoint(_) | Error::OptimizerState(_)),
        "{err}"
    );
    assert_eq!(bytes(&other), before);
    assert!(
        fresh.state().unwrap().tensors.is_empty(),
        "the optimizer kept its own state"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn ranks_that_would_resume_from_different_states_fail_naming_the_rank() {
    let options = GroupOptions {
        timeout: Some(Duration::from_secs(20)),
        ..Default::default()
    };
    let first = options.clone();
    let results = within(60, move || {
        spawn_with(3, first, |ctx| {
            let step = if ctx.rank == 2 { None } else { Some(40) };
            Ok(check_ranks_agree(ctx.pg.as_ref(), step).map_err(|e| e.to_string()))
        })
        .unwrap()
    });
    for (rank, result) in results.iter().enumerate() {
        let err = result.as_ref().unwrap_err();
        assert!(
            err.contains("rank 2 would resume from scratch (no state found), rank 0 from the state of step 40"),
            "rank {rank}: {err}"
        );
    }
    let agreed = within(60, move || {
        spawn_with(2, options, |ctx| {
            Ok(check_ranks_agree(ctx.pg.as_ref(), Some(7)).is_ok())
        })
        .unwrap()
    });
    assert_eq!(agreed, [true, true]);
}

/// Shards saved beside the states that name them: listed by step, pruned
/// to the steps still named, and the newest state whose shards are all
/// there found when a kill left the newest without them.
#[test]
fn shard_folders_are_pruned_to_the_named_steps_and_the_newest_whole_state_is_found() {
    let root = std::env::temp_dir().join(format!("candle_dp_retain_{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let varmap = model();
    let opt = trained(&varmap);
    let shards = StateDir::new(root.join("shards")).unwrap().keep(usize::MAX);
    for step in [2, 4, 6, 8] {
        shards.save(&varmap, &state_at(step, &opt)).unwrap();
    }
    assert_eq!(shards.steps().unwrap(), vec![8, 6, 4, 2]);
    // The states kept elsewhere name steps 4 and 8: 2 and 6 go.
    assert_eq!(shards.retain_steps(|s| s == 4 || s == 8).unwrap(), 2);
    assert_eq!(shards.steps().unwrap(), vec![8, 4]);
    // The newest state accepted: 8 is refused (its shards "missing"), 4 is taken.
    let found = shards
        .latest_where(|saved| saved.state.progress.step != 8)
        .unwrap()
        .unwrap();
    assert_eq!(found.state.progress.step, 4);
    assert!(shards.latest_where(|_| false).unwrap().is_none());
    let _ = std::fs::remove_dir_all(&root);
}

/// JSON has no NaN nor infinity (serde would write `null`, which the
/// resume then takes for damage and skips for an older state): a state
/// holding such a number is refused at save, naming the field, and
/// nothing is written.
#[test]
fn a_state_holding_a_number_that_is_not_finite_is_refused_at_save_naming_the_field() {
    let dir = scratch("not_finite");
    let varmap = model();
    let opt = trained(&varmap);
    let states = StateDir::new(&dir).unwrap();
    let mut overflowed = state_at(3, &opt);
    if let Some(schedule) = overflowed.lr_scheduler.as_mut() {
        schedule.children[1].lr = f64::INFINITY;
    }
    let mut nan_setting = state_at(3, &opt);
    if let Some(optimizer) = nan_setting.optimizer.as_mut() {
        optimizer.settings.insert("weight_decay".into(), f64::NAN);
    }
    let mut scale = state_at(3, &opt);
    if let Some(scaler) = scale.grad_scaler.as_mut() {
        scaler.scale = f32::INFINITY;
    }
    for (state, field) in [
        (overflowed, "lr_scheduler.children[1].lr"),
        (nan_setting, "`weight_decay`"),
        (scale, "`scale`"),
    ] {
        let err = states.save(&varmap, &state).expect_err(field);
        assert!(matches!(err, Error::Checkpoint(_)), "{err}");
        assert!(err.to_string().contains(field), "{err}");
        assert!(
            states.latest().unwrap().is_none(),
            "{field}: a state was written"
        );
    }
    let entries = std::fs::read_dir(&dir).unwrap().count();
    assert_eq!(entries, 0, "nothing left behind");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Every finite setting and rate loads back to the bit, whatever its
/// decimal form (serde_json's exact float parsing).
#[test]
fn settings_and_rates_of_any_finite_value_load_back_to_the_bit() {
    let dir = scratch("round_trip");
    let varmap = model();
    let opt = trained(&varmap);
    let states = StateDir::new(&dir).unwrap();
    let mut state = state_at(3, &opt);
    let values: Vec<f64> = killing::fractions(17, 400)
        .into_iter()
        .enumerate()
        .map(|(i, f)| f * 10f64.powi(i as i32 % 40 - 20))
        .chain([f64::MIN_POSITIVE, f64::MAX, 5e-324, 0.1 + 0.2, 1.0 / 3.0])
        .collect();
    if let Some(optimizer) = state.optimizer.as_mut() {
        for (i, &value) in values.iter().enumerate() {
            optimizer.settings.insert(format!("probe{i:03}"), value);
        }
    }
    states.save(&varmap, &state).unwrap();
    let loaded = states.latest().unwrap().expect("the state");
    let settings = &loaded.state.optimizer.as_ref().unwrap().settings;
    for (i, &value) in values.iter().enumerate() {
        let back = settings[&format!("probe{i:03}")];
        assert_eq!(
            back.to_bits(),
            value.to_bits(),
            "{value:e} came back as {back:e}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}
