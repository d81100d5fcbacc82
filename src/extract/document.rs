//! Walks the top level of a JSON object body as it arrives, handing each
//! completed key/value span (or, for arrays the reader wants streamed, each
//! element span) to a [`Sink`], so nothing is parsed twice and no byte is
//! scanned twice.
//!
//! Only the glue between spans (`{`, keys, `:`, `,`, `[`, `]`, `}`) is checked
//! here; every span the sink keeps is parsed by `serde_json` there. Spans the
//! sink skips (values it no longer needs) are only delimited: never copied,
//! never parsed, never validated. In spans the sink wants capped
//! ([`Sink::string_cap`]), strings longer than the cap are cut as they arrive,
//! so a system prompt of hundreds of KiB is not held whole to read its first
//! characters.

use std::borrow::Cow;

use super::long_strings::{cap_arriving, cap_long_strings};
use super::span::{skip_string, SpanScanner};
use super::FallbackReason;

/// A capped span is cut while it arrives once it holds this many bytes (and
/// again each time it doubles); smaller spans are cut once complete. Under
/// cargo-fuzz (`cfg(fuzzing)`) it is [`CUT_ARRIVING_FROM_FUZZING`], so the
/// fuzzer's short bodies reach the cut (and its chunkings are compared with
/// the one-piece feed, which never cuts while arriving).
const CUT_ARRIVING_FROM: usize = if cfg!(fuzzing) {
    CUT_ARRIVING_FROM_FUZZING
} else {
    64 * 1024
};

/// The cut threshold of the fuzz build (tests replaying its inputs use it).
pub(super) const CUT_ARRIVING_FROM_FUZZING: usize = 64;

/// What the sink wants of a top-level value that starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ValueUse {
    /// The whole value, to [`Sink::value`].
    Whole,
    /// Its elements one by one if it is an array (else the whole value).
    Elements,
    /// Nothing: only find where it ends.
    Skip,
}

/// Receives the pieces of the top-level object, in body order.
pub(crate) trait Sink {
    /// A value for `key` starts.
    fn begin_value(&mut self, key: &str) -> Result<ValueUse, FallbackReason>;
    /// The next element of the streamed array under `key` starts: `false`
    /// skips it (it is only delimited, and [`Sink::element`] is not called).
    fn wants_element(&self, key: &str) -> bool;
    /// The whole value of `key` (not a streamed array).
    fn value(&mut self, key: &str, span: &[u8]) -> Result<(), FallbackReason>;
    /// One element of the streamed array under `key`.
    fn element(&mut self, key: &str, span: &[u8]) -> Result<(), FallbackReason>;
    /// The streamed array under `key` ended.
    fn end_array(&mut self, key: &str) -> Result<(), FallbackReason>;
    /// The top-level object ended.
    fn end_object(&mut self) -> Result<(), FallbackReason>;
    /// The most characters of any one string the value of `key` (or, with
    /// `element`, each element of it) can use: longer strings reach
    /// [`Sink::value`] or [`Sink::element`] cut to that many (see
    /// `long_strings`). `None`: whole.
    fn string_cap(&self, key: &str, element: bool) -> Option<usize>;
    /// Everything wanted from the body is known.
    fn satisfied(&self) -> bool;
}

/// Where the walker is in the top-level object.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum At {
    BeforeObject,
    /// After `{`: a key or `}`.
    FirstKeyOrEnd,
    /// After `,`: a key.
    Key,
    InKey,
    Colon,
    Value,
    InValue,
    /// After `[` of a streamed array: an element or `]`.
    FirstElementOrEnd,
    /// After `,` in a streamed array: an element.
    Element,
    InElement,
    ElementCommaOrEnd,
    CommaOrEnd,
    Ended,
}

/// What a call to [`Document::feed`] achieved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Outcome {
    NeedMore,
    Satisfied,
    Failed(FallbackReason),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Step {
    /// Bytes of the input this call inspected (up to and including the byte
    /// that satisfied the sink or revealed the failure).
    pub consumed: usize,
    pub outcome: Outcome,
}

/// Incremental walker over one top-level JSON object.
#[derive(Debug)]
pub(crate) struct Document {
    at: At,
    span: SpanScanner,
    /// The span being accumulated (a key, a value or an array element).
    buf: Vec<u8>,
    /// The current span is skipped: not accumulated, not handed on.
    skipping: bool,
    /// The current span's strings are cut to this many characters.
    string_cap: Option<usize>,
    /// `buf` is cut (`cap_arriving`) when it grows past this many bytes.
    cut_at: usize,
    /// Bytes from which a capped span is first cut while arriving.
    cut_arriving_from: usize,
    /// Inside a string already cut: the bytes up to its closing quote are
    /// dropped. The value is `skip_string`'s `escaped`.
    dropping: Option<bool>,
    key: String,
}

fn is_whitespace(byte: u8) -> bool {
    matches!(byte, b' ' | b'\t' | b'\n' | b'\r')
}

/// Bytes that cannot start a value.
fn cannot_start_value(byte: u8) -> bool {
    matches!(byte, b',' | b':' | b']' | b'}')
}

/// Decodes a JSON string span, borrowing when it has no escapes.
pub(crate) fn decode_string(span: &[u8]) -> Result<Cow<'_, str>, serde_json::Error> {
    if span.contains(&b'\\') {
        serde_json::from_slice::<String>(span).map(Cow::Owned)
    } else {
        serde_json::from_slice::<&str>(span).map(Cow::Borrowed)
    }
}

/// Syntax errors mean the body is not JSON; type errors mean it is JSON of
/// another shape.
pub(crate) fn reason_of(error: &serde_json::Error) -> FallbackReason {
    match error.classify() {
        serde_json::error::Category::Data => FallbackReason::UnexpectedShape,
        _ => FallbackReason::InvalidJson,
    }
}

impl Document {
    pub(crate) fn new() -> Self {
        Document {
            at: At::BeforeObject,
            span: SpanScanner::new(),
            buf: Vec::new(),
            skipping: false,
            string_cap: None,
            cut_at: CUT_ARRIVING_FROM,
            cut_arriving_from: CUT_ARRIVING_FROM,
            dropping: None,
            key: String::new(),
        }
    }

    /// Cuts arriving spans from `bytes` on (tests use small values).
    #[cfg(test)]
    pub(super) fn cutting_arriving_from(mut self, bytes: usize) -> Self {
        self.cut_arriving_from = bytes;
        self
    }

    fn start_span(&mut self, next: At, skipping: bool, string_cap: Option<usize>) {
        self.span = SpanScanner::new();
        self.buf.clear();
        self.skipping = skipping;
        self.string_cap = string_cap.filter(|_| !skipping);
        self.cut_at = self.cut_arriving_from;
        self.dropping = None;
        self.at = next;
    }

    /// The most characters a string of the current span keeps, if it is
    /// capped and has strings: the cut reads every `"` outside a string as
    /// opening one, which is the scanner's reading only where it tracks
    /// strings. In a scalar it is not (`x"…` is no string but an invalid
    /// value that ends at the next delimiter), and dropping bytes up to the
    /// next quote there could drop that delimiter.
    fn cap(&self) -> Option<usize> {
        self.string_cap.filter(|_| self.span.holds_strings())
    }

    /// Cuts the long strings of a capped span that is still arriving, once
    /// it is large.
    fn cut_arriving(&mut self) {
        let Some(max_chars) = self.cap() else {
            return;
        };
        if self.buf.len() <= self.cut_at {
            return;
        }
        let (kept, dropping) = cap_arriving(&self.buf, max_chars);
        if let Cow::Owned(kept) = kept {
            self.buf = kept;
        }
        self.dropping = dropping;
        // Doubling keeps the total work of the cuts linear in the span.
        self.cut_at = (2 * self.buf.len()).max(self.buf.len() + self.cut_arriving_from);
    }

    /// Inspects `bytes` (the next bytes of the body) until the sink is
    /// satisfied, the body is found unusable, or the bytes run out.
    pub(crate) fn feed<S: Sink>(&mut self, bytes: &[u8], sink: &mut S) -> Step {
        let mut i = 0;
        while let Some(rest) = bytes.get(i..).filter(|r| !r.is_empty()) {
            match self.advance(rest, sink) {
                Ok((used, event)) => {
                    i += used;
                    if event && sink.satisfied() {
                        return Step {
                            consumed: i,
                            outcome: Outcome::Satisfied,
                        };
                    }
                }
                Err((used, reason)) => {
                    return Step {
                        consumed: i + used,
                        outcome: Outcome::Failed(reason),
                    }
                }
            }
        }
        Step {
            consumed: bytes.len(),
            outcome: Outcome::NeedMore,
        }
    }

    /// One step on non-empty `rest`: returns the bytes used and whether the
    /// sink received something (so satisfaction may have changed).
    fn advance<S: Sink>(
        &mut self,
        rest: &[u8],
        sink: &mut S,
    ) -> Result<(usize, bool), (usize, FallbackReason)> {
        if matches!(self.at, At::InKey | At::InValue | At::InElement) {
            if let Some(escaped) = self.dropping.as_mut() {
                // The rest of a string already cut: dropped up to its closing
                // quote, which is then scanned and kept like any byte.
                let Some(end) = skip_string(rest, 0, escaped) else {
                    return Ok((rest.len(), false));
                };
                self.dropping = None;
                self.span.skipped_string_contents();
                return Ok((end - 1, false));
            }
            let scanned = self.span.scan(rest);
            let used = scanned.consumed;
            if self.skipping {
                if scanned.complete {
                    self.at = match self.at {
                        At::InElement => At::ElementCommaOrEnd,
                        _ => At::CommaOrEnd,
                    };
                }
                return Ok((used, false));
            }
            self.buf.extend_from_slice(rest.get(..used).unwrap_or(rest));
            if !scanned.complete {
                self.cut_arriving();
                return Ok((used, false));
            }
            self.span_complete(sink).map_err(|reason| (used, reason))?;
            return Ok((used, true));
        }
        let Some(&byte) = rest.first() else {
            return Ok((0, false));
        };
        if is_whitespace(byte) {
            let skipped = rest.iter().take_while(|&&b| is_whitespace(b)).count();
            return Ok((skipped, false));
        }
        let fail = |reason| Err((1, reason));
        match (self.at, byte) {
            (At::BeforeObject, b'{') => self.at = At::FirstKeyOrEnd,
            // A top-level array is JSON of another shape (judged from its
            // first byte only); anything else that is not `{` is not ours.
            (At::BeforeObject, b'[') => return fail(FallbackReason::UnexpectedShape),
            (At::FirstKeyOrEnd | At::Key, b'"') => {
                self.start_span(At::InKey, false, None);
                return Ok((0, false));
            }
            (At::FirstKeyOrEnd | At::CommaOrEnd, b'}') => {
                self.at = At::Ended;
                sink.end_object().map_err(|reason| (1, reason))?;
                return Ok((1, true));
            }
            (At::Colon, b':') => self.at = At::Value,
            (At::Value, b) if !cannot_start_value(b) => {
                let usage = sink.begin_value(&self.key).map_err(|reason| (1, reason))?;
                if usage == ValueUse::Elements && b == b'[' {
                    self.at = At::FirstElementOrEnd;
                } else {
                    let cap = sink.string_cap(&self.key, false);
                    self.start_span(At::InValue, usage == ValueUse::Skip, cap);
                    return Ok((0, false));
                }
            }
            (At::FirstElementOrEnd | At::ElementCommaOrEnd, b']') => {
                self.at = At::CommaOrEnd;
                sink.end_array(&self.key).map_err(|reason| (1, reason))?;
                return Ok((1, true));
            }
            (At::FirstElementOrEnd | At::Element, b) if !cannot_start_value(b) => {
                let skipping = !sink.wants_element(&self.key);
                let cap = sink.string_cap(&self.key, true);
                self.start_span(At::InElement, skipping, cap);
                return Ok((0, false));
            }
            (At::ElementCommaOrEnd, b',') => self.at = At::Element,
            (At::CommaOrEnd, b',') => self.at = At::Key,
            _ => return fail(FallbackReason::InvalidJson),
        }
        Ok((1, false))
    }

    /// The completed span, its strings cut to the span's cap.
    fn capped(&self) -> Cow<'_, [u8]> {
        match self.cap() {
            Some(max_chars) => cap_long_strings(&self.buf, max_chars),
            None => Cow::Borrowed(&self.buf),
        }
    }

    fn span_complete<S: Sink>(&mut self, sink: &mut S) -> Result<(), FallbackReason> {
        match self.at {
            At::InKey => {
                let key = decode_string(&self.buf).map_err(|e| reason_of(&e))?;
                self.key.clear();
                self.key.push_str(&key);
                self.at = At::Colon;
            }
            At::InValue => {
                self.at = At::CommaOrEnd;
                sink.value(&self.key, &self.capped())?;
            }
            At::InElement => {
                self.at = At::ElementCommaOrEnd;
                sink.element(&self.key, &self.capped())?;
            }
            _ => {}
        }
        self.buf.clear();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Records what the walker reports, streaming the key "s".
    #[derive(Default)]
    struct Recorder {
        events: Vec<String>,
        /// Skip every element of streamed arrays.
        skip_elements: bool,
        /// What [`Sink::string_cap`] answers for every key.
        string_cap: Option<usize>,
    }

    impl Sink for Recorder {
        fn begin_value(&mut self, key: &str) -> Result<ValueUse, FallbackReason> {
            Ok(match key {
                "s" => ValueUse::Elements,
                "skip" => ValueUse::Skip,
                _ => ValueUse::Whole,
            })
        }
        fn wants_element(&self, _key: &str) -> bool {
            !self.skip_elements
        }
        fn string_cap(&self, _key: &str, _element: bool) -> Option<usize> {
            self.string_cap
        }
        fn value(&mut self, key: &str, span: &[u8]) -> Result<(), FallbackReason> {
            serde_json::from_slice::<serde::de::IgnoredAny>(span).map_err(|e| reason_of(&e))?;
            self.events
                .push(format!("{key}={}", String::from_utf8_lossy(span)));
            Ok(())
        }
        fn element(&mut self, key: &str, span: &[u8]) -> Result<(), FallbackReason> {
            self.events
                .push(format!("{key}[]={}", String::from_utf8_lossy(span)));
            Ok(())
        }
        fn end_array(&mut self, key: &str) -> Result<(), FallbackReason> {
            self.events.push(format!("{key}]"));
            Ok(())
        }
        fn end_object(&mut self) -> Result<(), FallbackReason> {
            self.events.push("}".to_string());
            Ok(())
        }
        fn satisfied(&self) -> bool {
            false
        }
    }

    fn walk(body: &[u8], step: usize) -> (Vec<String>, Outcome, usize) {
        walk_with(body, step, Recorder::default())
    }

    fn walk_with(body: &[u8], step: usize, mut sink: Recorder) -> (Vec<String>, Outcome, usize) {
        let mut doc = Document::new();
        let mut consumed = 0;
        for piece in body.chunks(step) {
            let s = doc.feed(piece, &mut sink);
            consumed += s.consumed;
            if s.outcome != Outcome::NeedMore {
                return (sink.events, s.outcome, consumed);
            }
        }
        (sink.events, Outcome::NeedMore, consumed)
    }

    /// Walks `body` in pieces of `step` bytes with strings capped at
    /// `max_chars`, cut while arriving from `cut_from` bytes on; returns the
    /// events and the most bytes the walker held at once.
    fn walk_capped(
        body: &[u8],
        step: usize,
        max_chars: usize,
        cut_from: usize,
    ) -> (Vec<String>, usize) {
        let mut sink = Recorder {
            string_cap: Some(max_chars),
            ..Recorder::default()
        };
        let mut doc = Document::new().cutting_arriving_from(cut_from);
        let mut held = 0;
        for piece in body.chunks(step) {
            let s = doc.feed(piece, &mut sink);
            held = held.max(doc.buf.len());
            assert_eq!(
                s.outcome,
                Outcome::NeedMore,
                "step {step}: {:?}",
                sink.events
            );
        }
        (sink.events, held)
    }

    #[test]
    fn strings_cut_while_arriving_are_cut_as_the_whole_span_would_be() {
        // Characters of every width and escape kind, including a surrogate
        // pair, escaped quotes and backslashes, in strings of many lengths.
        let pieces = [
            "ab",
            "é",
            "日",
            "🦀",
            r"\n",
            r"\\",
            r#"\""#,
            r"\u00e9",
            r"\ud83e\udd80",
            r#"\\\""#,
        ];
        let mut strings = Vec::new();
        for n in 0..pieces.len() {
            for len in [0, 1, 5, 9, 23] {
                let content: String = (0..len)
                    .map(|i| pieces[(n + i * 7) % pieces.len()])
                    .collect();
                strings.push(format!("\"{content}\""));
            }
        }
        let elements: Vec<String> = strings
            .chunks(3)
            .map(|three| {
                format!(
                    r#"{{"k{}:[{}],"n":12345}}"#,
                    &three[0][1..],
                    three[1..].join(",")
                )
            })
            .chain(strings.iter().cloned())
            .collect();
        let body = format!(r#"{{"s":[{}],"v":{}}}"#, elements.join(","), strings[24]);
        let capped = |span: &str, max_chars: usize| {
            String::from_utf8(cap_long_strings(span.as_bytes(), max_chars).into_owned()).unwrap()
        };
        for max_chars in [1, 3, 8] {
            let mut expected: Vec<String> = elements
                .iter()
                .map(|e| format!("s[]={}", capped(e, max_chars)))
                .collect();
            expected.push("s]".to_string());
            expected.push(format!("v={}", capped(&strings[24], max_chars)));
            expected.push("}".to_string());
            for cut_from in [0, 5, 40] {
                for step in [1, 2, 3, 7, 13, 64, body.len()] {
                    let (events, _) = walk_capped(body.as_bytes(), step, max_chars, cut_from);
                    assert_eq!(
                        events, expected,
                        "max_chars {max_chars}, cut from {cut_from}, step {step}"
                    );
                }
            }
        }
    }

    #[test]
    fn a_quote_in_a_scalar_opens_no_string_to_cut() {
        // Neither scalar is JSON, but each is delimited as one: it ends at the
        // first delimiter, and its bytes after the quote are no string to cut.
        let x = format!("x\"{}", "a".repeat(60));
        let y = format!("y\"{}", "z".repeat(60));
        let body = format!(r#"{{"s":[{x} ,"bcdefgh",{y}]}}"#);
        let expected = [
            format!("s[]={x}"),
            r#"s[]="bcd""#.to_string(),
            format!("s[]={y}"),
            "s]".to_string(),
            "}".to_string(),
        ];
        for cut_from in [0, 5, 40] {
            for step in 1..=body.len() {
                let (events, _) = walk_capped(body.as_bytes(), step, 3, cut_from);
                assert_eq!(events, expected, "cut from {cut_from}, step {step}");
            }
        }
    }

    #[test]
    fn a_long_string_is_not_held_whole() {
        // A system prompt of over 1 MiB, arriving in the host's 64 KiB slices.
        let prompt = r"It is a truth universally acknowledged, é 日本 \\ \n. ".repeat(20_000);
        let body = format!(r#"{{"s":[{{"role":"system","content":"{prompt}"}}]}}"#);
        assert!(body.len() > 1 << 20);
        let (events, held) = walk_capped(body.as_bytes(), 64 * 1024, 4096, CUT_ARRIVING_FROM);
        let element = &body[6..body.len() - 2];
        let whole =
            String::from_utf8(cap_long_strings(element.as_bytes(), 4096).into_owned()).unwrap();
        assert_eq!(
            events,
            [format!("s[]={whole}"), "s]".to_string(), "}".to_string()]
        );
        assert!(
            held <= CUT_ARRIVING_FROM + 64 * 1024,
            "held {held} bytes of a {} byte body",
            body.len()
        );
    }

    #[test]
    fn reports_values_elements_and_ends_in_order_for_any_piece_size() {
        let body = br#" { "a" : 1 , "s" : [ {"x":[1]} , "y",2 ] , "b\u0073":[3],"t":"u"} "#;
        for step in 1..=body.len() {
            let (events, outcome, _) = walk(body, step);
            assert_eq!(outcome, Outcome::NeedMore, "step {step}");
            assert_eq!(
                events,
                [
                    "a=1",
                    r#"s[]={"x":[1]}"#,
                    r#"s[]="y""#,
                    "s[]=2",
                    "s]",
                    "bs=[3]",
                    r#"t="u""#,
                    "}"
                ],
                "step {step}"
            );
        }
    }

    #[test]
    fn skipped_values_and_elements_are_delimited_but_never_handed_on_or_checked() {
        // Recorder parses whole values, so `tru` would fail if not skipped.
        let body = br#"{"skip":[tru,{"x\"]":"]}"}] , "s":[1,{"a":[}],"y"],"a":1}"#;
        for step in 1..=body.len() {
            let (events, outcome, consumed) = walk(body, step);
            assert_eq!(outcome, Outcome::NeedMore, "step {step}");
            assert_eq!(consumed, body.len());
            assert_eq!(
                events,
                ["s[]=1", r#"s[]={"a":[}]"#, r#"s[]="y""#, "s]", "a=1", "}"],
                "step {step}"
            );
            let sink = Recorder {
                skip_elements: true,
                ..Recorder::default()
            };
            let (events, outcome, consumed) = walk_with(body, step, sink);
            assert_eq!(outcome, Outcome::NeedMore, "step {step}");
            assert_eq!(consumed, body.len());
            assert_eq!(events, ["s]", "a=1", "}"], "step {step}");
        }
        // The glue around skipped spans is still checked.
        for step in 1..=18 {
            let (_, outcome, consumed) = walk(br#"{"skip":[1] "a":1}"#, step);
            assert_eq!(outcome, Outcome::Failed(FallbackReason::InvalidJson));
            assert_eq!(consumed, 13, "step {step}");
        }
    }

    #[test]
    fn broken_glue_is_invalid_json_at_the_offending_byte() {
        let cases: &[(&[u8], Outcome, usize)] = &[
            (b"x", Outcome::Failed(FallbackReason::InvalidJson), 1),
            (b"[1]", Outcome::Failed(FallbackReason::UnexpectedShape), 1),
            (
                br#"{"a" 1}"#,
                Outcome::Failed(FallbackReason::InvalidJson),
                6,
            ),
            (
                br#"{"a":1,}"#,
                Outcome::Failed(FallbackReason::InvalidJson),
                8,
            ),
            (
                br#"{"s":[1,]}"#,
                Outcome::Failed(FallbackReason::InvalidJson),
                9,
            ),
            (
                br#"{"a":1 "b":2}"#,
                Outcome::Failed(FallbackReason::InvalidJson),
                8,
            ),
            (
                br#"{"a":tru}"#,
                Outcome::Failed(FallbackReason::InvalidJson),
                8,
            ),
            (
                br#"{"a":[1}"#,
                Outcome::Failed(FallbackReason::InvalidJson),
                8,
            ),
            (
                br#"{"a":{"b":1]}"#,
                Outcome::Failed(FallbackReason::InvalidJson),
                12,
            ),
            (
                br#"{"a":1}x"#,
                Outcome::Failed(FallbackReason::InvalidJson),
                8,
            ),
        ];
        for &(body, expected, at) in cases {
            for step in 1..=body.len() {
                let (_, outcome, consumed) = walk(body, step);
                let text = String::from_utf8_lossy(body);
                assert_eq!(outcome, expected, "{text} step {step}");
                assert_eq!(consumed, at, "{text} step {step}");
            }
        }
    }
}
