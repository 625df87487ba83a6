//! The memory bandwidth every floor is taken at: the device's datasheet figure, found by its name
//! (H200, H100 in its three forms, A100, L4), else what a timed 1 GiB device-to-device copy moves;
//! both the name and the copy are measured and reported, so a floor is never an H200's on an
//! H100 (whose 3.35 TB/s would read every ratio 1.4× worse than it is).

use std::sync::OnceLock;

/// The bandwidth the floors use, and what it rests on.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Bandwidth {
    /// Bytes per second.
    pub(crate) bytes_per_sec: f64,
    /// Where the figure comes from, for the report (`"NVIDIA H100 80GB HBM3: datasheet"`, …).
    pub(crate) basis: String,
}

/// An H200 SXM's HBM3e bandwidth (NVIDIA's datasheet: 4.8 TB/s): the floors' figure until the
/// device says otherwise, and in the tests.
pub(crate) const H200_BYTES_PER_SEC: f64 = 4.8e12;

static BANDWIDTH: OnceLock<Bandwidth> = OnceLock::new();

/// Datasheet bandwidths by a marker of the device's name, most specific first (NVIDIA's names:
/// `NVIDIA H100 80GB HBM3`, `NVIDIA H100 PCIe`, `NVIDIA H100 NVL`, `NVIDIA H200`,
/// `NVIDIA A100-SXM4-80GB`, `NVIDIA A100-PCIE-40GB`, `NVIDIA L4`).
const DATASHEET: &[(&[&str], f64)] = &[
    (&["H200"], 4.8e12),
    (&["H100", "NVL"], 3.9e12),
    (&["H100", "PCIE"], 2.0e12),
    (&["H100"], 3.35e12),
    (&["A100", "80GB", "SXM4"], 2.039e12),
    (&["A100", "80GB"], 1.935e12),
    (&["A100"], 1.555e12),
    (&["L4"], 0.3e12),
];

/// The datasheet bandwidth of the device named `name`, when it is one of [`DATASHEET`]'s.
pub(crate) fn datasheet(name: &str) -> Option<f64> {
    let upper = name.to_ascii_uppercase();
    let words: Vec<&str> = upper.split(|c: char| !c.is_ascii_alphanumeric()).filter(|w| !w.is_empty()).collect();
    DATASHEET.iter().find(|(marks, _)| marks.iter().all(|m| words.contains(m))).map(|&(_, bw)| bw)
}

/// The floors' bandwidth for a device named `name` whose copy moved `copied` bytes a second:
/// its datasheet figure when it is known, else the copy's, else (neither) an H200's, said so.
pub(crate) fn choose(name: Option<&str>, copied: Option<f64>) -> Bandwidth {
    let tb = |b: f64| format!("{:.2} TB/s", b / 1e12);
    let copy = copied.map_or("no copy timed".to_string(), |c| format!("a 1 GiB copy moved {}", tb(c)));
    let who = name.unwrap_or("unnamed device");
    match (name.and_then(datasheet), copied) {
        (Some(bw), _) => Bandwidth { bytes_per_sec: bw, basis: format!("{who}: datasheet {}; {copy}", tb(bw)) },
        (None, Some(c)) => Bandwidth {
            bytes_per_sec: c,
            basis: format!("{who}: no datasheet figure known; {copy} (the floors' figure)"),
        },
        (None, None) => Bandwidth {
            bytes_per_sec: H200_BYTES_PER_SEC,
            basis: format!("{who}: unknown, no copy timed: an H200's {}", tb(H200_BYTES_PER_SEC)),
        },
    }
}

/// Sets the floors' bandwidth for this process (the first call wins).
pub(crate) fn set(bw: Bandwidth) {
    let _ = BANDWIDTH.set(bw);
}

/// The floors' bandwidth in bytes per second: the one [`set`], else an H200's.
pub(crate) fn bytes_per_sec() -> f64 {
    BANDWIDTH.get().map_or(H200_BYTES_PER_SEC, |b| b.bytes_per_sec)
}

/// The device's name and the bytes a second a timed 1 GiB device-to-device copy moves (read and
/// written: twice the bytes copied), on the device's own stream.
#[cfg(feature = "cuda")]
pub(crate) fn probe(dev: &candle_core::Device) -> anyhow::Result<(String, f64)> {
    let candle_core::Device::Cuda(d) = dev else { anyhow::bail!("not a CUDA device") };
    let stream = d.cuda_stream();
    let name = stream.context().name()?;
    const BYTES: usize = 1 << 30;
    const COPIES: usize = 4;
    let src = stream.alloc_zeros::<u8>(BYTES)?;
    let mut dst = stream.alloc_zeros::<u8>(BYTES)?;
    // The first copy wakes the clocks and maps the pages; the next ones are timed.
    stream.memcpy_dtod(&src, &mut dst)?;
    stream.synchronize()?;
    let t = std::time::Instant::now();
    for _ in 0..COPIES {
        stream.memcpy_dtod(&src, &mut dst)?;
    }
    stream.synchronize()?;
    Ok((name, (2 * COPIES * BYTES) as f64 / t.elapsed().as_secs_f64()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_get_their_datasheet_figures() {
        let cases = [
            ("NVIDIA H200", Some(4.8e12)),
            ("NVIDIA H100 80GB HBM3", Some(3.35e12)),
            ("NVIDIA H100 PCIe", Some(2.0e12)),
            ("NVIDIA H100 NVL", Some(3.9e12)),
            ("NVIDIA A100-SXM4-80GB", Some(2.039e12)),
            ("NVIDIA A100 80GB PCIe", Some(1.935e12)),
            ("NVIDIA A100-PCIE-40GB", Some(1.555e12)),
            ("NVIDIA L4", Some(0.3e12)),
            ("NVIDIA L40S", None),
            ("NVIDIA GeForce RTX 4090", None),
        ];
        for (name, want) in cases {
            assert_eq!(datasheet(name), want, "{name}");
        }
    }

    #[test]
    fn the_datasheet_wins_then_the_copy_then_an_h200_said_so() {
        let h100 = choose(Some("NVIDIA H100 80GB HBM3"), Some(2.9e12));
        assert_eq!(h100.bytes_per_sec, 3.35e12);
        assert!(h100.basis.contains("datasheet 3.35 TB/s; a 1 GiB copy moved 2.90 TB/s"), "{}", h100.basis);
        let l40 = choose(Some("NVIDIA L40S"), Some(0.8e12));
        assert_eq!(l40.bytes_per_sec, 0.8e12);
        assert!(l40.basis.contains("no datasheet figure"), "{}", l40.basis);
        let none = choose(None, None);
        assert_eq!(none.bytes_per_sec, H200_BYTES_PER_SEC);
        assert!(none.basis.contains("an H200's 4.80 TB/s"), "{}", none.basis);
    }
}
