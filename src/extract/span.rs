//! Finds where one JSON value ends in a body that arrives in pieces.
//!
//! This is deliberately only a delimiter: it tracks nesting depth, whether it
//! is inside a string and whether a backslash escapes the next byte, nothing
//! more. Whether the bytes it delimits are valid JSON is decided by
//! `serde_json` when the completed span is parsed (if it is parsed at all:
//! values the key does not use are only delimited), so no JSON grammar is
//! written here.
//!
//! It is the hot loop for large bodies (everything past the prefix is only
//! delimited), so it jumps: inside a string with `memchr` to the next `"`
//! (an escaped quote is recognised by the odd run of backslashes before it),
//! outside strings through a byte table to the next bracket or quote.

/// Incremental scanner for the extent of one JSON value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SpanScanner {
    /// Nothing seen yet; the first byte decides the kind of value.
    Fresh,
    /// Inside a string value (the span began with `"`); `escaped`: the
    /// previous piece ended in an unpaired backslash.
    String { escaped: bool },
    /// Inside an object or array; `depth` counts open brackets of either kind
    /// (a mismatch such as `[}` is left for serde_json to reject).
    Container {
        depth: usize,
        in_string: bool,
        escaped: bool,
    },
    /// A number or literal (`true`, `false`, `null`): ends before the next
    /// whitespace, `,`, `]` or `}`.
    Scalar,
}

/// How far one call to [`SpanScanner::scan`] got.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Scanned {
    /// Bytes that belong to the span (a scalar's terminating delimiter is not
    /// part of it and is not counted).
    pub consumed: usize,
    /// The span ended within these bytes.
    pub complete: bool,
}

/// Bytes that end a scalar: JSON whitespace and the structural closers.
fn ends_scalar(byte: u8) -> bool {
    matches!(byte, b' ' | b'\t' | b'\n' | b'\r' | b',' | b']' | b'}')
}

/// Bytes that matter inside a container outside strings.
// Evaluated at compile time: an index out of range fails the build, not a request.
#[allow(clippy::indexing_slicing)]
const STRUCTURAL: [bool; 256] = {
    let mut table = [false; 256];
    table[b'"' as usize] = true;
    table[b'{' as usize] = true;
    table[b'[' as usize] = true;
    table[b'}' as usize] = true;
    table[b']' as usize] = true;
    table
};

/// Backslashes immediately before `end`, not looking before `start`.
pub(crate) fn backslashes_before(bytes: &[u8], start: usize, end: usize) -> usize {
    bytes.get(start..end).map_or(0, |run| {
        run.iter().rev().take_while(|&&b| b == b'\\').count()
    })
}

/// Skips string contents from `from` (just after the opening quote, or
/// where the previous piece stopped). Returns the index just past the closing
/// quote, or `None` when the piece ends first, with `escaped` set if its last
/// byte is a backslash that escapes the next piece's first byte.
pub(crate) fn skip_string(bytes: &[u8], from: usize, escaped: &mut bool) -> Option<usize> {
    let mut start = from;
    if *escaped {
        if start >= bytes.len() {
            return None;
        }
        *escaped = false;
        start += 1;
    }
    // `start` is never an escaped byte, so within [start, quote) a quote is
    // escaped exactly when an odd run of backslashes precedes it.
    let mut search = start;
    loop {
        let Some(offset) = bytes
            .get(search..)
            .and_then(|rest| memchr::memchr(b'"', rest))
        else {
            *escaped = backslashes_before(bytes, start, bytes.len()) % 2 == 1;
            return None;
        };
        let quote = search + offset;
        if backslashes_before(bytes, start, quote) % 2 == 0 {
            return Some(quote + 1);
        }
        search = quote + 1;
    }
}

impl SpanScanner {
    /// A scanner for a value whose first byte is the next byte fed. The caller
    /// must not start a span on whitespace or on `,` `]` `}`.
    pub(crate) fn new() -> Self {
        SpanScanner::Fresh
    }

    /// Whether a `"` in this span opens or closes a string, as `long_strings`
    /// reads it (outside a string, every `"` opens one): in a string or a
    /// container. A scalar has no strings: a quote in one is just a byte (the
    /// span is not JSON), and only a delimiter ends it.
    pub(crate) fn holds_strings(&self) -> bool {
        matches!(
            self,
            SpanScanner::String { .. } | SpanScanner::Container { .. }
        )
    }

    /// The caller dropped the rest of the string the scanner is in, up to
    /// (not including) its closing quote, which it feeds next: no byte before
    /// that quote escapes it.
    pub(crate) fn skipped_string_contents(&mut self) {
        match self {
            SpanScanner::String { escaped }
            | SpanScanner::Container {
                in_string: true,
                escaped,
                ..
            } => *escaped = false,
            _ => debug_assert!(false, "not inside a string: {self:?}"),
        }
    }

    /// Scans the next bytes of the span; call again with the following bytes
    /// until `complete`.
    pub(crate) fn scan(&mut self, bytes: &[u8]) -> Scanned {
        let incomplete = Scanned {
            consumed: bytes.len(),
            complete: false,
        };
        let complete = |consumed| Scanned {
            consumed,
            complete: true,
        };
        let mut i = 0;
        if *self == SpanScanner::Fresh {
            let Some(&first) = bytes.first() else {
                return incomplete;
            };
            *self = match first {
                b'"' => SpanScanner::String { escaped: false },
                b'{' | b'[' => SpanScanner::Container {
                    depth: 1,
                    in_string: false,
                    escaped: false,
                },
                _ => SpanScanner::Scalar,
            };
            i = 1;
        }
        match self {
            SpanScanner::Fresh => incomplete,
            SpanScanner::String { escaped } => match skip_string(bytes, i, escaped) {
                Some(end) => complete(end),
                None => incomplete,
            },
            SpanScanner::Scalar => {
                let rest = bytes.get(i..).unwrap_or_default();
                match rest.iter().position(|&b| ends_scalar(b)) {
                    Some(offset) => complete(i + offset),
                    None => incomplete,
                }
            }
            SpanScanner::Container {
                depth,
                in_string,
                escaped,
            } => loop {
                if *in_string {
                    match skip_string(bytes, i, escaped) {
                        Some(end) => {
                            *in_string = false;
                            i = end;
                        }
                        None => return incomplete,
                    }
                }
                let rest = bytes.get(i..).unwrap_or_default();
                let Some(offset) = rest
                    .iter()
                    .position(|&b| STRUCTURAL.get(usize::from(b)) == Some(&true))
                else {
                    return incomplete;
                };
                let at = i + offset;
                i = at + 1;
                match bytes.get(at) {
                    Some(b'"') => *in_string = true,
                    Some(b'{' | b'[') => *depth = depth.saturating_add(1),
                    _ => {
                        *depth = depth.saturating_sub(1);
                        if *depth == 0 {
                            return complete(i);
                        }
                    }
                }
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each input's span length is `expected` however it is cut in pieces.
    fn assert_spans(cases: &[(&[u8], Option<usize>)]) {
        for &(input, expected) in cases {
            for step in 1..=input.len() {
                assert_eq!(
                    span_len(input, step),
                    expected,
                    "{} in pieces of {step}",
                    String::from_utf8_lossy(input)
                );
            }
        }
    }

    /// Scans `input` in pieces of `step` bytes; returns the span length if it
    /// completed.
    fn span_len(input: &[u8], step: usize) -> Option<usize> {
        let mut scanner = SpanScanner::new();
        let mut offset = 0;
        for piece in input.chunks(step) {
            let scanned = scanner.scan(piece);
            offset += scanned.consumed;
            if scanned.complete {
                return Some(offset);
            }
        }
        None
    }

    #[test]
    fn finds_the_end_of_each_kind_of_value_in_any_piece_size() {
        let cases: &[(&[u8], Option<usize>)] = &[
            (br#""abc" rest"#, Some(5)),
            (br#""a\"b\\" rest"#, Some(8)),
            (br#"{"a":[1,{"b":"}]"}]} rest"#, Some(20)),
            (br#"[[],[[]]],"#, Some(9)),
            (b"123,", Some(3)),
            (b"true}", Some(4)),
            (b"null ", Some(4)),
            (b"-1.5e3]", Some(6)),
            (br#""unterminated"#, None),
            (br#"{"a":"}"#, None),
            (b"123", None),
        ];
        assert_spans(cases);
    }

    /// The obvious byte-at-a-time delimiter, to compare the jumping one with.
    fn reference_len(input: &[u8]) -> Option<usize> {
        let first = *input.first()?;
        if !matches!(first, b'"' | b'{' | b'[') {
            return input.iter().position(|&b| ends_scalar(b));
        }
        let (mut depth, mut in_string, mut escaped) = (0usize, false, false);
        for (i, &b) in input.iter().enumerate() {
            if in_string {
                match (escaped, b) {
                    (true, _) => escaped = false,
                    (false, b'\\') => escaped = true,
                    (false, b'"') => {
                        in_string = false;
                        if depth == 0 {
                            return Some(i + 1);
                        }
                    }
                    _ => {}
                }
                continue;
            }
            match b {
                b'"' => in_string = true,
                b'{' | b'[' => depth += 1,
                b'}' | b']' => {
                    depth = depth.saturating_sub(1);
                    if depth == 0 {
                        return Some(i + 1);
                    }
                }
                _ => {}
            }
        }
        None
    }

    #[test]
    fn jumping_agrees_with_byte_at_a_time_on_random_input_in_any_pieces() {
        // Few symbols, so backslash runs, escaped quotes and brackets inside
        // strings are frequent.
        const SYMBOLS: &[u8] = br#"\\\"""{}[]a , 1"#;
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = |n: usize| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state % n as u64) as usize
        };
        for _ in 0..3000 {
            let len = 1 + next(40);
            let mut input: Vec<u8> = (0..len).map(|_| SYMBOLS[next(SYMBOLS.len())]).collect();
            input[0] = [b'"', b'{', b'[', b'1'][next(4)];
            let expected = reference_len(&input);
            for step in [1, 2, 3, 5, len] {
                assert_eq!(
                    span_len(&input, step),
                    expected,
                    "{} in pieces of {step}",
                    String::from_utf8_lossy(&input)
                );
            }
        }
    }

    #[test]
    fn backslash_runs_of_either_parity_in_any_pieces() {
        let cases: &[(&[u8], Option<usize>)] = &[
            (br#""\\" x"#, Some(4)),
            (br#""\\\"" x"#, Some(6)),
            (br#""\\\\\\\\" x"#, Some(10)),
            (br#""\\\\\\\"" x"#, Some(10)),
            (br#"["\\\\",{"k":"\""}] x"#, Some(19)),
            (br#"["\\\"]"] x"#, Some(9)),
            (br#""\\\""#, None),
        ];
        assert_spans(cases);
    }

    #[test]
    fn escaped_quote_split_across_pieces_does_not_end_the_string() {
        let mut scanner = SpanScanner::new();
        assert!(!scanner.scan(br#""ab\"#).complete);
        assert!(!scanner.scan(br#"""#).complete);
        assert_eq!(
            scanner.scan(br#"c" x"#),
            Scanned {
                consumed: 2,
                complete: true
            }
        );
    }
}
