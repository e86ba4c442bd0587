//! How much of a teacher's answer the client reads. Every answer has a limit derived from what
//! was asked, so that a broken peer (a proxy streaming without end, a wrong URL serving a large
//! file) is a clear error, not the trainer's memory filling until the kernel kills the run.

use super::ClientError;
use bytes::{Bytes, BytesMut};
use reqwest::Url;
use xdistill_shared::codec;
use xdistill_shared::protocol::{HiddenRequest, TopkRequest};

/// An error answer: this much is read, the rest dropped (its message shows 300 characters).
pub const ERROR_BODY: u64 = 64 << 10;
/// `/health` and `/v1/info`.
pub const SMALL_BODY: u64 = 16 << 20;
/// `/tokenizer.json`: the limit the model loader puts on the file.
pub const TOKENIZER_BODY: u64 = xdistill_shared::hf::limits::TOKENIZER_JSON;
/// Room for the parts of an answer the request does not size (the model's name).
const SLACK: u64 = 64 << 10;

/// Rows the teacher answers for each sequence of a request (`len − 1 − start`).
fn rows<'a>(
    sequences: &'a [Vec<u32>],
    start_of: impl Fn(usize) -> usize + 'a,
) -> impl Iterator<Item = usize> + 'a {
    sequences
        .iter()
        .enumerate()
        .map(move |(i, s)| s.len().saturating_sub(1 + start_of(i)))
}

/// The most a `/topk_logits` answer to `req` can take, in either format.
pub fn topk_limit(req: &TopkRequest) -> u64 {
    let m = req
        .ids
        .as_ref()
        .and_then(|ids| ids.iter().flatten().map(Vec::len).max())
        .unwrap_or(0);
    let bytes = codec::topk_response_bytes(rows(&req.sequences, |i| req.start_of(i)), req.k, m);
    (bytes as u64).saturating_add(SLACK)
}

/// The most a `/hidden_states` answer to `req` can take: its states in f32 (the widest dtype).
pub fn hidden_limit(req: &HiddenRequest, hidden_size: usize) -> u64 {
    let row_bytes = hidden_size.saturating_mul(4);
    let bytes = codec::hidden_response_bytes(rows(&req.sequences, |i| req.start_of(i)), row_bytes);
    (bytes as u64).saturating_add(SLACK)
}

/// The body of `resp`, at most `limit` bytes: a declared length over it is refused before a
/// byte is read, a body that runs past it (chunked, or longer than declared) once it does.
pub async fn read(
    url: &Url,
    mut resp: reqwest::Response,
    limit: u64,
) -> Result<Bytes, ClientError> {
    let too_large = || ClientError::TooLarge {
        url: url.to_string(),
        limit,
    };
    if resp.content_length().is_some_and(|n| n > limit) {
        return Err(too_large());
    }
    let mut out = BytesMut::with_capacity(resp.content_length().unwrap_or(0) as usize);
    while let Some(chunk) = resp.chunk().await.map_err(|e| transport(url, &e))? {
        if out.len() as u64 + chunk.len() as u64 > limit {
            return Err(too_large());
        }
        out.extend_from_slice(&chunk);
    }
    Ok(out.freeze())
}

/// The first [`ERROR_BODY`] bytes of an error answer (what a transport error left of them
/// too: the status already says what went wrong).
pub async fn read_error(mut resp: reqwest::Response) -> Bytes {
    let mut out = BytesMut::new();
    while let Ok(Some(chunk)) = resp.chunk().await {
        let room = ERROR_BODY as usize - out.len();
        out.extend_from_slice(&chunk[..chunk.len().min(room)]);
        if out.len() == ERROR_BODY as usize {
            break;
        }
    }
    out.freeze()
}

/// A connection or body error of `url`, with its causes (retried).
pub fn transport(url: &Url, e: &reqwest::Error) -> ClientError {
    ClientError::Transport {
        url: url.to_string(),
        message: xdistill_shared::report::error_chain(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The limits follow the request: rows past `start`, k, the widest candidate list.
    #[test]
    fn limits_grow_with_what_was_asked() {
        let mut req = TopkRequest {
            sequences: vec![vec![1; 9], vec![2; 3]],
            k: 4,
            temperature: 1.0,
            start: 0,
            starts: None,
            values: Default::default(),
            ids: None,
        };
        let base = topk_limit(&req);
        assert_eq!(
            base,
            (codec::topk_response_bytes([8, 2].into_iter(), 4, 0) as u64) + SLACK
        );
        req.start = 1;
        assert_eq!(
            topk_limit(&req),
            (codec::topk_response_bytes([7, 1].into_iter(), 4, 0) as u64) + SLACK
        );
        req.ids = Some(vec![vec![vec![1, 2, 3]; 7], vec![vec![4, 5, 6, 7]]]);
        assert_eq!(
            topk_limit(&req),
            (codec::topk_response_bytes([7, 1].into_iter(), 4, 4) as u64) + SLACK
        );
        let h = HiddenRequest {
            sequences: vec![vec![1; 5]],
            start: 0,
            starts: Some(vec![2]),
        };
        assert_eq!(
            hidden_limit(&h, 8),
            (codec::hidden_response_bytes([2].into_iter(), 32) as u64) + SLACK
        );
    }
}
