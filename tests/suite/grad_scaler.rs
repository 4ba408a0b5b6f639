//! Dynamic loss scaling against real PyTorch's `torch.amp.GradScaler`
//! (`tests/data/scaler_reference.json`, `scripts/gen_scaler_reference.py`):
//! inputs with an inf, a NaN and values whose scaled gradient overflows at
//! chosen steps; the steps skipped, the scale and tracker after every
//! update, the parameters; a run that unscales to clip; a resume halfway.

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};
use candle_dp::launch::spawn;
use candle_dp::optim::{
    clip_grad_norm, GradScaler, GradScalerConfig, GradScalerState, Sgd, SgdConfig,
};
use candle_dp::Error;
use candle_nn::Optimizer;

#[derive(serde::Deserialize)]
struct Step {
    x: Vec<u32>,
    stepped: bool,
    scale: u32,
    growth_tracker: u64,
    w: Vec<u32>,
    total_norm: Option<u32>,
}

#[derive(serde::Deserialize)]
struct Halfway {
    after_step: usize,
    scale: u32,
    growth_tracker: u64,
}

#[derive(serde::Deserialize)]
struct Run {
    name: String,
    config: serde_json::Map<String, serde_json::Value>,
    clip: Option<f64>,
    w0: Vec<u32>,
    steps: Vec<Step>,
    halfway: Halfway,
}

#[derive(serde::Deserialize)]
struct File {
    torch: String,
    lr: f64,
    momentum: f64,
    runs: Vec<Run>,
}

fn reference() -> File {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/data/scaler_reference.json");
    let file: File = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
    assert!(file.torch.starts_with("2.15"), "{}", file.torch);
    file
}

fn f32s(bits: &[u32]) -> Vec<f32> {
    bits.iter().map(|&b| f32::from_bits(b)).collect()
}

fn config_of(run: &Run) -> GradScalerConfig {
    let mut config = GradScalerConfig::default();
    let get = |k: &str| run.config.get(k).and_then(|v| v.as_f64());
    if let Some(v) = get("init_scale") {
        config.init_scale = v;
    }
    if let Some(v) = get("growth_factor") {
        config.growth_factor = v;
    }
    if let Some(v) = get("backoff_factor") {
        config.backoff_factor = v;
    }
    if let Some(v) = get("growth_interval") {
        config.growth_interval = v as u64;
    }
    config
}

/// Replays `run`'s steps `from..` on `w` and `opt` with `scaler`, checking
/// each against PyTorch; the largest relative difference of the weights.
fn replay(run: &Run, from: usize, w: &Var, opt: &mut Sgd, scaler: &mut GradScaler) -> f64 {
    let mut worst = 0f64;
    for (t, step) in run.steps.iter().enumerate().skip(from) {
        let what = format!("{} step {t}", run.name);
        let x = Tensor::new(f32s(&step.x), &Device::Cpu).unwrap();
        let loss = w.as_tensor().mul(&x).unwrap().sum_all().unwrap();
        let mut grads = scaler.scale(&loss).unwrap().backward().unwrap();
        let params = [w.clone()];
        if let Some(max_norm) = run.clip {
            scaler.unscale(&mut grads, &params).unwrap();
            let clipped = clip_grad_norm(&mut grads, &params, max_norm, 2.0, false).unwrap();
            let expected = f32::from_bits(step.total_norm.unwrap());
            let (a, b) = (clipped.total_norm as f32, expected);
            assert!(
                a == b || (a.is_nan() && b.is_nan()) || (a - b).abs() <= 1e-6 * b.abs(),
                "{what}: total norm {a} vs {b}"
            );
        }
        let stepped = scaler.step(&mut grads, &params, |g| opt.step(g)).unwrap();
        scaler.update().unwrap();
        assert_eq!(stepped, step.stepped, "{what}: stepped");
        assert_eq!(
            scaler.scale_factor(),
            f32::from_bits(step.scale),
            "{what}: scale"
        );
        assert_eq!(
            scaler.growth_tracker(),
            step.growth_tracker,
            "{what}: tracker"
        );
        let got = w.as_tensor().to_vec1::<f32>().unwrap();
        for (a, b) in got.iter().zip(f32s(&step.w)) {
            if run.clip.is_none() {
                assert_eq!(a.to_bits(), b.to_bits(), "{what}: weight {a} vs {b}");
            }
            worst = worst.max(((a - b) as f64 / b as f64).abs());
        }
    }
    worst
}

fn start(run: &Run, lr: f64, momentum: f64) -> (Var, Sgd) {
    let w = Var::from_tensor(&Tensor::new(f32s(&run.w0), &Device::Cpu).unwrap()).unwrap();
    let opt = Sgd::new_named(
        vec![("w".to_string(), w.clone())],
        SgdConfig {
            lr,
            momentum,
            ..Default::default()
        },
    )
    .unwrap();
    (w, opt)
}

/// Without clipping the weights are PyTorch's bit for bit (SGD is, and
/// the unscaled gradients are); with clipping within 1e-6 relative
/// (clip_grad_norm's square root, `clip.rs`).
#[test]
fn scaling_reproduces_pytorchs_grad_scaler_steps_skips_and_scales() {
    let file = reference();
    for run in &file.runs {
        let (w, mut opt) = start(run, file.lr, file.momentum);
        let mut scaler = GradScaler::new(config_of(run)).unwrap();
        let worst = replay(run, 0, &w, &mut opt, &mut scaler);
        assert!(worst <= 1e-6, "{}: weights differ by {worst:e}", run.name);
        // Every run skips at least the steps with inf and NaN inputs.
        assert!(run.steps.iter().filter(|s| !s.stepped).count() >= 3);
    }
}

#[test]
fn a_scaler_resumed_from_its_saved_state_continues_as_pytorchs() {
    let file = reference();
    for run in &file.runs {
        let (w, mut opt) = start(run, file.lr, file.momentum);
        let mut scaler = GradScaler::new(config_of(run)).unwrap();
        let half = run.halfway.after_step;
        // The first half, in this scaler.
        for t in 0..half {
            let x = Tensor::new(f32s(&run.steps[t].x), &Device::Cpu).unwrap();
            let loss = w.as_tensor().mul(&x).unwrap().sum_all().unwrap();
            let mut grads = scaler.scale(&loss).unwrap().backward().unwrap();
            if let Some(max_norm) = run.clip {
                scaler
                    .unscale(&mut grads, std::slice::from_ref(&w))
                    .unwrap();
                clip_grad_norm(&mut grads, std::slice::from_ref(&w), max_norm, 2.0, false).unwrap();
            }
            scaler
                .step(&mut grads, std::slice::from_ref(&w), |g| opt.step(g))
                .unwrap();
            scaler.update().unwrap();
        }
        // Saved as PyTorch's state_dict holds it, through JSON.
        let saved = serde_json::to_string(&scaler.state()).unwrap();
        let state: GradScalerState = serde_json::from_str(&saved).unwrap();
        assert_eq!(
            state.scale,
            f32::from_bits(run.halfway.scale),
            "{}",
            run.name
        );
        assert_eq!(state.growth_tracker, run.halfway.growth_tracker);
        // A fresh scaler with other settings takes the saved ones.
        let mut resumed = GradScaler::new(GradScalerConfig::default()).unwrap();
        resumed.load_state(&state).unwrap();
        let worst = replay(run, half, &w, &mut opt, &mut resumed);
        assert!(worst <= 1e-6, "{}: weights differ by {worst:e}", run.name);
    }
}

/// Two thread ranks hold different gradients (as ZeRO-2's or a
/// pipeline's stages do); an inf on rank 1 alone makes both skip and back
/// off, and their parameters stay equal.
#[test]
fn an_inf_on_one_ranks_gradients_skips_the_step_on_every_rank() {
    let outcome = crate::common::within(120, || {
        spawn(2, |ctx| {
            let w = Var::from_tensor(&Tensor::new(&[1f32, 2.], &Device::Cpu)?)?;
            let mut opt = Sgd::new_named(
                vec![("w".into(), w.clone())],
                SgdConfig {
                    lr: 0.5,
                    ..Default::default()
                },
            )?;
            let mut scaler = GradScaler::new(GradScalerConfig {
                init_scale: 8.0,
                ..Default::default()
            })?;
            let mut seen = Vec::new();
            for step in 0..3 {
                let bad = step == 1 && ctx.rank == 1;
                let x = Tensor::new(&[if bad { f32::INFINITY } else { 1. }, 1.], &Device::Cpu)?;
                let loss = w.as_tensor().mul(&x)?.sum_all()?;
                let mut grads = scaler.scale(&loss)?.backward()?;
                scaler.unscale_across(&mut grads, std::slice::from_ref(&w), ctx.pg.as_ref())?;
                let stepped = scaler.step(&mut grads, std::slice::from_ref(&w), |g| opt.step(g))?;
                scaler.update()?;
                seen.push((stepped, scaler.scale_factor()));
            }
            Ok((seen, w.as_tensor().to_vec1::<f32>()?))
        })
        .unwrap()
    });
    for (rank, (seen, w)) in outcome.iter().enumerate() {
        assert_eq!(
            seen,
            &vec![(true, 8.0), (false, 4.0), (true, 4.0)],
            "rank {rank}"
        );
        // Two steps of lr 0.5 on a gradient of 1.
        assert_eq!(w, &vec![0f32, 1.], "rank {rank}");
    }
}

#[test]
fn a_misused_scaler_says_what_is_wrong_and_changes_nothing() {
    let w = Var::from_tensor(&Tensor::new(&[1f32, -2.], &Device::Cpu).unwrap()).unwrap();
    let grads_of = |scaler: &GradScaler| -> GradStore {
        let loss = w.as_tensor().sum_all().unwrap();
        scaler.scale(&loss).unwrap().backward().unwrap()
    };
    let message = |e: Error| {
        assert!(matches!(e, Error::GradScaler(_)), "{e:?}");
        e.to_string()
    };
    let mut scaler = GradScaler::new(GradScalerConfig::default()).unwrap();
    let params = [w.clone()];

    let e = scaler.update().unwrap_err();
    assert!(message(e).contains("update without a step"));

    let mut grads = grads_of(&scaler);
    scaler.unscale(&mut grads, &params).unwrap();
    let e = scaler.unscale(&mut grads, &params).unwrap_err();
    assert!(message(e).contains("already called"));
    scaler
        .step(&mut grads, &params, |_| candle_core::Result::Ok(()))
        .unwrap();
    let e = scaler
        .step(&mut grads, &params, |_| candle_core::Result::Ok(()))
        .unwrap_err();
    assert!(message(e).contains("step was already called"));
    let e = scaler.unscale(&mut grads, &params).unwrap_err();
    assert!(message(e).contains("after step"));
    scaler.update().unwrap();

    // f16 gradients are refused, untouched.
    let h = Var::from_tensor(
        &Tensor::new(&[1f32, 2.], &Device::Cpu)
            .unwrap()
            .to_dtype(DType::F16)
            .unwrap(),
    )
    .unwrap();
    let mut grads = h.as_tensor().sum_all().unwrap().backward().unwrap();
    let before = grads
        .get(h.as_tensor())
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    let e = scaler
        .unscale(&mut grads, std::slice::from_ref(&h))
        .unwrap_err();
    assert!(message(e).contains("f16"));
    let after = grads
        .get(h.as_tensor())
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    assert_eq!(before, after);

    // A scale that f16 cannot hold, for an f16 loss.
    let loss = h.as_tensor().sum_all().unwrap();
    assert!(message(scaler.scale(&loss).unwrap_err()).contains("compute the loss in f32"));

    // Settings PyTorch refuses, at construction and on load.
    for (config, what) in [
        (
            GradScalerConfig {
                growth_factor: 1.0,
                ..Default::default()
            },
            "growth_factor",
        ),
        (
            GradScalerConfig {
                backoff_factor: 1.5,
                ..Default::default()
            },
            "backoff_factor",
        ),
        (
            GradScalerConfig {
                growth_interval: 0,
                ..Default::default()
            },
            "growth_interval",
        ),
        (
            GradScalerConfig {
                init_scale: f64::NAN,
                ..Default::default()
            },
            "init_scale",
        ),
    ] {
        assert!(
            message(GradScaler::new(config).unwrap_err()).contains(what),
            "{what}"
        );
    }
    let good = scaler.state();
    for bad in [
        GradScalerState {
            scale: f32::INFINITY,
            ..good
        },
        GradScalerState {
            growth_tracker: good.growth_interval,
            ..good
        },
        GradScalerState {
            backoff_factor: f64::NAN,
            ..good
        },
    ] {
        message(scaler.load_state(&bad).unwrap_err());
        assert_eq!(scaler.state(), good, "a refused state changes nothing");
    }
}

#[test]
fn a_disabled_scaler_passes_the_loss_and_every_step_through() {
    let w = Var::from_tensor(&Tensor::new(&[1f32, 2.], &Device::Cpu).unwrap()).unwrap();
    let mut scaler = GradScaler::new(GradScalerConfig {
        enabled: false,
        ..Default::default()
    })
    .unwrap();
    let x = Tensor::new(&[f32::NAN, 1.], &Device::Cpu).unwrap();
    let loss = w.as_tensor().mul(&x).unwrap().sum_all().unwrap();
    let scaled = scaler.scale(&loss).unwrap();
    assert!(scaled.to_scalar::<f32>().unwrap().is_nan());
    let mut grads = scaled.backward().unwrap();
    let mut ran = false;
    let stepped = scaler
        .step(&mut grads, std::slice::from_ref(&w), |_| {
            ran = true;
            candle_core::Result::Ok(())
        })
        .unwrap();
    scaler.update().unwrap();
    assert!(stepped && ran && scaler.scale_factor() == 1.0);
}
