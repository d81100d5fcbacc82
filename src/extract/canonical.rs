//! The canonical text a routing prefix is cut from, built field by field.
//!
//! The format (see the module doc of `extract` for the full grammar) is a
//! sequence of records ended by RS (U+001E); a record is a sequence of fields
//! `tag=value` ended by US (U+001F). Inside a value, the three control
//! characters DLE (U+0010), US and RS are preceded by DLE, so no value can fake
//! a separator and two different conversations never share a text.
//!
//! Everything is capped at the prefix length in characters: whatever lies past
//! it can never be part of a key, so it is never stored.

/// Ends a field (`tag=value`).
pub(crate) const FIELD_END: char = '\u{1f}';
/// Ends a record (one message, prompt or item).
pub(crate) const RECORD_END: char = '\u{1e}';
/// Precedes a literal DLE, US or RS inside a value.
pub(crate) const ESCAPE: char = '\u{10}';

fn needs_escape(c: char) -> bool {
    matches!(c, ESCAPE | FIELD_END | RECORD_END)
}

/// One part of the canonical text (e.g. `/responses` has `instructions` then
/// `input`, which may arrive in the other order), capped at `limit` chars.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Section {
    text: String,
    chars: usize,
    limit: usize,
    /// No more text will be added (its value ended, or the body did).
    pub(crate) complete: bool,
}

impl Section {
    pub(crate) fn new(limit: usize) -> Self {
        Section {
            text: String::new(),
            chars: 0,
            limit,
            complete: false,
        }
    }

    pub(crate) fn chars(&self) -> usize {
        self.chars
    }

    pub(crate) fn text(&self) -> &str {
        &self.text
    }

    pub(crate) fn is_full(&self) -> bool {
        self.chars >= self.limit
    }

    fn push_char(&mut self, c: char) {
        if !self.is_full() {
            self.text.push(c);
            self.chars += 1;
        }
    }

    /// Appends structural text (tags, separators, digits) that needs no escaping.
    pub(crate) fn push_plain(&mut self, s: &str) {
        for c in s.chars() {
            if self.is_full() {
                return;
            }
            self.push_char(c);
        }
    }

    /// Appends a value, escaping separator characters, up to the cap.
    pub(crate) fn push_escaped(&mut self, s: &str) {
        let room = self.limit.saturating_sub(self.chars);
        if room == 0 {
            return;
        }
        // The value's first `room` characters: bytes >= chars, so a value of
        // at most `room` bytes fits whole, and an ASCII head (the usual
        // prompt text) has one character per byte.
        let head = if s.len() <= room {
            s
        } else if s.as_bytes().get(..room).is_some_and(<[u8]>::is_ascii) {
            s.get(..room).unwrap_or(s)
        } else {
            match s.char_indices().nth(room) {
                Some((cut, _)) => s.get(..cut).unwrap_or(s),
                None => s,
            }
        };
        // Common case: nothing to escape, so the head is copied whole. The
        // separators are ASCII, so a byte search is exact (and memchr's
        // SIMD search beats a byte loop several times over).
        if memchr::memchr3(0x10, 0x1e, 0x1f, head.as_bytes()).is_none() {
            self.text.push_str(head);
            self.chars += head.chars().count();
            return;
        }
        for c in s.chars() {
            if self.is_full() {
                return;
            }
            if needs_escape(c) {
                self.push_char(ESCAPE);
            }
            self.push_char(c);
        }
    }

    /// Appends a decimal number (token ids).
    pub(crate) fn push_number(&mut self, n: u64) {
        let mut digits = [0u8; 20];
        let mut len = 0;
        let mut rest = n;
        loop {
            if let Some(slot) = digits.get_mut(len) {
                *slot = b'0' + (rest % 10) as u8;
            }
            len += 1;
            rest /= 10;
            if rest == 0 || len >= digits.len() {
                break;
            }
        }
        for &d in digits.iter().take(len).rev() {
            self.push_char(char::from(d));
        }
    }

    /// Appends a whole `tag=value` field.
    pub(crate) fn field(&mut self, tag: &str, value: &str) {
        self.push_plain(tag);
        self.push_char('=');
        self.push_escaped(value);
        self.push_char(FIELD_END);
    }

    pub(crate) fn end_field(&mut self) {
        self.push_char(FIELD_END);
    }

    pub(crate) fn end_record(&mut self) {
        self.push_char(RECORD_END);
    }
}

/// The sections of one request's canonical text, in canonical order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct CanonicalText {
    sections: Vec<Section>,
    limit: usize,
}

impl CanonicalText {
    pub(crate) fn new(section_count: usize, limit: usize) -> Self {
        CanonicalText {
            sections: vec![Section::new(limit); section_count],
            limit,
        }
    }

    pub(crate) fn section(&mut self, index: usize) -> Option<&mut Section> {
        self.sections.get_mut(index)
    }

    pub(crate) fn sections(&self) -> &[Section] {
        &self.sections
    }

    pub(crate) fn complete_all(&mut self) {
        for section in &mut self.sections {
            section.complete = true;
        }
    }

    /// The first `limit` characters are known: every section before the cut
    /// is complete, whatever follows cannot change them.
    pub(crate) fn prefix_known(&self) -> bool {
        let mut total = 0usize;
        for section in &self.sections {
            total = total.saturating_add(section.chars());
            if total >= self.limit {
                return true;
            }
            if !section.complete {
                return false;
            }
        }
        true
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.sections.iter().all(|s| s.chars() == 0)
    }

    /// The first `limit` characters of the concatenated sections, as UTF-8,
    /// and how many characters that is.
    pub(crate) fn prefix(&self) -> (Vec<u8>, usize) {
        let mut out = Vec::new();
        let mut chars = 0usize;
        for section in &self.sections {
            let room = self.limit.saturating_sub(chars);
            if room == 0 {
                break;
            }
            let text = section.text();
            if section.chars() <= room {
                chars += section.chars();
                out.extend_from_slice(text.as_bytes());
                continue;
            }
            // Cut after `room` characters, on a character boundary.
            let taken = match text.char_indices().nth(room) {
                Some((cut, _)) => text.get(..cut).unwrap_or(text),
                None => text,
            };
            chars += taken.chars().count();
            out.extend_from_slice(taken.as_bytes());
        }
        (out, chars)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn separators_inside_values_are_escaped() {
        let mut s = Section::new(100);
        s.field("text", "a\u{1f}b\u{1e}c\u{10}d");
        assert_eq!(
            s.text(),
            "text=a\u{10}\u{1f}b\u{10}\u{1e}c\u{10}\u{10}d\u{1f}"
        );
    }

    #[test]
    fn cap_counts_characters_not_bytes() {
        let mut s = Section::new(7);
        s.field("text", "ééé");
        assert_eq!(s.text(), "text=éé");
        assert_eq!(s.chars(), 7);
        s.field("text", "more");
        assert_eq!(s.text(), "text=éé");
    }

    #[test]
    fn a_long_value_is_cut_at_the_cap_with_escapes_counted() {
        // Separator past the cap: copied whole up to the cap.
        let mut s = Section::new(8);
        s.push_escaped("abcdéfghij\u{1f}");
        assert_eq!(s.text(), "abcdéfgh");
        // Separator before the cap: its escape takes a character.
        let mut s = Section::new(8);
        s.push_escaped("abc\u{1f}défghij");
        assert_eq!(s.text(), "abc\u{10}\u{1f}déf");
        assert_eq!(s.chars(), 8);
    }

    #[test]
    fn numbers_render_in_decimal() {
        let mut s = Section::new(100);
        for n in [0, 7, 10, 1234567890, u64::MAX] {
            s.push_number(n);
            s.push_plain(" ");
        }
        assert_eq!(s.text(), "0 7 10 1234567890 18446744073709551615 ");
    }

    #[test]
    fn prefix_spans_sections_and_waits_for_incomplete_ones() {
        let mut t = CanonicalText::new(2, 4);
        t.section(1).unwrap().push_plain("cdef");
        assert!(!t.prefix_known(), "section 0 may still come");
        t.section(0).unwrap().push_plain("ab");
        assert!(!t.prefix_known());
        t.section(0).unwrap().complete = true;
        assert!(t.prefix_known());
        assert_eq!(t.prefix(), (b"abcd".to_vec(), 4));
    }
}
