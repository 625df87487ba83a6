//! Compiles `src/*.cu` to PTX with nvcc, only with feature `cuda` (as candle-kernels does, through
//! the same build helper); `CUDA_COMPUTE_CAP` is honoured and defaults to 90 (H100 / H200). A
//! build without the feature compiles nothing and needs no CUDA toolkit.

fn main() {
    println!("cargo::rerun-if-changed=build.rs");
    println!("cargo::rerun-if-changed=src");
    #[cfg(feature = "cuda")]
    if let Err(e) = cuda::build() {
        // A kernel that does not compile fails the build, with nvcc's own message.
        panic!("multilora-kernels: {e}");
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use std::path::PathBuf;

    /// The compute capability the PTX is built for when `CUDA_COMPUTE_CAP` is not set.
    const DEFAULT_COMPUTE_CAP: usize = 90;

    pub(crate) fn build() -> cudaforge::Result<()> {
        let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
        println!("cargo::rerun-if-env-changed=CUDA_COMPUTE_CAP");
        let mut builder = cudaforge::KernelBuilder::new()
            .source_dir("src")
            .arg("-std=c++17")
            .arg("-O3")
            .arg("--expt-relaxed-constexpr");
        if std::env::var_os("CUDA_COMPUTE_CAP").is_none() {
            builder = builder.compute_cap(DEFAULT_COMPUTE_CAP);
        }
        builder.build_ptx()?.write(out.join("ptx.rs"))
    }
}
