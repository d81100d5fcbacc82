//! Header handling: an invalid tenant header, or one sent more than once, is
//! refused with a JSON 400 before anything reaches an upstream; the key header is always the filter's (a
//! client-sent one is replaced, never kept or doubled); a request without a
//! body carries no key.

use harness::{bodies, Harness, Outgoing, Reply, KEY_HEADER, TENANT_HEADER};

/// Refused requests reach no upstream.
fn assert_no_upstream_received_anything(harness: &Harness) {
    assert_eq!(
        harness.fleet.total(),
        0,
        "an upstream received a refused request: {:?}",
        harness.fleet.records()
    );
}

/// Checks `reply` is the filter's JSON 400 for the tenant header and returns
/// its `error` object.
fn refused_tenant_error(reply: &Reply, what: &str) -> serde_json::Value {
    assert_eq!(reply.status, 400, "{what}: {}", reply.text());
    let content_type = reply
        .headers
        .get("content-type")
        .and_then(|v| v.to_str().ok());
    assert_eq!(content_type, Some("application/json"), "{what}");
    let json: serde_json::Value = serde_json::from_slice(&reply.body)
        .unwrap_or_else(|e| panic!("{what}: error body is not JSON ({e}): {}", reply.text()));
    let error = json["error"].clone();
    assert_eq!(error["type"], "invalid_request_error", "{json}");
    assert_eq!(error["code"], "invalid_tenant_header", "{json}");
    assert_eq!(error["param"], TENANT_HEADER, "{json}");
    error
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_invalid_tenant_header_gets_a_json_400_and_reaches_no_upstream() {
    let harness = Harness::start();
    let body = format!("{}tail", bodies::text(&mut bodies::rng(3), 5000));
    let invalid: [(&str, Vec<u8>); 3] = [
        ("65 characters", "t".repeat(65).into_bytes()),
        ("a tab", b"team\tone".to_vec()),
        ("non-ASCII", "équipe".as_bytes().to_vec()),
    ];
    for (what, value) in &invalid {
        for path in ["/invocations", "/v1/chat/completions"] {
            let request = Outgoing::post(path, body.clone()).header(TENANT_HEADER, value);
            let reply = harness.send(request).await;
            let error =
                refused_tenant_error(&reply, &format!("tenant header with {what} on {path}"));
            assert!(
                error["message"].as_str().is_some_and(|m| !m.is_empty()),
                "the error must say what is wrong: {error}"
            );
        }
    }
    assert_no_upstream_received_anything(&harness);

    // The boundary: 64 printable characters are a valid tenant.
    let reply = harness
        .send(
            Outgoing::post("/invocations", body)
                .header(TENANT_HEADER, "t".repeat(64))
                .id("t64"),
        )
        .await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    harness.key_of("t64");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_header_sent_twice_gets_a_json_400_and_reaches_no_upstream() {
    let harness = Harness::start();
    let body = format!("{}tail", bodies::text(&mut bodies::rng(5), 5000));
    // A second value that alone would be refused, and two valid ones: the
    // request must not be keyed on the first and forwarded with both.
    let repeats: [(&str, [Vec<u8>; 2]); 2] = [
        (
            "valid then 65 characters",
            [b"team-a".to_vec(), "t".repeat(65).into_bytes()],
        ),
        ("two valid values", [b"team-a".to_vec(), b"team-b".to_vec()]),
    ];
    for (what, [first, second]) in &repeats {
        for path in ["/invocations", "/v1/chat/completions"] {
            let request = Outgoing::post(path, body.clone())
                .header(TENANT_HEADER, first)
                .header(TENANT_HEADER, second);
            let reply = harness.send(request).await;
            let error = refused_tenant_error(&reply, &format!("{what} on {path}"));
            assert_eq!(
                error["message"],
                format!(
                    "{TENANT_HEADER}: the tenant header must be sent once; it was sent 2 times"
                ),
                "{error}"
            );
        }
    }
    assert_no_upstream_received_anything(&harness);
    // Sent once, the same value is accepted.
    let reply = harness
        .send(
            Outgoing::post("/invocations", body)
                .header(TENANT_HEADER, "team-a")
                .id("once"),
        )
        .await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    harness.key_of("once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_sent_key_header_is_replaced() {
    let harness = Harness::start();
    let spoofed = "ffffffffffffffff";
    for path in ["/invocations", "/v1/chat/completions"] {
        let body = bodies::chat("m", &bodies::text(&mut bodies::rng(4), 5000), "hello");
        let honest = Outgoing::post(path, body.clone()).id(&format!("{path}-honest"));
        let spoofing = Outgoing::post(path, body)
            .header(KEY_HEADER, spoofed)
            .header(KEY_HEADER, "0123456789abcdef")
            .id(&format!("{path}-spoofing"));
        for request in [honest, spoofing] {
            let reply = harness.send(request).await;
            assert_eq!(reply.status, 200, "{}", reply.text());
        }
        // key_of checks the upstream saw exactly one well-formed value.
        let honest_key = harness.key_of(&format!("{path}-honest"));
        let spoofing_key = harness.key_of(&format!("{path}-spoofing"));
        assert_eq!(
            honest_key, spoofing_key,
            "{path}: the client's key header changed the key the upstream saw"
        );
        assert_ne!(spoofing_key, spoofed);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_without_a_body_gets_no_key() {
    let harness = Harness::start();
    let requests = [
        Outgoing::get("/v1/models").id("get"),
        Outgoing::post("/v1/chat/completions", "").id("empty-post"),
        // A client-sent key on a bodiless request must not survive either.
        Outgoing::get("/health")
            .header(KEY_HEADER, "ffffffffffffffff")
            .id("get-spoofed"),
    ];
    for request in requests {
        let reply = harness.send(request).await;
        assert_eq!(reply.status, 200, "{}", reply.text());
    }
    for id in ["get", "empty-post", "get-spoofed"] {
        let record = harness.record_of(id);
        assert_eq!(
            record.header_values(KEY_HEADER),
            Vec::<&str>::new(),
            "{id}: a request without a body reached the upstream with a key"
        );
    }
}
