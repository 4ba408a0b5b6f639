//! Parameter groups (PyTorch's `param_groups`) on the crate's SGD, Adam and
//! AdamW: against real PyTorch (`tests/data/optim_groups_reference.json`,
//! made by `scripts/gen_optim_groups_reference.py`) under a schedule, their
//! state by group, and a state of other groups refused.
// `load_state` returns `candle_dp::Result`, as the API does.
#![allow(clippy::result_large_err)]

use std::collections::{BTreeMap, HashMap};

use candle_core::backprop::GradStore;
use candle_core::{Device, Tensor, Var};
use candle_dp::fabric::{DataOptions, Fabric, FabricConfig, Strategy};
use candle_dp::optim::{AdamW, AdamWConfig, LrScheduler, Sgd, SgdConfig, StatefulOptimizer};
use candle_nn::loss;

use super::optim::{Any, Settings};
use crate::common::fabric_loop::{classifier, dataset, EPOCHS, GLOBAL_BATCH};
use crate::common::{diff_report, max_rel_diff};

#[derive(serde::Deserialize)]
struct Fixture {
    torch: String,
    shapes: BTreeMap<String, Vec<usize>>,
    init: BTreeMap<String, Vec<f32>>,
    grads: Vec<BTreeMap<String, Vec<f32>>>,
    gamma: f64,
    runs: BTreeMap<String, Run>,
}

#[derive(serde::Deserialize)]
struct Run {
    kind: String,
    groups: Vec<Group>,
    #[serde(rename = "final")]
    last: BTreeMap<String, Vec<f32>>,
    lrs: Vec<Vec<f64>>,
    state: BTreeMap<String, Vec<f32>>,
}

#[derive(serde::Deserialize)]
struct Group {
    params: Vec<String>,
    settings: Settings,
}

fn fixture() -> Fixture {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/data/optim_groups_reference.json"
    );
    let fixture: Fixture = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
    assert!(fixture.torch.starts_with("2.15"), "{}", fixture.torch);
    fixture
}

impl Fixture {
    fn tensor(&self, name: &str, values: &[f32]) -> Tensor {
        Tensor::from_vec(values.to_vec(), self.shapes[name].as_slice(), &Device::Cpu).unwrap()
    }

    /// Fresh parameters at the initial values, by name.
    fn params(&self) -> Vec<(String, Var)> {
        self.init
            .iter()
            .map(|(n, v)| (n.clone(), Var::from_tensor(&self.tensor(n, v)).unwrap()))
            .collect()
    }

    fn grads(&self, step: usize, params: &[(String, Var)]) -> GradStore {
        let mut grads = GradStore::default();
        for (name, var) in params {
            if let Some(g) = self.grads[step].get(name) {
                grads.insert(var.as_tensor(), self.tensor(name, g));
            }
        }
        grads
    }
}

impl Run {
    fn group_of(&self) -> impl Fn(&str) -> usize + '_ {
        |name| {
            self.groups
                .iter()
                .position(|g| g.params.iter().any(|p| p == name))
                .unwrap()
        }
    }

    fn optimizer(&self, params: Vec<(String, Var)>) -> Any {
        let settings: Vec<&Settings> = self.groups.iter().map(|g| &g.settings).collect();
        Any::grouped(&self.kind, &settings, params, self.group_of()).unwrap()
    }
}

fn largest_rel_diff(got: &Tensor, want: &[f32]) -> f64 {
    let got = got.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    assert_eq!(got.len(), want.len());
    got.iter()
        .zip(want)
        .map(|(g, w)| f64::from((g - w).abs()) / f64::from(w.abs()).max(1e-3))
        .fold(0.0, f64::max)
}

/// Each group keeps its own settings, the schedule's factor scales each
/// group's initial rate (LambdaLR), and the state holds every group.
#[test]
fn groups_follow_pytorchs_param_groups_under_a_schedule() {
    let fx = fixture();
    for (name, run) in &fx.runs {
        let params = fx.params();
        let mut opt = run.optimizer(params.clone());
        let base = run.groups[0].settings["lr"].as_f64().unwrap();
        let gamma = fx.gamma;
        let mut schedule =
            LrScheduler::lambda(base, std::sync::Arc::new(move |s| gamma.powi(s as i32))).unwrap();
        for (step, want_lrs) in run.lrs.iter().enumerate() {
            opt.step(&fx.grads(step, &params));
            schedule.step().unwrap();
            opt.set_learning_rate(schedule.lr());
            let lrs = opt.group_lrs();
            for (g, (got, want)) in lrs.iter().zip(want_lrs).enumerate() {
                assert!(
                    ((got - want) / want).abs() <= 1e-12,
                    "{name}: step {step}, group {g}'s rate {got}, PyTorch's {want}"
                );
            }
        }
        for (param, var) in &params {
            let d = largest_rel_diff(var.as_tensor(), &run.last[param]);
            assert!(d <= 1e-6, "{name}: `{param}` differs by {d:e}");
        }
        let state = opt.state();
        for (key, want) in &run.state {
            let got = &state.tensors[key];
            let d = largest_rel_diff(&got.to_dtype(candle_core::DType::F32).unwrap(), want);
            assert!(d <= 1e-6, "{name}: state `{key}` differs by {d:e}");
        }
        assert_eq!(
            state.tensors.len(),
            run.state.len(),
            "{name}: state entries"
        );
    }
    assert_eq!(fx.runs.len(), 3);
}

/// A state of a grouped optimizer loads into a fresh one with the same
/// groups and continues bit for bit.
#[test]
fn a_grouped_state_resumes_bit_for_bit() {
    let fx = fixture();
    for (name, run) in &fx.runs {
        let params = fx.params();
        let mut opt = run.optimizer(params.clone());
        for step in 0..4 {
            opt.step(&fx.grads(step, &params));
            opt.set_learning_rate(0.5_f64.powi(step as i32 + 1) * 0.01);
        }
        let saved = opt.state();
        let copies: Vec<(String, Var)> = params
            .iter()
            .map(|(n, v)| {
                (
                    n.clone(),
                    Var::from_tensor(&v.as_tensor().copy().unwrap()).unwrap(),
                )
            })
            .collect();
        let mut resumed = run.optimizer(copies.clone());
        resumed.load_state(&saved).unwrap();
        assert_eq!(resumed.group_lrs(), opt.group_lrs(), "{name}: rates");
        for step in 4..fx.grads.len() {
            opt.step(&fx.grads(step, &params));
            resumed.step(&fx.grads(step, &copies));
        }
        for ((n, a), (_, b)) in params.iter().zip(&copies) {
            let (a, b) = (
                a.as_tensor()
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap(),
                b.as_tensor()
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap(),
            );
            assert_eq!(a, b, "{name}: `{n}` after the resume");
        }
    }
}

fn vars(names: &[&str]) -> Vec<(String, Var)> {
    names
        .iter()
        .map(|n| {
            (
                n.to_string(),
                Var::ones(3, candle_core::DType::F32, &Device::Cpu).unwrap(),
            )
        })
        .collect()
}

fn two_groups(params: Vec<(String, Var)>, bias_group: usize) -> AdamW {
    let decay = AdamWConfig {
        lr: 0.01,
        weight_decay: 0.1,
        ..Default::default()
    };
    let none = AdamWConfig {
        weight_decay: 0.0,
        ..decay
    };
    AdamW::with_groups(params, vec![decay, none], |n| {
        if n.ends_with("bias") {
            bias_group
        } else {
            1 - bias_group
        }
    })
    .unwrap()
}

/// PyTorch's `load_state_dict` refuses a state whose groups differ in
/// number or size; here the parameter in another group is named, and
/// nothing is loaded.
#[test]
fn a_state_of_other_groups_is_refused_naming_the_parameter_and_nothing_changes() {
    let names = ["l1.weight", "l1.bias"];
    let saved = {
        let params = vars(&names);
        let mut opt = two_groups(params.clone(), 1);
        let mut grads = GradStore::default();
        for (_, var) in &params {
            grads.insert(var.as_tensor(), var.as_tensor().ones_like().unwrap());
        }
        candle_nn::Optimizer::step(&mut opt, &grads).unwrap();
        opt.state().unwrap()
    };
    assert!(!saved.tensors.is_empty());
    // The bias in group 0, the weight in group 1: the other way round.
    let mut swapped = two_groups(vars(&names), 0);
    let error = swapped.load_state(&saved).unwrap_err().to_string();
    assert!(
        error.contains("`l1.weight` is in group 1 here, in group 0 in the state"),
        "{error}"
    );
    assert!(
        swapped.state().unwrap().tensors.is_empty(),
        "nothing loaded"
    );
    // One group where the state has two.
    let mut one = AdamW::new_named(vars(&names), AdamWConfig::default()).unwrap();
    let error = one.load_state(&saved).unwrap_err().to_string();
    assert!(
        error.contains("the state has 2 parameter group(s), this adam optimizer 1"),
        "{error}"
    );
    assert!(one.state().unwrap().tensors.is_empty(), "nothing loaded");
}

/// `param_groups` reports each group's parameters and settings; the
/// optimizer's rate is group 0's, and setting it scales every group alike.
#[test]
fn setting_the_rate_scales_every_group_by_group_zeros_factor() {
    let decay = SgdConfig {
        lr: 0.1,
        weight_decay: 0.01,
        ..Default::default()
    };
    let slow = SgdConfig { lr: 0.02, ..decay };
    let mut opt = Sgd::with_groups(vars(&["w", "b"]), vec![decay, slow], |n| {
        usize::from(n == "b")
    })
    .unwrap();
    candle_nn::Optimizer::set_learning_rate(&mut opt, 0.05);
    assert_eq!(candle_nn::Optimizer::learning_rate(&opt), 0.05);
    let groups = opt.param_groups();
    assert_eq!(groups[0].1, vec!["w".to_string()]);
    assert_eq!(groups[1].1, vec!["b".to_string()]);
    assert_eq!(groups[0].0.lr, 0.05);
    assert!((groups[1].0.lr - 0.01).abs() < 1e-15, "{}", groups[1].0.lr);
    assert_eq!(groups[1].0.weight_decay, 0.01);
}

/// Groups PyTorch would refuse, or that cannot be scheduled, are refused
/// at construction, naming the group or the parameter.
#[test]
fn groups_that_cannot_work_are_refused_naming_the_group_or_parameter() {
    let sgd = |configs: Vec<SgdConfig>, to: usize| {
        Sgd::with_groups(vars(&["a", "b"]), configs, move |n| {
            usize::from(n == "b") * to
        })
        .unwrap_err()
        .to_string()
    };
    let ok = SgdConfig {
        lr: 0.1,
        ..Default::default()
    };
    let error = sgd(vec![ok], 1);
    assert!(
        error.contains("`b` is put in group 1, but there are 1 group(s)"),
        "{error}"
    );
    let error = sgd(vec![], 0);
    assert!(error.contains("no parameter group"), "{error}");
    let bad = SgdConfig { lr: -1.0, ..ok };
    let error = sgd(vec![ok, bad], 1);
    assert!(
        error.contains("parameter group 1") && error.contains("lr -1"),
        "{error}"
    );
    let zero = SgdConfig { lr: 0.0, ..ok };
    let error = sgd(vec![zero, ok], 1);
    assert!(error.contains("group 0 has lr 0"), "{error}");
}

/// AdamW that decays the weights only (biases in a group of their own
/// without decay), with clipping across both groups, trained by the one
/// Fabric loop under `strategy`: every ZeRO and FSDP piece is stepped in
/// its parameter's group. With `dir`, the run resumes from the newest
/// state there and, at step `stop_at`, saves and stops. The final weights,
/// and the step it started from.
fn train_in_groups(
    strategy: Strategy,
    grouped: bool,
    dir: Option<&std::path::Path>,
    stop_at: Option<u64>,
) -> (HashMap<String, Tensor>, u64) {
    use candle_dp::training_state::Progress;
    let data = dataset();
    let devices = if strategy == Strategy::Single { 1 } else { 2 };
    let config = FabricConfig {
        gradient_clip: Some(0.5),
        timeout_secs: Some(120.0),
        checkpoint_dir: dir.map(Into::into),
        ..FabricConfig::new(strategy, devices)
    };
    let mut ranks = Fabric::launch(config, |fabric| -> anyhow::Result<_> {
        let decay = AdamWConfig {
            lr: 0.02,
            weight_decay: 0.5,
            ..Default::default()
        };
        let none = AdamWConfig {
            weight_decay: 0.0,
            ..decay
        };
        let mut model = fabric.setup(classifier(), |params| match grouped {
            true => AdamW::with_groups(params, vec![decay, none], |name| {
                usize::from(name.ends_with("bias"))
            }),
            false => AdamW::new_named(params, decay),
        })?;
        let from = match dir {
            Some(_) => model.load()?.map(|r| r.progress).unwrap_or_default(),
            None => Progress::default(),
        };
        let per_rank = GLOBAL_BATCH / fabric.world_size();
        let mut loader = fabric.setup_dataloader(data.clone(), per_rank, DataOptions::default())?;
        let mut step = from.step;
        for epoch in from.epoch..EPOCHS {
            loader.set_epoch(epoch);
            let skip = if epoch == from.epoch { from.batch } else { 0 };
            loader.skip_batches(skip as usize);
            for (index, batch) in (skip..).zip(loader.iter()?) {
                let batch = batch?;
                model.backward(&batch[0], &batch[1], loss::cross_entropy)?;
                model.step()?;
                step += 1;
                if stop_at == Some(step) {
                    model.save(Progress {
                        epoch,
                        batch: index + 1,
                        step,
                    })?;
                    return Ok((model.full_state()?, from.step));
                }
            }
        }
        Ok((model.full_state()?, from.step))
    })
    .unwrap_or_else(|e| panic!("{strategy}: {e}"));
    ranks.swap_remove(0)
}

#[test]
fn zero_and_fsdp_step_each_piece_in_its_parameters_group() {
    let single = train_in_groups(Strategy::Single, true, None, None).0;
    let ungrouped = train_in_groups(Strategy::Single, false, None, None).0;
    // The groups change the result: biases not decayed.
    let apart = max_rel_diff(&single, &ungrouped);
    assert!(apart > 1e-3, "groups made no difference ({apart:.1e})");
    for strategy in [
        Strategy::Dp,
        Strategy::Ddp,
        Strategy::Zero1,
        Strategy::Zero2,
        Strategy::Fsdp,
    ] {
        let trained = train_in_groups(strategy, true, None, None).0;
        let d = max_rel_diff(&trained, &single);
        println!("{strategy}: {d:.1e} from one device (groups change it by {apart:.1e})");
        assert!(
            d <= 1e-5,
            "{strategy}: {d:.1e} from one device\n{}",
            diff_report(&trained, &single)
        );
    }
}

/// A sharded state (ZeRO-2, FSDP) keeps its pieces' groups: stopped after
/// its save and resumed, the run ends at the uninterrupted run's bytes.
#[test]
fn a_grouped_sharded_state_resumes_to_the_same_bytes() {
    for strategy in [Strategy::Zero2, Strategy::Fsdp] {
        let whole = train_in_groups(strategy, true, None, None).0;
        let dir = std::env::temp_dir().join(format!(
            "candle-dp-groups-{}-{strategy}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        train_in_groups(strategy, true, Some(&dir), Some(3));
        let (resumed, from) = train_in_groups(strategy, true, Some(&dir), None);
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(
            from, 3,
            "{strategy}: resumed from step {from}, not the saved 3"
        );
        assert!(
            crate::common::identical(&resumed, &whole),
            "{strategy}: resumed run differs\n{}",
            diff_report(&resumed, &whole)
        );
    }
}
