//! The collectives' names, as errors and failures report them.

/// A collective of [`ProcessGroup`](super::ProcessGroup), by name: one
/// place for the `&'static str` that [`CommError`](super::CommError)s and
/// [`FailureCause::TimedOut`](super::FailureCause::TimedOut) carry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Op {
    AllReduce,
    Broadcast,
    AllGather,
    Gather,
    Scatter,
    Reduce,
    Barrier,
    AllGatherBytes,
    Send,
    Recv,
}

impl Op {
    const ALL: [Op; 10] = [
        Op::AllReduce,
        Op::Broadcast,
        Op::AllGather,
        Op::Gather,
        Op::Scatter,
        Op::Reduce,
        Op::Barrier,
        Op::AllGatherBytes,
        Op::Send,
        Op::Recv,
    ];

    /// The name, as in PyTorch (`all_reduce`, ...).
    pub(crate) const fn as_str(self) -> &'static str {
        match self {
            Op::AllReduce => "all_reduce",
            Op::Broadcast => "broadcast",
            Op::AllGather => "all_gather",
            Op::Gather => "gather",
            Op::Scatter => "scatter",
            Op::Reduce => "reduce",
            Op::Barrier => "barrier",
            Op::AllGatherBytes => "all_gather_bytes",
            Op::Send => "send",
            Op::Recv => "recv",
        }
    }

    /// The collective called `name`, if it is one.
    #[cfg_attr(not(feature = "mpi"), allow(dead_code))]
    pub(crate) fn from_name(name: &str) -> Option<Op> {
        Op::ALL.into_iter().find(|op| op.as_str() == name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_name_leads_back_to_its_collective() {
        for op in Op::ALL {
            assert_eq!(Op::from_name(op.as_str()), Some(op));
        }
        assert_eq!(Op::from_name("all_gather_object"), None);
    }
}
