//! # weir-budget: a memory budget for work that input steers
//!
//! A thread's live bytes, capped.
//!
//! A chat template or a judge template is a program from a file. Fuel
//! bounds how many instructions it runs, not how many bytes: one
//! instruction repeats a string a hundred million times, and a handful
//! more double it in a loop until the machine is out of memory — and Rust
//! aborts the whole process when an allocation fails. No check inside the
//! template engine covers every operator, filter and method that builds a
//! value; counting every allocation does.
//!
//! [`Counting`], weir's global allocator, charges each allocation of a
//! thread that runs [`within`] to that thread's budget and refunds each
//! release. An allocation that would take the thread past its budget is
//! never made: the thread marks itself as over and stops for good, holding
//! no lock and at most its budget, and the caller, which waited on another
//! thread, gets [`OverBudget`] and fails with one line. A process that
//! refuses a template goes on to end, so the stopped thread lives no longer
//! than the run it refused.
//!
//! Threads outside [`within`] pay one thread-local read per allocation.
//! Linking this crate makes [`Counting`] the binary's global allocator.
//!
//! # Examples
//!
//! ```
//! use weir_budget::{within, OverBudget};
//!
//! let small = within(1 << 20, || "x".repeat(1000).len());
//! assert_eq!(small, Ok(1000));
//! let huge = within(1 << 20, || "x".repeat(1 << 30).len());
//! assert_eq!(huge, Err(OverBudget { bytes: 1 << 20 }));
//! ```

#![deny(missing_docs)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// The system allocator, charging the threads that run under [`within`].
pub struct Counting;

#[global_allocator]
static ALLOCATOR: Counting = Counting;

thread_local! {
    /// This thread's budget in bytes; 0 when it has none.
    static LIMIT: Cell<usize> = const { Cell::new(0) };
    /// Bytes allocated and not yet released since the budget was set.
    static LIVE: Cell<isize> = const { Cell::new(0) };
    /// Where this thread says it went over (an `AtomicBool` its caller reads).
    static OVER: Cell<*const AtomicBool> = const { Cell::new(std::ptr::null()) };
}

/// Charges `bytes` to this thread's budget, if it has one; a charge past it
/// never returns.
fn charge(bytes: usize) {
    let limit = LIMIT.with(Cell::get);
    // A thread that panics is not stopped: its panic hook holds the
    // process's backtrace and stderr locks while it allocates.
    if limit == 0 || std::thread::panicking() {
        return;
    }
    let live = LIVE.with(|live| {
        let now = live.get().saturating_add(bytes as isize);
        live.set(now);
        now
    });
    if live > limit as isize {
        stop_over_budget();
    }
}

fn refund(bytes: usize) {
    if LIMIT.with(Cell::get) != 0 {
        LIVE.with(|live| live.set(live.get().saturating_sub(bytes as isize)));
    }
}

/// Tells this thread's caller that it went over, then stops for good:
/// inside the allocator nothing may unwind or allocate.
fn stop_over_budget() -> ! {
    let over = OVER.with(Cell::get);
    if !over.is_null() {
        // SAFETY: `within` keeps the flag alive in this thread's closure,
        // which never returns from here.
        unsafe { (*over).store(true, Ordering::SeqCst) };
    }
    loop {
        // SAFETY: pause only waits for a signal.
        unsafe { libc::pause() };
    }
}

// SAFETY: every call is forwarded to `System` unchanged; the counting only
// reads and writes this thread's own cells, which allocate nothing.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        charge(layout.size());
        System.alloc(layout)
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        charge(layout.size());
        System.alloc_zeroed(layout)
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        refund(layout.size());
        System.dealloc(ptr, layout)
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if new_size > layout.size() {
            charge(new_size - layout.size());
        } else {
            refund(layout.size() - new_size);
        }
        System.realloc(ptr, layout, new_size)
    }
}

/// `work` could not finish within its budget of `bytes`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OverBudget {
    /// The budget it went past.
    pub bytes: usize,
}

impl std::fmt::Display for OverBudget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "needs more than {} MiB of memory", self.bytes >> 20)
    }
}

/// Runs `work` on a thread of its own whose live allocations may not pass
/// `bytes`, and returns what it returns, or [`OverBudget`] once it tries to
/// allocate past that (the thread then stays stopped, holding at most
/// `bytes`). What `work` returns is handed back across threads, so it should
/// own its data. A panic in `work` is resumed here.
pub fn within<T: Send + 'static>(
    bytes: usize,
    work: impl FnOnce() -> T + Send + 'static,
) -> Result<T, OverBudget> {
    let over = Arc::new(AtomicBool::new(false));
    let flag = Arc::clone(&over);
    let (sender, receiver) = std::sync::mpsc::sync_channel(1);
    let spawned = std::thread::Builder::new()
        .name("weir-budget".into())
        // Deep template recursion needs the stack a main thread has.
        .stack_size(8 << 20)
        .spawn(move || {
            OVER.with(|o| o.set(Arc::as_ptr(&flag)));
            LIVE.with(|live| live.set(0));
            LIMIT.with(|limit| limit.set(bytes.max(1)));
            let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(work));
            LIMIT.with(|limit| limit.set(0));
            let _ = sender.send(result);
            drop(flag);
        })
        .expect("a thread for bounded work starts (the system is out of threads otherwise)");
    loop {
        match receiver.recv_timeout(Duration::from_millis(10)) {
            Ok(result) => {
                let _ = spawned.join();
                return result.map_err(|payload| std::panic::resume_unwind(payload));
            }
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                if over.load(Ordering::SeqCst) {
                    return Err(OverBudget { bytes });
                }
            }
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                if over.load(Ordering::SeqCst) {
                    return Err(OverBudget { bytes });
                }
                // The thread ended without a result: only a failed send can
                // do that, and the receiver is here.
                unreachable!("a bounded thread ended without sending its result");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn work_that_frees_as_it_goes_fits_a_budget_smaller_than_its_total() {
        // 64 × 1 MiB allocated, one at a time: the live bytes stay small.
        let total = within(8 << 20, || {
            (0..64).map(|_| vec![1u8; 1 << 20].len()).sum::<usize>()
        });
        assert_eq!(total, Ok(64 << 20));
    }

    #[test]
    fn doubling_stops_at_the_budget_and_the_caller_goes_on() {
        let result = within(64 << 20, || {
            let mut s = String::from("x");
            for _ in 0..40 {
                s = format!("{s}{s}");
            }
            s.len()
        });
        assert_eq!(result, Err(OverBudget { bytes: 64 << 20 }));
        // The caller allocates as it likes.
        assert_eq!(vec![0u8; 128 << 20].len(), 128 << 20);
    }

    #[test]
    fn a_panic_in_the_work_reaches_the_caller() {
        let caught = std::panic::catch_unwind(|| within(1 << 20, || panic!("inside")));
        assert!(caught.is_err());
    }
}
