//! Synchronisation primitives of the shared-memory ring: std atomics and a *shared* futex
//! normally, loom's atomics and a futex model under `cfg(loom)`. Everything in `shm/` imports
//! its atomics from here, so the loom models in `tests/rust/` check the same protocol code.
//!
//! The futex is shared (no `FUTEX_PRIVATE_FLAG`): private futexes are keyed by (address
//! space, address), so a waker in another process would never find the waiter.

use std::time::Duration;

#[cfg(loom)]
pub use loom::sync::atomic::{fence, AtomicBool, AtomicU32, AtomicU64};
#[cfg(loom)]
pub use loom::sync::{Mutex, MutexGuard};
pub use std::sync::atomic::Ordering;
#[cfg(not(loom))]
pub use std::sync::atomic::{fence, AtomicBool, AtomicU32, AtomicU64};
#[cfg(not(loom))]
pub use std::sync::{Mutex, MutexGuard};

/// Busy-wait hint; under loom a yield, so that spinning models stay finite.
#[inline]
pub fn spin_loop() {
    #[cfg(loom)]
    loom::thread::yield_now();
    #[cfg(not(loom))]
    std::hint::spin_loop();
}

/// A 32-bit futex word in shared memory (`#[repr(C)]`, 4 bytes outside loom) with the
/// compare-and-sleep / wake pair of an eventcount: a waiter reads `seq`, re-checks its
/// condition, then sleeps only while `seq` is unchanged; a waker bumps `seq` then wakes.
#[repr(C)]
pub struct Futex {
    pub seq: AtomicU32,
    #[cfg(loom)]
    model: (loom::sync::Mutex<()>, loom::sync::Condvar),
}

/// Why [`Futex::wait`] returned; every case makes the caller re-check its condition.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Woken {
    /// Woken, or `seq` had already changed (EAGAIN), or a signal (EINTR).
    Maybe,
    /// The slice elapsed.
    TimedOut,
}

impl Futex {
    pub fn new() -> Self {
        Futex {
            seq: AtomicU32::new(0),
            #[cfg(loom)]
            model: (loom::sync::Mutex::new(()), loom::sync::Condvar::new()),
        }
    }

    /// The value a waiter passes to [`Futex::wait`]; read it *before* re-checking.
    #[inline]
    pub fn load(&self) -> u32 {
        self.seq.load(Ordering::Acquire)
    }

    /// Bumps `seq` and wakes every waiter (there is at most one: one waiter per ring end).
    pub fn bump_and_wake(&self) {
        self.seq.fetch_add(1, Ordering::Release);
        #[cfg(not(loom))]
        {
            // An error here (EFAULT cannot happen on a live mapping) only costs the waiter
            // the rest of its slice, so it is ignored.
            let _ = rustix::thread::futex::wake(
                &self.seq,
                rustix::thread::futex::Flags::empty(),
                i32::MAX as u32,
            );
        }
        #[cfg(loom)]
        {
            let _guard = self.model.0.lock().unwrap();
            self.model.1.notify_all();
        }
    }

    /// Sleeps while `seq == expected`, for at most `timeout` (loom: until woken).
    pub fn wait(&self, expected: u32, timeout: Duration) -> Woken {
        #[cfg(not(loom))]
        {
            let ts = rustix::thread::futex::Timespec {
                tv_sec: timeout.as_secs() as i64,
                tv_nsec: timeout.subsec_nanos() as _,
            };
            match rustix::thread::futex::wait(
                &self.seq,
                rustix::thread::futex::Flags::empty(),
                expected,
                Some(&ts),
            ) {
                Err(rustix::io::Errno::TIMEDOUT) => Woken::TimedOut,
                _ => Woken::Maybe,
            }
        }
        #[cfg(loom)]
        {
            let _ = timeout;
            let guard = self.model.0.lock().unwrap();
            if self.seq.load(Ordering::SeqCst) != expected {
                return Woken::Maybe;
            }
            drop(self.model.1.wait(guard).unwrap());
            Woken::Maybe
        }
    }
}

impl Default for Futex {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(not(loom))]
const _: () = assert!(std::mem::size_of::<Futex>() == 4);
