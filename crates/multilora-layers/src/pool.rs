//! Keeping the rayon pool's other threads awake through one model step ([`with_hot_pool`]).
//!
//! A decode step of a small model is a few hundred short parallel regions (the projections, the
//! attention, the `lm_head`), each a few to a few hundred microseconds. Between two of them a
//! rayon worker that found no work yields a few dozen times and then sleeps on a futex; the next
//! region wakes it with a system call, and in a virtual machine the wake-up of an idle virtual CPU
//! costs tens of microseconds more. Over a one-row step that is a sizeable part of the step (see
//! docs/BENCHMARKS.md). So for the length of a step the other workers run a keeper that takes the
//! step's parallel work as soon as it appears (`rayon::yield_now`) and spins in between, as
//! ggml's thread pool does between its ops; when the step ends they go back to rayon's own
//! idling. Nothing changes in what is computed or on which data: only who waits how.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// A keeper gives up after this long without work, whatever the step does: a bound on the time
/// it spins for nothing (a step that runs serial code for longer lets its thread sleep).
const MAX_IDLE: Duration = Duration::from_millis(2);

/// Sets the flag when dropped: the keepers stop even when the step returns early or panics.
struct Done(Arc<AtomicBool>);

impl Drop for Done {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Release);
    }
}

/// Runs `f` (one model step) with the current rayon pool's other threads spinning for its
/// parallel work instead of sleeping between its regions. Called from a thread outside any rayon
/// pool (an embedder's own), it runs `f` on the global pool's threads, hot the same way: from
/// outside, each of a step's parallel regions would be handed to the pool and waited for through
/// a futex, with nobody keeping the workers awake (measured: 55 against 43 ms for the 16-row LoRA
/// step of docs/BENCHMARKS.md's GGUF bench). In a pool of one thread it just runs `f`.
pub fn with_hot_pool<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    let Some(me) = rayon::current_thread_index() else {
        // `scope` called from outside a pool runs its body on one of the global pool's threads.
        return rayon::scope(|_| with_hot_pool(f));
    };
    if rayon::current_num_threads() < 2 {
        return f();
    }
    let done = Done(Arc::new(AtomicBool::new(false)));
    let flag = Arc::clone(&done.0);
    // One keeper per thread of the pool, each queued on its own thread (a broadcast job is never
    // stolen): this thread's returns at once, so it never holds up the step it runs.
    rayon::spawn_broadcast(move |ctx| {
        if ctx.index() == me {
            return;
        }
        let mut last = Instant::now();
        while !flag.load(Ordering::Acquire) {
            match rayon::yield_now() {
                Some(rayon::Yield::Executed) => last = Instant::now(),
                _ if last.elapsed() > MAX_IDLE => return,
                _ => std::hint::spin_loop(),
            }
        }
    });
    let out = f();
    drop(done);
    out
}
