//! Adam and AdamW (`torch.optim.Adam`, `torch.optim.AdamW`): one
//! implementation, the weight decay added to the gradient (Adam) or
//! applied to the parameter (AdamW, decoupled).

use std::collections::BTreeMap;

use candle_core::backprop::GradStore;
use candle_core::{Tensor, Var};
use candle_nn::{Optimizer, VarMap};

use super::element::{device_state, step_each, typed, update_each, Buffer, Element, PerParameter};
use super::groups::{param_groups, GroupSettings, Groups};
use super::in_place::update_in_place;
use super::state::{
    by_position, check_finite, check_non_negative, check_unique, flag, invalid, named_vars,
    scalar_value, setting, sort_entries,
};
use super::{OptimizerState, StatefulOptimizer};
use crate::error::Result;

/// [`Adam`]'s settings; the defaults are PyTorch's.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamConfig {
    /// Learning rate (default 1e-3).
    pub lr: f64,
    /// Decay of the first moment (default 0.9).
    pub beta1: f64,
    /// Decay of the second moment (default 0.999).
    pub beta2: f64,
    /// Added to the denominator (default 1e-8).
    pub eps: f64,
    /// L2 penalty added to the gradient (default 0).
    pub weight_decay: f64,
    /// Normalise by the largest second moment so far (AMSGrad).
    pub amsgrad: bool,
    /// Maximise the objective instead of minimising it.
    pub maximize: bool,
}

impl Default for AdamConfig {
    fn default() -> Self {
        Self {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
            amsgrad: false,
            maximize: false,
        }
    }
}

/// [`AdamW`]'s settings: [`AdamConfig`]'s fields, with PyTorch's AdamW
/// default weight decay (1e-2), applied to the parameter.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWConfig {
    /// Learning rate (default 1e-3).
    pub lr: f64,
    /// Decay of the first moment (default 0.9).
    pub beta1: f64,
    /// Decay of the second moment (default 0.999).
    pub beta2: f64,
    /// Added to the denominator (default 1e-8).
    pub eps: f64,
    /// Decoupled weight decay: `p *= 1 - lr * weight_decay` (default 1e-2).
    pub weight_decay: f64,
    /// Normalise by the largest second moment so far (AMSGrad).
    pub amsgrad: bool,
    /// Maximise the objective instead of minimising it.
    pub maximize: bool,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        Self {
            weight_decay: 1e-2,
            ..AdamWConfig::from(AdamConfig::default())
        }
    }
}

impl From<AdamConfig> for AdamWConfig {
    fn from(c: AdamConfig) -> Self {
        Self {
            lr: c.lr,
            beta1: c.beta1,
            beta2: c.beta2,
            eps: c.eps,
            weight_decay: c.weight_decay,
            amsgrad: c.amsgrad,
            maximize: c.maximize,
        }
    }
}

impl From<AdamWConfig> for AdamConfig {
    fn from(c: AdamWConfig) -> Self {
        Self {
            lr: c.lr,
            beta1: c.beta1,
            beta2: c.beta2,
            eps: c.eps,
            weight_decay: c.weight_decay,
            amsgrad: c.amsgrad,
            maximize: c.maximize,
        }
    }
}

/// `torch.optim.Adam`: for each parameter with a gradient `g`, counting
/// its own steps `t`: `g += weight_decay * p`; `m = lerp(m, g, 1 - beta1)`;
/// `v = beta2 * v + (1 - beta2) * g * g`; `p -= lr / (1 - beta1^t) * m /
/// (sqrt(v) / sqrt(1 - beta2^t) + eps)` (with `amsgrad`, `v`'s running
/// maximum in the denominator). State per parameter: `step`, `exp_avg`,
/// `exp_avg_sq`, and `max_exp_avg_sq` with `amsgrad`.
#[derive(Debug)]
pub struct Adam(AdamCore);

/// `torch.optim.AdamW`: [`Adam`] with the weight decay applied to the
/// parameter before the update (`p *= 1 - lr * weight_decay`) instead of
/// added to the gradient.
#[derive(Debug)]
pub struct AdamW(AdamCore);

/// What Adam and AdamW share: everything but where the decay goes.
#[derive(Debug)]
struct AdamCore {
    params: Vec<(String, Var)>,
    groups: Groups<AdamConfig>,
    decoupled: bool,
    slots: Vec<Option<Moments>>,
    steps: u64,
}

/// One parameter's state.
#[derive(Debug, Clone)]
struct Moments {
    /// The parameter's own step count (PyTorch's per-parameter `step`).
    step: f64,
    exp_avg: Buffer,
    exp_avg_sq: Buffer,
    max_exp_avg_sq: Option<Buffer>,
}

/// The state slots: (name, whether it is one number).
const SLOTS: [(&str, bool); 4] = [
    ("step", true),
    ("exp_avg", false),
    ("exp_avg_sq", false),
    ("max_exp_avg_sq", false),
];

const SETTINGS: [&str; 7] = [
    "lr",
    "beta1",
    "beta2",
    "eps",
    "weight_decay",
    "amsgrad",
    "maximize",
];

impl AdamConfig {
    /// PyTorch's checks of the constructor.
    fn check(&self, name: &str) -> candle_core::Result<()> {
        let bad = |what: String| Err(candle_core::Error::Msg(format!("{name}: {what}")));
        let numbers = [
            ("lr", self.lr),
            ("eps", self.eps),
            ("weight_decay", self.weight_decay),
        ];
        check_finite(name, &numbers)?;
        check_non_negative(name, &numbers)?;
        for (setting, value) in [("beta1", self.beta1), ("beta2", self.beta2)] {
            if !(0.0..1.0).contains(&value) {
                return bad(format!("invalid {setting} {value}: it must be in [0, 1)"));
            }
        }
        Ok(())
    }
}

impl GroupSettings for AdamConfig {
    const NAME: &'static str = "adam";

    fn lr(&self) -> f64 {
        self.lr
    }

    fn set_lr(&mut self, lr: f64) {
        self.lr = lr;
    }

    fn settings(&self) -> Vec<(&'static str, f64)> {
        let flag = |b: bool| f64::from(u8::from(b));
        vec![
            ("lr", self.lr),
            ("beta1", self.beta1),
            ("beta2", self.beta2),
            ("eps", self.eps),
            ("weight_decay", self.weight_decay),
            ("amsgrad", flag(self.amsgrad)),
            ("maximize", flag(self.maximize)),
        ]
    }

    fn read(&self, state: &OptimizerState, key: &dyn Fn(&str) -> String) -> Result<Self> {
        Ok(AdamConfig {
            lr: setting(state, &key("lr"), self.lr),
            beta1: setting(state, &key("beta1"), self.beta1),
            beta2: setting(state, &key("beta2"), self.beta2),
            eps: setting(state, &key("eps"), self.eps),
            weight_decay: setting(state, &key("weight_decay"), self.weight_decay),
            amsgrad: flag(state, &key("amsgrad"), self.amsgrad)?,
            maximize: flag(state, &key("maximize"), self.maximize)?,
        })
    }

    fn check(&self) -> candle_core::Result<()> {
        AdamConfig::check(self, Self::NAME)
    }
}

impl AdamCore {
    fn new(
        params: Vec<(String, Var)>,
        groups: Groups<AdamConfig>,
        decoupled: bool,
    ) -> candle_core::Result<Self> {
        check_unique(Self::kind_of(decoupled), &params)?;
        Ok(Self {
            slots: params.iter().map(|_| None).collect(),
            params,
            groups,
            decoupled,
            steps: 0,
        })
    }

    fn kind_of(decoupled: bool) -> &'static str {
        if decoupled {
            "adamw"
        } else {
            "adam"
        }
    }

    fn step(&mut self, grads: &GradStore) -> candle_core::Result<()> {
        step_each(self, grads)?;
        self.steps += 1;
        Ok(())
    }

    fn state(&self) -> Result<OptimizerState> {
        let mut tensors = BTreeMap::new();
        for ((name, var), slots) in self.params.iter().zip(&self.slots) {
            let Some(s) = slots else { continue };
            tensors.insert(
                format!("{name}.step"),
                Tensor::new(s.step, &candle_core::Device::Cpu)?,
            );
            tensors.insert(format!("{name}.exp_avg"), s.exp_avg.to_tensor(var.shape())?);
            tensors.insert(
                format!("{name}.exp_avg_sq"),
                s.exp_avg_sq.to_tensor(var.shape())?,
            );
            if let Some(max) = &s.max_exp_avg_sq {
                tensors.insert(
                    format!("{name}.max_exp_avg_sq"),
                    max.to_tensor(var.shape())?,
                );
            }
        }
        Ok(OptimizerState {
            kind: Self::kind_of(self.decoupled).into(),
            steps: self.steps,
            settings: self.groups.save(&self.params),
            tensors,
            shard: None,
        })
    }

    fn load_state(&mut self, state: &OptimizerState) -> Result<()> {
        let kind = Self::kind_of(self.decoupled);
        let entries = sort_entries(state, kind, &self.params, &SLOTS, &SETTINGS)?;
        let configs = self.groups.load(state, &self.params)?;
        let mut slots = Vec::with_capacity(self.params.len());
        for (i, ((name, var), entry)) in self.params.iter().zip(&entries).enumerate() {
            if entry.is_empty() {
                slots.push(None);
                continue;
            }
            let config = configs[self.groups.group_of(i)];
            let needed: &[&str] = if config.amsgrad {
                &["step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"]
            } else {
                &["step", "exp_avg", "exp_avg_sq"]
            };
            if let Some(missing) = needed.iter().find(|s| !entry.contains_key(**s)) {
                return Err(invalid(format!(
                    "parameter `{name}` has state but no `{missing}`"
                )));
            }
            let buffer = |slot: &str| Buffer::from_tensor(&entry[slot], var.dtype());
            let step = scalar_value(&entry["step"])?;
            if !(step.is_finite() && step >= 0.0 && step.fract() == 0.0) {
                return Err(invalid(format!(
                    "parameter `{name}` has step {step}: a step count is a whole number, at least 0"
                )));
            }
            slots.push(Some(Moments {
                step,
                exp_avg: buffer("exp_avg")?,
                exp_avg_sq: buffer("exp_avg_sq")?,
                max_exp_avg_sq: config
                    .amsgrad
                    .then(|| buffer("max_exp_avg_sq"))
                    .transpose()?,
            }));
        }
        self.groups.set_configs(configs);
        self.slots = slots;
        self.steps = state.steps;
        Ok(())
    }
}

impl PerParameter for AdamCore {
    fn params(&self) -> &[(String, Var)] {
        &self.params
    }

    fn update<T: Element>(&mut self, i: usize, grad: &Tensor) -> candle_core::Result<()> {
        let (c, decoupled) = (self.groups.of(i), self.decoupled);
        let (name, var) = &self.params[i];
        let n = var.elem_count();
        let state = self.slots[i].get_or_insert_with(|| Moments {
            step: 0.0,
            exp_avg: T::into_buffer(vec![T::of(0.0); n]),
            exp_avg_sq: T::into_buffer(vec![T::of(0.0); n]),
            max_exp_avg_sq: c.amsgrad.then(|| T::into_buffer(vec![T::of(0.0); n])),
        });
        let Moments {
            step,
            exp_avg,
            exp_avg_sq,
            max_exp_avg_sq,
        } = state;
        // The state is looked up before the parameter is touched: a step
        // that fails here leaves it (and the step count) as it was.
        let m = typed::<T>(exp_avg, name, "exp_avg")?;
        let v = typed::<T>(exp_avg_sq, name, "exp_avg_sq")?;
        let max = match max_exp_avg_sq {
            Some(max) => Some(typed::<T>(max, name, "max_exp_avg_sq")?),
            None => None,
        };
        update_in_place(var, grad, |p: &mut [T], g: &[T]| {
            *step += 1.0;
            let mut changed: Option<Vec<T>> = None;
            if c.maximize {
                changed = Some(g.iter().map(|&x| -x).collect());
            }
            if c.weight_decay != 0.0 {
                if decoupled {
                    let keep = T::of(1.0 - c.lr * c.weight_decay);
                    p.iter_mut().for_each(|p| *p *= keep);
                } else {
                    let wd = T::of(c.weight_decay);
                    let g = changed.get_or_insert_with(|| g.to_vec());
                    update_each(g, p, |g, p| p.fma(wd, g));
                }
            }
            let g: &[T] = changed.as_deref().unwrap_or(g);
            // exp_avg.lerp_(g, 1 - beta1): ATen's vectorised lerp, two forms.
            let w = T::of(1.0 - c.beta1);
            match w < T::of(0.5) && -w < T::of(0.5) {
                true => update_each(m, g, |m, g| w.fma(g - m, m)),
                false => update_each(m, g, |m, g| (w - T::of(1.0)).fma(g - m, g)),
            }
            // exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2): ATen's
            // addcmul kernel, `v + (value * g) * g`, is compiled into a fused
            // multiply-add (measured: a plain add differs from PyTorch by an
            // ulp here and there).
            let (beta2, rest) = (T::of(c.beta2), T::of(1.0 - c.beta2));
            update_each(v, g, |v, g| (rest * g).fma(g, v * beta2));
            let step_size = c.lr / (1.0 - c.beta1.powf(*step));
            let bc2_sqrt = T::of((1.0 - c.beta2.powf(*step)).powf(0.5));
            let (eps, minus_step) = (T::of(c.eps), T::of(-step_size));
            let second: &[T] = match max {
                Some(max) => {
                    for (max, &v) in max.iter_mut().zip(v.iter()) {
                        // torch.maximum: NaN wins.
                        if v.is_nan() || v > *max {
                            *max = v;
                        }
                    }
                    max
                }
                None => v,
            };
            // p.addcdiv_(m, sqrt(v) / sqrt(bc2) + eps, value=-step_size)
            for ((p, &m), &v) in p.iter_mut().zip(m.iter()).zip(second) {
                *p += minus_step * m / (v.sqrt() / bc2_sqrt + eps);
            }
        })
    }

    fn update_on_device(&mut self, i: usize, grad: &Tensor) -> candle_core::Result<()> {
        let (c, decoupled) = (self.groups.of(i), self.decoupled);
        let (name, var) = &self.params[i];
        let mut p = var.as_detached_tensor();
        let mut g = grad.detach().to_dtype(var.dtype())?;
        let state = match &mut self.slots[i] {
            Some(state) => state,
            slot @ None => {
                let zeros = || p.zeros_like().map(Buffer::Tensor);
                slot.insert(Moments {
                    step: 0.0,
                    exp_avg: zeros()?,
                    exp_avg_sq: zeros()?,
                    max_exp_avg_sq: c.amsgrad.then(zeros).transpose()?,
                })
            }
        };
        let m = device_state(&state.exp_avg, var, name, "exp_avg")?;
        let v = device_state(&state.exp_avg_sq, var, name, "exp_avg_sq")?;
        let max = match &state.max_exp_avg_sq {
            Some(max) => Some(device_state(max, var, name, "max_exp_avg_sq")?),
            None => None,
        };
        if c.maximize {
            g = g.neg()?;
        }
        if c.weight_decay != 0.0 {
            match decoupled {
                true => p = p.affine(1.0 - c.lr * c.weight_decay, 0.0)?,
                false => g = (p.affine(c.weight_decay, 0.0)? + &g)?,
            }
        }
        // exp_avg.lerp_(g, 1 - beta1); exp_avg_sq.mul_(beta2).addcmul_(g, g, 1 - beta2)
        let m = (&m + (&g - &m)?.affine(1.0 - c.beta1, 0.0)?)?;
        let v = (v.affine(c.beta2, 0.0)? + g.sqr()?.affine(1.0 - c.beta2, 0.0)?)?;
        let step = state.step + 1.0;
        let step_size = c.lr / (1.0 - c.beta1.powf(step));
        let bc2_sqrt = (1.0 - c.beta2.powf(step)).sqrt();
        let max = match max {
            Some(max) => Some(max.maximum(&v)?),
            None => None,
        };
        let second = max.as_ref().unwrap_or(&v);
        let denom = (second.sqrt()? / bc2_sqrt)?.affine(1.0, c.eps)?;
        let p = (p - (m.div(&denom)?.affine(step_size, 0.0))?)?;
        // Nothing below can fail but the write: the state moves on with it.
        var.set(&p)?;
        state.step = step;
        state.exp_avg = Buffer::Tensor(m);
        state.exp_avg_sq = Buffer::Tensor(v);
        if let Some(max) = max {
            state.max_exp_avg_sq = Some(Buffer::Tensor(max));
        }
        Ok(())
    }
}

macro_rules! adam_variant {
    ($name:ident, $config:ident, $decoupled:expr) => {
        impl $name {
            /// Over every variable of `varmap`, each state named after its
            /// variable.
            ///
            /// # Errors
            ///
            /// A setting PyTorch refuses (a negative rate, a beta outside
            /// `[0, 1)`).
            pub fn from_varmap(varmap: &VarMap, config: $config) -> candle_core::Result<Self> {
                Self::new_named(named_vars(varmap), config)
            }

            /// Over `params`, each state named after its entry's name.
            ///
            /// # Errors
            ///
            /// As [`from_varmap`](Self::from_varmap).
            pub fn new_named(
                params: Vec<(String, Var)>,
                config: $config,
            ) -> candle_core::Result<Self> {
                let groups = Groups::one(AdamConfig::from(config), params.len())?;
                Ok(Self(AdamCore::new(params, groups, $decoupled)?))
            }

            /// Over `params` in parameter groups (PyTorch's
            /// `param_groups`): the parameter named `name` in group
            /// `group_of(name)`, stepped with `configs[group_of(name)]`. A schedule over the groups sets each group's rate
            /// (`set_group_learning_rates`); candle's `set_learning_rate` sets group 0's and scales the others' by the same factor. Through ZeRO and FSDP each piece is named as
            /// its parameter, so it falls into its parameter's group.
            ///
            /// # Errors
            ///
            /// No group, a group index past `configs`, a group's setting
            /// PyTorch refuses, or a first group's rate of 0 when there are
            /// several.
            pub fn with_groups(
                params: Vec<(String, Var)>,
                configs: Vec<$config>,
                group_of: impl Fn(&str) -> usize,
            ) -> candle_core::Result<Self> {
                let configs = configs.into_iter().map(AdamConfig::from).collect();
                let groups = Groups::new(&params, configs, group_of)?;
                Ok(Self(AdamCore::new(params, groups, $decoupled)?))
            }

            /// The settings in force (of the first parameter group).
            pub fn config(&self) -> $config {
                self.0.groups.configs()[0].into()
            }

            /// Every parameter group's settings in force and its
            /// parameters' names.
            pub fn param_groups(&self) -> Vec<($config, Vec<String>)> {
                param_groups(&self.0.groups, &self.0.params)
                    .into_iter()
                    .map(|(c, names)| (c.into(), names))
                    .collect()
            }
        }

        impl Optimizer for $name {
            type Config = $config;

            /// Over `vars`, their state named by position (see the
            /// [module docs](super)).
            fn new(vars: Vec<Var>, config: $config) -> candle_core::Result<Self> {
                Self::new_named(by_position(vars), config)
            }

            fn step(&mut self, grads: &GradStore) -> candle_core::Result<()> {
                self.0.step(grads)
            }

            /// The first parameter group's rate.
            fn learning_rate(&self) -> f64 {
                self.0.groups.lr()
            }

            /// Sets the first group's rate to `lr`, and every other group's
            /// to its initial rate times the same factor (as a PyTorch
            /// schedule does).
            fn set_learning_rate(&mut self, lr: f64) {
                self.0.groups.set_lr(lr);
            }
        }

        impl StatefulOptimizer for $name {
            fn state(&self) -> Result<OptimizerState> {
                self.0.state()
            }

            fn load_state(&mut self, state: &OptimizerState) -> Result<()> {
                self.0.load_state(state)
            }

            fn group_learning_rates(&self) -> Vec<f64> {
                self.0.groups.lrs()
            }

            fn set_group_learning_rates(&mut self, lrs: &[f64]) -> Result<()> {
                self.0.groups.set_lrs(lrs)
            }
        }
    };
}

adam_variant!(Adam, AdamConfig, false);
adam_variant!(AdamW, AdamWConfig, true);
