//! Optimizers whose state can be saved and loaded: [`Sgd`] (momentum,
//! dampening, Nesterov, weight decay), [`Adam`] and [`AdamW`] (bias
//! correction, `amsgrad`), with PyTorch's formulas, defaults and rounding.
//!
//! candle-nn's `AdamW` keeps its moments and step count private, so a
//! candle program cannot resume AdamW training exactly. These implement
//! candle-nn's [`Optimizer`](candle_nn::Optimizer) trait (drop-in wherever
//! candle's are used) and [`StatefulOptimizer`]: their state is a set of
//! named tensors and settings, [`OptimizerState`], to save with the rest of
//! a training state and to load into a fresh optimizer.
//!
//! **Exactness.** Each element is updated as PyTorch's single-tensor CPU
//! path updates it (`torch/optim/sgd.py`, `adam.py`): the same operations in
//! the same order, each Python scalar rounded to the parameter's dtype once,
//! `lerp` and `add(alpha=…)` as fused multiply-adds, the bias corrections in
//! f64 with `pow`, and `addcmul` as the fused multiply-add its compiled
//! kernel is. `tests/suite/optim.rs` pins every option against real PyTorch 2.15
//! (`scripts/gen_optim_reference.py`, 25 steps): SGD bit for bit; Adam and
//! AdamW within 1e-6 relative (9.4e-7 at most, measured), not bit for bit,
//! because PyTorch's `sqrt` of an f32 tensor (in its MKL builds) is not
//! correctly rounded: one ulp away from the exact square root in about 20%
//! of elements (measured on 100,000 values), where Rust's is exact; each
//! step's denominators differ there by an ulp. As in PyTorch, a parameter
//! without a gradient in a step is skipped: no state, no decay, no step
//! counted.
//!
//! **Names.** [`Sgd::from_varmap`] (and the others') names each parameter's
//! state after its variable (`l1.weight.exp_avg`), which is what a
//! checkpoint needs. Through `Optimizer::new(vars, ..)` the parameters are
//! named by position (`0.exp_avg`, as PyTorch numbers them), so a state
//! loads back only into the same variables in the same order (note that
//! `VarMap::all_vars` does not promise an order).
//!
//! **Parameter groups** (PyTorch's `param_groups`): `with_groups(params,
//! configs, group_of)` puts the parameter named `name` in group
//! `group_of(name)`, each group with its own settings (rate, weight decay,
//! betas, momentum). The optimizer's rate is group 0's; candle's
//! `set_learning_rate` sets every other group's to its initial rate times
//! the same factor. A schedule over the groups sets each group's own rate
//! instead ([`StatefulOptimizer::set_group_learning_rates`] from
//! [`LrScheduler::group_lrs`]): PyTorch's schedules compute each group's
//! rate by their formula from the group's own base, which is not a common
//! factor where the schedule has a floor or absolute rates (a cosine's
//! `eta_min`, one-cycle's rates). [`LrScheduler::with_group_rates`] makes a
//! schedule for the groups' rates ([`FabricModel::set_schedule`](crate::fabric::FabricModel::set_schedule)
//! does it with the optimizer's), [`LrScheduler::per_group`] takes one per
//! group (PyTorch's lists of `max_lr`); `tests/suite/lr_schedule.rs` pins
//! every schedule over two groups against PyTorch 2.15 within 1e-12. A state holds
//! every group's settings and which parameters are outside group 0, and
//! loads only into an optimizer with the same groups (else an error naming
//! the parameter). Groups are chosen by name, so that ZeRO's and FSDP's
//! pieces, named as their parameters, fall into their parameters' groups.
//! `tests/suite/optim_groups.rs` pins them against PyTorch 2.15
//! (`scripts/gen_optim_groups_reference.py`: two groups of other settings
//! under a `LambdaLR`, 8 steps) within 1e-6, and through DP, DDP, ZeRO and
//! FSDP against one device. GPT-2's recipe, decay on the weights only:
//!
//! ```
//! use candle_core::{DType, Device};
//! use candle_dp::optim::{AdamW, AdamWConfig};
//! use candle_nn::{linear, VarBuilder, VarMap};
//!
//! # fn main() -> anyhow::Result<()> {
//! let varmap = VarMap::new();
//! linear(4, 2, VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu).pp("fc"))?;
//! let decay = AdamWConfig { lr: 1e-3, weight_decay: 0.1, ..Default::default() };
//! let none = AdamWConfig { weight_decay: 0.0, ..decay };
//! let params: Vec<_> = varmap.data().lock().unwrap().iter()
//!     .map(|(name, var)| (name.clone(), var.clone()))
//!     .collect();
//! let opt = AdamW::with_groups(params, vec![decay, none], |name| {
//!     usize::from(name.ends_with("bias")) // biases in group 1, not decayed
//! })?;
//! assert_eq!(opt.param_groups()[1].1, vec!["fc.bias".to_string()]);
//! # Ok(())
//! # }
//! ```
//!
//! [`LrScheduler`] gives any candle optimizer PyTorch's learning-rate
//! schedules (`LinearLR`, `CosineAnnealingLR`, `StepLR`, `ExponentialLR`,
//! `OneCycleLR`, `SequentialLR`, `LambdaLR`), step for step;
//! [`clip_grad_norm`] is PyTorch's `clip_grad_norm_`; [`GradScaler`] is its
//! dynamic loss scaling for f16 training.
//!
//! Parameters may be f32 or f64, on any device. A parameter on the CPU is
//! updated on the host, element by element, as above. One on another
//! device (a GPU) is updated where it lives, with candle's tensor ops in
//! PyTorch's order, its state kept there too: a step copies nothing to or
//! from the host. That path rounds each op on its own where the host path
//! fuses a multiply-add, so the two agree to rounding, not bit for bit:
//! within 1e-5 (f32) and 1e-12 (f64) of each tensor's largest value after
//! 6 steps of every option (both paths run on the CPU in the crate's
//! tests). A state saved from either path loads into the other (it is
//! saved on the host).
//!
//! ```
//! use candle_core::{DType, Device, Tensor};
//! use candle_dp::optim::{AdamW, AdamWConfig, StatefulOptimizer};
//! use candle_nn::{linear, Module, Optimizer, VarBuilder, VarMap};
//!
//! # fn main() -> anyhow::Result<()> {
//! let varmap = VarMap::new();
//! let model = linear(4, 2, VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu))?;
//! let mut opt = AdamW::from_varmap(&varmap, AdamWConfig::default())?;
//! let x = Tensor::ones((3, 4), DType::F32, &Device::Cpu)?;
//! opt.backward_step(&model.forward(&x)?.sum_all()?)?;
//!
//! let state = opt.state()?; // `weight.exp_avg`, `weight.step`, ... and the settings
//! let mut resumed = AdamW::from_varmap(&varmap, AdamWConfig::default())?;
//! resumed.load_state(&state)?; // continues exactly where `opt` is
//! # Ok(())
//! # }
//! ```

mod adam;
pub(crate) mod clip;
#[cfg(test)]
mod device_path;
mod element;
mod grad_scaler;
mod groups;
mod in_place;
mod lr_schedule;
mod schedule_groups;
mod schedule_kinds;
mod sgd;
mod state;
mod warmup_cosine;

pub use adam::{Adam, AdamConfig, AdamW, AdamWConfig};
pub use clip::{clip_grad_norm, Clipped};
pub use grad_scaler::{GradScaler, GradScalerConfig, GradScalerState};
pub use lr_schedule::{Anneal, LrLambda, LrScheduler, LrSchedulerState, OneCycleConfig};
pub use sgd::{Sgd, SgdConfig};
pub use state::{OptimizerState, ShardOf, StatefulOptimizer};
