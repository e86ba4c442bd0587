//! The accept loop: HTTP/1.1 connections with a header-read timeout, a cap on open connections,
//! and accepting that survives running out of file descriptors. (`axum::serve` sets no timeout:
//! a client that sends half its headers, or nothing, holds its connection forever, and enough
//! of them starve every other client.)
//!
//! - Header timeout: from the moment a connection waits for a request head (a new connection,
//!   or a keep-alive connection after its last answer) until the head is complete; past it the
//!   connection is closed. So it is also the keep-alive idle timeout.
//! - Body timeout: applied where bodies are read ([`crate::routes`]), answered with 408.
//! - Connection cap: at most `max_connections` open at once; beyond it new connections wait in
//!   the kernel's backlog (sized to the cap, [`bind`]) until one closes.
//! - Per-client cap: at most `max_per_client` open at once from one client address; a client
//!   past it gets a 503 JSON answer and its connection is closed, so one careless or hostile
//!   client cannot take every slot from the others (0: no per-client cap; behind a proxy every
//!   connection has the proxy's address). A connection the server closes gives its place back
//!   before the close reaches the client (`Counted`): a client that reconnects as soon as it
//!   reads the end of an answer is never refused for a connection it no longer holds.
//! - Write-stall timeout: a connection whose writes make no progress for `write_timeout` (a
//!   client that stopped reading an answer, e.g. a `/v1/head` download) is closed
//!   (`WriteStall`, in the same wrapper as the share), so a stalled reader holds neither its
//!   slot nor its share for longer.
//! - Answers hyper writes itself (unparsable heads) get JSON bodies ([`crate::hyper_errors`]).
//! - File descriptors: the soft limit is raised to the hard one at start ([`raise_fd_limit`]);
//!   an accept that fails for lack of descriptors (EMFILE, ENFILE) or memory is retried after a
//!   short pause instead of ending the server.

use crate::error::ApiError;
use crate::hyper_errors::HyperErrors;
use axum::Router;
use hyper::rt::{Read, ReadBufCursor, Write};
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::net::{TcpListener, TcpSocket};
use tokio::sync::Semaphore;

/// Connection limits (`teacher --header-timeout-secs --max-connections`).
#[derive(Debug, Clone, Copy)]
pub struct ConnLimits {
    pub header_timeout: Duration,
    pub max_connections: usize,
    /// Most connections open at once from one client address (0: no limit).
    pub max_per_client: usize,
    /// How long in-flight requests may take to finish after a shutdown signal.
    pub drain_timeout: Duration,
    /// Longest a connection's writes may make no progress before it is closed.
    pub write_timeout: Duration,
}

/// Serves `router` on `listener` until `shutdown` resolves, then lets open connections finish
/// their current request (up to `drain_timeout`).
pub async fn serve(
    listener: TcpListener,
    router: Router,
    limits: ConnLimits,
    shutdown: impl Future<Output = ()>,
) {
    let slots = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let clients = Clients::new(limits.max_per_client);
    let graceful = GracefulShutdown::new();
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout)
        .keep_alive(true);
    tokio::pin!(shutdown);
    loop {
        // 1. A free connection slot (beyond the cap, connections wait in the backlog).
        let slot = tokio::select! {
            _ = &mut shutdown => break,
            slot = slots.clone().acquire_owned() => match slot {
                Ok(s) => s,
                Err(_) => break,
            },
        };
        // 2. A connection; out of descriptors is a pause, not the end.
        let (stream, peer) = tokio::select! {
            _ = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok(pair) => pair,
                Err(e) => {
                    if is_resource_exhaustion(&e) {
                        tracing::warn!("accept failed ({e}); retrying in 50 ms");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    } else {
                        tracing::debug!("accept failed: {e}");
                    }
                    continue;
                }
            },
        };
        let _ = stream.set_nodelay(true);
        // 3. Within its client's share, or answered 503 and closed (the slot is freed at once).
        let Some(share) = clients.enter(peer.ip()) else {
            refuse_over_share(stream, peer, limits.max_per_client);
            continue;
        };
        // 4. Serve it on its own task; the share is given back when the server closes the
        //    connection (or it ends), the slot when the connection ends.
        let svc = TowerToHyperService::new(router.clone());
        let io = Counted::new(
            HyperErrors::new(TokioIo::new(stream)),
            share,
            limits.write_timeout,
        );
        let conn = graceful.watch(http.serve_connection(io, svc));
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!("connection ended: {e}");
            }
            drop(slot);
        });
    }
    drop(listener);
    if tokio::time::timeout(limits.drain_timeout, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!(
            "connections still open {:?} after the shutdown signal; closing them",
            limits.drain_timeout
        );
    }
}

/// Binds `addr` with a listen backlog of `backlog` connections (the connection cap: beyond it,
/// new connections wait there; the kernel may lower it to `net.core.somaxconn`).
pub fn bind(addr: SocketAddr, backlog: usize) -> std::io::Result<TcpListener> {
    let socket = match addr {
        SocketAddr::V4(_) => TcpSocket::new_v4()?,
        SocketAddr::V6(_) => TcpSocket::new_v6()?,
    };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(
        u32::try_from(backlog)
            .unwrap_or(u32::MAX)
            .clamp(128, i32::MAX as u32),
    )
}

/// Open connections per client address, for the per-client cap.
#[derive(Clone)]
struct Clients {
    cap: usize,
    open: Arc<Mutex<HashMap<IpAddr, usize>>>,
}

/// One connection's place in its client's share; given back on drop.
struct Share {
    ip: IpAddr,
    open: Arc<Mutex<HashMap<IpAddr, usize>>>,
}

impl Clients {
    fn new(cap: usize) -> Clients {
        Clients {
            cap,
            open: Arc::default(),
        }
    }

    /// A place for one more connection from `ip`, or `None` when it already has `cap`.
    fn enter(&self, ip: IpAddr) -> Option<Share> {
        let mut open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        let n = open.entry(ip).or_insert(0);
        if self.cap > 0 && *n >= self.cap {
            return None;
        }
        *n += 1;
        Some(Share {
            ip,
            open: self.open.clone(),
        })
    }
}

impl Drop for Share {
    fn drop(&mut self) {
        let mut open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = open.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                open.remove(&self.ip);
            }
        }
    }
}

/// A connection that holds its client's [`Share`] until the server shuts its side down (or the
/// connection is dropped), and fails its writes once they have made no progress for the write
/// timeout ([`WriteStall`]; hyper then closes the connection). The share is given back *before*
/// the shutdown is passed on, so by the time the client sees the end of the stream its place is
/// free again; given back after, a client reconnecting at once could still find its old
/// connection counted and be refused.
struct Counted<T> {
    inner: T,
    share: Option<Share>,
    stall: WriteStall,
}

impl<T> Counted<T> {
    fn new(inner: T, share: Share, write_timeout: Duration) -> Counted<T> {
        Counted {
            inner,
            share: Some(share),
            stall: WriteStall::new(write_timeout),
        }
    }
}

/// The clock of a connection's stalled writes: started by the first write (or flush) that
/// cannot proceed, cleared by any that does; once it has run for `limit`, the pending write
/// fails with `TimedOut`. It wakes the connection's task itself, so a client that reads nothing
/// more is closed on time even though its socket never becomes writable again.
struct WriteStall {
    limit: Duration,
    /// Set while writes are blocked (made on the first stall, reset on later ones).
    timer: Option<Pin<Box<tokio::time::Sleep>>>,
    stalled: bool,
}

impl WriteStall {
    fn new(limit: Duration) -> WriteStall {
        WriteStall {
            limit,
            timer: None,
            stalled: false,
        }
    }

    /// `r`, the outcome of a write (`wrote`) or of a flush or shutdown, seen by the clock: a
    /// write that went through clears it (a flush that did proves nothing: it only follows
    /// writes); one that is blocked starts it (or checks it) and becomes `TimedOut` once it has
    /// run out.
    fn watch<R>(
        &mut self,
        cx: &mut Context<'_>,
        r: Poll<io::Result<R>>,
        wrote: bool,
    ) -> Poll<io::Result<R>> {
        if r.is_ready() {
            if wrote {
                self.stalled = false;
            }
            return r;
        }
        let deadline = tokio::time::Instant::now() + self.limit;
        let timer = self
            .timer
            .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
        if !self.stalled {
            self.stalled = true;
            timer.as_mut().reset(deadline);
        }
        match timer.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!(
                    "no write progress for {:?} (--write-timeout-secs): closing the connection",
                    self.limit
                ),
            ))),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl<T: Read + Unpin> Read for Counted<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: ReadBufCursor<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_read(cx, buf)
    }
}

impl<T: Write + Unpin> Write for Counted<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let r = Pin::new(&mut this.inner).poll_write(cx, buf);
        this.stall.watch(cx, r, true)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let r = Pin::new(&mut this.inner).poll_write_vectored(cx, bufs);
        this.stall.watch(cx, r, true)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let r = Pin::new(&mut this.inner).poll_flush(cx);
        this.stall.watch(cx, r, false)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        this.share = None;
        let r = Pin::new(&mut this.inner).poll_shutdown(cx);
        this.stall.watch(cx, r, false)
    }
}

/// Answers a connection past its client's share with a 503 and closes it. The close lingers
/// (what the client sends meanwhile is read and dropped, for at most a second and 64 KiB) so
/// that unread request bytes do not turn the close into a reset that loses the answer.
fn refuse_over_share(stream: tokio::net::TcpStream, peer: SocketAddr, cap: usize) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    tracing::debug!("{peer}: over the per-client cap of {cap} connections");
    let e = ApiError::TooManyConnections { limit: cap };
    let body = serde_json::to_vec(&e.body()).unwrap_or_default();
    let mut out = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: {}\r\ncontent-length: {}\r\n\
         retry-after: 1\r\nconnection: close\r\n\r\n",
        xdistill_shared::codec::JSON,
        body.len()
    )
    .into_bytes();
    out.extend_from_slice(&body);
    tokio::spawn(async move {
        let mut stream = stream;
        let linger = async {
            stream.write_all(&out).await?;
            stream.shutdown().await?;
            let mut sink = [0u8; 4096];
            let mut left = 64 * 1024usize;
            while left > 0 {
                let n = stream.read(&mut sink).await?;
                if n == 0 {
                    break;
                }
                left = left.saturating_sub(n);
            }
            Ok::<_, std::io::Error>(())
        };
        let _ = tokio::time::timeout(Duration::from_secs(1), linger).await;
    });
}

/// Errors after which accepting again soon may succeed (descriptors or memory freed).
fn is_resource_exhaustion(e: &std::io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM)
    )
}

/// Raises the soft limit on open files to the hard limit; returns the limit now in force.
pub fn raise_fd_limit() -> std::io::Result<libc::rlim_t> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit only read or write the struct passed by pointer.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        if lim.rlim_cur < lim.rlim_max {
            let raised = libc::rlimit {
                rlim_cur: lim.rlim_max,
                rlim_max: lim.rlim_max,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &raised) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            lim.rlim_cur = lim.rlim_max;
        }
    }
    Ok(lim.rlim_cur)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn per_client_shares() {
        let c = Clients::new(2);
        let a: IpAddr = "127.0.0.1".parse().unwrap();
        let b: IpAddr = "127.0.0.2".parse().unwrap();
        let (s1, s2) = (c.enter(a).unwrap(), c.enter(a).unwrap());
        assert!(c.enter(a).is_none());
        let other = c.enter(b);
        assert!(other.is_some());
        drop(s1);
        assert!(c.enter(a).is_some());
        drop((s2, other));
        assert!(c.open.lock().unwrap().get(&b).is_none());
        let unlimited = Clients::new(0);
        let all: Vec<_> = (0..10).map(|_| unlimited.enter(a).unwrap()).collect();
        assert_eq!(all.len(), 10);
    }

    /// A writer that records, when it is shut down, how many connections its client holds.
    struct ShutdownProbe {
        clients: Clients,
        ip: IpAddr,
        open_at_shutdown: Option<usize>,
    }

    impl Write for ShutdownProbe {
        fn poll_write(
            self: Pin<&mut Self>,
            _: &mut Context<'_>,
            buf: &[u8],
        ) -> Poll<io::Result<usize>> {
            Poll::Ready(Ok(buf.len()))
        }
        fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }
        fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            let this = self.get_mut();
            let open = this.clients.open.lock().unwrap();
            this.open_at_shutdown = Some(open.get(&this.ip).copied().unwrap_or(0));
            Poll::Ready(Ok(()))
        }
    }

    /// The share is given back before the server's shutdown reaches the socket (the client can
    /// reconnect as soon as it reads the end of the stream), and on drop when never shut down.
    #[test]
    fn a_closed_connection_gives_its_share_back_before_the_client_sees_the_close() {
        let c = Clients::new(1);
        let ip: IpAddr = "127.0.0.1".parse().unwrap();
        let probe = ShutdownProbe {
            clients: c.clone(),
            ip,
            open_at_shutdown: None,
        };
        let mut conn = Counted::new(probe, c.enter(ip).unwrap(), Duration::from_secs(60));
        assert!(c.enter(ip).is_none(), "the open connection holds the share");
        let waker = futures::task::noop_waker();
        let mut cx = Context::from_waker(&waker);
        let r = Pin::new(&mut conn).poll_shutdown(&mut cx);
        assert!(matches!(r, Poll::Ready(Ok(()))));
        assert_eq!(conn.inner.open_at_shutdown, Some(0));
        assert!(c.enter(ip).is_some());

        let dropped = Counted::new(
            ShutdownProbe {
                clients: c.clone(),
                ip,
                open_at_shutdown: None,
            },
            c.enter(ip).unwrap(),
            Duration::from_secs(60),
        );
        assert!(c.enter(ip).is_none());
        drop(dropped);
        assert!(c.enter(ip).is_some());
    }

    /// A writer that takes `gap` to accept each write (it wakes its task when it will).
    struct SlowWriter {
        ready_at: std::time::Instant,
        gap: Duration,
    }

    impl Write for SlowWriter {
        fn poll_write(
            self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            buf: &[u8],
        ) -> Poll<io::Result<usize>> {
            let now = std::time::Instant::now();
            if now >= self.ready_at {
                self.get_mut().ready_at = now + self.gap;
                return Poll::Ready(Ok(buf.len()));
            }
            let (waker, wait) = (cx.waker().clone(), self.ready_at - now);
            std::thread::spawn(move || {
                std::thread::sleep(wait);
                waker.wake();
            });
            Poll::Pending
        }
        fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }
        fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }
    }

    /// Writes that make no progress for the write timeout fail with `TimedOut`; writes that
    /// are each slow but keep going do not, however long they take in all.
    #[tokio::test]
    async fn stalled_writes_fail_after_the_write_timeout() {
        let c = Clients::new(0);
        let ip: IpAddr = "127.0.0.1".parse().unwrap();
        let limit = Duration::from_millis(60);
        let conn = |gap| {
            let w = SlowWriter {
                ready_at: std::time::Instant::now() + gap,
                gap,
            };
            Counted::new(w, c.enter(ip).unwrap(), limit)
        };
        let mut stalled = conn(Duration::from_secs(3600));
        let t0 = std::time::Instant::now();
        let e = futures::future::poll_fn(|cx| Pin::new(&mut stalled).poll_write(cx, b"x"))
            .await
            .unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::TimedOut, "{e}");
        assert!(e.to_string().contains("--write-timeout-secs"), "{e}");
        let took = t0.elapsed();
        assert!(took >= limit && took < Duration::from_secs(5), "{took:?}");
        let mut slow = conn(Duration::from_millis(20));
        let t0 = std::time::Instant::now();
        for _ in 0..10 {
            let n = futures::future::poll_fn(|cx| Pin::new(&mut slow).poll_write(cx, b"xy"))
                .await
                .unwrap();
            assert_eq!(n, 2);
        }
        assert!(t0.elapsed() > 2 * limit);
    }

    #[test]
    fn exhaustion_is_recognised() {
        for code in [libc::EMFILE, libc::ENFILE] {
            assert!(is_resource_exhaustion(&std::io::Error::from_raw_os_error(
                code
            )));
        }
        assert!(!is_resource_exhaustion(&std::io::Error::from_raw_os_error(
            libc::ECONNABORTED
        )));
    }
}
