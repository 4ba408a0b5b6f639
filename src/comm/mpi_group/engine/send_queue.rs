//! Point-to-point sends that outlive the call that started them: `send`
//! returns once MPI has the message, not once the receiver took it.
//!
//! A send past MPI's eager limit completes only when the receiver posts
//! its receive (the rendezvous protocol). With one engine thread per
//! process, two ranks that each send before they receive (a pipeline's
//! activations forward and gradients backward, crossing) would each wait
//! in its send for the other's receive, until the timeout. So the engine
//! starts the send, keeps the message, and tests it while it does the
//! rest of its work; the thread group's channels buffer the same way.

use mpi::request::{Request, StaticScope};
use mpi::topology::SimpleCommunicator;
use mpi::traits::*;

/// A send in flight and the message it reads.
struct InFlight {
    request: Request<'static, [u8], StaticScope>,
    /// The message, owned here until MPI has sent it (see `start`).
    message: *mut [u8],
}

/// The engine's sends in flight, in the order they started.
#[derive(Default)]
pub(super) struct SendQueue {
    sends: Vec<InFlight>,
}

// SAFETY: the queue lives on the engine thread only; the raw pointers are
// the queue's own boxed messages, touched by nothing else.
unsafe impl Send for SendQueue {}

impl SendQueue {
    /// Starts sending `message` to `dst` of `comm` with `tag`.
    pub(super) fn start(
        &mut self,
        comm: &SimpleCommunicator,
        dst: i32,
        tag: i32,
        message: Vec<u8>,
    ) {
        // The message must stay where it is until MPI is done with it, past
        // this call: it is leaked into a `'static` slice here and taken back
        // in `progress` once the request has completed.
        let message: &'static mut [u8] = Box::leak(message.into_boxed_slice());
        let pointer: *mut [u8] = message;
        // SAFETY: `pointer` is the live allocation just leaked; nothing
        // writes it until `progress` frees it after MPI completes the send.
        let readable: &'static [u8] = unsafe { &*pointer };
        let request = comm
            .process_at_rank(dst)
            .immediate_send_with_tag(StaticScope, readable, tag);
        self.sends.push(InFlight {
            request,
            message: pointer,
        });
    }

    /// Tests every send in flight, freeing the messages sent; whether none
    /// is left.
    pub(super) fn progress(&mut self) -> bool {
        let mut still = Vec::with_capacity(self.sends.len());
        for InFlight { request, message } in self.sends.drain(..) {
            match request.test() {
                Ok(_) => {
                    // SAFETY: `message` came from `Box::leak` in `start`, and
                    // MPI completed the send that read it: nothing refers to
                    // it any more.
                    drop(unsafe { Box::from_raw(message) });
                }
                Err(request) => still.push(InFlight { request, message }),
            }
        }
        self.sends = still;
        self.sends.is_empty()
    }
}

impl Drop for SendQueue {
    fn drop(&mut self) {
        // A send that never completed (its receiver failed) may still be
        // read by MPI: its request and message are left to the process's
        // end, which follows a group failure, rather than freed under MPI.
        for send in self.sends.drain(..) {
            std::mem::forget(send.request);
        }
    }
}
