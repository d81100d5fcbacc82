//! Shortens the strings of a value that are longer than any prefix can use,
//! before serde_json parses it.
//!
//! A message can hold a system prompt of hundreds of KiB, of which the key
//! uses at most `prefix_length` characters; decoding and validating the rest
//! was most of the cost of a large body. A string keeps its first
//! `max_chars` characters, cut between two characters (never inside an escape
//! or a UTF-8 sequence, never between the two halves of a surrogate pair), so
//! the value stays valid JSON and every text it gives is unchanged up to
//! `max_chars` characters. What is cut is past the prefix and, like the rest of
//! the body there, not validated. Short strings compare exactly as before (a
//! string cut to `max_chars >= 1024` characters never equals a role, a part
//! type or a key the reader looks for, and did not before either).

use std::borrow::Cow;

use super::span::{backslashes_before, skip_string};

/// Bytes of one UTF-8 sequence, from its first byte (1 for a byte that cannot
/// start one: serde_json rejects it wherever it is kept).
fn utf8_len(first: u8) -> usize {
    match first {
        0xC0..=0xDF => 2,
        0xE0..=0xEF => 3,
        0xF0..=0xF7 => 4,
        _ => 1,
    }
}

fn hex_value(digits: Option<&[u8]>) -> Option<u32> {
    let digits = std::str::from_utf8(digits?).ok()?;
    u32::from_str_radix(digits, 16).ok()
}

/// Bytes of the escape at `at` (which is a backslash): a surrogate pair
/// counts as one character, so it is never split.
fn escape_len(content: &[u8], at: usize) -> usize {
    if content.get(at + 1) != Some(&b'u') {
        return 2;
    }
    let high = hex_value(content.get(at + 2..at + 6));
    let paired = content.get(at + 6..at + 8) == Some(&b"\\u"[..]);
    match high {
        Some(0xD800..=0xDBFF) if paired => 12,
        _ => 6,
    }
}

/// Where string contents are cut to keep their first `max_chars`
/// characters, so that the quote put there closes the string.
///
/// In valid JSON the end of a character is never just after a backslash
/// that escapes the next byte. In a malformed escape (`\u12a\"`) or UTF-8
/// sequence (a lead byte, then `\"`) it can be; the quote put there would
/// then be escaped, and the cut text would read on as one string where the
/// span scanner (`skip_string`'s reading: a byte is escaped after an odd run
/// of backslashes) saw the string close. So such a cut keeps the escaped
/// byte too. The kept text is malformed either way, and serde_json rejects
/// it as it would reject the whole.
fn cut_after_chars(content: &[u8], max_chars: usize) -> usize {
    let cut = end_of_chars(content, max_chars);
    if backslashes_before(content, 0, cut) % 2 == 1 {
        (cut + 1).min(content.len())
    } else {
        cut
    }
}

/// Where the first `max_chars` characters of string contents end.
fn end_of_chars(content: &[u8], max_chars: usize) -> usize {
    let mut at = 0;
    let mut left = max_chars;
    // Position of the next backslash at or after `at`, found once per escape
    // (searching again for every character would be quadratic in a long
    // non-ASCII string).
    let mut next_escape = None;
    while left > 0 && at < content.len() {
        let escape = match next_escape {
            Some(escape) if escape >= at => escape,
            _ => {
                let escape = content
                    .get(at..)
                    .and_then(|rest| memchr::memchr(b'\\', rest))
                    .map_or(content.len(), |offset| at + offset);
                next_escape = Some(escape);
                escape
            }
        };
        // Fast path: ASCII before the next escape is one character per byte.
        let run = content.get(at..escape.min(at + left)).unwrap_or_default();
        let ascii = if run.is_ascii() {
            run.len()
        } else {
            run.iter().position(|b| !b.is_ascii()).unwrap_or(run.len())
        };
        at += ascii;
        left -= ascii;
        if left == 0 {
            break;
        }
        let Some(len) = char_len(content, at) else {
            break;
        };
        at += len;
        left -= 1;
    }
    at.min(content.len())
}

/// Bytes of the one character (an escape counts as one) starting at `at`.
fn char_len(content: &[u8], at: usize) -> Option<usize> {
    let byte = *content.get(at)?;
    Some(if byte == b'\\' {
        escape_len(content, at)
    } else {
        utf8_len(byte)
    })
}

/// The longest character: a surrogate pair written as two `\uXXXX` escapes.
const MAX_CHAR_BYTES: usize = 12;

/// A string still open at the end of a span that is still arriving.
struct Unterminated {
    /// Where its contents start.
    start: usize,
    /// The span ends in a backslash that escapes the next byte.
    escaped: bool,
}

/// Cuts every complete string of `span` longer than `max_chars` characters;
/// also says where a string left open at its end starts.
fn cap_complete_strings(span: &[u8], max_chars: usize) -> (Cow<'_, [u8]>, Option<Unterminated>) {
    let mut out: Option<Vec<u8>> = None;
    // span[..copied] is already in `out`.
    let mut copied = 0;
    let mut from = 0;
    let mut open = None;
    // Outside strings, every `"` opens one.
    while let Some(quote) = span.get(from..).and_then(|rest| memchr::memchr(b'"', rest)) {
        let start = from + quote + 1;
        let mut escaped = false;
        let Some(end) = skip_string(span, start, &mut escaped) else {
            open = Some(Unterminated { start, escaped });
            break;
        };
        let close = end - 1;
        let content = span.get(start..close).unwrap_or_default();
        if content.len() > max_chars {
            let cut = start + cut_after_chars(content, max_chars);
            if cut < close {
                let kept = out.get_or_insert_with(|| Vec::with_capacity(span.len().min(1 << 16)));
                kept.extend_from_slice(span.get(copied..cut).unwrap_or_default());
                copied = close;
            }
        }
        from = end;
    }
    let capped = match out {
        None => Cow::Borrowed(span),
        Some(mut kept) => {
            kept.extend_from_slice(span.get(copied..).unwrap_or_default());
            Cow::Owned(kept)
        }
    };
    (capped, open)
}

/// `span` (one complete JSON value) with each string longer than
/// `max_chars` characters cut to its first `max_chars`; borrowed when none is.
pub(crate) fn cap_long_strings(span: &[u8], max_chars: usize) -> Cow<'_, [u8]> {
    // A string has at least as many bytes as characters.
    if span.len() <= max_chars {
        return Cow::Borrowed(span);
    }
    cap_complete_strings(span, max_chars).0
}

/// The same cut for the start of a value that is still arriving, so that a
/// long string does not have to be held whole: complete strings are cut as
/// [`cap_long_strings`] cuts them, and a string open at the end that already
/// has more than `max_chars` characters loses everything after them. Then
/// `Some(escaped)`: the caller drops the next bytes up to that string's closing
/// quote (`skip_string` with `escaped`) and goes on from the quote, which
/// gives what [`cap_long_strings`] gives for the whole value.
pub(crate) fn cap_arriving(span: &[u8], max_chars: usize) -> (Cow<'_, [u8]>, Option<bool>) {
    let (capped, open) = cap_complete_strings(span, max_chars);
    let Some(Unterminated { start, escaped }) = open else {
        return (capped, None);
    };
    let content = span.get(start..).unwrap_or_default();
    let cut = cut_after_chars(content, max_chars);
    // Only a cut followed by a whole character's worth of bytes is sure to be
    // where the whole string would be cut (the last character may still be
    // arriving).
    if cut + MAX_CHAR_BYTES > content.len() {
        return (capped, None);
    }
    // The open string is the tail of `span` and of `capped` alike.
    let mut kept = capped.into_owned();
    kept.truncate(kept.len() - (content.len() - cut));
    (Cow::Owned(kept), Some(escaped))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;

    fn capped(span: &str, max_chars: usize) -> String {
        String::from_utf8(cap_long_strings(span.as_bytes(), max_chars).into_owned()).unwrap()
    }

    /// The character-by-character walk the fast path must agree with.
    fn end_of_chars_slowly(content: &[u8], max_chars: usize) -> usize {
        let mut at = 0;
        for _ in 0..max_chars {
            let Some(len) = char_len(content, at) else {
                break;
            };
            at += len;
        }
        at.min(content.len())
    }

    #[test]
    fn fast_cut_agrees_with_the_character_walk() {
        let pieces = [
            "plain ascii ",
            "é",
            "日本",
            "🦀",
            r"\n",
            r"\\",
            r"\u00e9",
            r"\ud83e\udd80",
            r#"\""#,
            "x",
        ];
        // Every sequence of up to four pieces, cut at every length.
        let mut contents = vec![String::new()];
        for _ in 0..4 {
            let longer: Vec<String> = contents
                .iter()
                .flat_map(|c| pieces.iter().map(move |p| format!("{c}{p}")))
                .collect();
            contents.extend(longer);
        }
        contents.sort();
        contents.dedup();
        for content in &contents {
            let bytes = content.as_bytes();
            for max_chars in 0..=bytes.len() + 1 {
                assert_eq!(
                    end_of_chars(bytes, max_chars),
                    end_of_chars_slowly(bytes, max_chars),
                    "{content:?} cut at {max_chars}"
                );
            }
        }
    }

    /// Where the string opening at `span[1]` ends, and what follows it.
    fn after_first_string(span: &[u8]) -> Option<&[u8]> {
        let mut escaped = false;
        skip_string(span, 2, &mut escaped).and_then(|end| span.get(end..))
    }

    #[test]
    fn a_cut_never_leaves_the_closing_quote_escaped() {
        // A malformed escape, and a UTF-8 lead byte before `\"`: the last
        // character kept ends just after a backslash that escapes a quote.
        let cases: [(&[u8], usize, &[u8]); 2] = [
            (br#"["aa\u12a\"bbbb",1]"#, 3, br#"["aa\u12a\"",1]"#),
            (b"[\"a\xc3\\\"bbbb\",1]", 2, b"[\"a\xc3\\\"\",1]"),
        ];
        for (span, max_chars, expected) in cases {
            assert_eq!(cap_long_strings(span, max_chars), expected);
        }
        // Any string of these pieces, cut anywhere, still ends where it did.
        let pieces: [&[u8]; 8] = [
            b"a", b"\\", b"\\\\", b"\\\"", b"\\u", b"1", b"\xc3", b"\xe2",
        ];
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut next = |n: usize| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state % n as u64) as usize
        };
        let mut checked = 0;
        for _ in 0..3000 {
            let mut span = b"[\"".to_vec();
            for _ in 0..next(12) {
                span.extend_from_slice(pieces[next(pieces.len())]);
            }
            span.extend_from_slice(br#"",1]"#);
            if after_first_string(&span) != Some(&br#",1]"#[..]) {
                // A backslash piece before `\"` closed the string early.
                continue;
            }
            checked += 1;
            for max_chars in 0..span.len() {
                let cut = cap_long_strings(&span, max_chars);
                assert_eq!(
                    after_first_string(&cut),
                    Some(&br#",1]"#[..]),
                    "{} cut to {max_chars}: {}",
                    String::from_utf8_lossy(&span),
                    String::from_utf8_lossy(&cut)
                );
            }
        }
        assert!(checked > 1000, "only {checked} strings checked");
    }

    #[test]
    fn long_strings_keep_their_first_characters_and_stay_valid_json() {
        assert_eq!(
            capped(r#"{"a":"abcdef","b":"xy"}"#, 3),
            r#"{"a":"abc","b":"xy"}"#
        );
        assert_eq!(capped(r#"["éàü日本語"]"#, 4), r#"["éàü日"]"#);
        assert_eq!(capped(r#"["a\nb\u00e9c"]"#, 3), r#"["a\nb"]"#);
        assert_eq!(
            capped(r#"["\ud83d\ude00\ud83d\ude01"]"#, 1),
            r#"["\ud83d\ude00"]"#
        );
        assert_eq!(capped(r#"["\"\\\"x",1]"#, 3), r#"["\"\\\"",1]"#);
        // Keys are strings too; numbers and structure are untouched.
        assert_eq!(capped(r#"{"abcd":12345678}"#, 2), r#"{"ab":12345678}"#);
        assert_eq!(capped(r#"{"abc":"d"}"#, 3), r#"{"abc":"d"}"#);
    }

    #[test]
    fn the_cut_text_is_the_first_characters_of_the_whole_text() {
        let texts = [
            "plain ascii text that is long",
            "naïve café 日本語 with “quotes” and \n newlines \t tabs",
            "emoji 😀😁😂 and \u{0010}\u{001f} controls \\ \" ",
        ];
        for text in texts {
            for escape_unicode in [false, true] {
                let mut span = serde_json::to_string(&[text]).unwrap();
                if escape_unicode {
                    span = span
                        .chars()
                        .map(|c| {
                            if c.is_ascii() {
                                c.to_string()
                            } else {
                                let mut units = [0u16; 2];
                                c.encode_utf16(&mut units)
                                    .iter()
                                    .map(|u| format!("\\u{u:04x}"))
                                    .collect()
                            }
                        })
                        .collect();
                }
                for max_chars in 1..=text.chars().count() + 1 {
                    let value: Value = serde_json::from_str(&capped(&span, max_chars)).unwrap();
                    let expected: String = text.chars().take(max_chars).collect();
                    assert_eq!(value[0], expected, "{span} at {max_chars}");
                }
            }
        }
    }

    #[test]
    fn short_and_unterminated_spans_are_borrowed() {
        assert!(matches!(
            cap_long_strings(br#"["ab"]"#, 10),
            Cow::Borrowed(_)
        ));
        assert!(matches!(
            cap_long_strings(br#"["abcdef"#, 2),
            Cow::Borrowed(_)
        ));
    }
}
