//! What the model benches share: the read bandwidth of the machine, measured in the same run as
//! the steps it is a floor for, and the median time of a step.

use std::hint::black_box;
use std::time::Instant;

/// Bytes per second all threads read from memory (a sum over 512 MiB, far past the caches, on
/// the rayon pool; the best of 5).
pub(crate) fn read_bandwidth() -> f64 {
    use rayon::prelude::*;
    let buf = vec![1u64; 64 << 20];
    let mut best = 0f64;
    for _ in 0..5 {
        let t = Instant::now();
        let sum: u64 = buf.par_chunks(1 << 16).map(|c| c.iter().fold(0u64, |a, &v| a.wrapping_add(v))).sum();
        black_box(sum);
        best = best.max((buf.len() * 8) as f64 / t.elapsed().as_secs_f64());
    }
    best
}

/// The median of `runs` timed calls of `f`, in seconds, after one untimed call.
pub(crate) fn median_time<F: FnMut()>(runs: usize, mut f: F) -> f64 {
    f();
    let mut times: Vec<f64> = (0..runs)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .collect();
    times.sort_by(f64::total_cmp);
    times[times.len() / 2]
}
