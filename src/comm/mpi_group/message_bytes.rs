//! The bytes MPI sends and receives, and receiving into memory that is not
//! initialised yet.
//!
//! A reduction's result is a fresh buffer of the gradient's size, and MPI
//! writes every byte of it before anything reads it. Zero-filling it first
//! would be a pass over megabytes for nothing: timed inside DDP's
//! all-reduce in training (MLP, batch 256, 2 processes), 0.55-0.85 ms of a
//! 2.4-3.1 ms call. So the ring receives into `MaybeUninit` memory, through
//! [`MessageByte`], and the engine reads a chunk only once MPI received
//! it. The `unsafe` of it is here, in a few small functions.

use std::mem::{size_of_val, MaybeUninit};

use mpi::datatype::{Equivalence, SystemDatatype};

use super::wire::Wire;

/// One byte of a message buffer, initialised or not before MPI receives
/// into it.
#[repr(transparent)]
#[derive(Clone, Copy)]
pub(super) struct MessageByte(MaybeUninit<u8>);

// SAFETY: `MessageByte` has the size, alignment and layout of `u8`
// (`repr(transparent)` over `MaybeUninit<u8>`), which is what `u8`'s MPI
// datatype describes; MPI only ever writes whole bytes into it.
unsafe impl Equivalence for MessageByte {
    type Out = SystemDatatype;

    fn equivalent_datatype() -> SystemDatatype {
        u8::equivalent_datatype()
    }
}

/// The bytes of `values`, to send.
pub(super) fn sent<T: Wire>(values: &[T]) -> &[MessageByte] {
    let bytes: &[u8] = bytemuck::cast_slice(values);
    // SAFETY: `MessageByte` has `u8`'s layout, and initialised bytes are
    // valid `MaybeUninit<u8>`s; the slice is shared, so nothing is written.
    unsafe { std::slice::from_raw_parts(bytes.as_ptr().cast(), bytes.len()) }
}

/// The bytes of `values`, for MPI to receive into.
pub(super) fn received<T: Wire>(values: &mut [MaybeUninit<T>]) -> &mut [MessageByte] {
    // SAFETY: a `MaybeUninit<T>` is `size_of::<T>()` bytes, each of which
    // may be uninitialised, as a `MaybeUninit<u8>` may be.
    unsafe { std::slice::from_raw_parts_mut(values.as_mut_ptr().cast(), size_of_val(values)) }
}

/// Initialised `values`, for MPI to receive into all the same.
///
/// # Safety
///
/// Only initialised bytes may be written through the result (as MPI's
/// receives write them): writing `MaybeUninit::uninit()` would leave
/// `values` uninitialised behind the caller's back.
pub(super) unsafe fn as_receivable<T: Wire>(values: &mut [T]) -> &mut [MaybeUninit<T>] {
    // `MaybeUninit<T>` has `T`'s layout, and any initialised bytes are a
    // valid `T` (`Wire` types are `Pod`).
    std::slice::from_raw_parts_mut(values.as_mut_ptr().cast(), values.len())
}

/// `values`, which MPI has received into.
///
/// # Safety
///
/// Every byte of `values` was written (by a completed receive, or by the
/// engine since).
pub(super) unsafe fn assume_received<T: Wire>(values: &mut [MaybeUninit<T>]) -> &mut [T] {
    std::slice::from_raw_parts_mut(values.as_mut_ptr().cast(), values.len())
}

/// [`assume_received`] for reading only.
///
/// # Safety
///
/// As for [`assume_received`].
pub(super) unsafe fn assume_received_ref<T: Wire>(values: &[MaybeUninit<T>]) -> &[T] {
    std::slice::from_raw_parts(values.as_ptr().cast(), values.len())
}
