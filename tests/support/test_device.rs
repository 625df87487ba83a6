//! The one `test_device!` macro of the workspace, `#[path]`-included by the crates whose tests run
//! one body on every device (the layers' in-crate tests, the models' integration tests).
//!
//! `test_device!(body, body_cpu, body_cuda)` makes `body(&Device)` a CPU test, and with feature
//! `cuda` a CUDA test on the first GPU too. Without a GPU the CUDA test prints `SKIPPED … no CUDA
//! device` and passes; `MULTILORA_REQUIRE_CUDA=1` (the device check sets it) makes it fail
//! instead. The includer re-exports it (`pub(crate) use test_device::test_device;`); the lookup
//! is written inside the macro so that it names no path of the includer.

/// Runs `$body(&Device)` as a CPU test, and as a CUDA test when built with the feature.
#[allow(unused_macros)]
macro_rules! test_device {
    ($body:ident, $cpu:ident, $cuda:ident) => {
        #[test]
        fn $cpu() -> anyhow::Result<()> {
            $body(&candle_core::Device::Cpu)
        }

        #[cfg(feature = "cuda")]
        #[test]
        fn $cuda() -> anyhow::Result<()> {
            match candle_core::Device::new_cuda(0) {
                Ok(dev) => $body(&dev),
                Err(e) if std::env::var("MULTILORA_REQUIRE_CUDA").as_deref() == Ok("1") => {
                    panic!("{}: MULTILORA_REQUIRE_CUDA=1 but no CUDA device: {e}", stringify!($cuda))
                }
                Err(e) => {
                    println!("SKIPPED {}: no CUDA device ({e})", stringify!($cuda));
                    Ok(())
                }
            }
        }
    };
}
#[allow(unused_imports)]
pub(crate) use test_device;
