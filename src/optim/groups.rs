//! Parameter groups, PyTorch's `param_groups`: each parameter belongs to
//! one group, each group has its own settings (rate, weight decay,
//! betas, momentum); a learning-rate schedule sets each group's rate
//! (`set_lrs`), candle's `set_learning_rate` scales every group's by group
//! 0's factor (`set_lr`).
//!
//! A parameter's group is chosen by its name, so that ZeRO's and FSDP's
//! pieces (named as their parameters) fall into their parameters' groups.

use std::collections::BTreeMap;

use candle_core::Var;

use super::state::{group_key, invalid, GROUPS, GROUP_OF};
use super::OptimizerState;
use crate::error::Result;

/// A group's settings, as an optimizer's config holds them.
pub(crate) trait GroupSettings: Copy {
    /// The optimizer's name in messages (`SGD`, `adam`, `adamw`).
    const NAME: &'static str;
    fn lr(&self) -> f64;
    fn set_lr(&mut self, lr: f64);
    /// The settings by name, flags as 0 or 1.
    fn settings(&self) -> Vec<(&'static str, f64)>;
    /// The settings `state` holds under `key(name)`, `self`'s where it
    /// holds none.
    fn read(&self, state: &OptimizerState, key: &dyn Fn(&str) -> String) -> Result<Self>;
    /// PyTorch's constructor checks.
    fn check(&self) -> candle_core::Result<()>;
}

/// The groups of an optimizer's parameters.
#[derive(Debug, Clone)]
pub(crate) struct Groups<C> {
    /// Each group's settings in force.
    configs: Vec<C>,
    /// Each group's rate when the optimizer was made: a schedule scales
    /// these (PyTorch's `initial_lr`).
    initial_lr: Vec<f64>,
    /// The group of each parameter, by position.
    of: Vec<usize>,
}

impl<C: GroupSettings> Groups<C> {
    /// Every one of `n` parameters in one group.
    pub(crate) fn one(config: C, n: usize) -> candle_core::Result<Self> {
        config.check()?;
        Ok(Self {
            initial_lr: vec![config.lr()],
            configs: vec![config],
            of: vec![0; n],
        })
    }

    /// `configs[g]` for the parameters `group_of` puts in group `g`.
    pub(crate) fn new(
        params: &[(String, Var)],
        configs: Vec<C>,
        group_of: impl Fn(&str) -> usize,
    ) -> candle_core::Result<Self> {
        let fail = |what: String| Err(candle_core::Error::Msg(format!("{}: {what}", C::NAME)));
        if configs.is_empty() {
            return fail("no parameter group: give at least one group's settings".into());
        }
        for (g, config) in configs.iter().enumerate() {
            config
                .check()
                .map_err(|e| candle_core::Error::Msg(format!("parameter group {g}: {e}")))?;
        }
        if configs.len() > 1 && configs[0].lr() <= 0.0 {
            return fail(format!(
                "parameter group 0 has lr {}: a schedule sets the rate of group 0 and scales \
                 the others by the same factor, so group 0's rate must be above 0",
                configs[0].lr()
            ));
        }
        let mut of = Vec::with_capacity(params.len());
        for (name, _) in params {
            let g = group_of(name);
            if g >= configs.len() {
                return fail(format!(
                    "parameter `{name}` is put in group {g}, but there are {} group(s)",
                    configs.len()
                ));
            }
            of.push(g);
        }
        Ok(Self {
            initial_lr: configs.iter().map(GroupSettings::lr).collect(),
            configs,
            of,
        })
    }

    /// The settings of parameter `i`'s group.
    pub(crate) fn of(&self, i: usize) -> C {
        self.configs[self.of[i]]
    }

    /// Parameter `i`'s group.
    pub(crate) fn group_of(&self, i: usize) -> usize {
        self.of[i]
    }

    /// Every group's settings, in order.
    pub(crate) fn configs(&self) -> &[C] {
        &self.configs
    }

    /// Which parameters (by position) each group holds.
    pub(crate) fn members(&self) -> Vec<Vec<usize>> {
        let mut members = vec![Vec::new(); self.configs.len()];
        for (i, &g) in self.of.iter().enumerate() {
            members[g].push(i);
        }
        members
    }

    /// The optimizer's rate: group 0's.
    pub(crate) fn lr(&self) -> f64 {
        self.configs[0].lr()
    }

    /// Sets group 0's rate to `lr` and every other group's to its initial
    /// rate times the same factor (`lr` over group 0's initial rate), as a
    /// PyTorch schedule scales each group's `initial_lr`.
    pub(crate) fn set_lr(&mut self, lr: f64) {
        if self.configs.len() == 1 {
            self.configs[0].set_lr(lr);
            return;
        }
        let factor = lr / self.initial_lr[0];
        for (config, initial) in self.configs.iter_mut().zip(&self.initial_lr) {
            config.set_lr(initial * factor);
        }
        // Group 0 exactly, not through the factor's rounding.
        self.configs[0].set_lr(lr);
    }

    /// Each group's rate, in order.
    pub(crate) fn lrs(&self) -> Vec<f64> {
        self.configs.iter().map(GroupSettings::lr).collect()
    }

    /// Sets each group's rate, in order.
    ///
    /// # Errors
    ///
    /// Another number of rates than groups, naming both; nothing changes.
    pub(crate) fn set_lrs(&mut self, lrs: &[f64]) -> Result<()> {
        if lrs.len() != self.configs.len() {
            return Err(invalid(format!(
                "{} rates for the {} parameter group(s) of this {} optimizer",
                lrs.len(),
                self.configs.len(),
                C::NAME
            )));
        }
        for (config, &lr) in self.configs.iter_mut().zip(lrs) {
            config.set_lr(lr);
        }
        Ok(())
    }

    /// The settings of a state: group 0's under their own names (a
    /// one-group state is as before groups existed), each other group's
    /// as `group<g>.<name>`, the number of groups and each parameter's
    /// group (those outside group 0) by name.
    pub(crate) fn save(&self, params: &[(String, Var)]) -> BTreeMap<String, f64> {
        let mut settings = BTreeMap::new();
        for (g, config) in self.configs.iter().enumerate() {
            for (name, value) in config.settings() {
                settings.insert(group_key(g, name), value);
            }
        }
        if self.configs.len() > 1 {
            settings.insert(GROUPS.into(), self.configs.len() as f64);
            for ((name, _), &g) in params.iter().zip(&self.of) {
                if g != 0 {
                    settings.insert(format!("{GROUP_OF}{name}"), g as f64);
                }
            }
        }
        settings
    }

    /// The groups' settings `state` holds, after checking that it has this
    /// optimizer's groups with the same parameters in each.
    ///
    /// # Errors
    ///
    /// [`Error::OptimizerState`](crate::Error::OptimizerState) naming the
    /// number of groups or the parameter whose group differs, or a group's
    /// setting that PyTorch would refuse.
    pub(crate) fn load(&self, state: &OptimizerState, params: &[(String, Var)]) -> Result<Vec<C>> {
        let saved_groups = state.settings.get(GROUPS).copied().unwrap_or(1.0);
        if saved_groups != self.configs.len() as f64 {
            return Err(invalid(format!(
                "the state has {saved_groups} parameter group(s), this {} optimizer {}: make it \
                 with the groups of the run that saved it",
                C::NAME,
                self.configs.len()
            )));
        }
        for ((name, _), &g) in params.iter().zip(&self.of) {
            let saved = state
                .settings
                .get(&format!("{GROUP_OF}{name}"))
                .copied()
                .unwrap_or(0.0);
            if saved != g as f64 {
                return Err(invalid(format!(
                    "parameter `{name}` is in group {g} here, in group {saved} in the state"
                )));
            }
        }
        if let Some(unknown) = state
            .settings
            .keys()
            .filter_map(|k| k.strip_prefix(GROUP_OF))
            .find(|name| !params.iter().any(|(n, _)| n == name))
        {
            return Err(invalid(format!(
                "the state puts `{unknown}` in a group, but this optimizer has no such parameter"
            )));
        }
        self.configs
            .iter()
            .enumerate()
            .map(|(g, current)| {
                let config = current.read(state, &|name| group_key(g, name))?;
                config
                    .check()
                    .map_err(|e| invalid(format!("parameter group {g}: {e}")))?;
                Ok(config)
            })
            .collect()
    }

    /// Replaces the settings in force (from [`load`](Self::load)).
    pub(crate) fn set_configs(&mut self, configs: Vec<C>) {
        self.configs = configs;
    }
}

/// Each group's settings and its parameters' names (the optimizers'
/// `param_groups`).
pub(crate) fn param_groups<C: GroupSettings>(
    groups: &Groups<C>,
    params: &[(String, Var)],
) -> Vec<(C, Vec<String>)> {
    groups
        .configs()
        .iter()
        .zip(groups.members())
        .map(|(config, members)| {
            let names = members.iter().map(|&i| params[i].0.clone()).collect();
            (*config, names)
        })
        .collect()
}
