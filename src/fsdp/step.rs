//! One FSDP step: the forward unit by unit over gathered parameters, the
//! backward unit by unit with the resharded units recomputed, and each
//! final gradient reduce-scattered to the ranks' pieces.

use std::collections::HashMap;

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var};
use candle_nn::VarBuilder;

use super::gathered::Gathered;
use super::release;
use super::FullyShardedDataParallel;
use crate::buffers::BufferSnapshot;
use crate::comm::ReduceOp;
use crate::error::{Error, Result};
use crate::sharding::{reduce_scatter_grads, ShardLayout};
use crate::step::Step;
use crate::units::boundary;
use crate::units::{build_layer, fingerprint, Fingerprint};
use crate::util::vars::with_accumulated;

/// What the latest step held on this rank, in bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FsdpMemory {
    /// This rank's pieces of the parameters (held between steps).
    pub shard_bytes: usize,
    /// The most whole parameters gathered at once during the step (in the
    /// parameters' dtype; under mixed precision the compute-dtype copy
    /// each use makes is not counted).
    pub peak_gathered_bytes: usize,
    /// The whole model's parameters, for scale.
    pub full_bytes: usize,
}

/// One unit built over its gathered parameters, with its forward's graph.
struct UnitRun {
    /// The gathered parameters, as variables, by parameter index.
    vars: Vec<(usize, Var)>,
    /// Where the unit's graph starts (none for the first unit).
    leaf: Option<Var>,
    output: Tensor,
}

/// The gathered bytes alive, and the most at once.
#[derive(Default)]
struct Held {
    now: usize,
    peak: usize,
}

impl Held {
    fn add(&mut self, bytes: usize) {
        self.now += bytes;
        self.peak = self.peak.max(self.now);
    }

    fn sub(&mut self, bytes: usize) {
        self.now = self.now.saturating_sub(bytes);
    }

    fn drop_run(&mut self, run: &UnitRun) {
        self.sub(vars_bytes(&run.vars));
    }
}

fn vars_bytes(vars: &[(usize, Var)]) -> usize {
    vars.iter()
        .map(|(_, v)| v.elem_count() * v.dtype().size_in_bytes())
        .sum()
}

/// A unit's whole parameters, gathered, as variables, by parameter index.
type GatheredVars = Vec<(usize, Var)>;

/// The buffers a unit is built over.
#[derive(Clone, Copy)]
enum Buffers<'a> {
    /// FSDP's own: the forward updates them.
    Live,
    /// Fresh variables holding these values (every buffer's, in order).
    Copies(&'a [Tensor]),
}

impl FullyShardedDataParallel {
    /// Unit `k`'s whole parameters, gathered in one collective, as
    /// variables (so that the unit's backward computes their gradients),
    /// in the parameters' dtype: the unit casts them to its compute dtype
    /// at each use ([`Gathered`]).
    fn gather_unit(&self, k: usize) -> Result<GatheredVars> {
        let params = &self.unit_params[k];
        let whole = self.gather(params)?;
        params
            .iter()
            .zip(whole)
            .map(|(&p, t)| Ok((p, Var::from_tensor(&t)?)))
            .collect()
    }

    /// Runs `work` on this thread while unit `next`'s parameters are
    /// gathered on another (FSDP2's prefetch); without prefetch, or for no
    /// next unit, `work` alone. The gathering is the only collective in
    /// flight: `work` issues none, and the caller's next collective comes
    /// after this returns, so every rank keeps one order.
    fn with_prefetch<T>(
        &self,
        next: Option<usize>,
        work: impl FnOnce() -> T,
    ) -> (T, Option<Result<GatheredVars>>) {
        let next = next.filter(|_| self.config.prefetch);
        std::thread::scope(|s| {
            let gathering = next.map(|k| s.spawn(move || self.gather_unit(k)));
            let out = work();
            let gathered = gathering.map(|thread| {
                thread.join().unwrap_or_else(|payload| {
                    Err(Error::Fsdp(format!(
                        "the thread gathering the next unit panicked: {}",
                        crate::util::panic_message::panic_message(payload.as_ref())
                    )))
                })
            });
            (out, gathered)
        })
    }

    /// Unit `k`'s parameters: prefetched, or gathered now (and counted).
    fn take_or_gather(
        &self,
        k: usize,
        prefetched: Option<Result<GatheredVars>>,
        held: &mut Held,
    ) -> Result<GatheredVars> {
        match prefetched {
            // Counted when it arrived, beside the unit then running.
            Some(vars) => vars,
            None => {
                let vars = self.gather_unit(k)?;
                held.add(vars_bytes(&vars));
                Ok(vars)
            }
        }
    }

    /// Unit `k` built over its gathered parameters `vars` and run on
    /// `input` (on a leaf, so that its backward yields the input's
    /// gradient).
    fn run_unit(
        &self,
        k: usize,
        vars: GatheredVars,
        input: &Tensor,
        train: bool,
        buffers: Buffers<'_>,
    ) -> Result<UnitRun> {
        let mut by_name: HashMap<String, (Tensor, DType)> = vars
            .iter()
            .map(|(p, v)| {
                let dtype = self.compute_dtype(*p);
                (self.shards[*p].0.clone(), (v.as_tensor().clone(), dtype))
            })
            .collect();
        for &b in &self.unit_buffers[k] {
            let (name, var) = &self.buffers[b];
            let tensor = match buffers {
                // The variable itself: the unit's forward updates it.
                Buffers::Live => var.as_tensor().clone(),
                // A variable of its own, whose update is thrown away.
                Buffers::Copies(before) => {
                    Var::from_tensor(&before[b].copy()?)?.as_tensor().clone()
                }
            };
            let dtype = tensor.dtype();
            by_name.insert(name.clone(), (tensor, dtype));
        }
        let dtype = self
            .config
            .mixed_precision
            .as_ref()
            .map_or(self.dtype, |policy| policy.param_dtype);
        let vb = VarBuilder::from_backend(Box::new(Gathered(by_name)), dtype, self.device.clone());
        let unit = build_layer(&self.factories[k], k, vb)?;
        let leaf = match k > 0 && input.dtype().is_float() {
            true => Some(boundary::leaf(input)?),
            false => None,
        };
        let x = leaf.as_ref().map_or(input, Var::as_tensor);
        let output = unit.forward_t(x, train)?;
        Ok(UnitRun { vars, leaf, output })
    }

    /// The model's output on `x`, without a graph (evaluation): each unit
    /// gathered, run and released in turn. Every rank must call it.
    ///
    /// # Errors
    ///
    /// As [`forward_backward`](Self::forward_backward): any error fails the
    /// group.
    pub fn forward_t(&mut self, x: &Tensor, train: bool) -> Result<Tensor> {
        self.failing_the_group("forward", |fsdp| fsdp.forward_inner(x, train))
    }

    fn forward_inner(&mut self, x: &Tensor, train: bool) -> Result<Tensor> {
        self.sync_buffers()?;
        let mut held = Held::default();
        self.forward_units(x, train, &mut held, |_, _, run, held| {
            held.drop_run(&run);
            Ok(())
        })
    }

    /// The forward unit by unit, each unit's parameters gathered (the
    /// next one's prefetched meanwhile) and counted in `held`; `after(k,
    /// input, run, held)` takes each unit's run and its input, and decides
    /// what stays of them. Returns the last unit's output, detached.
    fn forward_units(
        &self,
        x: &Tensor,
        train: bool,
        held: &mut Held,
        mut after: impl FnMut(usize, Tensor, UnitRun, &mut Held) -> Result<()>,
    ) -> Result<Tensor> {
        let n = self.factories.len();
        let mut h = self.input(x)?;
        let mut prefetched = None;
        for k in 0..n {
            let vars = self.take_or_gather(k, prefetched.take(), held)?;
            let next = (k + 1 < n).then_some(k + 1);
            let (run, gathered) =
                self.with_prefetch(next, || self.run_unit(k, vars, &h, train, Buffers::Live));
            prefetched = gathered;
            if let Some(Ok(vars)) = &prefetched {
                held.add(vars_bytes(vars));
            }
            let run = run?;
            let input = std::mem::replace(&mut h, run.output.detach());
            after(k, input, run, held)?;
        }
        Ok(h)
    }

    /// One training step on this rank's batch: the forward unit by unit,
    /// `loss_fn(output, y)` (a scalar), the backward unit by unit, each
    /// final gradient reduce-scattered. Returns this rank's loss and the
    /// gradients of its pieces ([`shards`](Self::shards)), averaged over
    /// the ranks, for any candle optimizer over the pieces.
    ///
    /// # Errors
    ///
    /// A collective's failure (naming the rank); a resharded unit whose
    /// recomputed forward differs from its first ([`Error::Fsdp`] naming
    /// the unit: the gradients would be another forward's); a loss that
    /// is not a scalar. On any error the pieces and the buffers are
    /// untouched (the buffers put back as the step found them), and the
    /// group is failed with the reason (the step's collectives cannot all
    /// come on this rank, so the others stop at once rather than at their
    /// timeout); a panic fails it too, then goes on unwinding.
    pub fn forward_backward<F>(&mut self, x: &Tensor, y: &Tensor, loss_fn: F) -> Result<Step>
    where
        F: FnOnce(&Tensor, &Tensor) -> candle_core::Result<Tensor>,
    {
        self.failing_the_group("step", |fsdp| fsdp.step_inner(x, y, loss_fn))
    }

    /// Runs `f`; its error or panic fails the group, naming this rank and
    /// `what` (only the group's first failure is kept), and puts the
    /// buffers back as `f` found them (the broadcast from rank 0 and the
    /// forward's update undone): a failed step leaves them untouched.
    fn failing_the_group<T>(
        &mut self,
        what: &str,
        f: impl FnOnce(&mut Self) -> Result<T>,
    ) -> Result<T> {
        use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
        let pg = self.pg.clone();
        let fail = |why: &dyn std::fmt::Display| {
            pg.abort(&format!("rank {}: FSDP's {what} failed: {why}", pg.rank()))
        };
        let before = match BufferSnapshot::take(&self.buffers) {
            Ok(before) => before,
            Err(e) => {
                // Out of memory for a copy: the step cannot start here, so
                // the others must not wait for it.
                let e = Error::from(e);
                fail(&e);
                return Err(e);
            }
        };
        match catch_unwind(AssertUnwindSafe(|| f(self))) {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(e)) => {
                fail(&e);
                before.restore_after(&e);
                Err(e)
            }
            Err(payload) => {
                fail(&crate::util::panic_message::panic_message(payload.as_ref()));
                before.restore_after(&"a panic");
                resume_unwind(payload)
            }
        }
    }

    fn step_inner<F>(&mut self, x: &Tensor, y: &Tensor, loss_fn: F) -> Result<Step>
    where
        F: FnOnce(&Tensor, &Tensor) -> candle_core::Result<Tensor>,
    {
        let n = self.factories.len();
        let last = n - 1;
        // Released units are not recomputed (and a unit that cannot be
        // released is kept), so only recomputation needs the copies.
        let recomputes = !self.releases() && (0..n).any(|k| !self.kept_after_forward(k));
        self.sync_buffers()?;
        // The buffers as the forward finds them, for the recomputations.
        let before = match recomputes && !self.buffers.is_empty() {
            true => self
                .buffers
                .iter()
                .map(|(_, var)| var.as_tensor().copy())
                .collect::<candle_core::Result<Vec<_>>>()?,
            false => Vec::new(),
        };
        let mut held = Held::default();
        // Per unit: its run (kept for the backward; `released`: its
        // parameters' storage freed until then), or its input and output
        // fingerprint (resharded: recomputed in the backward).
        let mut kept: Vec<Option<UnitRun>> = Vec::with_capacity(n);
        let mut released = vec![false; n];
        let mut saved: Vec<Option<(Tensor, Fingerprint)>> = Vec::with_capacity(n);
        self.forward_units(x, true, &mut held, |k, input, run, held| {
            let vars = || run.vars.iter().map(|(_, v)| v);
            // A unit whose output is a view of a parameter (the next unit
            // reads it before the backward) is kept, not released.
            let keep = self.kept_after_forward(k)
                || (self.releases() && release::shares_storage(&run.output, vars()));
            if keep {
                kept.push(Some(run));
                saved.push(None);
            } else if self.releases() {
                release::release(vars())?;
                released[k] = true;
                held.drop_run(&run);
                kept.push(Some(run));
                saved.push(None);
            } else {
                saved.push(Some((input, fingerprint(&run.output)?)));
                held.drop_run(&run);
                kept.push(None);
            }
            Ok(())
        })?;
        let output = kept[last]
            .as_ref()
            .map(|run| run.output.clone())
            .ok_or_else(|| Error::Fsdp("the last unit's run is missing".into()))?;
        let loss = loss_fn(&output, y)?;
        if loss.elem_count() != 1 {
            return Err(Error::Fsdp(format!(
                "the loss must be a scalar, got shape {:?}",
                loss.dims()
            )));
        }
        let mut full_grads: Vec<Option<Tensor>> = vec![None; self.shards.len()];
        // What earlier `no_sync` steps accumulated, worked on as a copy:
        // kept as it was unless this step succeeds.
        let syncing = self.syncing;
        let mut acc = self
            .accumulated
            .clone()
            .unwrap_or_else(|| vec![None; self.shards.len()]);
        let mut store = GradStore::default();
        let mut without = Vec::new();
        let mut grad: Option<Tensor> = None;
        let mut prefetched = None;
        let gathers_again = |k: usize, kept: &[Option<UnitRun>]| kept[k].is_none() || released[k];
        for k in (0..n).rev() {
            let mut vars = match gathers_again(k, &kept) {
                true => Some(self.take_or_gather(k, prefetched.take(), &mut held)?),
                false => None,
            };
            if released[k] {
                // Its graph's parameters filled again before the next
                // gather starts, so that no more than two units' whole
                // parameters are alive at once: the copy, then the
                // gathered values let go.
                if let (Some(run), Some(values)) = (&kept[k], vars.take()) {
                    held.add(vars_bytes(&values));
                    let vars = run.vars.iter().map(|(_, v)| v);
                    release::refill(vars, values.iter().map(|(_, v)| v))?;
                    held.sub(vars_bytes(&values));
                }
            }
            // The unit before, if it is gathered again, is gathered meanwhile.
            let next = (k > 0 && gathers_again(k - 1, &kept)).then(|| k - 1);
            let (ran, gathered) = self.with_prefetch(next, || -> Result<UnitRun> {
                let run = match (kept[k].take(), vars) {
                    (Some(run), _) => run,
                    (None, Some(vars)) => self.recompute(k, vars, saved[k].take(), &before)?,
                    (None, None) => return Err(Error::Fsdp(format!("unit {k} has no run"))),
                };
                let grads = if k == last {
                    Some(loss.backward()?)
                } else {
                    match grad.take() {
                        Some(g) => Some(boundary::backward_from(&run.output, &g)?),
                        None => None,
                    }
                };
                if let Some(grads) = &grads {
                    grad = run
                        .leaf
                        .as_ref()
                        .and_then(|leaf| grads.get(leaf.as_tensor()).cloned());
                    for (p, var) in &run.vars {
                        if let Some(g) = grads.get(var.as_tensor()) {
                            // In the parameters' dtype (the gathered
                            // variables are), so a weight tied across units
                            // and what `no_sync` accumulated add in it, as
                            // with DDP's mixed precision.
                            full_grads[*p] = Some(match full_grads[*p].take() {
                                Some(sum) => (sum + g)?,
                                None => g.clone(),
                            });
                        }
                    }
                }
                Ok(run)
            });
            prefetched = gathered;
            // The next unit arrived while this one was alive: counted
            // before this one goes.
            if let Some(Ok(vars)) = &prefetched {
                held.add(vars_bytes(vars));
            }
            held.drop_run(&ran?);
            let finals: Vec<usize> = (0..self.shards.len())
                .filter(|&p| self.first_use[p] == Some(k))
                .collect();
            for &p in &finals {
                // The accumulated sum first, as DDP adds them.
                let sum = with_accumulated(acc[p].take().as_ref(), full_grads[p].take())?;
                match syncing {
                    true => full_grads[p] = sum,
                    false => acc[p] = sum,
                }
            }
            if syncing {
                self.reduce_scatter(&finals, &mut full_grads, &mut store, &mut without)?;
            }
        }
        self.accumulated = (!syncing).then_some(acc);
        self.memory = FsdpMemory {
            shard_bytes: self
                .shards
                .iter()
                .map(|(_, v)| v.elem_count() * v.dtype().size_in_bytes())
                .sum(),
            peak_gathered_bytes: held.peak,
            full_bytes: self
                .layouts
                .iter()
                .map(|l| l.dims.iter().product::<usize>() * self.dtype.size_in_bytes())
                .sum(),
        };
        without.sort();
        Ok(Step {
            loss: loss.detach(),
            grads: store,
            without_grad: without,
        })
    }

    /// Whether unit `k` keeps its gathered parameters and graph from its
    /// forward to its backward (no recomputation). Every unit does without
    /// [`reshard_after_forward`](super::FsdpConfig::reshard_after_forward);
    /// with it, the last one still does (its backward comes right after
    /// its forward), and with [`prefetch`](super::FsdpConfig::prefetch) the
    /// one before too: it would be gathered again during the last one's
    /// backward anyway, so keeping it holds no more whole parameters at a
    /// time than the walk does, only its activations besides, and saves
    /// its recomputation (torchtitan keeps the last transformer block for
    /// this reason). Without prefetch the walk holds one unit at a time,
    /// and keeping it would hold two.
    fn kept_after_forward(&self, k: usize) -> bool {
        let n = self.factories.len();
        !self.config.reshard_after_forward || k + 1 >= n || (self.config.prefetch && k + 2 >= n)
    }

    /// Whether a resharded unit keeps its graph and frees only its
    /// parameters' storage until its backward (FSDP2's way), rather than
    /// being recomputed: without `recompute_activations`, on the CPU (the
    /// storage is emptied and refilled by a CPU kernel), and without a
    /// mixed-precision policy (whose casts the graph would hold, so that
    /// freeing the parameters would free less than the recomputation).
    fn releases(&self) -> bool {
        !self.config.recompute_activations
            && self.device.is_cpu()
            && self.config.mixed_precision.is_none()
    }

    /// With mixed precision, a floating-point input in the compute dtype.
    fn input(&self, x: &Tensor) -> Result<Tensor> {
        Ok(match &self.config.mixed_precision {
            Some(policy) => crate::precision::cast_input(x, policy.param_dtype)?,
            None => x.clone(),
        })
    }

    /// Unit `k` over its parameters gathered again, its forward run again
    /// from its saved input and checked against the first forward's output.
    /// The unit's buffers are copies of their values before the forward
    /// (`before`), so that the recomputation sees what the first forward
    /// saw and does not update them a second time.
    fn recompute(
        &self,
        k: usize,
        vars: GatheredVars,
        saved: Option<(Tensor, Fingerprint)>,
        before: &[Tensor],
    ) -> Result<UnitRun> {
        let (input, first) =
            saved.ok_or_else(|| Error::Fsdp(format!("unit {k}'s saved input is missing")))?;
        let run = self.run_unit(k, vars, &input, true, Buffers::Copies(before))?;
        if fingerprint(&run.output)? != first {
            return Err(Error::Fsdp(format!(
                "unit {k} gave another output when recomputed for the backward (a layer that \
                 draws random numbers, such as Dropout?): its gradients would be those of another \
                 forward than the loss saw; build with reshard_after_forward: false, or make the \
                 unit deterministic"
            )));
        }
        Ok(run)
    }

    /// Reduce-scatters the whole gradients of `params` (one collective):
    /// each rank gets the average of its own pieces, inserted into `store`
    /// under its piece. A parameter without a gradient on any rank gets
    /// none (named in `without`); on some ranks only, it counts as zero
    /// there. Every rank calls it after the same unit, with the same
    /// `params`.
    fn reduce_scatter(
        &self,
        params: &[usize],
        full_grads: &mut [Option<Tensor>],
        store: &mut GradStore,
        without: &mut Vec<String>,
    ) -> Result<()> {
        // One collective per reduce dtype (two where a mixed-precision
        // policy keeps some parameters in their own), in a fixed order.
        let mut dtypes: Vec<DType> = params.iter().map(|&p| self.reduce_dtype(p)).collect();
        dtypes.sort_by_key(|d| d.as_str());
        dtypes.dedup();
        for dtype in dtypes {
            let group: Vec<usize> = params
                .iter()
                .copied()
                .filter(|&p| self.reduce_dtype(p) == dtype)
                .collect();
            self.reduce_scatter_in(dtype, &group, full_grads, store, without)?;
        }
        Ok(())
    }

    /// [`reduce_scatter`](Self::reduce_scatter) of `params`, all reduced
    /// in `dtype`; the pieces come back in the parameters' dtype.
    fn reduce_scatter_in(
        &self,
        dtype: DType,
        params: &[usize],
        full_grads: &mut [Option<Tensor>],
        store: &mut GradStore,
        without: &mut Vec<String>,
    ) -> Result<()> {
        if params.is_empty() {
            return Ok(());
        }
        let world = self.pg.world_size();
        let grads: Vec<Option<Tensor>> = params.iter().map(|&p| full_grads[p].take()).collect();
        let layouts: Vec<&ShardLayout> = params.iter().map(|&p| &self.layouts[p]).collect();
        let presence = self.groups.presence_across_replicas(&grads)?;
        let pieces = reduce_scatter_grads(
            &grads,
            &layouts,
            dtype,
            &self.device,
            &vec![self.dtype; params.len()],
            presence.as_deref(),
            world,
            |table, section| Ok(self.groups.reduce_scatter(table, ReduceOp::Avg, section)?),
        )?;
        for (&p, piece) in params.iter().zip(pieces) {
            match piece {
                Some(piece) => {
                    store.insert(self.shards[p].1.as_tensor(), piece);
                }
                None => without.push(self.shards[p].0.clone()),
            }
        }
        Ok(())
    }
}
