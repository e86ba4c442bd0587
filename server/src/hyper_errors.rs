//! JSON bodies for the answers hyper writes on its own. A request head that cannot be parsed is
//! answered by hyper itself — 400 (bad request line or header), 414 (target too long), 431
//! (headers too large) — with an empty body, and the connection is closed. The protocol promises
//! a JSON error body on every non-2xx the server writes, so the connection's writer
//! ([`HyperErrors`]) recognises those heads and writes the same status with the body of the
//! matching [`ApiError`] instead.
//!
//! Recognised: a write that is exactly one response head, with status 400, 414 or 431 and
//! `content-length: 0`. The routes never write such a head (their errors always carry a body),
//! so nothing else is touched.

use crate::error::ApiError;
use hyper::rt::{Read, ReadBufCursor, Write};
use std::io;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

/// A connection whose writes pass through, except hyper's bodiless error heads.
pub struct HyperErrors<T> {
    inner: T,
    /// A rewritten answer still to be written, and how much of it is.
    pending: Option<(Vec<u8>, usize)>,
}

impl<T> HyperErrors<T> {
    pub fn new(inner: T) -> HyperErrors<T> {
        HyperErrors {
            inner,
            pending: None,
        }
    }
}

/// The JSON answer that replaces `head`, when `head` is one of hyper's bodiless error heads.
pub fn rewrite(head: &[u8]) -> Option<Vec<u8>> {
    // hyper's heads are short; answers' writes are not looked into.
    if head.len() > 512 || !head.starts_with(b"HTTP/1.") {
        return None;
    }
    let text = std::str::from_utf8(head).ok()?;
    let end = text.find("\r\n\r\n")?;
    if end + 4 != text.len() {
        return None;
    }
    let mut lines = text[..end].split("\r\n");
    let status_line = lines.next()?;
    let mut parts = status_line.splitn(3, ' ');
    let version = parts.next()?;
    if !version.starts_with("HTTP/1.") {
        return None;
    }
    let status: u16 = parts.next()?.parse().ok()?;
    let error = ApiError::of_connection_status(status)?;
    let mut kept = Vec::new();
    let mut empty = false;
    for line in lines {
        let (name, value) = line.split_once(':')?;
        if name.eq_ignore_ascii_case("content-length") {
            empty = value.trim() == "0";
        } else if !name.eq_ignore_ascii_case("connection") {
            kept.push(line);
        }
    }
    if !empty {
        return None;
    }
    let body = serde_json::to_vec(&error.body()).ok()?;
    let mut out = format!(
        "{status_line}\r\ncontent-type: {}\r\ncontent-length: {}\r\nconnection: close\r\n",
        xdistill_shared::codec::JSON,
        body.len()
    )
    .into_bytes();
    for line in kept {
        out.extend_from_slice(line.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"\r\n");
    out.extend_from_slice(&body);
    Some(out)
}

impl<T: Write + Unpin> HyperErrors<T> {
    /// Writes what is pending; `Ready(Ok)` once nothing is.
    fn drain(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while let Some((buf, at)) = &mut self.pending {
            let n = ready!(Pin::new(&mut self.inner).poll_write(cx, &buf[*at..]))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            *at += n;
            if *at == buf.len() {
                self.pending = None;
            }
        }
        Poll::Ready(Ok(()))
    }
}

impl<T: Read + Unpin> Read for HyperErrors<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: ReadBufCursor<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_read(cx, buf)
    }
}

impl<T: Write + Unpin> Write for HyperErrors<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        ready!(this.drain(cx))?;
        if let Some(out) = rewrite(buf) {
            this.pending = Some((out, 0));
            // The original bytes are taken; the replacement goes out now or on the next poll.
            let _ = this.drain(cx)?;
            return Poll::Ready(Ok(buf.len()));
        }
        Pin::new(&mut this.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        ready!(this.drain(cx))?;
        let mut non_empty = bufs.iter().filter(|b| !b.is_empty());
        if let (Some(only), None) = (non_empty.next(), non_empty.next()) {
            if let Some(out) = rewrite(only) {
                this.pending = Some((out, 0));
                let _ = this.drain(cx)?;
                return Poll::Ready(Ok(only.len()));
            }
        }
        Pin::new(&mut this.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(this.drain(cx))?;
        Pin::new(&mut this.inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(this.drain(cx))?;
        Pin::new(&mut this.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hyper_error_heads_get_json_bodies() {
        let head = b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-length: 0\r\n\
                     date: Thu, 26 Nov 2026 01:00:00 GMT\r\n\r\n";
        let out = String::from_utf8(rewrite(head).unwrap()).unwrap();
        let (h, body) = out.split_once("\r\n\r\n").unwrap();
        assert!(
            h.starts_with("HTTP/1.1 431 Request Header Fields Too Large\r\n"),
            "{h}"
        );
        assert!(h.contains("content-type: application/json"), "{h}");
        assert!(
            h.contains(&format!("content-length: {}", body.len())),
            "{h}"
        );
        assert!(h.contains("date: Thu"), "{h}");
        let v: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(v["error"]["type"], "headers_too_large");
        assert_eq!(v["error"]["code"], 431);
        for status in ["400 Bad Request", "414 URI Too Long"] {
            let head = format!("HTTP/1.1 {status}\r\ncontent-length: 0\r\n\r\n");
            assert!(rewrite(head.as_bytes()).is_some(), "{status}");
        }
        // Anything else passes through: other statuses, heads with a body, partial writes.
        for other in [
            "HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n",
            "HTTP/1.1 400 Bad Request\r\ncontent-length: 12\r\n\r\n",
            "HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n{}",
            "HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n",
        ] {
            assert!(rewrite(other.as_bytes()).is_none(), "{other}");
        }
    }
}
