//! Learning-rate schedules: real PyTorch's sequences
//! (`tests/data/lr_reference.json`), the chainable formulas against their
//! closed forms, the worked sequences of a warm-up into a cosine and of a
//! one-cycle schedule, exact resume, refusals, and the rate set on an
//! optimizer.

use std::sync::Arc;

use candle_core::{DType, Device, Var};
use candle_dp::optim::{LrScheduler, OneCycleConfig};
use candle_dp::Error;
use candle_nn::{Optimizer, SGD};

/// The rate before each of the first `steps` optimizer steps.
fn rates(mut schedule: LrScheduler, steps: usize) -> Vec<f64> {
    (0..steps)
        .map(|_| {
            let lr = schedule.lr();
            schedule.step().unwrap();
            lr
        })
        .collect()
}

/// `|a - b|` relative to `|b|`, absolute where `b` is 0.
fn rel(a: f64, b: f64) -> f64 {
    if b == 0.0 {
        a.abs()
    } else {
        ((a - b) / b).abs()
    }
}

fn assert_close(got: &[f64], want: &[f64], tolerance: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (k, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            rel(*g, *w) <= tolerance,
            "{what}, step {k}: {g} against {w} ({:.2e})",
            rel(*g, *w)
        );
    }
}

/// One case of `tests/data/lr_reference.json`.
#[derive(serde::Deserialize)]
struct Reference {
    args: std::collections::BTreeMap<String, f64>,
    lr: Vec<f64>,
    momentum: Vec<f64>,
}

#[test]
fn pytorchs_schedules_are_reproduced_to_1e_12_over_100_steps() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/data/lr_reference.json");
    #[derive(serde::Deserialize)]
    struct File {
        torch: String,
        cases: std::collections::BTreeMap<String, Reference>,
    }
    let file: File = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
    assert!(file.torch.starts_with("2.15"), "{}", file.torch);
    let mut worst = 0f64;
    for (name, case) in &file.cases {
        let a = |key: &str| case.args[key];
        let schedule = match name.as_str() {
            "cosine" => {
                LrScheduler::cosine_annealing(a("base_lr"), a("T_max") as u64, a("eta_min"))
            }
            "linear" => LrScheduler::linear(
                a("base_lr"),
                a("start_factor"),
                a("end_factor"),
                a("total_iters") as u64,
            ),
            "step" => LrScheduler::step_lr(a("base_lr"), a("step_size") as u64, a("gamma")),
            "exponential" => LrScheduler::exponential(a("base_lr"), a("gamma")),
            "one_cycle" => LrScheduler::one_cycle(
                a("max_lr"),
                a("total_steps") as u64,
                OneCycleConfig::default(),
            ),
            "warmup_cosine" => {
                let base = a("base_lr");
                let warm_up =
                    LrScheduler::linear(base, a("start_factor"), 1.0, a("total_iters") as u64)
                        .unwrap();
                let cosine =
                    LrScheduler::cosine_annealing(base, a("T_max") as u64, a("eta_min")).unwrap();
                LrScheduler::sequential(base, vec![warm_up, cosine], vec![a("milestone") as u64])
            }
            other => panic!("a case this test does not know: {other}"),
        }
        .unwrap();
        let mut schedule = schedule;
        for (step, (&lr, &momentum)) in case.lr.iter().zip(&case.momentum).enumerate() {
            let diff = rel(schedule.lr(), lr);
            worst = worst.max(diff);
            assert!(
                diff <= 1e-12,
                "{name}, step {step}: {} against PyTorch's {lr}",
                schedule.lr()
            );
            if let Some(m) = schedule.momentum() {
                assert!(
                    rel(m, momentum) <= 1e-12,
                    "{name}, step {step}: momentum {m} against {momentum}"
                );
            }
            schedule.step().unwrap();
        }
    }
    eprintln!("largest relative difference from PyTorch 2.15: {worst:.2e}");
}

#[test]
fn chainable_rates_follow_the_closed_forms_over_100_steps() {
    let pi = std::f64::consts::PI;
    let closed = |f: &dyn Fn(f64) -> f64| (0..100).map(|n| f(n as f64)).collect::<Vec<_>>();
    let cases: Vec<(LrScheduler, Vec<f64>, &str)> = vec![
        (
            // Past T_max the cosine rises again, as PyTorch's.
            LrScheduler::cosine_annealing(0.5, 30, 0.01).unwrap(),
            closed(&|n| 0.01 + (0.5 - 0.01) * (1.0 + (pi * n / 30.0).cos()) / 2.0),
            "cosine",
        ),
        (
            LrScheduler::linear(0.2, 1.0 / 3.0, 1.0, 5).unwrap(),
            closed(&|n| 0.2 * (1.0 / 3.0 + (1.0 - 1.0 / 3.0) * n.min(5.0) / 5.0)),
            "linear",
        ),
        (
            LrScheduler::step_lr(0.1, 7, 0.5).unwrap(),
            closed(&|n| 0.1 * 0.5f64.powf((n / 7.0).floor())),
            "step",
        ),
        (
            LrScheduler::exponential(0.1, 0.97).unwrap(),
            closed(&|n| 0.1 * 0.97f64.powf(n)),
            "exponential",
        ),
        (
            LrScheduler::lambda(0.3, Arc::new(|n| 1.0 / (1.0 + n as f64))).unwrap(),
            closed(&|n| 0.3 * (1.0 / (1.0 + n))),
            "lambda",
        ),
    ];
    for (schedule, want, what) in cases {
        // The recursive forms are running products: they drift from the
        // closed form by a few ulps a step, about 1e-13 over 100 steps.
        assert_close(&rates(schedule, 100), &want, 1e-12, what);
    }
}

#[test]
fn a_linear_warm_up_then_a_cosine_gives_pytorchs_sequence() {
    // PyTorch: SequentialLR([LinearLR(s=0.1, T=4), CosineAnnealingLR(T_max=6)],
    // milestones=[4]) at base rate 1.0 (its formulas evaluated by hand:
    // the cosine starts from its closed form at 0, the base rate).
    let warm_up = LrScheduler::linear(1.0, 0.1, 1.0, 4).unwrap();
    let cosine = LrScheduler::cosine_annealing(1.0, 6, 0.0).unwrap();
    let schedule = LrScheduler::sequential(1.0, vec![warm_up, cosine], vec![4]).unwrap();
    let want = [
        0.1,
        0.325,
        0.55,
        0.775,
        1.0,
        0.933_012_701_892_219_3,
        0.75,
        0.5,
        0.25,
        0.066_987_298_107_780_7,
        0.0,
        0.066_987_298_107_780_7,
    ];
    assert_close(&rates(schedule, 12), &want, 1e-12, "warm-up then cosine");
}

#[test]
fn one_cycle_with_pytorchs_defaults_rises_falls_and_ends() {
    let mut schedule = LrScheduler::one_cycle(1.0, 10, OneCycleConfig::default()).unwrap();
    let mut got = Vec::new();
    let mut momenta = Vec::new();
    for _ in 0..10 {
        got.push(schedule.lr());
        momenta.push(schedule.momentum().unwrap());
        schedule.step().unwrap();
    }
    // max_lr / 25 up to 1.0 over 3 steps, then down to 4e-6 (a
    // ten-thousandth of the start) by the last.
    let want = [
        0.04,
        0.52,
        1.0,
        0.950_484_632_013_474,
        0.811_745_653_949_763,
        0.611_262_021_936_289,
        0.388_741_978_063_711,
        0.188_258_346_050_237,
        0.049_519_367_986_526_3,
        4e-6,
    ];
    assert_close(&got, &want, 1e-12, "one-cycle rates");
    // The momentum against the rate: 0.95 down to 0.85 at the peak.
    assert_close(
        &momenta[..4],
        &[0.95, 0.90, 0.85, 0.854_951_556_604_879],
        1e-12,
        "one-cycle momenta",
    );
    // Step total_steps is reached (its rate extrapolates the last phase,
    // as PyTorch's); one more is an error, and the schedule stays where it
    // was.
    let at_end = schedule.lr();
    assert!(rel(at_end, 0.049_519_367_986_526_2) < 1e-12, "{at_end}");
    let err = schedule.step().unwrap_err();
    assert!(
        matches!(err, Error::LrSchedule(_)) && err.to_string().contains("10 steps"),
        "{err}"
    );
    assert_eq!(schedule.lr(), at_end);
}

#[test]
fn a_schedule_resumed_from_its_state_continues_bit_for_bit() {
    let build = || {
        let warm_up = LrScheduler::linear(0.01, 0.2, 1.0, 10).unwrap();
        let cosine = LrScheduler::cosine_annealing(0.01, 50, 1e-4).unwrap();
        LrScheduler::sequential(0.01, vec![warm_up, cosine], vec![10]).unwrap()
    };
    let whole = rates(build(), 80);
    let mut first = build();
    for _ in 0..37 {
        first.step().unwrap();
    }
    let saved = serde_json::to_string(&first.state()).unwrap();
    let mut resumed = build();
    resumed
        .load_state(&serde_json::from_str(&saved).unwrap())
        .unwrap();
    let rest = rates(resumed, 43);
    let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&rest), bits(&whole[37..]));

    // A state of another schedule is refused, and nothing changes.
    let mut cosine = LrScheduler::cosine_annealing(0.01, 50, 1e-4).unwrap();
    let before = cosine.state();
    let err = cosine.load_state(&first.state()).unwrap_err();
    assert!(err.to_string().contains("`sequential` schedule"), "{err}");
    assert_eq!(cosine.state(), before);
}

#[test]
fn schedules_pytorch_refuses_are_refused() {
    let refused = [
        LrScheduler::linear(0.1, 0.0, 1.0, 5).map(|_| ()),
        LrScheduler::linear(0.1, 0.5, 1.5, 5).map(|_| ()),
        LrScheduler::cosine_annealing(0.1, 0, 0.0).map(|_| ()),
        LrScheduler::step_lr(0.1, 0, 0.1).map(|_| ()),
        LrScheduler::one_cycle(1.0, 0, OneCycleConfig::default()).map(|_| ()),
        LrScheduler::one_cycle(
            1.0,
            10,
            OneCycleConfig {
                pct_start: 1.5,
                ..Default::default()
            },
        )
        .map(|_| ()),
        LrScheduler::exponential(f64::NAN, 0.9).map(|_| ()),
        LrScheduler::sequential(
            0.1,
            vec![LrScheduler::exponential(0.1, 0.9).unwrap()],
            vec![3],
        )
        .map(|_| ()),
    ];
    for (k, outcome) in refused.into_iter().enumerate() {
        assert!(
            matches!(outcome, Err(Error::LrSchedule(_))),
            "case {k}: {outcome:?}"
        );
    }
}

#[test]
fn the_rate_is_set_on_any_candle_optimizer() {
    let w = Var::ones(3, DType::F32, &Device::Cpu).unwrap();
    let mut sgd = SGD::new(vec![w], 0.1).unwrap();
    let mut schedule = LrScheduler::step_lr(sgd.learning_rate(), 2, 0.1).unwrap();
    let mut seen = Vec::new();
    for _ in 0..5 {
        schedule.apply(&mut sgd);
        seen.push(sgd.learning_rate());
        schedule.step().unwrap();
    }
    assert_close(
        &seen,
        &[0.1, 0.1, 0.01, 0.01, 0.001],
        1e-12,
        "StepLR on SGD",
    );
}

/// A one-cycle schedule whose rising phase ends at step 0 (10 steps,
/// `pct_start` 0.1) would place step 0 at 0/0 of it, a NaN rate and
/// momentum from the first step (PyTorch raises ZeroDivisionError): it is
/// refused at construction; a short rising phase that PyTorch accepts
/// still gives finite rates.
#[test]
fn one_cycle_whose_rising_phase_ends_at_step_0_is_refused() {
    let config = |pct_start| OneCycleConfig {
        pct_start,
        ..Default::default()
    };
    for (steps, pct) in [(10, 0.1), (4, 0.25), (100, 0.01)] {
        let err = LrScheduler::one_cycle(0.1, steps, config(pct)).unwrap_err();
        assert!(matches!(err, Error::LrSchedule(_)), "{err}");
        assert!(err.to_string().contains("pct_start"), "{err}");
    }
    for pct in [0.05, 0.15, 0.3] {
        let mut schedule = LrScheduler::one_cycle(0.1, 10, config(pct)).unwrap();
        for step in 0..10 {
            let (lr, momentum) = (schedule.lr(), schedule.momentum());
            assert!(lr.is_finite(), "pct {pct}, step {step}: {lr}");
            assert!(
                momentum.is_some_and(f64::is_finite),
                "pct {pct}, step {step}"
            );
            if step < 9 {
                schedule.step().unwrap();
            }
        }
    }
}

/// StepLR's step size above `i64::MAX` used to wrap to a negative one in
/// a cast and decay the rate at every step; it never decays within any
/// reachable step now.
#[test]
fn step_lr_with_a_step_size_above_i64_max_never_decays() {
    for step_size in [i64::MAX as u64, i64::MAX as u64 + 1, u64::MAX] {
        let mut schedule = LrScheduler::step_lr(0.1, step_size, 0.5).unwrap();
        for _ in 0..5 {
            assert_eq!(schedule.lr(), 0.1, "step size {step_size}");
            schedule.step().unwrap();
        }
    }
}

/// Milestones that do not increase give an odd schedule (one that never
/// runs): refused, naming them.
#[test]
fn sequential_milestones_that_do_not_increase_are_refused_naming_them() {
    let child = || LrScheduler::step_lr(0.1, 1, 0.9).unwrap();
    for milestones in [vec![5, 5], vec![6, 3]] {
        let err = LrScheduler::sequential(0.1, vec![child(), child(), child()], milestones.clone())
            .unwrap_err();
        assert!(matches!(err, Error::LrSchedule(_)), "{err}");
        assert!(
            err.to_string().contains(&format!("{milestones:?}")),
            "{err}"
        );
    }
    assert!(LrScheduler::sequential(0.1, vec![child(), child(), child()], vec![3, 6]).is_ok());
}

/// A rate that overflows (an exponential growing past f64's range) would
/// train on NaN weights and leave a state no save can write: the step is
/// refused and the schedule stays where it was.
#[test]
fn a_step_to_a_rate_that_is_not_finite_is_refused_and_changes_nothing() {
    let mut schedule = LrScheduler::exponential(1.0, 1e200).unwrap();
    schedule.step().unwrap();
    let before = schedule.state();
    let err = schedule.step().unwrap_err();
    assert!(matches!(err, Error::LrSchedule(_)), "{err}");
    assert!(err.to_string().contains("inf"), "{err}");
    assert_eq!(schedule.state(), before);
}

/// One schedule of `tests/data/lr_reference.json`'s `groups`: each step's
/// rates and momenta, in group order.
#[derive(serde::Deserialize)]
struct GroupReference {
    args: serde_json::Value,
    lr: Vec<Vec<f64>>,
    momentum: Vec<Vec<f64>>,
}

/// The schedule of case `name` over groups of base rates `bases`, built
/// as a user would: with group 0's rate, then the groups' rates (or one
/// schedule per group where PyTorch takes a list).
fn over_groups(name: &str, args: &serde_json::Value, bases: &[f64]) -> LrScheduler {
    let a = |key: &str| args[key].as_f64().unwrap();
    let base = bases[0];
    let one_cycle = |max_lr: f64| {
        LrScheduler::one_cycle(max_lr, a("total_steps") as u64, OneCycleConfig::default()).unwrap()
    };
    let schedule = match name {
        "cosine" => LrScheduler::cosine_annealing(base, a("T_max") as u64, a("eta_min")),
        "linear" => LrScheduler::linear(
            base,
            a("start_factor"),
            a("end_factor"),
            a("total_iters") as u64,
        ),
        "step" => LrScheduler::step_lr(base, a("step_size") as u64, a("gamma")),
        "exponential" => LrScheduler::exponential(base, a("gamma")),
        "lambda" => LrScheduler::lambda(base, Arc::new(|step| 0.95f64.powf(step as f64))),
        "one_cycle" => Ok(one_cycle(a("max_lr"))),
        "one_cycle_per_group" => {
            let max_lrs = args["max_lr"].as_array().unwrap();
            let per_group = max_lrs.iter().map(|m| one_cycle(m.as_f64().unwrap()));
            return LrScheduler::per_group(per_group.collect()).unwrap();
        }
        "warmup_cosine" => {
            let warm_up =
                LrScheduler::linear(base, a("start_factor"), 1.0, a("total_iters") as u64).unwrap();
            let cosine =
                LrScheduler::cosine_annealing(base, a("T_max") as u64, a("eta_min")).unwrap();
            LrScheduler::sequential(base, vec![warm_up, cosine], vec![a("milestone") as u64])
        }
        other => panic!("a case this test does not know: {other}"),
    };
    schedule.unwrap().with_group_rates(bases).unwrap()
}

/// Every schedule over two parameter groups (rates 0.1 and 0.01) gives
/// each group PyTorch's rate, step by step, within 1e-12, set on an
/// optimizer of two groups; a cosine's floor is every group's (before,
/// every group was scaled by group 0's factor: the second ended at 1e-4,
/// not PyTorch's 1e-3). Saved at step 37 and loaded into a schedule built
/// the same way, it continues to the same bits.
#[test]
fn every_schedule_over_two_parameter_groups_gives_each_group_pytorchs_rate() {
    use candle_dp::optim::StatefulOptimizer;
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/data/lr_reference.json");
    #[derive(serde::Deserialize)]
    struct File {
        torch: String,
        group_lrs: Vec<f64>,
        groups: std::collections::BTreeMap<String, GroupReference>,
    }
    let file: File = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
    assert!(file.torch.starts_with("2.15"), "{}", file.torch);
    assert_eq!(file.groups.len(), 8, "every schedule's case");
    let bases = &file.group_lrs;
    let mut sgd = two_group_sgd(bases);
    let mut worst = 0f64;
    for (name, case) in &file.groups {
        let mut schedule = over_groups(name, &case.args, bases);
        assert_eq!(schedule.groups(), 2, "{name}");
        let mut rates = Vec::new();
        for (step, (want, momenta)) in case.lr.iter().zip(&case.momentum).enumerate() {
            sgd.set_group_learning_rates(&schedule.group_lrs()).unwrap();
            let got = sgd.group_learning_rates();
            for (g, (got, want)) in got.iter().zip(want).enumerate() {
                worst = worst.max(rel(*got, *want));
                assert!(
                    rel(*got, *want) <= 1e-12,
                    "{name}, group {g}, step {step}: {got} against PyTorch's {want}"
                );
            }
            if let Some(m) = schedule.momentum() {
                assert!(
                    rel(m, momenta[0]) <= 1e-12,
                    "{name}, step {step}: momentum {m}"
                );
            }
            rates.push(schedule.group_lrs());
            schedule.step().unwrap();
        }
        // Resumed at step 37 from a saved state: the same bits onwards.
        let mut first = over_groups(name, &case.args, bases);
        for _ in 0..37 {
            first.step().unwrap();
        }
        let saved = serde_json::to_string(&first.state()).unwrap();
        let mut resumed = over_groups(name, &case.args, bases);
        resumed
            .load_state(&serde_json::from_str(&saved).unwrap())
            .unwrap();
        for (step, want) in rates.iter().enumerate().skip(37) {
            let got = resumed.group_lrs();
            let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got), bits(want), "{name} resumed, step {step}");
            resumed.step().unwrap();
        }
    }
    eprintln!("largest relative difference from PyTorch 2.15 over two groups: {worst:.2e}");
}

/// A state of another number of groups, groups given after a step, and
/// schedules per group of other kinds are refused, naming why; a refused
/// load changes nothing.
#[test]
fn schedules_over_groups_that_do_not_fit_are_refused_naming_why() {
    let two = || {
        LrScheduler::cosine_annealing(0.1, 10, 1e-3)
            .unwrap()
            .with_group_rates(&[0.1, 0.01])
            .unwrap()
    };
    let mut one = LrScheduler::cosine_annealing(0.1, 10, 1e-3).unwrap();
    let before = one.state();
    let e = one.load_state(&two().state()).unwrap_err().to_string();
    assert!(
        e.contains("sets 2 parameter group(s), this schedule 1"),
        "{e}"
    );
    assert_eq!(one.state(), before);

    let mut stepped = LrScheduler::cosine_annealing(0.1, 10, 1e-3).unwrap();
    stepped.step().unwrap();
    let e = stepped
        .with_group_rates(&[0.1, 0.01])
        .unwrap_err()
        .to_string();
    assert!(e.contains("before the first step"), "{e}");

    let e = LrScheduler::cosine_annealing(0.1, 10, 1e-3)
        .unwrap()
        .with_group_rates(&[0.1, f64::NAN])
        .unwrap_err()
        .to_string();
    assert!(e.contains("parameter group 1's rate"), "{e}");

    let e = LrScheduler::per_group(vec![
        LrScheduler::cosine_annealing(0.1, 10, 1e-3).unwrap(),
        LrScheduler::exponential(0.01, 0.9).unwrap(),
    ])
    .unwrap_err()
    .to_string();
    assert!(e.contains("group 1's schedule (`exponential`"), "{e}");

    let e = LrScheduler::sequential(0.1, vec![two()], vec![])
        .unwrap_err()
        .to_string();
    assert!(e.contains("one-group schedules"), "{e}");
}

/// A state saved before the groups had schedules of their own (of one
/// group) loads into a schedule over two: group 0 from the state, group 1
/// where its own schedule is at that step; `apply_to_groups` sets both.
#[test]
fn a_one_group_state_loads_into_a_schedule_over_groups() {
    use candle_dp::optim::StatefulOptimizer;
    let build = || LrScheduler::cosine_annealing(0.1, 30, 1e-3).unwrap();
    let mut old = build();
    let mut both = build().with_group_rates(&[0.1, 0.01]).unwrap();
    for _ in 0..12 {
        old.step().unwrap();
        both.step().unwrap();
    }
    let mut resumed = build().with_group_rates(&[0.1, 0.01]).unwrap();
    resumed.load_state(&old.state()).unwrap();
    assert_eq!(resumed.group_lrs(), both.group_lrs());
    resumed.step().unwrap();
    both.step().unwrap();
    assert_eq!(resumed.group_lrs(), both.group_lrs());

    let mut sgd = two_group_sgd(&[0.1, 0.01]);
    resumed.apply_to_groups(&mut sgd).unwrap();
    assert_eq!(sgd.group_learning_rates(), resumed.group_lrs());
    let e = build().apply_to_groups(&mut sgd).unwrap_err().to_string();
    assert!(e.contains("1 rates for the 2 parameter group(s)"), "{e}");
}

/// An SGD over two parameters, `a` in group 0 and `b` in group 1, of
/// rates `rates`.
fn two_group_sgd(rates: &[f64]) -> candle_dp::optim::Sgd {
    use candle_dp::optim::{Sgd, SgdConfig};
    let params: Vec<(String, Var)> = ["a", "b"]
        .iter()
        .map(|n| {
            (
                n.to_string(),
                Var::zeros(1, DType::F32, &Device::Cpu).unwrap(),
            )
        })
        .collect();
    let configs = rates
        .iter()
        .map(|&lr| SgdConfig {
            lr,
            ..Default::default()
        })
        .collect();
    Sgd::with_groups(params, configs, |n| usize::from(n == "b")).unwrap()
}
