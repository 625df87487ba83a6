//! The instruction sets the kernels run on: one enum ([`Isa`]), one detection
//! ([`Isa::available`]), one cap ([`Isa::set_max`]), and the marker types the SIMD traits are
//! implemented on.
//!
//! Every kernel of the crate takes an `Isa` and dispatches on it once, at its entry point, to a
//! `#[target_feature]` function; a set the CPU lacks runs the portable code instead, so no
//! `#[target_feature]` code is reached without [`Isa::available`] having said yes. Each family
//! maps the enum to the kernels it has: the float family ([`crate::float`]) has portable, AVX2
//! and AVX-512F kernels (the VNNI and AMX sets run the AVX2 or AVX-512F one), the quantized family
//! ([`crate::quant`]) portable, AVX2, AVX-VNNI, AVX-512 VNNI and AMX ones (plain AVX-512F runs
//! AVX-VNNI where the CPU has it, else AVX2). AMX needs the operating system's leave as well as
//! the CPU's: Linux hands the tile state out only to a process that asks for it
//! (`arch_prctl(ARCH_REQ_XCOMP_PERM)`), which [`Isa::available`] does once; where the answer is
//! no (another OS, an old kernel, a hypervisor that hides the state), AMX is not available and
//! the AVX-512 VNNI kernels run. [`Isa::FLOAT`] and [`Isa::QUANT`] list each
//! family's distinct kernels, for tests and benchmarks that run every one.
//!
//! **Written once over a trait, or per set.** A kernel whose inner loop is the same sequence of
//! vector operations on every set (a register tile of FMAs, a block's integer dot products) is
//! written once, generic over the family's trait, and the trait's methods are the set's
//! intrinsics: `FloatSimd` (f32 vectors: load, widen bf16/f16, FMA, horizontal sum) for the float
//! products and the LoRA kernel, `DotSimd` (weight bytes × activation bytes into i32 lanes, then
//! f32) for the quantized tiles; both are implemented on the marker types below, so "the AVX-512
//! code" of either family is the `impl` for the `Avx512` marker. A kernel whose best form differs
//! in shape between sets (attention rows, activation quantization: other shuffles, other widths)
//! is written per set as free `#[target_feature]` functions beside a portable one, in the
//! kernel's own file. A kernel the compiler vectorises well from plain Rust (exp, softmax, norm
//! rows, logits passes) is written once in portable Rust and compiled per set by the
//! `dispatched!` macro of [`crate::float`]. The quantized products and the passes written once
//! give the same bits on every set (the same IEEE operations in the same order); the float
//! products sum in their set's lane width, so two sets agree to rounding, and a row's result
//! never depends on the other rows of its batch.

use std::sync::atomic::{AtomicU8, Ordering};

/// An instruction set, declared narrowest first (the order [`Isa::set_max`]'s cap compares in).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Isa {
    /// Plain Rust, vectorised by the compiler for the build target; runs everywhere.
    Portable,
    /// x86-64 AVX2 with FMA and F16C (Zen 3, Haswell and later): 8 f32 lanes, `vpmaddubsw`.
    Avx2,
    /// AVX2 plus AVX-VNNI (256-bit `vpdpbusd`: Alder Lake, Zen 5, Sapphire Rapids).
    AvxVnni,
    /// x86-64 AVX-512F (with the AVX2 set): 16 f32 lanes.
    Avx512,
    /// AVX-512 F, BW, VL and VNNI (512-bit `vpdpbusd`: Ice Lake, Sapphire Rapids, Zen 4).
    Avx512Vnni,
    /// AVX-512 VNNI plus AMX-TILE and AMX-INT8 (Sapphire Rapids and later Xeons), with the
    /// operating system's leave to use the tile state: the quantized products of many rows on the
    /// tile unit (`tdpbsud`), the rest as AVX-512 VNNI.
    Amx,
}

/// The widest set [`Isa::best`] picks ([`Isa::set_max`]), as an `Isa` in the enum's order.
static MAX_ISA: AtomicU8 = AtomicU8::new(Isa::Amx as u8);

impl Isa {
    /// Every set, narrowest first.
    pub const ALL: [Isa; 6] = [Isa::Portable, Isa::Avx2, Isa::AvxVnni, Isa::Avx512, Isa::Avx512Vnni, Isa::Amx];
    /// The float family's distinct kernels.
    pub const FLOAT: [Isa; 3] = [Isa::Portable, Isa::Avx2, Isa::Avx512];
    /// The quantized family's distinct kernels.
    pub const QUANT: [Isa; 5] = [Isa::Portable, Isa::Avx2, Isa::AvxVnni, Isa::Avx512Vnni, Isa::Amx];

    /// The widest set this CPU has, within [`Isa::set_max`]'s cap.
    pub fn best() -> Isa {
        Isa::ALL.into_iter().rev().find(|&i| i.available() && i.allowed()).unwrap_or(Isa::Portable)
    }

    /// Caps the sets [`Isa::best`] picks from here on, for this process: every CPU kernel's
    /// choice, e.g. to measure on an AVX-512 machine what an AVX2-only CPU such as Zen 3 runs
    /// (as PyTorch's `ATEN_CPU_CAPABILITY`). Kernels called with an explicit set (tests,
    /// benchmarks) are not affected.
    pub fn set_max(max: Isa) {
        MAX_ISA.store(max as u8, Ordering::Relaxed);
    }

    /// The cap [`Isa::set_max`] set.
    pub fn max() -> Isa {
        Isa::ALL.into_iter().rfind(|i| i.allowed()).unwrap_or(Isa::Portable)
    }

    /// Whether the cap lets [`Isa::best`] pick `self`.
    fn allowed(self) -> bool {
        self as u8 <= MAX_ISA.load(Ordering::Relaxed)
    }

    /// Whether this CPU can run it (the one detection of the crate).
    pub fn available(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            let avx2 = || has!("avx2") && has!("fma") && has!("f16c");
            let vnni512 = || avx2() && has!("avx512f") && has!("avx512bw") && has!("avx512vl") && has!("avx512vnni");
            match self {
                Isa::Portable => true,
                Isa::Avx2 => avx2(),
                Isa::AvxVnni => avx2() && has!("avxvnni"),
                Isa::Avx512 => avx2() && has!("avx512f"),
                Isa::Avx512Vnni => vnni512(),
                Isa::Amx => vnni512() && crate::quant::amx_granted(),
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            self == Isa::Portable
        }
    }

    /// The sets of `family` ([`Isa::FLOAT`], [`Isa::QUANT`], [`Isa::ALL`]) this CPU can run,
    /// the portable one first.
    pub fn available_of(family: &[Isa]) -> Vec<Isa> {
        family.iter().copied().filter(|i| i.available()).collect()
    }

    /// `self`, or the portable set when this CPU lacks it.
    pub(crate) fn or_portable(self) -> Isa {
        if self.available() { self } else { Isa::Portable }
    }

    /// The float family's kernel for `self`: portable, AVX2 or AVX-512F.
    pub(crate) fn float(self) -> Isa {
        match self.or_portable() {
            Isa::Avx512 | Isa::Avx512Vnni | Isa::Amx => Isa::Avx512,
            Isa::Avx2 | Isa::AvxVnni => Isa::Avx2,
            Isa::Portable => Isa::Portable,
        }
    }

    /// The quantized family's kernel for `self`: portable, AVX2, AVX-VNNI or AVX-512 VNNI.
    pub(crate) fn quant(self) -> Isa {
        match self.or_portable() {
            Isa::Avx512 if Isa::AvxVnni.available() => Isa::AvxVnni,
            Isa::Avx512 => Isa::Avx2,
            other => other,
        }
    }

    /// The set of that name (`amx`, `avx512-vnni`, `avx512`, `avx-vnni`, `avx2`, `portable`, as
    /// [`Isa::name`] spells them: the benches' `MULTILORA_BENCH_ISA`), `None` for any other word.
    pub fn from_name(name: &str) -> Option<Isa> {
        Isa::ALL.into_iter().find(|i| i.name() == name)
    }

    /// The set's name in environment variables.
    pub fn name(self) -> &'static str {
        match self {
            Isa::Portable => "portable",
            Isa::Avx2 => "avx2",
            Isa::AvxVnni => "avx-vnni",
            Isa::Avx512 => "avx512",
            Isa::Avx512Vnni => "avx512-vnni",
            Isa::Amx => "amx",
        }
    }

    /// How the start-up log names it.
    pub fn describe(self) -> &'static str {
        match self {
            Isa::Portable => "portable",
            Isa::Avx2 => "AVX2",
            Isa::AvxVnni => "AVX-VNNI",
            Isa::Avx512 => "AVX-512F",
            Isa::Avx512Vnni => "AVX-512 VNNI",
            Isa::Amx => "AMX-INT8",
        }
    }
}

impl std::fmt::Display for Isa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.describe())
    }
}

/// The portable set's marker: plain arrays the compiler vectorises.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Portable;

/// The 256-bit sets' marker, with or without AVX-VNNI.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Avx256<const VNNI: bool>;

/// AVX2 + FMA + F16C.
pub(crate) type Avx2 = Avx256<false>;

/// AVX2 + AVX-VNNI.
pub(crate) type AvxVnni = Avx256<true>;

/// The 512-bit sets' marker: AVX-512F, or with BW, VL and VNNI.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Avx512<const VNNI: bool>;

/// AVX-512F.
pub(crate) type Avx512F = Avx512<false>;

/// AVX-512 F, BW, VL and VNNI.
pub(crate) type Avx512Vnni = Avx512<true>;
