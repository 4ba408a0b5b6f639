//! candle_dp's optimizers against real PyTorch (`tests/data/optim_reference.safetensors`,
//! made by `scripts/gen_optim_reference.py`): every option of SGD, Adam and
//! AdamW over 25 steps, parameters of several shapes, one of which misses
//! its gradient in some steps; their state, its names, and an exact resume.
// `load_state` returns `candle_dp::Result`, as the API does.
#![allow(clippy::result_large_err)]

use std::collections::{BTreeMap, HashMap};

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};
use candle_dp::optim::{
    Adam, AdamConfig, AdamW, AdamWConfig, OptimizerState, Sgd, SgdConfig, StatefulOptimizer,
};
use candle_nn::Optimizer;

const FIXTURE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/data/optim_reference.safetensors"
);
const PARAMS: [&str; 7] = ["a", "b", "c", "d", "e", "f", "skip"];
const STEPS: usize = 25;

struct Fixture {
    tensors: HashMap<String, Tensor>,
    /// run -> (optimizer, settings)
    runs: BTreeMap<String, (String, BTreeMap<String, serde_json::Value>)>,
}

fn fixture() -> Fixture {
    let bytes = std::fs::read(FIXTURE).unwrap();
    let (_, metadata) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let runs = metadata.metadata().as_ref().unwrap()["runs"].clone();
    Fixture {
        tensors: candle_core::safetensors::load(FIXTURE, &Device::Cpu).unwrap(),
        runs: serde_json::from_str(&runs).unwrap(),
    }
}

/// One of the three optimizers, behind one type for the tests.
pub(crate) enum Any {
    Sgd(Sgd),
    Adam(Adam),
    AdamW(AdamW),
}

/// Settings as the fixtures name them.
pub(crate) type Settings = BTreeMap<String, serde_json::Value>;

fn sgd_config(s: &Settings) -> SgdConfig {
    let f = |k: &str, d: f64| s.get(k).map_or(d, |v| v.as_f64().unwrap());
    let b = |k: &str| s.get(k).is_some_and(|v| v.as_bool().unwrap());
    let d = SgdConfig::default();
    SgdConfig {
        lr: f("lr", d.lr),
        momentum: f("momentum", d.momentum),
        dampening: f("dampening", d.dampening),
        weight_decay: f("weight_decay", d.weight_decay),
        nesterov: b("nesterov"),
        maximize: b("maximize"),
    }
}

/// Adam and AdamW take the same settings; AdamW's default weight decay is
/// PyTorch's 1e-2.
fn adam_config(kind: &str, s: &Settings) -> AdamConfig {
    let f = |k: &str, d: f64| s.get(k).map_or(d, |v| v.as_f64().unwrap());
    let b = |k: &str| s.get(k).is_some_and(|v| v.as_bool().unwrap());
    let default_decay = if kind == "adam" { 0.0 } else { 1e-2 };
    let d = AdamConfig::default();
    AdamConfig {
        lr: f("lr", d.lr),
        beta1: f("beta1", d.beta1),
        beta2: f("beta2", d.beta2),
        eps: f("eps", d.eps),
        weight_decay: f("weight_decay", default_decay),
        amsgrad: b("amsgrad"),
        maximize: b("maximize"),
    }
}

impl Any {
    fn new(kind: &str, s: &Settings, params: Vec<(String, Var)>) -> Any {
        match kind {
            "sgd" => Any::Sgd(Sgd::new_named(params, sgd_config(s)).unwrap()),
            "adam" => Any::Adam(Adam::new_named(params, adam_config(kind, s)).unwrap()),
            _ => Any::AdamW(AdamW::new_named(params, adam_config(kind, s).into()).unwrap()),
        }
    }

    /// `kind` over `params` in groups: `groups[g]`'s settings for the
    /// parameters `group_of` puts in group `g`.
    pub(crate) fn grouped(
        kind: &str,
        groups: &[&Settings],
        params: Vec<(String, Var)>,
        group_of: impl Fn(&str) -> usize,
    ) -> candle_core::Result<Any> {
        Ok(match kind {
            "sgd" => Any::Sgd(Sgd::with_groups(
                params,
                groups.iter().map(|s| sgd_config(s)).collect(),
                group_of,
            )?),
            "adam" => Any::Adam(Adam::with_groups(
                params,
                groups.iter().map(|s| adam_config(kind, s)).collect(),
                group_of,
            )?),
            _ => Any::AdamW(AdamW::with_groups(
                params,
                groups.iter().map(|s| adam_config(kind, s).into()).collect(),
                group_of,
            )?),
        })
    }

    pub(crate) fn set_learning_rate(&mut self, lr: f64) {
        match self {
            Any::Sgd(o) => o.set_learning_rate(lr),
            Any::Adam(o) => o.set_learning_rate(lr),
            Any::AdamW(o) => o.set_learning_rate(lr),
        }
    }

    /// Each group's rate in force.
    pub(crate) fn group_lrs(&self) -> Vec<f64> {
        match self {
            Any::Sgd(o) => o.param_groups().iter().map(|(c, _)| c.lr).collect(),
            Any::Adam(o) => o.param_groups().iter().map(|(c, _)| c.lr).collect(),
            Any::AdamW(o) => o.param_groups().iter().map(|(c, _)| c.lr).collect(),
        }
    }

    pub(crate) fn step(&mut self, grads: &GradStore) {
        match self {
            Any::Sgd(o) => o.step(grads),
            Any::Adam(o) => o.step(grads),
            Any::AdamW(o) => o.step(grads),
        }
        .unwrap()
    }

    pub(crate) fn state(&self) -> OptimizerState {
        match self {
            Any::Sgd(o) => o.state(),
            Any::Adam(o) => o.state(),
            Any::AdamW(o) => o.state(),
        }
        .unwrap()
    }

    pub(crate) fn load_state(&mut self, state: &OptimizerState) -> candle_dp::Result<()> {
        match self {
            Any::Sgd(o) => o.load_state(state),
            Any::Adam(o) => o.load_state(state),
            Any::AdamW(o) => o.load_state(state),
        }
    }
}

/// Fresh variables holding `values[name]` for every parameter.
fn params_from(values: &HashMap<String, Tensor>) -> Vec<(String, Var)> {
    PARAMS
        .iter()
        .map(|n| (n.to_string(), Var::from_tensor(&values[*n]).unwrap()))
        .collect()
}

fn init(fx: &Fixture) -> HashMap<String, Tensor> {
    PARAMS
        .iter()
        .map(|n| (n.to_string(), fx.tensors[&format!("init.{n}")].clone()))
        .collect()
}

/// Steps `from..to` of the fixture's gradients.
fn run_steps(fx: &Fixture, opt: &mut Any, params: &[(String, Var)], from: usize, to: usize) {
    for step in from..to {
        let mut grads = GradStore::default();
        for (name, var) in params {
            if let Some(g) = fx.tensors.get(&format!("grad.{step}.{name}")) {
                grads.insert(var.as_tensor(), g.clone());
            }
        }
        opt.step(&grads);
    }
}

fn values(params: &[(String, Var)]) -> HashMap<String, Tensor> {
    params
        .iter()
        .map(|(n, v)| (n.clone(), v.as_tensor().copy().unwrap()))
        .collect()
}

/// The largest |got - want| / max(|want|, 1e-3) over every element.
fn rel_diff(got: &Tensor, want: &Tensor) -> f64 {
    let g = got
        .flatten_all()
        .unwrap()
        .to_dtype(DType::F64)
        .unwrap()
        .to_vec1::<f64>()
        .unwrap();
    let w = want
        .flatten_all()
        .unwrap()
        .to_dtype(DType::F64)
        .unwrap()
        .to_vec1::<f64>()
        .unwrap();
    assert_eq!(g.len(), w.len());
    g.iter()
        .zip(&w)
        .map(|(g, w)| (g - w).abs() / w.abs().max(1e-3))
        .fold(0.0, f64::max)
}

#[test]
fn sgd_adam_and_adamw_follow_pytorch_for_25_steps_with_every_option() {
    follow_pytorch(&Device::Cpu, 1e-6, rel_diff);
}

/// The device path: parameters, gradients and state on the GPU, where the
/// update runs with candle's CUDA kernels and nothing goes through the host.
#[cfg(feature = "cuda")]
#[test]
fn sgd_adam_and_adamw_follow_pytorch_on_the_gpu_with_their_state_there() {
    let gpu = Device::new_cuda_with_stream(0).unwrap();
    // The device path rounds each op on its own (no fused multiply-add):
    // its promise is 1e-5 of each tensor's largest value.
    follow_pytorch(&gpu, 1e-5, diff_of_largest);
}

/// The largest |got - want| over the largest |want|.
#[cfg(feature = "cuda")]
fn diff_of_largest(got: &Tensor, want: &Tensor) -> f64 {
    let values = |t: &Tensor| {
        t.flatten_all()
            .and_then(|t| t.to_dtype(DType::F64))
            .and_then(|t| t.to_vec1::<f64>())
            .unwrap()
    };
    let (g, w) = (values(got), values(want));
    assert_eq!(g.len(), w.len());
    let largest = w.iter().fold(0f64, |m, v| m.max(v.abs()));
    let diff = g
        .iter()
        .zip(&w)
        .fold(0f64, |m, (g, w)| m.max((g - w).abs()));
    diff / largest.max(1e-30)
}

/// Every run of the fixture with its parameters and gradients on `device`,
/// within `tolerance` of PyTorch's parameters and state, as `diff` measures.
fn follow_pytorch(device: &Device, tolerance: f64, diff: fn(&Tensor, &Tensor) -> f64) {
    let mut fx = fixture();
    for tensor in fx.tensors.values_mut() {
        *tensor = tensor.to_device(device).unwrap();
    }
    let mut worst = Vec::new();
    for (run, (kind, settings)) in &fx.runs {
        let params = params_from(&init(&fx));
        let mut opt = Any::new(kind, settings, params.clone());
        run_steps(&fx, &mut opt, &params, 0, STEPS);
        let mut run_worst = 0f64;
        for (name, var) in &params {
            assert!(var.device().same_device(device), "{run}: `{name}` moved");
            let want = &fx.tensors[&format!("{run}.final.{name}")];
            let d = diff(var.as_tensor(), want);
            assert!(
                d <= tolerance,
                "{run}: parameter `{name}` differs by {d:e} (relative)"
            );
            run_worst = run_worst.max(d);
        }
        // The state: PyTorch's names and values.
        let state = opt.state();
        let prefix = format!("{run}.state.");
        let want: BTreeMap<&str, &Tensor> = fx
            .tensors
            .iter()
            .filter_map(|(k, t)| Some((k.strip_prefix(&prefix)?, t)))
            .collect();
        let got: Vec<&str> = state.tensors.keys().map(String::as_str).collect();
        assert_eq!(
            got,
            want.keys().copied().collect::<Vec<_>>(),
            "{run}: state names"
        );
        for (key, tensor) in &state.tensors {
            let d = diff(tensor, want[key.as_str()]);
            assert!(d <= tolerance, "{run}: state `{key}` differs by {d:e}");
        }
        assert_eq!(state.steps, STEPS as u64, "{run}");
        worst.push(format!("{run} {run_worst:.1e}"));
    }
    assert_eq!(fx.runs.len(), 14, "every run of the fixture is checked");
    println!(
        "{device:?}: largest relative difference per run: {}",
        worst.join(", ")
    );
}

#[test]
fn a_state_loaded_into_a_fresh_optimizer_continues_bit_for_bit() {
    let fx = fixture();
    for (run, (kind, settings)) in &fx.runs {
        let params = params_from(&init(&fx));
        let mut straight = Any::new(kind, settings, params.clone());
        run_steps(&fx, &mut straight, &params, 0, STEPS);
        let want = values(&params);

        // Killed after step 12 (after `skip` missed two gradients): the
        // parameters and the optimizer's state are all that survive.
        let first = params_from(&init(&fx));
        let mut before = Any::new(kind, settings, first.clone());
        run_steps(&fx, &mut before, &first, 0, 12);
        let saved_values = values(&first);
        let saved_state = before.state();
        drop(before);

        // A fresh optimizer with other settings: load restores them too.
        let resumed = params_from(&saved_values);
        let mut after = Any::new(kind, &BTreeMap::new(), resumed.clone());
        after.load_state(&saved_state).unwrap();
        run_steps(&fx, &mut after, &resumed, 12, STEPS);
        for (name, var) in &resumed {
            let (got, want) = (var.as_tensor(), &want[name]);
            let bits = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            assert_eq!(bits(got), bits(want), "{run}: `{name}` after resuming");
        }
    }
}

#[test]
fn a_state_that_does_not_fit_is_refused_and_changes_nothing() {
    let v = || {
        vec![(
            "w".to_string(),
            Var::ones((2, 3), DType::F32, &Device::Cpu).unwrap(),
        )]
    };
    let mut adam = Adam::new_named(v(), AdamConfig::default()).unwrap();
    let params = v();
    let mut grads = GradStore::default();
    grads.insert(
        params[0].1.as_tensor(),
        Tensor::ones((2, 3), DType::F32, &Device::Cpu).unwrap(),
    );
    let mut sgd = Sgd::new_named(
        params,
        SgdConfig {
            momentum: 0.9,
            ..Default::default()
        },
    )
    .unwrap();
    sgd.step(&grads).unwrap();
    let sgd_state = sgd.state().unwrap();
    let before = adam.state().unwrap();

    let err = adam.load_state(&sgd_state).unwrap_err().to_string();
    assert!(err.contains("`sgd` optimizer, this one is `adam`"), "{err}");

    let mut wrong_shape = sgd_state.clone();
    wrong_shape.tensors.insert(
        "w.momentum_buffer".into(),
        Tensor::zeros(5, DType::F32, &Device::Cpu).unwrap(),
    );
    let err = sgd.load_state(&wrong_shape).unwrap_err().to_string();
    assert!(
        err.contains("parameter `w` has shape [5], the parameter [2, 3]"),
        "{err}"
    );

    let mut unknown = sgd_state.clone();
    unknown.tensors.insert(
        "v.momentum_buffer".into(),
        Tensor::zeros((2, 3), DType::F32, &Device::Cpu).unwrap(),
    );
    let err = sgd.load_state(&unknown).unwrap_err().to_string();
    assert!(
        err.contains("`v.momentum_buffer` names no parameter"),
        "{err}"
    );

    let mut setting = sgd_state.clone();
    setting.settings.insert("betas".into(), 0.9);
    let err = sgd.load_state(&setting).unwrap_err().to_string();
    assert!(err.contains("unknown setting `betas`"), "{err}");

    // Nothing changed: the same states as before the refused loads.
    assert_eq!(
        format!("{:?}", adam.state().unwrap().settings),
        format!("{:?}", before.settings)
    );
    assert!(adam.state().unwrap().tensors.is_empty());
    assert_eq!(sgd.state().unwrap().tensors.len(), 1);
}

#[test]
fn settings_pytorch_refuses_are_refused() {
    let v = vec![Var::ones(2, DType::F32, &Device::Cpu).unwrap()];
    let nesterov = SgdConfig {
        nesterov: true,
        ..Default::default()
    };
    let err = Sgd::new(v.clone(), nesterov).unwrap_err().to_string();
    assert!(
        err.contains("Nesterov momentum needs momentum > 0"),
        "{err}"
    );
    let beta = AdamWConfig {
        beta2: 1.0,
        ..Default::default()
    };
    let err = AdamW::new(v.clone(), beta).unwrap_err().to_string();
    assert!(err.contains("invalid beta2 1"), "{err}");
    let lr = AdamConfig {
        lr: -1.0,
        ..Default::default()
    };
    assert!(Adam::new(v, lr).is_err());
}

#[test]
fn two_parameters_of_one_name_or_one_variable_twice_are_refused_naming_them() {
    let var = || Var::ones(2, DType::F32, &Device::Cpu).unwrap();
    let same_name = || vec![("w".to_string(), var()), ("w".to_string(), var())];
    let err = Sgd::new_named(same_name(), SgdConfig::default())
        .unwrap_err()
        .to_string();
    assert!(err.contains("two parameters are named `w`"), "{err}");
    let err = AdamW::new_named(same_name(), AdamWConfig::default())
        .unwrap_err()
        .to_string();
    assert!(err.contains("two parameters are named `w`"), "{err}");
    let shared = var();
    let twice = vec![
        ("a".to_string(), shared.clone()),
        ("b".to_string(), shared.clone()),
    ];
    let err = Adam::new_named(twice, AdamConfig::default())
        .unwrap_err()
        .to_string();
    assert!(err.contains("`a` and `b` are the same variable"), "{err}");
    let err = Sgd::new(vec![shared.clone(), shared], SgdConfig::default())
        .unwrap_err()
        .to_string();
    assert!(err.contains("`0` and `1` are the same variable"), "{err}");
}

#[test]
fn settings_that_are_not_numbers_or_flags_are_refused_at_construction_and_on_load() {
    let v = || {
        vec![(
            "w".to_string(),
            Var::ones(2, DType::F32, &Device::Cpu).unwrap(),
        )]
    };
    let dampening = SgdConfig {
        momentum: 0.9,
        dampening: f64::NAN,
        ..Default::default()
    };
    let err = Sgd::new_named(v(), dampening).unwrap_err().to_string();
    assert!(err.contains("invalid dampening NaN"), "{err}");
    let lr = AdamWConfig {
        lr: f64::INFINITY,
        ..Default::default()
    };
    let err = AdamW::new_named(v(), lr).unwrap_err().to_string();
    assert!(err.contains("invalid lr inf"), "{err}");

    // A loaded state: all or nothing, the setting named.
    let sgd_config = SgdConfig {
        momentum: 0.9,
        ..Default::default()
    };
    let mut sgd = Sgd::new_named(v(), sgd_config).unwrap();
    let good = sgd.state().unwrap();
    let with = |name: &str, value: f64| {
        let mut state = good.clone();
        state.settings.insert(name.into(), value);
        state
    };
    for (state, want) in [
        (
            with("nesterov", 0.5),
            "setting `nesterov` is 0.5: a flag must be 0 or 1",
        ),
        (with("maximize", 2.0), "setting `maximize` is 2"),
        (with("dampening", f64::NAN), "invalid dampening NaN"),
        (with("lr", f64::NEG_INFINITY), "invalid lr -inf"),
    ] {
        let err = sgd.load_state(&state).unwrap_err().to_string();
        assert!(err.contains(want), "{err}");
        assert_eq!(*sgd.config(), sgd_config, "nothing loaded");
    }
    let mut adam = Adam::new_named(v(), AdamConfig::default()).unwrap();
    let mut amsgrad = adam.state().unwrap();
    amsgrad.settings.insert("amsgrad".into(), -1.0);
    let err = adam.load_state(&amsgrad).unwrap_err().to_string();
    assert!(err.contains("setting `amsgrad` is -1"), "{err}");
    assert_eq!(adam.config(), AdamConfig::default(), "nothing loaded");
}

#[test]
fn an_f16_parameter_is_refused_naming_it_before_any_update() {
    let a = Var::ones(2, DType::F32, &Device::Cpu).unwrap();
    let h = Var::ones(2, DType::F16, &Device::Cpu).unwrap();
    let params = vec![("a".to_string(), a.clone()), ("h".to_string(), h.clone())];
    let mut opt = AdamW::new_named(params, AdamWConfig::default()).unwrap();
    let mut grads = GradStore::default();
    grads.insert(
        a.as_tensor(),
        Tensor::ones(2, DType::F32, &Device::Cpu).unwrap(),
    );
    grads.insert(
        h.as_tensor(),
        Tensor::ones(2, DType::F16, &Device::Cpu).unwrap(),
    );
    let err = opt.step(&grads).unwrap_err().to_string();
    assert!(err.contains("parameter `h` is F16"), "{err}");
    assert_eq!(
        a.as_tensor().to_vec1::<f32>().unwrap(),
        [1.0, 1.0],
        "a was not updated"
    );
}
