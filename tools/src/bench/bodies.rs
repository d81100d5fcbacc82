//! Request bodies of exact sizes for the overhead benchmark: native invoke
//! JSON and OpenAI chat bodies shaped like real traffic (a long system prompt,
//! several user/assistant turns, newlines, quotes and non-ASCII text, so the
//! extractor meets escapes as it would in production).

use rand::rngs::StdRng;
use rand::{Rng as _, SeedableRng as _};
use serde_json::{json, Value};

/// The model name used in chat bodies.
pub const MODEL: &str = "meta-llama/Llama-3.1-70B-Instruct";

const WORDS: &[&str] = &[
    "the",
    "cluster",
    "routes",
    "each",
    "request",
    "to",
    "an",
    "instance",
    "whose",
    "cache",
    "already",
    "holds",
    "prefix",
    "tokens",
    "latency",
    "first",
    "token",
    "model",
    "shared",
    "system",
    "prompt",
    "document",
    "section",
    "clause",
    "applies",
    "reader",
    "question",
    "answer",
    "summarise",
    "following",
    "context",
    "carefully",
    "café",
    "naïve",
    "résumé",
    "über",
    "日本語",
    "données",
    "“quoted”",
    "it's",
    "and",
    "of",
    "in",
    "with",
    "for",
    "on",
];

/// Deterministic prose of at least `min_bytes` bytes (UTF-8), with sentences,
/// paragraphs and an occasional quoted phrase.
pub fn prose(seed: u64, min_bytes: usize) -> String {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut text = String::with_capacity(min_bytes + 64);
    let mut words_in_sentence = 0;
    while text.len() < min_bytes {
        let word = WORDS[rng.gen_range(0..WORDS.len())];
        if words_in_sentence == 0 {
            let mut chars = word.chars();
            if let Some(first) = chars.next() {
                text.extend(first.to_uppercase());
                text.push_str(chars.as_str());
            }
        } else {
            text.push(' ');
            if rng.gen_ratio(1, 40) {
                text.push('"');
                text.push_str(word);
                text.push('"');
            } else {
                text.push_str(word);
            }
        }
        words_in_sentence += 1;
        if words_in_sentence > 8 && rng.gen_ratio(1, 6) {
            text.push('.');
            words_in_sentence = 0;
            if rng.gen_ratio(1, 5) {
                text.push_str("\n\n");
            } else {
                text.push(' ');
            }
        }
    }
    text
}

/// A native invoke body (`{"inputs": ..., "parameters": ...}`) of exactly `size` bytes.
pub fn invoke_body(size: usize, seed: u64) -> Vec<u8> {
    exact_size(size, |budget, pad| {
        let mut inputs = prose(seed, budget);
        inputs.push_str(&"x".repeat(pad));
        json!({"inputs": inputs, "parameters": {"max_new_tokens": 128, "temperature": 0.2}})
    })
}

/// An OpenAI chat completions body of exactly `size` bytes: a system prompt of
/// about a third of the body, then alternating user and assistant turns of a
/// few KiB each, ending with a user turn.
pub fn chat_body(size: usize, seed: u64) -> Vec<u8> {
    exact_size(size, |budget, pad| {
        let mut messages = vec![json!({"role": "system", "content": prose(seed, budget / 3)})];
        let mut used = budget / 3;
        let turn_bytes = (budget / 8).clamp(200, 6000);
        let mut turn = 0u64;
        while used + turn_bytes < budget {
            let role = if turn % 2 == 0 { "user" } else { "assistant" };
            messages.push(json!({"role": role, "content": prose(seed + 1 + turn, turn_bytes)}));
            used += turn_bytes + 40;
            turn += 1;
        }
        if turn % 2 == 0 {
            // End on a user turn, as a real request does.
            messages.push(json!({"role": "user", "content": "Please continue."}));
        }
        let last = messages.len() - 1;
        if let Some(Value::String(content)) = messages[last].get_mut("content") {
            content.push_str(&"x".repeat(pad));
        }
        json!({
            "model": MODEL,
            "messages": messages,
            "max_tokens": 256,
            "temperature": 0.7,
            "stream": false
        })
    })
}

/// Finds a text budget whose serialisation fits in `size` bytes (escapes make
/// JSON longer than its text), then pads with ASCII (1 byte per character,
/// never escaped) so the result has exactly `size` bytes.
fn exact_size(size: usize, build: impl Fn(usize, usize) -> Value) -> Vec<u8> {
    let mut budget = size.saturating_sub(200);
    loop {
        let unpadded = serde_json::to_vec(&build(budget, 0)).unwrap_or_default();
        if unpadded.len() <= size || budget == 0 {
            let pad = size.saturating_sub(unpadded.len());
            return serde_json::to_vec(&build(budget, pad)).unwrap_or_default();
        }
        budget = budget.saturating_sub(unpadded.len() - size + 64);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bodies_have_the_exact_size_and_parse() {
        for size in [8 * 1024, 64 * 1024, 256 * 1024, 1024 * 1024] {
            let chat = chat_body(size, 7);
            assert_eq!(chat.len(), size, "chat {size}");
            let value: Value = serde_json::from_slice(&chat).unwrap();
            let messages = value["messages"].as_array().unwrap();
            assert!(
                messages.len() >= 3,
                "chat {size} has {} messages",
                messages.len()
            );
            assert_eq!(messages.last().unwrap()["role"], "user");
            let invoke = invoke_body(size, 7);
            assert_eq!(invoke.len(), size, "invoke {size}");
            let value: Value = serde_json::from_slice(&invoke).unwrap();
            assert!(value["inputs"].as_str().unwrap().len() > size / 2);
        }
    }

    #[test]
    fn chat_bodies_contain_escapes_and_non_ascii() {
        let body = String::from_utf8(chat_body(8 * 1024, 1)).unwrap();
        assert!(body.contains("\\n"));
        assert!(body.contains("\\\""));
        assert!(!body.is_ascii());
    }
}
