//! The optimizers' device path (a parameter off the CPU is stepped with
//! candle's tensor ops where it lives) checked against the host path on
//! the CPU, where both can run: the same updates to rounding, and states
//! that move between the paths.

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::Optimizer;

use super::element::with_device_path;
use super::{Adam, AdamConfig, AdamW, AdamWConfig, Sgd, SgdConfig, StatefulOptimizer};

/// Three parameters: f32 of two shapes, and f64.
fn params() -> Vec<(String, Var)> {
    let values = |n: usize, seed: usize| -> Vec<f64> {
        (0..n)
            .map(|i| ((i * 37 + seed * 11) as f64 * 0.37).sin())
            .collect()
    };
    let make = |name: &str, dims: &[usize], dtype: DType, seed: usize| {
        let n = dims.iter().product();
        let t = Tensor::from_vec(values(n, seed), dims, &Device::Cpu)
            .and_then(|t| t.to_dtype(dtype))
            .and_then(|t| Var::from_tensor(&t))
            .unwrap();
        (name.to_string(), t)
    };
    vec![
        make("w", &[5, 3], DType::F32, 1),
        make("b", &[4], DType::F32, 2),
        make("d", &[2, 2], DType::F64, 3),
    ]
}

/// Step `step`'s gradients: other values every step, of either sign.
fn grads(params: &[(String, Var)], step: usize) -> GradStore {
    let mut store = GradStore::default();
    for (k, (_, var)) in params.iter().enumerate() {
        let n = var.elem_count();
        let g: Vec<f64> = (0..n)
            .map(|i| ((i * 13 + k * 7 + step * 29) as f64 * 0.61).cos() * 0.1)
            .collect();
        let g = Tensor::from_vec(g, var.shape(), &Device::Cpu)
            .and_then(|g| g.to_dtype(var.dtype()))
            .unwrap();
        store.insert(var.as_tensor(), g);
    }
    store
}

/// Every parameter's values, as f64.
fn values(params: &[(String, Var)]) -> Vec<Vec<f64>> {
    params
        .iter()
        .map(|(_, v)| {
            v.as_tensor()
                .flatten_all()
                .and_then(|t| t.to_dtype(DType::F64))
                .and_then(|t| t.to_vec1::<f64>())
                .unwrap()
        })
        .collect()
}

/// `steps` steps of the optimizer `make` builds, each on the device path
/// where `path(step)` says so, else on the host.
fn run<O: Optimizer + StatefulOptimizer>(
    make: &dyn Fn(Vec<(String, Var)>) -> O,
    path: &dyn Fn(usize) -> bool,
    steps: usize,
) -> Vec<Vec<f64>> {
    let params = params();
    let mut opt = make(params.clone());
    for step in 0..steps {
        let g = grads(&params, step);
        match path(step) {
            true => with_device_path(|| opt.step(&g)).unwrap(),
            false => opt.step(&g).unwrap(),
        }
    }
    values(&params)
}

/// The largest difference between two runs, relative to each tensor's
/// largest value; f32 and f64 tensors apart.
fn gaps(a: &[Vec<f64>], b: &[Vec<f64>]) -> (f64, f64) {
    let gap = |x: &[f64], y: &[f64]| {
        let scale = x.iter().fold(0f64, |m, v| m.max(v.abs())).max(1e-30);
        x.iter()
            .zip(y)
            .fold(0f64, |m, (p, q)| m.max((p - q).abs() / scale))
    };
    let f32_gap = gap(&a[0], &b[0]).max(gap(&a[1], &b[1]));
    (f32_gap, gap(&a[2], &b[2]))
}

fn check<O: Optimizer + StatefulOptimizer>(what: &str, make: &dyn Fn(Vec<(String, Var)>) -> O) {
    let steps = 6;
    let host = run(make, &|_| false, steps);
    let device = run(make, &|_| true, steps);
    // Half and half: the device's state goes back to the host and on.
    let mixed = run(make, &|step| step < steps / 2, steps);
    for (label, other) in [("device", &device), ("device then host", &mixed)] {
        let (f32_gap, f64_gap) = gaps(&host, other);
        eprintln!("{what}, {label}: f32 {f32_gap:e}, f64 {f64_gap:e}");
        assert!(
            f32_gap < 1e-5,
            "{what}, {label}: f32 differs by {f32_gap:e}"
        );
        assert!(
            f64_gap < 1e-12,
            "{what}, {label}: f64 differs by {f64_gap:e}"
        );
    }
    assert_ne!(
        host,
        values(&params()),
        "{what}: the steps moved the parameters"
    );
}

#[test]
fn sgd_on_the_device_path_matches_the_host_path_to_rounding() {
    let configs = [
        SgdConfig {
            lr: 0.1,
            ..Default::default()
        },
        SgdConfig {
            lr: 0.1,
            momentum: 0.9,
            dampening: 0.1,
            weight_decay: 0.01,
            maximize: true,
            ..Default::default()
        },
        SgdConfig {
            lr: 0.1,
            momentum: 0.9,
            weight_decay: 0.01,
            nesterov: true,
            ..Default::default()
        },
    ];
    for config in configs {
        check(&format!("{config:?}"), &|p| {
            Sgd::new_named(p, config).unwrap()
        });
    }
}

#[test]
fn adam_and_adamw_on_the_device_path_match_the_host_path_to_rounding() {
    for amsgrad in [false, true] {
        let config = AdamConfig {
            lr: 0.01,
            weight_decay: 0.01,
            amsgrad,
            ..Default::default()
        };
        check(&format!("{config:?}"), &|p| {
            Adam::new_named(p, config).unwrap()
        });
        let config = AdamWConfig {
            lr: 0.01,
            amsgrad,
            maximize: amsgrad,
            ..Default::default()
        };
        check(&format!("{config:?}"), &|p| {
            AdamW::new_named(p, config).unwrap()
        });
    }
}

#[test]
fn a_state_saved_from_the_device_path_resumes_on_the_host_path() {
    let config = AdamWConfig {
        lr: 0.01,
        ..Default::default()
    };
    let params = params();
    let mut opt = AdamW::new_named(params.clone(), config).unwrap();
    for step in 0..3 {
        let g = grads(&params, step);
        with_device_path(|| opt.step(&g)).unwrap();
    }
    let state = opt.state().unwrap();
    // Saved on the host, as the host path saves it.
    assert!(state.tensors.values().all(|t| t.device().is_cpu()));
    let copy: Vec<(String, Var)> = params
        .iter()
        .map(|(n, v)| {
            (
                n.clone(),
                Var::from_tensor(&v.as_tensor().copy().unwrap()).unwrap(),
            )
        })
        .collect();
    let mut resumed = AdamW::new_named(copy.clone(), config).unwrap();
    resumed.load_state(&state).unwrap();
    for step in 3..6 {
        with_device_path(|| opt.step(&grads(&params, step))).unwrap();
        resumed.step(&grads(&copy, step)).unwrap();
    }
    let (f32_gap, f64_gap) = gaps(&values(&params), &values(&copy));
    assert!(f32_gap < 1e-5 && f64_gap < 1e-12, "{f32_gap:e} {f64_gap:e}");
}
