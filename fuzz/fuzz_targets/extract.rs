//! Fuzzes the body extractor: arbitrary bodies, chunkings, API kinds and
//! limits must never panic, and the result must not depend on chunking.
//!
//! Input layout: byte 0 picks the kind and flags, bytes 1-2 the prefix
//! length, bytes 3-4 the body limit, bytes 5-12 seed the chunking; the rest
//! is the body.

#![no_main]

use libfuzzer_sys::fuzz_target;
use prefix_router::classify::ApiKind;
use prefix_router::extract::{Extraction, Extractor, Limits, PrefixSource, Progress};

/// Feeds `body` in pieces chosen by `next_len`, stopping after `Done`.
fn feed(
    kind: ApiKind,
    limits: Limits,
    body: &[u8],
    mut next_len: impl FnMut() -> usize,
) -> Extraction {
    let mut x = Extractor::new(kind, limits);
    let mut rest = body;
    while !rest.is_empty() {
        let (piece, tail) = rest.split_at(next_len().min(rest.len()));
        rest = tail;
        if x.feed(piece) == Progress::Done {
            assert_eq!(x.feed(rest), Progress::Done, "Done is final");
            break;
        }
    }
    x.finish()
}

fuzz_target!(|data: &[u8]| {
    if data.len() < 13 {
        return;
    }
    let (head, body) = data.split_at(13);
    let kind = match head[0] & 3 {
        0 => ApiKind::Invoke,
        1 => ApiKind::ChatCompletions,
        2 => ApiKind::Completions,
        _ => ApiKind::Responses,
    };
    let small = |hi: u8, lo: u8, flag: bool| {
        let n = usize::from(u16::from_le_bytes([lo, hi]));
        // Mostly small numbers, so limits fall inside the body.
        if flag {
            n
        } else {
            n % 300
        }
    };
    let limits = Limits {
        prefix_length: small(head[2], head[1], head[0] & 16 != 0),
        max_body_bytes: if head[0] & 32 != 0 {
            usize::MAX
        } else {
            small(head[4], head[3], head[0] & 64 != 0)
        },
        include_model: head[0] & 4 != 0,
        want_body_tenant: head[0] & 8 != 0,
    };
    let mut seed = u64::from_le_bytes([
        head[5], head[6], head[7], head[8], head[9], head[10], head[11], head[12],
    ]) | 1;
    let max_piece = 1 + (seed as usize % 64);

    let whole = feed(kind, limits, body, || usize::MAX);
    let bytewise = feed(kind, limits, body, || 1);
    let random = feed(kind, limits, body, || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        // Empty pieces too: the filter can get empty body callbacks.
        seed as usize % (max_piece + 1)
    });
    assert_eq!(whole, bytewise, "byte-by-byte feeding differs");
    assert_eq!(whole, random, "random chunking differs");

    assert!(whole.bytes_inspected <= body.len().min(limits.max_body_bytes));
    match whole.source {
        PrefixSource::RawBytes => {
            assert!(whole.prefix.len() <= limits.prefix_length);
            assert!(body.starts_with(&whole.prefix));
        }
        PrefixSource::CanonicalText => {
            let text = std::str::from_utf8(&whole.prefix).expect("canonical text is UTF-8");
            assert!(text.chars().count() <= limits.prefix_length);
            assert!(whole.fallback.is_none());
            assert_ne!(kind, ApiKind::Invoke);
        }
    }
});
