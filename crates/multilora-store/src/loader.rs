//! Loading off the engine's thread: the `AdapterLoader` trait (what a load is, swappable in tests)
//! and the pool of loader threads that runs queued loads. The only file of the crate with threads.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::mpsc;
use std::thread::JoinHandle;

use multilora_adapter::{LoadOptions, LoraAdapter, ModelShapes};
use multilora_types::AdapterSource;
use parking_lot::Mutex;

use crate::error::{Error, Result};

/// Reads and validates one adapter. Runs on a loader thread (or the caller of a runtime `load`),
/// never under the store's lock.
pub trait AdapterLoader: Send + Sync {
    /// Loads `name` from `source`, validated against `shapes` with `opts`.
    fn load(
        &self,
        name: &str,
        source: &AdapterSource,
        shapes: &ModelShapes,
        opts: &LoadOptions,
    ) -> multilora_adapter::Result<LoraAdapter>;
}

/// The loader the store uses unless told otherwise: [`multilora_adapter::load`] (local
/// directories, and hub repos through the Hugging Face cache).
#[derive(Clone, Copy, Debug, Default)]
pub struct FsLoader;

impl AdapterLoader for FsLoader {
    fn load(
        &self,
        name: &str,
        source: &AdapterSource,
        shapes: &ModelShapes,
        opts: &LoadOptions,
    ) -> multilora_adapter::Result<LoraAdapter> {
        multilora_adapter::load(name, source, shapes, opts)
    }
}

type Job = Box<dyn FnOnce() + Send>;

/// A fixed pool of threads taking jobs from one queue, in order. Dropping it closes the queue and
/// joins the threads, after they finish the job in hand.
pub(crate) struct LoaderPool {
    queue: Option<mpsc::Sender<Job>>,
    threads: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for LoaderPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoaderPool").field("threads", &self.threads.len()).finish()
    }
}

impl LoaderPool {
    pub(crate) fn new(threads: usize) -> Result<LoaderPool> {
        let (tx, rx) = mpsc::channel::<Job>();
        // std's receiver is single-consumer; the threads take turns at it.
        let rx = Arc::new(Mutex::new(rx));
        let mut pool = LoaderPool { queue: Some(tx), threads: Vec::with_capacity(threads) };
        for i in 0..threads {
            let rx = Arc::clone(&rx);
            let handle = std::thread::Builder::new()
                .name(format!("multilora-loader-{i}"))
                .spawn(move || {
                    loop {
                        // The guard is a temporary: the lock is released before the job runs.
                        let job = rx.lock().recv();
                        match job {
                            // A panicking job must not take the thread down with it; the job
                            // itself reports its failure.
                            Ok(job) => drop(catch_unwind(AssertUnwindSafe(job))),
                            Err(mpsc::RecvError) => break,
                        }
                    }
                })
                .map_err(|source| Error::LoaderThread { index: i, source })?;
            pool.threads.push(handle);
        }
        Ok(pool)
    }

    /// Queues `job`; false once the pool is shutting down.
    pub(crate) fn submit(&self, job: Job) -> bool {
        self.queue.as_ref().is_some_and(|q| q.send(job).is_ok())
    }
}

impl Drop for LoaderPool {
    fn drop(&mut self) {
        self.queue = None;
        for handle in self.threads.drain(..) {
            // A thread that panicked outside a job has nothing left to clean up.
            let _ = handle.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jobs_run_and_drop_joins() {
        let (tx, rx) = mpsc::channel();
        let pool = LoaderPool::new(2).unwrap();
        for i in 0..4 {
            let tx = tx.clone();
            assert!(pool.submit(Box::new(move || tx.send(i).unwrap())));
        }
        assert!(pool.submit(Box::new(|| panic!("a job that panics"))));
        let mut got: Vec<i32> = (0..4).map(|_| rx.recv().unwrap()).collect();
        got.sort();
        assert_eq!(got, [0, 1, 2, 3]);
        drop(pool);
    }
}
