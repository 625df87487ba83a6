//! [`crate::pool::with_hot_pool`]: the step's value comes back, its parallel work runs on every thread
//! of the pool (the global one when called from outside), and the keepers let the threads go
//! when it ends (or panics).

use std::collections::BTreeSet;
use std::sync::Mutex;

use rayon::prelude::*;

use crate::pool::with_hot_pool;

fn pool() -> rayon::ThreadPool {
    rayon::ThreadPoolBuilder::new().num_threads(2).build().expect("pool")
}

#[test]
fn hot_pool_runs_the_step_on_every_thread_and_lets_them_go() {
    let pool = pool();
    for round in 0..10u64 {
        let seen = Mutex::new(BTreeSet::new());
        let sum = pool.install(|| {
            with_hot_pool(|| {
                // Many short parallel regions, as a step's layers make.
                (0..30)
                    .map(|_| {
                        (0..64u64)
                            .into_par_iter()
                            .map(|i| {
                                seen.lock().expect("seen").insert(rayon::current_thread_index());
                                std::thread::sleep(std::time::Duration::from_micros(50));
                                i + round
                            })
                            .sum::<u64>()
                    })
                    .sum::<u64>()
            })
        });
        assert_eq!(sum, 30 * (64 * 63 / 2 + 64 * round));
        assert_eq!(seen.into_inner().expect("seen").len(), 2, "both threads took part");
    }
    // The keepers are gone: a job on every thread of the pool completes.
    let ids: BTreeSet<usize> = pool.broadcast(|ctx| ctx.index()).into_iter().collect();
    assert_eq!(ids.len(), 2);
}

/// Called from a thread outside any pool, the step runs on one of the global pool's threads
/// (not on the caller's, whose every parallel region would otherwise be handed over and waited
/// for); after a panic the keepers are gone.
#[test]
fn hot_pool_from_outside_runs_on_the_global_pool_and_a_panic_lets_the_threads_go() {
    assert_eq!(with_hot_pool(|| 7), 7);
    assert_eq!(rayon::current_thread_index(), None, "the test's own thread");
    let on = with_hot_pool(rayon::current_thread_index);
    assert!(on.is_some(), "the step ran on a pool thread");
    let pool = pool();
    let caught = pool.install(|| std::panic::catch_unwind(|| with_hot_pool(|| panic!("a step failed"))));
    assert!(caught.is_err());
    let ids: BTreeSet<usize> = pool.broadcast(|ctx| ctx.index()).into_iter().collect();
    assert_eq!(ids.len(), 2, "the keepers stopped after the panic");
}
