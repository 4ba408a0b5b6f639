//! DDP over a model given as [`Units`]: each gradient bucket is reduced on
//! a communication thread as soon as the backward has finished its
//! gradients, while the backward of the earlier units computes (what
//! PyTorch's reducer does from autograd hooks, which candle lacks).
//!
//! The walk: the forward runs unit by unit ([`Units`]); the backward runs
//! last unit first; after each unit, the buckets whose parameters are all
//! final (no earlier unit uses them) go to the communication thread, in
//! bucket order, the same on every rank. The buckets, their contents and
//! their reduction are those of the DDP without units given the same
//! [`bucket_order`](crate::DdpConfig::bucket_order), so the weights are
//! the same bytes.

use std::panic::{self, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor};
use candle_nn::VarMap;
use crossbeam::channel;

use super::buckets::{BucketReducer, Reduced};
use super::timeline::{Activity, Span};
use super::{DdpConfig, DistributedDataParallel};
use crate::buffers::BufferSnapshot;
use crate::comm::ProcessGroup;
use crate::error::{Error, Result};
use crate::step::Step;
use crate::units::{UnitFactory, Units};
use crate::util::panic_message::panic_message;
use crate::util::vars::with_accumulated;

/// Why the walk stopped early: a reduction failed (its error is the one
/// returned).
const STOPPED: &str = "stopped: a reduction failed";

/// A bucket handed to the communication thread.
struct Job {
    bucket: usize,
    /// This rank's gradient of each of the bucket's parameters.
    grads: Vec<Option<Tensor>>,
    /// The unit after whose backward it was ready (`None`: at the end).
    unit: Option<usize>,
}

/// A bucket back from the communication thread.
struct Done {
    bucket: usize,
    unit: Option<usize>,
    result: Result<Reduced>,
    span: Span,
}

impl DistributedDataParallel<Units> {
    /// Builds this rank's model from `units` (one factory each, as for a
    /// [`Pipeline`](crate::pipeline::Pipeline); tied weights across units
    /// allowed) on `device`, as [`new`](Self::new) builds a model: every
    /// rank must call it, with the same units. The buckets fill in the
    /// order the backward finishes the gradients ([`Units::bucket_order`])
    /// unless [`DdpConfig::bucket_order`] names one.
    /// [`forward_backward`](Self::forward_backward) then reduces them while
    /// the backward runs; [`forward`](Self::forward_t) and
    /// [`backward`](Self::backward) keep working as for any module (the
    /// whole graph, reduced after the backward).
    ///
    /// ```
    /// use candle_core::{DType, Device, Tensor};
    /// use candle_dp::launch::spawn;
    /// use candle_dp::pipeline::unit;
    /// use candle_dp::{DdpConfig, DistributedDataParallel};
    /// use candle_nn::{linear, loss, Activation, Optimizer, VarMap, SGD};
    ///
    /// spawn(2, |ctx| {
    ///     let varmap = VarMap::new();
    ///     let units = vec![
    ///         unit(|vb| linear(4, 8, vb.pp("a"))),
    ///         unit(|_| Ok(Activation::Relu)),
    ///         unit(|vb| linear(8, 2, vb.pp("b"))),
    ///     ];
    ///     let mut ddp = DistributedDataParallel::from_units(
    ///         ctx.process_group(), &varmap, DType::F32, &Device::Cpu, units, DdpConfig::default())?;
    ///     // The last unit's parameters are reduced first.
    ///     assert_eq!(ddp.buckets(), [["b.bias", "b.weight", "a.bias", "a.weight"]]);
    ///     let mut sgd = SGD::new(varmap.all_vars(), 0.1)?;
    ///     let x = Tensor::randn(0f32, 1., (6, 4), &Device::Cpu)?;
    ///     let y = Tensor::new(&[0u32, 1, 0, 1, 0, 1], &Device::Cpu)?;
    ///     let step = ddp.forward_backward(&x, &y, |out, y| loss::cross_entropy(out, y))?;
    ///     sgd.step(&step.grads)?;
    ///     Ok(())
    /// })?;
    /// # Ok::<(), anyhow::Error>(())
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::Units`] for no units; a unit's factory failing, as for
    /// [`new`](Self::new).
    pub fn from_units(
        pg: std::sync::Arc<dyn ProcessGroup>,
        varmap: &VarMap,
        dtype: DType,
        device: &Device,
        units: Vec<UnitFactory>,
        config: DdpConfig,
    ) -> Result<Self> {
        if units.is_empty() {
            return Err(Error::Units(
                "a model given as units needs at least one unit".into(),
            ));
        }
        let mut ddp = Self::build_with_order(
            pg,
            varmap,
            dtype,
            device,
            |vb| Units::build(vb, &units).map_err(candle_core::Error::wrap),
            config,
            |units| Some(units.bucket_order()),
        )?;
        ddp.set_overlaps();
        Ok(ddp)
    }

    /// One training step on this rank's batch: the forward unit by unit,
    /// `loss_fn(output, y)` (a scalar), then the backward unit by unit,
    /// last first, each bucket all-reduced on a communication thread as
    /// soon as its gradients are final, while the earlier units' backward
    /// computes. Returns this rank's loss and the gradients averaged over
    /// the ranks (plus what [`no_sync`](Self::no_sync) accumulated), as
    /// [`backward`](Self::backward) does: the same buckets, the same
    /// reduction, so the same bytes. Inside `no_sync` nothing is reduced
    /// and the store is empty; at ZeRO stage 2 it holds this rank's own
    /// parameters' gradients. [`last_timings`](Self::last_timings) has the
    /// step's timeline.
    ///
    /// # Errors
    ///
    /// A failed reduction is [`Error::OverlappedReduction`], naming the
    /// rank, the bucket and the unit after which it was handed over; a
    /// unit's backward failing after reductions began also fails the group
    /// (the other ranks' reductions of this step could not complete). A
    /// unit that gives a gradient to a parameter it did not ask its
    /// `VarBuilder` for (its bucket may be on its way) is [`Error::Units`].
    /// On any error (or a panic) nothing is returned, the buffers are put
    /// back as the step found them and what `no_sync` accumulated is kept.
    pub fn forward_backward<F>(&mut self, x: &Tensor, y: &Tensor, loss_fn: F) -> Result<Step>
    where
        F: FnOnce(&Tensor, &Tensor) -> candle_core::Result<Tensor>,
    {
        // A failed step leaves the buffers as it found them: the forward
        // updates them in place (or, with mixed precision, commits them
        // before the last thing that can fail), and the broadcast replaces
        // them on every rank but rank 0.
        let before = match BufferSnapshot::take(self.buffers()) {
            Ok(before) => before,
            Err(e) => {
                // Out of memory for a copy: this rank cannot start the
                // step, so the others must not wait in its collectives.
                let pg = self.process_group();
                pg.abort(&format!(
                    "rank {}: DDP's step could not start: {e}",
                    pg.rank()
                ));
                return Err(e.into());
            }
        };
        match panic::catch_unwind(AssertUnwindSafe(|| self.step_overlapped(x, y, loss_fn))) {
            Ok(Ok(step)) => Ok(step),
            Ok(Err(e)) => {
                before.restore_after(&e);
                Err(e)
            }
            Err(payload) => {
                before.restore_after(&"a panic");
                panic::resume_unwind(payload)
            }
        }
    }

    fn step_overlapped<F>(&mut self, x: &Tensor, y: &Tensor, loss_fn: F) -> Result<Step>
    where
        F: FnOnce(&Tensor, &Tensor) -> candle_core::Result<Tensor>,
    {
        self.pre_forward()?;
        let start = Instant::now();
        let trace = self.module().forward_traced(&self.input(x)?, true)?;
        let output = trace
            .output()
            .ok_or_else(|| Error::Units("the model has no units".into()))?;
        let loss = loss_fn(output, y)?;
        if loss.elem_count() != 1 {
            return Err(Error::Units(format!(
                "the loss must be a scalar, got shape {:?}",
                loss.dims()
            )));
        }
        let mut timeline = vec![Span {
            activity: Activity::Forward,
            start: Duration::ZERO,
            end: start.elapsed(),
        }];
        let walk = Walk::new(self);
        if !self.is_syncing() {
            let local = walk.local_grads(trace, &loss, start, &mut timeline)?;
            let store = self.store_of(local)?;
            // The buffers first: a failed commit must not leave this
            // step's gradients in what `no_sync` accumulated.
            self.commit_buffers()?;
            self.synchronise(&store)?;
            return Ok(self.step(&loss, GradStore::default()));
        }
        let reducer = self.reducer();
        let overlapped = walk.overlapped(&reducer, trace, &loss, start, &mut timeline);
        let reduced = overlapped.and_then(|reduced| {
            reducer.pg.wait_for_device()?;
            Ok(reduced)
        });
        let (store, all_reduce) = reduced?;
        let backward = timeline
            .iter()
            .filter(|s| matches!(s.activity, Activity::Backward { .. }))
            .map(Span::duration)
            .sum();
        timeline.sort_by_key(|s| s.start);
        self.record_overlapped(backward, all_reduce, timeline);
        // Before `synchronised` spends what `no_sync` accumulated: a failed
        // commit keeps it.
        self.commit_buffers()?;
        let grads = self.synchronised(store);
        Ok(self.step(&loss, grads))
    }

    /// The `Step` of a successful `forward_backward`.
    fn step(&self, loss: &Tensor, grads: GradStore) -> Step {
        let without_grad = if self.is_syncing() {
            self.vars_without_grad().to_vec()
        } else {
            Vec::new()
        };
        Step {
            loss: loss.detach(),
            grads,
            without_grad,
        }
    }

    /// `local` (one optional gradient per parameter) as a `GradStore`.
    fn store_of(&self, local: Vec<Option<Tensor>>) -> Result<GradStore> {
        let mut store = GradStore::default();
        for ((_, var), grad) in self.params().iter().zip(local) {
            if let Some(grad) = grad {
                store.insert(var.as_tensor(), grad);
            }
        }
        Ok(store)
    }
}

/// What the backward walk needs to know of the DDP: its parameters, its
/// buckets, and after which unit each is ready.
struct Walk<'a> {
    ddp: &'a DistributedDataParallel<Units>,
    /// Per parameter, the first unit that uses it (`None`: no unit asked
    /// for it; its gradient is final only at the end).
    first_use: Vec<Option<usize>>,
    /// Per bucket, the unit after whose backward all its parameters are
    /// final (`None`: only at the end).
    ready_after: Vec<Option<usize>>,
}

impl<'a> Walk<'a> {
    fn new(ddp: &'a DistributedDataParallel<Units>) -> Self {
        let by_name = ddp.module().first_use();
        let first_use: Vec<Option<usize>> = ddp
            .params()
            .iter()
            .map(|(name, _)| by_name.get(name.as_str()).copied())
            .collect();
        let ready_after = ddp
            .bucket_list()
            .iter()
            .map(|b| {
                b.params
                    .iter()
                    .map(|&i| first_use[i])
                    .try_fold(usize::MAX, |min, u| u.map(|u| min.min(u)))
            })
            .collect();
        Walk {
            ddp,
            first_use,
            ready_after,
        }
    }

    /// Adds unit `k`'s gradients into `local`, and checks that the unit
    /// touched no parameter already final.
    fn add_unit(&self, k: usize, grads: &GradStore, local: &mut [Option<Tensor>]) -> Result<()> {
        for (i, (name, var)) in self.ddp.params().iter().enumerate() {
            let Some(g) = grads.get(var.as_tensor()) else {
                continue;
            };
            if matches!(self.first_use[i], Some(first) if first > k) {
                return Err(Error::Units(format!(
                    "unit {k} gave a gradient to `{name}`, which it did not ask its VarBuilder for \
                     (the first unit that did is {}): its bucket may already be reduced; build \
                     each unit's variables through the VarBuilder its factory gets",
                    self.first_use[i].unwrap_or(k)
                )));
            }
            local[i] = Some(match local[i].take() {
                Some(sum) => (sum + g)?,
                None => g.clone(),
            });
        }
        Ok(())
    }

    /// The backward unit by unit without reduction (inside `no_sync`).
    fn local_grads(
        &self,
        trace: crate::units::Trace,
        loss: &Tensor,
        start: Instant,
        timeline: &mut Vec<Span>,
    ) -> Result<Vec<Option<Tensor>>> {
        let mut local = vec![None; self.ddp.params().len()];
        let mut unit_start = start.elapsed();
        trace.backward(loss, |k, grads| -> Result<()> {
            self.add_unit(k, &grads, &mut local)?;
            let end = start.elapsed();
            timeline.push(Span {
                activity: Activity::Backward { unit: k },
                start: unit_start,
                end,
            });
            unit_start = end;
            Ok(())
        })?;
        Ok(local)
    }

    /// The backward unit by unit, each bucket handed to a communication
    /// thread once ready. Returns the reduced gradients (at ZeRO stage 2,
    /// this rank's pieces) and the time the communication thread was busy.
    fn overlapped(
        &self,
        reducer: &BucketReducer<'_>,
        trace: crate::units::Trace,
        loss: &Tensor,
        start: Instant,
        timeline: &mut Vec<Span>,
    ) -> Result<(GradStore, Duration)> {
        let buckets = self.ddp.bucket_list();
        let accumulated = self.ddp.accumulated();
        let failed = AtomicBool::new(false);
        let (jobs, job_rx) = channel::unbounded::<Job>();
        let (done_tx, done) = channel::unbounded::<Done>();
        let pg = reducer.pg;
        let walked = std::thread::scope(|s| {
            let comm = std::thread::Builder::new()
                .name(format!("ddp-comm-{}", pg.rank()))
                .spawn_scoped(s, || {
                    for job in job_rx {
                        // After a failure the group is failed: every later
                        // bucket would fail alike.
                        if failed.load(Ordering::Acquire) {
                            continue;
                        }
                        let begin = start.elapsed();
                        let result = reduce_job(reducer, &buckets[job.bucket], &job.grads);
                        if let Err(e) = &result {
                            failed.store(true, Ordering::Release);
                            // A local failure (a conversion, memory) leaves
                            // the others waiting in this bucket or the next:
                            // fail the group (only its first failure counts).
                            pg.abort(&format!(
                                "rank {}: the reduction of bucket {} failed: {e}",
                                pg.rank(),
                                job.bucket
                            ));
                        }
                        let span = Span {
                            activity: Activity::Reduce { bucket: job.bucket },
                            start: begin,
                            end: start.elapsed(),
                        };
                        let _ = done_tx.send(Done {
                            bucket: job.bucket,
                            unit: job.unit,
                            result,
                            span,
                        });
                    }
                })
                .map_err(|e| Error::Units(format!("cannot start the communication thread: {e}")))?;
            let mut local = vec![None; self.ddp.params().len()];
            let mut next = 0;
            let mut handed = 0;
            let mut send =
                |upto_unit: Option<usize>, local: &mut Vec<Option<Tensor>>| -> Result<()> {
                    while next < buckets.len() {
                        let ready = match (self.ready_after[next], upto_unit) {
                            (_, None) => true,
                            (Some(u), Some(k)) => u >= k,
                            (None, Some(_)) => false,
                        };
                        if !ready {
                            break;
                        }
                        let grads = buckets[next]
                            .params
                            .iter()
                            .map(|&i| {
                                with_accumulated(
                                    accumulated.and_then(|acc| acc[i].as_ref()),
                                    local[i].take(),
                                )
                            })
                            .collect::<candle_core::Result<Vec<_>>>()?;
                        // A closed channel means the thread is gone: its
                        // result (or panic) is reported at the join.
                        let _ = jobs.send(Job {
                            bucket: next,
                            grads,
                            unit: upto_unit,
                        });
                        next += 1;
                        handed += 1;
                    }
                    Ok(())
                };
            let mut unit_start = start.elapsed();
            let walk = panic::catch_unwind(AssertUnwindSafe(|| {
                trace
                    .backward(loss, |k, grads| -> Result<()> {
                        if failed.load(Ordering::Acquire) {
                            return Err(Error::Units(STOPPED.into()));
                        }
                        self.add_unit(k, &grads, &mut local)?;
                        drop(grads);
                        let end = start.elapsed();
                        timeline.push(Span {
                            activity: Activity::Backward { unit: k },
                            start: unit_start,
                            end,
                        });
                        send(Some(k), &mut local)?;
                        unit_start = start.elapsed();
                        Ok(())
                    })
                    .and_then(|()| send(None, &mut local))
            }));
            let stop = |why: &dyn std::fmt::Display| {
                if handed > 0 && !failed.load(Ordering::Acquire) {
                    // This rank's remaining collectives of the step will not
                    // come: the others must not wait for them.
                    pg.abort(&format!(
                        "rank {}: the backward failed after its first gradient buckets were \
                         handed over: {why}",
                        pg.rank()
                    ));
                }
            };
            let walk = match walk {
                Ok(walk) => {
                    if let Err(e) = &walk {
                        stop(e);
                    }
                    walk
                }
                Err(payload) => {
                    stop(&panic_message(payload.as_ref()));
                    drop(jobs);
                    let _ = comm.join();
                    panic::resume_unwind(payload);
                }
            };
            drop(jobs);
            let wait_start = start.elapsed();
            let joined = comm.join();
            timeline.push(Span {
                activity: Activity::Wait,
                start: wait_start,
                end: start.elapsed(),
            });
            match joined {
                Ok(()) => walk,
                Err(payload) => {
                    let why = format!(
                        "the communication thread panicked: {}",
                        panic_message(payload.as_ref())
                    );
                    pg.abort(&format!("rank {}: {why}", pg.rank()));
                    Err(Error::Units(why))
                }
            }
        });
        let mut results: Vec<Done> = done.try_iter().collect();
        results.sort_by_key(|d| d.bucket);
        // The walk's own failure first, unless it only stopped because a
        // reduction failed: then the reduction's.
        let stopped = match walked {
            Ok(()) => None,
            Err(Error::Units(why)) if why == STOPPED => Some(Error::Units(why)),
            Err(e) => return Err(e),
        };
        let mut reduced = Vec::with_capacity(results.len());
        let mut busy = Duration::ZERO;
        for d in results {
            busy += d.span.duration();
            timeline.push(d.span);
            match d.result {
                Ok(r) => reduced.push(r),
                Err(source) => {
                    return Err(Error::OverlappedReduction {
                        rank: pg.rank(),
                        bucket: d.bucket,
                        unit: d.unit,
                        source: Box::new(source),
                    })
                }
            }
        }
        if let Some(e) = stopped {
            return Err(e);
        }
        let mut store = GradStore::default();
        let params = self.ddp.params();
        for r in reduced {
            for (i, grad) in r.grads {
                store.insert(params[i].1.as_tensor(), grad);
            }
        }
        Ok((store, busy))
    }
}

/// One bucket's reduction on the communication thread: on a group that
/// reduces on the GPUs, its presence flags summed on the host first.
fn reduce_job(
    reducer: &BucketReducer<'_>,
    bucket: &super::buckets::Bucket,
    grads: &[Option<Tensor>],
) -> Result<Reduced> {
    let presence = match reducer.pg.reduces_on_device() {
        true => Some(reducer.presence_on_host(grads)?),
        false => None,
    };
    reducer.reduce(bucket, grads, presence.as_deref())
}
