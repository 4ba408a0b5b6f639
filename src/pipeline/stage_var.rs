//! A variable as a stage's layers see it.

use candle_core::Var;

/// A variable a stage's layers use: the `VarMap`'s own (`local` is
/// `master`), or a stage-local mirror of it (see `stage_build`).
pub(crate) struct StageVar {
    pub(crate) name: String,
    /// What the layers use.
    pub(crate) local: Var,
    /// The `VarMap`'s variable.
    pub(crate) master: Var,
}

impl StageVar {
    pub(crate) fn is_mirror(&self) -> bool {
        self.local.as_tensor().id() != self.master.as_tensor().id()
    }
}
