//! Request bodies for the tests: random text and bytes, OpenAI chat bodies of
//! an exact size, and hashes to compare with what the upstreams received.

use rand::distributions::Alphanumeric;
use rand::{Rng, SeedableRng};
use sha2::{Digest, Sha256};

/// A seeded generator, so a failing run can be reproduced from its seed.
pub fn rng(seed: u64) -> rand::rngs::StdRng {
    rand::rngs::StdRng::seed_from_u64(seed)
}

/// Random letters and digits.
pub fn text(rng: &mut impl Rng, len: usize) -> String {
    rng.sample_iter(&Alphanumeric)
        .take(len)
        .map(char::from)
        .collect()
}

/// Random bytes (not UTF-8 in general).
pub fn bytes(rng: &mut impl Rng, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    rng.fill_bytes(&mut out);
    out
}

/// Lowercase hex SHA-256.
pub fn sha256(data: &[u8]) -> String {
    hex::encode(Sha256::digest(data))
}

/// A JSON string literal (serde's escaping).
pub fn json_string(text: &str) -> String {
    serde_json::Value::String(text.to_string()).to_string()
}

/// An OpenAI chat body: a system message then a user message.
pub fn chat(model: &str, system: &str, user: &str) -> String {
    format!(
        r#"{{"model":{},"messages":[{{"role":"system","content":{}}},{{"role":"user","content":{}}}]}}"#,
        json_string(model),
        json_string(system),
        json_string(user)
    )
}

/// A valid OpenAI chat body of exactly `len` bytes, its text mixing ASCII,
/// multi-byte characters and escapes; `None` when `len` is below the smallest
/// such body.
pub fn chat_of_exact_len(rng: &mut impl Rng, len: usize) -> Option<Vec<u8>> {
    let head = br#"{"model":"m","messages":[{"role":"user","content":""#;
    let tail = br#""}]}"#;
    let room = len.checked_sub(head.len() + tail.len())?;
    let mut content = Vec::with_capacity(room);
    // Pieces of known byte length: ASCII, 2-byte é, an escaped \u00e9, an escaped newline.
    let pieces: [&[u8]; 4] = [b"abc ", "é".as_bytes(), br"\u00e9", br"\n"];
    while content.len() < room {
        let left = room - content.len();
        let piece = pieces[rng.gen_range(0..pieces.len())];
        if piece.len() <= left {
            content.extend_from_slice(piece);
        } else {
            content.extend(std::iter::repeat_n(b'x', left));
        }
    }
    let mut body = Vec::with_capacity(len);
    body.extend_from_slice(head);
    body.extend_from_slice(&content);
    body.extend_from_slice(tail);
    debug_assert_eq!(body.len(), len);
    Some(body)
}

/// An invalid JSON body of exactly `len` bytes that starts like a chat request
/// (a string that never ends), the kind of body the filter must pass untouched.
pub fn truncated_chat(rng: &mut impl Rng, len: usize) -> Vec<u8> {
    let head = br#"{"model":"m","messages":[{"role":"user","content":"#;
    let mut body: Vec<u8> = head.iter().copied().take(len).collect();
    let filler = text(rng, len - body.len());
    body.extend_from_slice(filler.as_bytes());
    body
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chat_bodies_have_the_exact_length_and_parse() {
        let mut rng = rng(1);
        for len in [57, 58, 63, 100, 1023, 4096, 70_000] {
            let body = chat_of_exact_len(&mut rng, len).unwrap();
            assert_eq!(body.len(), len);
            let json: serde_json::Value = serde_json::from_slice(&body).unwrap();
            assert!(json["messages"][0]["content"].is_string());
        }
        assert!(chat_of_exact_len(&mut rng, 10).is_none());
    }

    #[test]
    fn truncated_chat_is_invalid_json_of_the_exact_length() {
        let mut rng = rng(2);
        for len in [1, 40, 4096] {
            let body = truncated_chat(&mut rng, len);
            assert_eq!(body.len(), len);
            assert!(serde_json::from_slice::<serde_json::Value>(&body).is_err());
        }
    }
}
