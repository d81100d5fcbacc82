//! A closed-loop HTTP/1.1 load client: `concurrency` keep-alive connections,
//! each sending the next request as soon as the previous answer has been read,
//! for a fixed time. It records each request's latency as the client sees it
//! (send to last response byte). Meant for a current-thread runtime, so it
//! takes one core at most and leaves the other to Envoy.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use bytes::Bytes;
use http_body_util::{BodyExt as _, Full};
use hyper::client::conn::http1::{self, SendRequest};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;
use tokio::task::JoinSet;

/// What to send.
#[derive(Debug, Clone)]
pub struct Target {
    pub addr: SocketAddr,
    /// Path and query.
    pub path: String,
    pub body: Bytes,
}

/// What one phase measured.
#[derive(Debug, Clone, Default)]
pub struct PhaseResult {
    /// Latency of each successful request, in microseconds.
    pub latencies_us: Vec<f64>,
    pub failures: u64,
    /// The first failure's description, for the error message.
    pub first_failure: Option<String>,
    pub elapsed: Duration,
}

impl PhaseResult {
    /// Successful requests per second.
    pub fn rps(&self) -> f64 {
        let seconds = self.elapsed.as_secs_f64();
        if seconds > 0.0 {
            self.latencies_us.len() as f64 / seconds
        } else {
            0.0
        }
    }

    /// Records one request sent at `started`; true if it failed.
    fn record(&mut self, started: Instant, outcome: anyhow::Result<()>) -> bool {
        match outcome {
            Ok(()) => {
                self.latencies_us
                    .push(started.elapsed().as_secs_f64() * 1e6);
                false
            }
            Err(error) => {
                self.failures += 1;
                if self.first_failure.is_none() {
                    self.first_failure = Some(format!("{error:#}"));
                }
                true
            }
        }
    }

    fn merge(&mut self, other: PhaseResult) {
        self.latencies_us.extend(other.latencies_us);
        self.failures += other.failures;
        if self.first_failure.is_none() {
            self.first_failure = other.first_failure;
        }
    }
}

/// Runs `concurrency` closed loops against `target` for `duration`.
/// Connections are opened before the clock starts.
pub async fn run(
    target: &Target,
    concurrency: usize,
    duration: Duration,
) -> anyhow::Result<PhaseResult> {
    let mut senders = Vec::with_capacity(concurrency);
    for _ in 0..concurrency {
        senders.push(connect(target.addr).await?);
    }
    let start = Instant::now();
    let deadline = start + duration;
    let mut workers = JoinSet::new();
    for sender in senders {
        let target = target.clone();
        workers.spawn(worker(sender, target, deadline));
    }
    let mut result = PhaseResult::default();
    while let Some(worker) = workers.join_next().await {
        result.merge(worker.context("load worker panicked")?);
    }
    result.elapsed = start.elapsed();
    Ok(result)
}

/// Latency at concurrency 1 against several targets at once: one keep-alive
/// connection each, requests sent one at a time, rotating over the targets
/// (the starting target shifts every cycle). Interleaving request by request
/// puts every target under the same machine noise, which alternating whole
/// phases cannot do on a shared machine.
pub async fn interleaved(
    targets: &[Target],
    duration: Duration,
) -> anyhow::Result<Vec<PhaseResult>> {
    let mut senders = Vec::with_capacity(targets.len());
    for target in targets {
        senders.push(connect(target.addr).await?);
    }
    let mut results = vec![PhaseResult::default(); targets.len()];
    let start = Instant::now();
    let deadline = start + duration;
    let mut cycle = 0usize;
    while Instant::now() < deadline {
        for step in 0..targets.len() {
            let index = (cycle + step) % targets.len();
            let result = &mut results[index];
            let started = Instant::now();
            let outcome = send_one(&mut senders[index], &targets[index]).await;
            if result.record(started, outcome) {
                senders[index] = connect(targets[index].addr).await?;
            }
        }
        cycle += 1;
    }
    let elapsed = start.elapsed();
    for result in &mut results {
        result.elapsed = elapsed;
    }
    Ok(results)
}

async fn connect(addr: SocketAddr) -> anyhow::Result<SendRequest<Full<Bytes>>> {
    let stream = TcpStream::connect(addr)
        .await
        .with_context(|| format!("connecting to {addr}"))?;
    stream.set_nodelay(true)?;
    let (sender, connection) = http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(connection);
    Ok(sender)
}

async fn worker(
    mut sender: SendRequest<Full<Bytes>>,
    target: Target,
    deadline: Instant,
) -> PhaseResult {
    let mut result = PhaseResult::default();
    while Instant::now() < deadline {
        let started = Instant::now();
        let outcome = send_one(&mut sender, &target).await;
        if result.record(started, outcome) {
            // The connection may be gone; a failed reconnect ends this loop.
            match connect(target.addr).await {
                Ok(fresh) => sender = fresh,
                Err(_) => break,
            }
        }
    }
    result
}

async fn send_one(sender: &mut SendRequest<Full<Bytes>>, target: &Target) -> anyhow::Result<()> {
    sender.ready().await?;
    let request = hyper::Request::post(target.path.as_str())
        .header("host", "bench.local")
        .header("content-type", "application/json")
        .body(Full::new(target.body.clone()))?;
    let response = sender.send_request(request).await?;
    let status = response.status();
    let body = response.into_body().collect().await?.to_bytes();
    if status != hyper::StatusCode::OK {
        anyhow::bail!("HTTP {status}: {}", String::from_utf8_lossy(&body));
    }
    Ok(())
}
