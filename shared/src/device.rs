//! `--device` and `--dtype` parsing with clear errors.

use candle_core::{DType, Device};

#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    #[error("unknown device {0:?}: expected cpu, cuda or cuda:N")]
    Unknown(String),
    #[error(
        "device {0:?} needs a binary built with `--features cuda` (see scripts/build-cuda.sh)"
    )]
    NotCompiled(String),
    #[error("cannot open {device:?}: {message} (is an NVIDIA GPU and driver present?)")]
    Open { device: String, message: String },
    #[error("unknown dtype {0:?}: expected f32, bf16 or f16")]
    DType(String),
}

/// Parses `cpu`, `cuda` or `cuda:N` and opens the device.
pub fn parse_device(s: &str) -> Result<Device, DeviceError> {
    let s = s.trim();
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

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn parses() {
        assert!(matches!(parse_device("cpu"), Ok(Device::Cpu)));
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
