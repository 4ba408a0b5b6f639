//! The crate's small shared helpers, each a file of a few lines: a lock
//! that survives a panicking holder (`lock`), the variables of a `VarMap`
//! in a fixed order and gradients summed (`vars`), a device's name in
//! messages (`device_label`), a panic's message (`panic_message`), and a
//! `VarBuilder` backend kept where its builder can read it back
//! (`shared_backend`).

pub(crate) mod device_label;
pub(crate) mod lock;
pub(crate) mod panic_message;
pub(crate) mod shared_backend;
pub(crate) mod vars;
