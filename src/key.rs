//! The routing key: xxh3-64 over tenant, model and prefix, framed so that
//! distinct inputs can never produce the same hashed bytes, written as 16
//! lowercase hex digits.
//!
//! Framing (version 1), hashed as one byte stream:
//! - the domain tag `prefix-router/key/v1`, then one byte for the prefix
//!   source: `R` (raw body bytes) or `C` (canonical text), so a raw body that
//!   happens to equal some canonical text does not share its key;
//! - then tenant, model and prefix, each as a presence byte (0 absent,
//!   1 present) followed, when present, by its length as u64 little-endian
//!   and its bytes. Fixed-width lengths make `("ab","c")` differ from
//!   `("a","bc")`, and absent differ from empty, on every target (`usize`
//!   is never hashed).
//!
//! Changing any of this re-routes every key in a running fleet (all KV
//! caches go cold at once), so a golden test pins the output.

use xxhash_rust::xxh3::Xxh3;

use crate::extract::PrefixSource;

const DOMAIN_TAG: &[u8] = b"prefix-router/key/v1";

/// What a key is computed from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyMaterial<'a> {
    pub tenant: Option<&'a [u8]>,
    pub model: Option<&'a [u8]>,
    pub source: PrefixSource,
    pub prefix: &'a [u8],
}

fn source_tag(source: PrefixSource) -> u8 {
    match source {
        PrefixSource::RawBytes => b'R',
        PrefixSource::CanonicalText => b'C',
    }
}

fn update_field(hasher: &mut Xxh3, field: Option<&[u8]>) {
    match field {
        None => hasher.update(&[0]),
        Some(bytes) => {
            hasher.update(&[1]);
            // usize -> u64 is lossless on 32- and 64-bit targets.
            hasher.update(&(bytes.len() as u64).to_le_bytes());
            hasher.update(bytes);
        }
    }
}

/// The 64-bit routing hash.
pub fn routing_hash(material: &KeyMaterial<'_>) -> u64 {
    let mut hasher = Xxh3::new();
    hasher.update(DOMAIN_TAG);
    update_frame(&mut hasher, material);
    hasher.digest()
}

/// Feeds the framed material (everything after the domain tag) to `hasher`;
/// `crate::blocks` seeds its chains with the same framing.
pub(crate) fn update_frame(hasher: &mut Xxh3, material: &KeyMaterial<'_>) {
    hasher.update(&[source_tag(material.source)]);
    update_field(hasher, material.tenant);
    update_field(hasher, material.model);
    update_field(hasher, Some(material.prefix));
}

/// The header value: 16 lowercase hex digits.
pub fn routing_key(material: &KeyMaterial<'_>) -> String {
    format!("{:016x}", routing_hash(material))
}

#[cfg(test)]
mod tests {
    use super::*;
    use xxhash_rust::xxh3::xxh3_64;

    fn raw<'a>(
        tenant: Option<&'a str>,
        model: Option<&'a str>,
        prefix: &'a str,
    ) -> KeyMaterial<'a> {
        KeyMaterial {
            tenant: tenant.map(str::as_bytes),
            model: model.map(str::as_bytes),
            source: PrefixSource::RawBytes,
            prefix: prefix.as_bytes(),
        }
    }

    #[test]
    fn field_boundaries_are_unambiguous() {
        assert_ne!(
            routing_key(&raw(Some("ab"), Some("c"), "p")),
            routing_key(&raw(Some("a"), Some("bc"), "p"))
        );
        assert_ne!(
            routing_key(&raw(None, Some("ab"), "c")),
            routing_key(&raw(None, Some("a"), "bc"))
        );
        assert_ne!(
            routing_key(&raw(Some("t"), None, "x")),
            routing_key(&raw(None, Some("t"), "x"))
        );
    }

    #[test]
    fn absent_differs_from_empty() {
        assert_ne!(
            routing_key(&raw(None, None, "p")),
            routing_key(&raw(Some(""), None, "p"))
        );
        assert_ne!(
            routing_key(&raw(None, None, "p")),
            routing_key(&raw(None, Some(""), "p"))
        );
    }

    #[test]
    fn source_is_part_of_the_key() {
        let mut canonical = raw(None, None, "hello");
        canonical.source = PrefixSource::CanonicalText;
        assert_ne!(
            routing_key(&raw(None, None, "hello")),
            routing_key(&canonical)
        );
    }

    #[test]
    fn tenant_and_model_change_the_key() {
        let base = routing_key(&raw(Some("a"), Some("m"), "p"));
        assert_ne!(base, routing_key(&raw(Some("b"), Some("m"), "p")));
        assert_ne!(base, routing_key(&raw(Some("a"), Some("n"), "p")));
        assert_eq!(base, routing_key(&raw(Some("a"), Some("m"), "p")));
    }

    #[test]
    fn hash_is_xxh3_of_the_documented_frame() {
        // Built by hand from the module documentation, independently of
        // `update_field`, with explicit 8-byte lengths (also on 32-bit wasm).
        let mut frame = b"prefix-router/key/v1C".to_vec();
        frame.extend_from_slice(&[1, 2, 0, 0, 0, 0, 0, 0, 0]);
        frame.extend_from_slice(b"t1");
        frame.push(0);
        frame.extend_from_slice(&[1, 5, 0, 0, 0, 0, 0, 0, 0]);
        frame.extend_from_slice(b"hello");
        let material = KeyMaterial {
            tenant: Some(b"t1"),
            model: None,
            source: PrefixSource::CanonicalText,
            prefix: b"hello",
        };
        assert_eq!(routing_hash(&material), xxh3_64(&frame));
    }

    #[test]
    fn golden_keys_never_change() {
        // Pinned: a change here re-routes every deployed fleet.
        let long = "x".repeat(5000);
        let cases = [
            (raw(None, None, ""), "5d858280719475a6"),
            (
                raw(None, Some("llama-3"), "You are a helpful assistant."),
                "dd33240afb7ecce9",
            ),
            (
                raw(Some("tenant-a"), Some("llama-3"), &long),
                "1497c3f807d16f25",
            ),
            (
                KeyMaterial {
                    source: PrefixSource::CanonicalText,
                    ..raw(Some("t"), None, "system\u{0}Hi é")
                },
                "8945905614238ab5",
            ),
        ];
        for (material, expected) in cases {
            let key = routing_key(&material);
            assert_eq!(key.len(), 16);
            assert!(
                key.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')),
                "{key}"
            );
            assert_eq!(key, expected, "{material:?}");
        }
    }
}
