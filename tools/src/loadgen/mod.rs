//! The load generator (`loadgen`): drives a workload against an endpoint
//! (Envoy, or an instance directly) on the OpenAI chat or native invoke API,
//! open loop (Poisson arrivals) or at fixed concurrency, and summarises what
//! clients saw. [`run_workload`] is the entry point for the benchmark
//! orchestrator; the binary is a thin CLI over it.
//!
//! Units: `RunOptions::arrival`'s rate is in requests per *simulated* second
//! and all reported times and rates are simulated (see [`report`]), so that
//! a run against instances with `--time-scale 10` reads like one on the real
//! hardware. `max_duration` and `request_timeout` are wall-clock bounds.
//!
//! Conversation replays (`sharegpt`, `sharegpt-system`) are driven as
//! conversations: each arrival (or each client, at fixed concurrency) starts
//! one, which sends its turns one after another, each after the previous
//! response and the workload's think time; `max_requests` then bounds the
//! turns of the conversations started.

pub mod client;
pub mod replay;
pub mod report;
pub mod sharegpt;
pub mod text;
pub mod workload;

use std::str::FromStr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context as _;
use bytes::Bytes;
use hyper::header::{HeaderName, HeaderValue};
use hyper::Uri;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};
use tokio::task::JoinSet;
use tokio::time::{sleep_until, Instant};

pub use report::{Report, RequestRecord};
pub use sharegpt::Corpus;
pub use workload::{Workload, WorkloadGen, DATA_WORKLOAD_NAMES, WORKLOAD_NAMES};

use client::HttpClient;
use workload::PlannedRequest;

/// Which API the requests use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Api {
    /// OpenAI chat completions.
    Chat,
    /// Native invoke: `{"inputs": text, "parameters": {...}, "stream": ...}`.
    Invoke,
}

impl Api {
    /// `chat` or `invoke`.
    pub fn name(self) -> &'static str {
        match self {
            Api::Chat => "chat",
            Api::Invoke => "invoke",
        }
    }
}

impl FromStr for Api {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "chat" | "openai" => Ok(Api::Chat),
            "invoke" | "native" => Ok(Api::Invoke),
            _ => Err(format!("unknown API {s:?}: use chat or invoke")),
        }
    }
}

/// How requests are issued.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Arrival {
    /// Open loop: exponential gaps at this many requests per simulated second.
    Poisson { rate: f64 },
    /// Closed loop: this many requests in flight at all times.
    Concurrency { clients: usize },
}

/// How a run is driven.
#[derive(Debug, Clone)]
pub struct RunOptions {
    /// The API.
    pub api: Api,
    /// Arrivals.
    pub arrival: Arrival,
    /// Stop issuing after this many requests.
    pub max_requests: usize,
    /// Stop issuing after this much wall-clock time.
    pub max_duration: Duration,
    /// A request not finished after this long (wall clock) fails.
    pub request_timeout: Duration,
    /// Seed of the traffic: arrivals, group choices, questions, conversations.
    pub seed: u64,
    /// Seed of the workload's shared texts (group prefixes, prompt pools,
    /// system prompt): keep it across runs that should share prefixes, e.g. a
    /// warm-up and the measured run.
    pub shared_seed: u64,
    /// The instances' time scale (simulated seconds per real second).
    pub time_scale: f64,
    /// Stream responses (TTFT at the first content event) or not (TTFT = latency).
    pub stream: bool,
    /// `model` sent on the chat API.
    pub model: String,
    /// Path of the chat API.
    pub chat_path: String,
    /// Path of the invoke API.
    pub invoke_path: String,
    /// Extra request headers (e.g. a tenant header).
    pub headers: Vec<(String, String)>,
    /// Instance names expected to serve, so an idle one counts as a 0 share.
    pub instances: Vec<String>,
    /// Keep every request's record in the report.
    pub keep_records: bool,
    /// The real data the `sharegpt`, `sharegpt-system` and `rag` workloads need.
    pub corpus: Option<Arc<Corpus>>,
    /// Instead of `target_url`, send each request straight to one of these
    /// base URLs: its group's (else its conversation's) number modulo their
    /// count. Pins every group to one instance, spread evenly: the oracle
    /// placement.
    pub pinned_targets: Vec<String>,
    /// Instead of `target_url`, send requests through these base URLs in turn
    /// (replicas of one proxy), as [`alternating_target`] picks: consecutive
    /// turns of a conversation always go through different ones.
    pub alternate_targets: Vec<String>,
}

impl Default for RunOptions {
    fn default() -> Self {
        RunOptions {
            api: Api::Chat,
            arrival: Arrival::Concurrency { clients: 8 },
            max_requests: 100,
            max_duration: Duration::from_secs(60),
            request_timeout: Duration::from_secs(120),
            seed: 1,
            shared_seed: workload::DEFAULT_SHARED_SEED,
            time_scale: 1.0,
            stream: true,
            model: crate::sim::SimConfig::default().model,
            chat_path: "/v1/chat/completions".into(),
            invoke_path: "/invocations".into(),
            headers: Vec::new(),
            instances: Vec::new(),
            keep_records: false,
            corpus: None,
            pinned_targets: Vec::new(),
            alternate_targets: Vec::new(),
        }
    }
}

#[derive(Serialize)]
struct ChatBody<'a> {
    model: &'a str,
    messages: &'a [workload::Message],
    max_tokens: usize,
    stream: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    stream_options: Option<StreamOptions>,
    ignore_eos: bool,
}

#[derive(Serialize)]
struct StreamOptions {
    include_usage: bool,
}

/// `inputs` first: routers that key on the raw body's first bytes see the prompt.
#[derive(Serialize)]
struct InvokeBody {
    inputs: String,
    parameters: InvokeParameters,
    stream: bool,
}

#[derive(Serialize)]
struct InvokeParameters {
    max_new_tokens: usize,
}

/// The request body for `planned` on `api`.
pub fn request_body(api: Api, planned: &PlannedRequest, opts: &RunOptions) -> Bytes {
    let json = match api {
        Api::Chat => serde_json::to_vec(&ChatBody {
            model: planned.model.as_deref().unwrap_or(&opts.model),
            messages: &planned.messages,
            max_tokens: planned.output_tokens,
            stream: opts.stream,
            stream_options: opts.stream.then_some(StreamOptions {
                include_usage: true,
            }),
            ignore_eos: true,
        }),
        Api::Invoke => serde_json::to_vec(&InvokeBody {
            inputs: planned.text(),
            parameters: InvokeParameters {
                max_new_tokens: planned.output_tokens,
            },
            stream: opts.stream,
        }),
    };
    // Serialising strings and numbers cannot fail.
    Bytes::from(json.unwrap_or_default())
}

/// Which of `replicas` targets a request goes through when a run alternates
/// between them: turn `t` (from 0) of conversation `c` goes to `(c + t) mod
/// replicas`, so each turn goes through another replica than the turn before;
/// a request outside a conversation goes to `index mod replicas`.
pub fn alternating_target(index: usize, planned: &PlannedRequest, replicas: usize) -> usize {
    let replicas = replicas.max(1) as u64;
    let slot = match planned.conversation {
        Some(conversation) => {
            // Every turn adds one user message to the history it sends.
            let turn = planned.messages.iter().filter(|m| m.role == "user").count();
            conversation.wrapping_add(turn.saturating_sub(1) as u64)
        }
        None => index as u64,
    };
    (slot % replicas) as usize
}

/// How a run's requests pick one of its target URIs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Targeting {
    /// The one target.
    One,
    /// Group (else conversation) modulo the targets: the oracle.
    Pinned,
    /// [`alternating_target`].
    Alternating,
}

struct Run {
    client: HttpClient,
    /// One target, the pinned targets or the alternated ones.
    uris: Vec<Uri>,
    targeting: Targeting,
    headers: Vec<(HeaderName, HeaderValue)>,
    opts: RunOptions,
    gen: Mutex<WorkloadGen>,
    records: Mutex<Vec<RequestRecord>>,
    start: Instant,
    last_end: Mutex<Instant>,
    /// Requests issued so far (conversation replays number them here).
    issued: std::sync::atomic::AtomicUsize,
    deadline: Instant,
}

impl Run {
    fn sim_ms(&self, d: Duration) -> f64 {
        d.as_secs_f64() * 1000.0 * self.opts.time_scale
    }

    fn next(&self) -> PlannedRequest {
        self.gen
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .next_request()
    }

    /// Where `planned` goes: the one target, its group's pinned target or
    /// its turn's alternated target.
    fn uri_for(&self, index: usize, planned: &PlannedRequest) -> &Uri {
        let slot = match self.targeting {
            Targeting::One => 0,
            Targeting::Pinned => {
                let key = planned
                    .group
                    .map(|g| g as u64)
                    .or(planned.conversation)
                    .unwrap_or(index as u64);
                (key % self.uris.len() as u64) as usize
            }
            Targeting::Alternating => alternating_target(index, planned, self.uris.len()),
        };
        &self.uris[slot % self.uris.len()]
    }

    /// Sends one request and records it; true if it succeeded.
    async fn one(&self, index: usize, planned: PlannedRequest) -> bool {
        let sent = Instant::now();
        let body = request_body(self.opts.api, &planned, &self.opts);
        let ex = client::exchange(
            &self.client,
            self.uri_for(index, &planned),
            &self.headers,
            body,
            self.opts.stream,
            self.opts.request_timeout,
        )
        .await;
        let ok = ex.error.is_none();
        self.gen
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .complete(planned.conversation, ok.then(|| ex.content.clone()));
        let record = RequestRecord {
            index,
            start_ms: self.sim_ms(sent - self.start),
            ok,
            status: ex.status,
            error: ex.error,
            instance: ex.instance,
            ttft_ms: ex.first_content.map(|d| self.sim_ms(d)),
            latency_ms: self.sim_ms(ex.latency),
            prompt_tokens: ex.usage.map(|u| u.prompt_tokens),
            cached_tokens: ex.usage.map(|u| u.cached_tokens),
            completion_tokens: ex.usage.map(|u| u.completion_tokens),
            group: planned.group,
            conversation: planned.conversation,
        };
        self.records
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(record);
        let mut last = self.last_end.lock().unwrap_or_else(|e| e.into_inner());
        *last = (*last).max(Instant::now());
        ok
    }

    /// The next conversation to replay, if the run may start one.
    fn next_conversation(&self) -> Option<replay::PlannedConversation> {
        if Instant::now() >= self.deadline {
            return None;
        }
        let mut gen = self.gen.lock().unwrap_or_else(|e| e.into_inner());
        let conversation = gen.replay()?.next_conversation()?;
        Some(conversation)
    }

    /// Replays one conversation: each turn after the previous response and
    /// its think time; stops at a failed turn, `max_requests` or the deadline.
    async fn conversation(&self, conversation: replay::PlannedConversation) {
        use std::sync::atomic::Ordering;
        for (planned, think_ms) in conversation.turns.into_iter().zip(conversation.think_ms) {
            if Instant::now() >= self.deadline {
                break;
            }
            let index = self.issued.fetch_add(1, Ordering::Relaxed);
            if index >= self.opts.max_requests {
                break;
            }
            if !self.one(index, planned).await {
                break;
            }
            let real_ms = think_ms / self.opts.time_scale;
            tokio::time::sleep(Duration::from_secs_f64(real_ms / 1000.0)).await;
        }
    }
}

/// Runs `workload` against `target_url` (e.g. `http://127.0.0.1:10000`) and
/// summarises it. Issues requests until `max_requests` or `max_duration`,
/// then waits for those in flight (each bounded by `request_timeout`).
pub async fn run_workload(
    target_url: &str,
    workload: &Workload,
    opts: &RunOptions,
) -> anyhow::Result<Report> {
    if !(opts.time_scale.is_finite() && opts.time_scale > 0.0) {
        anyhow::bail!("time scale must be positive, got {}", opts.time_scale);
    }
    let path = match opts.api {
        Api::Chat => &opts.chat_path,
        Api::Invoke => &opts.invoke_path,
    };
    let (targeting, bases) = match (&opts.pinned_targets[..], &opts.alternate_targets[..]) {
        ([], []) => (Targeting::One, vec![target_url.to_string()]),
        (pinned, []) => (Targeting::Pinned, pinned.to_vec()),
        ([], alternated) => (Targeting::Alternating, alternated.to_vec()),
        _ => anyhow::bail!("pinned_targets and alternate_targets exclude each other"),
    };
    let uris = bases
        .iter()
        .map(|base| {
            let url = format!("{}{}", base.trim_end_matches('/'), path);
            let uri: Uri = url
                .parse()
                .with_context(|| format!("bad target URL {url:?}"))?;
            if uri.scheme_str() != Some("http") {
                anyhow::bail!("only http:// targets are supported, got {url:?}");
            }
            Ok(uri)
        })
        .collect::<anyhow::Result<Vec<Uri>>>()?;
    let mut gen = WorkloadGen::new(workload.clone(), opts.seed).with_shared_seed(opts.shared_seed);
    if workload.needs_corpus() {
        let corpus = opts.corpus.clone().with_context(|| {
            format!(
                "workload {} needs the ShareGPT data (RunOptions::corpus)",
                workload.name()
            )
        })?;
        gen = gen.with_corpus(corpus);
    }
    let headers = opts
        .headers
        .iter()
        .map(|(k, v)| {
            Ok((
                HeaderName::from_bytes(k.as_bytes())
                    .with_context(|| format!("bad header name {k:?}"))?,
                HeaderValue::from_str(v).with_context(|| format!("bad value for header {k}"))?,
            ))
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let start = Instant::now();
    let deadline = start + opts.max_duration;
    let run = Arc::new(Run {
        client: client::http_client(),
        uris,
        targeting,
        headers,
        opts: opts.clone(),
        gen: Mutex::new(gen),
        records: Mutex::new(Vec::new()),
        start,
        last_end: Mutex::new(start),
        issued: std::sync::atomic::AtomicUsize::new(0),
        deadline,
    });
    let mut tasks = JoinSet::new();
    let replay = workload.is_conversation_replay();
    match opts.arrival {
        Arrival::Poisson { rate } if replay => {
            if !(rate.is_finite() && rate > 0.0) {
                anyhow::bail!("arrival rate must be positive, got {rate}");
            }
            let real_rate = rate * opts.time_scale;
            let mut rng = StdRng::seed_from_u64(opts.seed ^ 0x5eed_a441_7a1e);
            let mut next = start;
            let mut planned_turns = 0;
            while planned_turns < opts.max_requests {
                sleep_until(next).await;
                let Some(conversation) = run.next_conversation() else {
                    break;
                };
                planned_turns += conversation.turns.len();
                let r = Arc::clone(&run);
                tasks.spawn(async move { r.conversation(conversation).await });
                while tasks.try_join_next().is_some() {}
                let u: f64 = rng.gen_range(f64::MIN_POSITIVE..1.0);
                next += Duration::from_secs_f64(-u.ln() / real_rate);
            }
        }
        Arrival::Concurrency { clients } if replay => {
            if clients == 0 {
                anyhow::bail!("concurrency must be at least 1");
            }
            for _ in 0..clients {
                let r = Arc::clone(&run);
                tasks.spawn(async move {
                    while let Some(conversation) = r.next_conversation() {
                        r.conversation(conversation).await;
                    }
                });
            }
        }
        Arrival::Poisson { rate } => {
            if !(rate.is_finite() && rate > 0.0) {
                anyhow::bail!("arrival rate must be positive, got {rate}");
            }
            let real_rate = rate * opts.time_scale;
            let mut rng = StdRng::seed_from_u64(opts.seed ^ 0x5eed_a441_7a1e);
            let mut next = start;
            for index in 0..opts.max_requests {
                if next >= deadline {
                    break;
                }
                sleep_until(next).await;
                let planned = run.next();
                let r = Arc::clone(&run);
                tasks.spawn(async move {
                    let _ = r.one(index, planned).await;
                });
                while tasks.try_join_next().is_some() {}
                let u: f64 = rng.gen_range(f64::MIN_POSITIVE..1.0);
                next += Duration::from_secs_f64(-u.ln() / real_rate);
            }
        }
        Arrival::Concurrency { clients } => {
            if clients == 0 {
                anyhow::bail!("concurrency must be at least 1");
            }
            let issued = Arc::new(std::sync::atomic::AtomicUsize::new(0));
            for _ in 0..clients {
                let r = Arc::clone(&run);
                let issued = Arc::clone(&issued);
                let max = opts.max_requests;
                tasks.spawn(async move {
                    loop {
                        let index = issued.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        if index >= max || Instant::now() >= deadline {
                            break;
                        }
                        let planned = r.next();
                        let _ = r.one(index, planned).await;
                    }
                });
            }
        }
    }
    while tasks.join_next().await.is_some() {}
    let mut records = std::mem::take(&mut *run.records.lock().unwrap_or_else(|e| e.into_inner()));
    records.sort_by_key(|r| r.index);
    let last_end = *run.last_end.lock().unwrap_or_else(|e| e.into_inner());
    let duration_s = (last_end - start).as_secs_f64() * opts.time_scale;
    Ok(report::summarize(
        workload.name(),
        opts.api.name(),
        opts.time_scale,
        duration_s,
        records,
        &opts.instances,
        opts.keep_records,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn invoke_body_starts_with_the_prompt() {
        let mut g = WorkloadGen::new(
            Workload::by_name("long-shared-prefix").unwrap().scaled(0.1),
            1,
        );
        let planned = g.next_request();
        let body = request_body(Api::Invoke, &planned, &RunOptions::default());
        let text = planned.text();
        let expected_start = format!("{{\"inputs\":\"{}", &text[..100]);
        assert!(body.starts_with(expected_start.as_bytes()));
        let chat: serde_json::Value =
            serde_json::from_slice(&request_body(Api::Chat, &planned, &RunOptions::default()))
                .unwrap();
        assert_eq!(
            chat["messages"][0]["content"],
            planned.messages[0].content.as_str()
        );
        assert_eq!(chat["stream_options"]["include_usage"], true);
        assert_eq!(chat["max_tokens"], 26);
        assert_eq!(chat["model"], RunOptions::default().model.as_str());
        // A request's own model (a LoRA adapter) replaces the run's.
        let adapter = PlannedRequest {
            model: Some("adapter-07".into()),
            ..planned
        };
        let chat: serde_json::Value =
            serde_json::from_slice(&request_body(Api::Chat, &adapter, &RunOptions::default()))
                .unwrap();
        assert_eq!(chat["model"], "adapter-07");
    }

    /// Turn `turn` (from 0) of `conversation`: its history and the next question.
    fn turn_of(conversation: Option<u64>, turn: usize) -> PlannedRequest {
        let mut messages = vec![workload::Message::new("system", "be brief".into())];
        for t in 0..=turn {
            messages.push(workload::Message::new("user", format!("question {t}")));
            if t < turn {
                messages.push(workload::Message::new("assistant", format!("answer {t}")));
            }
        }
        PlannedRequest {
            messages,
            output_tokens: 1,
            group: None,
            conversation,
            model: None,
        }
    }

    #[test]
    fn consecutive_turns_of_a_conversation_alternate_between_replicas() {
        for conversation in 0..5u64 {
            let replicas: Vec<usize> = (0..6)
                .map(|turn| alternating_target(99, &turn_of(Some(conversation), turn), 2))
                .collect();
            // Turn t of conversation c through replica (c + t) mod 2, whatever the index.
            let expected: Vec<usize> = (0..6).map(|t| (conversation as usize + t) % 2).collect();
            assert_eq!(replicas, expected, "conversation {conversation}");
        }
        // Requests outside conversations: by their index.
        let lone: Vec<usize> = (0..5)
            .map(|index| alternating_target(index, &turn_of(None, 0), 2))
            .collect();
        assert_eq!(lone, [0, 1, 0, 1, 0]);
        assert_eq!(alternating_target(7, &turn_of(Some(3), 2), 1), 0);
    }
}
