//! Walks the top level of a JSON object body as it arrives, handing each
//! completed key/value span (or, for arrays the reader wants streamed, each
//! element span) to a [`Sink`], so nothing is parsed twice and no byte is
//! scanned twice.
//!
//! Only the glue between spans (`{`, keys, `:`, `,`, `[`, `]`, `}`) is checked
//! here; every span the sink keeps is parsed by `serde_json` there. Spans the
//! sink skips (values it no longer needs) are only delimited: never copied,
//! never parsed, never validated.

use std::borrow::Cow;

use super::span::SpanScanner;
use super::FallbackReason;

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
            key: String::new(),
        }
    }

    fn start_span(&mut self, next: At, skipping: bool) {
        self.span = SpanScanner::new();
        self.buf.clear();
        self.skipping = skipping;
        self.at = next;
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
                self.start_span(At::InKey, false);
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
                    self.start_span(At::InValue, usage == ValueUse::Skip);
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
                self.start_span(At::InElement, skipping);
                return Ok((0, false));
            }
            (At::ElementCommaOrEnd, b',') => self.at = At::Element,
            (At::CommaOrEnd, b',') => self.at = At::Key,
            _ => return fail(FallbackReason::InvalidJson),
        }
        Ok((1, false))
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
                sink.value(&self.key, &self.buf)?;
            }
            At::InElement => {
                self.at = At::ElementCommaOrEnd;
                sink.element(&self.key, &self.buf)?;
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
