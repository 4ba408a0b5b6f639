//! How a stage talks to its neighbours: a channel when both live in this
//! process ([`Pipeline`](super::Pipeline)), or messages between ranks of a
//! group when the neighbour is another rank's stage
//! ([`RankPipeline`](super::RankPipeline)).
//!
//! Between ranks, every tensor travels as two messages: a header (what it
//! is: an activation or a gradient, from which stage, for which
//! micro-batch, its dtype and shape) and the tensor. One pair of ranks
//! carries several streams (activations one way and, with interleaved
//! stages, gradients too), so a receiver keeps what arrives before it is
//! asked for in a mailbox, and takes it from there.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use candle_core::{DType, Device, Tensor};
use crossbeam::channel::{Receiver, Sender};

use crate::comm::ProcessGroup;
use crate::util::lock::lock;

/// A tensor for micro-batch `m`, between neighbouring stages.
pub(crate) type Message = (usize, Tensor);

/// What travels: an activation forward or a gradient backward.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Flow {
    Activation,
    Gradient,
}

/// Where a stage sends.
pub(crate) enum Outbox {
    Channel(Sender<Message>),
    Rank(Route),
}

/// Where a stage receives from.
pub(crate) enum Inbox {
    Channel(Receiver<Message>),
    Rank(Route),
}

/// One stream between two ranks' stages: `flow` from stage `from_stage`,
/// on rank `peer` (the other end).
pub(crate) struct Route {
    pub(crate) port: Arc<RankPort>,
    pub(crate) peer: usize,
    pub(crate) flow: Flow,
    pub(crate) from_stage: usize,
}

impl Outbox {
    /// Sends micro-batch `m`'s tensor. A channel's neighbour may be gone
    /// after a failure (the step is being abandoned, its error comes
    /// first); a rank's failure is the group's, and is returned.
    pub(crate) fn send(&self, m: usize, tensor: Tensor) -> Result<(), String> {
        match self {
            Outbox::Channel(tx) => {
                let _ = tx.send((m, tensor));
                Ok(())
            }
            Outbox::Rank(route) => route.port.send(route, m, &tensor),
        }
    }
}

/// What a header says of the tensor after it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Key {
    flow: Flow,
    from_stage: usize,
    micro_batch: usize,
}

/// The header's length in `i64`s: flow, stage, micro-batch, dtype, rank
/// of the shape, then the shape padded.
const HEADER: usize = 5 + MAX_DIMS;
const MAX_DIMS: usize = 8;

/// The dtypes a header can name, by their index.
const DTYPES: [DType; 7] = [
    DType::U8,
    DType::U32,
    DType::I64,
    DType::BF16,
    DType::F16,
    DType::F32,
    DType::F64,
];

/// One rank's end of the messages between stages: its group, and what
/// arrived before it was asked for.
pub(crate) struct RankPort {
    pg: Arc<dyn ProcessGroup>,
    mailbox: Mutex<HashMap<(usize, Key), Tensor>>,
}

impl std::fmt::Debug for RankPort {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RankPort")
            .field("rank", &self.pg.rank())
            .field("waiting", &lock(&self.mailbox).len())
            .finish()
    }
}

impl RankPort {
    pub(crate) fn new(pg: Arc<dyn ProcessGroup>) -> Self {
        RankPort {
            pg,
            mailbox: Mutex::new(HashMap::new()),
        }
    }

    fn send(&self, route: &Route, m: usize, tensor: &Tensor) -> Result<(), String> {
        let dims = tensor.dims();
        let dtype = DTYPES
            .iter()
            .position(|&d| d == tensor.dtype())
            .ok_or_else(|| format!("a {:?} tensor cannot travel between stages", tensor.dtype()))?;
        if dims.len() > MAX_DIMS {
            return Err(format!(
                "a tensor of {} dims cannot travel between stages (at most {MAX_DIMS})",
                dims.len()
            ));
        }
        let flow = match route.flow {
            Flow::Activation => 0,
            Flow::Gradient => 1,
        };
        let mut header = vec![
            flow,
            route.from_stage as i64,
            m as i64,
            dtype as i64,
            dims.len() as i64,
        ];
        header.extend(dims.iter().map(|&d| d as i64));
        header.resize(HEADER, 0);
        let header = Tensor::from_vec(header, HEADER, &Device::Cpu).map_err(|e| e.to_string())?;
        self.pg
            .send(&header, route.peer)
            .and_then(|()| self.pg.send(tensor, route.peer))
            .map_err(|e| e.to_string())
    }

    /// Micro-batch `m`'s tensor of `route`'s stream, from the mailbox or,
    /// once the messages before it are read, from its peer.
    pub(crate) fn receive(&self, route: &Route, m: usize) -> Result<Tensor, String> {
        let wanted = Key {
            flow: route.flow,
            from_stage: route.from_stage,
            micro_batch: m,
        };
        if let Some(tensor) = lock(&self.mailbox).remove(&(route.peer, wanted.clone())) {
            return Ok(tensor);
        }
        let like = Tensor::zeros(HEADER, DType::I64, &Device::Cpu).map_err(|e| e.to_string())?;
        loop {
            let header = self
                .pg
                .recv(&like, route.peer)
                .and_then(|h| h.to_vec1::<i64>().map_err(|e| self.tensor_error(e)))
                .map_err(|e| e.to_string())?;
            let (key, dtype, dims) = decode(&header, route.peer)?;
            let tensor = Tensor::zeros(dims, dtype, &Device::Cpu)
                .map_err(|e| e.to_string())
                .and_then(|like| self.pg.recv(&like, route.peer).map_err(|e| e.to_string()))?;
            if key == wanted {
                return Ok(tensor);
            }
            lock(&self.mailbox).insert((route.peer, key), tensor);
        }
    }

    fn tensor_error(&self, source: candle_core::Error) -> crate::comm::CommError {
        crate::comm::CommError::Tensor {
            rank: self.pg.rank(),
            op: "recv",
            source,
        }
    }
}

/// A header's key, dtype and shape; an error naming the peer for one that
/// does not decode.
fn decode(header: &[i64], peer: usize) -> Result<(Key, DType, Vec<usize>), String> {
    let bad = || format!("rank {peer} sent a stage header that does not decode: {header:?}");
    let [flow, stage, m, dtype, rank, dims @ ..] = header else {
        return Err(bad());
    };
    let flow = match flow {
        0 => Flow::Activation,
        1 => Flow::Gradient,
        _ => return Err(bad()),
    };
    let index = |v: i64| usize::try_from(v).map_err(|_| bad());
    let dtype = *DTYPES.get(index(*dtype)?).ok_or_else(bad)?;
    let dims = dims
        .get(..index(*rank)?)
        .ok_or_else(bad)?
        .iter()
        .map(|&d| index(d))
        .collect::<Result<Vec<usize>, String>>()?;
    let key = Key {
        flow,
        from_stage: index(*stage)?,
        micro_batch: index(*m)?,
    };
    Ok((key, dtype, dims))
}
