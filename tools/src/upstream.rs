//! Recording upstream instances on loopback: each answers 200 with
//! `x-served-by: <name>` and records what it received (headers, body length
//! and SHA-256), so tests can check what reached which instance, byte for byte.
//!
//! A fleet runs on its own small tokio runtime, so it works the same from
//! synchronous code (xtask) and from inside async tests.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use anyhow::Context as _;
use bytes::Bytes;
use http_body_util::{BodyExt as _, Full};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use sha2::{Digest as _, Sha256};

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

/// One named instance.
struct Instance {
    name: String,
    addr: SocketAddr,
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
            runtime.spawn(serve(listener, name.clone(), Arc::clone(&records)));
            instances.push(Instance { name, addr });
        }
        Ok(UpstreamFleet {
            runtime: Some(runtime),
            instances,
            records,
        })
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

async fn serve(
    listener: std::net::TcpListener,
    name: String,
    records: Arc<Mutex<Vec<RecordedRequest>>>,
) {
    let Ok(listener) = tokio::net::TcpListener::from_std(listener) else {
        return;
    };
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let name = name.clone();
        let records = Arc::clone(&records);
        tokio::spawn(async move {
            let service = service_fn(move |request| {
                let name = name.clone();
                let records = Arc::clone(&records);
                async move { Ok::<_, Infallible>(handle(request, name, records).await) }
            });
            // Connection errors (client resets) end this connection only.
            let _ = http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

async fn handle(
    request: Request<Incoming>,
    name: String,
    records: Arc<Mutex<Vec<RecordedRequest>>>,
) -> Response<Full<Bytes>> {
    let (parts, body) = request.into_parts();
    let body = match body.collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(error) => {
            return response(400, &name, format!("{{\"error\":\"body: {error}\"}}"));
        }
    };
    let record = RecordedRequest {
        instance: name.clone(),
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
    };
    let reply = format!(
        "{{\"served_by\":\"{name}\",\"body_bytes\":{},\"body_sha256\":\"{}\"}}",
        record.body_len, record.body_sha256
    );
    // Recorded before answering: once the client has the response, the record exists.
    lock(&records).push(record);
    response(200, &name, reply)
}

fn response(status: u16, name: &str, body: String) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from(body)));
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
