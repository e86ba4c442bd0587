//! Named phases of GPU work for profilers: the teacher's forward, head, top-k and copy; the
//! trainer's forward, head + loss, backward, accumulation, clipping, collectives and update.
//! [`region`] opens one for as long as its guard lives, and on a CUDA device
//! - pushes an NVTX range of the phase's name (Nsight Systems' timeline, `ncu --nvtx`), where a
//!   profiler has injected NVTX (`NVTX_INJECTION64_PATH` set, as nsys and ncu do) and NVIDIA's
//!   NVTX library loads (`libnvtx3interop.so.1` from the `nvidia-nvtx` wheel PyTorch brings, or
//!   `libnvToolsExt.so.1`); `XDISTILL_NVTX=on` loads it without the variable;
//! - with `XDISTILL_PHASE_MARKS=on`, launches an empty kernel named for the phase
//!   (`xd_phase_forward`, …; `kernels/cuda/src/phase_mark.cu`) when the region opens and the
//!   enclosing region's (or `xd_phase_none`) when it closes, so that a per-launch log, which
//!   lists launches in order, can be cut by phase (`bench/ncu_kernels.py --phases`).
//!
//! Neither is on by default: a region then reads two switches (each read from the environment
//! once). Regions nest (the per-layer accumulation inside the backward); each thread keeps its
//! own stack.

use candle_core::Device;
use std::cell::RefCell;

/// A phase of the teacher's or the trainer's GPU work.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// The decoder's forward (the teacher's batch, the student's training forward).
    Forward,
    /// The student's LM head and loss in row chunks, each chunk's backward included.
    HeadLoss,
    /// The student's backward through the decoder.
    Backward,
    /// Gradients summed into the step's f32 sums.
    Accumulate,
    /// The gradients' global norm.
    Clip,
    /// The AdamW update (and the compute copies' refresh).
    Optimizer,
    /// A data-parallel collective.
    Collective,
    /// The teacher's LM head.
    Head,
    /// The teacher's log-softmax statistics and top-k.
    Topk,
    /// The teacher's answers copied to the host.
    Copy,
}

impl Phase {
    /// Every phase, in `phase_mark.cu`'s order (its test compares the two).
    pub const ALL: [Phase; 10] = [
        Phase::Forward,
        Phase::HeadLoss,
        Phase::Backward,
        Phase::Accumulate,
        Phase::Clip,
        Phase::Optimizer,
        Phase::Collective,
        Phase::Head,
        Phase::Topk,
        Phase::Copy,
    ];

    /// The phase's name: its NVTX range, and its mark kernel's `xd_phase_{name}`.
    pub fn name(self) -> &'static str {
        self.c_name().to_str().unwrap_or("phase")
    }

    fn c_name(self) -> &'static std::ffi::CStr {
        match self {
            Phase::Forward => c"forward",
            Phase::HeadLoss => c"head_loss",
            Phase::Backward => c"backward",
            Phase::Accumulate => c"accumulate",
            Phase::Clip => c"clip",
            Phase::Optimizer => c"optimizer",
            Phase::Collective => c"collective",
            Phase::Head => c"head",
            Phase::Topk => c"topk",
            Phase::Copy => c"copy",
        }
    }
}

thread_local! {
    /// The regions open on this thread, innermost last.
    static OPEN: RefCell<Vec<Phase>> = const { RefCell::new(Vec::new()) };
}

/// An open region; closes when dropped.
#[must_use = "the region closes when the guard is dropped"]
pub struct Region {
    /// The device whose stream takes the marks; `None` where nothing was pushed.
    device: Option<Device>,
}

/// Opens `phase` on `device` until the returned guard drops (see the module).
pub fn region(device: &Device, phase: Phase) -> Region {
    if !device.is_cuda() || !annotating() {
        return Region { device: None };
    }
    enter(phase);
    nvtx::push(phase.c_name());
    mark(device, Some(phase));
    Region {
        device: Some(device.clone()),
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        let Some(device) = self.device.take() else {
            return;
        };
        let outer = leave();
        nvtx::pop();
        mark(&device, outer);
    }
}

/// Records `phase` as this thread's innermost open region.
fn enter(phase: Phase) {
    OPEN.with(|o| o.borrow_mut().push(phase));
}

/// Closes this thread's innermost region; returns the region the work is in again (the next
/// one out), whose mark follows.
fn leave() -> Option<Phase> {
    OPEN.with(|o| {
        let mut o = o.borrow_mut();
        o.pop();
        o.last().copied()
    })
}

/// Whether regions do anything: marks on, or NVTX loaded.
fn annotating() -> bool {
    phase_marks() || nvtx::loaded()
}

/// `XDISTILL_PHASE_MARKS=on|off` (default off), read once.
pub fn phase_marks() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| {
        let value = std::env::var("XDISTILL_PHASE_MARKS").ok();
        crate::device::on_or_off(value.as_deref(), false).unwrap_or_else(|why| {
            tracing::warn!("XDISTILL_PHASE_MARKS: {why}; using off");
            false
        }) && cfg!(feature = "cuda")
    })
}

/// Launches the mark of `phase` (`None`: outside any phase) on `device`, where marks are on; a
/// failure is logged once and marks stop (a profiling aid never fails the work).
fn mark(device: &Device, phase: Option<Phase>) {
    if !phase_marks() {
        return;
    }
    #[cfg(feature = "cuda")]
    if let Device::Cuda(dev) = device {
        use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
        static FAILED: AtomicBool = AtomicBool::new(false);
        if FAILED.load(Relaxed) {
            return;
        }
        let name = phase.map_or("none", Phase::name);
        if let Err(e) = xdistill_cuda_kernels::phase_mark(dev, name) {
            FAILED.store(true, Relaxed);
            tracing::warn!("phase mark {name}: {e}; no more phase marks");
        }
    }
    let _ = (device, phase);
}

/// NVTX ranges through NVIDIA's library, loaded once where a profiler asks for them.
mod nvtx {
    use std::ffi::CStr;

    #[cfg(feature = "cuda")]
    mod lib {
        use std::ffi::{c_char, c_int};
        use std::sync::OnceLock;

        pub struct Nvtx {
            pub push: unsafe extern "C" fn(*const c_char) -> c_int,
            pub pop: unsafe extern "C" fn() -> c_int,
            /// Kept loaded for the process's life (the two functions point into it).
            _lib: libloading::Library,
        }

        /// NVIDIA's NVTX library, where a profiler injected NVTX (or `XDISTILL_NVTX=on`).
        pub fn get() -> Option<&'static Nvtx> {
            static NVTX: OnceLock<Option<Nvtx>> = OnceLock::new();
            NVTX.get_or_init(|| {
                let asked = std::env::var("XDISTILL_NVTX").is_ok_and(|v| v == "on");
                if !asked && std::env::var_os("NVTX_INJECTION64_PATH").is_none() {
                    return None;
                }
                let names = ["libnvtx3interop.so.1", "libnvToolsExt.so.1"];
                let found = names.iter().find_map(|name| load(name));
                if found.is_none() {
                    tracing::info!(
                        "NVTX: neither {} loads (the nvidia-nvtx wheel's lib/ on \
                         LD_LIBRARY_PATH): no NVTX ranges",
                        names.join(" nor ")
                    );
                }
                found
            })
            .as_ref()
        }

        fn load(name: &str) -> Option<Nvtx> {
            // SAFETY: NVIDIA's NVTX library, whose initialisers only read the environment; the
            // two symbols have the C signatures of nvToolsExt.h's nvtxRangePushA and
            // nvtxRangePop.
            unsafe {
                let lib = libloading::Library::new(name).ok()?;
                let push = *lib
                    .get::<unsafe extern "C" fn(*const c_char) -> c_int>(b"nvtxRangePushA\0")
                    .ok()?;
                let pop = *lib
                    .get::<unsafe extern "C" fn() -> c_int>(b"nvtxRangePop\0")
                    .ok()?;
                Some(Nvtx {
                    push,
                    pop,
                    _lib: lib,
                })
            }
        }
    }

    pub fn loaded() -> bool {
        #[cfg(feature = "cuda")]
        return lib::get().is_some();
        #[cfg(not(feature = "cuda"))]
        false
    }

    pub fn push(name: &CStr) {
        #[cfg(feature = "cuda")]
        if let Some(n) = lib::get() {
            // SAFETY: a NUL-terminated static string; NVTX copies what it keeps.
            unsafe {
                (n.push)(name.as_ptr());
            }
        }
        let _ = name;
    }

    pub fn pop() {
        #[cfg(feature = "cuda")]
        if let Some(n) = lib::get() {
            // SAFETY: pops the range this thread pushed last (regions are scoped guards).
            unsafe {
                (n.pop)();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn phases_are_named_as_their_mark_kernels() {
        // phase_mark.cu has one kernel per name, and `none`.
        let cu = include_str!("../../kernels/cuda/src/phase_mark.cu");
        let marks: Vec<&str> = cu
            .lines()
            .filter_map(|l| l.strip_prefix("MARK(")?.strip_suffix(')'))
            .collect();
        let mut names: Vec<&str> = Phase::ALL.iter().map(|p| p.name()).collect();
        names.insert(0, "none");
        assert_eq!(marks, names);
    }

    #[test]
    fn closing_a_nested_region_returns_to_the_enclosing_one() {
        enter(Phase::Backward);
        enter(Phase::Accumulate);
        assert_eq!(leave(), Some(Phase::Backward));
        enter(Phase::Accumulate);
        assert_eq!(leave(), Some(Phase::Backward));
        assert_eq!(leave(), None);
        // Each thread its own stack.
        enter(Phase::Forward);
        std::thread::spawn(|| {
            enter(Phase::Clip);
            assert_eq!(leave(), None);
        })
        .join()
        .unwrap();
        assert_eq!(leave(), None);
    }

    #[test]
    fn regions_on_the_cpu_do_nothing() {
        let _r = region(&Device::Cpu, Phase::Backward);
        enter(Phase::Head);
        // The CPU region pushed nothing: the innermost is the one entered by hand.
        assert_eq!(leave(), None);
    }
}
