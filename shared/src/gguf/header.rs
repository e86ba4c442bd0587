//! A bounded first pass over a GGUF file's header, before candle's reader runs: candle divides
//! by `general.alignment` (0 panics), keeps the last of two equal keys or tensor names, holds
//! each metadata array element as a 32-byte value (a 2^30-element array is 32 GiB), and opens a
//! file whose tensor data lies past its end. Here nothing is stored but names (to find
//! duplicates); lengths are checked against the bounds below and the bytes left in the file
//! before anything is read or skipped.

use super::GgufError;
use candle_core::quantized::GgmlDType;
use std::collections::HashSet;
use std::io::{BufReader, Read};
use std::path::Path;

/// Most tensors a file may index (llama.cpp's largest models hold a few thousand).
pub const MAX_TENSORS: u64 = 1 << 16;
/// Most metadata keys a file may hold.
pub const MAX_KEYS: u64 = 1 << 16;
/// Most metadata array elements in all the file's arrays together (candle holds each as a
/// 32-byte value: 2^23 elements are 256 MiB; a 256k-token vocabulary with its merges and token
/// types is under 2^20).
pub const MAX_ARRAY_ELEMENTS: u64 = 1 << 23;
/// Longest key or tensor name.
pub const MAX_NAME_BYTES: u64 = 64 << 10;
/// Longest string value (a chat template, a token).
pub const MAX_STRING_BYTES: u64 = 16 << 20;
/// Deepest nesting of arrays (llama.cpp writes none nested).
const MAX_DEPTH: usize = 4;
/// GGUF's alignment when `general.alignment` is absent.
const DEFAULT_ALIGNMENT: u64 = 32;

/// What the first pass found.
#[derive(Debug)]
pub struct Header {
    /// Where the tensor data starts.
    pub tensor_data_offset: u64,
}

/// The file being read, its length, and the path for messages.
struct Cursor<'a> {
    r: BufReader<std::fs::File>,
    pos: u64,
    len: u64,
    path: &'a Path,
    /// 8-byte lengths (GGUF v2, v3) or 4-byte (v1).
    wide: bool,
    /// Array elements read so far.
    elements: u64,
}

impl Cursor<'_> {
    fn bad(&self, message: impl Into<String>) -> GgufError {
        GgufError::Format {
            path: self.path.to_path_buf(),
            message: message.into(),
        }
    }

    fn left(&self) -> u64 {
        self.len.saturating_sub(self.pos)
    }

    fn bytes<const N: usize>(&mut self, what: &str) -> Result<[u8; N], GgufError> {
        let mut b = [0u8; N];
        if self.left() < N as u64 {
            return Err(self.bad(format!(
                "the file ends at byte {} inside {what} (truncated?)",
                self.len
            )));
        }
        self.r.read_exact(&mut b).map_err(|source| GgufError::Io {
            path: self.path.to_path_buf(),
            source,
        })?;
        self.pos += N as u64;
        Ok(b)
    }

    fn u32(&mut self, what: &str) -> Result<u32, GgufError> {
        self.bytes::<4>(what).map(u32::from_le_bytes)
    }

    fn u64(&mut self, what: &str) -> Result<u64, GgufError> {
        self.bytes::<8>(what).map(u64::from_le_bytes)
    }

    fn length(&mut self, what: &str) -> Result<u64, GgufError> {
        if self.wide {
            self.u64(what)
        } else {
            self.u32(what).map(u64::from)
        }
    }

    /// Skips `n` bytes that must lie inside the file.
    fn skip(&mut self, n: u64, what: &str) -> Result<(), GgufError> {
        if n > self.left() {
            return Err(self.bad(format!(
                "{what} needs {n} bytes at offset {}, past the end of the file ({} bytes; \
                 truncated?)",
                self.pos, self.len
            )));
        }
        let step = i64::try_from(n).map_err(|_| self.bad(format!("{what}: {n} bytes")))?;
        self.r.seek_relative(step).map_err(|source| GgufError::Io {
            path: self.path.to_path_buf(),
            source,
        })?;
        self.pos += n;
        Ok(())
    }

    /// A string's length, checked against `max` and the bytes left.
    fn string_len(&mut self, what: &str, max: u64) -> Result<u64, GgufError> {
        let n = self.length(what)?;
        if n > max {
            return Err(self.bad(format!("{what} is {n} bytes long (at most {max})")));
        }
        if n > self.left() {
            return Err(self.bad(format!(
                "{what} of {n} bytes runs past the end of the file (truncated?)"
            )));
        }
        Ok(n)
    }

    /// A name (key or tensor name), read (bounded by [`MAX_NAME_BYTES`]).
    fn name(&mut self, what: &str) -> Result<String, GgufError> {
        let n = self.string_len(what, MAX_NAME_BYTES)?;
        let mut b = vec![0u8; n as usize];
        self.r.read_exact(&mut b).map_err(|source| GgufError::Io {
            path: self.path.to_path_buf(),
            source,
        })?;
        self.pos += n;
        // As candle reads names: trailing NULs dropped, invalid UTF-8 replaced.
        while b.last() == Some(&0) {
            b.pop();
        }
        Ok(String::from_utf8_lossy(&b).into_owned())
    }

    /// Skips one value of type `ty` (GGUF's type codes), returning it when it is an integer
    /// (for `general.alignment`).
    fn value(&mut self, key: &str, ty: u32, depth: usize) -> Result<Option<u64>, GgufError> {
        let fixed = |ty| match ty {
            0 | 1 | 7 => Some(1u64),
            2 | 3 => Some(2),
            4..=6 => Some(4),
            10..=12 => Some(8),
            _ => None,
        };
        match ty {
            0 => Ok(Some(u64::from(self.bytes::<1>(key)?[0]))),
            2 => Ok(Some(u64::from(u16::from_le_bytes(self.bytes::<2>(key)?)))),
            4 => Ok(Some(u64::from(self.u32(key)?))),
            10 => Ok(Some(self.u64(key)?)),
            1 | 3 | 5 | 11 => {
                let n = fixed(ty).unwrap_or(1);
                self.skip(n, key)?;
                Ok(None)
            }
            6 | 12 => {
                self.skip(fixed(ty).unwrap_or(4), key)?;
                Ok(None)
            }
            7 => match self.bytes::<1>(key)?[0] {
                0 | 1 => Ok(None),
                b => Err(self.bad(format!("metadata key {key:?}: bool byte {b}"))),
            },
            8 => {
                let n =
                    self.string_len(&format!("metadata key {key:?}'s string"), MAX_STRING_BYTES)?;
                self.skip(n, key)?;
                Ok(None)
            }
            9 => {
                if depth >= MAX_DEPTH {
                    return Err(self.bad(format!(
                        "metadata key {key:?}: arrays nested deeper than {MAX_DEPTH}"
                    )));
                }
                let elem = self.u32(key)?;
                let n = self.length(key)?;
                self.elements = self.elements.saturating_add(n);
                if self.elements > MAX_ARRAY_ELEMENTS {
                    return Err(self.bad(format!(
                        "metadata key {key:?}: an array of {n} elements takes the file's arrays \
                         past {MAX_ARRAY_ELEMENTS} elements in all"
                    )));
                }
                if let Some(size) = fixed(elem) {
                    if elem == 7 {
                        for _ in 0..n {
                            self.value(key, elem, depth + 1)?;
                        }
                        return Ok(None);
                    }
                    self.skip(
                        n.saturating_mul(size),
                        &format!("metadata key {key:?}'s array"),
                    )?;
                    return Ok(None);
                }
                for _ in 0..n {
                    self.value(key, elem, depth + 1)?;
                }
                Ok(None)
            }
            other => Err(self.bad(format!(
                "metadata key {key:?} has value type {other}, not a GGUF type (0..=12)"
            ))),
        }
    }
}

/// The storage type of GGUF type code `t`, as candle reads it (`None`: not one it knows).
fn ggml_type(t: u32) -> Option<GgmlDType> {
    Some(match t {
        0 => GgmlDType::F32,
        1 => GgmlDType::F16,
        2 => GgmlDType::Q4_0,
        3 => GgmlDType::Q4_1,
        6 => GgmlDType::Q5_0,
        7 => GgmlDType::Q5_1,
        8 => GgmlDType::Q8_0,
        9 => GgmlDType::Q8_1,
        10 => GgmlDType::Q2K,
        11 => GgmlDType::Q3K,
        12 => GgmlDType::Q4K,
        13 => GgmlDType::Q5K,
        14 => GgmlDType::Q6K,
        15 => GgmlDType::Q8K,
        30 => GgmlDType::BF16,
        _ => return None,
    })
}

/// Reads the header of `path` (magic, counts, every key and tensor record) with the bounds of
/// this module, and refuses: a bad magic or version, a count or length over its bound or past
/// the end of the file, a duplicate key or tensor name, a `general.alignment` that is 0 or not
/// a power of two, an unknown tensor type, more than 4 dimensions, a row that is not whole
/// blocks, and tensor data that would lie past the end of the file.
pub fn check(path: &Path) -> Result<Header, GgufError> {
    let io = |source| GgufError::Io {
        path: path.to_path_buf(),
        source,
    };
    let f = std::fs::File::open(path).map_err(io)?;
    let len = f.metadata().map_err(io)?.len();
    let mut c = Cursor {
        r: BufReader::with_capacity(64 << 10, f),
        pos: 0,
        len,
        path,
        wide: true,
        elements: 0,
    };
    if len < 4 {
        return Err(c.bad(format!("not a GGUF file ({len} bytes, no GGUF magic)")));
    }
    let magic = c.bytes::<4>("the magic")?;
    if &magic != b"GGUF" {
        return Err(c.bad(format!(
            "not a GGUF file (magic {magic:02x?}, not \"GGUF\")"
        )));
    }
    let version = c.u32("the version")?;
    if !(1..=3).contains(&version) {
        return Err(c.bad(format!("GGUF version {version} (1, 2 and 3 are read)")));
    }
    c.wide = version >= 2;
    let tensors = c.length("the tensor count")?;
    let keys = c.length("the metadata key count")?;
    if tensors > MAX_TENSORS {
        return Err(c.bad(format!("{tensors} tensors (at most {MAX_TENSORS})")));
    }
    if keys > MAX_KEYS {
        return Err(c.bad(format!("{keys} metadata keys (at most {MAX_KEYS})")));
    }
    let mut seen = HashSet::new();
    let mut alignment = DEFAULT_ALIGNMENT;
    for _ in 0..keys {
        let key = c.name("a metadata key")?;
        let ty = c.u32(&key)?;
        let v = c.value(&key, ty, 0)?;
        if key == "general.alignment" {
            // candle reads it from an 8/16/32-bit integer (llama.cpp writes u32) and divides
            // by it.
            let a = match (ty, v) {
                (0 | 2 | 4, Some(a)) => a,
                _ => {
                    return Err(c.bad(format!(
                        "general.alignment has value type {ty}; llama.cpp writes a u32"
                    )))
                }
            };
            if a == 0 || !a.is_power_of_two() {
                return Err(GgufError::Key {
                    path: path.to_path_buf(),
                    key,
                    message: format!("alignment {a}: must be a power of two"),
                });
            }
            alignment = a;
        }
        if !seen.insert(key.clone()) {
            return Err(GgufError::Key {
                path: path.to_path_buf(),
                key,
                message: "given twice".into(),
            });
        }
    }
    seen.clear();
    // (name, byte offset in the data, bytes)
    let mut records = Vec::with_capacity(tensors.min(4096) as usize);
    for _ in 0..tensors {
        let name = c.name("a tensor name")?;
        let fail = |message: String| GgufError::Tensor {
            path: path.to_path_buf(),
            tensor: name.clone(),
            message,
        };
        let rank = c.u32(&name)?;
        if rank > 4 {
            return Err(fail(format!("{rank} dimensions (at most 4)")));
        }
        let mut dims = Vec::with_capacity(rank as usize);
        for _ in 0..rank {
            dims.push(c.length(&name)?);
        }
        let code = c.u32(&name)?;
        let offset = c.u64(&name)?;
        let ty = ggml_type(code).ok_or_else(|| fail(format!("unknown ggml type {code}")))?;
        let elems = dims
            .iter()
            .try_fold(1u64, |a, &d| a.checked_mul(d))
            .filter(|&n| usize::try_from(n).is_ok())
            .ok_or_else(|| fail(format!("dimensions {dims:?} overflow")))?;
        let block = ty.block_size() as u64;
        if dims.first().is_some_and(|d| d % block != 0) {
            return Err(fail(format!(
                "rows of {} elements are not whole {}-element blocks of {}",
                dims[0],
                block,
                super::dtype_name(ty)
            )));
        }
        let bytes = (elems / block)
            .checked_mul(ty.type_size() as u64)
            .ok_or_else(|| fail(format!("dimensions {dims:?} overflow")))?;
        if !seen.insert(name.clone()) {
            return Err(fail(
                "given twice (two tensor records with this name)".into(),
            ));
        }
        records.push((name, offset, bytes));
    }
    let tensor_data_offset = c.pos.div_ceil(alignment).saturating_mul(alignment);
    for (name, offset, bytes) in &records {
        let end = tensor_data_offset
            .checked_add(*offset)
            .and_then(|s| s.checked_add(*bytes));
        if end.is_none_or(|e| e > len) {
            return Err(GgufError::Tensor {
                path: path.to_path_buf(),
                tensor: name.clone(),
                message: format!(
                    "its {bytes} bytes at data offset {offset} lie past the end of the file \
                     ({len} bytes; truncated?)"
                ),
            });
        }
    }
    Ok(Header { tensor_data_offset })
}
