//! The output head as `GET /v1/head` serves it, and hidden states as `/hidden_states` sends
//! them: tensors in the model's dtype, as their little-endian bytes.
//!
//! The head file is a safetensors file ([`xdistill_shared::codec::HeadMeta::header`]): the
//! header, then the `[rows, H]` weight (then the bias, for a head with one). Its fingerprint is
//! the SHA-256 of exactly those bytes, computed once when the model is loaded (a chunk of rows
//! at a time, never the whole head on the host at once) and checked again on every answer of
//! the whole file. `GET /v1/head` streams it a piece at a time as the client takes it
//! ([`PIECE_BYTES`]), and serves single byte ranges ([`head_answer`]).

use candle_core::{DType, Tensor};
use sha2::{Digest, Sha256};
use std::ops::Range;
use std::sync::Arc;
use xdistill_shared::codec::HeadMeta;
use xdistill_shared::model::Decoder;
use xdistill_shared::protocol::WireDtype;

/// Bytes of head rows copied to the host at once while the fingerprint is computed at start.
pub const CHUNK_BYTES: usize = 8 << 20;

/// The wire dtype of a tensor's dtype, when it has one.
pub fn wire_dtype(d: DType) -> Option<WireDtype> {
    match d {
        DType::F32 => Some(WireDtype::F32),
        DType::BF16 => Some(WireDtype::Bf16),
        DType::F16 => Some(WireDtype::F16),
        _ => None,
    }
}

/// Little-endian bytes of `t` (any shape) in its own dtype, appended to `out`.
pub fn append_le_bytes(t: &Tensor, out: &mut Vec<u8>) -> candle_core::Result<()> {
    let flat = t.flatten_all()?;
    match t.dtype() {
        DType::F32 => extend_le(&flat.to_vec1::<f32>()?, out),
        DType::BF16 => extend_le(&flat.to_vec1::<half::bf16>()?, out),
        DType::F16 => extend_le(&flat.to_vec1::<half::f16>()?, out),
        d => candle_core::bail!("no wire format for tensors of {d:?}"),
    }
    Ok(())
}

/// The little-endian bytes of the scalars `v`, appended to `out`: on a little-endian host their
/// memory, in one copy (a value-by-value loop, unoptimised in test builds, was a few percent of
/// the tests that download heads or hidden states).
fn extend_le<T: bytemuck::Pod>(v: &[T], out: &mut Vec<u8>) {
    #[cfg(target_endian = "little")]
    out.extend_from_slice(bytemuck::cast_slice(v));
    #[cfg(target_endian = "big")]
    for x in v {
        out.extend(bytemuck::bytes_of(x).iter().rev());
    }
}

/// The head the server serves: the decoder's LM head tensor (shared with the worker, never
/// copied whole), its file header and the fingerprint of the whole file.
#[derive(Debug)]
pub struct HeadServe {
    /// `[rows, H]` in the model's dtype, on the model's device.
    pub weight: Tensor,
    pub meta: HeadMeta,
    /// The file's header bytes ([`HeadMeta::header`]).
    pub header: Vec<u8>,
    /// SHA-256 hex of the file.
    pub fingerprint: String,
    /// Length of the file.
    pub len: u64,
}

impl HeadServe {
    /// The head of `decoder`, fingerprinted (reads the whole head once, a chunk at a time).
    pub fn new(
        decoder: &Decoder,
        model_fingerprint: &str,
        architecture: &str,
        vocab_size: usize,
    ) -> candle_core::Result<HeadServe> {
        let weight = decoder.lm_head().clone();
        let (rows, h) = weight.dims2()?;
        let dtype = wire_dtype(weight.dtype()).ok_or_else(|| {
            candle_core::Error::Msg(format!("a head of {:?} cannot be served", weight.dtype()))
        })?;
        let meta = HeadMeta {
            model_fingerprint: model_fingerprint.to_string(),
            architecture: architecture.to_string(),
            vocab_size,
            head_rows: rows,
            hidden_size: h,
            dtype,
            tied: decoder.config().tie_word_embeddings,
            // No architecture served here has a head bias, a logit scale or a final soft-cap
            // (a config that sets one is refused at start: docs/models.md).
            bias: false,
            logit_scale: 1.0,
            logit_softcap: None,
        };
        let header = meta.header();
        let mut serve = HeadServe {
            weight,
            len: meta.file_len(),
            meta,
            header,
            fingerprint: String::new(),
        };
        let mut sha = Sha256::new();
        let mut pos = 0;
        while pos < serve.len {
            let piece = serve.bytes_at(pos, CHUNK_BYTES)?;
            sha.update(&piece);
            pos += piece.len() as u64;
        }
        serve.fingerprint = hex::encode(sha.finalize());
        Ok(serve)
    }

    /// Bytes of one row of the weight.
    fn row_bytes(&self) -> usize {
        (self.meta.hidden_size * self.meta.dtype.size()).max(1)
    }

    /// The file's bytes from offset `pos`: at most `max` of them, and at least one while `pos` is
    /// inside the file. Only the rows that hold them are copied from the tensor (a row more
    /// than `max` when a row is longer).
    pub fn bytes_at(&self, pos: u64, max: usize) -> candle_core::Result<Vec<u8>> {
        let want = (self.len.saturating_sub(pos)).min(max.max(1) as u64) as usize;
        let hlen = self.header.len() as u64;
        if pos < hlen {
            let p = pos as usize;
            return Ok(self.header[p..(p + want).min(self.header.len())].to_vec());
        }
        let off = pos - hlen;
        let row_bytes = self.row_bytes() as u64;
        let (row, within) = ((off / row_bytes) as usize, (off % row_bytes) as usize);
        let rows = self.meta.head_rows;
        if want == 0 || row >= rows {
            candle_core::bail!("offset {pos} is past the head file's {} bytes", self.len);
        }
        let n = (within + want).div_ceil(row_bytes as usize).min(rows - row);
        let mut buf = Vec::with_capacity(n * row_bytes as usize);
        append_le_bytes(&self.weight.narrow(0, row, n)?, &mut buf)?;
        let end = (within + want).min(buf.len());
        if within > 0 || end < buf.len() {
            buf.copy_within(within..end, 0);
            buf.truncate(end - within);
        }
        Ok(buf)
    }

    /// The bytes `range` of the file, as a stream of pieces of at most [`PIECE_BYTES`], each
    /// made only when the previous one has been taken (see [`PIECE_BYTES`]). When `range` is the
    /// whole file its bytes are hashed again as they go and the last piece is only given once
    /// they match the fingerprint: a body that arrives whole is the fingerprinted one.
    pub fn stream(
        self: Arc<Self>,
        range: Range<u64>,
    ) -> impl futures::Stream<Item = std::io::Result<bytes::Bytes>> + Send + 'static {
        let sha = (range.start == 0 && range.end == self.len).then(Sha256::new);
        let start = Piecewise {
            head: self,
            pos: range.start,
            end: range.end,
            sha,
        };
        futures::stream::unfold(Some(start), |state| async move {
            let mut s = state?;
            if s.pos >= s.end {
                return None;
            }
            // Off the async threads: copying rows from a GPU waits for its queue.
            let made = tokio::task::spawn_blocking(move || {
                let piece = s.next_piece();
                (piece, s)
            })
            .await;
            match made {
                Ok((Ok(piece), s)) => Some((Ok(piece), Some(s))),
                Ok((Err(e), _)) => {
                    tracing::error!("/v1/head aborted: {e}");
                    Some((Err(e), None))
                }
                Err(e) => Some((Err(std::io::Error::other(e.to_string())), None)),
            }
        })
    }
}

/// Bytes of the head file made (and handed to the connection) at once by `/v1/head`. The
/// connection asks for the next piece only when its write buffer has room (hyper's, about
/// 400 KiB), that is once the client has taken what came before; so a download holds at most
/// about that buffer and one piece, however slowly the client reads.
pub const PIECE_BYTES: usize = 128 << 10;

/// Where a download stands: the next offset, the end, and the running hash (whole files only).
struct Piecewise {
    head: Arc<HeadServe>,
    pos: u64,
    end: u64,
    sha: Option<Sha256>,
}

impl Piecewise {
    /// The next piece, hashed; the last one of a whole file only when the hash matches.
    fn next_piece(&mut self) -> std::io::Result<bytes::Bytes> {
        let want = (self.end - self.pos).min(PIECE_BYTES as u64) as usize;
        let piece = self
            .head
            .bytes_at(self.pos, want)
            .map_err(|e| std::io::Error::other(format!("reading the head: {e}")))?;
        if piece.is_empty() || piece.len() > want {
            return Err(std::io::Error::other(format!(
                "reading the head at {} gave {} bytes for {want}",
                self.pos,
                piece.len()
            )));
        }
        self.pos += piece.len() as u64;
        if let Some(sha) = &mut self.sha {
            sha.update(&piece);
            if self.pos == self.end && hex::encode(sha.clone().finalize()) != self.head.fingerprint
            {
                return Err(std::io::Error::other(
                    "the head's bytes no longer match its fingerprint",
                ));
            }
        }
        Ok(bytes::Bytes::from(piece))
    }
}

/// What `GET /v1/head` answers, from its conditional and range headers (RFC 9110 §13, §14).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HeadAnswer {
    /// `If-None-Match` names the head (weak comparison): 304.
    NotModified,
    /// 200 with the whole file (no `Range`, one that is ignored, or an `If-Range` that does
    /// not name the head).
    Whole,
    /// 206 with these bytes.
    Part(Range<u64>),
    /// 416: the range starts at or past the end.
    Unsatisfiable(String),
}

/// Whether the entity-tag list `list` (an `If-None-Match` value) names `etag` (quoted) under
/// the weak comparison: `W/"x"` matches `"x"`; `*` matches anything.
fn weak_match(list: &str, etag: &str) -> bool {
    list.split(',').map(str::trim).any(|t| {
        t == "*" || t.strip_prefix("W/").unwrap_or(t) == etag.strip_prefix("W/").unwrap_or(etag)
    })
}

/// The answer to a `GET` of a file of `len` bytes whose strong entity tag is `etag` (quoted),
/// given the request's `If-None-Match` values, `Range` values and `If-Range` value.
/// One byte range per request is served; a list of ranges, another unit or a malformed range
/// is ignored (the whole file: RFC 9110 §14.2 lets a server ignore `Range`).
pub fn head_answer<'a>(
    if_none_match: impl IntoIterator<Item = &'a str>,
    range: &[&str],
    if_range: Option<&str>,
    etag: &str,
    len: u64,
) -> HeadAnswer {
    if if_none_match.into_iter().any(|v| weak_match(v, etag)) {
        return HeadAnswer::NotModified;
    }
    let [range] = range else {
        return HeadAnswer::Whole;
    };
    // If-Range takes the strong comparison: a weak tag (or a date: there is no Last-Modified)
    // never matches, and the whole file is sent.
    if if_range.is_some_and(|v| v.trim() != etag) {
        return HeadAnswer::Whole;
    }
    let Some((unit, spec)) = range.trim().split_once('=') else {
        return HeadAnswer::Whole;
    };
    if !unit.trim().eq_ignore_ascii_case("bytes") || spec.contains(',') {
        return HeadAnswer::Whole;
    }
    let Some((first, last)) = spec.trim().split_once('-') else {
        return HeadAnswer::Whole;
    };
    let num = |s: &str| -> Option<u64> {
        (!s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()))
            .then(|| s.parse().unwrap_or(u64::MAX))
    };
    let (first, last) = (first.trim(), last.trim());
    let wanted = match (num(first), num(last)) {
        // `-n`: the last n bytes.
        (None, Some(n)) if first.is_empty() => {
            if n == 0 || len == 0 {
                return HeadAnswer::Unsatisfiable(range.to_string());
            }
            len - n.min(len)..len
        }
        (Some(a), None) if last.is_empty() => a..len,
        (Some(a), Some(b)) if a <= b => a..b.saturating_add(1).min(len),
        _ => return HeadAnswer::Whole,
    };
    if wanted.start >= len {
        return HeadAnswer::Unsatisfiable(range.to_string());
    }
    HeadAnswer::Part(wanted)
}

#[cfg(test)]
mod tests {
    use super::*;

    const TAG: &str = "\"ab12\"";

    fn answer(inm: &[&str], range: &[&str], if_range: Option<&str>) -> HeadAnswer {
        head_answer(inm.iter().copied(), range, if_range, TAG, 1000)
    }

    /// RFC 9110: weak comparison for If-None-Match, strong for If-Range, one byte range.
    #[test]
    fn conditional_and_range_answers() {
        use HeadAnswer::*;
        for inm in [
            "\"ab12\"",
            "W/\"ab12\"",
            "\"x\", W/\"ab12\"",
            "*",
            " W/\"ab12\" ",
        ] {
            assert_eq!(answer(&[inm], &["bytes=0-1"], None), NotModified, "{inm}");
        }
        assert_eq!(answer(&["W/\"x\"", "\"ab1\""], &[], None), Whole);
        assert_eq!(answer(&[], &["bytes=0-9"], None), Part(0..10));
        assert_eq!(answer(&[], &["bytes=990-"], None), Part(990..1000));
        assert_eq!(answer(&[], &["bytes=-10"], None), Part(990..1000));
        assert_eq!(answer(&[], &["bytes=-5000"], None), Part(0..1000));
        assert_eq!(answer(&[], &["bytes=990-5000"], None), Part(990..1000));
        assert_eq!(answer(&[], &["Bytes = 3-3"], None), Part(3..4));
        assert_eq!(answer(&[], &["bytes=999-999"], Some(TAG)), Part(999..1000));
        for bad in ["bytes=1000-", "bytes=1000-2000", "bytes=-0"] {
            assert_eq!(
                answer(&[], &[bad], None),
                Unsatisfiable(bad.into()),
                "{bad}"
            );
        }
        // Ignored: the whole file.
        for r in [
            "bytes=5-1",
            "bytes=0-1,4-5",
            "items=0-1",
            "bytes=x-1",
            "bytes=-",
            "bytes=1",
            "0-1",
            "bytes=+1-2",
        ] {
            assert_eq!(answer(&[], &[r], None), Whole, "{r}");
        }
        assert_eq!(answer(&[], &["bytes=0-1", "bytes=2-3"], None), Whole);
        for ir in ["W/\"ab12\"", "\"other\"", "Sat, 28 Nov 2026 10:00:00 GMT"] {
            assert_eq!(answer(&[], &["bytes=0-1"], Some(ir)), Whole, "{ir}");
        }
        // Huge numbers do not overflow.
        assert_eq!(
            answer(&[], &["bytes=0-99999999999999999999999"], None),
            Part(0..1000)
        );
        assert_eq!(
            answer(&[], &["bytes=99999999999999999999999-"], None),
            Unsatisfiable("bytes=99999999999999999999999-".into())
        );
    }
}
