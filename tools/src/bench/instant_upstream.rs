//! The upstreams of the overhead benchmark, a fleet of 7 on one thread: hyper
//! servers (one current-thread runtime) that read each request body to its
//! end and answer 200 at once with a vLLM-shaped chat completion and its
//! `usage` ([`COMPLETION`], or [`STREAMED`] where the body asks for a
//! stream: what the filter reads back), so what is measured
//! is Envoy and the filter, not an upstream. It counts requests that carried the routing key header, which
//! proves the filter really ran (or really did not) in each configuration.
//! Started with a metrics body, it answers `GET /metrics` with it, as an
//! engine does to the filter's engine-load poller, and counts those apart.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use anyhow::Context as _;
use bytes::Bytes;
use http_body_util::{BodyExt as _, Full};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use tokio::sync::oneshot;

/// What every request is answered with: a chat completion as vLLM sends it
/// with `--enable-prompt-tokens-details`, usage last.
pub const COMPLETION: &[u8] = br#"{"id":"chatcmpl-3f6d9c2a8b1e4f07","object":"chat.completion","created":1764979200,"model":"meta-llama/Llama-3.1-70B-Instruct","choices":[{"index":0,"message":{"role":"assistant","content":"The document describes a routing filter that sends each request to the instance whose cache already holds the start of its prompt, so the shared part is not computed again and the first token arrives sooner.","refusal":null,"tool_calls":[]},"logprobs":null,"finish_reason":"stop","stop_reason":null}],"service_tier":null,"system_fingerprint":null,"usage":{"prompt_tokens":2048,"total_tokens":2096,"completion_tokens":48,"prompt_tokens_details":{"cached_tokens":1792}},"prompt_logprobs":null,"kv_transfer_params":null}"#;

/// What a request whose body sets `"stream":true` is answered with: vLLM's
/// event stream of chunks, the last with the usage (as with
/// `stream_options.include_usage`), then `[DONE]`.
pub const STREAMED: &[u8] = concat!(
    r#"data: {"id":"chatcmpl-3f6d9c2a8b1e4f07","object":"chat.completion.chunk","created":1764979200,"model":"meta-llama/Llama-3.1-70B-Instruct","choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}],"usage":null}"#,
    "\n\n",
    r#"data: {"id":"chatcmpl-3f6d9c2a8b1e4f07","object":"chat.completion.chunk","created":1764979200,"model":"meta-llama/Llama-3.1-70B-Instruct","choices":[{"index":0,"delta":{"content":"The document describes a routing filter that sends each request to the instance whose cache already holds the start of its prompt."},"logprobs":null,"finish_reason":null}],"usage":null}"#,
    "\n\n",
    r#"data: {"id":"chatcmpl-3f6d9c2a8b1e4f07","object":"chat.completion.chunk","created":1764979200,"model":"meta-llama/Llama-3.1-70B-Instruct","choices":[{"index":0,"delta":{"content":""},"logprobs":null,"finish_reason":"stop","stop_reason":null}],"usage":null}"#,
    "\n\n",
    r#"data: {"id":"chatcmpl-3f6d9c2a8b1e4f07","object":"chat.completion.chunk","created":1764979200,"model":"meta-llama/Llama-3.1-70B-Instruct","choices":[],"usage":{"prompt_tokens":2048,"total_tokens":2096,"completion_tokens":48,"prompt_tokens_details":{"cached_tokens":1792}}}"#,
    "\n\ndata: [DONE]\n\n"
)
.as_bytes();

/// The end of a body that asks for a stream ([`STREAMED`]): the overhead
/// benchmark's bodies end with their `stream` and `temperature` fields.
const STREAM_ASKED: &[u8] = br#""stream":true"#;

/// Requests seen, with and without the key header, and body bytes read.
#[derive(Debug, Default)]
pub struct Counts {
    pub keyed: AtomicU64,
    pub unkeyed: AtomicU64,
    pub body_bytes: AtomicU64,
    /// `GET /metrics` answered with the metrics body (not in the others).
    pub metrics: AtomicU64,
}

/// A snapshot of [`Counts`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CountsSnapshot {
    pub keyed: u64,
    pub unkeyed: u64,
    pub body_bytes: u64,
    pub metrics: u64,
}

impl CountsSnapshot {
    /// Counts accumulated since `earlier`.
    pub fn since(self, earlier: CountsSnapshot) -> CountsSnapshot {
        CountsSnapshot {
            keyed: self.keyed - earlier.keyed,
            unkeyed: self.unkeyed - earlier.unkeyed,
            body_bytes: self.body_bytes - earlier.body_bytes,
            metrics: self.metrics - earlier.metrics,
        }
    }
}

/// Instances in a benchmark's fleet of instant upstreams, as in the routing
/// benchmark's and `envoy/envoy.yaml`'s.
pub const FLEET_SIZE: usize = 7;

/// Instant upstreams behind one Envoy cluster ([`FLEET_SIZE`] unless told),
/// served by one thread and counted as one; stopped when dropped. One thread,
/// so that a fleet costs the machine what one upstream does: the benchmark
/// measures Envoy and the filter deciding over a fleet, not 7 more threads on
/// its cores.
pub struct InstantFleet {
    addrs: Vec<SocketAddr>,
    counts: Arc<Counts>,
    shutdown: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl InstantFleet {
    /// Starts [`FLEET_SIZE`] on ephemeral loopback ports; requests carrying
    /// `key_header` count as keyed. With `metrics`, answers `GET /metrics`
    /// with it.
    pub fn start(key_header: &str, metrics: Option<Bytes>) -> anyhow::Result<Self> {
        Self::start_sized(FLEET_SIZE, key_header, metrics)
    }

    /// [`InstantFleet::start`] with `size` upstreams.
    pub fn start_sized(
        size: usize,
        key_header: &str,
        metrics: Option<Bytes>,
    ) -> anyhow::Result<Self> {
        let listeners = (0..size)
            .map(|_| {
                let listener =
                    std::net::TcpListener::bind("127.0.0.1:0").context("binding an upstream")?;
                listener.set_nonblocking(true)?;
                Ok(listener)
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        let addrs = listeners
            .iter()
            .map(std::net::TcpListener::local_addr)
            .collect::<std::io::Result<Vec<_>>>()?;
        let counts = Arc::new(Counts::default());
        let (shutdown, stop) = oneshot::channel();
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .context("starting the upstream runtime")?;
        let key_header = hyper::header::HeaderName::from_bytes(key_header.as_bytes())
            .context("key header name")?;
        let thread_counts = Arc::clone(&counts);
        let thread = std::thread::Builder::new()
            .name("instant-upstream".into())
            .spawn(move || {
                runtime.block_on(async move {
                    for listener in listeners {
                        tokio::spawn(serve(
                            listener,
                            key_header.clone(),
                            metrics.clone(),
                            Arc::clone(&thread_counts),
                        ));
                    }
                    let _ = stop.await;
                });
            })?;
        Ok(InstantFleet {
            addrs,
            counts,
            shutdown: Some(shutdown),
            thread: Some(thread),
        })
    }

    pub fn addrs(&self) -> Vec<SocketAddr> {
        self.addrs.clone()
    }

    /// Every upstream's counts together.
    pub fn counts(&self) -> CountsSnapshot {
        CountsSnapshot {
            keyed: self.counts.keyed.load(Ordering::Relaxed),
            unkeyed: self.counts.unkeyed.load(Ordering::Relaxed),
            body_bytes: self.counts.body_bytes.load(Ordering::Relaxed),
            metrics: self.counts.metrics.load(Ordering::Relaxed),
        }
    }
}

impl Drop for InstantFleet {
    fn drop(&mut self) {
        if let Some(shutdown) = self.shutdown.take() {
            let _ = shutdown.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

async fn serve(
    listener: std::net::TcpListener,
    key_header: hyper::header::HeaderName,
    metrics: Option<Bytes>,
    counts: Arc<Counts>,
) {
    let Ok(listener) = tokio::net::TcpListener::from_std(listener) else {
        return;
    };
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let _ = stream.set_nodelay(true);
        let key_header = key_header.clone();
        let counts = Arc::clone(&counts);
        let metrics = metrics.clone();
        tokio::spawn(async move {
            let service = service_fn(move |request: Request<Incoming>| {
                let keyed = request.headers().contains_key(&key_header);
                let counts = Arc::clone(&counts);
                let metrics = metrics.clone().filter(|_| {
                    request.method() == hyper::Method::GET && request.uri().path() == "/metrics"
                });
                async move {
                    if let Some(metrics) = metrics {
                        counts.metrics.fetch_add(1, Ordering::Relaxed);
                        let mut response = Response::new(Full::new(metrics));
                        response.headers_mut().insert(
                            hyper::header::CONTENT_TYPE,
                            hyper::header::HeaderValue::from_static(
                                "text/plain; version=0.0.4; charset=utf-8",
                            ),
                        );
                        return Ok::<_, Infallible>(response);
                    }
                    let mut body = request.into_body();
                    let mut bytes = 0u64;
                    // The body's last 64 bytes, where a stream is asked for.
                    let mut tail = Vec::with_capacity(128);
                    while let Some(Ok(frame)) = body.frame().await {
                        if let Some(data) = frame.data_ref() {
                            bytes += data.len() as u64;
                            tail.extend_from_slice(&data[data.len().saturating_sub(64)..]);
                            tail.drain(..tail.len().saturating_sub(64));
                        }
                    }
                    let streamed = tail.windows(STREAM_ASKED.len()).any(|w| w == STREAM_ASKED);
                    let counter = if keyed {
                        &counts.keyed
                    } else {
                        &counts.unkeyed
                    };
                    counter.fetch_add(1, Ordering::Relaxed);
                    counts.body_bytes.fetch_add(bytes, Ordering::Relaxed);
                    let (answer, content_type) = if streamed {
                        (STREAMED, "text/event-stream")
                    } else {
                        (COMPLETION, "application/json")
                    };
                    let mut response = Response::new(Full::new(Bytes::from_static(answer)));
                    response.headers_mut().insert(
                        hyper::header::CONTENT_TYPE,
                        hyper::header::HeaderValue::from_static(content_type),
                    );
                    response.headers_mut().insert(
                        "x-served-by",
                        hyper::header::HeaderValue::from_static("instant"),
                    );
                    Ok::<_, Infallible>(response)
                }
            });
            let _ = http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prefix_router::usage::{scan, Framing, Usage};

    /// The answer carries what the filter reads, so the overhead benchmark
    /// measures reading it.
    #[test]
    fn the_completion_reports_usage_the_filter_reads() {
        assert_eq!(
            scan(Framing::Json, COMPLETION),
            Some(Usage {
                prompt_tokens: 2048,
                cached_tokens: Some(1792),
            })
        );
        assert!(serde_json::from_slice::<serde_json::Value>(COMPLETION).is_ok());
        assert_eq!(
            scan(Framing::EventStream, STREAMED),
            scan(Framing::Json, COMPLETION)
        );
    }
}
