//! Typed reads of GGUF metadata values: each getter names the key it could not read, so a
//! malformed file is refused with the key rather than a panic or a silent default.

use super::GgufError;
use candle_core::quantized::gguf_file::Value;
use std::collections::HashMap;
use std::path::Path;

/// The metadata of one file, with the file's path for messages.
pub(crate) struct Meta<'a> {
    pub path: &'a Path,
    pub map: &'a HashMap<String, Value>,
}

impl<'a> Meta<'a> {
    fn bad(&self, key: &str, message: impl Into<String>) -> GgufError {
        GgufError::Key {
            path: self.path.to_path_buf(),
            key: key.to_string(),
            message: message.into(),
        }
    }

    /// A non-negative integer of any width (llama.cpp writes u32, older files i32 or u64).
    pub fn opt_usize(&self, key: &str) -> Result<Option<usize>, GgufError> {
        let Some(v) = self.map.get(key) else {
            return Ok(None);
        };
        let n: Option<u64> = match v {
            Value::U8(x) => Some(u64::from(*x)),
            Value::U16(x) => Some(u64::from(*x)),
            Value::U32(x) => Some(u64::from(*x)),
            Value::U64(x) => Some(*x),
            Value::I8(x) => u64::try_from(*x).ok(),
            Value::I16(x) => u64::try_from(*x).ok(),
            Value::I32(x) => u64::try_from(*x).ok(),
            Value::I64(x) => u64::try_from(*x).ok(),
            _ => None,
        };
        n.and_then(|n| usize::try_from(n).ok())
            .map(Some)
            .ok_or_else(|| self.bad(key, format!("expected a non-negative integer, found {v:?}")))
    }

    pub fn usize(&self, key: &str) -> Result<usize, GgufError> {
        self.opt_usize(key)?
            .ok_or_else(|| self.bad(key, "missing (required)"))
    }

    /// A float (f32 or f64; an integer is accepted too).
    pub fn opt_f64(&self, key: &str) -> Result<Option<f64>, GgufError> {
        let Some(v) = self.map.get(key) else {
            return Ok(None);
        };
        let x = match v {
            Value::F32(x) => f64::from(*x),
            Value::F64(x) => *x,
            other => match self.opt_usize(key) {
                Ok(Some(n)) => n as f64,
                _ => return Err(self.bad(key, format!("expected a number, found {other:?}"))),
            },
        };
        if !x.is_finite() {
            return Err(self.bad(key, format!("not a finite number ({x})")));
        }
        Ok(Some(x))
    }

    pub fn opt_str(&self, key: &str) -> Result<Option<&'a str>, GgufError> {
        match self.map.get(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.as_str())),
            Some(other) => Err(self.bad(
                key,
                format!("expected a string, found a {:?}", other.value_type()),
            )),
        }
    }

    pub fn str(&self, key: &str) -> Result<&'a str, GgufError> {
        self.opt_str(key)?
            .ok_or_else(|| self.bad(key, "missing (required)"))
    }

    pub fn opt_bool(&self, key: &str) -> Result<Option<bool>, GgufError> {
        match self.map.get(key) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(other) => Err(self.bad(
                key,
                format!("expected a bool, found a {:?}", other.value_type()),
            )),
        }
    }

    fn array(&self, key: &str) -> Result<Option<&'a [Value]>, GgufError> {
        match self.map.get(key) {
            None => Ok(None),
            Some(Value::Array(a)) => Ok(Some(a.as_slice())),
            Some(other) => Err(self.bad(
                key,
                format!("expected an array, found a {:?}", other.value_type()),
            )),
        }
    }

    /// An array of strings.
    pub fn opt_strings(&self, key: &str) -> Result<Option<Vec<&'a str>>, GgufError> {
        let Some(a) = self.array(key)? else {
            return Ok(None);
        };
        a.iter()
            .enumerate()
            .map(|(i, v)| match v {
                Value::String(s) => Ok(s.as_str()),
                other => Err(self.bad(
                    key,
                    format!("element {i} is a {:?}, not a string", other.value_type()),
                )),
            })
            .collect::<Result<Vec<_>, _>>()
            .map(Some)
    }

    /// An array of integers (token types are i32).
    pub fn opt_ints(&self, key: &str) -> Result<Option<Vec<i64>>, GgufError> {
        let Some(a) = self.array(key)? else {
            return Ok(None);
        };
        a.iter()
            .enumerate()
            .map(|(i, v)| match v {
                Value::I8(x) => Ok(i64::from(*x)),
                Value::I16(x) => Ok(i64::from(*x)),
                Value::I32(x) => Ok(i64::from(*x)),
                Value::I64(x) => Ok(*x),
                Value::U8(x) => Ok(i64::from(*x)),
                Value::U16(x) => Ok(i64::from(*x)),
                Value::U32(x) => Ok(i64::from(*x)),
                other => Err(self.bad(
                    key,
                    format!("element {i} is a {:?}, not an integer", other.value_type()),
                )),
            })
            .collect::<Result<Vec<_>, _>>()
            .map(Some)
    }
}
