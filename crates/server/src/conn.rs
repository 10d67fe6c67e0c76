//! The connection layer: accepting TCP connections and speaking HTTP/1.1 on them, with the
//! limits a server exposed to hostile clients needs before any request reaches a handler
//! (and before any API key is checked).
//!
//! * At most [`ConnectionLimits::max_connections`] connections are open at once. One more is
//!   answered at once with a 503 in OpenAI's error shape (and `Retry-After`) and closed,
//!   never left hanging; the cap sits well below the descriptor limit, so `accept` itself
//!   keeps working and `/health` keeps answering.
//! * A connection has [`ConnectionLimits::header_timeout`] to send a request's headers,
//!   counted from when it opens or when its previous response ended: a connection that sends
//!   nothing, sends headers byte by byte, or idles between keep-alive requests is closed.
//! * A request body must arrive within `AppState::body_timeout` (the handlers read it;
//!   a 408 otherwise), so a Content-Length larger than the body, or a body trickled one
//!   byte at a time, cannot hold a connection.
//! * A response that the client stops reading is dropped after
//!   [`ConnectionLimits::send_timeout`] without progress, and its generation with it.
//! * The errors hyper answers by itself, before any handler runs (400 for an unparsable
//!   request or Content-Length, 414, 431), carry OpenAI's error body like every other error.

use std::future::Future;
use std::io;
use std::pin::{pin, Pin};
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use axum::http::StatusCode;
use axum::Router;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Semaphore};
use tokio::time::{sleep, Sleep};

use crate::error::ApiError;

/// The limits of the connection layer (see the module documentation).
#[derive(Debug, Clone)]
pub struct ConnectionLimits {
    pub max_connections: usize,
    /// For a request's headers, from when the connection opens or its previous response
    /// ends; so also the longest a keep-alive connection may idle.
    pub header_timeout: Duration,
    /// The longest a response write may make no progress.
    pub send_timeout: Duration,
    /// Bytes of a request's start line and headers (431 beyond).
    pub max_header_bytes: usize,
}

impl Default for ConnectionLimits {
    fn default() -> Self {
        Self {
            max_connections: 256,
            header_timeout: Duration::from_secs(10),
            send_timeout: Duration::from_secs(30),
            // Room for hyper's own 64 KiB URI limit (414), so that limit stays the one
            // that answers an over-long URI.
            max_header_bytes: 72 * 1024,
        }
    }
}

/// Refused connections being answered at once (see [`refuse`]).
const ANSWERING_REFUSALS: usize = 16;

/// Descriptors the process needs besides its connections: listeners, the runtime's
/// poller, standard streams, the model file while it loads, and the refused connections
/// being answered.
pub const RESERVED_DESCRIPTORS: u64 = 24 + ANSWERING_REFUSALS as u64;

/// The soft limit on open files (Linux's `/proc/self/limits`), if it can be read.
pub fn open_files_limit() -> Option<u64> {
    let limits = std::fs::read_to_string("/proc/self/limits").ok()?;
    let line = limits.lines().find(|l| l.starts_with("Max open files"))?;
    line.split_whitespace().nth(3)?.parse().ok()
}

/// Serves `router` on `listener` under `limits` until `shutdown` resolves; then stops
/// accepting, lets open requests finish and closes idle connections, and returns once every
/// connection has ended.
pub async fn serve_router(
    listener: TcpListener,
    router: Router,
    limits: ConnectionLimits,
    shutdown: impl Future<Output = ()>,
) -> io::Result<()> {
    let max = limits.max_connections.clamp(1, Semaphore::MAX_PERMITS);
    let places = Arc::new(Semaphore::new(max));
    let refusals = Arc::new(Semaphore::new(ANSWERING_REFUSALS));
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut shutdown = pin!(shutdown);
    loop {
        let stream = tokio::select! {
            () = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    // Per-connection failures (reset before accept) are nothing to wait
                    // for; resource exhaustion is, briefly, rather than spinning.
                    if !matches!(
                        e.kind(),
                        io::ErrorKind::ConnectionAborted | io::ErrorKind::ConnectionReset
                    ) {
                        tracing::error!("accept failed: {e}");
                        sleep(Duration::from_millis(100)).await;
                    }
                    continue;
                }
            },
        };
        let Ok(place) = places.clone().try_acquire_owned() else {
            refuse(stream, max, &refusals);
            continue;
        };
        let _ = stream.set_nodelay(true);
        let service = TowerToHyperService::new(router.clone());
        let limits = limits.clone();
        let mut stop = stop_rx.clone();
        tokio::spawn(async move {
            let _place = place;
            let io = TokioIo::new(GuardedIo::new(stream, limits.send_timeout));
            let mut builder = http1::Builder::new();
            builder
                .timer(TokioTimer::new())
                .header_read_timeout(limits.header_timeout)
                .max_header_size(limits.max_header_bytes)
                // One contiguous buffer per write, so that GuardedIo sees a response head
                // whole (it rewrites hyper's own error responses).
                .writev(false);
            let conn = builder.serve_connection(io, service);
            let mut conn = pin!(conn);
            // The guard `wait_for` returns must not live across an await.
            let stopping = async move {
                let _ = stop.wait_for(|stop| *stop).await.map(|_| ());
            };
            let ended = tokio::select! {
                ended = conn.as_mut() => ended,
                () = stopping => {
                    conn.as_mut().graceful_shutdown();
                    conn.await
                }
            };
            if let Err(e) = ended {
                // Timeouts and clients that vanish are routine on an exposed server.
                tracing::debug!("connection ended: {e}");
            }
        });
    }
    let _ = stop_tx.send(true);
    // Every connection holds a place until it ends: having them all back means all ended.
    let _ = places.acquire_many(max as u32).await;
    Ok(())
}

/// Answers a connection over the cap with a 503 and closes it. Closing a socket whose
/// request was not read makes the kernel reset the connection, and a reset can destroy
/// the answer before the client reads it; so the answer is followed by an orderly close
/// and what the client sent is read and dropped, for at most a second, by one of a few
/// tasks (a bounded number of descriptors). When all of those are busy, the answer is
/// written and the socket closed at once.
fn refuse(stream: TcpStream, max: usize, refusals: &Arc<Semaphore>) {
    tracing::warn!("connection refused: {max} connections already open");
    let reply = raw_error(&ApiError::TooManyConnections { limit: max });
    let Ok(permit) = refusals.clone().try_acquire_owned() else {
        let _ = stream.try_write(&reply);
        return;
    };
    tokio::spawn(async move {
        let _permit = permit;
        let mut stream = stream;
        let answer = async {
            stream.write_all(&reply).await?;
            stream.shutdown().await?;
            let mut sink = [0u8; 4096];
            let mut drained = 0;
            while drained < 64 * 1024 {
                match stream.read(&mut sink).await? {
                    0 => break,
                    n => drained += n,
                }
            }
            io::Result::Ok(())
        };
        let _ = tokio::time::timeout(Duration::from_secs(1), answer).await;
    });
}

/// A complete HTTP/1.1 response carrying `error` in OpenAI's shape (status, body and
/// `Retry-After` from the single mapping in [`ApiError`]), closing the connection.
pub fn raw_error(error: &ApiError) -> Vec<u8> {
    let status = error.status();
    let body = error.body().to_string();
    let mut head = format!(
        "HTTP/1.1 {} {}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n",
        status.as_u16(),
        status.canonical_reason().unwrap_or(""),
        body.len()
    );
    if let Some(secs) = error.retry_after() {
        head.push_str(&format!("retry-after: {secs}\r\n"));
    }
    head.push_str("\r\n");
    let mut out = head.into_bytes();
    out.extend_from_slice(body.as_bytes());
    out
}

/// If `buf` is one of the responses hyper writes by itself when it cannot parse a request
/// (a bare status line and `content-length: 0`; the handlers' error responses always have a
/// JSON body), the same answer in OpenAI's error shape.
fn rewrite_bare_error(buf: &[u8]) -> Option<Vec<u8>> {
    let rest = buf.strip_prefix(b"HTTP/1.1 ")?;
    let code: u16 = std::str::from_utf8(rest.get(..3)?).ok()?.parse().ok()?;
    if !matches!(code, 400 | 408 | 413 | 414 | 431) {
        return None;
    }
    let end = buf.windows(4).position(|w| w == b"\r\n\r\n")? + 4;
    if end != buf.len() {
        return None;
    }
    let head = std::str::from_utf8(&buf[..end]).ok()?.to_ascii_lowercase();
    if !head.contains("\r\ncontent-length: 0\r\n") {
        return None;
    }
    let status = StatusCode::from_u16(code).ok()?;
    Some(raw_error(&ApiError::Http { status }))
}

/// The TCP stream as the connection sees it: a write that makes no progress for
/// `send_timeout` fails (closing the connection), and hyper's bare error responses are
/// replaced by ones in OpenAI's error shape.
struct GuardedIo<S> {
    stream: S,
    send_timeout: Duration,
    /// Armed while a write waits on a client that does not read.
    stalled: Option<Pin<Box<Sleep>>>,
    /// A replacement being written: its bytes, how many went out, and the length of the
    /// original write to report once it is all out.
    rewrite: Option<(Vec<u8>, usize, usize)>,
}

impl<S: AsyncRead + AsyncWrite + Unpin> GuardedIo<S> {
    fn new(stream: S, send_timeout: Duration) -> Self {
        Self {
            stream,
            send_timeout,
            stalled: None,
            rewrite: None,
        }
    }

    /// For a write that is pending: true once writes have been pending for
    /// `send_timeout` (the timer wakes the task then, if nothing else does first).
    fn stalled_too_long(&mut self, cx: &mut Context<'_>) -> bool {
        let timeout = self.send_timeout;
        let timer = self.stalled.get_or_insert_with(|| Box::pin(sleep(timeout)));
        timer.as_mut().poll(cx).is_ready()
    }

    fn progressed(&mut self) {
        self.stalled = None;
    }

    fn poll_write_guarded(&mut self, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        match Pin::new(&mut self.stream).poll_write(cx, buf) {
            Poll::Ready(r) => {
                self.progressed();
                Poll::Ready(r)
            }
            Poll::Pending if self.stalled_too_long(cx) => Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "the client stopped reading the response",
            ))),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncRead for GuardedIo<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_read(cx, buf)
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncWrite for GuardedIo<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if this.rewrite.is_none() {
            if let Some(replacement) = rewrite_bare_error(buf) {
                this.rewrite = Some((replacement, 0, buf.len()));
            }
        }
        let Some((bytes, mut sent, report)) = this.rewrite.take() else {
            return this.poll_write_guarded(cx, buf);
        };
        while sent < bytes.len() {
            match this.poll_write_guarded(cx, &bytes[sent..]) {
                Poll::Ready(Ok(0)) => return Poll::Ready(Err(io::ErrorKind::WriteZero.into())),
                Poll::Ready(Ok(n)) => sent += n,
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => {
                    // hyper calls again with the same bytes; carry on from here then.
                    this.rewrite = Some((bytes, sent, report));
                    return Poll::Pending;
                }
            }
        }
        Poll::Ready(Ok(report))
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(Pin::new(&mut this.stream).poll_flush(cx))?;
        this.progressed();
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_shutdown(cx)
    }

    fn is_write_vectored(&self) -> bool {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hypers_bare_errors_get_openai_bodies() {
        let bare = b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-length: 0\r\ndate: Mon, 30 Nov 2026 10:00:00 GMT\r\n\r\n";
        let out = rewrite_bare_error(bare).unwrap();
        let text = String::from_utf8(out).unwrap();
        assert!(text.starts_with("HTTP/1.1 431 "), "{text}");
        let body: serde_json::Value =
            serde_json::from_str(text.split("\r\n\r\n").nth(1).unwrap()).unwrap();
        assert_eq!(body["error"]["code"], "request_header_fields_too_large");
        assert_eq!(body["error"]["type"], "invalid_request_error");
        for code in [400, 414] {
            let bare = format!("HTTP/1.1 {code} X\r\ncontent-length: 0\r\n\r\n");
            assert!(rewrite_bare_error(bare.as_bytes()).is_some(), "{code}");
        }
        // The handlers' own errors have bodies and pass untouched, as does anything else.
        for other in [
            &b"HTTP/1.1 400 Bad Request\r\ncontent-length: 12\r\n\r\n{\"error\":{}}"[..],
            b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n",
            b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n",
            b"data: HTTP/1.1 400 \r\n\r\n",
            b"1a\r\ndata: {}\r\n\r\n",
        ] {
            assert!(rewrite_bare_error(other).is_none());
        }
    }

    /// A client that stops reading cannot hold a response (and its generation) for ever.
    #[tokio::test]
    async fn a_write_nobody_reads_fails_after_the_send_timeout() {
        let (ours, _theirs) = tokio::io::duplex(64);
        let mut io = GuardedIo::new(ours, Duration::from_millis(50));
        let chunk = [b'x'; 1024];
        // Liveness bound only: the write fails about 50 ms after the buffer fills.
        let written = tokio::time::timeout(Duration::from_secs(30), async {
            loop {
                io.write_all(&chunk).await?;
            }
            #[allow(unreachable_code)]
            io::Result::Ok(())
        })
        .await
        .expect("the stalled write never failed");
        assert_eq!(written.unwrap_err().kind(), io::ErrorKind::TimedOut);
    }

    #[test]
    fn a_raw_refusal_is_a_whole_response() {
        let out = raw_error(&ApiError::TooManyConnections { limit: 8 });
        let text = String::from_utf8(out).unwrap();
        let (head, body) = text.split_once("\r\n\r\n").unwrap();
        assert!(
            head.starts_with("HTTP/1.1 503 Service Unavailable\r\n"),
            "{head}"
        );
        assert!(head.contains("\r\nretry-after: 1"), "{head}");
        assert!(
            head.contains(&format!("\r\ncontent-length: {}", body.len())),
            "{head}"
        );
        let body: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(body["error"]["code"], "too_many_connections");
    }
}
