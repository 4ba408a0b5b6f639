//! One pipeline stage: its layers on its device, and the work it runs in a
//! step, talking to its neighbours over channels.

use std::cell::Cell;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use candle_core::{Device, Tensor, Var};
use candle_nn::ModuleT;
use crossbeam::channel::{Receiver, RecvTimeoutError};

use super::deferred_norm::{self, NormLayers, NormStep, NormUse};
use super::link::{Inbox, Message, Outbox};
use super::recompute::{self, Checkpoint, Fingerprints};
use super::schedule::Op;
use super::stage_var::StageVar;
use crate::device_copy::{self as copy, copy_into};
use crate::units::boundary;
use crate::units::Fingerprint;
use crate::util::lock::lock;
use crate::worker_pool::Cancel;

/// What a training stage keeps of a micro-batch's forward for its
/// backward.
enum Saved {
    /// The output, with the graph of its activations.
    Graph { leaf: Option<Var>, output: Tensor },
    /// The input only (activation checkpointing): the forward runs again
    /// before the backward, and is compared with `prints`, the first
    /// forward's fingerprints (each layer's output, then the loss).
    Input {
        leaf: Option<Var>,
        input: Tensor,
        prints: Vec<Fingerprint>,
    },
}

/// The loss of one micro-batch: `(output, targets)`.
pub(crate) type LossFn = dyn Fn(&Tensor, &Tensor) -> candle_core::Result<Tensor> + Send + Sync;

/// How often a waiting stage looks whether the step was abandoned.
const POLL: Duration = Duration::from_millis(20);

/// How long a stage waits, once its neighbour is gone, for the step to be
/// abandoned before it reports the neighbour itself.
const GONE_GRACE: Duration = Duration::from_secs(5);

/// The layers of one stage, built on its worker (they need not be `Send`).
pub(crate) struct Stage {
    pub(crate) layers: Vec<Box<dyn ModuleT>>,
    /// The global index of the first layer.
    pub(crate) first: usize,
    /// The trainable variables the layers use, by name.
    pub(crate) vars: Vec<StageVar>,
    /// The BatchNorm buffers the layers use (always mirrors), by name.
    pub(crate) buffers: Vec<StageVar>,
    /// The layers that update buffers.
    pub(crate) norms: Vec<NormUse>,
}

impl Stage {
    /// What the BatchNorm deferral reads of this stage.
    fn norm_layers(&self) -> NormLayers<'_> {
        NormLayers {
            layers: &self.layers,
            first: self.first,
            buffers: &self.buffers,
            norms: &self.norms,
        }
    }

    /// Copies the `VarMap`'s current values into the mirrors (one device
    /// copy each, see [`copy_into`]).
    fn refresh(&self) -> candle_core::Result<()> {
        for v in self.vars.iter().chain(&self.buffers) {
            if v.is_mirror() {
                let value = v.master.as_detached_tensor().to_dtype(v.local.dtype())?;
                copy_into(v.local.as_tensor(), &value)?;
            }
        }
        Ok(())
    }

    /// The stage's layers on `x`; with `prints`, each layer's output
    /// fingerprinted (a checkpointed micro-batch's forward and its
    /// recomputation).
    fn forward(
        &self,
        x: &Tensor,
        train: bool,
        mut norms: Option<&mut NormStep>,
        mut prints: Option<&mut Fingerprints>,
    ) -> candle_core::Result<Tensor> {
        let mut h = x.clone();
        for (k, layer) in self.layers.iter().enumerate() {
            h = match norms.as_deref_mut() {
                Some(step) if train && self.norms.iter().any(|u| u.layer == k) => {
                    deferred_norm::forward_layer(&self.norm_layers(), k, &h, step)?
                }
                _ => layer.forward_t(&h, train)?,
            };
            if let Some(prints) = prints.as_deref_mut() {
                prints.record(&h)?;
            }
        }
        Ok(h)
    }
}

/// What a stage was doing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phase {
    Forward,
    Loss,
    Backward,
}

impl Phase {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Phase::Forward => "forward",
            Phase::Loss => "loss",
            Phase::Backward => "backward",
        }
    }
}

/// What a stage is doing in a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Doing {
    /// Its job has not begun: its worker is still busy (with an earlier,
    /// abandoned step that is stuck).
    NotStarted,
    /// Waiting for a neighbour, or done.
    Waiting,
    Computing {
        phase: Phase,
        micro_batch: usize,
        since: Instant,
    },
}

/// What each stage is doing right now, so that a timeout names the stage
/// that holds the step up.
pub(crate) type Board = Arc<Vec<Mutex<Doing>>>;

/// Why a stage's work stopped.
#[derive(Debug)]
pub(crate) struct StageFailure {
    pub(crate) micro_batch: usize,
    pub(crate) phase: Phase,
    pub(crate) source: candle_core::Error,
}

/// The channels of one stage to its neighbours (absent at the ends).
#[derive(Default)]
pub(crate) struct Links {
    pub(crate) from_prev: Option<Inbox>,
    pub(crate) to_next: Option<Outbox>,
    pub(crate) grad_from_next: Option<Inbox>,
    pub(crate) grad_to_prev: Option<Outbox>,
}

/// What a stage hands back at the end of a step.
#[derive(Default)]
pub(crate) struct StageOutput {
    /// One accumulated gradient per stage variable (training), on the
    /// device of the `VarMap`'s variable.
    pub(crate) grads: Vec<Option<Tensor>>,
    /// The buffers' new values, with their `VarMap` variables (training
    /// forwards), to commit when every stage has succeeded.
    pub(crate) buffers: Vec<(Var, Tensor)>,
    /// The weighted micro-batch losses (last stage, training).
    pub(crate) losses: Vec<Tensor>,
    /// The micro-batch outputs (last stage, forward only).
    pub(crate) outputs: Vec<Tensor>,
}

/// What a stage holds between the ops of a step.
pub(crate) struct StageRun {
    norms: Option<NormStep>,
    /// Per micro-batch, what its forward kept for its backward.
    saved: Vec<Option<Saved>>,
    /// The bytes of `saved` (see [`saved_size`]).
    pub(crate) saved_bytes: usize,
    out: StageOutput,
}

/// One stage's part of a step.
pub(crate) struct StageWork {
    pub(crate) index: usize,
    /// The micro-batches of the step.
    pub(crate) chunks: usize,
    pub(crate) device: Device,
    /// Stage 0: the micro-batches of the input.
    pub(crate) inputs: Vec<Tensor>,
    pub(crate) links: Links,
    pub(crate) board: Board,
    /// A training step (stage inputs are leaves, each stage runs its own
    /// backward), or forwards only (the drop-in path).
    pub(crate) training: bool,
    /// The last stage of a training step: its loss.
    pub(crate) loss: Option<TrainLoss>,
    /// The train flag of the layers' `forward_t` (true when training).
    pub(crate) train: bool,
    /// Which micro-batches a training step recomputes before their
    /// backward instead of keeping their activations.
    pub(crate) checkpoint: Checkpoint,
    /// When the current computation began, and the time computed so far.
    pub(crate) computing_since: Cell<Option<Instant>>,
    pub(crate) busy: Cell<Duration>,
    /// The part of `busy` spent fingerprinting checkpointed forwards.
    pub(crate) checking: Cell<Duration>,
}

/// The loss side of a training step (used by the last stage).
pub(crate) struct TrainLoss {
    pub(crate) loss_fn: Arc<LossFn>,
    pub(crate) targets: Vec<Tensor>,
    /// Each micro-batch's weight (its share of the rows for a mean loss).
    pub(crate) shares: Vec<f64>,
}

impl StageWork {
    /// Marks the stage computing `phase` of micro-batch `m`, or waiting
    /// (`None`), and keeps count of the time it computes.
    pub(crate) fn set(&self, doing: Option<(Phase, usize)>) {
        let now = Instant::now();
        if let Some(since) = self.computing_since.take() {
            self.busy.set(self.busy.get() + now.duration_since(since));
        }
        let doing = match doing {
            Some((phase, micro_batch)) => {
                self.computing_since.set(Some(now));
                Doing::Computing {
                    phase,
                    micro_batch,
                    since: now,
                }
            }
            None => Doing::Waiting,
        };
        if let Some(slot) = self.board.get(self.index) {
            *lock(slot) = doing;
        }
    }

    /// Starts the stage's part of a step: its mirrors refreshed, its
    /// BatchNorm deferral begun.
    pub(crate) fn start(&self, stage: &Stage) -> Result<StageRun, StageFailure> {
        self.set(None);
        let setup = |source| StageFailure {
            micro_batch: 0,
            phase: Phase::Forward,
            source,
        };
        stage.refresh().map_err(setup)?;
        let norms = if self.train && !stage.norms.is_empty() {
            Some(NormStep::start(&stage.norm_layers()).map_err(setup)?)
        } else {
            None
        };
        Ok(StageRun {
            norms,
            saved: (0..self.chunks).map(|_| None).collect(),
            saved_bytes: 0,
            out: StageOutput {
                grads: vec![None; stage.vars.len()],
                ..StageOutput::default()
            },
        })
    }

    /// Runs one op of the stage: a forward (kept for the backward in a
    /// training step, or sent on with its graph on the drop-in path) or a
    /// backward. Returns the most bytes of activations the stage held
    /// during it (see [`saved_size`]).
    pub(crate) fn run_op(
        &self,
        stage: &Stage,
        run: &mut StageRun,
        op: Op,
        cancel: &Cancel,
    ) -> Result<usize, StageFailure> {
        // Stage 0 never waits on a neighbour: stop here once the step is
        // abandoned, so no work (or BatchNorm update) outlives it.
        if cancel.is_cancelled() {
            let m = match op {
                Op::Forward(m) | Op::Backward(m) => m,
            };
            return Err(StageFailure {
                micro_batch: m,
                phase: Phase::Forward,
                source: candle_core::Error::Msg("step abandoned: another stage failed".into()),
            });
        }
        let mut peak = run.saved_bytes;
        match op {
            Op::Forward(m) => {
                let checkpointed = self.training && self.checkpoint.applies(m, self.chunks);
                let mut prints = checkpointed.then(Fingerprints::default);
                let (leaf, input, output) =
                    self.forward(stage, m, run.norms.as_mut(), prints.as_mut(), cancel)?;
                if self.training {
                    let keep = if let Some(prints) = prints {
                        Saved::Input {
                            leaf,
                            input,
                            prints: prints.prints,
                        }
                    } else {
                        Saved::Graph {
                            leaf,
                            output: output.clone(),
                        }
                    };
                    run.saved_bytes += saved_size(&keep);
                    peak = run.saved_bytes;
                    if let Some(slot) = run.saved.get_mut(m) {
                        *slot = Some(keep);
                    }
                }
                match &self.links.to_next {
                    Some(next) => {
                        let message = if self.training {
                            output.detach()
                        } else {
                            output
                        };
                        next.send(m, message).map_err(|reason| StageFailure {
                            micro_batch: m,
                            phase: Phase::Forward,
                            source: candle_core::Error::Msg(reason),
                        })?;
                    }
                    None if !self.training => run.out.outputs.push(output),
                    None => {}
                }
            }
            Op::Backward(m) => {
                let Some(kept) = run.saved.get_mut(m).and_then(Option::take) else {
                    return Err(StageFailure {
                        micro_batch: m,
                        phase: Phase::Backward,
                        source: candle_core::Error::Msg(format!(
                            "no saved forward for micro-batch {m}"
                        )),
                    });
                };
                let size = saved_size(&kept);
                let (leaf, output) = match kept {
                    Saved::Graph { leaf, output } => (leaf, output),
                    Saved::Input {
                        leaf,
                        input,
                        prints,
                    } => {
                        let output = self.recompute(stage, m, &input, &prints)?;
                        // The recomputed graph lives through this
                        // micro-batch's backward, beside what is saved.
                        peak = run.saved_bytes + graph_bytes(&output);
                        (leaf, output)
                    }
                };
                run.saved_bytes = run.saved_bytes.saturating_sub(size);
                self.backward(stage, m, leaf, output, &mut run.out, cancel)?;
            }
        }
        // Waiting from here: the time of the device's next op, maybe of
        // another of its stages, is not this stage's.
        self.set(None);
        Ok(peak)
    }

    /// Ends the stage's part of a step: a training forward's buffers
    /// (updated by the layers on the stage's copies) go back with the
    /// output, to be committed once every stage has succeeded.
    pub(crate) fn finish(&self, stage: &Stage, run: StageRun) -> Result<StageOutput, StageFailure> {
        let StageRun {
            mut norms, mut out, ..
        } = run;
        if self.train && !stage.buffers.is_empty() {
            let last = self.chunks.saturating_sub(1);
            self.set(Some((Phase::Forward, last)));
            let committed = match norms.as_mut() {
                Some(step) => deferred_norm::finish(&stage.norm_layers(), step),
                None => stage
                    .buffers
                    .iter()
                    .map(|b| Ok((b.master.clone(), b.local.as_tensor().copy()?)))
                    .collect(),
            };
            out.buffers = committed.map_err(|source| StageFailure {
                micro_batch: last,
                phase: Phase::Forward,
                source,
            })?;
        }
        self.set(None);
        Ok(out)
    }

    /// The time the stage spent computing so far.
    pub(crate) fn busy(&self) -> Duration {
        self.busy.get()
    }

    /// The part of [`busy`](Self::busy) spent fingerprinting checkpointed
    /// forwards and their recomputations.
    pub(crate) fn checking(&self) -> Duration {
        self.checking.get()
    }

    /// Micro-batch `m`'s forward (and, on the last stage, its weighted
    /// loss), fingerprinted into `prints` when given: returns the stage's
    /// input leaf, its input and its output.
    fn forward(
        &self,
        stage: &Stage,
        m: usize,
        norms: Option<&mut NormStep>,
        mut prints: Option<&mut Fingerprints>,
        cancel: &Cancel,
    ) -> Result<(Option<Var>, Tensor, Tensor), StageFailure> {
        let fail = |phase| {
            move |source| StageFailure {
                micro_batch: m,
                phase,
                source,
            }
        };
        let input = match &self.links.from_prev {
            Some(rx) => self.receive(rx, m, Phase::Forward, cancel)?,
            None => self
                .inputs
                .get(m)
                .cloned()
                .ok_or_else(|| candle_core::Error::Msg(format!("no input for micro-batch {m}")))
                .map_err(fail(Phase::Forward))?,
        };
        self.set(Some((Phase::Forward, m)));
        let input = copy::to_device(&input, &self.device).map_err(fail(Phase::Forward))?;
        // A training stage starts its own graph at a leaf, so that its
        // backward stops there and yields the gradient to send upstream.
        let leaf = match (self.training, &self.links.from_prev) {
            (true, Some(_)) => Some(boundary::leaf(&input).map_err(fail(Phase::Forward))?),
            _ => None,
        };
        let x = leaf.as_ref().map_or(&input, Var::as_tensor).clone();
        let output = stage
            .forward(&x, self.train, norms, prints.as_deref_mut())
            .map_err(fail(Phase::Forward))?;
        let output = self.weighted_loss(m, output)?;
        if let Some(prints) = prints {
            if self.loss.is_some() {
                prints.record(&output).map_err(fail(Phase::Loss))?;
            }
            self.checking.set(self.checking.get() + prints.time);
        }
        Ok((leaf, x, output))
    }

    /// On the last stage of a training step, micro-batch `m`'s loss times
    /// its share; elsewhere `output` itself.
    fn weighted_loss(&self, m: usize, output: Tensor) -> Result<Tensor, StageFailure> {
        let Some(loss) = &self.loss else {
            return Ok(output);
        };
        self.set(Some((Phase::Loss, m)));
        (|| {
            let target = loss.targets.get(m).ok_or_else(|| {
                candle_core::Error::Msg(format!("no targets for micro-batch {m}"))
            })?;
            // The targets come where the input came; the loss is where
            // the last stage's output is (a GPU stage's, say).
            let target = target.to_device(output.device())?;
            let value = (loss.loss_fn)(&output, &target)?;
            if value.elem_count() != 1 {
                candle_core::bail!("the loss must be a scalar, got shape {:?}", value.dims());
            }
            let share = loss.shares.get(m).copied().unwrap_or(1.0);
            value.reshape(())?.affine(share, 0.)
        })()
        .map_err(|source| StageFailure {
            micro_batch: m,
            phase: Phase::Loss,
            source,
        })
    }

    /// Runs micro-batch `m`'s forward again from its saved input, leaving
    /// the buffers as they were, and checks it layer by layer against the
    /// first forward's fingerprints: a layer that gives another output on
    /// the same input (Dropout) fails the step, named with the micro-batch.
    fn recompute(
        &self,
        stage: &Stage,
        m: usize,
        input: &Tensor,
        first_forward: &[Fingerprint],
    ) -> Result<Tensor, StageFailure> {
        let fail = |source| StageFailure {
            micro_batch: m,
            phase: Phase::Backward,
            source,
        };
        self.set(Some((Phase::Backward, m)));
        let saved = recompute::save_buffers(&stage.buffers).map_err(fail)?;
        let mut prints = Fingerprints::default();
        let output = stage.forward(input, self.train, None, Some(&mut prints));
        recompute::restore_buffers(&stage.buffers, &saved).map_err(fail)?;
        let output = self.weighted_loss(m, output.map_err(fail)?)?;
        if self.loss.is_some() {
            prints.record(&output).map_err(fail)?;
        }
        self.checking.set(self.checking.get() + prints.time);
        match recompute::mismatch(
            first_forward,
            &prints.prints,
            stage.first,
            stage.layers.len(),
        ) {
            None => Ok(output),
            Some(what) => Err(fail(candle_core::Error::Msg(format!(
                "{what}: recomputing micro-batch {m} for the backward ({:?}) would give the \
                 gradients of another forward than the one the loss saw; build the pipeline \
                 with Checkpoint::Never, or make the layer deterministic",
                self.checkpoint
            )))),
        }
    }

    fn backward(
        &self,
        stage: &Stage,
        m: usize,
        leaf: Option<Var>,
        output: Tensor,
        out: &mut StageOutput,
        cancel: &Cancel,
    ) -> Result<(), StageFailure> {
        let fail = |source| StageFailure {
            micro_batch: m,
            phase: Phase::Backward,
            source,
        };
        let grads = match &self.links.grad_from_next {
            // The last stage: `output` is the weighted loss.
            None => {
                self.set(Some((Phase::Backward, m)));
                out.losses.push(output.detach());
                output.backward().map_err(fail)?
            }
            Some(rx) => {
                let grad = self.receive(rx, m, Phase::Backward, cancel)?;
                self.set(Some((Phase::Backward, m)));
                (|| {
                    let grad = copy::to_device(&grad, output.device())?;
                    boundary::backward_from(&output, &grad)
                })()
                .map_err(fail)?
            }
        };
        // In micro-batch order on every schedule: bitwise-equal sums.
        for (var, acc) in stage.vars.iter().zip(out.grads.iter_mut()) {
            if let Some(g) = grads.get(var.local.as_tensor()) {
                // A mirror's gradient goes to its variable's device.
                // Under mixed precision it is widened to the variable's dtype.
                let g = copy::to_device(g, var.master.device())
                    .and_then(|g| g.to_dtype(var.master.dtype()))
                    .map_err(fail)?;
                *acc = Some(match acc.take() {
                    Some(sum) => (sum + g).map_err(fail)?,
                    None => g,
                });
            }
        }
        if let (Some(leaf), Some(prev)) = (leaf, &self.links.grad_to_prev) {
            let grad = match grads.get(leaf.as_tensor()) {
                Some(g) => g.clone(),
                None => leaf.zeros_like().map_err(fail)?,
            };
            prev.send(m, grad)
                .map_err(|reason| fail(candle_core::Error::Msg(reason)))?;
        }
        Ok(())
    }

    /// Waits for micro-batch `m` from a neighbour; gives up when the step
    /// is abandoned (another stage failed or the step timed out), or, from
    /// another rank, when its group fails or times out.
    fn receive(
        &self,
        inbox: &Inbox,
        m: usize,
        phase: Phase,
        cancel: &Cancel,
    ) -> Result<Tensor, StageFailure> {
        self.set(None);
        let fail = |reason: String| StageFailure {
            micro_batch: m,
            phase,
            source: candle_core::Error::Msg(reason),
        };
        let rx = match inbox {
            Inbox::Channel(rx) => rx,
            Inbox::Rank(route) => return route.port.receive(route, m).map_err(fail),
        };
        self.receive_channel(rx, m, fail, cancel)
    }

    fn receive_channel(
        &self,
        rx: &Receiver<Message>,
        m: usize,
        fail: impl Fn(String) -> StageFailure,
        cancel: &Cancel,
    ) -> Result<Tensor, StageFailure> {
        let mut gone_since: Option<Instant> = None;
        loop {
            if cancel.is_cancelled() {
                return Err(fail("step abandoned: another stage failed".into()));
            }
            match rx.recv_timeout(POLL) {
                Ok((got, tensor)) if got == m => return Ok(tensor),
                Ok((got, _)) => {
                    return Err(fail(format!("received micro-batch {got}, expected {m}")))
                }
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => {
                    // The neighbour failed: its own error reaches the caller
                    // first and abandons the step; this is the fallback.
                    let since = *gone_since.get_or_insert_with(Instant::now);
                    if since.elapsed() > GONE_GRACE {
                        return Err(fail("a neighbouring stage stopped without an error".into()));
                    }
                    std::thread::sleep(POLL);
                }
            }
        }
    }
}

/// Bytes of activations a saved forward holds: its input, and the storage
/// of the tensors of the graph behind its output (the output included),
/// each storage once: a view (a transposed weight, a reshaped activation)
/// adds nothing to what it views, and the variables' own storage, the
/// model's, is not counted. With activation checkpointing: its input (the
/// fingerprints kept to check the recomputation are a few bytes a layer).
fn saved_size(saved: &Saved) -> usize {
    let bytes = |t: &Tensor| t.elem_count() * t.dtype().size_in_bytes();
    match saved {
        Saved::Graph { leaf, output } => {
            graph_bytes(output) + leaf.as_ref().map_or(0, |l| bytes(l))
        }
        Saved::Input { input, .. } => bytes(input),
    }
}

/// See [`saved_size`]: the graph's storages, each counted once at the
/// largest extent any of its tensors reaches.
fn graph_bytes(output: &Tensor) -> usize {
    use std::collections::{HashMap, HashSet};
    let storage_of = |t: &Tensor| {
        let (storage, layout) = t.storage_and_layout();
        let address = &*storage as *const candle_core::Storage as usize;
        let extent = (layout.start_offset() + t.elem_count()) * t.dtype().size_in_bytes();
        (address, extent)
    };
    let nodes = output.sorted_nodes();
    let variables: HashSet<usize> = nodes
        .iter()
        .filter(|t| t.is_variable())
        .map(|t| storage_of(t).0)
        .collect();
    let mut storages: HashMap<usize, usize> = HashMap::new();
    for t in nodes.iter().filter(|t| !t.is_variable()).chain([&output]) {
        let (address, extent) = storage_of(t);
        if !variables.contains(&address) {
            let size = storages.entry(address).or_default();
            *size = (*size).max(extent);
        }
    }
    storages.values().sum()
}
