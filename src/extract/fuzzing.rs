//! The extractor's fuzz case, in one place for the cargo-fuzz target
//! (`fuzz/fuzz_targets/extract.rs`) and for the unit tests that replay what
//! it found: how an input's 13-byte header becomes an API kind, limits and
//! a chunking, and every property a run must hold.
//!
//! Only built for cargo-fuzz (`--cfg fuzzing`) and tests: it asserts, which
//! the filter itself never does.
//!
//! Input layout: byte 0 picks the kind (bits 0-1) and flags (bit 2
//! `include_model`, 3 `want_body_tenant`, 4 a full-range `prefix_length`,
//! 5 no body limit, 6 a full-range body limit, 7 a gRPC-framed body, which
//! the raw kind ends with its first message), bytes 1-2 the prefix length,
//! bytes 3-4 the body limit, bytes 5-12 seed the chunking; the rest is the
//! body.

use super::{Extraction, Extractor, Limits, PrefixSource, Progress};
use crate::classify::ApiKind;

/// One decoded fuzz input.
#[derive(Debug, Clone, Copy)]
pub struct FuzzCase<'a> {
    pub kind: ApiKind,
    pub limits: Limits,
    /// The body is gRPC-framed ([`Extractor::ending_raw_prefix_with_the_first_grpc_message`]).
    pub grpc: bool,
    pub body: &'a [u8],
    seed: u64,
}

impl<'a> FuzzCase<'a> {
    /// `None` for inputs shorter than the header.
    pub fn decode(data: &'a [u8]) -> Option<Self> {
        let (head, body) = data.split_at_checked(13)?;
        let kind = match head[0] & 3 {
            0 => ApiKind::Invoke,
            1 => ApiKind::ChatCompletions,
            2 => ApiKind::Completions,
            _ => ApiKind::Responses,
        };
        let small = |hi: u8, lo: u8, full_range: bool| {
            let n = usize::from(u16::from_le_bytes([lo, hi]));
            // Mostly small numbers, so limits fall inside the body.
            if full_range {
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
        let seed = u64::from_le_bytes(head[5..13].try_into().ok()?) | 1;
        Some(FuzzCase {
            kind,
            limits,
            grpc: head[0] & 128 != 0,
            body,
            seed,
        })
    }

    /// Feeds the body in one piece, byte by byte and in random pieces (empty
    /// ones too: Envoy can call with an empty body), asserts all three agree
    /// and the result keeps within its limits, and returns it.
    pub fn run(&self) -> Extraction {
        let mut seed = self.seed;
        let max_piece = 1 + (seed as usize % 64);
        let whole = self.feed(&mut || usize::MAX);
        let bytewise = self.feed(&mut || 1);
        let random = self.feed(&mut || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed as usize % (max_piece + 1)
        });
        assert_eq!(whole, bytewise, "byte-by-byte feeding differs");
        assert_eq!(whole, random, "random chunking differs");

        let limits = self.limits;
        assert!(whole.bytes_inspected <= self.body.len().min(limits.max_body_bytes));
        match whole.source {
            PrefixSource::RawBytes => {
                assert!(whole.prefix.len() <= limits.prefix_length);
                assert!(self.body.starts_with(&whole.prefix));
                assert!(whole.bytes_inspected >= whole.prefix.len());
                if self.grpc && self.kind == ApiKind::Invoke {
                    // At most the first message, its 5-byte header included.
                    if let Some(&[_, a, b, c, d]) = self.body.get(..5) {
                        let message = u32::from_be_bytes([a, b, c, d]) as usize;
                        assert!(whole.prefix.len() <= message.saturating_add(5));
                    }
                    // Invoke inspects only what its prefix keeps.
                    assert_eq!(whole.bytes_inspected, whole.prefix.len());
                }
            }
            PrefixSource::CanonicalText => {
                let text = std::str::from_utf8(&whole.prefix).expect("canonical text is UTF-8");
                assert!(text.chars().count() <= limits.prefix_length);
                assert!(whole.fallback.is_none());
                assert_ne!(self.kind, ApiKind::Invoke);
            }
        }
        whole
    }

    /// Feeds the body in pieces of `next_len` bytes, stopping after `Done`.
    fn feed(&self, next_len: &mut dyn FnMut() -> usize) -> Extraction {
        let mut x = fuzz_extractor(self.kind, self.limits, self.grpc);
        let mut rest = self.body;
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
}

/// An extractor as the fuzz build makes it: cutting arriving strings from
/// [`super::document::CUT_ARRIVING_FROM_FUZZING`] bytes on, so short bodies
/// reach the cut (`Extractor::new` does so itself under `cfg(fuzzing)`),
/// and for a gRPC body ending the raw prefix with its first message.
pub(super) fn fuzz_extractor(kind: ApiKind, limits: Limits, grpc: bool) -> Extractor {
    let mut extractor = Extractor::new(kind, limits);
    if grpc {
        extractor = extractor.ending_raw_prefix_with_the_first_grpc_message();
    }
    #[cfg(test)]
    let extractor = extractor.cutting_arriving_from(super::document::CUT_ARRIVING_FROM_FUZZING);
    extractor
}
