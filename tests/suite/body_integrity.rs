//! The upstream receives the client's body byte for byte, whatever its size,
//! framing (content-length or chunked) and the pieces it arrives in, on both
//! APIs, valid JSON or not; and the filter never causes a 413, even for bodies
//! far larger than what it reads (`max_body_bytes`, 1 MiB by default).

use bytes::Bytes;
use harness::{bodies, Framing, Harness, Outgoing};

const SIZES: [usize; 7] = [0, 1, 1023, 4096, 65_536, 70_000, 4 << 20];
/// Bytes per write; `usize::MAX` writes the body at once.
const PIECES: [usize; 5] = [1, 1000, 16_384, 65_536, usize::MAX];
/// Keeps 1-byte pieces to bodies that need at most this many writes.
const MAX_WRITES: usize = 70_000;
/// Pieces sent a moment apart at the start, where the filter decides.
const PACED: usize = 8;

struct Case {
    id: String,
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
        for framing in [Framing::ContentLength, Framing::Chunked] {
            for piece in PIECES {
                if size.div_ceil(piece.min(size.max(1))) > MAX_WRITES {
                    continue;
                }
                out.push(Case {
                    id: format!("{kind}-{size}-{framing:?}-{piece}"),
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
    for ((id, len, sha), reply) in expected.iter().zip(&replies) {
        if reply.status != 200 {
            failures.push(format!("{id}: HTTP {} {}", reply.status, reply.text()));
            continue;
        }
        let found = harness
            .fleet
            .records_with_header(harness::TEST_ID_HEADER, id);
        match found.as_slice() {
            [record] if record.body_len == *len && record.body_sha256 == *sha => {}
            [record] => failures.push(format!(
                "{id}: upstream got {} bytes (sha256 {}), sent {len} (sha256 {sha})",
                record.body_len, record.body_sha256
            )),
            _ => failures.push(format!("{id}: reached the upstreams {} times", found.len())),
        }
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
