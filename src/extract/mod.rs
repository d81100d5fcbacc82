//! Reads the routing prefix out of a request body, one chunk at a time.
//!
//! Each new chunk is fed exactly once, in order; the extractor keeps only what
//! it still needs (the first `prefix_length` raw bytes, for a fallback, and the
//! one JSON value being delimited) and says `Done` as soon as it has the
//! prefix, the model and the tenant it was asked for, or the body is known to
//! lack them, or `max_body_bytes` have been inspected. The result never
//! depends on how the body was split into chunks.
//!
//! # Native invoke
//! The prefix is the first `prefix_length` bytes of the body.
//!
//! # OpenAI-compatible APIs: the canonical text
//! The prefix is the first `prefix_length` characters (Unicode scalar values)
//! of a canonical text built from the decoded JSON strings, so whitespace, key
//! order and escapes (`\u00e9` / `é`, `\/` / `/`) do not change it. Grammar,
//! with `␟` = U+001F (ends a field) and `␞` = U+001E (ends a record):
//!
//! ```text
//! text    = record*
//! record  = field* "␞"
//! field   = tag "=" value "␟"          (tokens: tag "=" ids "␟")
//! ```
//!
//! Inside a `value`, each U+0010, U+001E and U+001F is preceded by U+0010, so
//! a value can never end a field or record early: `[user:"ab"],[user:"c"]`
//! gives `role=user␟text=ab␟␞role=user␟text=c␟␞`, which no other conversation
//! gives. The records:
//!
//! - `/chat/completions`: one record per element of `messages`, in order:
//!   `role=R␟`, then `name=N␟` if present, then the content (a string is one
//!   `text=…␟`; an array of parts gives `text=…␟` per `text`/`input_text`/
//!   `output_text` part and `part=TYPE␟` for any other part, e.g.
//!   `part=image_url␟`, never its data), then for each tool call
//!   `tool=NAME␟args=ARGUMENTS␟`, for a custom tool's call
//!   `custom=NAME␟input=INPUT␟` (a call with neither gives `part=TYPE␟`).
//!   Ignored: tool call ids, `tool_call_id`, and every other message field
//!   (`refusal`, `audio`, ...).
//! - `/completions`: `prompt` as a string is `text=…␟␞`; an array of strings
//!   gives one such record each; token ids `[1,2]` give `tokens=1 2␟␞`, and an
//!   array of token arrays one `tokens=` record each.
//! - `/responses`: `instructions` (if a string) as `instructions=…␟␞`, then
//!   `input`: a string is `role=user␟text=…␟␞`; an array gives, per item, a
//!   message record as for chat when the item has a `role`, else
//!   `item=TYPE␟` followed for `function_call` by `tool=NAME␟args=…␟`, for
//!   `custom_tool_call` by `custom=NAME␟input=…␟`, and for
//!   `function_call_output` and `custom_tool_call_output` by its output as
//!   content, then `␞`. Since `instructions` comes first in the text, `input`
//!   is held (capped) until `instructions` is seen or the object ends.
//!
//! `model` (top-level string) and `prompt_cache_key` (top-level string,
//! anywhere in the object) are returned separately when asked for; `null`
//! reads as absent.
//!
//! # Fallback to raw bytes
//! A body that is not valid JSON, not an object, or not of the expected shape
//! is routed on its first `prefix_length` raw bytes, with `fallback` saying
//! why. "Not of the expected shape": a value the text is read from has the
//! wrong type (e.g. `messages` not an array, `content` a number), the
//! required field is missing (`messages`, `prompt`, or both `instructions`
//! and `input`), a field the key reads appears twice, or the body is a
//! top-level array (any other non-`{` start counts as `InvalidJson`).
//!
//! Validation covers the prefix region only, and bytes after `Done` are
//! never read. Until the prefix is known, every value is parsed by
//! serde_json, so it is valid JSON, but shapes are checked only where text is
//! read. Once the prefix is known (the text reached `prefix_length`
//! characters, or its source values ended), the body is read on only for
//! `prompt_cache_key` (and `model` if still missing): every other value, and
//! every array element past the prefix, is only delimited by the span scanner,
//! neither parsed nor validated. Checking those bytes could only turn a key
//! already determined into a fallback, and it would depend on whether a
//! tenant header let extraction stop early; the body is forwarded untouched
//! either way. The top-level glue (`,` `:` and the key strings) is still
//! checked to the end, since it is what locates the top-level keys, and a body
//! that ends before its object does is still `InvalidJson`. serde_json's
//! nesting limit (128) applies to the values the text is read from (deeper
//! counts as invalid; other values are checked without recursion), and lone
//! UTF-16 surrogate escapes (`"\ud800"`), which no Rust string holds, count
//! as invalid.
//!
//! # Limits
//! When `max_body_bytes` cuts the body, the prefix is the text of the values
//! completed before the cut; a value the cut falls inside contributes nothing.
//! With no text at all, the raw bytes are used (`FallbackReason::LimitReached`).
//! Values read before a fallback or cut (`model`, `prompt_cache_key`) are
//! still returned. Memory held: the first `prefix_length` raw bytes, the
//! canonical text (at most `prefix_length` characters per section), and the
//! one value being delimited (at most `max_body_bytes`). A value the text is
//! read from is held with its strings cut to `prefix_length` characters once
//! it passes 64 KiB, so a long system prompt costs about 64 KiB plus one read
//! of the body (at most 64 KiB), not its length.

pub(crate) mod canonical;
mod document;
#[cfg(any(fuzzing, test))]
pub mod fuzzing;
mod long_strings;
mod openai;
mod span;

#[cfg(test)]
mod tests;

use crate::classify::ApiKind;
use document::{Document, Outcome};
use openai::OpenAiReader;
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
    /// `max_body_bytes` cut the body before any text was found.
    LimitReached,
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

/// How reading ends for the body seen so far.
#[derive(Debug)]
enum Mode {
    /// Collecting the first `prefix_length` raw bytes: native invoke, or an
    /// OpenAI body that fell back (`fallback` says why).
    Raw { fallback: Option<FallbackReason> },
    /// Walking an OpenAI-compatible JSON body.
    Json(Box<Document>),
}

/// Why `feed` said `Done`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stop {
    /// Everything wanted is known (or, for raw bytes, the prefix is full).
    Complete,
    /// `max_body_bytes` were inspected first.
    LimitReached,
}

/// Incremental prefix extraction for one request body.
#[derive(Debug)]
pub struct Extractor {
    limits: Limits,
    mode: Mode,
    /// Present for the OpenAI kinds; kept after a fallback for model/tenant.
    reader: Option<Box<OpenAiReader>>,
    /// The first `prefix_length` bytes of the body (what a fallback routes on).
    raw: Vec<u8>,
    /// The body is gRPC-framed: the raw prefix ends with its first message.
    grpc: bool,
    inspected: usize,
    stop: Option<Stop>,
}

/// A gRPC message's header: a compression flag, then the length (4 bytes,
/// big-endian).
const GRPC_HEADER_BYTES: usize = 5;

impl Extractor {
    pub fn new(kind: ApiKind, limits: Limits) -> Self {
        let (mode, reader) = match kind {
            ApiKind::Invoke => (Mode::Raw { fallback: None }, None),
            _ => (
                Mode::Json(Box::new(Document::new())),
                Some(Box::new(OpenAiReader::new(
                    kind,
                    limits.prefix_length,
                    limits.include_model,
                    limits.want_body_tenant,
                ))),
            ),
        };
        Extractor {
            limits,
            mode,
            reader,
            raw: Vec::new(),
            grpc: false,
            inspected: 0,
            stop: None,
        }
    }

    /// A gRPC body (native invoke): its raw prefix ends with its first
    /// message when that is shorter than `prefix_length`, so a stream whose
    /// client waits for a reply to its first message is not held for more.
    pub fn ending_raw_prefix_with_the_first_grpc_message(mut self) -> Self {
        self.grpc = matches!(self.mode, Mode::Raw { .. });
        self
    }

    /// How long the raw prefix is once complete: `prefix_length`, or a
    /// gRPC body's first message (header included) if shorter, known once
    /// its header is in.
    fn raw_prefix_bound(&self) -> usize {
        let first_message = match self.raw.get(1..GRPC_HEADER_BYTES) {
            Some(&[a, b, c, d]) if self.grpc => {
                let length = u32::from_be_bytes([a, b, c, d]);
                usize::try_from(length).map_or(usize::MAX, |l| l.saturating_add(GRPC_HEADER_BYTES))
            }
            _ => usize::MAX,
        };
        self.limits.prefix_length.min(first_message)
    }

    /// Cuts capped spans while they arrive from `bytes` on (tests replay
    /// fuzz inputs with the fuzz build's threshold).
    #[cfg(test)]
    fn cutting_arriving_from(mut self, bytes: usize) -> Self {
        if let Mode::Json(document) = self.mode {
            self.mode = Mode::Json(Box::new(document.cutting_arriving_from(bytes)));
        }
        self
    }

    fn progress(&self) -> Progress {
        if self.stop.is_some() {
            Progress::Done
        } else {
            Progress::NeedMore
        }
    }

    /// Keeps bytes for a possible raw-byte prefix, up to `prefix_length`.
    fn keep_raw(&mut self, bytes: &[u8]) {
        let room = self.limits.prefix_length.saturating_sub(self.raw.len());
        self.raw
            .extend_from_slice(bytes.get(..room.min(bytes.len())).unwrap_or(bytes));
    }

    /// At most how many more body bytes are worth reading now, if that is
    /// known: what a raw-byte prefix still lacks (so the host copies no more
    /// than needed), 0 once done; `None` while walking JSON (where `model` or
    /// `prompt_cache_key` may come anywhere).
    pub fn max_useful_bytes(&self) -> Option<usize> {
        if self.stop.is_some() {
            return Some(0);
        }
        match self.mode {
            Mode::Raw { .. } => Some(self.raw_prefix_bound().saturating_sub(self.raw.len())),
            Mode::Json(_) => None,
        }
    }

    /// Feeds the next chunk of the body (each byte exactly once, in order).
    /// Bytes fed after `Done` are ignored.
    pub fn feed(&mut self, chunk: &[u8]) -> Progress {
        if self.stop.is_some() || chunk.is_empty() {
            return self.progress();
        }
        let room = self.limits.max_body_bytes.saturating_sub(self.inspected);
        let allowed = chunk.get(..room.min(chunk.len())).unwrap_or(chunk);
        let mut consumed = 0;
        if let (Mode::Json(document), Some(reader)) = (&mut self.mode, self.reader.as_deref_mut()) {
            let step = document.feed(allowed, reader);
            consumed = step.consumed;
            let seen = allowed.get(..consumed).unwrap_or(allowed);
            self.keep_raw(seen);
            match step.outcome {
                Outcome::NeedMore => {}
                Outcome::Satisfied => self.stop = Some(Stop::Complete),
                Outcome::Failed(reason) => {
                    self.mode = Mode::Raw {
                        fallback: Some(reason),
                    }
                }
            }
        }
        if matches!(self.mode, Mode::Raw { .. }) {
            // A gRPC header first, alone: the bound it sets must not depend
            // on how the body was split. Only what the prefix keeps of it is
            // taken (all of it unless prefix_length is shorter).
            let header = GRPC_HEADER_BYTES.min(self.limits.prefix_length);
            if self.grpc && self.raw.len() < header {
                let rest = allowed.get(consumed..).unwrap_or_default();
                let take = (header - self.raw.len()).min(rest.len());
                self.keep_raw(rest.get(..take).unwrap_or_default());
                consumed += take;
            }
            let rest = allowed.get(consumed..).unwrap_or_default();
            let bound = self.raw_prefix_bound();
            let wanted = bound.saturating_sub(self.raw.len());
            let take = wanted.min(rest.len());
            self.keep_raw(rest.get(..take).unwrap_or_default());
            consumed += take;
            // Until a gRPC header is in, the bound is prefix_length (at
            // least 1024), past any header.
            if self.raw.len() >= bound {
                self.stop = Some(Stop::Complete);
            }
        }
        self.inspected = self.inspected.saturating_add(consumed);
        if self.stop.is_none() && self.inspected >= self.limits.max_body_bytes {
            self.stop = Some(Stop::LimitReached);
        }
        self.progress()
    }

    /// Ends extraction: at the end of the body, or once `feed` said `Done`.
    pub fn finish(self) -> Extraction {
        let (model, body_tenant) = match &self.reader {
            Some(reader) => (reader.model.clone(), reader.tenant.clone()),
            None => (None, None),
        };
        let fallback = match (&self.mode, self.stop) {
            (Mode::Raw { fallback }, _) => *fallback,
            (Mode::Json(_), Some(Stop::Complete)) => None,
            (Mode::Json(_), Some(Stop::LimitReached)) => {
                let found_text = self.reader.as_ref().is_some_and(|r| !r.text.is_empty());
                (!found_text).then_some(FallbackReason::LimitReached)
            }
            // The body ended before its JSON did (an empty body is no JSON
            // at all: empty prefix, no fallback).
            (Mode::Json(_), None) => (self.inspected > 0).then_some(FallbackReason::InvalidJson),
        };
        let canonical =
            matches!(self.mode, Mode::Json(_)) && fallback.is_none() && self.inspected > 0;
        let (source, prefix, short) = match (&self.reader, canonical) {
            (Some(reader), true) => {
                let (prefix, chars) = reader.text.prefix();
                (
                    PrefixSource::CanonicalText,
                    prefix,
                    chars < self.limits.prefix_length,
                )
            }
            _ => {
                let short = self.raw.len() < self.limits.prefix_length;
                (PrefixSource::RawBytes, self.raw, short)
            }
        };
        Extraction {
            source,
            prefix,
            model,
            body_tenant,
            fallback,
            short,
            bytes_inspected: self.inspected,
        }
    }
}
