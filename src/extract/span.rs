//! Finds where one JSON value ends in a body that arrives in pieces.
//!
//! This is deliberately only a delimiter: it tracks nesting depth, whether it
//! is inside a string and whether the last byte was a backslash, nothing more.
//! Whether the bytes it delimits are valid JSON is decided by `serde_json`
//! when the completed span is parsed, so no JSON grammar is written here.

/// Incremental scanner for the extent of one JSON value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SpanScanner {
    /// Nothing seen yet; the first byte decides the kind of value.
    Fresh,
    /// Inside a string value (the span began with `"`).
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

/// Position of the next `"` or `\` at or after `from`.
fn next_quote_or_backslash(bytes: &[u8], from: usize) -> Option<usize> {
    let rest = bytes.get(from..)?;
    memchr::memchr2(b'"', b'\\', rest).map(|offset| from + offset)
}

impl SpanScanner {
    /// A scanner for a value whose first byte is the next byte fed. The caller
    /// must not start a span on whitespace or on `,` `]` `}`.
    pub(crate) fn new() -> Self {
        SpanScanner::Fresh
    }

    /// Scans the next bytes of the span; call again with the following bytes
    /// until `complete`.
    pub(crate) fn scan(&mut self, bytes: &[u8]) -> Scanned {
        let mut i = 0;
        while let Some(&byte) = bytes.get(i) {
            match self {
                SpanScanner::Fresh => {
                    *self = match byte {
                        b'"' => SpanScanner::String { escaped: false },
                        b'{' | b'[' => SpanScanner::Container {
                            depth: 1,
                            in_string: false,
                            escaped: false,
                        },
                        _ => SpanScanner::Scalar,
                    };
                    i += 1;
                }
                SpanScanner::String { escaped } => {
                    if *escaped {
                        *escaped = false;
                        i += 1;
                        continue;
                    }
                    match next_quote_or_backslash(bytes, i) {
                        None => i = bytes.len(),
                        Some(at) if bytes.get(at) == Some(&b'"') => {
                            return Scanned {
                                consumed: at + 1,
                                complete: true,
                            }
                        }
                        Some(at) => {
                            *escaped = true;
                            i = at + 1;
                        }
                    }
                }
                SpanScanner::Container {
                    depth,
                    in_string,
                    escaped,
                } => {
                    if *in_string {
                        if *escaped {
                            *escaped = false;
                            i += 1;
                            continue;
                        }
                        match next_quote_or_backslash(bytes, i) {
                            None => i = bytes.len(),
                            Some(at) => {
                                if bytes.get(at) == Some(&b'"') {
                                    *in_string = false;
                                } else {
                                    *escaped = true;
                                }
                                i = at + 1;
                            }
                        }
                        continue;
                    }
                    match byte {
                        b'"' => *in_string = true,
                        b'{' | b'[' => *depth = depth.saturating_add(1),
                        b'}' | b']' => {
                            *depth = depth.saturating_sub(1);
                            if *depth == 0 {
                                return Scanned {
                                    consumed: i + 1,
                                    complete: true,
                                };
                            }
                        }
                        _ => {}
                    }
                    i += 1;
                }
                SpanScanner::Scalar => {
                    if ends_scalar(byte) {
                        return Scanned {
                            consumed: i,
                            complete: true,
                        };
                    }
                    i += 1;
                }
            }
        }
        Scanned {
            consumed: bytes.len(),
            complete: false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
