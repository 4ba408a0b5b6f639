//! Stochastic gradient descent with momentum, dampening, Nesterov momentum
//! and weight decay: `torch.optim.SGD`.

use std::collections::BTreeMap;

use candle_core::backprop::GradStore;
use candle_core::Var;
use candle_nn::{Optimizer, VarMap};

use super::element::{device_state, step_each, typed, update_each, Buffer, Element, PerParameter};
use super::groups::{param_groups, GroupSettings, Groups};
use super::in_place::update_in_place;
use super::state::{
    by_position, check_finite, check_non_negative, check_unique, flag, named_vars, setting,
    sort_entries,
};
use super::{OptimizerState, StatefulOptimizer};
use crate::error::Result;

/// [`Sgd`]'s settings; the defaults are PyTorch's.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SgdConfig {
    /// Learning rate (default 1e-3).
    pub lr: f64,
    /// Momentum factor (default 0: none).
    pub momentum: f64,
    /// Dampening of the momentum's new gradient (default 0).
    pub dampening: f64,
    /// L2 penalty added to the gradient (default 0).
    pub weight_decay: f64,
    /// Nesterov momentum (needs `momentum > 0` and `dampening == 0`).
    pub nesterov: bool,
    /// Maximise the objective instead of minimising it.
    pub maximize: bool,
}

impl Default for SgdConfig {
    fn default() -> Self {
        Self {
            lr: 1e-3,
            momentum: 0.0,
            dampening: 0.0,
            weight_decay: 0.0,
            nesterov: false,
            maximize: false,
        }
    }
}

impl SgdConfig {
    /// PyTorch's checks of the constructor.
    fn check(&self) -> candle_core::Result<()> {
        check_finite(
            "SGD",
            &[
                ("lr", self.lr),
                ("momentum", self.momentum),
                ("dampening", self.dampening),
                ("weight_decay", self.weight_decay),
            ],
        )?;
        check_non_negative(
            "SGD",
            &[
                ("lr", self.lr),
                ("momentum", self.momentum),
                ("weight_decay", self.weight_decay),
            ],
        )?;
        if self.nesterov && (self.momentum <= 0.0 || self.dampening != 0.0) {
            return Err(candle_core::Error::Msg(format!(
                "SGD: Nesterov momentum needs momentum > 0 and dampening 0 (momentum {}, dampening {})",
                self.momentum, self.dampening
            )));
        }
        Ok(())
    }
}

impl GroupSettings for SgdConfig {
    const NAME: &'static str = "SGD";

    fn lr(&self) -> f64 {
        self.lr
    }

    fn set_lr(&mut self, lr: f64) {
        self.lr = lr;
    }

    fn settings(&self) -> Vec<(&'static str, f64)> {
        vec![
            ("lr", self.lr),
            ("momentum", self.momentum),
            ("dampening", self.dampening),
            ("weight_decay", self.weight_decay),
            ("nesterov", f64::from(u8::from(self.nesterov))),
            ("maximize", f64::from(u8::from(self.maximize))),
        ]
    }

    fn read(&self, state: &OptimizerState, key: &dyn Fn(&str) -> String) -> Result<Self> {
        Ok(SgdConfig {
            lr: setting(state, &key("lr"), self.lr),
            momentum: setting(state, &key("momentum"), self.momentum),
            dampening: setting(state, &key("dampening"), self.dampening),
            weight_decay: setting(state, &key("weight_decay"), self.weight_decay),
            nesterov: flag(state, &key("nesterov"), self.nesterov)?,
            maximize: flag(state, &key("maximize"), self.maximize)?,
        })
    }

    fn check(&self) -> candle_core::Result<()> {
        SgdConfig::check(self)
    }
}

/// `torch.optim.SGD`: for each parameter with a gradient `g`,
/// `g += weight_decay * p`; with momentum, `buf = momentum * buf + (1 -
/// dampening) * g` (the first step: `buf = g`), then `g = g + momentum *
/// buf` (Nesterov) or `g = buf`; `p -= lr * g`. State: each parameter's
/// `momentum_buffer` (with momentum only).
#[derive(Debug)]
pub struct Sgd {
    params: Vec<(String, Var)>,
    groups: Groups<SgdConfig>,
    momentum_buffers: Vec<Option<Buffer>>,
    steps: u64,
}

impl Sgd {
    /// Over every variable of `varmap`, each state named after its variable.
    ///
    /// # Errors
    ///
    /// A setting PyTorch refuses (a negative rate, Nesterov without
    /// momentum or with dampening).
    pub fn from_varmap(varmap: &VarMap, config: SgdConfig) -> candle_core::Result<Self> {
        Self::new_named(named_vars(varmap), config)
    }

    /// Over `params`, each state named after its entry's name.
    ///
    /// # Errors
    ///
    /// As [`from_varmap`](Self::from_varmap).
    pub fn new_named(params: Vec<(String, Var)>, config: SgdConfig) -> candle_core::Result<Self> {
        let groups = Groups::one(config, params.len())?;
        Self::over(params, groups)
    }

    /// Over `params` in parameter groups (PyTorch's `param_groups`): the
    /// parameter named `name` in group `group_of(name)`, stepped with
    /// `configs[group_of(name)]`. A schedule over the groups sets each group's rate (`set_group_learning_rates`); candle's `set_learning_rate` sets
    /// group 0's and scales the others' by the same factor. Through ZeRO and FSDP each piece is
    /// named as its parameter, so it falls into its parameter's group.
    ///
    /// # Errors
    ///
    /// No group, a group index past `configs`, a group's setting PyTorch
    /// refuses, or a first group's rate of 0 when there are several.
    pub fn with_groups(
        params: Vec<(String, Var)>,
        configs: Vec<SgdConfig>,
        group_of: impl Fn(&str) -> usize,
    ) -> candle_core::Result<Self> {
        let groups = Groups::new(&params, configs, group_of)?;
        Self::over(params, groups)
    }

    fn over(params: Vec<(String, Var)>, groups: Groups<SgdConfig>) -> candle_core::Result<Self> {
        check_unique("SGD", &params)?;
        Ok(Self {
            momentum_buffers: params.iter().map(|_| None).collect(),
            params,
            groups,
            steps: 0,
        })
    }

    /// The settings in force (of the first parameter group).
    pub fn config(&self) -> &SgdConfig {
        &self.groups.configs()[0]
    }

    /// Every parameter group's settings in force and its parameters' names.
    pub fn param_groups(&self) -> Vec<(SgdConfig, Vec<String>)> {
        param_groups(&self.groups, &self.params)
    }
}

impl PerParameter for Sgd {
    fn params(&self) -> &[(String, Var)] {
        &self.params
    }

    fn update<T: Element>(
        &mut self,
        i: usize,
        grad: &candle_core::Tensor,
    ) -> candle_core::Result<()> {
        let c = self.groups.of(i);
        let (name, var) = &self.params[i];
        // The state is looked up before the parameter is touched: a step
        // that fails here leaves it as it was.
        let buffer = match &mut self.momentum_buffers[i] {
            Some(buffer) if c.momentum != 0.0 => Some(typed::<T>(buffer, name, "momentum_buffer")?),
            _ => None,
        };
        let mut started: Option<Vec<T>> = None;
        update_in_place(var, grad, |p: &mut [T], g: &[T]| {
            let mut changed: Vec<T>;
            let mut g = g;
            if c.maximize || c.weight_decay != 0.0 {
                changed = g.to_vec();
                if c.maximize {
                    changed.iter_mut().for_each(|x| *x = -*x);
                }
                if c.weight_decay != 0.0 {
                    let wd = T::of(c.weight_decay);
                    update_each(&mut changed, p, |g, p| p.fma(wd, g));
                }
                g = &changed;
            }
            let mut nesterov: Vec<T>;
            if c.momentum != 0.0 {
                let mu = T::of(c.momentum);
                let keep = T::of(1.0 - c.dampening);
                let b: &[T] = match buffer {
                    None => started.insert(g.to_vec()),
                    Some(b) => {
                        update_each(b, g, |b, g| g.fma(keep, b * mu));
                        b
                    }
                };
                if c.nesterov {
                    nesterov = g.to_vec();
                    update_each(&mut nesterov, b, |g, b| b.fma(mu, g));
                    g = &nesterov;
                } else {
                    g = b;
                }
            }
            let minus_lr = T::of(-c.lr);
            update_each(p, g, |p, g| g.fma(minus_lr, p));
        })?;
        if let Some(values) = started {
            self.momentum_buffers[i] = Some(T::into_buffer(values));
        }
        Ok(())
    }

    fn update_on_device(
        &mut self,
        i: usize,
        grad: &candle_core::Tensor,
    ) -> candle_core::Result<()> {
        let c = self.groups.of(i);
        let (name, var) = &self.params[i];
        let p = var.as_detached_tensor();
        let mut g = grad.detach().to_dtype(var.dtype())?;
        if c.maximize {
            g = g.neg()?;
        }
        if c.weight_decay != 0.0 {
            g = (p.affine(c.weight_decay, 0.0)? + g)?;
        }
        let mut momentum = None;
        if c.momentum != 0.0 {
            let buf = match &self.momentum_buffers[i] {
                None => g.copy()?,
                Some(buffer) => {
                    let b = device_state(buffer, var, name, "momentum_buffer")?;
                    (b.affine(c.momentum, 0.0)? + g.affine(1.0 - c.dampening, 0.0)?)?
                }
            };
            g = match c.nesterov {
                true => (g + buf.affine(c.momentum, 0.0)?)?,
                false => buf.clone(),
            };
            momentum = Some(buf);
        }
        var.set(&(p - g.affine(c.lr, 0.0)?)?)?;
        // The state moves on with the parameter only: a failure above
        // leaves both as they were.
        if let Some(buf) = momentum {
            self.momentum_buffers[i] = Some(Buffer::Tensor(buf));
        }
        Ok(())
    }
}

impl Optimizer for Sgd {
    type Config = SgdConfig;

    /// Over `vars`, their state named by position (see the
    /// [module docs](super)).
    fn new(vars: Vec<Var>, config: SgdConfig) -> candle_core::Result<Self> {
        Self::new_named(by_position(vars), config)
    }

    fn step(&mut self, grads: &GradStore) -> candle_core::Result<()> {
        step_each(self, grads)?;
        self.steps += 1;
        Ok(())
    }

    /// The first parameter group's rate.
    fn learning_rate(&self) -> f64 {
        self.groups.lr()
    }

    /// Sets the first group's rate to `lr`, and every other group's to its
    /// initial rate times the same factor (as a PyTorch schedule does).
    fn set_learning_rate(&mut self, lr: f64) {
        self.groups.set_lr(lr);
    }
}

impl StatefulOptimizer for Sgd {
    fn state(&self) -> Result<OptimizerState> {
        let mut tensors = BTreeMap::new();
        for ((name, var), buffer) in self.params.iter().zip(&self.momentum_buffers) {
            if let Some(buffer) = buffer {
                tensors.insert(
                    format!("{name}.momentum_buffer"),
                    buffer.to_tensor(var.shape())?,
                );
            }
        }
        Ok(OptimizerState {
            kind: "sgd".into(),
            steps: self.steps,
            settings: self.groups.save(&self.params),
            tensors,
            shard: None,
        })
    }

    fn load_state(&mut self, state: &OptimizerState) -> Result<()> {
        let entries = sort_entries(
            state,
            "sgd",
            &self.params,
            &[("momentum_buffer", false)],
            &[
                "lr",
                "momentum",
                "dampening",
                "weight_decay",
                "nesterov",
                "maximize",
            ],
        )?;
        let configs = self.groups.load(state, &self.params)?;
        let buffers = self
            .params
            .iter()
            .zip(&entries)
            .map(|((_, var), slots)| {
                slots
                    .get("momentum_buffer")
                    .map(|t| Buffer::from_tensor(t, var.dtype()))
                    .transpose()
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        self.groups.set_configs(configs);
        self.momentum_buffers = buffers;
        self.steps = state.steps;
        Ok(())
    }

    fn group_learning_rates(&self) -> Vec<f64> {
        self.groups.lrs()
    }

    fn set_group_learning_rates(&mut self, lrs: &[f64]) -> Result<()> {
        self.groups.set_lrs(lrs)
    }
}
