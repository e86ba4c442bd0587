//! Encodings of [`TopkResponse`] and [`TopkRequest`].
//!
//! - JSON (`application/json`): nested arrays, `topk_ids` as `[[u32; k]; rows]`.
//! - MessagePack (`application/msgpack`): every numeric array is a little-endian binary blob
//!   (`bin`), with its shape alongside. At k = 64 this costs ≈ 8.1 bytes per (position, k) entry.

use crate::protocol::{
    HiddenRequest, HiddenResponse, HiddenStates, SequenceScores, TopkRequest, TopkResponse,
    ValuesKind, WireDtype,
};
use serde::{Deserialize, Serialize};
use std::borrow::Cow;

pub const JSON: &str = "application/json";
pub const MSGPACK: &str = "application/msgpack";

#[derive(Debug, thiserror::Error)]
pub enum CodecError {
    #[error("invalid JSON: {0}")]
    Json(#[from] serde_json::Error),
    #[error("invalid MessagePack: {0}")]
    MsgpackDecode(#[from] rmp_serde::decode::Error),
    #[error("MessagePack encoding failed: {0}")]
    MsgpackEncode(#[from] rmp_serde::encode::Error),
    #[error("malformed response: {0}")]
    Shape(String),
    #[error("{0} bytes after the end of the MessagePack value")]
    Trailing(usize),
}

/// Wire format chosen by content negotiation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Json,
    Msgpack,
}

impl Format {
    pub fn content_type(self) -> &'static str {
        match self {
            Format::Json => JSON,
            Format::Msgpack => MSGPACK,
        }
    }
    /// Format of a body from its `Content-Type` (JSON when absent or unknown).
    pub fn from_content_type(ct: Option<&str>) -> Format {
        match ct {
            Some(ct) if is_msgpack(ct) => Format::Msgpack,
            _ => Format::Json,
        }
    }
    /// Preferred response format from an `Accept` header: msgpack only when asked for.
    pub fn from_accept(accept: Option<&str>) -> Format {
        match accept {
            Some(a) if a.split(',').any(is_msgpack) => Format::Msgpack,
            _ => Format::Json,
        }
    }
}

fn is_msgpack(mime: &str) -> bool {
    let m = mime.split(';').next().unwrap_or("").trim();
    m.eq_ignore_ascii_case(MSGPACK) || m.eq_ignore_ascii_case("application/x-msgpack")
}

// ---- requests -------------------------------------------------------------------------------

/// Decodes a request body. Both formats are strict alike: the body is exactly one value (no
/// trailing bytes), lists are lists (no `bin` blob where ids are expected), names are strings.
pub fn decode_request(format: Format, body: &[u8]) -> Result<TopkRequest, CodecError> {
    decode_one(format, body)
}

pub fn encode_request(format: Format, req: &TopkRequest) -> Result<Vec<u8>, CodecError> {
    encode_one(format, req)
}

/// Exactly one value of `T` in `body`. serde_json refuses trailing data itself; MessagePack's
/// decoder stops after one value, so whatever follows it is refused here.
fn decode_one<'de, T: Deserialize<'de>>(format: Format, body: &'de [u8]) -> Result<T, CodecError> {
    match format {
        Format::Json => Ok(serde_json::from_slice(body)?),
        Format::Msgpack => {
            let mut de = rmp_serde::Deserializer::new(body);
            let value = T::deserialize(&mut de)?;
            match de.into_inner().len() {
                0 => Ok(value),
                rest => Err(CodecError::Trailing(rest)),
            }
        }
    }
}

/// `value` as named MessagePack into a buffer of `capacity` bytes (an estimate of its size:
/// the answer is written once, not grown and copied as it is written).
fn encode_named<T: Serialize>(value: &T, capacity: usize) -> Result<Vec<u8>, CodecError> {
    let mut out = Vec::with_capacity(capacity);
    rmp_serde::encode::write_named(&mut out, value)?;
    Ok(out)
}

/// `value` in `format`: MessagePack with field names (maps), as every reader here expects.
fn encode_one<T: Serialize>(format: Format, value: &T) -> Result<Vec<u8>, CodecError> {
    Ok(match format {
        Format::Json => serde_json::to_vec(value)?,
        Format::Msgpack => rmp_serde::to_vec_named(value)?,
    })
}

// ---- responses: JSON ------------------------------------------------------------------------

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct JsonResponse {
    k: usize,
    values: ValuesKind,
    temperature: f32,
    model: String,
    results: Vec<JsonSequence>,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct JsonSequence {
    topk_ids: Vec<Vec<u32>>,
    topk_values: Vec<Vec<f32>>,
    target_logprobs: Vec<f32>,
    logsumexp: Vec<f32>,
    /// `[rows][m]`, only when the request sent candidate `ids`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    ids_logprobs: Option<Vec<Vec<f32>>>,
}

/// `[rows * k]` → `[rows][k]` (`rows` empty rows when `k = 0`).
fn rows_of<T: Copy>(flat: &[T], rows: usize, k: usize) -> Vec<Vec<T>> {
    if k == 0 {
        return vec![Vec::new(); rows];
    }
    flat.chunks(k).map(|c| c.to_vec()).collect()
}

/// `[rows][k]` → `[rows * k]`. Sized by the rows it holds, never by the `k` an answer states
/// (a peer's `k` of 2^40 with one empty row must be an error, not a 4 TiB allocation).
fn flatten<T: Copy>(rows: Vec<Vec<T>>, k: usize) -> Result<Vec<T>, CodecError> {
    if let Some(r) = rows.iter().find(|r| r.len() != k) {
        return Err(CodecError::Shape(format!(
            "row of length {} where k = {k}",
            r.len()
        )));
    }
    Ok(rows.concat())
}

/// `a × b` for sizes a peer states, or a shape error where the product does not fit a `usize`
/// (a wrapped product could match a short buffer).
fn product(a: usize, b: usize, what: &str) -> Result<usize, CodecError> {
    a.checked_mul(b)
        .ok_or_else(|| CodecError::Shape(format!("{what}: {a} × {b} does not fit in memory")))
}

// ---- responses: MessagePack -----------------------------------------------------------------

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct PackResponse<'a> {
    k: usize,
    values: ValuesKind,
    temperature: f32,
    model: String,
    #[serde(borrow)]
    results: Vec<PackSequence<'a>>,
}

/// One sequence with its arrays as little-endian blobs; `shape` is `[rows, k]`, `ids_shape`
/// `[rows, m]` (with `ids_logprobs`, only when the request sent candidate `ids`).
///
/// Encoding, the blobs are the arrays' own bytes on a little-endian host (no copy before the
/// answer's one buffer); decoded, they are owned.
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct PackSequence<'a> {
    shape: [usize; 2],
    #[serde(with = "serde_bytes", borrow)]
    topk_ids: Cow<'a, [u8]>,
    #[serde(with = "serde_bytes", borrow)]
    topk_values: Cow<'a, [u8]>,
    #[serde(with = "serde_bytes", borrow)]
    target_logprobs: Cow<'a, [u8]>,
    #[serde(with = "serde_bytes", borrow)]
    logsumexp: Cow<'a, [u8]>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    ids_shape: Option<[usize; 2]>,
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        with = "serde_bytes",
        borrow
    )]
    ids_logprobs: Option<Cow<'a, [u8]>>,
}

/// `v` as little-endian bytes: its own memory on a little-endian host, a copy elsewhere.
fn le_bytes<T: bytemuck::Pod + ToLe>(v: &[T]) -> Cow<'_, [u8]> {
    if cfg!(target_endian = "little") {
        Cow::Borrowed(bytemuck::cast_slice(v))
    } else {
        Cow::Owned(v.iter().flat_map(|x| x.to_le()).collect())
    }
}

/// A 4-byte value's little-endian bytes.
trait ToLe {
    fn to_le(&self) -> [u8; 4];
}
impl ToLe for u32 {
    fn to_le(&self) -> [u8; 4] {
        self.to_le_bytes()
    }
}
impl ToLe for f32 {
    fn to_le(&self) -> [u8; 4] {
        self.to_le_bytes()
    }
}
fn from_le<T>(b: &[u8], n: usize, name: &str, f: fn([u8; 4]) -> T) -> Result<Vec<T>, CodecError> {
    if !b.len().is_multiple_of(4) || b.len() / 4 != n {
        return Err(CodecError::Shape(format!(
            "{name}: {} bytes where {n} 4-byte values were expected",
            b.len()
        )));
    }
    Ok(b.chunks_exact(4)
        .map(|c| f([c[0], c[1], c[2], c[3]]))
        .collect())
}

pub fn encode_response(format: Format, resp: &TopkResponse) -> Result<Vec<u8>, CodecError> {
    match format {
        Format::Json => {
            let r = JsonResponse {
                k: resp.k,
                values: resp.values,
                temperature: resp.temperature,
                model: resp.model.clone(),
                results: resp
                    .results
                    .iter()
                    .map(|s| JsonSequence {
                        topk_ids: rows_of(&s.topk_ids, s.rows, s.k),
                        topk_values: rows_of(&s.topk_values, s.rows, s.k),
                        target_logprobs: s.target_logprobs.clone(),
                        logsumexp: s.logsumexp.clone(),
                        ids_logprobs: resp.with_ids.then(|| rows_of(&s.ids_logprobs, s.rows, s.m)),
                    })
                    .collect(),
            };
            Ok(serde_json::to_vec(&r)?)
        }
        Format::Msgpack => {
            let r = PackResponse {
                k: resp.k,
                values: resp.values,
                temperature: resp.temperature,
                model: resp.model.clone(),
                results: resp
                    .results
                    .iter()
                    .map(|s| PackSequence {
                        shape: [s.rows, s.k],
                        topk_ids: le_bytes(&s.topk_ids),
                        topk_values: le_bytes(&s.topk_values),
                        target_logprobs: le_bytes(&s.target_logprobs),
                        logsumexp: le_bytes(&s.logsumexp),
                        ids_shape: resp.with_ids.then_some([s.rows, s.m]),
                        ids_logprobs: resp.with_ids.then(|| le_bytes(&s.ids_logprobs)),
                    })
                    .collect(),
            };
            // The blobs, 160 bytes a sequence for its field names, lengths and shapes, and
            // the envelope.
            let blobs: usize = resp
                .results
                .iter()
                .map(|s| {
                    160 + 4
                        * (s.topk_ids.len()
                            + s.topk_values.len()
                            + s.target_logprobs.len()
                            + s.logsumexp.len()
                            + s.ids_logprobs.len())
                })
                .sum();
            encode_named(&r, blobs + 128 + r.model.len())
        }
    }
}

pub fn decode_response(format: Format, body: &[u8]) -> Result<TopkResponse, CodecError> {
    match format {
        Format::Json => {
            let r: JsonResponse = decode_one(format, body)?;
            let k = r.k;
            let mut with_ids = false;
            let results = r
                .results
                .into_iter()
                .map(|s| {
                    let rows = s.target_logprobs.len();
                    if s.topk_ids.len() != rows {
                        return Err(CodecError::Shape(format!(
                            "{} top-k rows for {rows} target log-probs",
                            s.topk_ids.len()
                        )));
                    }
                    let (m, ids_logprobs) = match s.ids_logprobs {
                        Some(v) => {
                            with_ids = true;
                            let m = v.first().map_or(0, Vec::len);
                            (m, flatten(v, m)?)
                        }
                        None => (0, Vec::new()),
                    };
                    // serde_json writes non-finite floats as null; they cannot occur in top-k
                    // values of a finite model, so a null is a malformed answer.
                    let seq = SequenceScores {
                        rows,
                        k,
                        topk_ids: flatten(s.topk_ids, k)?,
                        topk_values: flatten(s.topk_values, k)?,
                        target_logprobs: s.target_logprobs,
                        logsumexp: s.logsumexp,
                        m,
                        ids_logprobs,
                        ..Default::default()
                    };
                    seq.check_shapes().map_err(CodecError::Shape)?;
                    Ok(seq)
                })
                .collect::<Result<Vec<_>, CodecError>>()?;
            Ok(TopkResponse {
                k,
                values: r.values,
                temperature: r.temperature,
                model: r.model,
                with_ids,
                results,
            })
        }
        Format::Msgpack => {
            let r: PackResponse = decode_one(format, body)?;
            let with_ids = r.results.iter().any(|s| s.ids_shape.is_some());
            let answer_k = r.k;
            let results = r
                .results
                .into_iter()
                .map(|s| {
                    let [rows, k] = s.shape;
                    // JSON states k once for every sequence; a blob's shape must agree with it.
                    if k != answer_k {
                        return Err(CodecError::Shape(format!(
                            "shape [{rows}, {k}] in an answer of k = {answer_k}"
                        )));
                    }
                    let rk = product(rows, k, "shape")?;
                    let seq = SequenceScores {
                        rows,
                        k,
                        topk_ids: from_le(&s.topk_ids, rk, "topk_ids", u32::from_le_bytes)?,
                        topk_values: from_le(
                            &s.topk_values,
                            rk,
                            "topk_values",
                            f32::from_le_bytes,
                        )?,
                        target_logprobs: from_le(
                            &s.target_logprobs,
                            rows,
                            "target_logprobs",
                            f32::from_le_bytes,
                        )?,
                        logsumexp: from_le(&s.logsumexp, rows, "logsumexp", f32::from_le_bytes)?,
                        ..Default::default()
                    };
                    let seq =
                        match (s.ids_shape, s.ids_logprobs) {
                            (Some([r, m]), Some(b)) if r == rows => SequenceScores {
                                m,
                                ids_logprobs: from_le(
                                    &b,
                                    product(rows, m, "ids_shape")?,
                                    "ids_logprobs",
                                    f32::from_le_bytes,
                                )?,
                                ..seq
                            },
                            (None, None) => seq,
                            _ => return Err(CodecError::Shape(
                                "ids_shape and ids_logprobs must come together, with `rows` rows"
                                    .into(),
                            )),
                        };
                    seq.check_shapes().map_err(CodecError::Shape)?;
                    Ok(seq)
                })
                .collect::<Result<Vec<_>, CodecError>>()?;
            Ok(TopkResponse {
                k: r.k,
                values: r.values,
                temperature: r.temperature,
                model: r.model,
                with_ids,
                results,
            })
        }
    }
}

// ---- hidden states (`/hidden_states`) -------------------------------------------------------

/// Decodes a `/hidden_states` body, as strictly as [`decode_request`].
pub fn decode_hidden_request(format: Format, body: &[u8]) -> Result<HiddenRequest, CodecError> {
    decode_one(format, body)
}

pub fn encode_hidden_request(format: Format, req: &HiddenRequest) -> Result<Vec<u8>, CodecError> {
    encode_one(format, req)
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct PackHidden<'a> {
    model: String,
    head_fingerprint: String,
    dtype: String,
    hidden_size: usize,
    #[serde(borrow)]
    results: Vec<PackHiddenSequence<'a>>,
}

/// One sequence's `[rows, H]` states as one little-endian blob.
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct PackHiddenSequence<'a> {
    shape: [usize; 2],
    #[serde(with = "serde_bytes", borrow)]
    hidden: Cow<'a, [u8]>,
}

/// The `/hidden_states` answer (MessagePack only: the states are blobs in the model's dtype).
pub fn encode_hidden_response(resp: &HiddenResponse) -> Result<Vec<u8>, CodecError> {
    let r = PackHidden {
        model: resp.model.clone(),
        head_fingerprint: resp.head_fingerprint.clone(),
        dtype: resp.dtype.name().into(),
        hidden_size: resp.hidden_size,
        results: resp
            .results
            .iter()
            .map(|s| PackHiddenSequence {
                shape: [s.rows, resp.hidden_size],
                hidden: Cow::Borrowed(&s.data),
            })
            .collect(),
    };
    let size = hidden_response_bytes(resp.results.iter().map(|s| s.rows), 0)
        + resp.results.iter().map(|s| s.data.len()).sum::<usize>()
        + r.model.len()
        + r.head_fingerprint.len();
    encode_named(&r, size)
}

/// Bytes of the encoded answer for sequences of `rows` rows each (the blobs plus 64 per
/// sequence and 256 for the envelope; an upper bound of [`encode_hidden_response`]'s size).
pub fn hidden_response_bytes(rows: impl Iterator<Item = usize>, row_bytes: usize) -> usize {
    256 + rows
        .map(|r| 64usize.saturating_add(r.saturating_mul(row_bytes)))
        .fold(0usize, usize::saturating_add)
}

/// An upper bound of a `/topk_logits` answer's size in either format, for sequences of `rows`
/// rows each at `k` top entries and `m` candidate ids a row, plus the `model` name's length:
/// at most 24 bytes a number (JSON's longest f32 is 15 characters and a comma, a u32 11), 16 a
/// row and 128 a sequence for the brackets and field names, 256 for the envelope. A client
/// reads no more than this of an answer (an endless body is an error, not its memory).
pub fn topk_response_bytes(rows: impl Iterator<Item = usize>, k: usize, m: usize) -> usize {
    let row_bytes = k
        .saturating_mul(2)
        .saturating_add(m)
        .saturating_add(2)
        .saturating_mul(24)
        .saturating_add(16);
    256 + rows
        .map(|r| 128usize.saturating_add(r.saturating_mul(row_bytes)))
        .fold(0usize, usize::saturating_add)
}

pub fn decode_hidden_response(body: &[u8]) -> Result<HiddenResponse, CodecError> {
    let r: PackHidden = decode_one(Format::Msgpack, body)?;
    let dtype = WireDtype::parse(&r.dtype)
        .ok_or_else(|| CodecError::Shape(format!("unknown dtype {:?}", r.dtype)))?;
    let results = r
        .results
        .into_iter()
        .map(|s| {
            let [rows, h] = s.shape;
            let bytes = product(rows, h, "hidden shape")
                .and_then(|n| product(n, dtype.size(), "hidden shape"))?;
            if h != r.hidden_size || s.hidden.len() != bytes {
                return Err(CodecError::Shape(format!(
                    "hidden: {} bytes for shape [{rows}, {h}] of {} (hidden_size {})",
                    s.hidden.len(),
                    dtype.name(),
                    r.hidden_size
                )));
            }
            Ok(HiddenStates {
                rows,
                data: s.hidden.into_owned(),
            })
        })
        .collect::<Result<Vec<_>, CodecError>>()?;
    Ok(HiddenResponse {
        model: r.model,
        head_fingerprint: r.head_fingerprint,
        dtype,
        hidden_size: r.hidden_size,
        results,
    })
}

// ---- the output head (`/v1/head`) ------------------------------------------------------------

/// What the head file says besides its tensors (its safetensors `__metadata__`).
#[derive(Debug, Clone, PartialEq)]
pub struct HeadMeta {
    pub model_fingerprint: String,
    pub architecture: String,
    /// Valid ids; rows at or above are padding.
    pub vocab_size: usize,
    pub head_rows: usize,
    pub hidden_size: usize,
    pub dtype: WireDtype,
    pub tied: bool,
    pub bias: bool,
    pub logit_scale: f64,
    pub logit_softcap: Option<f64>,
}

/// `format` in the head file's metadata.
pub const HEAD_FORMAT: &str = "xdistill-head-1";

impl HeadMeta {
    /// Bytes of the weight tensor `[head_rows, hidden_size]`.
    pub fn weight_bytes(&self) -> u64 {
        (self.head_rows * self.hidden_size * self.dtype.size()) as u64
    }
    /// Bytes of the bias `[head_rows]` (0 without one).
    pub fn bias_bytes(&self) -> u64 {
        if self.bias {
            (self.head_rows * self.dtype.size()) as u64
        } else {
            0
        }
    }
    /// The safetensors header: its length (u64 LE), then the JSON, padded with spaces to a
    /// multiple of 8 bytes. The tensors' bytes follow: `weight`, then `bias` if any.
    pub fn header(&self) -> Vec<u8> {
        let meta = serde_json::json!({
            "format": HEAD_FORMAT,
            "model_fingerprint": self.model_fingerprint,
            "architecture": self.architecture,
            "vocab_size": self.vocab_size.to_string(),
            "head_rows": self.head_rows.to_string(),
            "hidden_size": self.hidden_size.to_string(),
            "dtype": self.dtype.name(),
            "tied": self.tied.to_string(),
            "bias": self.bias.to_string(),
            "logit_scale": format!("{:?}", self.logit_scale),
            "logit_softcap": self.logit_softcap.map_or("none".to_string(), |c| format!("{c:?}")),
        });
        let w = self.weight_bytes();
        let mut header = serde_json::Map::new();
        header.insert("__metadata__".into(), meta);
        header.insert(
            "weight".into(),
            serde_json::json!({
                "dtype": self.dtype.safetensors_name(),
                "shape": [self.head_rows, self.hidden_size],
                "data_offsets": [0, w],
            }),
        );
        if self.bias {
            header.insert(
                "bias".into(),
                serde_json::json!({
                    "dtype": self.dtype.safetensors_name(),
                    "shape": [self.head_rows],
                    "data_offsets": [w, w + self.bias_bytes()],
                }),
            );
        }
        let mut json = serde_json::to_vec(&serde_json::Value::Object(header))
            .expect("a JSON map always serialises");
        while !json.len().is_multiple_of(8) {
            json.push(b' ');
        }
        let mut out = (json.len() as u64).to_le_bytes().to_vec();
        out.extend_from_slice(&json);
        out
    }
    /// Length of the whole head file.
    pub fn file_len(&self) -> u64 {
        self.header().len() as u64 + self.weight_bytes() + self.bias_bytes()
    }
}

/// A decoded head file, its tensors widened to f32.
#[derive(Debug, Clone, PartialEq)]
pub struct HeadFile {
    pub meta: HeadMeta,
    /// `[head_rows, hidden_size]`, row-major.
    pub weight: Vec<f32>,
    /// `[head_rows]` when the head has a bias.
    pub bias: Option<Vec<f32>>,
}

/// Decodes the bytes `/v1/head` serves (a safetensors file; see [`HeadMeta::header`]).
pub fn decode_head(bytes: &[u8]) -> Result<HeadFile, CodecError> {
    let bad = |m: String| CodecError::Shape(format!("head file: {m}"));
    if bytes.len() < 8 {
        return Err(bad(format!("{} bytes, no header", bytes.len())));
    }
    let n = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes")) as usize;
    let json = bytes
        .get(8..8usize.saturating_add(n))
        .ok_or_else(|| bad(format!("header of {n} bytes in a file of {}", bytes.len())))?;
    let header: serde_json::Value = serde_json::from_slice(json)?;
    let data = &bytes[8 + n..];
    let meta = &header["__metadata__"];
    let text = |k: &str| -> Result<&str, CodecError> {
        meta[k]
            .as_str()
            .ok_or_else(|| bad(format!("metadata {k} missing")))
    };
    let num = |k: &str| -> Result<usize, CodecError> {
        text(k)?
            .parse()
            .map_err(|e| bad(format!("metadata {k}: {e}")))
    };
    if text("format")? != HEAD_FORMAT {
        return Err(bad(format!(
            "format {:?}, not {HEAD_FORMAT}",
            text("format")?
        )));
    }
    let dtype = WireDtype::parse(text("dtype")?)
        .ok_or_else(|| bad(format!("dtype {:?}", text("dtype"))))?;
    let float = |k: &str| -> Result<Option<f64>, CodecError> {
        match text(k)? {
            "none" => Ok(None),
            v => v
                .parse()
                .map(Some)
                .map_err(|e| bad(format!("metadata {k}: {e}"))),
        }
    };
    let (head_rows, hidden_size) = (num("head_rows")?, num("hidden_size")?);
    // The sizes below are products of these: each must fit before anything is sized by it.
    product(head_rows, hidden_size, "head file: head_rows × hidden_size")
        .and_then(|n| product(n, dtype.size(), "head file: weight bytes"))?;
    product(head_rows, dtype.size(), "head file: bias bytes")?;
    let meta = HeadMeta {
        model_fingerprint: text("model_fingerprint")?.into(),
        architecture: text("architecture")?.into(),
        vocab_size: num("vocab_size")?,
        head_rows,
        hidden_size,
        dtype,
        tied: text("tied")? == "true",
        bias: text("bias")? == "true",
        logit_scale: float("logit_scale")?.unwrap_or(1.0),
        logit_softcap: float("logit_softcap")?,
    };
    // A NaN or infinite scale, or a soft-cap c ≤ 0 (c · tanh(z / c)), makes every logit NaN.
    if !meta.logit_scale.is_finite()
        || meta
            .logit_softcap
            .is_some_and(|c| !(c.is_finite() && c > 0.0))
    {
        return Err(bad(format!(
            "logit_scale {} and logit_softcap {:?}: a finite scale and a positive, finite \
             soft-cap (or none) are needed",
            meta.logit_scale, meta.logit_softcap
        )));
    }
    let tensor = |name: &str, want: u64| -> Result<Vec<f32>, CodecError> {
        let t = &header[name];
        let offs = t["data_offsets"]
            .as_array()
            .and_then(|a| Some((a.first()?.as_u64()?, a.get(1)?.as_u64()?)))
            .ok_or_else(|| bad(format!("{name}: no data_offsets")))?;
        if offs.1 < offs.0 || offs.1 - offs.0 != want || offs.1 as usize > data.len() {
            return Err(bad(format!(
                "{name}: offsets {offs:?} for {want} bytes in {} bytes of data",
                data.len()
            )));
        }
        dtype
            .to_f32(&data[offs.0 as usize..offs.1 as usize])
            .map_err(bad)
    };
    let weight = tensor("weight", meta.weight_bytes())?;
    let bias = if meta.bias {
        Some(tensor("bias", meta.bias_bytes())?)
    } else {
        None
    };
    if data.len() as u64 != meta.weight_bytes() + meta.bias_bytes() {
        return Err(bad(format!(
            "{} bytes of data for {} of tensors",
            data.len(),
            meta.weight_bytes() + meta.bias_bytes()
        )));
    }
    Ok(HeadFile { meta, weight, bias })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> TopkResponse {
        TopkResponse {
            k: 2,
            values: ValuesKind::Logprobs,
            temperature: 0.7,
            model: "abc".into(),
            results: vec![
                SequenceScores {
                    rows: 2,
                    k: 2,
                    topk_ids: vec![5, 1, 7, 3],
                    topk_values: vec![-0.1, -2.5, -0.3, -1.25],
                    target_logprobs: vec![-2.5, -9.0],
                    logsumexp: vec![3.5, 1.0],
                    ..Default::default()
                },
                SequenceScores {
                    rows: 0,
                    k: 2,
                    ..Default::default()
                },
            ],
            with_ids: false,
        }
    }

    /// Version 2: `k = 0` (no top-k columns) and candidate-id log-probs.
    fn sample_v2() -> TopkResponse {
        TopkResponse {
            k: 0,
            values: ValuesKind::Logprobs,
            temperature: 1.0,
            model: "abc".into(),
            results: vec![
                SequenceScores {
                    rows: 2,
                    k: 0,
                    target_logprobs: vec![-2.5, -9.0],
                    logsumexp: vec![3.5, 1.0],
                    m: 3,
                    ids_logprobs: vec![-1.0, -2.0, -3.0, -4.0, -5.0, -6.0],
                    ..Default::default()
                },
                SequenceScores {
                    rows: 1,
                    k: 0,
                    target_logprobs: vec![-0.5],
                    logsumexp: vec![2.0],
                    m: 1,
                    ids_logprobs: vec![-7.5],
                    ..Default::default()
                },
            ],
            with_ids: true,
        }
    }

    #[test]
    fn version_2_fields_round_trip() {
        for f in [Format::Json, Format::Msgpack] {
            let bytes = encode_response(f, &sample_v2()).unwrap();
            assert_eq!(decode_response(f, &bytes).unwrap(), sample_v2(), "{f:?}");
        }
        // k = 0 keeps one (empty) row per position in JSON, so the row count survives.
        let json: serde_json::Value =
            serde_json::from_slice(&encode_response(Format::Json, &sample_v2()).unwrap()).unwrap();
        assert_eq!(json["results"][0]["topk_ids"], serde_json::json!([[], []]));
        assert_eq!(
            json["results"][0]["ids_logprobs"],
            serde_json::json!([[-1.0, -2.0, -3.0], [-4.0, -5.0, -6.0]])
        );
        // A version-1 answer carries no ids fields at all.
        let v1: serde_json::Value =
            serde_json::from_slice(&encode_response(Format::Json, &sample()).unwrap()).unwrap();
        assert!(v1["results"][0].get("ids_logprobs").is_none());
    }

    #[test]
    fn request_ids_round_trip() {
        let req: TopkRequest =
            serde_json::from_str(r#"{"sequences":[[1,2,3]],"k":0,"ids":[[[4,5],[6,7]]]}"#).unwrap();
        assert_eq!(req.ids, Some(vec![vec![vec![4, 5], vec![6, 7]]]));
        let packed = encode_request(Format::Msgpack, &req).unwrap();
        assert_eq!(decode_request(Format::Msgpack, &packed).unwrap(), req);
    }

    #[test]
    fn both_formats_round_trip() {
        for f in [Format::Json, Format::Msgpack] {
            let bytes = encode_response(f, &sample()).unwrap();
            assert_eq!(decode_response(f, &bytes).unwrap(), sample(), "{f:?}");
        }
    }

    /// [`topk_response_bytes`] bounds both formats' answers at their longest numbers (the
    /// largest ids, f32s of nine significant digits and the smallest exponents, NaN) and at
    /// the smallest shapes, where the fixed parts dominate.
    #[test]
    fn topk_response_bytes_bounds_both_formats() {
        let worst = [
            -1.234_567_9e-38f32,
            -1.175_494_4e-38,
            f32::MIN,
            -1.000_000_1e-37,
            f32::NAN,
        ];
        for (rows, k, m) in [
            (0, 0, 0),
            (1, 0, 0),
            (1, 1, 0),
            (3, 5, 2),
            (7, 64, 0),
            (2, 0, 9),
        ] {
            let value = |i: usize| worst[i % worst.len()];
            let sequences = [rows, 0, 1];
            let resp = TopkResponse {
                k,
                values: ValuesKind::Logprobs,
                temperature: 1.0 - f32::EPSILON,
                model: "abc".into(),
                with_ids: m > 0,
                results: sequences
                    .iter()
                    .map(|&r| SequenceScores {
                        rows: r,
                        k,
                        topk_ids: vec![u32::MAX; r * k],
                        topk_values: (0..r * k).map(value).collect(),
                        target_logprobs: (0..r).map(value).collect(),
                        logsumexp: (0..r).map(|i| value(i + 1)).collect(),
                        m,
                        ids_logprobs: (0..r * m).map(value).collect(),
                        ..Default::default()
                    })
                    .collect(),
            };
            let bound = topk_response_bytes(sequences.into_iter(), k, m) + resp.model.len();
            for f in [Format::Json, Format::Msgpack] {
                let bytes = encode_response(f, &resp).unwrap();
                assert!(
                    bytes.len() <= bound,
                    "{f:?} rows {rows} k {k} m {m}: {} > {bound}",
                    bytes.len()
                );
            }
        }
    }

    #[test]
    fn msgpack_blobs_are_little_endian() {
        let bytes = encode_response(Format::Msgpack, &sample()).unwrap();
        let needle: Vec<u8> = [5u32, 1, 7, 3]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        assert!(bytes.windows(needle.len()).any(|w| w == needle.as_slice()));
    }

    #[test]
    fn truncated_blob_is_an_error() {
        let mut resp = sample();
        resp.results[0].topk_ids.pop();
        resp.results[0].rows = 2;
        let bytes = encode_response(Format::Msgpack, &resp).unwrap();
        assert!(matches!(
            decode_response(Format::Msgpack, &bytes),
            Err(CodecError::Shape(_))
        ));
    }

    /// MessagePack is decoded as strictly as JSON: trailing bytes, a variant index for `values`
    /// and `bin` blobs where lists of ids are expected are all errors.
    #[test]
    fn msgpack_requests_are_strict() {
        let ok = decode_request(Format::Json, br#"{"sequences":[[1,2]],"k":2}"#).unwrap();
        let mut packed = encode_request(Format::Msgpack, &ok).unwrap();
        assert_eq!(decode_request(Format::Msgpack, &packed).unwrap(), ok);
        packed.extend_from_slice(&[0xc0, 0x01]);
        assert!(matches!(
            decode_request(Format::Msgpack, &packed),
            Err(CodecError::Trailing(2))
        ));
        // {"sequences": [[1, 2]], "k": 2, "values": 1}
        let as_index = rmp_serde::to_vec_named(&serde_json::json!(
            {"sequences": [[1, 2]], "k": 2, "values": 1}
        ))
        .unwrap();
        assert!(decode_request(Format::Msgpack, &as_index).is_err());
        let named = rmp_serde::to_vec_named(&serde_json::json!(
            {"sequences": [[1, 2]], "k": 2, "values": "logits"}
        ))
        .unwrap();
        assert_eq!(
            decode_request(Format::Msgpack, &named).unwrap().values,
            ValuesKind::Logits
        );
        // A bin blob where a list of ids (or the list of sequences, or starts) is expected.
        #[derive(Serialize)]
        struct Blob<'a> {
            sequences: Vec<&'a serde_bytes::Bytes>,
            k: usize,
        }
        let blob = rmp_serde::to_vec_named(&Blob {
            sequences: vec![serde_bytes::Bytes::new(&[1, 2, 3])],
            k: 2,
        })
        .unwrap();
        assert!(decode_request(Format::Msgpack, &blob).is_err());
        #[derive(Serialize)]
        struct OuterBlob<'a> {
            #[serde(with = "serde_bytes")]
            sequences: &'a [u8],
            k: usize,
        }
        let outer = rmp_serde::to_vec_named(&OuterBlob {
            sequences: &[1, 2],
            k: 2,
        })
        .unwrap();
        assert!(decode_request(Format::Msgpack, &outer).is_err());
        #[derive(Serialize)]
        struct StartsBlob<'a> {
            sequences: Vec<Vec<u32>>,
            k: usize,
            #[serde(with = "serde_bytes")]
            starts: &'a [u8],
        }
        let starts = rmp_serde::to_vec_named(&StartsBlob {
            sequences: vec![vec![1, 2]],
            k: 2,
            starts: &[0],
        })
        .unwrap();
        assert!(decode_request(Format::Msgpack, &starts).is_err());
        // JSON refuses the same shapes.
        assert!(
            decode_request(Format::Json, br#"{"sequences":[[1,2]],"k":2,"values":1}"#).is_err()
        );
        assert!(decode_request(Format::Json, br#"{"sequences":["ab"],"k":2}"#).is_err());
        assert!(decode_request(Format::Json, br#"{"sequences":[[1,2]],"k":2} x"#).is_err());
    }

    #[test]
    fn request_rejects_unknown_fields() {
        let err = decode_request(Format::Json, br#"{"sequences":[[1,2]],"k":2,"bogus":1}"#);
        assert!(err.is_err());
        let ok = decode_request(Format::Json, br#"{"sequences":[[1,2]],"k":2}"#).unwrap();
        assert_eq!(ok.temperature, 1.0);
        assert_eq!(ok.values, ValuesKind::Logprobs);
        let packed = encode_request(Format::Msgpack, &ok).unwrap();
        assert_eq!(decode_request(Format::Msgpack, &packed).unwrap(), ok);
    }

    #[test]
    fn hidden_request_and_response_round_trip() {
        let req = decode_hidden_request(Format::Json, br#"{"sequences":[[1,2,3]],"starts":[1]}"#)
            .unwrap();
        assert_eq!(req.start_of(0), 1);
        let packed = encode_hidden_request(Format::Msgpack, &req).unwrap();
        assert_eq!(
            decode_hidden_request(Format::Msgpack, &packed).unwrap(),
            req
        );
        assert!(decode_hidden_request(Format::Json, br#"{"sequences":[[1]],"k":2}"#).is_err());
        let resp = HiddenResponse {
            model: "m".into(),
            head_fingerprint: "h".into(),
            dtype: WireDtype::Bf16,
            hidden_size: 2,
            results: vec![
                HiddenStates {
                    rows: 2,
                    data: [1.0f32, -2.0, 0.5, 3.0]
                        .iter()
                        .flat_map(|&x| half::bf16::from_f32(x).to_le_bytes())
                        .collect(),
                },
                HiddenStates::default(),
            ],
        };
        let bytes = encode_hidden_response(&resp).unwrap();
        let back = decode_hidden_response(&bytes).unwrap();
        assert_eq!(back, resp);
        assert_eq!(back.f32_rows(0).unwrap(), vec![1.0, -2.0, 0.5, 3.0]);
        assert!(bytes.len() <= hidden_response_bytes([2, 0].into_iter(), 4));
        let mut trailing = bytes;
        trailing.push(0xc0);
        assert!(matches!(
            decode_hidden_response(&trailing),
            Err(CodecError::Trailing(1))
        ));
    }

    /// Answers are decoded as strictly as requests: a byte after the one value is an error in
    /// both formats (a reader that stopped early would take half of a doubled body for all of it).
    #[test]
    fn responses_with_trailing_bytes_are_errors() {
        for format in [Format::Json, Format::Msgpack] {
            let mut bytes = encode_response(format, &sample()).unwrap();
            assert_eq!(decode_response(format, &bytes).unwrap(), sample());
            let one = bytes.clone();
            bytes.extend_from_slice(&one);
            let err = decode_response(format, &bytes).unwrap_err();
            match format {
                Format::Json => assert!(matches!(err, CodecError::Json(_)), "{err}"),
                Format::Msgpack => {
                    assert!(
                        matches!(err, CodecError::Trailing(n) if n == one.len()),
                        "{err}"
                    )
                }
            }
        }
    }

    /// The head file is a safetensors file (read back by the safetensors crate) that
    /// [`decode_head`] reads too, with or without a bias.
    #[test]
    fn head_file_is_safetensors() {
        for bias in [false, true] {
            let meta = HeadMeta {
                model_fingerprint: "fp".into(),
                architecture: "Qwen3ForCausalLM".into(),
                vocab_size: 3,
                head_rows: 4,
                hidden_size: 2,
                dtype: WireDtype::F32,
                tied: true,
                bias,
                logit_scale: 1.0,
                logit_softcap: Some(30.0),
            };
            let mut file = meta.header();
            assert_eq!(file.len() % 8, 0);
            let w: Vec<f32> = (0..8).map(|i| i as f32 - 3.5).collect();
            file.extend(w.iter().flat_map(|x| x.to_le_bytes()));
            if bias {
                file.extend([0.5f32; 4].iter().flat_map(|x| x.to_le_bytes()));
            }
            assert_eq!(file.len() as u64, meta.file_len());
            let st = safetensors::SafeTensors::deserialize(&file).unwrap();
            assert_eq!(st.tensor("weight").unwrap().shape(), &[4, 2]);
            assert_eq!(st.names().len(), 1 + bias as usize);
            let back = decode_head(&file).unwrap();
            assert_eq!(back.meta, meta);
            assert_eq!(back.weight, w);
            assert_eq!(back.bias, bias.then(|| vec![0.5; 4]));
            assert!(decode_head(&file[..file.len() - 1]).is_err());
            // Scales that would make every logit NaN are refused by name.
            for (scale, cap) in [(f64::NAN, None), (f64::INFINITY, None), (1.0, Some(0.0))] {
                let odd = HeadMeta {
                    logit_scale: scale,
                    logit_softcap: cap,
                    ..meta.clone()
                };
                let mut file = odd.header();
                file.extend(w.iter().flat_map(|x| x.to_le_bytes()));
                if bias {
                    file.extend([0.5f32; 4].iter().flat_map(|x| x.to_le_bytes()));
                }
                let e = decode_head(&file).unwrap_err().to_string();
                assert!(e.contains("logit_softcap"), "{e}");
            }
        }
    }

    /// Sizes an answer states are checked before anything is sized by them: a `k`, a shape or
    /// a head's rows whose products overflow, or that disagree with the data sent, are shape
    /// errors. They were a 4 TiB allocation (the process aborted), an overflow panic, or in a
    /// release build a wrapped product matching an empty buffer (`rows` 2^62 with no data).
    #[test]
    fn answers_stating_sizes_past_memory_are_errors() {
        let shape_err = |r: Result<(), CodecError>| matches!(r, Err(CodecError::Shape(_)));
        let json = |k: &str| {
            format!(
                r#"{{"k":{k},"values":"logprobs","temperature":1.0,"model":"m","results":[{{"topk_ids":[[],[]],"topk_values":[[],[]],"target_logprobs":[0.0,0.0],"logsumexp":[0.0,0.0]}}]}}"#
            )
        };
        for k in ["1099511627776", &usize::MAX.to_string()] {
            let r = decode_response(Format::Json, json(k).as_bytes()).map(|_| ());
            assert!(shape_err(r), "k = {k}");
        }
        assert!(decode_response(Format::Json, json("0").as_bytes()).is_ok());

        let f32s = |n: usize| vec![0u8; 4 * n];
        let pack = |shape: [usize; 2], target: usize, ids_shape: Option<[usize; 2]>| {
            let r = PackResponse {
                k: shape[1],
                values: ValuesKind::Logprobs,
                temperature: 1.0,
                model: "m".into(),
                results: vec![PackSequence {
                    shape,
                    topk_ids: Vec::new().into(),
                    topk_values: Vec::new().into(),
                    target_logprobs: f32s(target).into(),
                    logsumexp: f32s(target).into(),
                    ids_shape,
                    ids_logprobs: ids_shape.map(|_| Vec::new().into()),
                }],
            };
            decode_response(Format::Msgpack, &rmp_serde::to_vec_named(&r).unwrap()).map(|_| ())
        };
        assert!(shape_err(pack([1 << 62, 0], 0, None)));
        assert!(shape_err(pack([1 << 32, 1 << 32], 0, None)));
        assert!(shape_err(pack([1, 0], 1, Some([1, 1 << 62]))));
        assert!(shape_err(pack([1, 0], 1, Some([1, usize::MAX]))));
        assert!(pack([1, 0], 1, Some([1, 0])).is_ok());
        // A sequence's k is the answer's (JSON cannot say otherwise; found by fuzz/answers).
        let sample_bytes = encode_response(Format::Msgpack, &sample()).unwrap();
        let mut r: PackResponse = rmp_serde::from_slice(&sample_bytes).unwrap();
        r.k = 16;
        let bytes = rmp_serde::to_vec_named(&r).unwrap();
        assert!(shape_err(
            decode_response(Format::Msgpack, &bytes).map(|_| ())
        ));

        let hidden = |rows: usize| {
            let r = PackHidden {
                model: "m".into(),
                head_fingerprint: "h".into(),
                dtype: "f32".into(),
                hidden_size: 4,
                results: vec![PackHiddenSequence {
                    shape: [rows, 4],
                    hidden: Vec::new().into(),
                }],
            };
            decode_hidden_response(&rmp_serde::to_vec_named(&r).unwrap()).map(|_| ())
        };
        assert!(shape_err(hidden(1 << 62)));
        assert!(hidden(0).is_ok());

        // A head file's header, written by hand (HeadMeta::header would overflow first).
        let head = |rows: usize, hidden: usize, bias: bool| {
            let meta = serde_json::json!({"format": HEAD_FORMAT, "model_fingerprint": "fp",
                "architecture": "a", "vocab_size": "1", "head_rows": rows.to_string(),
                "hidden_size": hidden.to_string(), "dtype": "f32", "tied": "true",
                "bias": bias.to_string(), "logit_scale": "1.0", "logit_softcap": "none"});
            let tensor = |shape: Vec<usize>| serde_json::json!({"dtype": "F32", "shape": shape, "data_offsets": [0, 0]});
            let mut header = serde_json::json!({"__metadata__": meta,
                "weight": tensor(vec![rows, hidden])});
            if bias {
                header["bias"] = tensor(vec![rows]);
            }
            let json = serde_json::to_vec(&header).unwrap();
            let mut file = (json.len() as u64).to_le_bytes().to_vec();
            file.extend(json);
            decode_head(&file).map(|_| ())
        };
        assert!(shape_err(head(1 << 62, 4, false)));
        assert!(shape_err(head(1 << 63, 0, true)));
        assert!(head(0, 4, false).is_ok());
    }

    #[test]
    fn negotiation() {
        assert_eq!(
            Format::from_accept(Some("application/msgpack")),
            Format::Msgpack
        );
        assert_eq!(
            Format::from_accept(Some("text/html, application/msgpack;q=0.9")),
            Format::Msgpack
        );
        assert_eq!(Format::from_accept(Some("*/*")), Format::Json);
        assert_eq!(Format::from_accept(None), Format::Json);
        assert_eq!(
            Format::from_content_type(Some("application/msgpack")),
            Format::Msgpack
        );
    }
}
