//! The allocator of the workspace's binaries: jemalloc with transparent huge pages. Each binary
//! (the `teacher`, the `trainer`, the examples) installs it in its own crate root with
//! [`global_allocator!`](crate::global_allocator); linking this library installs nothing, so a
//! crate that uses it as a library keeps its own allocator.
//!
//! Why: a training or scoring step allocates a few large buffers (`[N, V]` logits, their
//! log-softmax and gradients: hundreds of MB with a 151k vocabulary) and frees them again. glibc
//! unmaps every allocation over 32 MB and jemalloc zeroes recycled memory with
//! `madvise(DONTNEED)`, so each step page-faults those buffers back in 4 KiB at a time. With
//! `thp:always` jemalloc backs them with 2 MiB pages and zeroes by `memset`: on the demo teacher's
//! SFT step (hidden 64, Qwen3 vocabulary, 16 sequences) minor page faults fell from ~430k to
//! ~4k per step and the step from 1.6 s to 0.5 s on 2 cores (bench/README.md).
//!
//! Two sets of options: [`MALLOC_CONF`] for the teacher (a long-lived server whose requests
//! vary: freed memory goes back to the system) and [`RETAINING_MALLOC_CONF`] for the trainer and
//! the test processes (each step allocates and frees the same large buffers again: they are
//! kept for the next step instead of being purged and zeroed again by the kernel).

#[cfg(not(target_env = "msvc"))]
pub use tikv_jemallocator::Jemalloc;

/// jemalloc's compile-time options, for the `_rjem_malloc_conf` symbol that
/// [`global_allocator!`](crate::global_allocator) defines (read before `main`;
/// `_RJEM_MALLOC_CONF` in the environment still overrides them).
#[cfg(not(target_env = "msvc"))]
pub const MALLOC_CONF: &std::ffi::CStr = c"thp:always";

/// The trainer's options (and the test processes', which run trainer code): [`MALLOC_CONF`],
/// and freed pages are never returned to the system (no decay), with large allocations kept in
/// each thread's arena like the rest (`oversize_threshold:0`: no separate arena for those over
/// 8 MiB, which jemalloc purges at once). With decay, each step's `[N, V]` temporaries came back
/// as pages the kernel zeroes again, whatever the decay time (10 s by default; 60 s changed
/// nothing: a step frees gigabytes). On a 12-step CPU SFT run (Qwen3 vocabulary, hidden 64, 16
/// records a step, 2 cores; bench/README.md "Allocator"): 351k minor faults → 2.2k, system
/// time 32–42 s → 3–9 s, the run 51–58 s → 38–46 s, for a peak RSS of 2.2 GB instead of 1.3 GB
/// (the largest step's temporaries held; 2.6 GB with the separate arena). The environment's
/// `_RJEM_MALLOC_CONF` is read after these and overrides the options it names:
/// `oversize_threshold:8388608,dirty_decay_ms:10000,muzzy_decay_ms:0` returns freed memory as
/// the teacher does.
///
/// And any kept extent may serve any request (`lg_extent_max_active_fit:30`; jemalloc's
/// default, 6, takes a freed extent only for requests of at least 1/64 of its size). With the
/// default the kept memory grew with every step, as if each step's large buffers found the
/// kept extents cut up by smaller requests and came from fresh pages: `trainer sft` with a
/// Llama-2-vocabulary student of hidden 512 and 4 layers, 16 records a step, held 3.9 GB after
/// 8 steps and 9.5 GB after 24; with this option 1.8 GB after both, and the run was faster
/// (bench/README.md "Allocator"; `tests/tests/allocator.rs` keeps it true).
#[cfg(not(target_env = "msvc"))]
pub const RETAINING_MALLOC_CONF: &std::ffi::CStr =
    c"thp:always,oversize_threshold:0,dirty_decay_ms:-1,muzzy_decay_ms:-1,lg_extent_max_active_fit:30";

/// Installs jemalloc ([`Jemalloc`]) with [`MALLOC_CONF`] (or the options given, e.g.
/// [`RETAINING_MALLOC_CONF`]) as the global allocator of the binary whose crate root invokes it
/// (once, at the top level).
#[macro_export]
macro_rules! global_allocator {
    () => {
        $crate::global_allocator!($crate::alloc::MALLOC_CONF);
    };
    ($conf:expr) => {
        #[cfg(not(target_env = "msvc"))]
        #[global_allocator]
        static GLOBAL: $crate::alloc::Jemalloc = $crate::alloc::Jemalloc;

        /// jemalloc's compile-time options.
        #[cfg(not(target_env = "msvc"))]
        #[allow(non_upper_case_globals)]
        #[export_name = "_rjem_malloc_conf"]
        pub static malloc_conf: Option<&'static std::ffi::c_char> =
            // SAFETY: a NUL-terminated static string, as jemalloc expects.
            Some(unsafe { &*$conf.as_ptr() });
    };
}
