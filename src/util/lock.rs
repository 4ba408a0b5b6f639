//! Locking that survives a panic elsewhere.
//!
//! A thread that panics while it holds a `Mutex` poisons it, and every
//! later `lock().unwrap()` panics too: one crashed replica or training
//! thread would make the master's `VarMap` unusable, even for the emergency
//! checkpoint after the crash. The data behind this crate's locks (variable
//! maps, saved forwards, timings, channels) is never left half-written by
//! the code that holds them, so the guard is taken back from the poison.

use std::sync::{Mutex, MutexGuard, PoisonError};

/// Locks `mutex`, poisoned or not.
pub(crate) fn lock<T: ?Sized>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lock_poisoned_by_a_panicking_thread_still_locks() {
        let mutex = Mutex::new(1);
        let _ = std::thread::scope(|s| {
            s.spawn(|| {
                let _guard = mutex.lock().unwrap();
                panic!("poison it");
            })
            .join()
        });
        assert!(mutex.is_poisoned());
        assert_eq!(*lock(&mutex), 1);
    }
}
