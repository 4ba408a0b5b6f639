//! DDP over uneven inputs (PyTorch's `Join`): a rank out of data keeps
//! answering the others' collectives with zero gradients until every rank
//! is done, then every rank takes the last one's parameters; and the flags
//! every rank sends at each step inside a join (still training, syncing).

use std::panic::{self, AssertUnwindSafe};

use candle_core::{Device, Tensor};

use super::DistributedDataParallel;
use crate::comm::ReduceOp;
use crate::error::{Error, Result};

impl<M> DistributedDataParallel<M> {
    /// Runs a training loop that may run out of data before the other
    /// ranks' (PyTorch's `Join`): every rank must call `join`; inside, each
    /// step is one forward and one backward, synchronised or, with gradient
    /// accumulation, inside [`no_sync`](Self::no_sync) on every rank still
    /// training (whether a step synchronises is agreed at its forward: the
    /// ranks that joined answer its all-reduce or skip it; ranks that
    /// disagree get [`Error::JoinSyncMismatch`]). When this rank's
    /// `f` returns, it keeps answering the others' collectives with zero
    /// gradients (divided per [`DdpConfig::join_divisor`](super::DdpConfig::join_divisor)) until every rank
    /// is done. Then, as in PyTorch, every rank takes the parameters (and,
    /// with [`DdpConfig::broadcast_buffers`](super::DdpConfig::broadcast_buffers), the buffers) of the last rank
    /// to finish, the largest such rank on a tie: the others stopped
    /// applying updates when they ran out of data. Optimizer states are not
    /// synchronised. While any rank trains, buffers are broadcast from the
    /// highest rank still training, not from rank 0. If `f` fails, its
    /// error is returned at once.
    pub fn join<R>(&mut self, f: impl FnOnce(&mut Self) -> Result<R>) -> Result<R> {
        if self.config.zero.is_some() {
            return Err(Error::Zero(
                "join is not supported: a rank that ran out of data would not take part in the \
                 ZeroOptimizer's all-gather of the parameters; give every rank the same number \
                 of batches (DistributedSampler with drop_last)"
                    .into(),
            ));
        }
        self.joining = true;
        // A panic in `f` ends the join as an error does (state restored),
        // then goes on unwinding.
        let result = match panic::catch_unwind(AssertUnwindSafe(|| f(self))) {
            Ok(result) => result,
            Err(payload) => {
                self.joining = false;
                self.step_syncs = None;
                self.active_ranks = self.pg.world_size();
                panic::resume_unwind(payload)
            }
        };
        let shadowed = match &result {
            Ok(_) => self
                .shadow_until_all_joined()
                .and_then(|last_joiner| self.sync_from_last_joiner(last_joiner)),
            Err(_) => Ok(()),
        };
        self.joining = false;
        self.step_syncs = None;
        self.active_ranks = self.pg.world_size();
        let value = result?;
        shadowed?;
        Ok(value)
    }

    /// Which ranks answer `true`: one all-reduce of a one-hot vector (this
    /// rank's slot holds `mine`), so the count and the highest such rank
    /// come from the same collective.
    pub(super) fn active_flags(&self, mine: bool) -> Result<Vec<bool>> {
        self.rank_flags(&[mine]).map(|mut sets| sets.remove(0))
    }

    /// The per-step exchange inside a join (PyTorch's join hook exchanges
    /// the same): which ranks still train, and which of them synchronise
    /// this step's gradients. Joined ranks answer `(false, false)`.
    pub(super) fn step_flags(&self, active: bool, syncing: bool) -> Result<StepFlags> {
        let mut sets = self.rank_flags(&[active, active && syncing])?;
        let syncing = sets.pop().unwrap_or_default();
        let active = sets.pop().unwrap_or_default();
        Ok(StepFlags { active, syncing })
    }

    /// One all-reduce of one one-hot vector per entry of `mine` (this
    /// rank's slot of vector `k` holds `mine[k]`): for each, which ranks
    /// answered `true`.
    pub(super) fn rank_flags(&self, mine: &[bool]) -> Result<Vec<Vec<bool>>> {
        let world = self.pg.world_size();
        let mut slots = vec![0f32; world * mine.len()];
        for (k, &flag) in mine.iter().enumerate() {
            if let Some(slot) = slots.get_mut(k * world + self.pg.rank()) {
                *slot = if flag { 1.0 } else { 0.0 };
            }
        }
        let flags = Tensor::from_vec(slots, world * mine.len(), &Device::Cpu)?;
        let total = self.comm(self.pg.all_reduce(&flags, ReduceOp::Sum))?;
        let total = total.to_vec1::<f32>()?;
        // A `ProcessGroup` implementation may be the user's: check its answer.
        if total.len() != world * mine.len() {
            return Err(Error::Candle(candle_core::Error::Msg(format!(
                "all_reduce of the {} join flags returned {} values",
                world * mine.len(),
                total.len()
            ))));
        }
        Ok(total
            .chunks(world.max(1))
            .map(|set| set.iter().map(|&f| f > 0.5).collect())
            .collect())
    }

    /// Every rank takes the model of the last rank to join (the largest
    /// one on a tie, PyTorch's `_sync_final_model`).
    pub(super) fn sync_from_last_joiner(&self, last_joiner: bool) -> Result<()> {
        let root = highest(&self.active_flags(last_joiner)?).unwrap_or(0);
        self.broadcast_vars(&self.params, root)?;
        self.sync_buffers(root)
    }

    /// Answers the collectives of the ranks still training until none is.
    /// Returns whether this rank was among the last to join (no rank was
    /// still training when it finished).
    pub(super) fn shadow_until_all_joined(&mut self) -> Result<bool> {
        let mut last_joiner = true;
        loop {
            let flags = self.step_flags(false, false)?;
            self.active_ranks = flags.active_ranks();
            let Some(buffer_root) = highest(&flags.active) else {
                return Ok(last_joiner);
            };
            last_joiner = false;
            let synchronised = flags.agreed_sync()?;
            self.sync_buffers(buffer_root)?;
            // A step inside no_sync has no all-reduce to answer.
            if synchronised {
                let zeros = self.params.iter().map(|_| None).collect();
                self.all_reduce_grads(zeros)?;
            }
        }
    }
}

/// The highest rank whose flag is set.
pub(super) fn highest(flags: &[bool]) -> Option<usize> {
    flags.iter().rposition(|&f| f)
}

/// What every rank said at the start of a step inside a join.
#[derive(Debug)]
pub(super) struct StepFlags {
    /// Per rank: still training.
    pub(super) active: Vec<bool>,
    /// Per rank: still training, and synchronising this step.
    syncing: Vec<bool>,
}

impl StepFlags {
    pub(super) fn active_ranks(&self) -> usize {
        self.active.iter().filter(|&&a| a).count()
    }

    /// Whether the step synchronises; an error when the ranks still
    /// training disagree (every rank sees the same flags, so every rank
    /// fails the step alike, and none waits for a collective that another
    /// skips).
    pub(super) fn agreed_sync(&self) -> Result<bool> {
        let ranks = |want: bool| -> Vec<usize> {
            (0..self.active.len())
                .filter(|&r| self.active[r] && self.syncing[r] == want)
                .collect()
        };
        let (syncing, not_syncing) = (ranks(true), ranks(false));
        if !syncing.is_empty() && !not_syncing.is_empty() {
            return Err(Error::JoinSyncMismatch {
                syncing,
                not_syncing,
            });
        }
        Ok(!syncing.is_empty())
    }
}
