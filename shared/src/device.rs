//! `--device` and `--dtype` parsing with clear errors.

use candle_core::{DType, Device};

#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    #[error("unknown device {0:?}: expected auto, cpu, cuda or cuda:N")]
    Unknown(String),
    #[error(
        "device {0:?} needs a binary built with `--features cuda` (see scripts/build-cuda.sh)"
    )]
    NotCompiled(String),
    #[error("cannot open {device:?}: {message} (is an NVIDIA GPU and driver present?)")]
    Open { device: String, message: String },
    #[error("unknown dtype {0:?}: expected auto, f32, bf16 or f16")]
    DType(String),
}

/// `auto` resolved: `cuda` where this build has CUDA and the driver sees a GPU, else `cpu`;
/// any other name as given (trimmed). What `auto` means everywhere a device is named (the
/// teacher's `--device`, `policy.device`, bench-step and eval).
pub fn resolve_device(s: &str) -> String {
    let s = s.trim();
    if !s.eq_ignore_ascii_case("auto") {
        return s.to_string();
    }
    let name = if gpu_present() { "cuda" } else { "cpu" };
    tracing::debug!("device auto: {name}");
    name.to_string()
}

/// Whether this build has CUDA and the driver sees at least one GPU (no context is made).
pub fn gpu_present() -> bool {
    #[cfg(feature = "cuda")]
    {
        use candle_core::cuda_backend::cudarc::driver::CudaContext;
        CudaContext::device_count().is_ok_and(|n| n > 0)
    }
    #[cfg(not(feature = "cuda"))]
    false
}

/// Parses `auto` ([`resolve_device`]), `cpu`, `cuda` or `cuda:N` and opens the device.
pub fn parse_device(s: &str) -> Result<Device, DeviceError> {
    let resolved = resolve_device(s);
    let s = resolved.as_str();
    if s.eq_ignore_ascii_case("cpu") {
        return Ok(Device::Cpu);
    }
    let ordinal = if s.eq_ignore_ascii_case("cuda") {
        0
    } else if let Some(n) = s.strip_prefix("cuda:") {
        n.parse::<usize>()
            .map_err(|_| DeviceError::Unknown(s.to_string()))?
    } else {
        return Err(DeviceError::Unknown(s.to_string()));
    };
    if !candle_core::utils::cuda_is_available() {
        return Err(DeviceError::NotCompiled(s.to_string()));
    }
    Device::new_cuda(ordinal).map_err(|e| DeviceError::Open {
        device: s.to_string(),
        message: e.to_string(),
    })
}

pub fn parse_dtype(s: &str) -> Result<DType, DeviceError> {
    match s.trim().to_ascii_lowercase().as_str() {
        "f32" | "float32" => Ok(DType::F32),
        "bf16" | "bfloat16" => Ok(DType::BF16),
        "f16" | "float16" => Ok(DType::F16),
        other => Err(DeviceError::DType(other.to_string())),
    }
}

/// Parses a dtype name for `device`: `auto` is bf16 on a GPU (its tensor cores; f32 there is
/// about ten times slower) and f32 on the CPU (no bf16 kernels worth having); otherwise as
/// [`parse_dtype`].
pub fn dtype_for(s: &str, device: &Device) -> Result<DType, DeviceError> {
    if s.trim().eq_ignore_ascii_case("auto") {
        return Ok(if device.is_cpu() {
            DType::F32
        } else {
            DType::BF16
        });
    }
    parse_dtype(s)
}

/// Checks a dtype name without a device (`auto` or one [`parse_dtype`] reads).
pub fn check_dtype(s: &str) -> Result<(), DeviceError> {
    dtype_for(s, &Device::Cpu).map(|_| ())
}

/// Human-readable name of a device (`cpu`, `cuda:0`).
pub fn device_name(d: &Device) -> String {
    match d.location() {
        candle_core::DeviceLocation::Cpu => "cpu".into(),
        candle_core::DeviceLocation::Cuda { gpu_id } => format!("cuda:{gpu_id}"),
        candle_core::DeviceLocation::Metal { gpu_id } => format!("metal:{gpu_id}"),
    }
}

pub fn dtype_name(d: DType) -> &'static str {
    match d {
        DType::F32 => "f32",
        DType::BF16 => "bf16",
        DType::F16 => "f16",
        _ => "other",
    }
}

/// Whether the project's own CUDA kernels (`kernels/cuda`: the top-k selection, the
/// multi-tensor AdamW, the gradients' sum of squares, the losses' log-softmax, the fused layer
/// ops) replace the tensor-op paths on CUDA devices: `XDISTILL_CUDA_KERNELS=on` or `off`, read
/// once per process; unset, on (checked on an H200, 2026-11-29: `scripts/gpu-check.sh` steps
/// 1c, 2 and 4). Always false in a build without CUDA.
pub fn cuda_kernels() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| {
        let value = std::env::var("XDISTILL_CUDA_KERNELS").ok();
        let on = on_or_off(value.as_deref(), true).unwrap_or_else(|why| {
            tracing::warn!("XDISTILL_CUDA_KERNELS: {why}; using off");
            false
        });
        on && cfg!(feature = "cuda")
    })
}

/// An on/off switch's value (`unset` when it is not set).
pub(crate) fn on_or_off(value: Option<&str>, unset: bool) -> Result<bool, String> {
    match value {
        None => Ok(unset),
        Some("off") => Ok(false),
        Some("on") => Ok(true),
        Some(other) => Err(format!("{other:?} is not on or off")),
    }
}

/// A device's memory in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryInfo {
    /// What can still be allocated now.
    pub free: u64,
    /// All of it.
    pub total: u64,
}

/// `device`'s memory: a GPU's, or on the CPU the machine's (`MemAvailable`, `MemTotal`) capped
/// by the process's cgroup limit (a container's, which `/proc/meminfo` does not see). `None`
/// where it cannot tell.
pub fn memory_info(device: &Device) -> Option<MemoryInfo> {
    match device {
        Device::Cpu => {
            let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
            let mut free = meminfo_kib(&meminfo, "MemAvailable")? * 1024;
            let mut total = meminfo_kib(&meminfo, "MemTotal")? * 1024;
            if let Some((limit, usage)) = cgroup_memory() {
                free = free.min(limit.saturating_sub(usage));
                total = total.min(limit);
            }
            Some(MemoryInfo { free, total })
        }
        #[cfg(feature = "cuda")]
        Device::Cuda(dev) => {
            let (free, total) = dev.cuda_stream().context().mem_get_info().ok()?;
            Some(MemoryInfo {
                free: free as u64,
                total: total as u64,
            })
        }
        #[allow(unreachable_patterns)]
        _ => None,
    }
}

/// The most bytes a GPU's allocations held at once since the last
/// [`reset_allocated_peak`]: the high watermark of the memory pool candle allocates from
/// (stream-ordered `cuMemAllocAsync`: an allocation counts from its allocation until its free
/// runs in stream order), the measure PyTorch's `max_memory_allocated` takes of its own
/// allocator. `None` on the CPU, or where allocations do not come from a pool.
pub fn allocated_peak(device: &Device) -> Option<u64> {
    let mut high = 0u64;
    pool_high_watermark(device, false, &mut high).then_some(high)
}

/// While the returned guard lives, in this thread: candle's CUDA ops keep the dims and strides
/// they upload for a non-contiguous operand (and every `index_select`'s) on the device, one
/// copy per distinct vector for the process's life, instead of a host-to-device copy from
/// pageable memory per launch (candle's cache for CUDA graph capture). `None` on the CPU. An
/// experiment for fixed shapes (`trainer bench-step --param-cache`): the cache only grows, so
/// a run whose shapes keep changing should not hold it.
#[cfg(feature = "cuda")]
pub fn cache_launch_params(device: &Device) -> Option<impl Drop> {
    match device {
        Device::Cuda(dev) => Some(dev.enable_cuda_graph_htod_cache()),
        _ => None,
    }
}

/// While the returned guard lives, the CUDA profiler's range (`cuProfilerStart` until
/// `cuProfilerStop`): what `ncu --profile-from-start off` profiles and `bench/cuda_calls.c`
/// counts driver calls in. Without a profiler or that library the two calls do nothing. `None`
/// on the CPU or in a build without CUDA.
pub fn profiler_range(device: &Device) -> Option<impl Drop> {
    struct Range;
    impl Drop for Range {
        fn drop(&mut self) {
            #[cfg(feature = "cuda")]
            // SAFETY: no arguments; the context was bound to this thread when the range began
            // (and an error is only a profiler's complaint, ignored).
            unsafe {
                candle_core::cuda_backend::cudarc::driver::sys::cuProfilerStop();
            }
        }
    }
    #[cfg(feature = "cuda")]
    if let Device::Cuda(dev) = device {
        dev.cuda_stream().context().bind_to_thread().ok()?;
        // SAFETY: no arguments, the device's context bound to this thread.
        unsafe {
            candle_core::cuda_backend::cudarc::driver::sys::cuProfilerStart();
        }
        return Some(Range);
    }
    let _ = device;
    None::<Range>
}

/// Starts [`allocated_peak`] afresh from what is allocated now (a no-op on the CPU).
pub fn reset_allocated_peak(device: &Device) {
    let mut zero = 0u64;
    pool_high_watermark(device, true, &mut zero);
}

/// Reads (or with `set`, writes: only zero is taken) the used-memory high watermark of the
/// pool `device`'s allocations come from; false where there is none.
fn pool_high_watermark(device: &Device, set: bool, value: &mut u64) -> bool {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(dev) = device {
        use candle_core::cuda_backend::cudarc::driver::{result, sys};
        let stream = dev.cuda_stream();
        let ctx = stream.context();
        if !ctx.has_async_alloc() || ctx.bind_to_thread().is_err() {
            return false;
        }
        let attr = sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH;
        let value = value as *mut u64 as *mut _;
        // SAFETY: the device's current pool (the one cuMemAllocAsync draws from), and an
        // attribute whose value is a cuuint64_t.
        return unsafe {
            result::device::get_mem_pool(ctx.cu_device()).is_ok_and(|pool| {
                if set {
                    result::mem_pool::set_attribute(pool, attr, value).is_ok()
                } else {
                    result::mem_pool::get_attribute(pool, attr, value).is_ok()
                }
            })
        };
    }
    let _ = (device, set, value);
    false
}

/// A `/proc/meminfo` entry in KiB (`MemAvailable:  123 kB`).
fn meminfo_kib(meminfo: &str, key: &str) -> Option<u64> {
    meminfo.lines().find_map(|line| {
        let rest = line.strip_prefix(key)?.strip_prefix(':')?;
        rest.split_whitespace().next()?.parse().ok()
    })
}

/// This process's cgroup memory limit and usage (v2, then v1); `None` without a limit.
fn cgroup_memory() -> Option<(u64, u64)> {
    let read = |p: &str| std::fs::read_to_string(p).ok();
    if let (Some(max), Some(current)) = (
        read("/sys/fs/cgroup/memory.max"),
        read("/sys/fs/cgroup/memory.current"),
    ) {
        return limit_and_usage(&max, &current);
    }
    limit_and_usage(
        &read("/sys/fs/cgroup/memory/memory.limit_in_bytes")?,
        &read("/sys/fs/cgroup/memory/memory.usage_in_bytes")?,
    )
}

/// A cgroup's limit and usage from its files; `None` for no limit (`max`, or v1's huge value).
fn limit_and_usage(limit: &str, usage: &str) -> Option<(u64, u64)> {
    let limit: u64 = limit.trim().parse().ok()?;
    if limit >= 1 << 60 {
        return None;
    }
    Some((limit, usage.trim().parse().ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn parses() {
        assert!(matches!(parse_device("cpu"), Ok(Device::Cpu)));
        // `auto`: the CPU where this build has no CUDA (the suite's builds).
        if !cfg!(feature = "cuda") {
            assert!(matches!(parse_device(" Auto "), Ok(Device::Cpu)));
            assert_eq!(resolve_device("auto"), "cpu");
        }
        assert_eq!(resolve_device(" cuda:1 "), "cuda:1");
        assert!(matches!(parse_device("tpu"), Err(DeviceError::Unknown(_))));
        assert!(matches!(
            parse_device("cuda:x"),
            Err(DeviceError::Unknown(_))
        ));
        #[cfg(not(feature = "cuda"))]
        assert!(matches!(
            parse_device("cuda:0"),
            Err(DeviceError::NotCompiled(_))
        ));
        assert_eq!(parse_dtype("bf16").unwrap(), DType::BF16);
        assert!(parse_dtype("int8").is_err());
    }
}

#[cfg(test)]
mod dtype_tests {
    use super::*;

    /// `auto` is f32 on the CPU; names are read as before; anything else is refused by name.
    #[test]
    fn auto_is_f32_on_the_cpu_and_names_parse() {
        assert_eq!(dtype_for("auto", &Device::Cpu).unwrap(), DType::F32);
        assert_eq!(dtype_for(" AUTO ", &Device::Cpu).unwrap(), DType::F32);
        assert_eq!(dtype_for("bf16", &Device::Cpu).unwrap(), DType::BF16);
        assert_eq!(dtype_for("float16", &Device::Cpu).unwrap(), DType::F16);
        check_dtype("auto").unwrap();
        let e = check_dtype("int4").unwrap_err().to_string();
        assert!(e.contains("\"int4\"") && e.contains("auto"), "{e}");
    }
}

#[cfg(test)]
mod memory_tests {
    use super::*;

    /// The cgroup files and `/proc/meminfo` are read as the kernel writes them.
    #[test]
    fn memory_info_reads_the_kernel_and_cgroup_files() {
        assert_eq!(limit_and_usage("max\n", "1000\n"), None);
        assert_eq!(limit_and_usage("9223372036854771712\n", "5\n"), None);
        assert_eq!(limit_and_usage("4096\n", "1000\n"), Some((4096, 1000)));
        let info = "MemTotal:       24000000 kB\nMemAvailable:   20000000 kB\n";
        assert_eq!(meminfo_kib(info, "MemAvailable"), Some(20_000_000));
        assert_eq!(meminfo_kib(info, "MemFree"), None);
        // This machine: something free, no more than it has.
        let total = meminfo_kib(
            &std::fs::read_to_string("/proc/meminfo").unwrap(),
            "MemTotal",
        )
        .unwrap()
            * 1024;
        let m = memory_info(&Device::Cpu).unwrap();
        assert!(
            0 < m.free && m.free <= m.total && m.total <= total,
            "{m:?} of {total}"
        );
    }

    /// `XDISTILL_CUDA_KERNELS` takes on or off (unset: on); anything else is named in the
    /// warning and means off.
    #[test]
    fn the_kernels_switch_reads_on_and_off() {
        assert_eq!(on_or_off(None, true), Ok(true));
        assert_eq!(on_or_off(None, false), Ok(false));
        assert_eq!(on_or_off(Some("off"), true), Ok(false));
        assert_eq!(on_or_off(Some("on"), false), Ok(true));
        let e = on_or_off(Some("yes"), true).unwrap_err();
        assert!(e.contains("\"yes\"") && e.contains("on or off"), "{e}");
        // A CPU build never runs them, whatever the switch says.
        if !cfg!(feature = "cuda") {
            assert!(!cuda_kernels());
        }
    }
}
