//! How a [`RankPipeline`]'s batch becomes micro-batches: every rank
//! learns their sizes from the ranks that hold the input and the targets,
//! and the first stage's rank splits the input.

use candle_core::Tensor;

use super::on_ranks::RankPipeline;
use crate::comm::all_gather_object;
use crate::data_parallel::scatter_gather::chunk_sizes;
use crate::error::{Error, Result};
use crate::precision::cast_input;

impl RankPipeline {
    /// Every rank learns the micro-batches' sizes from the rows of the
    /// input (on the first stage's rank) and, when `y` is asked for
    /// (`Some`), of the targets (on the last stage's).
    pub(super) fn micro_batch_sizes(
        &self,
        x: Option<&Tensor>,
        y: Option<Option<&Tensor>>,
    ) -> Result<Vec<usize>> {
        let (first_rank, last_rank) = (self.owner(0), self.owner(self.stages() - 1));
        let me = self.pg.rank();
        let rows = |t: Option<&Tensor>| t.and_then(|t| t.dims().first().copied());
        let mine = (
            rows(x.filter(|_| me == first_rank)),
            rows(y.flatten().filter(|_| me == last_rank)),
        );
        let all: Vec<(Option<usize>, Option<usize>)> = all_gather_object(self.pg.as_ref(), &mine)?;
        let refuse = |reason: String| Err(Error::Candle(candle_core::Error::Msg(reason)));
        let Some(rows) = all[first_rank].0 else {
            return refuse(format!(
                "a pipeline step needs the input on rank {first_rank} (the first stage's)"
            ));
        };
        if y.is_some() {
            let Some(target_rows) = all[last_rank].1 else {
                return refuse(format!(
                    "a pipeline step needs the targets on rank {last_rank} (the last stage's)"
                ));
            };
            if rows != target_rows {
                return refuse(format!(
                    "the input has {rows} rows and the targets {target_rows}: a step needs as many"
                ));
            }
        }
        if rows == 0 {
            return refuse("a pipeline step needs at least one row".into());
        }
        Ok(chunk_sizes(
            rows,
            self.config.chunks.unwrap_or(self.stages()),
        ))
    }

    /// `t` split into micro-batches of `sizes` rows.
    pub(super) fn split_rows(t: &Tensor, sizes: &[usize]) -> Result<Vec<Tensor>> {
        let mut start = 0;
        sizes
            .iter()
            .map(|&n| {
                let part = t.narrow(0, start, n)?;
                start += n;
                Ok(part)
            })
            .collect()
    }

    /// The first stage's micro-batches of `x` (in the compute dtype), on
    /// its rank; none elsewhere.
    pub(super) fn first_stage_inputs(
        &self,
        x: Option<&Tensor>,
        sizes: &[usize],
    ) -> Result<Vec<Tensor>> {
        match x.filter(|_| self.pg.rank() == self.owner(0)) {
            Some(x) => {
                let x = match &self.config.mixed_precision {
                    Some(policy) => cast_input(x, policy.param_dtype)?,
                    None => x.clone(),
                };
                Self::split_rows(&x, sizes)
            }
            None => Ok(Vec::new()),
        }
    }
}
