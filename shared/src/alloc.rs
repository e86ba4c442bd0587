//! The process-wide allocator of every binary that links this crate: jemalloc with transparent
//! huge pages.
//!
//! Why: a training or scoring step allocates a few large buffers (`[N, V]` logits, their
//! log-softmax and gradients: hundreds of MB with a 151k vocabulary) and frees them again. glibc
//! unmaps every allocation over 32 MB and jemalloc zeroes recycled memory with
//! `madvise(DONTNEED)`, so each step page-faults those buffers back in 4 KiB at a time. With
//! `thp:always` jemalloc backs them with 2 MiB pages and zeroes by `memset`: on the demo teacher's
//! SFT step (hidden 64, Qwen3 vocabulary, 16 sequences) minor page faults fell from ~430k to
//! ~4k per step and the step from 1.6 s to 0.5 s on 2 cores (bench/README.md).

#[cfg(not(target_env = "msvc"))]
#[global_allocator]
static GLOBAL: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// jemalloc's compile-time options (read before `main`; `_RJEM_MALLOC_CONF` in the environment
/// still overrides them).
#[cfg(not(target_env = "msvc"))]
#[allow(non_upper_case_globals)]
#[export_name = "_rjem_malloc_conf"]
pub static malloc_conf: Option<&'static std::ffi::c_char> =
    // SAFETY: a NUL-terminated static string, as jemalloc expects.
    Some(unsafe { &*c"thp:always".as_ptr() });
