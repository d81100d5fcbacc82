//! The upstream receives the client's body byte for byte, whatever its size,
//! framing (HTTP/1.1 content-length or chunked; HTTP/2 DATA frames, ending the
//! stream or followed by trailers) and the pieces it arrives in, on both APIs,
//! valid JSON or not; the filter never causes a 413, even for bodies far larger
//! than what it reads (`max_body_bytes`, 1 MiB by default); and the key it
//! writes depends on the body alone, never on how the body travelled.

use std::collections::BTreeMap;

use bytes::Bytes;
use harness::{bodies, Framing, Harness, Outgoing, KEY_HEADER};

const SIZES: [usize; 7] = [0, 1, 1023, 4096, 65_536, 70_000, 4 << 20];
/// Bytes per write; `usize::MAX` writes the body at once.
const PIECES: [usize; 5] = [1, 1000, 16_384, 65_536, usize::MAX];
/// Keeps 1-byte pieces to bodies that need at most this many writes.
const MAX_WRITES: usize = 70_000;
/// Pieces sent a moment apart at the start, where the filter decides.
const PACED: usize = 8;
const FRAMINGS: [Framing; 4] = [
    Framing::ContentLength,
    Framing::Chunked,
    Framing::Http2,
    Framing::Http2Trailers,
];

struct Case {
    id: String,
    /// Cases of the same body share it (the key must be the same).
    body_id: String,
    path: &'static str,
    body: Bytes,
    framing: Framing,
    piece: usize,
}

fn cases(kind: &str, path: &'static str, make: impl Fn(usize) -> Option<Vec<u8>>) -> Vec<Case> {
    let mut out = Vec::new();
    for size in SIZES {
        let Some(body) = make(size) else { continue };
        let body = Bytes::from(body);
        for framing in FRAMINGS {
            for piece in PIECES {
                if size.div_ceil(piece.min(size.max(1))) > MAX_WRITES {
                    continue;
                }
                out.push(Case {
                    id: format!("{kind}-{size}-{framing:?}-{piece}"),
                    body_id: format!("{kind}-{size}"),
                    path,
                    body: body.clone(),
                    framing,
                    piece,
                });
            }
        }
    }
    out
}

async fn check_integrity(cases: Vec<Case>) {
    let harness = Harness::start();
    let expected: Vec<(String, usize, String)> = cases
        .iter()
        .map(|c| (c.id.clone(), c.body.len(), bodies::sha256(&c.body)))
        .collect();
    let body_ids: Vec<String> = cases.iter().map(|c| c.body_id.clone()).collect();
    let http2_requests = cases.iter().filter(|c| c.framing.is_http2()).count() as u64;
    let requests = cases
        .into_iter()
        .map(|c| {
            Outgoing::post(c.path, c.body)
                .id(&c.id)
                .framed(c.framing, c.piece, PACED)
        })
        .collect();
    let replies = harness.send_all(requests, 6).await;

    let mut failures = Vec::new();
    // Per body, the key each framing gave it, and that framing's request id.
    let mut keys: BTreeMap<&str, BTreeMap<Vec<String>, &str>> = BTreeMap::new();
    for (((id, len, sha), reply), body_id) in expected.iter().zip(&replies).zip(&body_ids) {
        if reply.status != 200 {
            failures.push(format!("{id}: HTTP {} {}", reply.status, reply.text()));
            continue;
        }
        let found = harness
            .fleet
            .records_with_header(harness::TEST_ID_HEADER, id);
        if let [record] = found.as_slice() {
            let key: Vec<String> = record
                .header_values(KEY_HEADER)
                .iter()
                .map(|v| v.to_string())
                .collect();
            // Only an empty body has no key.
            if key.len() != usize::from(*len > 0) {
                failures.push(format!(
                    "{id}: {len} bytes arrived with {KEY_HEADER} {key:?}"
                ));
            }
            keys.entry(body_id).or_default().entry(key).or_insert(id);
        }
        match found.as_slice() {
            [record] if record.body_len == *len && record.body_sha256 == *sha => {}
            [record] => failures.push(format!(
                "{id}: upstream got {} bytes (sha256 {}), sent {len} (sha256 {sha})",
                record.body_len, record.body_sha256
            )),
            _ => failures.push(format!("{id}: reached the upstreams {} times", found.len())),
        }
    }
    for (body_id, by_key) in &keys {
        if by_key.len() > 1 {
            failures.push(format!(
                "{body_id}: the same body got different keys depending on its framing: {by_key:?}"
            ));
        }
    }
    // Envoy saw HTTP/2 requests, not a client that fell back to HTTP/1.1.
    let http2_seen = harness
        .envoy
        .stat("http.ingress_http.downstream_rq_http2_total")
        .expect("admin /stats")
        .unwrap_or(0);
    if http2_seen != http2_requests {
        failures.push(format!(
            "Envoy counted {http2_seen} HTTP/2 requests, the test sent {http2_requests}"
        ));
    }
    println!("{} bodies checked", expected.len());
    assert!(
        failures.is_empty(),
        "{} of {} bodies not delivered intact:\n{}\n--- Envoy log tail ---\n{}",
        failures.len(),
        expected.len(),
        failures.join("\n"),
        harness.log_tail()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invoke_bodies_arrive_intact() {
    let cases = cases("invoke", "/invocations", |size| {
        Some(bodies::bytes(&mut bodies::rng(size as u64), size))
    });
    check_integrity(cases).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn valid_chat_bodies_arrive_intact() {
    let cases = cases("chat", "/v1/chat/completions", |size| {
        // 0 and 1 bytes cannot be a chat body; the invalid-JSON test covers them.
        bodies::chat_of_exact_len(&mut bodies::rng(size as u64), size)
    });
    check_integrity(cases).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_json_chat_bodies_arrive_intact() {
    let cases = cases("badjson", "/v1/chat/completions", |size| {
        Some(bodies::truncated_chat(&mut bodies::rng(size as u64), size))
    });
    check_integrity(cases).await;
}
