//! `serve`: the accept loop over hyper's HTTP/1 connection builder, so that the protections a
//! public server needs are hyper's own: a header-read timeout (a client that sends its request
//! head slowly, or never, is dropped), a bound on open connections, and graceful shutdown that
//! lets in-flight responses finish within a grace period.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

/// Default time a client has to send a request's head (line and headers).
pub const DEFAULT_HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);

/// Default most connections open at once; more are closed as they are accepted.
pub const DEFAULT_MAX_CONNECTIONS: usize = 8192;

/// How [`serve_with`] runs the server.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct ServeOptions {
    /// After shutdown is asked for, how long in-flight responses may still run.
    pub grace: Duration,
    /// Time a client has to send a request's head before its connection is closed.
    pub header_read_timeout: Duration,
    /// Most connections open at once.
    pub max_connections: usize,
}

impl Default for ServeOptions {
    fn default() -> ServeOptions {
        ServeOptions {
            grace: Duration::from_secs(30),
            header_read_timeout: DEFAULT_HEADER_READ_TIMEOUT,
            max_connections: DEFAULT_MAX_CONNECTIONS,
        }
    }
}

impl ServeOptions {
    /// The grace period of shutdown (default 30 s).
    pub fn grace(mut self, grace: Duration) -> ServeOptions {
        self.grace = grace;
        self
    }

    /// The header-read timeout (default 10 s).
    pub fn header_read_timeout(mut self, timeout: Duration) -> ServeOptions {
        self.header_read_timeout = timeout;
        self
    }

    /// The bound on open connections (default 8192).
    pub fn max_connections(mut self, n: usize) -> ServeOptions {
        self.max_connections = n;
        self
    }
}

/// Serves `app` on `listener` until `shutdown` resolves; then stops accepting, lets in-flight
/// responses finish for up to `grace`, and returns (responses still open are dropped, which
/// cancels their requests). The other options at their defaults (see [`serve_with`]).
pub async fn serve(
    listener: TcpListener,
    app: Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
    grace: Duration,
) -> std::io::Result<()> {
    serve_with(listener, app, shutdown, ServeOptions::default().grace(grace)).await
}

/// [`serve`] with every option.
pub async fn serve_with(
    listener: TcpListener,
    app: Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
    options: ServeOptions,
) -> std::io::Result<()> {
    let mut builder = http1::Builder::new();
    builder.timer(TokioTimer::new()).header_read_timeout(options.header_read_timeout);
    let connections = Arc::new(Semaphore::new(options.max_connections));
    let graceful = GracefulShutdown::new();
    // Connections still open when the grace period ends are aborted with the set.
    let mut tasks = tokio::task::JoinSet::new();
    tokio::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            Some(_) = tasks.join_next(), if !tasks.is_empty() => continue,
            accepted = listener.accept() => match accepted {
                Ok(conn) => conn,
                Err(e) => {
                    // Out of file descriptors and the like: wait a little, as axum does.
                    tracing::warn!(error = %e, "accepting a connection failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let Ok(permit) = Arc::clone(&connections).try_acquire_owned() else {
            tracing::warn!(%peer, max = options.max_connections, "too many open connections: closing a new one");
            continue;
        };
        let conn = builder.serve_connection(TokioIo::new(stream), TowerToHyperService::new(app.clone()));
        let conn = graceful.watch(conn);
        tasks.spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(%peer, error = %e, "connection ended with an error");
            }
            drop(permit);
        });
    }
    drop(listener);
    tracing::info!(
        grace_s = options.grace.as_secs_f64(),
        "shutting down: no new connections, finishing in-flight requests"
    );
    tokio::select! {
        () = graceful.shutdown() => {}
        () = tokio::time::sleep(options.grace) => {
            tracing::warn!("grace period over: cancelling the requests still in flight");
        }
    }
    tasks.abort_all();
    Ok(())
}
