//! Pipeline (model) parallelism: exact against one device on both paths,
//! GPipe and 1F1B bitwise equal, the balances, and failing stages named.
// Closures here return `candle_dp::Result` as the API requires.
#![allow(clippy::result_large_err)]

use std::collections::HashMap;
use std::sync::mpsc;
use std::time::Duration;

use candle_core::{DType, Device, Module, Tensor};
use candle_dp::launch::spawn_with;
use candle_dp::pipeline::{unit, Balance, Pipeline, Schedule, UnitFactory};
use candle_dp::{
    cpu_devices, seeded_varmap, DdpConfig, DistributedDataParallel, Error, LossReduction,
};
use candle_nn::{linear, loss, Activation, Optimizer, VarBuilder, VarMap};

/// Runs `f` on a thread; fails the test if it takes longer than `seconds`.
fn within<T: Send + 'static>(seconds: u64, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)));
    });
    match rx.recv_timeout(Duration::from_secs(seconds)) {
        Ok(Ok(value)) => value,
        Ok(Err(panic)) => std::panic::resume_unwind(panic),
        Err(_) => panic!("did not finish within {seconds} s: it hangs"),
    }
}

/// Six layers: 6 -> 10 -> relu -> 10 -> sigmoid -> 10 -> 3 (with a
/// parameter-free layer in between, so every balance is exercised).
fn layers() -> Vec<UnitFactory> {
    vec![
        unit(|vb| linear(6, 10, vb.pp("l1"))),
        unit(|_| Ok(Activation::Relu)),
        unit(|vb| linear(10, 10, vb.pp("l2"))),
        unit(|_| Ok(Activation::Sigmoid)),
        unit(|vb| linear(10, 10, vb.pp("l3"))),
        unit(|vb| linear(10, 3, vb.pp("l4"))),
    ]
}

/// The same model on one device.
fn single(vb: VarBuilder) -> candle_core::Result<impl Module> {
    let l1 = linear(6, 10, vb.pp("l1"))?;
    let l2 = linear(10, 10, vb.pp("l2"))?;
    let l3 = linear(10, 10, vb.pp("l3"))?;
    let l4 = linear(10, 3, vb.pp("l4"))?;
    Ok(candle_nn::func(move |x: &Tensor| {
        let h = candle_nn::ops::sigmoid(&l2.forward(&l1.forward(x)?.relu()?)?)?;
        l4.forward(&l3.forward(&h)?)
    }))
}

fn data(rows: usize) -> (Tensor, Tensor) {
    let x = Tensor::randn(0f32, 1., (rows, 6), &Device::Cpu).unwrap();
    let y: Vec<u32> = (0..rows as u32).map(|i| (i * 7 + 1) % 3).collect();
    (x, Tensor::from_vec(y, rows, &Device::Cpu).unwrap())
}

fn init() -> VarMap {
    seeded_varmap(11, DType::F32, &Device::Cpu, |vb| single(vb).map(|_| ())).unwrap()
}

/// A copy of `varmap` (fresh variables with the same values).
fn copy_of(varmap: &VarMap) -> VarMap {
    let copy = VarMap::new();
    let mut data = copy.data().lock().unwrap();
    for (name, var) in varmap.data().lock().unwrap().iter() {
        let value = var.as_tensor().copy().unwrap();
        data.insert(name.clone(), candle_core::Var::from_tensor(&value).unwrap());
    }
    drop(data);
    copy
}

fn grads_by_name(
    varmap: &VarMap,
    grads: &candle_core::backprop::GradStore,
) -> HashMap<String, Vec<f32>> {
    varmap
        .data()
        .lock()
        .unwrap()
        .iter()
        .map(|(name, var)| {
            let g = grads
                .get(var.as_tensor())
                .unwrap_or_else(|| panic!("no gradient for {name}"));
            (
                name.clone(),
                g.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            )
        })
        .collect()
}

pub(crate) fn max_diff(a: &HashMap<String, Vec<f32>>, b: &HashMap<String, Vec<f32>>) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .flat_map(|(name, va)| {
            va.iter()
                .zip(&b[name])
                .map(|(x, y)| (x - y).abs() / (1. + y.abs()))
        })
        .fold(0., f32::max)
}

/// The gradients (by name) and the loss of one step of [`single`] from
/// `start` (left unchanged) on `x`, `y`.
fn one_device_step(start: &VarMap, x: &Tensor, y: &Tensor) -> (HashMap<String, Vec<f32>>, f32) {
    let reference = copy_of(start);
    let model = single(VarBuilder::from_varmap(
        &reference,
        DType::F32,
        &Device::Cpu,
    ))
    .unwrap();
    let l = loss::cross_entropy(&model.forward(x).unwrap(), y).unwrap();
    let grads = grads_by_name(&reference, &l.backward().unwrap());
    (grads, l.to_scalar::<f32>().unwrap())
}

fn pipeline(varmap: &VarMap, stages: usize, chunks: usize, schedule: Schedule) -> Pipeline {
    Pipeline::builder(varmap, DType::F32, &cpu_devices(stages))
        .chunks(chunks)
        .schedule(schedule)
        .timeout(Duration::from_secs(60))
        .build(layers())
        .unwrap()
}

#[test]
fn pipeline_gradients_equal_one_device_for_1_to_3_stages_and_1_to_13_micro_batches() {
    within(300, || {
        let start = init();
        let (x, y) = data(13);
        let (want, want_loss) = one_device_step(&start, &x, &y);
        for stages in 1..=3 {
            for chunks in 1..=13 {
                let varmap = copy_of(&start);
                let mut by_schedule = Vec::new();
                for schedule in [Schedule::GPipe, Schedule::OneFOneB] {
                    let pipe = pipeline(&varmap, stages, chunks, schedule);
                    let step = pipe
                        .forward_backward(&x, &y, LossReduction::Mean, |out, y| {
                            loss::cross_entropy(out, y)
                        })
                        .unwrap();
                    let got = grads_by_name(&varmap, &step.grads);
                    let diff = max_diff(&got, &want);
                    assert!(
                        diff < 1e-5,
                        "{stages} stages, {chunks} chunks, {schedule:?}: {diff}"
                    );
                    let l = step.loss.to_scalar::<f32>().unwrap();
                    assert!((l - want_loss).abs() < 1e-5, "loss {l} vs {want_loss}");
                    by_schedule.push(got);
                }
                assert_eq!(
                    by_schedule[0], by_schedule[1],
                    "GPipe and 1F1B bitwise, {stages} stages, {chunks} chunks"
                );
                // The drop-in path: the graph spans the stages.
                let pipe = pipeline(&varmap, stages, chunks, Schedule::OneFOneB);
                let out = pipe.forward(&x).unwrap();
                let l = loss::cross_entropy(&out, &y).unwrap();
                let diff = max_diff(&grads_by_name(&varmap, &l.backward().unwrap()), &want);
                assert!(
                    diff < 1e-5,
                    "drop-in, {stages} stages, {chunks} chunks: {diff}"
                );
            }
        }
    });
}

#[test]
fn pipeline_training_follows_one_device_training_step_for_step() {
    within(120, || {
        let start = init();
        let (x, y) = data(24);
        let reference = copy_of(&start);
        let model = single(VarBuilder::from_varmap(
            &reference,
            DType::F32,
            &Device::Cpu,
        ))
        .unwrap();
        let mut sgd = candle_nn::SGD::new(reference.all_vars(), 0.2).unwrap();
        let varmap = copy_of(&start);
        let pipe = pipeline(&varmap, 2, 5, Schedule::OneFOneB);
        let mut pipe_sgd = candle_nn::SGD::new(varmap.all_vars(), 0.2).unwrap();
        for _ in 0..5 {
            let l = loss::cross_entropy(&model.forward(&x).unwrap(), &y).unwrap();
            sgd.backward_step(&l).unwrap();
            let step = pipe
                .forward_backward(&x, &y, LossReduction::Mean, |out, y| {
                    loss::cross_entropy(out, y)
                })
                .unwrap();
            pipe_sgd.step(&step.grads).unwrap();
        }
        let diff = max_diff(&values(&varmap), &values(&reference));
        assert!(diff < 1e-5, "{diff}");
    });
}

fn values(v: &VarMap) -> HashMap<String, Vec<f32>> {
    v.data()
        .lock()
        .unwrap()
        .iter()
        .map(|(n, t)| {
            let values = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            (n.clone(), values)
        })
        .collect()
}

/// The values after SGD (lr 0.2) on one device from `start` over `batches`.
fn sgd_on_one_device(start: &VarMap, batches: &[(Tensor, Tensor)]) -> HashMap<String, Vec<f32>> {
    let reference = copy_of(start);
    let model = single(VarBuilder::from_varmap(
        &reference,
        DType::F32,
        &Device::Cpu,
    ))
    .unwrap();
    let mut sgd = candle_nn::SGD::new(reference.all_vars(), 0.2).unwrap();
    for (x, y) in batches {
        let l = loss::cross_entropy(&model.forward(x).unwrap(), y).unwrap();
        sgd.backward_step(&l).unwrap();
    }
    values(&reference)
}

/// Thread-rank group options whose collectives give up after 30 s.
fn bounded_group() -> candle_dp::comm::GroupOptions {
    candle_dp::comm::GroupOptions {
        timeout: Some(Duration::from_secs(30)),
        ..Default::default()
    }
}

#[test]
fn a_pipeline_in_each_ddp_rank_trains_like_one_device_on_the_global_batch() {
    within(120, || {
        let start = init();
        let batches: Vec<(Tensor, Tensor)> = (0..3).map(|_| data(12)).collect();
        let want = sgd_on_one_device(&start, &batches);
        for world in [2, 3] {
            for path in ["fast", "drop-in"] {
                let options = bounded_group();
                let ranks = spawn_with(world, options, |ctx| {
                    // Ranks other than 0 start elsewhere: DDP copies rank 0's.
                    let varmap = if ctx.rank == 0 {
                        copy_of(&start)
                    } else {
                        VarMap::new()
                    };
                    let pipe = pipeline(&varmap, 2, 3, Schedule::OneFOneB);
                    let mut ddp = DistributedDataParallel::from_module(
                        ctx.process_group(),
                        &varmap,
                        pipe,
                        DdpConfig::default(),
                    )?;
                    let mut sgd = candle_nn::SGD::new(varmap.all_vars(), 0.2)?;
                    for (x, y) in &batches {
                        let b = x.dim(0)? / world;
                        let x = x.narrow(0, ctx.rank * b, b)?;
                        let y = y.narrow(0, ctx.rank * b, b)?;
                        if path == "fast" {
                            let step =
                                ddp.forward_backward(&x, &y, LossReduction::Mean, |o, y| {
                                    loss::cross_entropy(o, y)
                                })?;
                            sgd.step(&step.grads)?;
                        } else {
                            let out = ddp.forward_t(&x, true)?;
                            let l = loss::cross_entropy(&out, &y)?;
                            ddp.backward_step(&l, &mut sgd)?;
                        }
                        // Both paths say where the step's time went.
                        let timings = ddp.last_timings();
                        anyhow::ensure!(
                            !timings.backward.is_zero() && !timings.all_reduce.is_zero(),
                            "{path}: {timings:?}"
                        );
                    }
                    Ok(values(&varmap))
                })
                .unwrap();
                for (rank, got) in ranks.iter().enumerate() {
                    let diff = max_diff(got, &want);
                    assert!(diff < 1e-5, "{world} ranks, {path}, rank {rank}: {diff}");
                }
            }
        }
    });
}

#[test]
fn an_interleaved_pipeline_in_each_zero_rank_trains_like_one_device_on_the_global_batch() {
    within(120, || {
        use candle_dp::zero::{ZeroOptimizer, ZeroStage};
        let start = init();
        let batches: Vec<(Tensor, Tensor)> = (0..3).map(|_| data(12)).collect();
        let want = sgd_on_one_device(&start, &batches);
        let world = 2;
        for stage in [ZeroStage::One, ZeroStage::Two] {
            let options = bounded_group();
            let ranks = spawn_with(world, options, |ctx| {
                let varmap = copy_of(&start);
                // 2 devices, 2 stages each, per rank.
                let pipe = pipeline(&varmap, 2, 3, interleaved(2));
                let mut ddp = DistributedDataParallel::from_module(
                    ctx.process_group(),
                    &varmap,
                    pipe,
                    DdpConfig {
                        zero: Some(stage),
                        ..DdpConfig::default()
                    },
                )?;
                let mut opt = ZeroOptimizer::new(&ddp, |owned| {
                    candle_nn::SGD::new(owned.into_iter().map(|(_, v)| v).collect(), 0.2)
                })?;
                for (x, y) in &batches {
                    let b = x.dim(0)? / world;
                    let x = x.narrow(0, ctx.rank * b, b)?;
                    let y = y.narrow(0, ctx.rank * b, b)?;
                    let step =
                        ddp.forward_backward(&x, &y, LossReduction::Mean, loss::cross_entropy)?;
                    opt.step(&step.grads)?;
                }
                Ok(values(&varmap))
            })
            .unwrap();
            for (rank, got) in ranks.iter().enumerate() {
                let diff = max_diff(got, &want);
                assert!(diff < 1e-5, "{stage:?}, rank {rank}: {diff}");
            }
        }
    });
}

#[test]
fn balances_split_the_layers_as_asked() {
    let build = |balance: Balance| {
        Pipeline::builder(&VarMap::new(), DType::F32, &cpu_devices(3))
            .balance(balance)
            .build(layers())
    };
    assert_eq!(build(Balance::Uniform).unwrap().balance(), &[2, 2, 2]);
    assert_eq!(
        build(Balance::Explicit(vec![1, 4, 1])).unwrap().balance(),
        &[1, 4, 1]
    );
    // Bytes per layer (f32): l1 280, relu 0, l2 440, sigmoid 0, l3 440,
    // l4 132. No contiguous split into 3 has a largest stage under 572.
    let bytes = [280, 0, 440, 0, 440, 132];
    let by_bytes = build(Balance::ParameterBytes).unwrap();
    let mut start = 0;
    let largest = by_bytes
        .balance()
        .iter()
        .map(|&n| {
            start += n;
            bytes[start - n..start].iter().sum::<usize>()
        })
        .max();
    assert_eq!(largest, Some(572), "{:?}", by_bytes.balance());
    let sample = Tensor::randn(0f32, 1., (8, 6), &Device::Cpu).unwrap();
    let timed = build(Balance::Time { sample }).unwrap();
    assert_eq!(timed.balance().iter().sum::<usize>(), 6);
    for bad in [vec![1, 1], vec![0, 3, 3], vec![2, 2, 3]] {
        let err = build(Balance::Explicit(bad.clone())).unwrap_err();
        assert!(
            matches!(err, Error::InvalidBalance { .. }),
            "{bad:?}: {err}"
        );
    }
    let err = Pipeline::builder(&VarMap::new(), DType::F32, &cpu_devices(7))
        .build(layers())
        .unwrap_err();
    assert!(
        err.to_string()
            .contains("every stage needs at least one layer"),
        "{err}"
    );
}

#[test]
fn a_layer_factory_that_panics_or_fails_is_named_under_every_balance() {
    let sample = Tensor::randn(0f32, 1., (4, 6), &Device::Cpu).unwrap();
    let balances = [
        Balance::Uniform,
        Balance::Explicit(vec![2, 2, 2]),
        Balance::ParameterBytes,
        Balance::Time { sample },
    ];
    for balance in balances {
        for panics in [true, false] {
            let mut broken = layers();
            broken[4] = unit(move |_| -> candle_core::Result<Activation> {
                if panics {
                    panic!("bad layer config");
                }
                candle_core::bail!("bad layer config")
            });
            let case = format!("{balance:?}, panics {panics}");
            let balance = balance.clone();
            let err = within(60, move || {
                Pipeline::builder(&VarMap::new(), DType::F32, &cpu_devices(3))
                    .balance(balance)
                    .build(broken)
                    .map(|_| ())
            })
            .unwrap_err();
            assert!(
                matches!(err, Error::LayerBuild { layer: 4, .. }),
                "{case}: {err}"
            );
            assert!(
                err.to_string().contains("bad layer config"),
                "{case}: {err}"
            );
        }
    }
    // Balance::Time also runs each layer: one that panics there is named.
    let mut broken = layers();
    broken[2] = unit(|_| {
        Ok(candle_nn::func(|_| -> candle_core::Result<Tensor> {
            panic!("forward blew up")
        }))
    });
    let sample = Tensor::randn(0f32, 1., (4, 6), &Device::Cpu).unwrap();
    let err = within(60, move || {
        Pipeline::builder(&VarMap::new(), DType::F32, &cpu_devices(3))
            .balance(Balance::Time { sample })
            .build(broken)
            .map(|_| ())
    })
    .unwrap_err();
    assert!(
        matches!(err, Error::LayerBuild { layer: 2, .. })
            && err.to_string().contains("forward blew up"),
        "{err}"
    );
}

#[test]
fn each_stage_builds_only_its_own_layers_variables() {
    let pipe = Pipeline::builder(&VarMap::new(), DType::F32, &cpu_devices(2))
        .balance(Balance::Explicit(vec![3, 3]))
        .build(layers())
        .unwrap();
    assert_eq!(
        pipe.stage_vars(),
        vec![
            vec!["l1.bias", "l1.weight", "l2.bias", "l2.weight"],
            vec!["l3.bias", "l3.weight", "l4.bias", "l4.weight"],
        ]
    );
}

#[test]
fn a_variable_shared_by_two_stages_gets_the_sum_of_its_gradients() {
    // x -> W -> relu -> W -> sum: the same `w` in stage 0 and stage 1.
    let tied = || unit(|vb| Ok(linear_no_bias(vb.get((4, 4), "w")?)));
    let layers = vec![tied(), unit(|_| Ok(Activation::Relu)), tied()];
    let varmap = VarMap::new();
    let pipe = Pipeline::builder(&varmap, DType::F32, &cpu_devices(2))
        .balance(Balance::Explicit(vec![2, 1]))
        .chunks(3)
        .build(layers)
        .unwrap();
    let x = Tensor::randn(0f32, 1., (5, 4), &Device::Cpu).unwrap();
    let y = Tensor::zeros(5, DType::F32, &Device::Cpu).unwrap();
    let step = pipe
        .forward_backward(&x, &y, LossReduction::Sum, |out, _| out.sum_all())
        .unwrap();
    let w = varmap.data().lock().unwrap()["w"].clone();
    let lin = linear_no_bias(w.as_tensor().clone());
    let out = lin
        .forward(&lin.forward(&x).unwrap().relu().unwrap())
        .unwrap();
    let want = out.sum_all().unwrap().backward().unwrap();
    let diff = (step.grads.get(w.as_tensor()).unwrap() - want.get(w.as_tensor()).unwrap())
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    assert!(diff < 1e-5, "{diff}");
}

fn linear_no_bias(w: Tensor) -> candle_nn::Linear {
    candle_nn::Linear::new(w, None)
}

/// A layer that fails (or panics, or sleeps) in the forward of micro-batch
/// rows starting with a marker value.
struct Faulty {
    mode: &'static str,
}

impl Module for Faulty {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let first = x.flatten_all()?.get(0)?.to_scalar::<f32>()?;
        if first == 99. {
            match self.mode {
                "error" => candle_core::bail!("bad rows"),
                "panic" => panic!("boom"),
                _ => std::thread::sleep(Duration::from_secs(30)),
            }
        }
        Ok(x.clone())
    }
}

/// `x` (6 rows of 4) with rows 2 and 3, micro-batch 1 of 3, set to 99:
/// what [`Faulty`] fails on.
fn marked(x: &Tensor) -> Tensor {
    Tensor::cat(
        &[
            x.narrow(0, 0, 2).unwrap(),
            Tensor::full(99f32, (2, 4), &Device::Cpu).unwrap(),
            x.narrow(0, 4, 2).unwrap(),
        ],
        0,
    )
    .unwrap()
}

#[test]
fn a_failing_panicking_or_stuck_stage_is_named_with_its_micro_batch_and_phase() {
    for mode in ["error", "panic", "stuck"] {
        let err = within(60, move || {
            let varmap = VarMap::new();
            // Stage 0 (relu) passes micro-batch 1's 99s on to stage 1.
            let x = Tensor::zeros((6, 4), DType::F32, &Device::Cpu).unwrap();
            let y = Tensor::new(&[0u32, 1, 0, 1, 0, 1], &Device::Cpu).unwrap();
            let pipe = Pipeline::builder(&varmap, DType::F32, &cpu_devices(3))
                .chunks(3)
                .timeout(Duration::from_millis(1500))
                .build(vec![
                    unit(|_| Ok(Activation::Relu)),
                    unit(move |_| Ok(Faulty { mode })),
                    unit(|vb| linear(4, 2, vb.pp("b"))),
                ])
                .unwrap();
            let marked = marked(&x);
            let step = |x: &Tensor| {
                pipe.forward_backward(x, &y, LossReduction::Mean, loss::cross_entropy)
                    .map(|_| ())
            };
            let err = step(&marked).unwrap_err();
            // A stuck stage's worker is still in that forward: the next
            // step must name it too, not a stage waiting for it.
            let next = (mode == "stuck").then(|| step(&x).unwrap_err());
            (err, next)
        });
        let (err, next) = err;
        match (mode, &err) {
            ("stuck", Error::StageTimeout { stage, doing, .. }) => {
                assert_eq!(*stage, 1, "{err}");
                assert!(doing.contains("forward of micro-batch 1"), "{err}");
                let next = next.unwrap();
                assert!(
                    matches!(&next, Error::StageTimeout { stage: 1, doing, .. } if doing.contains("still busy")),
                    "{next}"
                );
            }
            (
                _,
                Error::Stage {
                    stage,
                    micro_batch,
                    phase,
                    ..
                },
            ) if mode != "stuck" => {
                assert_eq!((*stage, *micro_batch, *phase), (1, 1, "forward"), "{err}");
                assert!(
                    err.to_string()
                        .contains(if mode == "error" { "bad rows" } else { "boom" }),
                    "{err}"
                );
            }
            _ => panic!("{mode}: unexpected {err}"),
        }
    }
}

/// The error of a training step (mean cross-entropy) that must fail.
fn failed_step(pipe: &Pipeline, x: &Tensor, y: &Tensor) -> Error {
    pipe.forward_backward(x, y, LossReduction::Mean, loss::cross_entropy)
        .map(|_| ())
        .unwrap_err()
}

#[test]
fn a_pipeline_keeps_working_after_a_failed_step() {
    within(60, || {
        let varmap = init();
        let pipe = pipeline(&varmap, 2, 2, Schedule::OneFOneB);
        let (x, y) = data(4);
        let bad_y = Tensor::new(&[0u32, 1, 7, 1], &Device::Cpu).unwrap(); // class 7 of 3
        let err = failed_step(&pipe, &x, &bad_y);
        assert!(
            matches!(
                err,
                Error::Stage {
                    stage: 1,
                    phase: "loss",
                    ..
                }
            ),
            "{err}"
        );
        let step = pipe
            .forward_backward(&x, &y, LossReduction::Mean, |o, y| {
                loss::cross_entropy(o, y)
            })
            .unwrap();
        assert!(step.loss.to_scalar::<f32>().unwrap().is_finite());
    });
}

// ---------------------------------------------------------------- BatchNorm

/// 6 -> 8 -> relu -> 8 -> BatchNorm -> 3, the norm with `momentum`: over
/// 8 features, or (`spatial`) over 2 channels of 4 positions each. One norm
/// only: a norm after another sees inputs normalised per micro-batch,
/// which no pipeline can make equal to the whole batch's.
pub(crate) fn bn_layers(momentum: f64, spatial: bool) -> Vec<UnitFactory> {
    bn_layers_with(
        candle_nn::BatchNormConfig {
            momentum,
            ..Default::default()
        },
        spatial,
    )
}

/// [`bn_layers`] with the norm's whole configuration.
fn bn_layers_with(config: candle_nn::BatchNormConfig, spatial: bool) -> Vec<UnitFactory> {
    let config = move || config;
    let (channels, shape) = if spatial {
        (2, vec![2, 4])
    } else {
        (8, vec![8])
    };
    vec![
        unit(|vb| linear(6, 8, vb.pp("l1"))),
        unit(|_| Ok(Activation::Relu)),
        unit(|vb| linear(8, 8, vb.pp("l2"))),
        unit(move |_| {
            let shape = shape.clone();
            Ok(candle_nn::func(move |x| {
                let mut dims = vec![x.dim(0)?];
                dims.extend(&shape);
                x.reshape(dims)
            }))
        }),
        unit(move |vb| candle_nn::batch_norm(channels, config(), vb.pp("bn"))),
        unit(|_| Ok(candle_nn::func(|x| x.flatten_from(1)))),
        unit(|vb| linear(8, 3, vb.pp("l3"))),
    ]
}

/// The layers built on one device, applied in order.
fn on_one_device(
    layers: &[UnitFactory],
    varmap: &VarMap,
) -> impl Fn(&Tensor, bool) -> candle_core::Result<Tensor> {
    let vb = VarBuilder::from_varmap(varmap, DType::F32, &Device::Cpu);
    let built: Vec<_> = layers.iter().map(|f| f(vb.clone()).unwrap()).collect();
    move |x: &Tensor, train: bool| {
        built
            .iter()
            .try_fold(x.clone(), |h, layer| layer.forward_t(&h, train))
    }
}

pub(crate) fn buffers_of(varmap: &VarMap) -> HashMap<String, Vec<f32>> {
    varmap
        .data()
        .lock()
        .unwrap()
        .iter()
        .filter(|(name, _)| candle_dp::is_batch_norm_buffer(name))
        .map(|(name, var)| {
            let v = var.as_tensor().flatten_all().unwrap().to_vec1::<f32>();
            (name.clone(), v.unwrap())
        })
        .collect()
}

fn bn_init(momentum: f64, spatial: bool) -> VarMap {
    let layers = bn_layers(momentum, spatial);
    let varmap = seeded_varmap(5, DType::F32, &Device::Cpu, |vb| {
        layers.iter().try_for_each(|f| f(vb.clone()).map(|_| ()))
    })
    .unwrap();
    // Start the statistics away from 0 and 1, so a lost update shows.
    for (name, var) in varmap.data().lock().unwrap().iter() {
        if candle_dp::is_batch_norm_buffer(name) {
            let shifted = var.as_tensor().affine(0.5, 0.25).unwrap();
            var.set(&shifted).unwrap();
        }
    }
    varmap
}

/// One device's run of [`bn_layers`]: the starting values, and after
/// `steps` training forwards of `x` the running statistics and the
/// evaluation output of `x`.
pub(crate) fn bn_reference(
    momentum: f64,
    spatial: bool,
    x: &Tensor,
    steps: usize,
) -> (VarMap, HashMap<String, Vec<f32>>, Tensor) {
    let start = bn_init(momentum, spatial);
    let reference = copy_of(&start);
    let one = on_one_device(&bn_layers(momentum, spatial), &reference);
    for _ in 0..steps {
        one(x, true).unwrap();
    }
    let eval = one(x, false).unwrap();
    (start, buffers_of(&reference), eval)
}

/// `rows` rows of 6 features and their classes (of 3), for the BatchNorm
/// layers ([`bn_layers`]).
pub(crate) fn bn_batch(rows: usize) -> (Tensor, Tensor) {
    let x = Tensor::randn(1f32, 3., (rows, 6), &Device::Cpu).unwrap();
    let y = Tensor::from_vec(
        (0..rows as u32).map(|i| i % 3).collect(),
        rows,
        &Device::Cpu,
    )
    .unwrap();
    (x, y)
}

/// One training step of `pipe` on `(x, y)` (cross-entropy), which must
/// succeed.
fn train_step(pipe: &Pipeline, x: &Tensor, y: &Tensor) {
    pipe.forward_backward(x, y, LossReduction::Mean, loss::cross_entropy)
        .unwrap();
}

/// Four threads stepping one pipeline at once on the same batch leave the
/// running statistics where four training forwards on one device do: each
/// step's commit of the statistics belongs to that step, under its lock
/// (before, the commit came after the lock was let go, and about one round
/// in 40 the next step read the statistics first: an update lost, the
/// running variance 0.12 away). Repeated so that a race shows.
#[test]
fn concurrent_steps_on_one_pipeline_lose_no_batch_norm_update() {
    within(240, || {
        let momentum = 0.3;
        let (x, y) = bn_batch(12);
        let threads = 4;
        let (start, want, _) = bn_reference(momentum, false, &x, threads);
        for round in 0..200 {
            let varmap = copy_of(&start);
            let pipe = Pipeline::builder(&varmap, DType::F32, &cpu_devices(2))
                .chunks(3)
                .build(bn_layers(momentum, false))
                .unwrap();
            std::thread::scope(|s| {
                for _ in 0..threads {
                    s.spawn(|| train_step(&pipe, &x, &y));
                }
            });
            let diff = max_diff(&buffers_of(&varmap), &want);
            assert!(
                diff < 1e-5,
                "round {round}: the running statistics are {diff} from {threads} forwards' on one device"
            );
        }
    });
}

#[test]
fn batch_norm_running_statistics_equal_the_whole_batchs_for_any_micro_batches() {
    within(240, || {
        let momentum = 0.3; // not candle's default: nothing assumes it
        let (x, y) = bn_batch(26); // 13 micro-batches of 2 rows at most
        for spatial in [false, true] {
            let steps = 3;
            let (start, want, eval_want) = bn_reference(momentum, spatial, &x, steps);
            for stages in 1..=3 {
                // 26 chunks: one row per micro-batch (one value per
                // channel without the spatial dimensions).
                for chunks in [1, 2, 3, 5, 13, 26] {
                    for path in ["gpipe", "1f1b", "drop-in"] {
                        let varmap = copy_of(&start);
                        let schedule = if path == "gpipe" {
                            Schedule::GPipe
                        } else {
                            Schedule::OneFOneB
                        };
                        let pipe = Pipeline::builder(&varmap, DType::F32, &cpu_devices(stages))
                            .chunks(chunks)
                            .schedule(schedule)
                            .timeout(Duration::from_secs(60))
                            .build(bn_layers(momentum, spatial))
                            .unwrap();
                        for _ in 0..steps {
                            if path == "drop-in" {
                                let out = pipe.forward(&x).unwrap();
                                out.sum_all().unwrap().backward().unwrap();
                            } else {
                                pipe.forward_backward(&x, &y, LossReduction::Mean, |o, y| {
                                    loss::cross_entropy(o, y)
                                })
                                .unwrap();
                            }
                        }
                        let diff = max_diff(&buffers_of(&varmap), &want);
                        let case =
                            format!("{stages} stages, {chunks} chunks, {path}, spatial {spatial}");
                        assert!(diff < 1e-5, "{case}: running statistics differ by {diff}");
                        // Evaluation reads them: the same output as one device.
                        let eval = pipe.forward_t(&x, false).unwrap();
                        let eval_diff = (eval - &eval_want)
                            .unwrap()
                            .abs()
                            .unwrap()
                            .max_all()
                            .unwrap()
                            .to_scalar::<f32>()
                            .unwrap();
                        assert!(
                            eval_diff < 1e-4,
                            "{case}: evaluation differs by {eval_diff}"
                        );
                    }
                }
            }
        }
    });
}

/// A layer whose `n`-th forward (counting from 1) fails.
struct FailsOnCall {
    calls: std::sync::atomic::AtomicUsize,
    n: usize,
}

impl Module for FailsOnCall {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let call = self.calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
        if call == self.n {
            candle_core::bail!("forward number {call} fails");
        }
        Ok(x.clone())
    }
}

#[test]
fn batch_norm_buffers_are_untouched_by_a_failed_step() {
    within(60, || {
        let varmap = bn_init(0.1, true);
        let before = buffers_of(&varmap);
        let mut layers = bn_layers(0.1, true);
        // The last stage fails on the second micro-batch, when the first
        // stage (GPipe) has run the forwards of both.
        layers.push(unit(|_| {
            Ok(FailsOnCall {
                calls: Default::default(),
                n: 2,
            })
        }));
        let pipe = Pipeline::builder(&varmap, DType::F32, &cpu_devices(2))
            .balance(Balance::Explicit(vec![7, 1]))
            .chunks(2)
            .schedule(Schedule::GPipe)
            .build(layers)
            .unwrap();
        let (x, y) = data(4);
        let err = failed_step(&pipe, &x, &y);
        assert!(
            matches!(
                err,
                Error::Stage {
                    stage: 1,
                    micro_batch: 1,
                    ..
                }
            ),
            "{err}"
        );
        assert_eq!(
            buffers_of(&varmap),
            before,
            "a failed step changed the buffers"
        );
        // The next step commits.
        pipe.forward_backward(&x, &y, LossReduction::Mean, |o, y| {
            loss::cross_entropy(o, y)
        })
        .unwrap();
        assert_ne!(buffers_of(&varmap), before);
    });
}

/// A thread rank whose every all-reduce fails (before reaching the other
/// ranks, so that none waits): what a dead network does to DDP's
/// gradient reduction.
#[derive(Debug)]
struct AllReduceFails(std::sync::Arc<dyn candle_dp::comm::ProcessGroup>);

impl candle_dp::comm::ProcessGroup for AllReduceFails {
    fn membership(&self) -> &candle_dp::comm::Membership {
        self.0.membership()
    }
    fn all_reduce(
        &self,
        _: &Tensor,
        _: candle_dp::comm::ReduceOp,
    ) -> candle_dp::comm::Result<Tensor> {
        Err(candle_dp::comm::CommError::InvalidInput {
            rank: self.rank(),
            op: "all_reduce",
            culprit: self.rank(),
            reason: "the network is down (test)".into(),
        })
    }
    fn broadcast(&self, t: &Tensor, root: usize) -> candle_dp::comm::Result<Tensor> {
        self.0.broadcast(t, root)
    }
    fn all_gather(&self, t: &Tensor) -> candle_dp::comm::Result<Vec<Tensor>> {
        self.0.all_gather(t)
    }
    fn gather(&self, t: &Tensor, root: usize) -> candle_dp::comm::Result<Option<Vec<Tensor>>> {
        self.0.gather(t, root)
    }
    fn scatter(&self, ts: Option<&[Tensor]>, root: usize) -> candle_dp::comm::Result<Tensor> {
        self.0.scatter(ts, root)
    }
    fn reduce(
        &self,
        t: &Tensor,
        root: usize,
        op: candle_dp::comm::ReduceOp,
    ) -> candle_dp::comm::Result<Option<Tensor>> {
        self.0.reduce(t, root, op)
    }
    fn barrier(&self) -> candle_dp::comm::Result<()> {
        self.0.barrier()
    }
    fn all_gather_bytes(&self, bytes: Vec<u8>) -> candle_dp::comm::Result<Vec<Vec<u8>>> {
        self.0.all_gather_bytes(bytes)
    }
    fn abort(&self, reason: &str) {
        self.0.abort(reason)
    }
    fn failure(&self) -> Option<candle_dp::comm::Failure> {
        self.0.failure()
    }
}

#[test]
fn a_pipeline_in_ddp_whose_all_reduce_fails_leaves_the_batch_norm_buffers_untouched() {
    within(60, || {
        let init = bn_init(0.1, true);
        let (x, y) = data(8);
        let ranks = spawn_with(2, bounded_group(), move |mut ctx| {
            let varmap = copy_of(&init);
            // Every all-reduce fails: the step's gradients cannot be
            // averaged (DDP's construction needs none).
            ctx.pg = std::sync::Arc::new(AllReduceFails(ctx.pg));
            let pipe = Pipeline::builder(&varmap, DType::F32, &cpu_devices(2))
                .chunks(2)
                .build(bn_layers(0.1, true))?;
            let mut ddp = DistributedDataParallel::from_module(
                ctx.process_group(),
                &varmap,
                pipe,
                DdpConfig::default(),
            )?;
            let before = (buffers_of(&varmap), values(&varmap));
            let (x, y) = (x.narrow(0, 4 * ctx.rank, 4)?, y.narrow(0, 4 * ctx.rank, 4)?);
            let err = ddp
                .forward_backward(&x, &y, LossReduction::Mean, |o, y| {
                    loss::cross_entropy(o, y)
                })
                .unwrap_err();
            anyhow::ensure!(err.to_string().contains("network is down"), "{err}");
            Ok((before, (buffers_of(&varmap), values(&varmap))))
        })
        .unwrap();
        for (rank, (before, after)) in ranks.into_iter().enumerate() {
            assert!(
                before == after,
                "rank {rank}: the failed step moved the buffers"
            );
        }
    });
}

#[test]
fn a_layer_with_a_batch_norm_inside_keeps_per_micro_batch_statistics() {
    // Linear and BatchNorm in one layer, or a ReLU before the norm (the
    // identity on inputs that are all positive): the layer's input is not
    // what the norm sees, so its statistics cannot be deferred; they must
    // be exactly the per-micro-batch updates, not something made up.
    // Widths 4 and 5 (no two-row input can tell; the check's own probe can).
    type Block = fn() -> UnitFactory;
    let linear_then_norm: Block = || {
        unit(|vb| {
            let lin = linear(4, 4, vb.pp("lin"))?;
            let bn = candle_nn::batch_norm(4, 1e-5, vb.pp("bn"))?;
            Ok(candle_nn::func_t(move |x, train| {
                candle_nn::ModuleT::forward_t(&bn, &lin.forward(x)?, train)
            }))
        })
    };
    let relu_then_norm: Block = || {
        unit(|vb| {
            let bn = candle_nn::batch_norm(5, 1e-5, vb.pp("bn"))?;
            Ok(candle_nn::func_t(move |x, train| {
                candle_nn::ModuleT::forward_t(&bn, &x.relu()?, train)
            }))
        })
    };
    for (width, block) in [(4, linear_then_norm), (5, relu_then_norm)] {
        within(60, move || {
            let layers = || {
                vec![
                    unit(move |vb| linear(6, width, vb.pp("in"))),
                    block(),
                    unit(move |vb| linear(width, 3, vb.pp("out"))),
                ]
            };
            let start = seeded_varmap(3, DType::F32, &Device::Cpu, |vb| {
                layers().iter().try_for_each(|f| f(vb.clone()).map(|_| ()))
            })
            .unwrap();
            let (x, y) = data(6);
            let reference = copy_of(&start);
            let one = on_one_device(&layers(), &reference);
            for m in 0..3 {
                one(&x.narrow(0, 2 * m, 2).unwrap(), true).unwrap();
            }
            let varmap = copy_of(&start);
            let pipe = Pipeline::builder(&varmap, DType::F32, &cpu_devices(2))
                .chunks(3)
                .build(layers())
                .unwrap();
            pipe.forward_backward(&x, &y, LossReduction::Mean, |o, y| {
                loss::cross_entropy(o, y)
            })
            .unwrap();
            let diff = max_diff(&buffers_of(&varmap), &buffers_of(&reference));
            assert!(diff < 1e-6, "width {width}: {diff}");
        });
    }
}

#[test]
fn batch_norm_without_mean_removal_gets_the_whole_batchs_statistics_too() {
    // `remove_mean: false` updates the running variance from the mean
    // square times n / (n - 1): a function of the count as well as of the
    // mean and variance, which two-row micro-batches cannot reveal.
    within(240, || {
        let config = candle_nn::BatchNormConfig {
            remove_mean: false,
            momentum: 0.3,
            ..Default::default()
        };
        let (x, y) = bn_batch(12);
        for spatial in [false, true] {
            let layers = || bn_layers_with(config, spatial);
            let start = seeded_varmap(5, DType::F32, &Device::Cpu, |vb| {
                layers().iter().try_for_each(|f| f(vb.clone()).map(|_| ()))
            })
            .unwrap();
            let reference = copy_of(&start);
            let one = on_one_device(&layers(), &reference);
            for _ in 0..2 {
                one(&x, true).unwrap();
            }
            let want = buffers_of(&reference);
            for chunks in [2, 3, 6, 12] {
                let varmap = copy_of(&start);
                let pipe = Pipeline::builder(&varmap, DType::F32, &cpu_devices(2))
                    .chunks(chunks)
                    .build(layers())
                    .unwrap();
                for _ in 0..2 {
                    train_step(&pipe, &x, &y);
                }
                let got = buffers_of(&varmap);
                let diff = max_diff(&got, &want);
                assert!(
                    diff < 1e-5,
                    "{chunks} chunks, spatial {spatial}: running statistics differ by {diff}: {got:?} against {want:?}"
                );
            }
        }
    });
}

#[test]
fn batch_norm_buffers_are_not_reported_as_untrained() {
    within(60, || {
        let varmap = bn_init(0.1, false);
        let pipe = Pipeline::builder(&varmap, DType::F32, &cpu_devices(2))
            .chunks(2)
            .build(bn_layers(0.1, false))
            .unwrap();
        let (x, y) = data(4);
        let step = pipe
            .forward_backward(&x, &y, LossReduction::Mean, |o, y| {
                loss::cross_entropy(o, y)
            })
            .unwrap();
        assert!(
            step.vars_without_grad().is_empty(),
            "{:?}",
            step.vars_without_grad()
        );
        // A parameter that really gets no gradient is still named.
        let varmap = bn_init(0.1, false);
        let mut layers = bn_layers(0.1, false);
        layers.push(unit(|vb| {
            let unused = vb.get(3, "unused")?;
            Ok(candle_nn::func(move |x| {
                let _ = &unused;
                Ok(x.clone())
            }))
        }));
        let pipe = Pipeline::builder(&varmap, DType::F32, &cpu_devices(2))
            .build(layers)
            .unwrap();
        let step = pipe
            .forward_backward(&x, &y, LossReduction::Mean, |o, y| {
                loss::cross_entropy(o, y)
            })
            .unwrap();
        assert_eq!(step.vars_without_grad(), ["unused".to_string()]);
    });
}

#[test]
fn a_drop_in_forward_that_fails_after_the_stages_leaves_the_buffers_untouched() {
    within(60, || {
        let varmap = bn_init(0.1, false);
        let before = buffers_of(&varmap);
        let mut layers = bn_layers(0.1, false);
        // Each micro-batch's output becomes a scalar: the stages succeed,
        // but the outputs of several micro-batches cannot be concatenated.
        layers.push(unit(|_| Ok(candle_nn::func(|x| x.sum_all()))));
        let pipe = Pipeline::builder(&varmap, DType::F32, &cpu_devices(2))
            .chunks(2)
            .build(layers)
            .unwrap();
        let (x, _) = data(4);
        assert!(pipe.forward(&x).is_err());
        assert_eq!(
            buffers_of(&varmap),
            before,
            "a failed forward changed the buffers"
        );
        // One micro-batch needs no concatenation: that forward commits.
        pipe.forward(&x.narrow(0, 0, 1).unwrap()).unwrap();
        assert_ne!(buffers_of(&varmap), before);
    });
}

#[test]
fn a_batch_norm_buffer_on_two_stages_is_refused() {
    let norm = || unit(|vb| candle_nn::batch_norm(6, 1e-5, vb.pp("bn")));
    let err = Pipeline::builder(&VarMap::new(), DType::F32, &cpu_devices(2))
        .build(vec![norm(), norm()])
        .unwrap_err();
    assert!(
        matches!(&err, Error::InvalidBalance { reason, .. } if reason.contains("bn.running_")),
        "{err}"
    );
}

/// Needs a GPU (on CPU every stage is the same device): a CPU stage and a
/// CUDA stage share a weight; the CUDA stage works on a copy, and the
/// weight (on the CPU, where it was created) gets the sum of both stages'
/// gradients, as on one device.
#[cfg(feature = "cuda")]
#[test]
fn a_weight_tied_across_a_cpu_and_a_gpu_stage_gets_the_sum_of_its_gradients() {
    within(120, || {
        let gpu = Device::new_cuda_with_stream(0).unwrap();
        let tied = || unit(|vb| Ok(linear_no_bias(vb.get((4, 4), "w")?)));
        let layers = vec![tied(), unit(|_| Ok(Activation::Relu)), tied()];
        let varmap = VarMap::new();
        let pipe = Pipeline::builder(&varmap, DType::F32, &[Device::Cpu, gpu])
            .balance(Balance::Explicit(vec![2, 1]))
            .chunks(3)
            .build(layers)
            .unwrap();
        let x = Tensor::randn(0f32, 1., (5, 4), &Device::Cpu).unwrap();
        let y = Tensor::zeros(5, DType::F32, &Device::Cpu).unwrap();
        let w = varmap.data().lock().unwrap()["w"].clone();
        assert!(w.device().is_cpu());
        for _ in 0..2 {
            let step = pipe
                .forward_backward(&x, &y, LossReduction::Sum, |out, _| out.sum_all())
                .unwrap();
            let lin = linear_no_bias(w.as_tensor().clone());
            let out = lin
                .forward(&lin.forward(&x).unwrap().relu().unwrap())
                .unwrap();
            let want = out.sum_all().unwrap().backward().unwrap();
            let got = step.grads.get(w.as_tensor()).unwrap();
            assert!(got.device().is_cpu());
            let diff = (got - want.get(w.as_tensor()).unwrap())
                .unwrap()
                .abs()
                .unwrap()
                .max_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap();
            assert!(diff < 1e-4, "{diff}");
            // The GPU stage must see the new value at the next step.
            let updated = (w.as_tensor() - (got * 0.1).unwrap()).unwrap();
            w.set(&updated).unwrap();
        }
        // The drop-in path could not route the GPU stage's gradient back.
        let err = pipe.forward(&x).map(|_| ()).unwrap_err();
        assert!(
            matches!(&err, Error::DropInWithCopiedVar { stage: 1, var, .. } if var == "w"),
            "{err}"
        );
    });
}

/// Needs a GPU: stages 0 and 2 on the CPU, 1 and 3 on the GPU, so every
/// message between stages crosses devices, both ways, twice per
/// micro-batch; the gradients are one device's.
#[cfg(feature = "cuda")]
#[test]
fn an_interleaved_pipeline_over_a_cpu_and_a_gpu_matches_one_device() {
    within(120, || {
        let gpu = Device::new_cuda_with_stream(0).unwrap();
        let start = init();
        let (x, y) = data(13);
        let (want, want_loss) = one_device_step(&start, &x, &y);
        for chunks in [1, 2, 5] {
            let varmap = copy_of(&start);
            let pipe = Pipeline::builder(&varmap, DType::F32, &[Device::Cpu, gpu.clone()])
                .schedule(interleaved(2))
                .chunks(chunks)
                .timeout(Duration::from_secs(60))
                .build(layers())
                .unwrap();
            let step = pipe
                .forward_backward(&x, &y, LossReduction::Mean, loss::cross_entropy)
                .unwrap();
            let got: HashMap<String, Vec<f32>> = grads_by_name(&varmap, &step.grads);
            let diff = max_diff(&got, &want);
            assert!(diff < 1e-4, "{chunks} micro-batches: {diff}");
            let l = step
                .loss
                .to_device(&Device::Cpu)
                .unwrap()
                .to_scalar::<f32>()
                .unwrap();
            assert!((l - want_loss).abs() < 1e-4, "loss {l} vs {want_loss}");
        }
    });
}

/// A layer that keeps the mean of its input in a `running_mean` of its own
/// (no `running_var`: not a BatchNorm pair).
struct MeanTracker {
    stat: candle_core::Var,
}

impl Module for MeanTracker {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.stat.set(&x.mean(0)?)?;
        Ok(x.clone())
    }
}

#[test]
fn a_buffer_outside_a_batch_norm_pair_is_committed_too() {
    within(60, || {
        let varmap = VarMap::new();
        let layers = vec![
            unit(|vb| linear(6, 3, vb.pp("l1"))),
            unit(|vb| {
                let stat =
                    vb.get_with_hints(3, "track.running_mean", candle_nn::Init::Const(0.))?;
                Ok(MeanTracker {
                    stat: candle_core::Var::from_tensor(&stat)?,
                })
            }),
        ];
        let pipe = Pipeline::builder(&varmap, DType::F32, &cpu_devices(2))
            .chunks(1)
            .build(layers)
            .unwrap();
        let (x, y) = data(4);
        pipe.forward_backward(&x, &y, LossReduction::Mean, loss::cross_entropy)
            .unwrap();
        let l1 = varmap.data().lock().unwrap()["l1.weight"].clone();
        let b1 = varmap.data().lock().unwrap()["l1.bias"].clone();
        let want = candle_nn::Linear::new(l1.as_tensor().clone(), Some(b1.as_tensor().clone()))
            .forward(&x)
            .unwrap()
            .mean(0)
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        assert_eq!(buffers_of(&varmap)["track.running_mean"], want);
    });
}

/// Needs a GPU: a stage on CUDA's per-thread default stream is refused (the
/// optimizer on the caller's thread and the stage's worker would use two
/// unordered streams).
#[cfg(feature = "cuda")]
#[test]
fn a_stage_on_the_per_thread_default_stream_is_refused() {
    let varmap = VarMap::new();
    let gpu = Device::new_cuda(0).unwrap();
    let err = Pipeline::builder(&varmap, DType::F32, &[Device::Cpu, gpu])
        .build(layers())
        .map(|_| ())
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::ImplicitCudaStream {
                role: "stage",
                index: 1,
                ..
            }
        ),
        "{err}"
    );
}

/// Bits of every value of `t`.
fn bits(t: &Tensor) -> Vec<u32> {
    t.flatten_all()
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
        .into_iter()
        .map(f32::to_bits)
        .collect()
}

/// Two training steps of `layers()` from `start`: each step's loss and
/// gradients (bits, by name), then the variables and buffers after them.
#[allow(clippy::too_many_arguments)]
fn two_steps(
    start: &VarMap,
    layers: fn() -> Vec<UnitFactory>,
    stages: usize,
    chunks: usize,
    schedule: Schedule,
    checkpoint: candle_dp::pipeline::Checkpoint,
    x: &Tensor,
    y: &Tensor,
) -> Vec<(String, Vec<u32>)> {
    let varmap = copy_of(start);
    let pipe = Pipeline::builder(&varmap, DType::F32, &cpu_devices(stages))
        .chunks(chunks)
        .schedule(schedule)
        .checkpoint(checkpoint)
        .timeout(Duration::from_secs(60))
        .build(layers())
        .unwrap();
    let mut got = Vec::new();
    for step in 0..2 {
        let s = pipe
            .forward_backward(x, y, LossReduction::Mean, loss::cross_entropy)
            .unwrap();
        got.push((format!("loss {step}"), bits(&s.loss)));
        let mut names: Vec<(String, candle_core::Var)> =
            varmap.data().lock().unwrap().clone().into_iter().collect();
        names.sort_by(|a, b| a.0.cmp(&b.0));
        for (name, var) in &names {
            if let Some(g) = s.grads.get(var.as_tensor()) {
                got.push((format!("grad {name} {step}"), bits(g)));
            }
            // Plain SGD, so that the second step starts elsewhere.
            if let Some(g) = s.grads.get(var.as_tensor()) {
                var.set(&(var.as_tensor() - (g * 0.1).unwrap()).unwrap())
                    .unwrap();
            }
        }
        for (name, var) in &names {
            got.push((format!("value {name} {step}"), bits(var.as_tensor())));
        }
    }
    got
}

#[test]
fn checkpointing_gives_the_losses_gradients_and_batch_norm_statistics_of_never_bit_for_bit() {
    use candle_dp::pipeline::Checkpoint;
    within(300, || {
        // A deferred BatchNorm (its own layer), and one inside a block,
        // whose updates stay per micro-batch: a recomputation must count
        // neither twice.
        let deferred: fn() -> Vec<UnitFactory> = || bn_layers(0.3, false);
        let inside: fn() -> Vec<UnitFactory> = || {
            vec![
                unit(|vb| linear(6, 4, vb.pp("in"))),
                unit(|vb| {
                    let lin = linear(4, 4, vb.pp("lin"))?;
                    let bn = candle_nn::batch_norm(4, 1e-5, vb.pp("bn"))?;
                    Ok(candle_nn::func_t(move |x, train| {
                        candle_nn::ModuleT::forward_t(&bn, &lin.forward(x)?, train)
                    }))
                }),
                unit(|_| Ok(Activation::Relu)),
                unit(|vb| linear(4, 3, vb.pp("out"))),
            ]
        };
        let (x, y) = data(10);
        for (name, layers) in [("deferred", deferred), ("inside a block", inside)] {
            let start = seeded_varmap(9, DType::F32, &Device::Cpu, |vb| {
                layers().iter().try_for_each(|f| f(vb.clone()).map(|_| ()))
            })
            .unwrap();
            for schedule in [Schedule::GPipe, Schedule::OneFOneB] {
                for (stages, chunks) in [(1, 3), (2, 1), (2, 4), (3, 5)] {
                    let never = two_steps(
                        &start,
                        layers,
                        stages,
                        chunks,
                        schedule,
                        Checkpoint::Never,
                        &x,
                        &y,
                    );
                    for mode in [Checkpoint::ExceptLast, Checkpoint::Always] {
                        let got = two_steps(&start, layers, stages, chunks, schedule, mode, &x, &y);
                        for ((what, a), (_, b)) in got.iter().zip(&never) {
                            assert!(
                                a == b,
                                "{name}, {schedule:?}, {stages} stages, {chunks} micro-batches, {mode:?}: {what} differs"
                            );
                        }
                        assert_eq!(got.len(), never.len());
                    }
                }
            }
        }
    });
}

/// A `VarMap` of one 4x4 weight `w`, the tied weight of the tests that
/// share it between stages.
fn tied_start() -> VarMap {
    let start = VarMap::new();
    start
        .get(
            (4, 4),
            "w",
            candle_nn::init::DEFAULT_KAIMING_NORMAL,
            DType::F32,
            &Device::Cpu,
        )
        .unwrap();
    start
}

#[test]
fn a_tied_weight_and_the_drop_in_path_are_unchanged_by_checkpointing() {
    within(120, || {
        use candle_dp::pipeline::Checkpoint;
        let tied = || unit(|vb| Ok(linear_no_bias(vb.get((4, 4), "w")?)));
        let x = Tensor::randn(0f32, 1., (5, 4), &Device::Cpu).unwrap();
        let y = Tensor::zeros(5, DType::F32, &Device::Cpu).unwrap();
        let start = tied_start();
        let run = |checkpoint| {
            let varmap = copy_of(&start);
            let pipe = Pipeline::builder(&varmap, DType::F32, &cpu_devices(2))
                .balance(Balance::Explicit(vec![2, 1]))
                .chunks(3)
                .checkpoint(checkpoint)
                .build(vec![tied(), unit(|_| Ok(Activation::Relu)), tied()])
                .unwrap();
            let w = varmap.data().lock().unwrap()["w"].clone();
            let step = pipe
                .forward_backward(&x, &y, LossReduction::Sum, |out, _| out.sum_all())
                .unwrap();
            let fast = bits(step.grads.get(w.as_tensor()).unwrap());
            // The drop-in path keeps its graph: checkpointing leaves it alone.
            let dropin = pipe
                .forward(&x)
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap();
            (fast, bits(dropin.get(w.as_tensor()).unwrap()))
        };
        let never = run(Checkpoint::Never);
        assert_eq!(run(Checkpoint::Always), never);
        assert_eq!(run(Checkpoint::ExceptLast), never);
    });
}

#[test]
fn a_dropout_layer_fails_a_checkpointed_step_named_and_changes_nothing() {
    use candle_dp::pipeline::Checkpoint;
    let layers = || {
        vec![
            unit(|vb| linear(6, 10, vb.pp("l1"))),
            unit(|_| Ok(candle_nn::Dropout::new(0.5))),
            unit(|vb| linear(10, 3, vb.pp("l2"))),
        ]
    };
    let (x, y) = data(8);
    within(60, move || {
        let varmap = VarMap::new();
        let pipe = Pipeline::builder(&varmap, DType::F32, &cpu_devices(2))
            .balance(Balance::Explicit(vec![1, 2]))
            .chunks(2)
            .checkpoint(Checkpoint::Always)
            .build(layers())
            .unwrap();
        let before = values(&varmap);
        let err = pipe
            .forward_backward(&x, &y, LossReduction::Mean, |o, y| {
                loss::cross_entropy(o, y)
            })
            .unwrap_err();
        let message = err.to_string();
        assert!(
            matches!(err, Error::Stage { stage: 1, .. })
                && message.contains("layer 1 gives another output")
                && message.contains("Checkpoint::Never"),
            "{message}"
        );
        assert_eq!(values(&varmap), before, "nothing trained");
        // Without checkpointing the same pipeline trains.
        let pipe = Pipeline::builder(&varmap, DType::F32, &cpu_devices(2))
            .balance(Balance::Explicit(vec![1, 2]))
            .chunks(2)
            .build(layers())
            .unwrap();
        pipe.forward_backward(&x, &y, LossReduction::Mean, |o, y| {
            loss::cross_entropy(o, y)
        })
        .unwrap();
    });
}

/// Rows of `x` set to zero: a Dropout on them gives the same output
/// whatever its mask.
fn zero_rows(x: &Tensor, rows: usize) -> Tensor {
    let (n, cols) = x.dims2().unwrap();
    let zeros = Tensor::zeros((rows, cols), x.dtype(), x.device()).unwrap();
    Tensor::cat(&[&zeros, &x.narrow(0, rows, n - rows).unwrap()], 0).unwrap()
}

#[test]
fn every_recomputed_micro_batch_is_checked_not_only_the_first() {
    use candle_dp::pipeline::Checkpoint;
    // Micro-batch 0 is all padding (zero rows): the Dropout in front gives
    // it the same output whatever its mask, so its recomputation matches.
    // Micro-batch 1's does not, in either mode that recomputes it.
    let layers = || {
        vec![
            unit(|_| Ok(candle_nn::Dropout::new(0.5))),
            unit(|vb| linear(6, 10, vb.pp("l1"))),
            unit(|vb| linear(10, 3, vb.pp("l2"))),
        ]
    };
    let (x, y) = data(6);
    let x = zero_rows(&x, 2);
    within(60, move || {
        for (checkpoint, schedule) in [
            (Checkpoint::Always, Schedule::OneFOneB),
            (Checkpoint::ExceptLast, Schedule::OneFOneB),
            (Checkpoint::Always, Schedule::GPipe),
            (
                Checkpoint::ExceptLast,
                Schedule::Interleaved1F1B {
                    stages_per_device: 1,
                },
            ),
        ] {
            let varmap = VarMap::new();
            let pipe = Pipeline::builder(&varmap, DType::F32, &cpu_devices(2))
                .balance(Balance::Explicit(vec![2, 1]))
                .chunks(3)
                .schedule(schedule)
                .checkpoint(checkpoint)
                .build(layers())
                .unwrap();
            let before = values(&varmap);
            let err = pipe
                .forward_backward(&x, &y, LossReduction::Mean, |o, y| {
                    loss::cross_entropy(o, y)
                })
                .unwrap_err();
            let message = err.to_string();
            assert!(
                matches!(
                    err,
                    Error::Stage {
                        stage: 0,
                        micro_batch: 1,
                        ..
                    }
                ) && message.contains("layer 0 gives another output")
                    && message.contains("micro-batch 1"),
                "{checkpoint:?}, {schedule:?}: {message}"
            );
            assert_eq!(values(&varmap), before, "{checkpoint:?}: nothing trained");
        }
    });
}

#[test]
fn a_random_layer_whose_output_a_later_layer_hides_is_caught() {
    use candle_dp::pipeline::Checkpoint;
    // A zero-initialised projection after the Dropout (as in ReZero or a
    // LoRA adapter): the stage's output is the bias whatever the mask, but
    // the projection's weight gradient depends on it.
    let layers = || {
        vec![
            unit(|vb| linear(6, 10, vb.pp("l1"))),
            unit(|_| Ok(candle_nn::Dropout::new(0.5))),
            unit(|vb| linear(10, 3, vb.pp("l2"))),
        ]
    };
    let (x, y) = data(8);
    within(60, move || {
        let varmap = VarMap::new();
        let pipe = Pipeline::builder(&varmap, DType::F32, &cpu_devices(1))
            .chunks(2)
            .checkpoint(Checkpoint::Always)
            .build(layers())
            .unwrap();
        {
            let data = varmap.data().lock().unwrap();
            let w = &data["l2.weight"];
            w.set(&w.zeros_like().unwrap()).unwrap();
        }
        let err = pipe
            .forward_backward(&x, &y, LossReduction::Mean, |o, y| {
                loss::cross_entropy(o, y)
            })
            .unwrap_err();
        let message = err.to_string();
        assert!(
            message.contains("layer 1 gives another output") && message.contains("micro-batch 0"),
            "{message}"
        );
    });
}

#[test]
fn checkpointing_lowers_each_stages_peak_of_saved_activations() {
    within(120, || {
        use candle_dp::pipeline::Checkpoint;
        let start = init();
        let (x, y) = data(16);
        let peaks = |checkpoint| {
            let varmap = copy_of(&start);
            let pipe = Pipeline::builder(&varmap, DType::F32, &cpu_devices(2))
                .chunks(4)
                .schedule(Schedule::GPipe)
                .checkpoint(checkpoint)
                .build(layers())
                .unwrap();
            pipe.forward_backward(&x, &y, LossReduction::Mean, |o, y| {
                loss::cross_entropy(o, y)
            })
            .unwrap();
            pipe.last_timings().peak_saved_bytes
        };
        let never = peaks(Checkpoint::Never);
        let always = peaks(Checkpoint::Always);
        for (stage, (a, n)) in always.iter().zip(&never).enumerate() {
            assert!(
                a < n,
                "stage {stage}: {a} bytes with Always, {n} with Never"
            );
            // GPipe without checkpointing holds all 4 micro-batches' graphs;
            // with it, one recomputed graph at a time, which the peak counts.
            assert!(
                *a >= n / 4,
                "stage {stage}: {a} bytes with Always, under one micro-batch's graph ({n} / 4)"
            );
        }
    });
}

// ------------------------------------------------------ interleaved 1F1B

fn interleaved(stages_per_device: usize) -> Schedule {
    Schedule::Interleaved1F1B { stages_per_device }
}

/// Devices and stages per device whose stages fit the 6 layers of
/// [`layers`] (and the 7 of [`bn_layers`]).
const INTERLEAVINGS: [(usize, usize); 5] = [(1, 2), (1, 3), (2, 2), (2, 3), (3, 2)];

#[test]
fn interleaved_stages_give_the_bits_of_one_f_one_b_over_as_many_devices_and_match_one_device() {
    use candle_dp::pipeline::Checkpoint;
    within(300, || {
        let start = init();
        let (x, y) = data(13);
        let (want, _) = one_device_step(&start, &x, &y);
        for (devices, per_device) in INTERLEAVINGS {
            for chunks in 1..=13 {
                let what = format!("{devices} devices x {per_device}, {chunks} micro-batches");
                let stages = devices * per_device;
                let flat = two_steps(
                    &start,
                    layers,
                    stages,
                    chunks,
                    Schedule::OneFOneB,
                    Checkpoint::Never,
                    &x,
                    &y,
                );
                let got = two_steps(
                    &start,
                    layers,
                    devices,
                    chunks,
                    interleaved(per_device),
                    Checkpoint::Never,
                    &x,
                    &y,
                );
                assert_eq!(got.len(), flat.len(), "{what}");
                for ((name, a), (_, b)) in got.iter().zip(&flat) {
                    assert!(
                        a == b,
                        "{what}: {name} differs from 1F1B on {stages} devices"
                    );
                }
                // Against one device, on both paths.
                let varmap = copy_of(&start);
                let pipe = pipeline(&varmap, devices, chunks, interleaved(per_device));
                assert_eq!(pipe.balance().len(), stages, "{what}");
                let step = pipe
                    .forward_backward(&x, &y, LossReduction::Mean, loss::cross_entropy)
                    .unwrap();
                let diff = max_diff(&grads_by_name(&varmap, &step.grads), &want);
                assert!(diff < 1e-5, "{what}: {diff}");
                let timings = pipe.last_timings();
                assert_eq!(timings.busy.len(), devices, "{what}: busy per device");
                assert_eq!(timings.peak_saved_bytes.len(), devices, "{what}");
                let out = pipe.forward(&x).unwrap();
                let l = loss::cross_entropy(&out, &y).unwrap();
                let diff = max_diff(&grads_by_name(&varmap, &l.backward().unwrap()), &want);
                assert!(diff < 1e-5, "{what}, drop-in: {diff}");
            }
        }
    });
}

#[test]
fn interleaved_stages_keep_batch_norm_statistics_and_checkpointing_exact() {
    use candle_dp::pipeline::Checkpoint;
    within(300, || {
        let deferred: fn() -> Vec<UnitFactory> = || bn_layers(0.3, false);
        let (x, y) = data(10);
        let start = seeded_varmap(9, DType::F32, &Device::Cpu, |vb| {
            deferred()
                .iter()
                .try_for_each(|f| f(vb.clone()).map(|_| ()))
        })
        .unwrap();
        for (devices, per_device) in INTERLEAVINGS {
            for chunks in [1, 3, 4, 7] {
                let flat = two_steps(
                    &start,
                    deferred,
                    devices * per_device,
                    chunks,
                    Schedule::OneFOneB,
                    Checkpoint::Never,
                    &x,
                    &y,
                );
                for mode in [
                    Checkpoint::Never,
                    Checkpoint::ExceptLast,
                    Checkpoint::Always,
                ] {
                    let got = two_steps(
                        &start,
                        deferred,
                        devices,
                        chunks,
                        interleaved(per_device),
                        mode,
                        &x,
                        &y,
                    );
                    assert_eq!(got.len(), flat.len());
                    for ((name, a), (_, b)) in got.iter().zip(&flat) {
                        assert!(
                            a == b,
                            "{devices} devices x {per_device}, {chunks} micro-batches, {mode:?}: {name} differs"
                        );
                    }
                }
            }
        }
    });
}

#[test]
fn a_weight_tied_across_two_stages_of_one_device_gets_the_sum_of_its_gradients() {
    within(60, || {
        // Stages 0 and 2 (both on device 0 of 2) use the same `w`.
        let tied = || unit(|vb| Ok(linear_no_bias(vb.get((4, 4), "w")?)));
        let relu = || unit(|_| Ok(Activation::Relu));
        let x = Tensor::randn(0f32, 1., (5, 4), &Device::Cpu).unwrap();
        let y = Tensor::zeros(5, DType::F32, &Device::Cpu).unwrap();
        let start = tied_start();
        let grad = |devices: usize, schedule: Schedule| {
            let varmap = copy_of(&start);
            let pipe = Pipeline::builder(&varmap, DType::F32, &cpu_devices(devices))
                .schedule(schedule)
                .chunks(3)
                .build(vec![tied(), relu(), tied(), relu()])
                .unwrap();
            let step = pipe
                .forward_backward(&x, &y, LossReduction::Sum, |out, _| out.sum_all())
                .unwrap();
            let w = varmap.data().lock().unwrap()["w"].clone();
            bits(step.grads.get(w.as_tensor()).unwrap())
        };
        let got = grad(2, interleaved(2));
        assert_eq!(got, grad(4, Schedule::OneFOneB));
        let w = start.data().lock().unwrap()["w"].as_tensor().clone();
        let lin = linear_no_bias(w.clone());
        let h = lin.forward(&x).unwrap().relu().unwrap();
        let out = lin.forward(&h).unwrap().relu().unwrap().sum_all().unwrap();
        let want = out.backward().unwrap();
        let want: Vec<f32> = want
            .get(&w)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let got: Vec<f32> = got.into_iter().map(f32::from_bits).collect();
        let diff = got
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(diff < 1e-5, "{diff}");
    });
}

#[test]
fn a_failing_panicking_or_stuck_interleaved_stage_is_named_with_its_device() {
    for mode in ["error", "panic", "stuck"] {
        let err = within(60, move || {
            let varmap = VarMap::new();
            // Stage 2 of 4 (device 0 of 2) gets micro-batch 1's 99s.
            let x = Tensor::zeros((6, 4), DType::F32, &Device::Cpu).unwrap();
            let y = Tensor::new(&[0u32, 1, 0, 1, 0, 1], &Device::Cpu).unwrap();
            let pipe = Pipeline::builder(&varmap, DType::F32, &cpu_devices(2))
                .schedule(interleaved(2))
                .chunks(3)
                .timeout(Duration::from_millis(1500))
                .build(vec![
                    unit(|_| Ok(Activation::Relu)),
                    unit(|_| Ok(Activation::Relu)),
                    unit(move |_| Ok(Faulty { mode })),
                    unit(|vb| linear(4, 2, vb.pp("b"))),
                ])
                .unwrap();
            let marked = marked(&x);
            pipe.forward_backward(&marked, &y, LossReduction::Mean, loss::cross_entropy)
                .map(|_| ())
                .unwrap_err()
        });
        let message = err.to_string();
        match (mode, &err) {
            ("stuck", Error::StageTimeout { stage, doing, .. }) => {
                assert_eq!(*stage, 2, "{message}");
                assert!(doing.contains("forward of micro-batch 1"), "{message}");
            }
            (
                _,
                Error::Stage {
                    stage,
                    micro_batch,
                    phase,
                    device,
                    ..
                },
            ) if mode != "stuck" => {
                assert_eq!(
                    (*stage, *micro_batch, *phase),
                    (2, 1, "forward"),
                    "{message}"
                );
                assert_eq!(device, &candle_dp::device_label(&cpu_devices(2)[0]));
            }
            _ => panic!("{mode}: unexpected {message}"),
        }
    }
}

#[test]
fn an_interleaving_without_a_layer_for_every_stage_or_with_no_stage_is_refused() {
    within(60, || {
        let build = |per_device| {
            Pipeline::builder(&VarMap::new(), DType::F32, &cpu_devices(2))
                .schedule(interleaved(per_device))
                .build(layers())
        };
        // 2 devices x 4 stages = 8 stages for 6 layers.
        let err = build(4).unwrap_err();
        assert!(
            matches!(&err, Error::InvalidBalance { stages: 8, reason, .. } if reason.contains("at least one layer")),
            "{err}"
        );
        let err = build(0).unwrap_err();
        assert!(
            matches!(&err, Error::InvalidBalance { reason, .. } if reason.contains("at least 1 stage per device")),
            "{err}"
        );
        assert!(build(3).is_ok());
    });
}

#[test]
#[allow(deprecated)]
fn the_former_names_layer_and_layer_factory_still_build_a_unit() -> anyhow::Result<()> {
    use candle_dp::units::Units;
    let former: candle_dp::pipeline::LayerFactory =
        candle_dp::pipeline::layer(|vb| candle_nn::linear(2, 3, vb.pp("fc")));
    let varmap = candle_nn::VarMap::new();
    let vb = candle_nn::VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let units = Units::build(vb, &[former])?;
    assert_eq!(units.vars_of(0), ["fc.bias", "fc.weight"]);
    Ok(())
}
