//! The filter's own work per request, without Envoy: reading the body
//! (classification, extraction, key) and routing it (policy, load tables in
//! an in-memory shared store, the upstream count, the release). It runs the
//! same way natively and as wasm32 under Node's V8, the engine Envoy runs the
//! filter in, so the second shows what the `.wasm` itself costs:
//!
//! ```sh
//! cargo bench --bench per_request                          # native
//! cargo bench --bench per_request --target wasm32-wasip1   # under Node's V8
//! ```
//!
//! Each line is the best of 7 timed runs after a warm-up (the machine is
//! shared; the minimum is the least disturbed). The host calls around this
//! work are measured through Envoy instead (docs/benchmarks.md).

use std::hint::black_box;
use std::rc::Rc;
use std::time::Instant;

use prefix_router::config::Config;
use prefix_router::headers::OnceHeader;
use prefix_router::load::{LoadTracker, UpstreamStart};
use prefix_router::request::{BodyVerdict, HeadersVerdict, RequestHead, RequestReader};
use prefix_router::shared::MemoryStore;
use prefix_router::steering;
use prefix_router::strategy::RoutingPolicy;

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
    let mut reader = RequestReader::new(Rc::clone(config));
    let head = RequestHead {
        path: path.as_bytes(),
        tenant_header: OnceHeader::Absent,
        end_of_stream: false,
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
            BodyVerdict::Continue(derivation) => return derivation.key.expect("keyed"),
            BodyVerdict::AlreadyDecided => break,
        }
    }
    panic!("no decision")
}

/// Routing `requests` through one worker's tracker: the decision, the count
/// where Envoy sends it (the host override, else a stand-in for Maglev) and
/// the release of both, 50 keys in turn.
fn route_requests(strategy: &str) -> impl FnMut() {
    let config = config(&format!(
        r#"{{"strategy":"{strategy}","prefix_length":4096,"host_header":"x-prefix-route-host"}}"#
    ));
    let policy = steering::policy_for(&config);
    let mut tracker = LoadTracker::new(MemoryStore::new(), steering::load_config(&config), 7);
    let mut now_ms = 1_000_000u64;
    for address in INSTANCES {
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
    let keys: Vec<String> = (0..50u64).map(|k| format!("{k:016x}")).collect();
    let mut n = 0usize;
    move || {
        n += 1;
        now_ms += 1;
        let k = n % keys.len();
        let key = &keys[k];
        let random = (n as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        let routed = policy.decide(Some(key), &mut tracker, random, now_ms);
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

fn main() {
    let target = if cfg!(target_arch = "wasm32") {
        "wasm32 under Node's V8"
    } else {
        "native"
    };
    println!("per request, {target} (best of 7 runs, µs):");
    // Every body type keyed on its first 4,096 bytes or characters.
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
    let body: Vec<u8> = (0..8192u32).map(|i| b'a' + (i % 26) as u8).collect();
    let us = best_of_7(3000, || {
        black_box(read_request(&prefix_4096, "/invocations", black_box(&body)));
    });
    println!("  {:<28} {us:8.2}", "read invoke 8 KiB");
    for strategy in ["RANDOM", "PREFIX_AWARE"] {
        let us = best_of_7(20_000, route_requests(strategy));
        println!("  {:<28} {us:8.2}", format!("route {strategy}"));
    }
}
