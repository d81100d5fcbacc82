//! The filter's own work per request, without Envoy: reading the body
//! (classification, extraction, key) and routing it (policy, load tables in
//! an in-memory shared store, the upstream count, the release). It runs the
//! same way natively and as wasm32 under Node's V8, the engine Envoy runs the
//! filter in, so the second shows what the `.wasm` itself costs:
//!
//! ```sh
//! cargo bench --bench per_request                          # native
//! cargo bench --bench per_request --target wasm32-wasip1   # under Node's V8
//! cargo bench --bench per_request -- usage                 # the usage scanner's lines only
//! ```
//!
//! Each line is the best of 7 timed runs after a warm-up (the machine is
//! shared; the minimum is the least disturbed). The host calls around this
//! work are measured through Envoy instead (docs/benchmarks.md); the
//! shared-data reads and writes of the routing lines are counted here too.

use std::hint::black_box;
use std::rc::Rc;
use std::time::Instant;

use prefix_router::blocks::PromptBlocks;
use prefix_router::config::Config;
use prefix_router::extract::PrefixSource;
use prefix_router::headers::OnceHeader;
use prefix_router::key::KeyMaterial;
use prefix_router::load::{LoadTracker, UpstreamStart};
use prefix_router::request::{
    BodyKind, BodyVerdict, HeadersVerdict, KeyDerivation, RequestHead, RequestReader,
};
use prefix_router::shared::MemoryStore;
use prefix_router::steering;
use prefix_router::strategy::{RecentChoices, RouteRequest};
use prefix_router::usage::{Framing, UsageScanner};

/// Envoy's body callbacks deliver up to this much at once here.
const CHUNK: usize = 16 * 1024;

const INSTANCES: [&str; 7] = [
    "10.0.0.1:8000",
    "10.0.0.2:8000",
    "10.0.0.3:8000",
    "10.0.0.4:8000",
    "10.0.0.5:8000",
    "10.0.0.6:8000",
    "10.0.0.7:8000",
];

/// Best microseconds per call of `f` over 7 runs of `iterations`.
fn best_of_7(iterations: u32, mut f: impl FnMut()) -> f64 {
    for _ in 0..iterations / 10 + 1 {
        f();
    }
    (0..7)
        .map(|_| {
            let started = Instant::now();
            for _ in 0..iterations {
                f();
            }
            started.elapsed().as_secs_f64() * 1e6 / f64::from(iterations)
        })
        .fold(f64::INFINITY, f64::min)
}

/// Prose like a prompt's: mostly ASCII, some accents, CJK, typographic and
/// escaped quotes and newlines (what the overhead benchmark's bodies hold).
fn prose(min_bytes: usize) -> String {
    let words = [
        "the",
        "cache",
        "prefix",
        "café",
        "naïve",
        "日本語",
        "“quoted”",
        "\"cache\"",
        "instance",
        "summarise",
        "latency",
        "données",
        "über",
        "question",
    ];
    let mut text = String::new();
    let mut i = 0usize;
    while text.len() < min_bytes {
        text.push_str(words[(i * 7 + i / 5) % words.len()]);
        text.push_str(if i % 23 == 22 { ".\n\n" } else { " " });
        i += 1;
    }
    text
}

/// An OpenAI chat body of about `size` bytes: a system prompt of a third of
/// it, alternating turns, `model` after `messages` (the whole body is read).
fn chat_body(size: usize) -> Vec<u8> {
    let mut messages = vec![serde_json::json!({"role": "system", "content": prose(size / 3)})];
    let mut used = size / 3;
    let turn = (size / 8).clamp(200, 6000);
    while used + turn < size {
        let role = if messages.len() % 2 == 1 {
            "user"
        } else {
            "assistant"
        };
        messages.push(serde_json::json!({"role": role, "content": prose(turn)}));
        used += turn + 40;
    }
    serde_json::to_vec(&serde_json::json!({
        "messages": messages,
        "model": "meta-llama/Llama-3.1-70B-Instruct",
        "max_tokens": 256
    }))
    .expect("serialisable")
}

fn config(json: &str) -> Rc<Config> {
    Rc::new(Config::parse(json.as_bytes()).expect("valid configuration"))
}

/// Headers and body callbacks as Envoy makes them; panics unless a key comes out.
fn read_request(config: &Rc<Config>, path: &str, body: &[u8]) -> String {
    read_derivation(config, path, body).key.expect("keyed")
}

/// What [`read_request`] derives from the request.
fn read_derivation(config: &Rc<Config>, path: &str, body: &[u8]) -> KeyDerivation {
    let mut reader = RequestReader::new(Rc::clone(config));
    let head = RequestHead {
        path: path.as_bytes(),
        tenant_header: OnceHeader::Absent,
        end_of_stream: false,
        body: BodyKind::Plain,
    };
    assert_eq!(
        reader.on_request_headers(head),
        HeadersVerdict::PauseForBody
    );
    let mut buffered = 0;
    for chunk in body.chunks(CHUNK) {
        buffered += chunk.len();
        let end = buffered == body.len();
        let mut read = |start: usize, len: usize| body.get(start..start + len).map(<[u8]>::to_vec);
        match reader.on_request_body(buffered, end, &mut read) {
            BodyVerdict::Pause => continue,
            BodyVerdict::Continue(derivation) => return derivation,
            BodyVerdict::AlreadyDecided => break,
        }
    }
    panic!("no decision")
}

/// A tracker over `store` that has seen every instance serve.
fn tracker_with_instances(
    config: &Config,
    store: &Rc<MemoryStore>,
    now_ms: u64,
) -> LoadTracker<Rc<MemoryStore>> {
    tracker_over(config, store, now_ms, &INSTANCES)
}

/// A tracker over `store` that has seen each of `instances` serve.
fn tracker_over(
    config: &Config,
    store: &Rc<MemoryStore>,
    now_ms: u64,
    instances: &[&str],
) -> LoadTracker<Rc<MemoryStore>> {
    let mut tracker = LoadTracker::new(Rc::clone(store), steering::load_config(config), 7);
    for &address in instances {
        let start = UpstreamStart {
            address,
            key: None,
            overridden: false,
            counted: None,
        };
        if let Some(ticket) = tracker.upstream_started(start, now_ms) {
            tracker.release(ticket, now_ms);
        }
    }
    tracker
}

/// Routing `requests` through one worker's tracker: the decision, the count
/// where Envoy sends it (the host override, else a stand-in for Maglev) and
/// the release of both, 50 keys in turn.
fn route_requests(strategy: &str) -> impl FnMut() {
    let config = config(&format!(
        r#"{{"strategy":"{strategy}","match":"FIXED_PREFIX","prefix_length":4096,"host_header":"x-prefix-route-host"}}"#
    ));
    let policy = steering::policy_for(&config);
    let mut now_ms = 1_000_000u64;
    let mut tracker = tracker_with_instances(&config, &Rc::new(MemoryStore::new()), now_ms);
    let keys: Vec<String> = (0..50u64).map(|k| format!("{k:016x}")).collect();
    let mut recent = RecentChoices::default();
    let mut n = 0usize;
    move || {
        n += 1;
        now_ms += 1;
        let k = n % keys.len();
        let key = &keys[k];
        let random = (n as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        let request = RouteRequest {
            key: Some(key),
            ..RouteRequest::default()
        };
        let routed = policy.route(request, &mut tracker, &mut recent, random, now_ms);
        let decision = &routed.headers;
        let address = decision
            .host_override
            .as_deref()
            .unwrap_or(INSTANCES[k % INSTANCES.len()]);
        let start = UpstreamStart {
            address,
            key: Some(key),
            overridden: decision.host_override.is_some(),
            counted: decision.counted.as_deref(),
        };
        let upstream_ticket = tracker.upstream_started(start, now_ms);
        for ticket in [routed.ticket, upstream_ticket].into_iter().flatten() {
            tracker.release(ticket, now_ms);
        }
    }
}

/// LONGEST_PREFIX (the default) as the overhead benchmark configures it
/// (no `instances`: a cold prompt goes by Maglev and is recorded at its
/// response): the decision on `body`'s blocks, the upstream count, the
/// response's recording when Envoy placed it, the releases. `fresh`: every
/// request a new prompt (its chain salted with the request number), else
/// the same one. Also returns the store, to count its reads and writes.
fn route_prompts(path: &str, body: &[u8], fresh: bool) -> (impl FnMut(), Rc<MemoryStore>) {
    route_prompts_over(path, body, fresh, None, 1, false)
}

/// [`route_prompts`], with `listed` instances listed in the configuration
/// (as the overhead benchmark lists its fleet), all of them serving, and
/// requests `step_ms` apart; with `adapter`, each request for a LoRA adapter
/// (`adapters` configured).
fn route_prompts_over(
    path: &str,
    body: &[u8],
    fresh: bool,
    listed: Option<&[String]>,
    step_ms: u64,
    adapter: bool,
) -> (impl FnMut(), Rc<MemoryStore>) {
    let mut settings = serde_json::json!({
        "strategy": "PREFIX_AWARE",
        "prefix_length": 4096,
        "host_header": "x-prefix-route-host"
    });
    if let Some(listed) = listed {
        settings["instances"] = serde_json::json!(listed);
    }
    if adapter {
        settings["adapters"] = serde_json::json!({"base_models": ["base"]});
    }
    let adapter = adapter.then(|| xxhash_rust::xxh3::xxh3_64(b"sql-lora"));
    let config = config(&settings.to_string());
    let derivation = read_derivation(&config, path, body);
    let key = derivation.key.clone().expect("keyed");
    let policy = steering::policy_for(&config);
    let mut now_ms = 1_000_000u64;
    let store = Rc::new(MemoryStore::new());
    let serving: Vec<String> = match listed {
        Some(listed) => listed.to_vec(),
        None => INSTANCES.iter().map(|a| a.to_string()).collect(),
    };
    let addresses: Vec<&str> = serving.iter().map(String::as_str).collect();
    let mut tracker = tracker_over(&config, &store, now_ms, &addresses);
    let mut recent = RecentChoices::default();
    let mut n = 0u64;
    let mut derivation = derivation;
    let route = move || {
        n += 1;
        now_ms += step_ms;
        // What the glue's three tracker calls of a request (decision,
        // upstream count, release) each apply first.
        for _ in 0..3 {
            tracker.set_instance_ttl_ms(config.instance_ttl_ms);
            if !config.instances.is_empty() {
                tracker.set_configured_instances(&config.instances);
            }
        }
        if fresh {
            if let Some(blocks) = derivation.blocks.as_mut() {
                for hash in &mut blocks.chain {
                    *hash ^= n.wrapping_mul(0x9e37_79b9_7f4a_7c15);
                }
            }
        }
        let random = n.wrapping_mul(0x9e37_79b9_7f4a_7c15);
        let request = RouteRequest::of(&derivation, adapter);
        let routed = policy.route(request, &mut tracker, &mut recent, random, now_ms);
        let decision = &routed.headers;
        let address = decision.host_override.as_deref().unwrap_or(&serving[0]);
        let start = UpstreamStart {
            address,
            key: Some(&key),
            overridden: decision.host_override.is_some(),
            counted: decision.counted.as_deref(),
        };
        let upstream_ticket = tracker.upstream_started(start, now_ms);
        if decision.host_override.is_none() {
            let chain = derivation.blocks.as_ref().map_or(&[][..], |b| &b.chain);
            tracker.remember_where_served(chain, address, now_ms + 1);
        }
        for ticket in [routed.ticket, upstream_ticket].into_iter().flatten() {
            tracker.release(ticket, now_ms);
        }
    };
    (route, store)
}

/// A 64 KiB response of `framing` as vLLM writes it, its usage at the end:
/// one chat completion, or chunks of a few words each.
fn response_body(framing: Framing) -> Vec<u8> {
    let usage = r#""usage":{"prompt_tokens":1536,"total_tokens":2560,"completion_tokens":1024,"prompt_tokens_details":{"cached_tokens":1408}}"#;
    let body = match framing {
        Framing::Json => format!(
            r#"{{"id":"chatcmpl-1","object":"chat.completion","choices":[{{"index":0,"message":{{"role":"assistant","content":"{}"}},"finish_reason":"length"}}],{usage}}}"#,
            prose(64 << 10)
        ),
        Framing::EventStream => {
            let mut events = String::new();
            let words = prose(64 << 10);
            let mut words = words.split(' ');
            while events.len() < 64 << 10 {
                let piece: Vec<&str> = words.by_ref().take(3).collect();
                events.push_str(&format!(
                    r#"data: {{"id":"chatcmpl-1","object":"chat.completion.chunk","choices":[{{"index":0,"delta":{{"content":"{} "}},"finish_reason":null}}],"usage":null}}"#,
                    piece.join(" ")
                ));
                events.push_str("\n\n");
            }
            format!("{events}data: {{\"choices\":[],{usage}}}\n\ndata: [DONE]\n\n")
        }
    };
    body.into_bytes()
}

/// The usage scanner over 64 KiB responses in Envoy-sized chunks.
fn scan_responses() {
    for (name, framing) in [
        ("scan usage JSON 64 KiB", Framing::Json),
        ("scan usage stream 64 KiB", Framing::EventStream),
    ] {
        let body = response_body(framing);
        let us = best_of_7(1000, || {
            let mut scanner = UsageScanner::new(framing);
            for chunk in body.chunks(CHUNK) {
                scanner.feed(black_box(chunk));
            }
            assert!(black_box(scanner.finish()).is_some());
        });
        let per_kib = us / (body.len() as f64 / 1024.0);
        println!("  {name:<28} {us:8.2}   {per_kib:.3} µs per KiB");
    }
}

fn main() {
    let target = if cfg!(target_arch = "wasm32") {
        "wasm32 under Node's V8"
    } else {
        "native"
    };
    println!("per request, {target} (best of 7 runs, µs):");
    if std::env::args().skip(1).any(|arg| arg == "usage") {
        scan_responses();
        return;
    }
    if std::env::args().skip(1).any(|arg| arg == "fleets") {
        route_over_fleets();
        return;
    }
    // Every body type keyed on its first 4,096 bytes or characters, at the
    // default match (LONGEST_PREFIX).
    let prefix_4096 = config(r#"{"prefix_length":4096}"#);
    for (name, size, iterations) in [
        ("read chat 8 KiB", 8 << 10, 3000),
        ("read chat 64 KiB", 64 << 10, 1000),
        ("read chat 1 MiB", 1 << 20, 50),
    ] {
        let body = chat_body(size);
        let us = best_of_7(iterations, || {
            black_box(read_request(
                &prefix_4096,
                "/v1/chat/completions",
                black_box(&body),
            ));
        });
        println!("  {name:<28} {us:8.2}");
    }
    // FIXED_PREFIX reads the same body for its key alone (no blocks).
    let fixed_4096 = config(r#"{"prefix_length":4096,"match":"FIXED_PREFIX"}"#);
    let body = chat_body(8 << 10);
    let us = best_of_7(3000, || {
        black_box(read_request(
            &fixed_4096,
            "/v1/chat/completions",
            black_box(&body),
        ));
    });
    println!("  {:<28} {us:8.2}", "read chat 8 KiB FIXED_PREFIX");
    let body: Vec<u8> = (0..8192u32).map(|i| b'a' + (i % 26) as u8).collect();
    let us = best_of_7(3000, || {
        black_box(read_request(&prefix_4096, "/invocations", black_box(&body)));
    });
    println!("  {:<28} {us:8.2}", "read invoke 8 KiB");
    // LONGEST_PREFIX's blocks of a 4 KiB canonical prefix: a system message
    // of a third, then the conversation (chained hashes, opening, start).
    let mut canonical = format!("role=system\u{1f}text={}\u{1f}\u{1e}", prose(1365));
    while canonical.len() < 4096 {
        canonical.push_str(&format!("role=user\u{1f}text={}\u{1f}\u{1e}", prose(800)));
    }
    let material = KeyMaterial {
        tenant: None,
        model: Some(b"meta-llama/Llama-3.1-70B-Instruct"),
        source: PrefixSource::CanonicalText,
        prefix: &canonical.as_bytes()[..4096],
    };
    let us = best_of_7(20_000, || {
        black_box(PromptBlocks::new(black_box(&material), 256));
    });
    println!("  {:<28} {us:8.2}", "blocks of a 4 KiB prefix");
    for strategy in ["RANDOM", "PREFIX_AWARE"] {
        let us = best_of_7(20_000, route_requests(strategy));
        let name = match strategy {
            "PREFIX_AWARE" => "route FIXED_PREFIX".to_string(),
            other => format!("route {other}"),
        };
        println!("  {name:<28} {us:8.2}");
    }
    // The overhead benchmark's bodies: one prompt again and again.
    let chat = chat_body(8 << 10);
    let invoke: Vec<u8> = serde_json::to_vec(&serde_json::json!({
        "inputs": prose(8000),
        "parameters": {"max_new_tokens": 8}
    }))
    .expect("serialisable");
    for (name, path, body) in [
        ("chat 8 KiB", "/v1/chat/completions", &chat),
        ("invoke 8 KiB", "/invocations", &invoke),
    ] {
        for (fresh, what) in [(false, "held"), (true, "new")] {
            let (mut route, store) = route_prompts(path, body, fresh);
            let us = best_of_7(5_000, &mut route);
            let (reads, writes) = (store.reads(), store.successful_sets());
            route();
            println!(
                "  {:<28} {us:8.2}   shared data per request: {} reads, {} writes",
                format!("route LONGEST {name} {what}"),
                store.reads() - reads,
                store.successful_sets() - writes
            );
        }
    }
    route_over_fleets();
    scan_responses();
}

/// The same held chat prompt in front of larger listed fleets, requests
/// 5 ms apart: each decision finds its copies of the instance records
/// expired (RECORD_CACHE_MS), as it does at any rate under 200 a second.
fn route_over_fleets() {
    let chat = chat_body(8 << 10);
    for fleet_size in [7u16, 64, 256] {
        let listed: Vec<String> = (0..fleet_size)
            .map(|i| format!("10.0.{}.{}:8000", i / 250, i % 250 + 1))
            .collect();
        // Beside it, the same request for a LoRA adapter (its set first).
        for adapter in [false, true] {
            let (mut route, store) = route_prompts_over(
                "/v1/chat/completions",
                &chat,
                false,
                Some(&listed),
                5,
                adapter,
            );
            let us = best_of_7(2_000, &mut route);
            let (reads, writes) = (store.reads(), store.successful_sets());
            for _ in 0..10 {
                route();
            }
            let name = format!(
                "route chat held, {fleet_size} listed{}",
                if adapter { ", adapter" } else { "" }
            );
            println!(
                "  {name:<28} {us:8.2}   shared data per request: {:.1} reads, {:.1} writes",
                (store.reads() - reads) as f64 / 10.0,
                (store.successful_sets() - writes) as f64 / 10.0
            );
        }
    }
}
