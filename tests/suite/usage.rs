//! The engines' reported usage, read from real responses through a real
//! Envoy: an instance on loopback answers each request with a scripted
//! response (JSON or an event stream written in small pieces, with usage or
//! without, malformed, 8 MiB, compressed, failed). The client receives every
//! response byte for byte as the instance sent it, Envoy's log shows no wasm
//! failure, and the filter's per-instance usage counters hold exactly what
//! the 2xx, uncompressed responses reported.
//!
//! And the index corrected by it: in front of two `vllm-sim` instances, one
//! whose prefix cache was emptied reports a miss on a conversation the index
//! had it hold, and the index stops believing the older conversations it
//! had there, while the other instance's stay matched.

use std::net::SocketAddr;

use harness::bodies::sha256;
use harness::client::{self, Outgoing};
use harness::load::{filter_counter, wait_for_counter};
use prefix_router::usage::check::SETTLED_SECS;
use prefix_router_tools::envoy::Envoy;
use prefix_router_tools::sim::{SimConfig, SimServer};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};

/// The request header naming the scripted response.
const CASE_HEADER: &str = "x-usage-case";

/// One scripted response: status, content type and encoding, body, and
/// whether it is sent chunked in small pieces (as an engine streams).
struct Script {
    status: u16,
    content_type: &'static str,
    encoding: Option<&'static str>,
    body: Vec<u8>,
    streamed: bool,
}

fn json(status: u16, body: impl Into<Vec<u8>>) -> Script {
    Script {
        status,
        content_type: "application/json",
        encoding: None,
        body: body.into(),
        streamed: false,
    }
}

fn events(body: &str) -> Script {
    Script {
        status: 200,
        content_type: "text/event-stream",
        encoding: None,
        body: body.as_bytes().to_vec(),
        streamed: true,
    }
}

const CHUNK: &str = "data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"a \\\"usage\\\": {\\\"prompt_tokens\\\": 9}\"}}],\"usage\":null}\n\n";

/// The response of `case`.
fn script(case: &str) -> Script {
    match case {
        "json" => json(
            200,
            r#"{"id":"x","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"{\"usage\":{\"prompt_tokens\":1}}"}}],"usage":{"prompt_tokens":1536,"total_tokens":1544,"completion_tokens":8,"prompt_tokens_details":{"cached_tokens":1408}}}"#,
        ),
        "stream" => events(&format!(
            "{CHUNK}{CHUNK}data: {{\"id\":\"c\",\"choices\":[],\"usage\":{{\"prompt_tokens\":300,\"total_tokens\":308,\"completion_tokens\":8,\"prompt_tokens_details\":{{\"cached_tokens\":256}}}}}}\r\n\r\ndata: [DONE]\n\n"
        )),
        "stream_without_usage" => events(&format!("{CHUNK}{CHUNK}data: [DONE]\n\n")),
        "absent" => json(200, r#"{"id":"x","choices":[]}"#),
        "truncated" => json(
            200,
            r#"{"id":"x","usage":{"prompt_tokens":12,"prompt_tokens_details":{"cached_tokens":5}}"#,
        ),
        "malformed" => json(200, r#"{"usage":{"prompt_tokens":"12","cached_tokens":5}}"#),
        "huge" => {
            let content = "lorem ipsum \\\"usage\\\" ".repeat(400_000);
            json(
                200,
                format!(
                    r#"{{"choices":[{{"message":{{"content":"{content}"}}}}],"usage":{{"prompt_tokens":7,"prompt_tokens_details":{{"cached_tokens":0}}}}}}"#
                ),
            )
        }
        "compressed" => Script {
            encoding: Some("gzip"),
            ..json(200, r#"{"usage":{"prompt_tokens":50}}"#)
        },
        "failed" => json(500, r#"{"usage":{"prompt_tokens":60}}"#),
        other => panic!("no script {other}"),
    }
}

/// Every case, and what the filter must count of all of them together.
const CASES: [&str; 9] = [
    "json",
    "stream",
    "stream_without_usage",
    "absent",
    "truncated",
    "malformed",
    "huge",
    "compressed",
    "failed",
];

/// The 2xx responses without a content-encoding.
const WATCHED: u64 = 7;
/// json, stream and huge.
const REPORTED: u64 = 3;
const PROMPT_TOKENS: u64 = 1536 + 300 + 7;
const CACHED_TOKENS: u64 = 1408 + 256;

/// Serves the scripted responses on loopback (HTTP/1.1, keep-alive).
async fn scripted_instance() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("address");
    tokio::spawn(async move {
        while let Ok((socket, _)) = listener.accept().await {
            tokio::spawn(serve(socket));
        }
    });
    addr
}

async fn serve(socket: TcpStream) {
    let mut reader = BufReader::new(socket);
    loop {
        let mut case = None;
        let mut length = 0usize;
        let mut line = String::new();
        loop {
            line.clear();
            if reader.read_line(&mut line).await.unwrap_or(0) == 0 {
                return;
            }
            let trimmed = line.trim_end();
            if trimmed.is_empty() {
                break;
            }
            if let Some((name, value)) = trimmed.split_once(':') {
                let value = value.trim();
                match name.to_ascii_lowercase().as_str() {
                    "content-length" => length = value.parse().expect("content-length"),
                    CASE_HEADER => case = Some(value.to_string()),
                    "transfer-encoding" => panic!("chunked request: {value}"),
                    _ => {}
                }
            }
        }
        let mut body = vec![0; length];
        if reader.read_exact(&mut body).await.is_err() {
            return;
        }
        let script = script(case.as_deref().unwrap_or("absent"));
        if write_response(reader.get_mut(), &script).await.is_err() {
            return;
        }
    }
}

async fn write_response(socket: &mut TcpStream, script: &Script) -> std::io::Result<()> {
    let mut head = format!(
        "HTTP/1.1 {} X\r\ncontent-type: {}\r\n",
        script.status, script.content_type
    );
    if let Some(encoding) = script.encoding {
        head.push_str(&format!("content-encoding: {encoding}\r\n"));
    }
    if !script.streamed {
        head.push_str(&format!("content-length: {}\r\n\r\n", script.body.len()));
        socket.write_all(head.as_bytes()).await?;
        return socket.write_all(&script.body).await;
    }
    head.push_str("transfer-encoding: chunked\r\n\r\n");
    socket.write_all(head.as_bytes()).await?;
    // Pieces of 5 bytes split every event and every number somewhere.
    for piece in script.body.chunks(5) {
        let mut chunk = format!("{:x}\r\n", piece.len()).into_bytes();
        chunk.extend_from_slice(piece);
        chunk.extend_from_slice(b"\r\n");
        socket.write_all(&chunk).await?;
        socket.flush().await?;
    }
    socket.write_all(b"0\r\n\r\n").await
}

fn chat(case: &str) -> Outgoing {
    let body = format!(
        r#"{{"model":"m","stream":{},"messages":[{{"role":"user","content":"case {case}: {}"}}]}}"#,
        case.starts_with("stream"),
        "tell me about the document ".repeat(20)
    );
    Outgoing::post("/v1/chat/completions", body).header(CASE_HEADER, case)
}

fn usage_counter(envoy: &Envoy, name: &str, instance: SocketAddr) -> u64 {
    filter_counter(envoy, &format!("usage.{name}.endpoint.{instance}"))
}

#[test]
fn responses_pass_untouched_and_their_reported_usage_is_counted_per_instance() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime");
    let instance = runtime.block_on(scripted_instance());
    // One worker: its tick hands every count to Envoy at once.
    let envoy = Envoy::builder()
        .upstreams([instance])
        .concurrency(1)
        .plugin_config(r#"{"instances": [], "decision_header": "x-prefix-router-decision"}"#)
        .start()
        .unwrap_or_else(|e| panic!("{e}"));
    let addr = envoy.listener_addr();
    for case in CASES {
        let reply = runtime
            .block_on(client::send(addr, chat(case)))
            .unwrap_or_else(|e| panic!("{case}: {e:#}"));
        let sent = script(case);
        assert_eq!(reply.status, sent.status, "{case}: {}", reply.text());
        assert_eq!(
            (reply.body.len(), sha256(&reply.body)),
            (sent.body.len(), sha256(&sent.body)),
            "{case}: the body the client received differs from the instance's"
        );
        let decision = reply
            .headers
            .get("x-prefix-router-decision")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default();
        assert!(
            ["matched", "cold", "prefix"]
                .iter()
                .any(|kind| decision.starts_with(kind)),
            "{case}: not a prefix-aware decision: {decision:?}"
        );
    }
    wait_for_counter(&envoy, &format!("usage.responses.endpoint.{instance}"), 1);
    let counted: Vec<(&str, u64)> = [
        "responses",
        "reported",
        "reported_cached",
        "prompt_tokens",
        "cached_tokens",
    ]
    .into_iter()
    .map(|name| (name, usage_counter(&envoy, name, instance)))
    .collect();
    assert_eq!(
        counted,
        vec![
            ("responses", WATCHED),
            ("reported", REPORTED),
            ("reported_cached", REPORTED),
            ("prompt_tokens", PROMPT_TOKENS),
            ("cached_tokens", CACHED_TOKENS),
        ]
    );
    let log = envoy.log();
    for failure in [
        "panicked",
        "RuntimeError",
        "wasm log: prefix-router: re-entrant",
    ] {
        assert!(
            !log.contains(failure),
            "Envoy's log has {failure:?}:\n{log}"
        );
    }
}

/// A conversation's first turn, or its second after a fixed answer.
fn conversation(n: usize, second_turn: bool) -> Outgoing {
    let question = format!(
        "Conversation {n}: {}",
        "summarise the attached report in plain words. ".repeat(30)
    );
    let mut messages = vec![serde_json::json!({"role": "user", "content": question})];
    if second_turn {
        messages.push(serde_json::json!({"role": "assistant", "content": "It says little."}));
        messages.push(serde_json::json!({"role": "user", "content": "Say more."}));
    }
    let body = serde_json::json!({"model": "m", "max_tokens": 4, "messages": messages});
    Outgoing::post("/v1/chat/completions", body.to_string())
        .header("content-type", "application/json")
}

/// (instance, matched bytes) of a decision header.
fn instance_and_matched(reply: &client::Reply) -> (String, u64) {
    let header = reply
        .headers
        .get("x-prefix-router-decision")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default();
    let field = |name: &str| {
        header
            .split("; ")
            .find_map(|part| part.strip_prefix(name))
            .unwrap_or_else(|| panic!("no {name} in {header:?}"))
            .to_string()
    };
    let matched = field("matched=").parse().expect("matched bytes");
    (field("instance="), matched)
}

#[test]
fn an_engine_that_lost_its_cache_is_no_longer_believed_to_hold_older_prompts() {
    let runtime = harness::runtime();
    let sims: Vec<SimServer> = (1..=2)
        .map(|i| {
            let cfg = SimConfig {
                name: format!("vllm-{i}"),
                prompt_tokens_details: true,
                ..SimConfig::default()
            };
            runtime
                .block_on(SimServer::start(cfg, "127.0.0.1:0".parse().unwrap()))
                .expect("vllm-sim instance")
        })
        .collect();
    let envoy = Envoy::builder()
        .upstreams(sims.iter().map(SimServer::addr))
        .concurrency(1)
        .plugin_config(
            r#"{"instances": ["127.0.0.1:8001"], "decision_header": "x-prefix-router-decision"}"#,
        )
        .start()
        .unwrap_or_else(|e| panic!("{e}"));
    let addr = envoy.listener_addr();
    let send = |request: Outgoing| {
        let reply = runtime
            .block_on(client::send(addr, request))
            .expect("reaches Envoy");
        assert_eq!(reply.status, 200, "{}", reply.text());
        instance_and_matched(&reply)
    };
    // At least eight first turns (the filter learns the bytes per token from
    // them), until both instances hold some: which instance the first ones
    // reach depends on when Envoy's hosts are learned.
    let mut placed: Vec<String> = Vec::new();
    for n in 0..32 {
        placed.push(send(conversation(n, false)).0);
        let both = placed.iter().any(|p| *p != placed[0]);
        if n >= 7 && both && placed[..n].contains(&placed[n]) {
            break;
        }
    }
    // The miss is on the last conversation placed on its instance, so the
    // instance's older one was used no later (their seconds may differ).
    let last = placed.len() - 1;
    let lost = placed[last].clone();
    let older_there = (0..last).find(|&n| placed[n] == lost);
    let elsewhere = (0..last).find(|&n| placed[n] != lost);
    let (Some(older_there), Some(elsewhere)) = (older_there, elsewhere) else {
        panic!("both instances hold conversations: {placed:?}");
    };
    // Settled holdings, then the first instance loses everything it held.
    std::thread::sleep(std::time::Duration::from_secs(u64::from(SETTLED_SECS) + 1));
    let sim = sims
        .iter()
        .find(|sim| sim.addr().to_string() == lost)
        .expect("a vllm-sim");
    assert!(sim.engine().reset_prefix_cache(), "an idle instance");
    let (at, matched) = send(conversation(last, true));
    assert_eq!((at.as_str(), matched > 0), (lost.as_str(), true));
    let misses = format!("usage.index_misses.endpoint.{lost}");
    wait_for_counter(&envoy, &misses, 1);
    // That miss moved the instance's forget mark.
    let forgets = format!("usage.index_forgets.endpoint.{lost}");
    assert_eq!(filter_counter(&envoy, &forgets), 1);
    // Its other conversation is cold now; the other instance's is matched.
    let (_, matched) = send(conversation(older_there, true));
    assert_eq!(matched, 0, "conversation {older_there} still believed held");
    let (at, matched) = send(conversation(elsewhere, true));
    assert_eq!(at, placed[elsewhere]);
    assert!(matched > 0, "conversation {elsewhere} forgotten on {at}");
    assert_eq!(filter_counter(&envoy, &misses), 1);
    assert_eq!(filter_counter(&envoy, &forgets), 1);
}
