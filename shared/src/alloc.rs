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

#[cfg(not(target_env = "msvc"))]
pub use tikv_jemallocator::Jemalloc;

/// jemalloc's compile-time options, for the `_rjem_malloc_conf` symbol that
/// [`global_allocator!`](crate::global_allocator) defines (read before `main`;
/// `_RJEM_MALLOC_CONF` in the environment still overrides them).
#[cfg(not(target_env = "msvc"))]
pub const MALLOC_CONF: &std::ffi::CStr = c"thp:always";

/// [`MALLOC_CONF`] for short-lived test processes: freed pages are never returned to the OS
/// (no decay), so a test's many `[N, V]` temporaries reuse memory instead of page-faulting it
/// back. jemalloc puts allocations over 8 MiB in an arena that purges at once, so with the
/// binaries' options every such buffer is zeroed by the kernel again (2 MiB huge pages); on
/// the cross-process tests (2 cores) this cut system time from 115 s to 76 s and the run from
/// 223 s to 203 s, for a higher peak RSS (1.7 → 2.7 GB on the longest test), which ends with
/// the process (bench/README.md, "Allocator").
#[cfg(not(target_env = "msvc"))]
pub const TEST_MALLOC_CONF: &std::ffi::CStr = c"thp:always,dirty_decay_ms:-1,muzzy_decay_ms:-1";

/// Installs jemalloc ([`Jemalloc`]) with [`MALLOC_CONF`] (or the options given, e.g.
/// [`TEST_MALLOC_CONF`]) as the global allocator of the binary whose crate root invokes it
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
