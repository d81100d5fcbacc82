//! The overhead benchmark's floor filter (`tools/floor-filter`) must do what
//! its figures claim: in the listener only, key each request by the xxh3 of
//! its body's first `prefix_length` bytes, pass the body on untouched, and
//! nothing else. Otherwise "what prefix-router adds over the floor" would
//! compare against a filter that skips the work.

use harness::bodies;
use harness::{Harness, Outgoing};
use prefix_router_tools::envoy;

const KEY_HEADER: &str = "x-prefix-route-key";

fn floor_harness(prefix_length: usize) -> Harness {
    let floor = envoy::require_floor_wasm().unwrap_or_else(|e| panic!("{e:#}"));
    Harness::start_with(|b| {
        b.listener_filter_only()
            .wasm(floor)
            .plugin_config(prefix_length.to_string())
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn floor_filter_keys_by_the_first_prefix_length_bytes() {
    let harness = floor_harness(4096);
    let mut rng = bodies::rng(11);
    let prefix = bodies::bytes(&mut rng, 4096);
    let mut sent = Vec::new();
    for (id, tail_len) in [("same-1", 4000), ("same-2", 1)] {
        let mut body = prefix.clone();
        body.extend(bodies::bytes(&mut rng, tail_len));
        let reply = harness
            .send(Outgoing::post("/invocations", body.clone()).id(id))
            .await;
        assert_eq!(reply.status, 200, "{}", reply.text());
        sent.push((id, body));
    }
    // Shorter than prefix_length: the whole body is the prefix.
    let short = bodies::bytes(&mut rng, 100);
    harness
        .send(Outgoing::post("/invocations", short.clone()).id("short"))
        .await;
    sent.push(("short", short));

    let expected = |body: &[u8]| format!("{:016x}", xxhash_rust::xxh3::xxh3_64(body));
    for (id, body) in &sent {
        let record = harness.record_of(id);
        assert_eq!(
            record.body_sha256,
            bodies::sha256(body),
            "{id}: body changed"
        );
        let key_of = &body[..body.len().min(4096)];
        assert_eq!(record.header_values(KEY_HEADER), [expected(key_of)], "{id}");
    }
    assert_eq!(
        harness.record_of("same-1").instance,
        harness.record_of("same-2").instance,
        "one prefix, one instance"
    );
}
