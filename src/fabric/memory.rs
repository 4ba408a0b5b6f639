//! [`Memory`]: what a rank holds after a step, as each strategy counts it.

/// What a rank holds after a step, in bytes ([`FabricModel::memory`](super::FabricModel::memory)).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Memory {
    /// Its parameters: the whole model, or (FSDP) its pieces.
    pub parameters: usize,
    /// The gradients its last step used (ZeRO-2 and FSDP: its pieces').
    pub gradients: usize,
    /// Its optimizer's state (ZeRO and FSDP: over its pieces).
    pub optimizer_state: usize,
    /// FSDP: the most whole parameters its last step held at once (FSDP
    /// across pipelines: its stages' variables, gathered for the step).
    pub peak_gathered: Option<usize>,
    /// FSDP: the whole model's parameters (`None` for FSDP across
    /// pipelines, whose ranks know their own stages only).
    pub whole_model: Option<usize>,
}
