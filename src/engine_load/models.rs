//! The adapters an engine serves, from its OpenAI-compatible `/v1/models`
//! (vLLM lists the base model and every LoRA adapter it has loaded, with
//! `load_lora_adapter` or `--lora-modules`): what `adapters` routes by, so
//! that an adapter's requests go only where it is loaded. Read as a
//! `serde_json::Value` (the configuration's reader, already in the .wasm);
//! only the names' hashes are kept.
//!
//! Which of them are in one of its `--max-loras` slots now, from
//! `vllm:lora_requests_info` in the `/metrics` the load poll reads: the
//! adapters with requests running or waiting. An idle adapter is absent from
//! it, so it confirms where an adapter is resident and never denies.

use serde_json::Value;

use super::metrics_text::{label_value, number, samples};
use crate::load::{adapter_hash, AdapterNames};

/// vLLM's gauge of the adapters in use: one series per state it has been
/// in, valued with the time it was last in it.
pub const LORA_REQUESTS_INFO: &str = "vllm:lora_requests_info";

/// The path polled beside the metrics path while `adapters` is configured.
pub const MODELS_PATH: &str = "/v1/models";

/// The largest `/v1/models` body read: past it the list is not known.
pub const MAX_MODELS_BODY_BYTES: usize = 256 * 1024;

/// The names a `/v1/models` answer lists, hashed as the filter hashes an
/// adapter's name; None: no usable answer (then nothing is denied).
pub fn served_adapters(status: Option<u32>, body: &[u8]) -> Option<AdapterNames> {
    if status != Some(200) || body.len() > MAX_MODELS_BODY_BYTES {
        return None;
    }
    let list: Value = serde_json::from_slice(body).ok()?;
    let names: Option<Vec<(u64, bool)>> = list
        .get("data")?
        .as_array()?
        .iter()
        .map(|card| {
            let name = adapter_hash(card.get("id")?.as_str()?.as_bytes());
            // vLLM names an adapter's base model as its parent.
            Some((name, card.get("parent").is_some_and(Value::is_string)))
        })
        .collect();
    Some(AdapterNames::of_list(names?))
}

/// The adapters with requests running or waiting in the engine's latest
/// state in `vllm:lora_requests_info` (the series with the largest value);
/// None: the body has no such series.
pub fn active_adapters(metrics_body: &[u8]) -> Option<AdapterNames> {
    let mut latest: Option<(f64, &[u8])> = None;
    for (name, labels, value) in samples(metrics_body) {
        if name != LORA_REQUESTS_INFO.as_bytes() {
            continue;
        }
        let Some(seen) = number(value) else {
            continue;
        };
        if latest.is_none_or(|(last, _)| seen > last) {
            latest = Some((seen, labels));
        }
    }
    let (_, labels) = latest?;
    let mut active = AdapterNames::default();
    for key in [&b"running_lora_adapters"[..], b"waiting_lora_adapters"] {
        let list = label_value(labels, key).unwrap_or_default();
        for name in list.split(|b| *b == b',').filter(|n| !n.is_empty()) {
            active.insert(adapter_hash(name));
        }
    }
    Some(active)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// vLLM 0.32's answer with one adapter loaded (trimmed of permissions).
    const VLLM: &str = r#"{"object":"list","data":[{"id":"HuggingFaceTB/SmolLM2-135M-Instruct","object":"model","created":1764979200,"owned_by":"vllm","root":"/models/smollm2","parent":null,"max_model_len":2048,"permission":[]},{"id":"a\u00e9-0","object":"model","created":1764979200,"owned_by":"vllm","root":"/adapters/a0","parent":"HuggingFaceTB/SmolLM2-135M-Instruct","max_model_len":null,"permission":[]}]}"#;

    #[test]
    fn lists_every_model_and_adapter_the_engine_names() {
        let served = served_adapters(Some(200), VLLM.as_bytes()).expect("a list");
        assert!(served.contains(adapter_hash("aé-0".as_bytes())));
        assert!(served.contains(adapter_hash(b"HuggingFaceTB/SmolLM2-135M-Instruct")));
        assert!(!served.contains(adapter_hash(b"a1")));
        // Exactly, only what names a parent: the adapter, not the base model.
        assert_eq!(served.listed(), [adapter_hash("aé-0".as_bytes())]);
        let empty = served_adapters(Some(200), br#"{"object":"list","data":[]}"#);
        assert_eq!(empty, Some(AdapterNames::default()));
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

    /// vLLM 0.32's gauge after three states: the last seen is the current.
    const LORA_INFO: &str = "\
# HELP vllm:lora_requests_info Running stats on lora requests.
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora=\"2\",running_lora_adapters=\"a0\",waiting_lora_adapters=\"\"} 1.7650e+09
vllm:lora_requests_info{max_lora=\"2\",running_lora_adapters=\"a1,a\\\"2\",waiting_lora_adapters=\"a3\"} 1.7650000042e+09
vllm:lora_requests_info{max_lora=\"2\",running_lora_adapters=\"\",waiting_lora_adapters=\"\"} 1.7650000041e+09
vllm:num_requests_running{engine=\"0\"} 2
";

    #[test]
    fn the_latest_lora_state_names_the_adapters_running_and_waiting() {
        let active = active_adapters(LORA_INFO.as_bytes()).expect("the gauge");
        for adapter in ["a1", "a\"2", "a3"] {
            assert!(
                active.contains(adapter_hash(adapter.as_bytes())),
                "{adapter}"
            );
        }
        // Running in an older state only, or never.
        assert!(!active.contains(adapter_hash(b"a0")));
        assert!(!active.contains(adapter_hash(b"a\\\"2")));
    }

    #[test]
    fn an_idle_engine_runs_no_adapter_and_one_without_the_gauge_says_nothing() {
        let idle = "vllm:lora_requests_info{max_lora=\"2\",running_lora_adapters=\"\",waiting_lora_adapters=\"\"} 5\n";
        assert_eq!(
            active_adapters(idle.as_bytes()),
            Some(AdapterNames::default())
        );
        for body in [
            "vllm:num_requests_running 2\n",
            "",
            "vllm:lora_requests_info{running_lora_adapters=\"a0\"} NaN\n",
            "vllm:lora_requests_info{running_lora_adapters=\"a0 5\n",
        ] {
            assert_eq!(active_adapters(body.as_bytes()), None, "{body:?}");
        }
    }
}
