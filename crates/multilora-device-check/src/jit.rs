//! The `jit` section (feature `cuda`), first of all: loads every module the later sections launch from before any
//! of them is timed, and reports how long each took. Ours come from their fatbins (the GPU's own
//! SASS, nothing compiled, or the PTX the driver compiles for a GPU they have no SASS for: the
//! line says which); candle's are PTX the driver compiles on first load and keeps in its cache
//! (`CUDA_CACHE_MAXSIZE`, raised by the script), so the sections after this one, each its own
//! process, find them compiled instead of paying inside their budgets.

/// The name of the first kernel entry point a PTX text declares (`.visible .entry NAME(`): a
/// function to ask for, which loads its module.
pub(crate) fn first_entry(ptx: &str) -> Option<&str> {
    ptx.lines().find_map(|l| {
        let l = l.trim_start();
        let l = l.strip_prefix(".visible").map_or(l, str::trim_start);
        let name = l.strip_prefix(".entry")?.trim_start();
        let name = name.split(|c: char| c == '(' || c.is_whitespace()).next()?;
        (!name.is_empty()).then_some(name)
    })
}

/// candle's kernel modules, each with its name.
fn candle_modules() -> [(&'static str, candle_core::cuda::kernels::Module); 11] {
    use candle_core::cuda::kernels as k;
    [
        ("affine", k::AFFINE),
        ("binary", k::BINARY),
        ("cast", k::CAST),
        ("conv", k::CONV),
        ("fill", k::FILL),
        ("indexing", k::INDEXING),
        ("quantized", k::QUANTIZED),
        ("reduce", k::REDUCE),
        ("sort", k::SORT),
        ("ternary", k::TERNARY),
        ("unary", k::UNARY),
    ]
}

/// Loads ours, then candle's, each timed.
pub(crate) fn warm(report: &mut crate::report::Report, dev: &candle_core::Device) -> anyhow::Result<()> {
    use crate::report::secs;
    let candle_core::Device::Cuda(d) = dev else { anyhow::bail!("not a CUDA device") };
    let t = std::time::Instant::now();
    let ours = multilora_layers::load_kernel_modules(d)?;
    let ours_s = t.elapsed().as_secs_f64();
    let as_is = ours.iter().filter(|m| m.code.ends_with("as it is")).count();
    for m in &ours {
        report.info("jit", m.module, format!("{} ({})", secs(m.seconds), m.code));
    }
    let t = std::time::Instant::now();
    for (name, module) in candle_modules() {
        let entry =
            first_entry(module.ptx()).ok_or_else(|| anyhow::anyhow!("candle's {name} PTX declares no kernel"))?;
        let one = std::time::Instant::now();
        d.get_or_load_func(entry, &module)?;
        report.info(
            "jit",
            format!("candle {name}"),
            format!("{} (PTX, compiled by the driver or read from its cache)", secs(one.elapsed().as_secs_f64())),
        );
    }
    let candle_s = t.elapsed().as_secs_f64();
    report.key(
        "jit",
        format!(
            "ours {} ({as_is} of {} modules SASS as is), candle's {} (11 PTX modules)",
            secs(ours_s),
            ours.len(),
            secs(candle_s)
        ),
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_entry_of_a_ptx_text() {
        let ptx = "//\n.version 8.0\n.target sm_90\n\n\t// .globl\taffine_f32\n.visible .entry affine_f32(\n\t.param .u64 a\n)\n\
                   .visible .entry affine_f16(\n";
        assert_eq!(first_entry(ptx), Some("affine_f32"));
        assert_eq!(first_entry(".entry  k_2 (\n"), Some("k_2"));
        assert_eq!(first_entry(".version 8.0\n.func helper(\n"), None);
    }

    /// Every candle module has an entry to ask for (the PTX nvcc made of candle's kernels).
    #[test]
    fn every_candle_module_declares_a_kernel() {
        for (name, m) in candle_modules() {
            assert!(first_entry(m.ptx()).is_some(), "candle's {name} PTX");
        }
    }
}
