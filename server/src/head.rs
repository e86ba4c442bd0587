//! The output head as `GET /v1/head` serves it, and hidden states as `/hidden_states` sends
//! them: tensors in the model's dtype, as their little-endian bytes.
//!
//! The head file is a safetensors file ([`xdistill_shared::codec::HeadMeta::header`]): the
//! header, then the `[rows, H]` weight (then the bias, for a head with one). Its fingerprint is
//! the SHA-256 of exactly those bytes, computed once when the model is loaded (a chunk of rows
//! at a time, never the whole head on the host at once) and checked again on every answer.

use candle_core::{DType, Tensor};
use sha2::{Digest, Sha256};
use xdistill_shared::codec::HeadMeta;
use xdistill_shared::model::Decoder;
use xdistill_shared::protocol::WireDtype;

/// Bytes of head rows copied to the host (and sent) at once.
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
        DType::F32 => {
            let v = flat.to_vec1::<f32>()?;
            out.reserve(v.len() * 4);
            v.iter()
                .for_each(|x| out.extend_from_slice(&x.to_le_bytes()));
        }
        DType::BF16 => {
            let v = flat.to_vec1::<half::bf16>()?;
            out.reserve(v.len() * 2);
            v.iter()
                .for_each(|x| out.extend_from_slice(&x.to_le_bytes()));
        }
        DType::F16 => {
            let v = flat.to_vec1::<half::f16>()?;
            out.reserve(v.len() * 2);
            v.iter()
                .for_each(|x| out.extend_from_slice(&x.to_le_bytes()));
        }
        d => candle_core::bail!("no wire format for tensors of {d:?}"),
    }
    Ok(())
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
        serve.for_each_chunk(|c| {
            sha.update(c);
            true
        })?;
        serve.fingerprint = hex::encode(sha.finalize());
        Ok(serve)
    }

    /// Rows per chunk of [`CHUNK_BYTES`].
    fn chunk_rows(&self) -> usize {
        (CHUNK_BYTES / (self.meta.hidden_size * self.meta.dtype.size()).max(1)).max(1)
    }

    /// Calls `f` with the file's bytes in order: the header, then chunks of the weight's rows;
    /// stops early when `f` returns false. Returns the bytes passed.
    pub fn for_each_chunk(&self, mut f: impl FnMut(&[u8]) -> bool) -> candle_core::Result<u64> {
        let mut sent = self.header.len() as u64;
        if !f(&self.header) {
            return Ok(sent);
        }
        let rows = self.meta.head_rows;
        let step = self.chunk_rows();
        let mut buf = Vec::new();
        for r0 in (0..rows).step_by(step) {
            let n = step.min(rows - r0);
            buf.clear();
            append_le_bytes(&self.weight.narrow(0, r0, n)?, &mut buf)?;
            sent += buf.len() as u64;
            if !f(&buf) {
                break;
            }
        }
        Ok(sent)
    }
}
