//! The parallel backward paths of a [`DataParallel`] and the reduce of the
//! replicas' gradients onto the master: from the gradient of the gathered
//! output ([`DataParallel::backward`]), from a loss on it
//! ([`DataParallel::backward_from_loss`]), or fused with the forward
//! ([`DataParallel::forward_backward`]).

use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_core::backprop::GradStore;
use candle_core::{Tensor, Var};

use super::reduce::{balanced_partition, sum_gradients};
use super::scatter_gather::{batch_rows, scatter, Scatter, ScatterPlan, Split};
use super::timings::slowest;
use super::{DataParallel, SavedForward};
use crate::error::{Error, Result};
use crate::step::{LossReduction, Step};
use crate::util::lock::lock;
use crate::util::vars::grads_of;

/// One replica's part of a parallel backward.
struct ReplicaGrads {
    /// The gradient of every master variable (`None`: no gradient).
    grads: Vec<Option<Tensor>>,
    backward: Duration,
}

/// One replica's part of a fused forward and backward.
struct ReplicaStep {
    /// The replica's loss, weighted by its share of the batch, detached.
    loss: Tensor,
    grads: ReplicaGrads,
}

impl<M: 'static> DataParallel<M> {
    /// The master parameters (buffers excluded) that received no gradient
    /// in the latest parallel backward ([`backward`](Self::backward),
    /// [`backward_from_loss`](Self::backward_from_loss),
    /// [`forward_backward`](Self::forward_backward)); see
    /// [`Step::vars_without_grad`].
    pub fn vars_without_grad(&self) -> Vec<String> {
        lock(&self.without_grad).clone()
    }

    fn record_without_grad(&self, grads: &GradStore) -> Vec<String> {
        let missing = self.no_grad.check("DataParallel", &self.params, grads);
        lock(&self.without_grad).clone_from(&missing);
        missing
    }

    /// Parallel backward from the gradient of the gathered output: each
    /// replica back-propagates its slice of `grad_output` on its own thread,
    /// and the gradients are summed into a store keyed by the master vars.
    ///
    /// `output` must be the result of this `DataParallel`'s most recent
    /// [`forward`](Self::forward) / [`forward_t`](Self::forward_t).
    pub fn backward(&self, output: &Tensor, grad_output: &Tensor) -> Result<GradStore> {
        self.backward_reporting(output, grad_output)
            .map(|(grads, _)| grads)
    }

    /// [`backward`](Self::backward), with the parameters that got no
    /// gradient in this very step (another thread's step may follow at once).
    fn backward_reporting(
        &self,
        output: &Tensor,
        grad_output: &Tensor,
    ) -> Result<(GradStore, Vec<String>)> {
        let _step = lock(&self.step);
        let start = Instant::now();
        // Checked before the saved forward is taken, so that a corrected
        // retry still finds it.
        if grad_output.dims() != output.dims() || grad_output.dtype() != output.dtype() {
            return Err(Error::NoMatchingForward(format!(
                "grad_output is {:?} {:?} but the output is {:?} {:?}",
                grad_output.dtype(),
                grad_output.dims(),
                output.dtype(),
                output.dims()
            )));
        }
        let saved = self.take_saved(output)?;
        let plan = self.output_plan(&saved.outputs)?;
        let grads = scatter(grad_output, &plan)?;
        let parts: Vec<(Tensor, Tensor)> = saved.outputs.into_iter().zip(grads).collect();
        let master = self.master_vars.clone();
        let per_replica = self
            .replicas
            .parallel_apply(parts, move |_, (out, grad), _| {
                let start = Instant::now();
                // d/d(out) of sum(out * grad) is exactly `grad`.
                let seeded = (&out * grad.reshape(out.shape())?.detach())?.sum_all()?;
                Ok(ReplicaGrads {
                    grads: grads_of(&seeded.backward()?, &master),
                    backward: start.elapsed(),
                })
            })?;
        let backward = slowest(per_replica.iter().map(|r| r.backward));
        let reduce_start = Instant::now();
        let grads = self.reduce_add(per_replica.into_iter().map(|r| r.grads).collect())?;
        let without_grad = self.record_without_grad(&grads);
        self.timings
            .backward(backward, reduce_start.elapsed(), start.elapsed());
        Ok((grads, without_grad))
    }

    /// Computes `loss_fn` on the gathered output (on the output device) and
    /// runs the backward in parallel on the replicas: any loss, including
    /// ones that do not split over rows, with a parallel backward.
    /// Returns the loss and the master gradients.
    pub fn backward_from_loss<F>(&self, output: &Tensor, loss_fn: F) -> Result<Step>
    where
        F: FnOnce(&Tensor) -> candle_core::Result<Tensor>,
    {
        // A detached copy as a variable: the loss's backward stops there and
        // yields exactly the gradient of the gathered output.
        let leaf = Var::from_tensor(&output.detach())?;
        let loss = loss_fn(leaf.as_tensor())?;
        let grad_output = match loss.backward()?.remove(leaf.as_tensor()) {
            Some(grad) => grad,
            None => output.zeros_like()?,
        };
        let (grads, without_grad) = self.backward_reporting(output, &grad_output)?;
        Ok(Step {
            loss: loss.detach(),
            grads,
            without_grad,
        })
    }

    /// The fast path: each replica computes its output and its own loss on
    /// its part of `input` (e.g. `(x, y)`: targets are scattered with the
    /// inputs) and back-propagates on its own thread; nothing is gathered
    /// but the loss. With [`LossReduction::Mean`] each replica's loss is
    /// weighted by its share of the rows, so the result equals single-device
    /// training on the whole batch.
    ///
    /// ```
    /// use candle_core::{DType, Device, Tensor};
    /// use candle_nn::{linear, loss, Module, Optimizer, VarMap, SGD};
    /// use candle_dp::{cpu_devices, DataParallel, LossReduction};
    ///
    /// # fn main() -> anyhow::Result<()> {
    /// let varmap = VarMap::new();
    /// let dp = DataParallel::new(&varmap, DType::F32, &cpu_devices(2), |vb| linear(4, 3, vb))?;
    /// let mut sgd = SGD::new(varmap.all_vars(), 0.1)?;
    /// let x = Tensor::randn(0f32, 1., (6, 4), &Device::Cpu)?;
    /// let y = Tensor::new(&[0u32, 1, 2, 0, 1, 2], &Device::Cpu)?;
    /// let step = dp.forward_backward((x, y), LossReduction::Mean, |m, (x, y)| {
    ///     loss::cross_entropy(&m.forward(&x)?, &y)
    /// })?;
    /// sgd.step(&step.grads)?;
    /// println!("loss {}", step.loss.to_scalar::<f32>()?);
    /// # Ok(())
    /// # }
    /// ```
    pub fn forward_backward<I, F>(
        &self,
        input: I,
        reduction: LossReduction,
        loss_fn: F,
    ) -> Result<Step>
    where
        I: Scatter + Send + 'static,
        F: Fn(&M, I) -> candle_core::Result<Tensor> + Send + Sync + 'static,
    {
        let _step = lock(&self.step);
        let (dim, rows) = (self.dim, batch_rows(&input, self.dim));
        let master = self.master_vars.clone();
        let per_replica = self.scatter_apply(input, &Split::Even, move |model, part, cancel| {
            let share = match (reduction, rows) {
                (LossReduction::Mean, Some(rows)) if rows > 0 => {
                    batch_rows(&part, dim).unwrap_or(rows) as f64 / rows as f64
                }
                _ => 1.0,
            };
            let loss = loss_fn(model, part)?;
            if loss.elem_count() != 1 {
                candle_core::bail!("the loss must be a scalar, got shape {:?}", loss.dims());
            }
            let weighted = loss.reshape(())?.affine(share, 0.)?;
            if cancel.is_cancelled() {
                candle_core::bail!("step abandoned: another replica failed");
            }
            let start = Instant::now();
            let grads = grads_of(&weighted.backward()?, &master);
            Ok(ReplicaStep {
                loss: weighted.detach(),
                grads: ReplicaGrads {
                    grads,
                    backward: start.elapsed(),
                },
            })
        })?;
        let backward = slowest(per_replica.iter().map(|r| r.grads.backward));
        let gather_start = Instant::now();
        let mut loss = crate::device_copy::to_device(&per_replica[0].loss, &self.output_device)?;
        for r in &per_replica[1..] {
            loss = (loss + crate::device_copy::to_device(&r.loss, &self.output_device)?)?;
        }
        let reduce_start = Instant::now();
        let grads = self.reduce_add(per_replica.into_iter().map(|r| r.grads.grads).collect())?;
        self.replicas.commit_buffers()?;
        self.timings.fused_backward(
            backward,
            reduce_start - gather_start,
            reduce_start.elapsed(),
            gather_start.elapsed(),
        );
        Ok(Step {
            loss,
            without_grad: self.record_without_grad(&grads),
            grads,
        })
    }

    /// One forward and backward of `input` whole on the first replica,
    /// nothing reduced: `loss_fn` gives the loss to differentiate and the
    /// one to report; returns the reported loss and the gradient of every
    /// master variable, on the output device. Deterministic training
    /// runs its chunks so, one after another.
    ///
    /// # Errors
    ///
    /// The model's, the loss's (which must be a scalar); a copy's.
    pub(crate) fn forward_backward_whole<I, F>(
        &self,
        input: I,
        loss_fn: F,
    ) -> Result<(Tensor, Vec<Option<Tensor>>)>
    where
        I: Scatter + Send + 'static,
        F: Fn(&M, I) -> candle_core::Result<(Tensor, Tensor)> + Send + Sync + 'static,
    {
        let _step = lock(&self.step);
        let rows = batch_rows(&input, self.dim).unwrap_or(1);
        let master = self.master_vars.clone();
        let mut parts =
            self.scatter_apply(input, &Split::Sizes(vec![rows]), move |model, x, _| {
                let (loss, reported) = loss_fn(model, x)?;
                if loss.elem_count() != 1 {
                    candle_core::bail!("the loss must be a scalar, got shape {:?}", loss.dims());
                }
                Ok((reported.detach(), grads_of(&loss.backward()?, &master)))
            })?;
        self.replicas.commit_buffers()?;
        let (loss, grads) = parts
            .pop()
            .ok_or_else(|| Error::Fabric("the first replica gave no result".into()))?;
        let on_output = |t: &Tensor| crate::device_copy::to_device(t, &self.output_device);
        let grads = grads
            .iter()
            .map(|g| g.as_ref().map(on_output).transpose())
            .collect::<candle_core::Result<_>>()?;
        Ok((on_output(&loss)?, grads))
    }

    fn take_saved(&self, output: &Tensor) -> Result<SavedForward> {
        let mut last = lock(&self.last_forward);
        match last.take() {
            Some(saved) if saved.gathered == output.id() => Ok(saved),
            Some(saved) => {
                *last = Some(saved);
                Err(Error::NoMatchingForward(
                    "this tensor is not the latest output (was it transformed, or from an older step?)".into(),
                ))
            }
            None => Err(Error::NoMatchingForward(
                "there is none (no forward yet, or its backward already ran)".into(),
            )),
        }
    }

    /// Rows of the gathered output that came from each replica.
    fn output_plan(&self, outputs: &[Tensor]) -> Result<ScatterPlan> {
        let sizes = outputs
            .iter()
            .map(|out| {
                if out.rank() == 0 {
                    Ok(1)
                } else {
                    out.dim(self.dim)
                }
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        Ok(ScatterPlan {
            dim: self.dim,
            devices: self.devices[..sizes.len()].to_vec(),
            sizes,
        })
    }

    /// Sums the replicas' gradients per master variable, in replica order
    /// (deterministic, see [`super::reduce`]), into one store. The variables
    /// are split between the (now idle) replica workers, which reduce their
    /// share in parallel.
    fn reduce_add(&self, per_replica: Vec<Vec<Option<Tensor>>>) -> Result<GradStore> {
        let master = self.master_vars.clone();
        let sums: Vec<(usize, Option<Tensor>)> = if let [_] = per_replica.as_slice() {
            per_replica.into_iter().flatten().enumerate().collect()
        } else {
            let sizes: Vec<usize> = master.iter().map(|(_, v)| v.elem_count()).collect();
            let groups = balanced_partition(&sizes, per_replica.len());
            let per_replica = Arc::new(per_replica);
            let work_master = master.clone();
            self.replicas
                .parallel_apply(groups, move |_, vars, _| {
                    vars.into_iter()
                        .map(|i| {
                            let parts: Vec<Option<Tensor>> =
                                per_replica.iter().map(|g| g[i].clone()).collect();
                            let sum =
                                sum_gradients(&parts, work_master[i].1.device()).map_err(|e| {
                                    e.context(format!(
                                        "summing the gradients of `{}`",
                                        work_master[i].0
                                    ))
                                })?;
                            Ok((i, sum))
                        })
                        .collect::<candle_core::Result<Vec<_>>>()
                })?
                .into_iter()
                .flatten()
                .collect()
        };
        let mut store = GradStore::default();
        for (i, sum) in sums {
            if let Some(sum) = sum {
                store.insert(master[i].1.as_tensor(), sum);
            }
        }
        Ok(store)
    }
}
