//! Which variables a unit uses: a `VarBuilder` that forwards every request
//! to the model's own `VarBuilder` and writes down the names asked for.
//!
//! The overlap needs it: a unit's gradients are final only after the
//! backward of the earliest unit that uses them (a weight tied across
//! units gets its last contribution there).

use std::sync::{Arc, Mutex};

use candle_core::{DType, Device, Shape, Tensor};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::{Init, VarBuilder};

use crate::util::lock::lock;
use crate::util::shared_backend::SharedBackend;

/// Forwards to `inner` (a `VarBuilder` without prefix: the names it is
/// given are already full) and records each name.
pub(crate) struct Recording<'a> {
    inner: VarBuilder<'a>,
    /// The path of the `VarBuilder` the model was given.
    prefix: String,
    used: Mutex<Vec<String>>,
}

impl<'a> Recording<'a> {
    /// A recorder over the root of `vb`'s backend.
    pub(crate) fn new(vb: &VarBuilder<'a>) -> Arc<Self> {
        // The names the recorder receives carry the whole path, so the
        // inner builder must add none of its own.
        Arc::new(Recording {
            inner: vb.root(),
            prefix: vb.prefix(),
            used: Mutex::new(Vec::new()),
        })
    }

    /// A `VarBuilder` at the model's path that records into this recorder.
    pub(crate) fn builder(self: &Arc<Self>) -> VarBuilder<'a> {
        let vb = VarBuilder::from_backend(
            Box::new(SharedBackend(self.clone())),
            self.inner.dtype(),
            self.inner.device().clone(),
        );
        match self.prefix.is_empty() {
            true => vb,
            false => vb.push_prefix(&self.prefix),
        }
    }

    /// The names recorded since the last call, sorted, each once.
    pub(crate) fn take(&self) -> Vec<String> {
        let mut names = std::mem::take(&mut *lock(&self.used));
        names.sort();
        names.dedup();
        names
    }

    fn note(&self, name: &str) {
        lock(&self.used).push(name.to_string());
    }
}

impl SimpleBackend for Recording<'_> {
    fn get(
        &self,
        shape: Shape,
        name: &str,
        init: Init,
        dtype: DType,
        _: &Device,
    ) -> candle_core::Result<Tensor> {
        self.note(name);
        self.inner.get_with_hints_dtype(shape, name, init, dtype)
    }

    fn get_unchecked(&self, name: &str, dtype: DType, _: &Device) -> candle_core::Result<Tensor> {
        self.note(name);
        self.inner.get_unchecked_dtype(name, dtype)
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.inner.contains_tensor(name)
    }
}
