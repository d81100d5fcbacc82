//! The adapters an engine serves, from its OpenAI-compatible `/v1/models`
//! (vLLM lists the base model and every LoRA adapter it has loaded, with
//! `load_lora_adapter` or `--lora-modules`): what `adapters` routes by, so
//! that an adapter's requests go only where it is loaded. Read as a
//! `serde_json::Value` (the configuration's reader, already in the .wasm);
//! only the names' hashes are kept.

use serde_json::Value;

use crate::load::ServedAdapters;

/// The path polled beside the metrics path while `adapters` is configured.
pub const MODELS_PATH: &str = "/v1/models";

/// The largest `/v1/models` body read: past it the list is not known.
pub const MAX_MODELS_BODY_BYTES: usize = 256 * 1024;

/// The names a `/v1/models` answer lists, hashed as the filter hashes an
/// adapter's name; None: no usable answer (then nothing is denied).
pub fn served_adapters(status: Option<u32>, body: &[u8]) -> Option<ServedAdapters> {
    if status != Some(200) || body.len() > MAX_MODELS_BODY_BYTES {
        return None;
    }
    let list: Value = serde_json::from_slice(body).ok()?;
    let mut served = ServedAdapters::default();
    for card in list.get("data")?.as_array()? {
        served.insert(xxhash_rust::xxh3::xxh3_64(
            card.get("id")?.as_str()?.as_bytes(),
        ));
    }
    Some(served)
}

#[cfg(test)]
mod tests {
    use super::*;
    use xxhash_rust::xxh3::xxh3_64;

    /// vLLM 0.32's answer with one adapter loaded (trimmed of permissions).
    const VLLM: &str = r#"{"object":"list","data":[{"id":"HuggingFaceTB/SmolLM2-135M-Instruct","object":"model","created":1764979200,"owned_by":"vllm","root":"/models/smollm2","parent":null,"max_model_len":2048,"permission":[]},{"id":"a\u00e9-0","object":"model","created":1764979200,"owned_by":"vllm","root":"/adapters/a0","parent":"HuggingFaceTB/SmolLM2-135M-Instruct","max_model_len":null,"permission":[]}]}"#;

    #[test]
    fn lists_every_model_and_adapter_the_engine_names() {
        let served = served_adapters(Some(200), VLLM.as_bytes()).expect("a list");
        assert!(served.contains(xxh3_64("aé-0".as_bytes())));
        assert!(served.contains(xxh3_64(b"HuggingFaceTB/SmolLM2-135M-Instruct")));
        assert!(!served.contains(xxh3_64(b"a1")));
        let empty = served_adapters(Some(200), br#"{"object":"list","data":[]}"#);
        assert_eq!(empty, Some(ServedAdapters::default()));
    }

    #[test]
    fn an_answer_that_is_not_a_model_list_says_nothing() {
        let oversized = format!(
            r#"{{"data":[{{"id":"{}"}}]}}"#,
            "x".repeat(MAX_MODELS_BODY_BYTES)
        );
        for (status, body) in [
            (Some(404), VLLM.as_bytes()),
            (None, b"".as_slice()),
            (Some(200), b"not json"),
            (Some(200), br#"{"data":{"id":"a0"}}"#),
            (Some(200), br#"{"data":[{"name":"a0"}]}"#),
            (Some(200), br#"{"data":[{"id":"a0"}"#),
            (Some(200), oversized.as_bytes()),
        ] {
            assert_eq!(served_adapters(status, body), None, "{status:?}");
        }
    }
}
