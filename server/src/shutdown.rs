//! The future that ends serving: SIGTERM, ctrl-c, or an internal stop request.

use tokio::sync::watch;

/// Resolves on SIGTERM, SIGINT / ctrl-c, or when `stop` becomes true.
pub async fn signal(mut stop: watch::Receiver<bool>) {
    let ctrl_c = async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    let stopped = async {
        while !*stop.borrow() {
            if stop.changed().await.is_err() {
                // The sender is gone without asking to stop: wait for a signal instead.
                std::future::pending::<()>().await;
            }
        }
    };
    tokio::select! {
        _ = ctrl_c => tracing::info!("ctrl-c: finishing in-flight requests"),
        _ = term => tracing::info!("SIGTERM: finishing in-flight requests"),
        _ = stopped => tracing::info!("stopping"),
    }
}
