//! An HTTP client whose request framing the test controls: over HTTP/1.1 a
//! `content-length` or a chunked body, over HTTP/2 (cleartext, prior
//! knowledge) DATA frames ending the stream or followed by trailers; written in
//! pieces of a chosen size, the first few pieces a moment apart so Envoy (and
//! the filter) really receive them as separate reads.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use anyhow::{anyhow, Context as _};
use bytes::Bytes;
use http_body_util::BodyExt as _;
use hyper::body::{Body, Frame, SizeHint};
use hyper::header::{HeaderMap, HeaderName, HeaderValue};
use hyper_util::rt::TokioIo;
use tokio::sync::{mpsc, Semaphore};

/// How the request body is delimited on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Framing {
    /// `content-length: N`.
    ContentLength,
    /// `transfer-encoding: chunked`, one chunk per piece.
    Chunked,
    /// HTTP/2 with `content-length`, one DATA frame per piece (hyper may split
    /// a piece by flow control); the last frame ends the stream.
    Http2,
    /// HTTP/2 without `content-length`: DATA frames, then a trailers frame
    /// ends the stream (no DATA frame carries END_STREAM).
    Http2Trailers,
}

impl Framing {
    /// Sent over HTTP/2 (prior knowledge).
    pub fn is_http2(self) -> bool {
        matches!(self, Framing::Http2 | Framing::Http2Trailers)
    }
}

/// The trailer [`Framing::Http2Trailers`] sends.
pub const TRAILER: (&str, &str) = ("x-test-trailer", "end");

/// A request to send.
#[derive(Debug, Clone)]
pub struct Outgoing {
    pub method: String,
    pub path: String,
    /// Raw header values (bytes, so tests can send non-ASCII values).
    pub headers: Vec<(String, Vec<u8>)>,
    /// `None`: no body at all (no content-length, no chunks).
    pub body: Option<Bytes>,
    pub framing: Framing,
    /// Bytes per write (and per chunk when chunked).
    pub piece: usize,
    /// Pause after each of the first few pieces, so they arrive as separate reads.
    pub paced_pieces: usize,
}

/// Pause between paced pieces (shapes delivery; nothing waits on it).
const PIECE_GAP: Duration = Duration::from_millis(2);
/// Bound on one request/response exchange.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

impl Outgoing {
    /// A POST with a `content-length` body written at once.
    pub fn post(path: &str, body: impl Into<Bytes>) -> Self {
        Outgoing {
            method: "POST".to_string(),
            path: path.to_string(),
            headers: vec![("content-type".to_string(), b"application/json".to_vec())],
            body: Some(body.into()),
            framing: Framing::ContentLength,
            piece: usize::MAX,
            paced_pieces: 0,
        }
    }

    /// A GET without a body.
    pub fn get(path: &str) -> Self {
        Outgoing {
            method: "GET".to_string(),
            path: path.to_string(),
            headers: Vec::new(),
            body: None,
            framing: Framing::ContentLength,
            piece: usize::MAX,
            paced_pieces: 0,
        }
    }

    /// Adds a header.
    pub fn header(mut self, name: &str, value: impl AsRef<[u8]>) -> Self {
        self.headers
            .push((name.to_string(), value.as_ref().to_vec()));
        self
    }

    /// Tags the request so its upstream record can be found ([`crate::TEST_ID_HEADER`]).
    pub fn id(self, test_id: &str) -> Self {
        self.header(crate::TEST_ID_HEADER, test_id)
    }

    /// Sends the body in `piece`-byte writes with the given framing, the first
    /// `paced` pieces a moment apart.
    pub fn framed(mut self, framing: Framing, piece: usize, paced: usize) -> Self {
        self.framing = framing;
        self.piece = piece.max(1);
        self.paced_pieces = paced;
        self
    }
}

/// A response, read to the end.
#[derive(Debug, Clone)]
pub struct Reply {
    pub status: u16,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Reply {
    /// The instance that served the request (`x-served-by`), if any.
    pub fn served_by(&self) -> Option<&str> {
        self.headers
            .get("x-served-by")
            .and_then(|v| v.to_str().ok())
    }

    /// The body as text (lossy), for messages.
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

/// A body fed piece by piece from a channel; its size is left to the headers.
/// Over when the sender is dropped.
pub struct PieceBody {
    pieces: mpsc::Receiver<Bytes>,
    /// Sent once the pieces are over (HTTP/2 only).
    trailers: Option<HeaderMap>,
}

impl PieceBody {
    /// The pieces `pieces` receives, then the end of the body.
    pub fn new(pieces: mpsc::Receiver<Bytes>) -> Self {
        PieceBody {
            pieces,
            trailers: None,
        }
    }
}

impl Body for PieceBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        match self.pieces.poll_recv(cx) {
            Poll::Ready(None) => Poll::Ready(self.trailers.take().map(|t| Ok(Frame::trailers(t)))),
            other => other.map(|piece| piece.map(|bytes| Ok(Frame::data(bytes)))),
        }
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::default()
    }
}

/// An empty body that is over at once (a request without a body).
struct NoBody;

impl Body for NoBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        Poll::Ready(None)
    }

    fn is_end_stream(&self) -> bool {
        true
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact(0)
    }
}

/// Sends one request on a new connection and reads the whole response.
pub async fn send(addr: SocketAddr, request: Outgoing) -> anyhow::Result<Reply> {
    tokio::time::timeout(REQUEST_TIMEOUT, exchange(addr, request))
        .await
        .map_err(|_| anyhow!("no complete response within {REQUEST_TIMEOUT:?}"))?
}

/// Sends many requests, at most `parallel` at once; replies in input order.
pub async fn send_all(
    addr: SocketAddr,
    requests: Vec<Outgoing>,
    parallel: usize,
) -> anyhow::Result<Vec<Reply>> {
    let permits = Arc::new(Semaphore::new(parallel.max(1)));
    let mut tasks = Vec::with_capacity(requests.len());
    for request in requests {
        let permits = Arc::clone(&permits);
        tasks.push(tokio::spawn(async move {
            let _permit = permits.acquire_owned().await?;
            let what = format!("{} {}", request.method, request.path);
            send(addr, request).await.with_context(|| what)
        }));
    }
    let mut replies = Vec::with_capacity(tasks.len());
    for task in tasks {
        replies.push(task.await??);
    }
    Ok(replies)
}

async fn exchange(addr: SocketAddr, request: Outgoing) -> anyhow::Result<Reply> {
    let stream = tokio::net::TcpStream::connect(addr)
        .await
        .with_context(|| format!("connecting to {addr}"))?;
    stream.set_nodelay(true)?;
    let io = TokioIo::new(stream);
    // The connection task is aborted however this exchange ends, also when a
    // caller's timeout drops it midway: that is how tests abort a request (the
    // connection closes).
    let (mut sender, _connection) = if request.framing.is_http2() {
        let (sender, connection) =
            hyper::client::conn::http2::handshake(hyper_util::rt::TokioExecutor::new(), io)
                .await
                .context("HTTP/2 handshake")?;
        (
            Sender::Http2(sender),
            AbortOnDrop(tokio::spawn(async move {
                connection.await.map_err(anyhow::Error::from)
            })),
        )
    } else {
        let (sender, connection) = hyper::client::conn::http1::handshake(io)
            .await
            .context("HTTP/1.1 handshake")?;
        (
            Sender::Http1(sender),
            AbortOnDrop(tokio::spawn(async move {
                connection.await.map_err(anyhow::Error::from)
            })),
        )
    };

    // HTTP/2 takes the authority from an absolute URI; HTTP/1.1 sends the path
    // and a host header.
    let mut builder = hyper::Request::builder().method(request.method.as_str());
    builder = if request.framing.is_http2() {
        builder.uri(format!("http://prefix-router.test{}", request.path))
    } else {
        builder
            .uri(request.path.as_str())
            .header("host", "prefix-router.test")
    };
    for (name, value) in &request.headers {
        builder = builder.header(
            HeaderName::from_bytes(name.as_bytes())?,
            HeaderValue::from_bytes(value)?,
        );
    }
    let response = match request.body {
        None => sender.send(builder.body(NoBody.boxed())?).await,
        Some(body) => {
            builder = match request.framing {
                Framing::ContentLength | Framing::Http2 => {
                    builder.header("content-length", body.len())
                }
                Framing::Chunked => builder.header("transfer-encoding", "chunked"),
                Framing::Http2Trailers => builder,
            };
            let trailers = (request.framing == Framing::Http2Trailers).then(|| {
                let mut trailers = HeaderMap::new();
                trailers.insert(TRAILER.0, HeaderValue::from_static(TRAILER.1));
                trailers
            });
            let (pieces, receiver) = mpsc::channel(16);
            let writer = tokio::spawn(write_pieces(
                body,
                request.piece,
                request.paced_pieces,
                pieces,
            ));
            let body = PieceBody {
                pieces: receiver,
                trailers,
            };
            let sent = sender.send(builder.body(body.boxed())?).await;
            writer.abort();
            sent
        }
    }
    .context("sending the request")?;

    let status = response.status().as_u16();
    let headers = response.headers().clone();
    let body = response
        .into_body()
        .collect()
        .await
        .context("reading the response body")?
        .to_bytes();
    Ok(Reply {
        status,
        headers,
        body,
    })
}

type BoxBody = http_body_util::combinators::BoxBody<Bytes, Infallible>;

/// One connection's request sender, either protocol.
enum Sender {
    Http1(hyper::client::conn::http1::SendRequest<BoxBody>),
    Http2(hyper::client::conn::http2::SendRequest<BoxBody>),
}

impl Sender {
    async fn send(
        &mut self,
        request: hyper::Request<BoxBody>,
    ) -> hyper::Result<hyper::Response<hyper::body::Incoming>> {
        match self {
            Sender::Http1(sender) => sender.send_request(request).await,
            Sender::Http2(sender) => sender.send_request(request).await,
        }
    }
}

/// A spawned task aborted when this handle is dropped.
pub(crate) struct AbortOnDrop<T>(pub(crate) tokio::task::JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

async fn write_pieces(body: Bytes, piece: usize, paced: usize, pieces: mpsc::Sender<Bytes>) {
    let mut offset = 0;
    let mut index = 0;
    while offset < body.len() {
        let end = body.len().min(offset.saturating_add(piece));
        if pieces.send(body.slice(offset..end)).await.is_err() {
            return; // the request ended early (e.g. a local reply)
        }
        offset = end;
        index += 1;
        if index <= paced {
            tokio::time::sleep(PIECE_GAP).await;
        }
    }
}
