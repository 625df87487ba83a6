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
//!
//! The step's parallel regions themselves run through [`for_each_index`] / [`for_each_part`]
//! rather than rayon's splitting iterators: each thread takes a contiguous run of the region's
//! tasks (a product's consecutive column ranges, so its weight stream goes on from task to task),
//! a thread out of work takes the last task of another's run, and the caller waits for the
//! tasks still running by spinning, not through rayon's wait, which gives the CPU back to the
//! system between checks and noticed a task's end ~2–4 µs late in a virtual machine (a 16-row
//! decode step has ~500 regions; docs/BENCHMARKS.md).

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

/// The caller of a region spins this long for the tasks still running elsewhere before it also
/// yields its CPU between checks (a thread of the pool descheduled by the system, on a machine
/// with more threads than cores, is then not kept from running by the spinning one).
const MAX_SPIN: Duration = Duration::from_micros(50);

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
    if WIDTH.get() == 1 {
        return f();
    }
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

/// Runs `f(0)`, …, `f(n - 1)`, each once, on the current rayon pool's threads (on this thread
/// alone in a pool of one, or for one task). Thread `t` of `T` starts on the run
/// `t·n/T .. (t+1)·n/T`, front to back; a thread whose run is done takes tasks from the back of
/// another's. Returns when every task has; a panic in a task is passed on once the others end.
/// (Past `u32::MAX` tasks, which no region has, they run on this thread.)
pub fn for_each_index(n: usize, f: impl Fn(usize) + Sync) {
    let threads = self::threads().min(n);
    if threads < 2 || u32::try_from(n).is_err() {
        (0..n).for_each(f);
        return;
    }
    let runs: Vec<Run> = (0..threads).map(|t| Run::new(t * n / threads, (t + 1) * n / threads)).collect();
    let (done, helping) = (AtomicUsize::new(0), AtomicUsize::new(0));
    let work = |me: usize| {
        let others = (1..threads).map(|d| &runs[(me + d) % threads]);
        while let Some(i) = runs[me].front().or_else(|| others.clone().find_map(Run::back)) {
            let _count = AddOnDrop(&done);
            f(i);
        }
    };
    rayon::scope(|s| {
        for t in 1..threads {
            let (work, helping) = (&work, &helping);
            s.spawn(move |_| {
                helping.fetch_add(1, Ordering::AcqRel);
                let _leave = SubOnDrop(helping);
                work(t);
            });
        }
        work(0);
        // Every task is taken; the ones still running elsewhere, and their threads' way out,
        // waited for here (a run never started is run by the scope itself: it finds no task).
        wait_until(|| done.load(Ordering::Acquire) >= n && helping.load(Ordering::Acquire) == 0);
    });
}

thread_local! {
    /// How many threads the regions opened on this thread run on: 0 for the pool's all, else a
    /// share of them ([`with_width`]; 1 in [`solo`]).
    static WIDTH: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// Runs `f` with every parallel region it opens on this thread run on at most `width` threads
/// (and products planned for that many): for work that is itself one of several run side by
/// side, e.g. one group of a step's rows while other threads run the other groups.
pub fn with_width<R>(width: usize, f: impl FnOnce() -> R) -> R {
    struct Restore(usize);
    impl Drop for Restore {
        fn drop(&mut self) {
            WIDTH.set(self.0);
        }
    }
    let _restore = Restore(WIDTH.replace(width.max(1)));
    f()
}

/// [`with_width`] 1: every region `f` opens runs on this thread alone.
pub fn solo<R>(f: impl FnOnce() -> R) -> R {
    with_width(1, f)
}

/// Runs `f` on each of `items` side by side, each a task of one parallel region whose own regions
/// run on its share of the threads ([`with_width`]: ⌈threads / items⌉; alone, [`solo`], when
/// there are no more threads than items): e.g. a step's row groups, each taken through a layer
/// by its own thread and helped by the threads left over. The results in the items' order; a
/// panic in one is passed on once the others end.
pub fn side_by_side<T: Send, R: Send>(items: &mut [T], f: impl Fn(&mut T) -> R + Sync) -> Vec<R> {
    let width = threads().div_ceil(items.len().max(1));
    let out: Vec<Mutex<Option<R>>> = items.iter().map(|_| Mutex::new(None)).collect();
    for_each_part(items.iter_mut().collect(), |i, item| {
        let r = with_width(width, || f(item));
        *out[i].lock().unwrap_or_else(PoisonError::into_inner) = Some(r);
    });
    out.into_iter().map(|m| taken(m).expect("side_by_side: every item ran")).collect()
}

/// Most row groups [`row_groups`] cuts a step into: each group streams every weight, so each group
/// more reads the weights once more, and a decode step's products, compute-bound at two groups,
/// turn memory-bound past them. Two is what has been measured (SmolLM2's 16-row step on the
/// 2-core machines); on more threads each group's regions run on its share of them.
pub const MAX_ROW_GROUPS: usize = 2;

/// How many row groups a step of `rows` rows is cut into in the current pool, each group taken
/// through every layer by its own thread, its regions on its share of the threads
/// ([`side_by_side`]): as many as the pool's threads, the rows (at least `min_rows` a group) and
/// [`MAX_ROW_GROUPS`] allow; 1 (the step as one group, each op's regions on every thread) inside
/// [`solo`] or on one thread.
pub fn row_groups(rows: usize, min_rows: usize) -> usize {
    threads().min(MAX_ROW_GROUPS).min(rows / min_rows.max(1)).max(1)
}

/// The threads a region opened here runs on: the current rayon pool's, or at most the share
/// [`with_width`] gives (1 inside [`solo`]).
pub fn threads() -> usize {
    let all = rayon::current_num_threads();
    match WIDTH.get() {
        0 => all,
        w => w.min(all),
    }
}

/// Returns once `ready()` holds, spinning for it ([`MAX_SPIN`] at most, then also yielding the
/// CPU between checks): how a thread waits for work another thread of a region is finishing.
pub(crate) fn wait_until(ready: impl Fn() -> bool) {
    let start = Instant::now();
    let mut spins = 0u32;
    while !ready() {
        spins = spins.wrapping_add(1);
        if spins.is_multiple_of(64) && start.elapsed() > MAX_SPIN {
            std::thread::yield_now();
        } else {
            std::hint::spin_loop();
        }
    }
}

/// [`for_each_index`] over owned parts (e.g. disjoint `&mut` chunks of an output): `f(i, part)`
/// once for each.
pub fn for_each_part<T: Send>(parts: Vec<T>, f: impl Fn(usize, T) + Sync) {
    if threads() < 2 || parts.len() < 2 {
        parts.into_iter().enumerate().for_each(|(i, p)| f(i, p));
        return;
    }
    let cells: Vec<Mutex<Option<T>>> = parts.into_iter().map(|p| Mutex::new(Some(p))).collect();
    for_each_index(cells.len(), |i| {
        // Each index is taken once, so each cell is taken once.
        if let Some(p) = cells[i].lock().unwrap_or_else(PoisonError::into_inner).take() {
            f(i, p);
        }
    });
}

/// `(a(), b())`, side by side as two tasks of [`for_each_index`].
pub fn join<A: Send, B: Send>(a: impl FnOnce() -> A + Send, b: impl FnOnce() -> B + Send) -> (A, B) {
    let (ra, rb) = (Mutex::new(None), Mutex::new(None));
    let (fa, fb) = (Mutex::new(Some(a)), Mutex::new(Some(b)));
    for_each_index(2, |i| {
        if i == 0 {
            if let Some(a) = fa.lock().unwrap_or_else(PoisonError::into_inner).take() {
                *ra.lock().unwrap_or_else(PoisonError::into_inner) = Some(a());
            }
        } else if let Some(b) = fb.lock().unwrap_or_else(PoisonError::into_inner).take() {
            *rb.lock().unwrap_or_else(PoisonError::into_inner) = Some(b());
        }
    });
    // Both ran: `for_each_index` returns after every task, or passes a task's panic on.
    (taken(ra).expect("join: the first task ran"), taken(rb).expect("join: the second task ran"))
}

fn taken<T>(m: Mutex<Option<T>>) -> Option<T> {
    m.into_inner().unwrap_or_else(PoisonError::into_inner)
}

/// The tasks `lo..hi` left of one thread's run, packed in one word: its owner takes from the
/// front, the others from the back.
struct Run(AtomicU64);

impl Run {
    fn new(lo: usize, hi: usize) -> Run {
        Run(AtomicU64::new(((lo as u64) << 32) | hi as u64))
    }

    fn front(&self) -> Option<usize> {
        self.take(true)
    }

    fn back(&self) -> Option<usize> {
        self.take(false)
    }

    fn take(&self, front: bool) -> Option<usize> {
        let mut cur = self.0.load(Ordering::Acquire);
        loop {
            let (lo, hi) = (cur >> 32, cur & u64::from(u32::MAX));
            if lo >= hi {
                return None;
            }
            let (next, got) = if front { (cur + (1 << 32), lo) } else { (cur - 1, hi - 1) };
            match self.0.compare_exchange_weak(cur, next, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return Some(got as usize),
                Err(now) => cur = now,
            }
        }
    }
}

/// Adds one when dropped: a task's end, also when it panics.
pub(crate) struct AddOnDrop<'a>(pub(crate) &'a AtomicUsize);

impl Drop for AddOnDrop<'_> {
    fn drop(&mut self) {
        self.0.fetch_add(1, Ordering::Release);
    }
}

/// Takes one away when dropped: a helping thread's way out, also when a task panics.
struct SubOnDrop<'a>(&'a AtomicUsize);

impl Drop for SubOnDrop<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use std::panic::{AssertUnwindSafe, catch_unwind};
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    fn pool(threads: usize) -> rayon::ThreadPool {
        rayon::ThreadPoolBuilder::new().num_threads(threads).build().expect("a pool")
    }

    /// Every index once, whatever the pool (1–3 threads, or the global one from outside), the
    /// number of tasks (none, fewer than the threads, many) and how uneven they are; inside a
    /// step's hot pool too.
    #[test]
    fn every_task_runs_once() {
        let check = |n: usize| {
            let seen: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
            for_each_index(n, |i| {
                // Uneven tasks, so that threads run out of their own and take others'.
                let spin = if i % 3 == 0 { 20_000 } else { 10 };
                (0..spin).for_each(|_| std::hint::spin_loop());
                seen[i].fetch_add(1, Ordering::Relaxed);
            });
            assert!(seen.iter().all(|c| c.load(Ordering::Relaxed) == 1), "{n} tasks");
        };
        for threads in [1, 2, 3] {
            pool(threads).install(|| [0, 1, 2, 3, 7, 64, 1000].into_iter().for_each(check));
            pool(threads).install(|| with_hot_pool(|| check(100)));
        }
        check(50);
    }

    /// Parts, a join's two results and a region inside a region's task.
    #[test]
    fn parts_joins_and_nested_regions() {
        pool(2).install(|| {
            let mut out = vec![0usize; 37];
            for_each_part(out.chunks_mut(5).collect(), |i, c: &mut [usize]| c.fill(i + 1));
            let want: Vec<usize> = (0..37).map(|j| j / 5 + 1).collect();
            assert_eq!(out, want);
            assert_eq!(join(|| 6 * 7, || "b"), (42, "b"));
            let total = AtomicUsize::new(0);
            for_each_index(4, |_| {
                for_each_index(5, |j| {
                    total.fetch_add(j, Ordering::Relaxed);
                })
            });
            assert_eq!(total.load(Ordering::Relaxed), 4 * 10);
        });
    }

    /// Items side by side: each runs once, its result in its place, every region it opens run
    /// on its own thread alone when there are no more threads than items (one thread seen
    /// inside, the tasks in order); the width is back after, also after a panic.
    #[test]
    fn items_side_by_side_run_their_regions_alone() {
        for n in [1, 2, 3, 5] {
            pool(n).install(|| {
                let mut items: Vec<usize> = (0..5).collect();
                let out = side_by_side(&mut items, |v| {
                    assert_eq!(threads(), 1, "inside an item");
                    let me = std::thread::current().id();
                    let order = Mutex::new(Vec::new());
                    for_each_index(6, |j| {
                        assert_eq!(std::thread::current().id(), me, "a region's task on another thread");
                        order.lock().expect("lock").push(j);
                    });
                    assert_eq!(order.into_inner().expect("lock"), (0..6).collect::<Vec<_>>());
                    *v += 10;
                    *v * 2
                });
                assert_eq!(out, vec![20, 22, 24, 26, 28]);
                assert_eq!(items, vec![10, 11, 12, 13, 14]);
                assert_eq!(threads(), n, "after the items");
            });
        }
        let failed = catch_unwind(|| solo(|| panic!("fails inside")));
        assert!(failed.is_err());
        assert_eq!(WIDTH.get(), 0, "solo is off again after a panic");
    }

    /// More threads than items: each item's regions run on its share of them (⌈threads /
    /// items⌉), helped by the threads left over, and every task runs once.
    #[test]
    fn items_side_by_side_share_the_threads_left_over() {
        for (n, items, width) in [(4, 2, 2), (3, 2, 2), (5, 2, 3)] {
            pool(n).install(|| {
                let mut ids: Vec<usize> = (0..items).collect();
                let out = side_by_side(&mut ids, |v| {
                    assert_eq!(threads(), width, "{n} threads, {items} items");
                    let total = AtomicUsize::new(0);
                    for_each_index(100, |j| {
                        total.fetch_add(j, Ordering::Relaxed);
                    });
                    total.load(Ordering::Relaxed) + *v
                });
                assert_eq!(out, (0..items).map(|v| 4950 + v).collect::<Vec<_>>());
                assert_eq!(threads(), n, "after the items");
            });
        }
    }

    /// A task's panic reaches the caller once the other tasks end; the pool goes on.
    #[test]
    fn a_panic_is_passed_on() {
        let p = pool(2);
        let ran = AtomicUsize::new(0);
        let r = catch_unwind(AssertUnwindSafe(|| {
            p.install(|| {
                for_each_index(16, |i| {
                    assert!(i != 11, "task 11 fails");
                    ran.fetch_add(1, Ordering::Relaxed);
                })
            })
        }));
        assert!(r.is_err(), "the panic comes back");
        assert!(ran.load(Ordering::Relaxed) <= 15);
        let after = AtomicUsize::new(0);
        p.install(|| {
            for_each_index(8, |_| {
                after.fetch_add(1, Ordering::Relaxed);
            })
        });
        assert_eq!(after.load(Ordering::Relaxed), 8, "the pool still works");
    }
}
