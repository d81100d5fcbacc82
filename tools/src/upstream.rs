//! Recording upstream instances on loopback: each answers 200 with
//! `x-served-by: <name>` and records what it received (headers, body length
//! and SHA-256), so tests can check what reached which instance, byte for byte.
//!
//! For load tests an instance can also behave like a slow or failing model
//! server: hold each request a while (per instance, or per request through
//! [`HOLD_HEADER`]), reset the connection, never answer, or stream an SSE
//! response ([`ACTION_HEADER`]). Each instance measures its own in-flight
//! requests and the maximum reached, so tests check a concurrency cap where it
//! matters: at the instance.
//!
//! An instance can also answer `GET /metrics` as a test chooses
//! ([`MetricsReply`]): an engine's series, an error, garbage, silence.
//!
//! A fleet runs on its own small tokio runtime, so it works the same from
//! synchronous code (xtask) and from inside async tests.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use bytes::Bytes;
use http_body_util::BodyExt as _;
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use sha2::{Digest as _, Sha256};
use tokio::sync::mpsc;

/// Request header: hold this request this many milliseconds before answering
/// (overrides the instance's own hold).
pub const HOLD_HEADER: &str = "x-upstream-hold-ms";

/// Request header choosing how the instance ends the request, after the hold:
/// `reset` (close the connection without answering), `hang` (never answer;
/// the request ends when the peer closes the connection, at the latest after
/// [`HANG_LIMIT`]), `sse` (stream server-sent events, see [`SSE_EVENTS_HEADER`]),
/// `fail` (answer 500, as an overloaded model server may). Absent or anything
/// else: a plain 200.
pub const ACTION_HEADER: &str = "x-upstream-action";

/// Request header: number of SSE events for `sse` (default 5), the last one
/// `data: [DONE]`.
pub const SSE_EVENTS_HEADER: &str = "x-upstream-sse-events";

/// Request header: milliseconds between SSE events (default 20).
pub const SSE_INTERVAL_HEADER: &str = "x-upstream-sse-interval-ms";

/// Bound on a `hang`: a test run never leaves a task behind for longer.
pub const HANG_LIMIT: Duration = Duration::from_secs(120);

/// How an instance answers `GET /metrics` (the engine-load poller's path;
/// see [`UpstreamFleet::set_metrics`]). Every such request is recorded like
/// any other, so tests count polls at the instance.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum MetricsReply {
    /// Like any other request (the default: tests that do not poll see no
    /// difference).
    #[default]
    Ordinary,
    /// 200 with this text (e.g. vLLM's series, or garbage).
    Text(String),
    /// This status, with a short text body.
    Status(u16),
    /// Never answers (until [`HANG_LIMIT`] or the peer closes).
    Hang,
    /// Closes the connection without answering.
    Reset,
}

/// The path whose answer [`MetricsReply`] sets.
pub const METRICS_PATH: &str = "/metrics";

/// What one instance received in one request.
#[derive(Debug, Clone)]
pub struct RecordedRequest {
    /// The instance that served it.
    pub instance: String,
    pub method: String,
    /// Path and query.
    pub path: String,
    /// Header names (lowercase) and values, in arrival order, repeats kept.
    pub headers: Vec<(String, String)>,
    pub body_len: usize,
    /// Lowercase hex SHA-256 of the body.
    pub body_sha256: String,
    /// When the whole request had arrived.
    pub received_at: Instant,
}

impl RecordedRequest {
    /// The first value of a header.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.header_values(name).into_iter().next()
    }

    /// Every value of a header.
    pub fn header_values(&self, name: &str) -> Vec<&str> {
        let name = name.to_ascii_lowercase();
        self.headers
            .iter()
            .filter(|(n, _)| *n == name)
            .map(|(_, v)| v.as_str())
            .collect()
    }
}

/// How an instance ends a request (from [`ACTION_HEADER`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    Respond,
    Fail,
    Reset,
    Hang,
    Stream { events: u32, interval: Duration },
}

/// One instance's live numbers, shared with its connections.
#[derive(Debug, Default)]
struct Load {
    hold_ms: AtomicU64,
    in_flight: AtomicU32,
    max_in_flight: AtomicU32,
}

/// Counts one request in flight on an instance until dropped (when the
/// response body is done or the connection is gone).
struct InFlight(Option<Arc<Load>>);

impl InFlight {
    fn start(load: &Arc<Load>) -> Self {
        let now = load.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        load.max_in_flight.fetch_max(now, Ordering::SeqCst);
        InFlight(Some(Arc::clone(load)))
    }

    /// A reply that counts nothing.
    fn uncounted() -> Self {
        InFlight(None)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        if let Some(load) = &self.0 {
            load.in_flight.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

/// The `user-agent` of Envoy's active HTTP health checks.
const ENVOY_HEALTH_CHECKER: hyper::header::HeaderValue =
    hyper::header::HeaderValue::from_static("Envoy/HC");

/// One named instance.
struct Instance {
    name: String,
    addr: SocketAddr,
    load: Arc<Load>,
    metrics: Arc<Mutex<MetricsReply>>,
}

/// Several recording instances sharing one log of received requests.
pub struct UpstreamFleet {
    runtime: Option<tokio::runtime::Runtime>,
    instances: Vec<Instance>,
    records: Arc<Mutex<Vec<RecordedRequest>>>,
}

impl UpstreamFleet {
    /// Starts `count` instances named `instance-1` .. `instance-<count>`.
    pub fn start(count: usize) -> anyhow::Result<Self> {
        Self::start_named((1..=count).map(|i| format!("instance-{i}")))
    }

    /// Starts one instance per name, each on an ephemeral loopback port.
    pub fn start_named(names: impl IntoIterator<Item = String>) -> anyhow::Result<Self> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("upstream-fleet")
            .enable_all()
            .build()
            .context("starting the upstream runtime")?;
        let records = Arc::new(Mutex::new(Vec::new()));
        let mut instances = Vec::new();
        for name in names {
            let listener = std::net::TcpListener::bind("127.0.0.1:0")
                .with_context(|| format!("binding upstream {name}"))?;
            listener.set_nonblocking(true)?;
            let addr = listener.local_addr()?;
            let load = Arc::new(Load::default());
            let metrics = Arc::new(Mutex::new(MetricsReply::default()));
            let server = Server {
                name: name.clone(),
                records: Arc::clone(&records),
                load: Arc::clone(&load),
                metrics: Arc::clone(&metrics),
            };
            runtime.spawn(serve(listener, server));
            instances.push(Instance {
                name,
                addr,
                load,
                metrics,
            });
        }
        Ok(UpstreamFleet {
            runtime: Some(runtime),
            instances,
            records,
        })
    }

    /// Sets how instance `index` answers `GET /metrics` from now on.
    pub fn set_metrics(&self, index: usize, reply: MetricsReply) -> anyhow::Result<()> {
        let Some(instance) = self.instances.get(index) else {
            bail!("no upstream instance {index}");
        };
        *instance
            .metrics
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner()) = reply;
        Ok(())
    }

    /// Instance addresses, in name order.
    pub fn addrs(&self) -> Vec<SocketAddr> {
        self.instances.iter().map(|i| i.addr).collect()
    }

    /// Instance names, in the order of [`addrs`](Self::addrs).
    pub fn names(&self) -> Vec<String> {
        self.instances.iter().map(|i| i.name.clone()).collect()
    }

    /// The instance name listening on `addr`.
    pub fn name_of(&self, addr: SocketAddr) -> Option<&str> {
        self.instances
            .iter()
            .find(|i| i.addr == addr)
            .map(|i| i.name.as_str())
    }

    /// The address of the instance called `name`.
    pub fn addr_of(&self, name: &str) -> Option<SocketAddr> {
        self.instances
            .iter()
            .find(|i| i.name == name)
            .map(|i| i.addr)
    }

    /// Makes instance number `index` (in [`addrs`](Self::addrs) order) hold
    /// each request `hold` before answering (a slow instance).
    pub fn set_hold(&self, index: usize, hold: Duration) -> anyhow::Result<()> {
        let Some(instance) = self.instances.get(index) else {
            bail!(
                "no instance number {index} (fleet of {})",
                self.instances.len()
            );
        };
        let ms = u64::try_from(hold.as_millis()).unwrap_or(u64::MAX);
        instance.load.hold_ms.store(ms, Ordering::SeqCst);
        Ok(())
    }

    /// Makes every instance hold each request `hold`.
    pub fn set_hold_all(&self, hold: Duration) {
        for index in 0..self.instances.len() {
            let _ = self.set_hold(index, hold);
        }
    }

    /// Requests in flight on each instance now, in [`addrs`](Self::addrs) order.
    pub fn in_flight(&self) -> Vec<u32> {
        self.instances
            .iter()
            .map(|i| i.load.in_flight.load(Ordering::SeqCst))
            .collect()
    }

    /// Requests in flight on each instance now, by name.
    pub fn in_flight_by_name(&self) -> BTreeMap<String, u32> {
        self.instances
            .iter()
            .map(|i| (i.name.clone(), i.load.in_flight.load(Ordering::SeqCst)))
            .collect()
    }

    /// The most requests each instance had in flight at once since the start
    /// or the last [`reset_max_in_flight`](Self::reset_max_in_flight), by name.
    pub fn max_in_flight(&self) -> BTreeMap<String, u32> {
        self.instances
            .iter()
            .map(|i| (i.name.clone(), i.load.max_in_flight.load(Ordering::SeqCst)))
            .collect()
    }

    /// Starts measuring the maximum in flight afresh (from the current count).
    pub fn reset_max_in_flight(&self) {
        for i in &self.instances {
            let now = i.load.in_flight.load(Ordering::SeqCst);
            i.load.max_in_flight.store(now, Ordering::SeqCst);
        }
    }

    /// Waits (bounded) until no instance has a request in flight.
    pub fn wait_idle(&self, timeout: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            if self.in_flight().iter().all(|n| *n == 0) {
                return Ok(());
            }
            if Instant::now() >= deadline {
                bail!(
                    "instances still busy after {timeout:?}: {:?}",
                    self.in_flight_by_name()
                );
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Everything received so far, in arrival order.
    pub fn records(&self) -> Vec<RecordedRequest> {
        lock(&self.records).clone()
    }

    /// Received requests carrying `header: value`.
    pub fn records_with_header(&self, header: &str, value: &str) -> Vec<RecordedRequest> {
        lock(&self.records)
            .iter()
            .filter(|r| r.header_values(header).contains(&value))
            .cloned()
            .collect()
    }

    /// How many requests each instance received (every instance listed).
    pub fn counts(&self) -> BTreeMap<String, usize> {
        let mut counts: BTreeMap<String, usize> =
            self.instances.iter().map(|i| (i.name.clone(), 0)).collect();
        for record in lock(&self.records).iter() {
            *counts.entry(record.instance.clone()).or_default() += 1;
        }
        counts
    }

    /// Total requests received.
    pub fn total(&self) -> usize {
        lock(&self.records).len()
    }

    /// Forgets what was received.
    pub fn clear(&self) {
        lock(&self.records).clear();
    }
}

impl Drop for UpstreamFleet {
    fn drop(&mut self) {
        // shutdown_background is allowed inside another runtime; a plain drop is not.
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

fn lock(records: &Mutex<Vec<RecordedRequest>>) -> std::sync::MutexGuard<'_, Vec<RecordedRequest>> {
    // A panicking test thread must not hide the records from the others.
    records
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// What each connection of one instance needs.
#[derive(Clone)]
struct Server {
    name: String,
    records: Arc<Mutex<Vec<RecordedRequest>>>,
    load: Arc<Load>,
    metrics: Arc<Mutex<MetricsReply>>,
}

/// The instance closes the connection instead of answering.
#[derive(Debug)]
struct ResetRequested;

impl std::fmt::Display for ResetRequested {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("reset requested by the test")
    }
}

impl std::error::Error for ResetRequested {}

async fn serve(listener: std::net::TcpListener, server: Server) {
    let Ok(listener) = tokio::net::TcpListener::from_std(listener) else {
        return;
    };
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let server = server.clone();
        tokio::spawn(async move {
            let service = service_fn(move |request| {
                let server = server.clone();
                async move { handle(request, server).await }
            });
            // Connection errors (client resets, requested resets) end this
            // connection only. When the peer closes the connection hyper drops
            // the request's future, which ends its in-flight count.
            let _ = http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

async fn handle(
    request: Request<Incoming>,
    server: Server,
) -> Result<Response<ReplyBody>, ResetRequested> {
    // Envoy's active health checks (the compose and Kubernetes configurations
    // run them) are answered at once, neither held, counted nor recorded, so
    // they do not move what tests measure.
    if request.headers().get(hyper::header::USER_AGENT) == Some(&ENVOY_HEALTH_CHECKER) {
        let reply = ReplyBody::full(String::new(), InFlight::uncounted());
        return Ok(response(200, &server.name, reply));
    }
    let in_flight = InFlight::start(&server.load);
    let name = server.name.as_str();
    let (parts, body) = request.into_parts();
    let body = match body.collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(error) => {
            let text = format!("{{\"error\":\"body: {error}\"}}");
            return Ok(response(400, name, ReplyBody::full(text, in_flight)));
        }
    };
    let header = |header: &str| {
        parts
            .headers
            .get(header)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    };
    let number = |header_name: &str| header(header_name).and_then(|v| v.trim().parse::<u64>().ok());
    let hold = Duration::from_millis(
        number(HOLD_HEADER).unwrap_or_else(|| server.load.hold_ms.load(Ordering::SeqCst)),
    );
    let action = match header(ACTION_HEADER).as_deref() {
        Some("reset") => Action::Reset,
        Some("fail") => Action::Fail,
        Some("hang") => Action::Hang,
        Some("sse") => Action::Stream {
            events: number(SSE_EVENTS_HEADER)
                .and_then(|n| u32::try_from(n).ok())
                .unwrap_or(5),
            interval: Duration::from_millis(number(SSE_INTERVAL_HEADER).unwrap_or(20)),
        },
        _ => Action::Respond,
    };
    let record = RecordedRequest {
        instance: name.to_string(),
        method: parts.method.to_string(),
        path: parts
            .uri
            .path_and_query()
            .map(|p| p.to_string())
            .unwrap_or_default(),
        headers: parts
            .headers
            .iter()
            .map(|(n, v)| {
                (
                    n.as_str().to_string(),
                    String::from_utf8_lossy(v.as_bytes()).into_owned(),
                )
            })
            .collect(),
        body_len: body.len(),
        body_sha256: hex::encode(Sha256::digest(&body)),
        received_at: Instant::now(),
    };
    let reply = format!(
        "{{\"served_by\":\"{name}\",\"body_bytes\":{},\"body_sha256\":\"{}\"}}",
        record.body_len, record.body_sha256
    );
    let is_metrics = parts.method == hyper::Method::GET && parts.uri.path() == METRICS_PATH;
    // Recorded before answering: once the client has the response, the record exists.
    lock(&server.records).push(record);
    if is_metrics {
        let reply = server
            .metrics
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .clone();
        match reply {
            MetricsReply::Ordinary => {}
            MetricsReply::Text(text) => {
                return Ok(response(200, name, ReplyBody::full(text, in_flight)))
            }
            MetricsReply::Status(status) => {
                let text = format!("metrics answer {status} requested");
                return Ok(response(status, name, ReplyBody::full(text, in_flight)));
            }
            MetricsReply::Hang => {
                tokio::time::sleep(HANG_LIMIT).await;
                return Err(ResetRequested);
            }
            MetricsReply::Reset => return Err(ResetRequested),
        }
    }
    if !hold.is_zero() {
        tokio::time::sleep(hold).await;
    }
    match action {
        Action::Respond => Ok(response(200, name, ReplyBody::full(reply, in_flight))),
        Action::Fail => {
            let text = format!("{{\"error\":\"failure requested\",\"served_by\":\"{name}\"}}");
            Ok(response(500, name, ReplyBody::full(text, in_flight)))
        }
        Action::Reset => Err(ResetRequested),
        Action::Hang => {
            tokio::time::sleep(HANG_LIMIT).await;
            Err(ResetRequested)
        }
        Action::Stream { events, interval } => {
            let (sender, receiver) = mpsc::channel(4);
            tokio::spawn(stream_events(name.to_string(), events, interval, sender));
            let mut response = response(200, name, ReplyBody::stream(receiver, in_flight));
            response.headers_mut().insert(
                "content-type",
                hyper::header::HeaderValue::from_static("text/event-stream"),
            );
            Ok(response)
        }
    }
}

/// Writes `events` SSE events, `interval` apart, the last `data: [DONE]`;
/// stops when the response is gone.
async fn stream_events(name: String, events: u32, interval: Duration, sender: mpsc::Sender<Bytes>) {
    for index in 0..events {
        let last = index + 1 == events;
        let event = if last {
            "data: [DONE]\n\n".to_string()
        } else {
            format!("data: {{\"served_by\":\"{name}\",\"event\":{index}}}\n\n")
        };
        if sender.send(Bytes::from(event)).await.is_err() {
            return;
        }
        if !last {
            tokio::time::sleep(interval).await;
        }
    }
}

/// A response body, whole or streamed, that keeps its request counted in
/// flight until it is dropped (sent completely, or the connection is gone).
struct ReplyBody {
    whole: Option<Bytes>,
    stream: Option<mpsc::Receiver<Bytes>>,
    _in_flight: InFlight,
}

impl ReplyBody {
    fn full(text: String, in_flight: InFlight) -> Self {
        ReplyBody {
            whole: Some(Bytes::from(text)),
            stream: None,
            _in_flight: in_flight,
        }
    }

    fn stream(receiver: mpsc::Receiver<Bytes>, in_flight: InFlight) -> Self {
        ReplyBody {
            whole: None,
            stream: Some(receiver),
            _in_flight: in_flight,
        }
    }
}

impl Body for ReplyBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        if let Some(bytes) = self.whole.take() {
            return Poll::Ready(Some(Ok(Frame::data(bytes))));
        }
        match self.stream.as_mut() {
            Some(receiver) => match receiver.poll_recv(cx) {
                Poll::Ready(Some(bytes)) => Poll::Ready(Some(Ok(Frame::data(bytes)))),
                Poll::Ready(None) => {
                    self.stream = None;
                    Poll::Ready(None)
                }
                Poll::Pending => Poll::Pending,
            },
            None => Poll::Ready(None),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.whole.is_none() && self.stream.is_none()
    }

    fn size_hint(&self) -> SizeHint {
        match (&self.whole, &self.stream) {
            (Some(bytes), _) => SizeHint::with_exact(bytes.len() as u64),
            (None, None) => SizeHint::with_exact(0),
            (None, Some(_)) => SizeHint::default(),
        }
    }
}

fn response(status: u16, name: &str, body: ReplyBody) -> Response<ReplyBody> {
    let mut response = Response::new(body);
    *response.status_mut() = hyper::StatusCode::from_u16(status).unwrap_or_default();
    let headers = response.headers_mut();
    headers.insert(
        "content-type",
        hyper::header::HeaderValue::from_static("application/json"),
    );
    if let Ok(value) = hyper::header::HeaderValue::from_str(name) {
        headers.insert("x-served-by", value);
    }
    response
}
