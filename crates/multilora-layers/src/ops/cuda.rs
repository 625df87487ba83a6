//! Launch glue of the CUDA kernels (feature `cuda`): device addresses of tensors, loading
//! `multilora-kernels`' modules from their fatbins (once per device, each function looked up
//! once), launching a kernel with the host plan's parameters, and readying a device's context. The
//! ops that use it are candle custom ops (`shrink/cuda.rs`, `expand/cuda.rs`), so candle holds
//! the right locks on the tensors they read and write.
//!
//! Everything here runs on the tensors' device stream; nothing is copied between host and device
//! (the step's tiles and row index went up once, with the mapping).
// The one place of the crate that launches kernels: every unsafe block says why it is sound.
#![allow(unsafe_code)]

use std::collections::HashMap;
use std::sync::{Arc, LazyLock, Mutex, MutexGuard};

use candle_core::backend::BackendStorage;
use candle_core::cuda::DeviceId;
use candle_core::cuda::cudarc::driver::{CudaFunction, CudaModule, CudaStream, PinnedHostSlice, SyncOnDrop};
use candle_core::cuda::cudarc::driver::{DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig, PushKernelArg};
use candle_core::cuda::cudarc::nvrtc::Ptx;
use candle_core::{CudaDevice, CudaStorage, DType, Layout, Storage, Tensor};
use multilora_kernels::params::{
    AddNormParams, BgmvExpandParams, BgmvShrinkParams, DecodeAttnParams, DecodeSplitParams, EmbedShrinkParams,
    ExpandParams, GreedyParams, KvWriteParams, RopeKvParams, ShrinkParams, SiluMulParams,
};
use multilora_kernels::{KernelDtype, Module};

use crate::ops::plan::Launch;

/// A parameter struct as a kernel argument: passed by value, as the kernels declare it.
#[repr(transparent)]
#[derive(Clone, Copy, Debug)]
pub(crate) struct KernelArg<P>(P);

// SAFETY: each is a `#[repr(C)]` struct of plain integers with no padding, laid out exactly as
// its twin in `params.h` (tests/layout.rs in multilora-kernels checks every offset), and every
// kernel takes it by value: the driver copies its bytes as the kernel's one parameter.
unsafe impl DeviceRepr for KernelArg<ShrinkParams> {}
// SAFETY: as above.
unsafe impl DeviceRepr for KernelArg<ExpandParams> {}
// SAFETY: as above.
unsafe impl DeviceRepr for KernelArg<EmbedShrinkParams> {}
// SAFETY: as above.
unsafe impl DeviceRepr for KernelArg<DecodeAttnParams> {}
// SAFETY: as above.
unsafe impl DeviceRepr for KernelArg<KvWriteParams> {}
// SAFETY: as above.
unsafe impl DeviceRepr for KernelArg<BgmvShrinkParams> {}
// SAFETY: as above.
unsafe impl DeviceRepr for KernelArg<BgmvExpandParams> {}
// SAFETY: as above.
unsafe impl DeviceRepr for KernelArg<DecodeSplitParams> {}
// SAFETY: as above.
unsafe impl DeviceRepr for KernelArg<RopeKvParams> {}
// SAFETY: as above.
unsafe impl DeviceRepr for KernelArg<AddNormParams> {}
// SAFETY: as above.
unsafe impl DeviceRepr for KernelArg<SiluMulParams> {}
// SAFETY: as above.
unsafe impl DeviceRepr for KernelArg<GreedyParams> {}

/// `len` values of `dtype` on `dev`, not zeroed: for a kernel output whose every element read is
/// written by the kernel first (the BGMV shrink writes all of it; the segmented shrink of the
/// fused path writes each row's columns below its rank, all the expand reads; the decode
/// attention writes every head of every sequence, and its split kernel every partition result
/// the reduce reads); their emulated tests check it on a buffer filled with NaN.
pub(crate) fn alloc_written(dev: &CudaDevice, len: usize, dtype: DType) -> candle_core::Result<CudaStorage> {
    use candle_core::backend::BackendDevice;
    // SAFETY: device memory, never read on the host; the launch that follows writes every
    // element anything reads before it is read (see above), and the float dtypes the kernels
    // use have no invalid bit patterns.
    unsafe { dev.alloc_uninit(&candle_core::Shape::from(len), dtype) }
}

/// Makes the kept page-locked host buffer `buf` hold at least `n` values: kept when it does, else
/// freed first (two are never held at once) and replaced by one of the next power of two, at
/// least `min`, allocated with `flags` (`CU_MEMHOSTALLOC_*`). The step's uploader and the logits'
/// reader each keep one this way.
///
/// # Safety
/// The buffer's values start uninitialized: `T` must be valid for any bit pattern, and the caller
/// reads only what it wrote or copied in; no copy into or out of the old buffer may still be in
/// flight.
pub(crate) unsafe fn kept_pinned<'a, T: DeviceRepr>(
    buf: &'a mut Option<PinnedHostSlice<T>>,
    n: usize,
    min: usize,
    flags: u32,
    stream: &CudaStream,
) -> candle_core::Result<&'a mut PinnedHostSlice<T>> {
    if buf.as_ref().is_none_or(|b| b.len() < n) {
        *buf = None;
        // SAFETY: forwarded from the caller.
        let fresh = unsafe { stream.context().alloc_pinned_with_flags::<T>(n.next_power_of_two().max(min), flags) };
        *buf = Some(fresh.map_err(candle_core::Error::wrap)?);
    }
    let Some(b) = buf.as_mut() else { unreachable!("allocated above") };
    Ok(b)
}

/// Readies `device`'s context for multilora's work (a CPU device is left alone):
/// - turns off cudarc's per-allocation event tracking: every tensor allocated afterwards skips the
///   `cuEventCreate` pair of its allocation and the `cuStreamWaitEvent` + `cuEventRecord` of each
///   use, which only order work between streams. multilora runs all of a device's work on
///   candle's one stream of that device (the kernels here launch on it, candle's ops and cuBLAS
///   use it), so the stream alone orders every use;
/// - keeps freed memory in the device's pool (its release threshold set to the most): with the
///   default of 0 every synchronisation hands the pool's free memory back to the driver, and the
///   next step's allocations take the slow path again. The memory stays the process's, as with
///   vLLM's and PyTorch's caching allocators.
pub fn prepare_cuda_device(device: &candle_core::Device) -> candle_core::Result<()> {
    use candle_core::cuda::cudarc::driver::{result, sys};
    let candle_core::Device::Cuda(d) = device else { return Ok(()) };
    let stream = d.cuda_stream();
    let ctx = stream.context();
    // SAFETY: cudarc's conditions are that no slice is used on a second stream before its
    // allocation or last use on the first is done, and none is freed while another stream
    // still uses it; every slice of this device is only ever used on its one stream.
    unsafe { ctx.disable_event_tracking() };
    if !ctx.has_async_alloc() {
        return Ok(());
    }
    let mut threshold = u64::MAX;
    // SAFETY: the device is the context's own; the pool is the one `cuMemAllocAsync` on its
    // streams draws from, and the release threshold's value is a `u64` (cuMemPoolSetAttribute).
    unsafe {
        ctx.bind_to_thread().map_err(|e| candle_core::Error::Cuda(Box::new(e)))?;
        let pool = result::device::get_mem_pool(ctx.cu_device()).map_err(|e| candle_core::Error::Cuda(Box::new(e)))?;
        result::mem_pool::set_attribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&mut threshold as *mut u64).cast(),
        )
        .map_err(|e| candle_core::Error::Cuda(Box::new(e)))
    }
}

/// The kernels' dtype for a candle dtype; other dtypes have no kernel.
pub(crate) fn kernel_dtype(d: DType) -> candle_core::Result<KernelDtype> {
    Ok(match d {
        DType::F32 => KernelDtype::F32,
        DType::BF16 => KernelDtype::Bf16,
        DType::F16 => KernelDtype::F16,
        other => candle_core::bail!("the multilora CUDA kernels take f32, bf16 or f16, not {other:?}"),
    })
}

/// `t` with its rows' elements adjacent (stride 1 along dimension 1), as the kernels read rows:
/// itself when they already are (rows may still be strided), else a contiguous copy.
pub(crate) fn row_major(t: &Tensor) -> candle_core::Result<Tensor> {
    if t.stride().get(1) == Some(&1) { Ok(t.clone()) } else { t.contiguous() }
}

/// The CUDA storage behind a locked tensor.
pub(crate) fn cuda_storage<'a>(what: &str, s: &'a Storage) -> candle_core::Result<&'a CudaStorage> {
    match s {
        Storage::Cuda(c) => Ok(c),
        _ => candle_core::bail!("{what}: expected a CUDA tensor"),
    }
}

/// The device address of the first element of `layout` in `s`, and the guard that records the
/// read on the stream once the launch is queued (keep it until then).
pub(crate) fn read_ptr<'a>(
    s: &'a CudaStorage,
    layout: &Layout,
    stream: &'a CudaStream,
) -> candle_core::Result<(u64, SyncOnDrop<'a>)> {
    let elem = s.dtype().size_in_bytes() as u64;
    let (ptr, guard) = match s.dtype() {
        DType::F32 => s.as_cuda_slice::<f32>()?.device_ptr(stream),
        DType::BF16 => s.as_cuda_slice::<half::bf16>()?.device_ptr(stream),
        DType::F16 => s.as_cuda_slice::<half::f16>()?.device_ptr(stream),
        DType::U32 => s.as_cuda_slice::<u32>()?.device_ptr(stream),
        other => candle_core::bail!("no kernel reads {other:?}"),
    };
    Ok((ptr + layout.start_offset() as u64 * elem, guard))
}

/// [`read_ptr`] for a tensor the kernel writes.
pub(crate) fn write_ptr<'a>(
    s: &'a mut CudaStorage,
    layout: &Layout,
    stream: &'a CudaStream,
) -> candle_core::Result<(u64, SyncOnDrop<'a>)> {
    let elem = s.dtype().size_in_bytes() as u64;
    let (ptr, guard) = match s.dtype() {
        DType::F32 => s.as_cuda_slice_mut::<f32>()?.device_ptr_mut(stream),
        DType::BF16 => s.as_cuda_slice_mut::<half::bf16>()?.device_ptr_mut(stream),
        DType::F16 => s.as_cuda_slice_mut::<half::f16>()?.device_ptr_mut(stream),
        DType::U32 => s.as_cuda_slice_mut::<u32>()?.device_ptr_mut(stream),
        other => candle_core::bail!("no kernel writes {other:?}"),
    };
    Ok((ptr + layout.start_offset() as u64 * elem, guard))
}

/// Read locks on tensors a kernel reads besides the op's own operands, held for the launch.
pub(crate) struct Locked<'t> {
    guards: Vec<(candle_core::StorageRef<'t>, &'t Layout)>,
}

impl<'t> Locked<'t> {
    pub(crate) fn new(tensors: &[&'t Tensor]) -> Locked<'t> {
        Locked { guards: tensors.iter().map(|t| t.storage_and_layout()).collect() }
    }

    /// Device addresses of every locked tensor, in order, with their guards.
    pub(crate) fn ptrs<'a>(&'a self, stream: &'a CudaStream) -> candle_core::Result<(Vec<u64>, Vec<SyncOnDrop<'a>>)> {
        let mut ptrs = Vec::with_capacity(self.guards.len());
        let mut syncs = Vec::with_capacity(self.guards.len());
        for (s, l) in &self.guards {
            let (p, g) = read_ptr(cuda_storage("kernel operand", s)?, l, stream)?;
            ptrs.push(p);
            syncs.push(g);
        }
        Ok((ptrs, syncs))
    }
}

/// Our kernels as loaded on each device: a module once from its fatbin (the GPU's own SASS where
/// the fatbin has it, so nothing is compiled on first use), a function looked up once by name.
#[derive(Default)]
struct Loaded {
    modules: HashMap<Module, Arc<CudaModule>>,
    functions: HashMap<String, CudaFunction>,
}

/// [`Loaded`] per device (candle's `DeviceId`, unique for the process). Process-wide: a device's
/// modules, and with them its context, stay loaded until the process ends, as the engine keeps
/// its one device for its whole life (candle's own per-device modules go with the device).
static LOADED: LazyLock<Mutex<HashMap<DeviceId, Loaded>>> = LazyLock::new(Default::default);

/// The cache, locked. A panic while it was held left at worst a module or function not yet
/// inserted: its contents are still right.
fn loaded() -> MutexGuard<'static, HashMap<DeviceId, Loaded>> {
    LOADED.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// `module` loaded on `dev`: from the cache, or now from its fatbin.
fn module(dev: &CudaDevice, loaded: &mut Loaded, module: Module) -> candle_core::Result<Arc<CudaModule>> {
    if let Some(m) = loaded.modules.get(&module) {
        return Ok(m.clone());
    }
    let ctx = dev.cuda_stream().context().clone();
    let m = ctx
        .load_module(Ptx::from_binary(module.fatbin().to_vec()))
        .map_err(|e| candle_core::Error::Msg(format!("loading {} from its fatbin: {e}", module.name())))?;
    loaded.modules.insert(module, m.clone());
    Ok(m)
}

/// One module of ours as [`load_kernel_modules`] loaded it.
#[derive(Clone, Debug)]
pub struct ModuleLoad {
    /// The module's name (`multilora_lora_bgmv`).
    pub module: &'static str,
    /// Seconds the load took.
    pub seconds: f64,
    /// What the driver loaded: `sm_90a SASS, as it is`, or the PTX it compiled for a GPU the
    /// fatbin has no SASS for.
    pub code: String,
}

/// Loads every module of ours on `dev` (a warm-up: later launches find them loaded), timing
/// each and saying whether the GPU ran one of the fatbin's SASS entries as it is.
pub fn load_kernel_modules(dev: &CudaDevice) -> candle_core::Result<Vec<ModuleLoad>> {
    let ctx = dev.cuda_stream().context().clone();
    let (major, minor) = ctx.compute_capability().map_err(|e| candle_core::Error::Cuda(Box::new(e)))?;
    let (major, minor) = (u32::try_from(major).unwrap_or(0), u32::try_from(minor).unwrap_or(0));
    let mut all = loaded();
    let loaded = all.entry(dev.id()).or_default();
    let mut out = Vec::with_capacity(Module::ALL.len());
    for m in Module::ALL {
        let entries = multilora_kernels::fatbin::entries(m.fatbin()).map_err(candle_core::Error::wrap)?;
        let code = match entries.iter().find(|e| e.runs_as_is_on(major, minor)) {
            Some(e) => format!("{} SASS, as it is", e.arch),
            None => format!(
                "no SASS for compute capability {major}.{minor}: the driver compiled the {} PTX",
                multilora_kernels::fatbins::PTX
            ),
        };
        let t = std::time::Instant::now();
        module(dev, loaded, m)?;
        out.push(ModuleLoad { module: m.name(), seconds: t.elapsed().as_secs_f64(), code });
    }
    Ok(out)
}

/// Every module of ours as `(name, fatbin)`: what the device replay loads without candle
/// (`multilora-device-check --write-fatbins`).
pub fn kernel_fatbins() -> Vec<(&'static str, &'static [u8])> {
    Module::ALL.into_iter().map(|m| (m.name(), m.fatbin())).collect()
}

/// The function `name` of `module` on `dev`.
fn function(dev: &CudaDevice, module_: Module, name: &str) -> candle_core::Result<CudaFunction> {
    let mut all = loaded();
    let loaded = all.entry(dev.id()).or_default();
    if let Some(f) = loaded.functions.get(name) {
        return Ok(f.clone());
    }
    let f = module(dev, loaded, module_)?
        .load_function(name)
        .map_err(|e| candle_core::Error::Msg(format!("{name} in {}: {e}", module_.name())))?;
    loaded.functions.insert(name.to_string(), f.clone());
    Ok(f)
}

/// Launches `name` of `module` on `dev`'s stream.
pub(crate) fn launch<P: Copy>(dev: &CudaDevice, module: Module, name: &str, l: &Launch<P>) -> candle_core::Result<()>
where
    KernelArg<P>: DeviceRepr,
{
    if l.grid.contains(&0) {
        return Ok(());
    }
    let func = function(dev, module, name)?;
    let arg = KernelArg(l.params);
    let cfg = LaunchConfig {
        grid_dim: (l.grid[0], l.grid[1], l.grid[2]),
        block_dim: (l.block[0], l.block[1], l.block[2]),
        shared_mem_bytes: 0,
    };
    let stream = dev.cuda_stream();
    let mut builder = stream.launch_builder(&func);
    builder.arg(&arg);
    // SAFETY: the kernel's one parameter is this struct by value (see `KernelArg`); every
    // pointer in it was taken from a tensor whose lock and stream guard the caller holds until
    // after this call, and the plan sized the grid so that no block reads or writes outside
    // those tensors (the tests compare every kernel with the slow reference, and the emulator
    // runs the same launches on the CPU).
    unsafe { builder.launch(cfg) }.map_err(|e| candle_core::Error::Cuda(Box::new(e)))?;
    Ok(())
}
