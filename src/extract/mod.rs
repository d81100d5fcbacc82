//! Reads the routing prefix out of a request body, one chunk at a time.
//!
//! Each new chunk is fed exactly once, in order; the extractor keeps only what
//! it still needs and says `Done` as soon as it has the prefix, the model and
//! the tenant it was asked for, or `max_body_bytes` have been inspected.

use crate::classify::ApiKind;

/// What the extractor may read and what it must find.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Bytes (invoke, raw fallback) or characters (canonical text) of prefix.
    pub prefix_length: usize,
    /// Never inspect more than this many body bytes.
    pub max_body_bytes: usize,
    /// Read the `model` field into the key material.
    pub include_model: bool,
    /// Look for a top-level `prompt_cache_key` (false when the tenant header
    /// already named the tenant, so extraction can stop earlier).
    pub want_body_tenant: bool,
}

/// Whether the extractor wants more of the body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Progress {
    NeedMore,
    Done,
}

/// What the routing prefix was made of.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PrefixSource {
    /// The first `prefix_length` bytes of the body.
    RawBytes,
    /// The first `prefix_length` characters of the canonical text.
    CanonicalText,
}

/// Why an OpenAI-compatible body was routed on its raw bytes instead.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FallbackReason {
    /// Not valid JSON (within what was inspected).
    InvalidJson,
    /// Valid JSON, but not the shape this API expects.
    UnexpectedShape,
}

/// The result of reading a body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Extraction {
    pub source: PrefixSource,
    /// Raw bytes, or the canonical text's UTF-8 bytes.
    pub prefix: Vec<u8>,
    pub model: Option<String>,
    /// The body's top-level `prompt_cache_key`, when asked for and present.
    pub body_tenant: Option<String>,
    /// Set when an OpenAI-compatible body fell back to raw bytes.
    pub fallback: Option<FallbackReason>,
    /// The prefix is shorter than `prefix_length` (the body or text ran out).
    pub short: bool,
    /// Body bytes inspected.
    pub bytes_inspected: usize,
}

/// Incremental prefix extraction for one request body.
#[derive(Debug)]
pub struct Extractor {
    kind: ApiKind,
    limits: Limits,
    raw: Vec<u8>,
    inspected: usize,
}

impl Extractor {
    pub fn new(kind: ApiKind, limits: Limits) -> Self {
        Extractor {
            kind,
            limits,
            raw: Vec::new(),
            inspected: 0,
        }
    }

    /// Feeds the next chunk of the body (each byte exactly once, in order).
    pub fn feed(&mut self, chunk: &[u8]) -> Progress {
        // PLACEHOLDER: raw-byte prefix for every API until the JSON extractor lands.
        let _ = self.kind;
        let room = self.limits.max_body_bytes.saturating_sub(self.inspected);
        let chunk = &chunk[..chunk.len().min(room)];
        self.inspected += chunk.len();
        let want = self.limits.prefix_length.saturating_sub(self.raw.len());
        self.raw.extend_from_slice(&chunk[..chunk.len().min(want)]);
        if self.raw.len() >= self.limits.prefix_length
            || self.inspected >= self.limits.max_body_bytes
        {
            Progress::Done
        } else {
            Progress::NeedMore
        }
    }

    /// Ends extraction: at the end of the body, or once `feed` said `Done`.
    pub fn finish(self) -> Extraction {
        Extraction {
            source: PrefixSource::RawBytes,
            short: self.raw.len() < self.limits.prefix_length,
            prefix: self.raw,
            model: None,
            body_tenant: None,
            fallback: None,
            bytes_inspected: self.inspected,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placeholder_raw_prefix_stops_at_prefix_length() {
        let limits = Limits {
            prefix_length: 4,
            max_body_bytes: 100,
            include_model: true,
            want_body_tenant: false,
        };
        let mut x = Extractor::new(ApiKind::Invoke, limits);
        assert_eq!(x.feed(b"ab"), Progress::NeedMore);
        assert_eq!(x.feed(b"cdef"), Progress::Done);
        assert_eq!(x.finish().prefix, b"abcd");
    }
}
