//! The connection layer: accepting TCP connections and speaking HTTP/1.1 on them, with the
//! limits a server exposed to hostile clients needs before any request reaches a handler
//! (and before any API key is checked).
//!
//! * At most [`ConnectionLimits::max_connections`] connections are open at once, and at
//!   most [`ConnectionLimits::max_per_address`] from one peer address (an IPv6 peer counts
//!   by its /64, which one host can fill with addresses). One more is answered at once with
//!   a 503 in OpenAI's error shape (and `Retry-After`) and closed, never left hanging; the
//!   cap sits well below the descriptor limit, so `accept` itself keeps working, and the
//!   per-address share leaves the rest of the cap to other addresses whatever one address
//!   opens, holds idle or trickles. Behind a proxy every peer is the proxy: raise the share
//!   to the whole cap there, and limit clients in the proxy.
//! * A connection has [`ConnectionLimits::header_timeout`] to send a request's headers,
//!   counted from when it opens or when its previous response ended: a connection that sends
//!   nothing, sends headers byte by byte, or idles between keep-alive requests is closed. Its
//!   first request's headers get only [`ConnectionLimits::first_header_timeout`] (a client
//!   sends them as soon as it connects), so a place taken by a connection that never sends
//!   a request comes back that soon.
//! * A request body must arrive within `AppState::body_timeout` (the handlers read it;
//!   a 408 otherwise), so a Content-Length larger than the body, or a body trickled one
//!   byte at a time, cannot hold a connection.
//! * A response that the client does not keep up with is dropped once the bytes handed to
//!   the socket have not all gone out for [`ConnectionLimits::send_timeout`], however
//!   slowly the client reads meanwhile, and its generation with it (a stream also watches
//!   its own backlog, in events and in bytes hyper holds: `routes::stream`, through
//!   [`ConnectionControl::bytes_sent`]): the connection is reset
//!   (not closed in order, which would leave the kernel trickling what it buffered to the
//!   slow client), so its place and its pages come back within the timeout.
//! * The errors hyper answers by itself, before any handler runs (400 for an unparsable
//!   request or Content-Length, 414, 431), carry OpenAI's error body like every other error.

use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::net::{IpAddr, Ipv6Addr};
use std::pin::{pin, Pin};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{ready, Context, Poll};
use std::time::Duration;

use axum::http::StatusCode;
use axum::{Extension, Router};
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
    /// Of `max_connections`, the most one peer address may hold.
    pub max_per_address: usize,
    /// For a request's headers, from when the connection opens or its previous response
    /// ends; so also the longest a keep-alive connection may idle.
    pub header_timeout: Duration,
    /// For the first request's headers, from when the connection opens (at most
    /// `header_timeout`).
    pub first_header_timeout: Duration,
    /// The longest a response write may make no progress.
    pub send_timeout: Duration,
    /// Bytes of a request's start line and headers (431 beyond).
    pub max_header_bytes: usize,
}

impl Default for ConnectionLimits {
    fn default() -> Self {
        Self {
            max_connections: 256,
            max_per_address: 128,
            header_timeout: Duration::from_secs(10),
            first_header_timeout: Duration::from_secs(3),
            send_timeout: Duration::from_secs(30),
            // Room for hyper's own 64 KiB URI limit (414), so that limit stays the one
            // that answers an over-long URI.
            max_header_bytes: 72 * 1024,
        }
    }
}

/// Bytes a connection's kernel buffer may hold that have not been sent yet.
const UNSENT_BYTES: u32 = 4 * 1024;

/// Keeps a slow client's backlog where the stream sees it (its events not yet taken)
/// rather than in the kernel, whose send buffer grows to megabytes on loopback. On Linux
/// only unsent bytes are capped (`TCP_NOTSENT_LOWAT`), so what is in flight to a distant
/// client is not; elsewhere the whole send buffer is.
fn keep_backlog_in_process(stream: &TcpStream) {
    let socket = socket2::SockRef::from(stream);
    #[cfg(any(target_os = "linux", target_os = "android"))]
    let _ = socket.set_tcp_notsent_lowat(UNSENT_BYTES);
    #[cfg(not(any(target_os = "linux", target_os = "android")))]
    let _ = socket.set_send_buffer_size(UNSENT_BYTES as usize);
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
    let per_address = Arc::new(PerAddress::new(limits.max_per_address.clamp(1, max)));
    let refusals = Arc::new(Semaphore::new(ANSWERING_REFUSALS));
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut shutdown = pin!(shutdown);
    loop {
        let stream = tokio::select! {
            () = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
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
        let (stream, peer) = stream;
        let Some(share) = per_address.take(peer.ip()) else {
            refuse(
                stream,
                ApiError::TooManyConnectionsFromAddress {
                    limit: per_address.limit,
                },
                &refusals,
            );
            continue;
        };
        let Ok(place) = places.clone().try_acquire_owned() else {
            refuse(
                stream,
                ApiError::TooManyConnections { limit: max },
                &refusals,
            );
            continue;
        };
        let _ = stream.set_nodelay(true);
        keep_backlog_in_process(&stream);
        let control = ConnectionControl::new(limits.send_timeout);
        let (reset, sent) = (control.reset.clone(), control.sent.clone());
        let service = TowerToHyperService::new(router.clone().layer(Extension(control)));
        // Set when hyper has a request's headers whole and calls the service.
        let requested = Arc::new(AtomicBool::new(false));
        let service = {
            let requested = requested.clone();
            hyper::service::service_fn(move |request| {
                requested.store(true, Ordering::Relaxed);
                hyper::service::Service::call(&service, request)
            })
        };
        let limits = limits.clone();
        let mut stop = stop_rx.clone();
        tokio::spawn(async move {
            let _place = place;
            let _share = share;
            let io = TokioIo::new(GuardedIo::new(stream, limits.send_timeout, reset, sent));
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
            let first_headers = limits.first_header_timeout.min(limits.header_timeout);
            let never_requested = async move {
                sleep(first_headers).await;
                if requested.load(Ordering::Relaxed) {
                    std::future::pending::<()>().await;
                }
            };
            let ended = tokio::select! {
                // Headers that arrived by the deadline reach the service before it is checked.
                biased;
                ended = conn.as_mut() => ended,
                // Dropping the connection closes it; nothing was asked, so nothing is lost.
                () = never_requested => {
                    tracing::debug!("connection closed: no request headers within {first_headers:?}");
                    return;
                }
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
fn refuse(stream: TcpStream, why: ApiError, refusals: &Arc<Semaphore>) {
    tracing::warn!("connection refused: {why}");
    let reply = raw_error(&why);
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

/// Open connections per peer address, for the per-address share of the cap.
#[derive(Debug)]
struct PerAddress {
    limit: usize,
    open: Mutex<HashMap<IpAddr, usize>>,
}

/// One connection's place in its address's share; dropping it gives the place back.
struct AddressShare {
    table: Arc<PerAddress>,
    key: IpAddr,
}

impl PerAddress {
    fn new(limit: usize) -> Self {
        Self {
            limit,
            open: Mutex::default(),
        }
    }

    /// What one client controls: an IPv4 address, or an IPv6 /64 (an IPv4 address mapped
    /// into IPv6 counts as itself).
    fn key(ip: IpAddr) -> IpAddr {
        match ip {
            IpAddr::V4(_) => ip,
            IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
                Some(v4) => IpAddr::V4(v4),
                None => IpAddr::V6(Ipv6Addr::from(u128::from(v6) & !((1u128 << 64) - 1))),
            },
        }
    }

    fn take(self: &Arc<Self>, ip: IpAddr) -> Option<AddressShare> {
        let key = Self::key(ip);
        // Counts change only in whole steps: a poisoned lock holds consistent data.
        let mut open = self.open.lock().unwrap_or_else(PoisonError::into_inner);
        let n = open.entry(key).or_default();
        if *n >= self.limit {
            return None;
        }
        *n += 1;
        Some(AddressShare {
            table: self.clone(),
            key,
        })
    }
}

impl Drop for AddressShare {
    fn drop(&mut self) {
        let mut open = self
            .table
            .open
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(n) = open.get_mut(&self.key) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                // Only addresses with connections stay in the table.
                open.remove(&self.key);
            }
        }
    }
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

/// A connection that can be reset rather than closed in order.
trait Reset {
    fn reset(&self);
}

impl Reset for TcpStream {
    fn reset(&self) {
        // Linger zero: close sends RST and drops whatever the kernel still buffers.
        let _ = socket2::SockRef::from(self).set_linger(Some(Duration::ZERO));
    }
}

impl Reset for tokio::io::DuplexStream {
    fn reset(&self) {}
}

/// What a request's handler may ask of the connection it came on (a request extension;
/// absent when a router is driven without this layer, as in unit tests).
#[derive(Debug, Clone)]
pub struct ConnectionControl {
    reset: Arc<AtomicBool>,
    /// Bytes the socket has taken on this connection, all responses together.
    sent: Arc<AtomicU64>,
    /// [`ConnectionLimits::send_timeout`]: how long a response may wait on its client.
    pub send_timeout: Duration,
}

impl ConnectionControl {
    fn new(send_timeout: Duration) -> Self {
        Self {
            reset: Arc::default(),
            sent: Arc::default(),
            send_timeout,
        }
    }

    /// Bytes the socket has taken on this connection so far. What a response handed to
    /// hyper beyond this waits in hyper's own buffer (up to 400 KiB, which it fills before
    /// it stops asking the stream for more): the stream compares the two to see a slow
    /// client's backlog there.
    pub fn bytes_sent(&self) -> u64 {
        self.sent.load(Ordering::Relaxed)
    }

    /// Resets the connection when it ends instead of closing it in order, so that bytes
    /// a slow client has not taken yet are not left trickling out of the kernel's buffer.
    pub fn reset_when_closed(&self) {
        self.reset.store(true, Ordering::Relaxed);
    }
}

/// The TCP stream as the connection sees it: a write that makes no progress for
/// `send_timeout` fails (resetting the connection), and hyper's bare error responses are
/// replaced by ones in OpenAI's error shape. A client that reads, but too slowly, is the
/// stream's to detect (it sees the backlog: `routes::stream`), which asks for the reset
/// through [`ConnectionControl`].
struct GuardedIo<S: Reset> {
    stream: S,
    send_timeout: Duration,
    /// Armed while a write waits on a client that does not read.
    stalled: Option<Pin<Box<Sleep>>>,
    /// Set by the request's handler (or a stalled write): reset rather than close.
    reset: Arc<AtomicBool>,
    /// [`ConnectionControl::bytes_sent`].
    sent: Arc<AtomicU64>,
    /// A replacement being written: its bytes, how many went out, and the length of the
    /// original write to report once it is all out.
    rewrite: Option<(Vec<u8>, usize, usize)>,
}

impl<S: Reset> Drop for GuardedIo<S> {
    fn drop(&mut self) {
        if self.reset.load(Ordering::Relaxed) {
            self.stream.reset();
        }
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin + Reset> GuardedIo<S> {
    fn new(
        stream: S,
        send_timeout: Duration,
        reset: Arc<AtomicBool>,
        sent: Arc<AtomicU64>,
    ) -> Self {
        Self {
            stream,
            send_timeout,
            stalled: None,
            reset,
            sent,
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
                if let Ok(n) = r {
                    self.sent.fetch_add(n as u64, Ordering::Relaxed);
                }
                Poll::Ready(r)
            }
            Poll::Pending if self.stalled_too_long(cx) => {
                self.reset.store(true, Ordering::Relaxed);
                Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "the client stopped reading the response",
                )))
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin + Reset> AsyncRead for GuardedIo<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_read(cx, buf)
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin + Reset> AsyncWrite for GuardedIo<S> {
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
        let mut io = GuardedIo::new(
            ours,
            Duration::from_millis(50),
            Arc::default(),
            Arc::default(),
        );
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

    #[test]
    fn one_address_holds_at_most_its_share_and_a_64_counts_as_one() {
        let table = Arc::new(PerAddress::new(2));
        let a: IpAddr = "10.0.0.1".parse().unwrap();
        let b: IpAddr = "10.0.0.2".parse().unwrap();
        let first = table.take(a).unwrap();
        let _second = table.take(a).unwrap();
        assert!(table.take(a).is_none());
        assert!(table.take(b).is_some(), "another address is not affected");
        drop(first);
        assert!(
            table.take(a).is_some(),
            "a closed connection gives its place back"
        );
        let v6 = |s: &str| -> IpAddr { s.parse().unwrap() };
        let _x = table.take(v6("2001:db8:1:2::1")).unwrap();
        let _y = table.take(v6("2001:db8:1:2:ffff::9")).unwrap();
        assert!(table.take(v6("2001:db8:1:2:abcd::5")).is_none(), "same /64");
        assert!(table.take(v6("2001:db8:1:3::1")).is_some(), "another /64");
        assert_eq!(PerAddress::key(v6("::ffff:10.0.0.2")), b);
    }
}
