//! The accept loop: HTTP/1.1 connections with a header-read timeout, a cap on open connections,
//! and accepting that survives running out of file descriptors. (`axum::serve` sets no timeout:
//! a client that sends half its headers, or nothing, holds its connection forever, and enough
//! of them starve every other client.)
//!
//! - Header timeout: from the moment a connection waits for a request head (a new connection,
//!   or a keep-alive connection after its last answer) until the head is complete; past it the
//!   connection is closed. So it is also the keep-alive idle timeout.
//! - Body timeout: applied where bodies are read ([`crate::app`]), answered with 408.
//! - Connection cap: at most `max_connections` open at once; beyond it new connections wait in
//!   the kernel's backlog until one closes.
//! - File descriptors: the soft limit is raised to the hard one at start ([`raise_fd_limit`]);
//!   an accept that fails for lack of descriptors (EMFILE, ENFILE) or memory is retried after a
//!   short pause instead of ending the server.

use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

/// Connection limits (`teacher --header-timeout-secs --max-connections`).
#[derive(Debug, Clone, Copy)]
pub struct ConnLimits {
    pub header_timeout: Duration,
    pub max_connections: usize,
    /// How long in-flight requests may take to finish after a shutdown signal.
    pub drain_timeout: Duration,
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
        let stream = tokio::select! {
            _ = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
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
        // 3. Serve it on its own task; the slot is freed when the connection ends.
        let svc = TowerToHyperService::new(router.clone());
        let conn = graceful.watch(http.serve_connection(TokioIo::new(stream), svc));
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
