//! OpenAI bodies are keyed on their canonical text: the same conversation
//! serialised differently gets one key; another tenant (body
//! `prompt_cache_key` or the tenant header) or another model gets another.
//! Asserted on the key header the upstream received.

use harness::{Harness, Outgoing, TENANT_HEADER};

const CHAT: &str = "/v1/chat/completions";

/// One conversation, three serialisations: compact; pretty-printed with other key
/// order; `é` written as `\u00e9` with odd whitespace.
const SERIALISATIONS: [&str; 3] = [
    r#"{"model":"llama-3.1-70b","messages":[{"role":"system","content":"Tu es un assistant précis."},{"role":"user","content":"Résume le café: \"crème\"."}],"temperature":0.2}"#,
    r#"{
  "temperature": 0.2,
  "messages": [
    { "content": "Tu es un assistant précis.", "role": "system" },
    { "content": "Résume le café: \"crème\".", "role": "user" }
  ],
  "model": "llama-3.1-70b"
}"#,
    "{ \"model\" : \"llama-3.1-70b\" ,\t\"messages\" :[ {\"role\":\"system\",\"content\":\"Tu es un assistant pr\\u00e9cis.\"},\r\n {\"role\":\"user\" , \"content\":\"R\\u00e9sume le caf\\u00e9: \\\"cr\\u00e8me\\\".\"} ] , \"temperature\":0.2 }",
];

/// The conversation with a top-level `prompt_cache_key`.
fn with_cache_key(key: &str) -> String {
    format!(
        r#"{{"model":"llama-3.1-70b","prompt_cache_key":"{key}","messages":[{{"role":"system","content":"Tu es un assistant précis."}},{{"role":"user","content":"Résume le café: \"crème\"."}}],"temperature":0.2}}"#
    )
}

async fn key_for(harness: &Harness, id: &str, body: String, tenant: Option<&str>) -> String {
    let mut request = Outgoing::post(CHAT, body).id(id);
    if let Some(tenant) = tenant {
        request = request.header(TENANT_HEADER, tenant);
    }
    let reply = harness.send(request).await;
    assert_eq!(reply.status, 200, "{id}: {}", reply.text());
    harness.key_of(id)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_conversation_in_three_serialisations_gets_one_key() {
    for text in SERIALISATIONS {
        let parsed: serde_json::Value =
            serde_json::from_str(text).expect("test bodies are valid JSON");
        assert_eq!(
            parsed,
            serde_json::from_str::<serde_json::Value>(SERIALISATIONS[0]).unwrap()
        );
    }
    let harness = Harness::start();
    let mut keys = Vec::new();
    for (i, body) in SERIALISATIONS.iter().enumerate() {
        keys.push(key_for(&harness, &format!("s{i}"), body.to_string(), None).await);
    }
    assert!(
        keys.iter().all(|k| *k == keys[0]),
        "one conversation, several keys: {keys:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_tenant_gets_another_key() {
    let harness = Harness::start();
    let plain = key_for(&harness, "plain", SERIALISATIONS[0].to_string(), None).await;
    let cache_a = key_for(&harness, "cache-a", with_cache_key("team-a"), None).await;
    let cache_a_again = key_for(&harness, "cache-a-again", with_cache_key("team-a"), None).await;
    let cache_b = key_for(&harness, "cache-b", with_cache_key("team-b"), None).await;
    let header_a = key_for(
        &harness,
        "header-a",
        SERIALISATIONS[0].to_string(),
        Some("team-a"),
    )
    .await;
    let header_b = key_for(
        &harness,
        "header-b",
        SERIALISATIONS[0].to_string(),
        Some("team-b"),
    )
    .await;

    assert_eq!(
        cache_a, cache_a_again,
        "the same tenant and conversation must keep its key"
    );
    assert_ne!(plain, cache_a, "prompt_cache_key must change the key");
    assert_ne!(cache_a, cache_b, "two prompt_cache_keys, one key");
    assert_ne!(plain, header_a, "the tenant header must change the key");
    assert_ne!(header_a, header_b, "two tenant headers, one key");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_model_gets_another_key() {
    // Different models (and LoRA adapters) have separate KV caches.
    let harness = Harness::start();
    let base = key_for(&harness, "m1", SERIALISATIONS[0].to_string(), None).await;
    let other = SERIALISATIONS[0].replace("llama-3.1-70b", "llama-3.1-8b");
    let other = key_for(&harness, "m2", other, None).await;
    assert_ne!(base, other);
}
