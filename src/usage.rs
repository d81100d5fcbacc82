//! What an engine reports it found cached: `prompt_tokens` and
//! `prompt_tokens_details.cached_tokens` of a response's top-level `usage`
//! (vLLM with `--enable-prompt-tokens-details`), read from the response body
//! in the chunks Envoy delivers, without buffering or altering it.
//!
//! A non-streaming response is one JSON object; a streamed one is
//! `text/event-stream`, whose last `data:` event with a non-null `usage`
//! counts (vLLM sends it when the request set `stream_options.include_usage`
//! or the server runs with `--enable-force-include-usage`).
//!
//! The scanner is a byte-at-a-time state machine with fixed-size state (no
//! carry-over: any split of the body gives the same result); inside strings
//! it skips to the next quote or backslash with memchr. Only keys directly in
//! the top-level object, its `usage` and that one's `prompt_tokens_details`
//! are read, so a `"usage"` inside message content or a nested object never
//! matches. A key written with escapes (`"\u0075sage"`) is not recognised.
//! Malformed, truncated or hostile bodies give no usage, never a panic.

pub mod check;

/// What one response reported.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: u64,
    /// `None` when the usage has no `prompt_tokens_details.cached_tokens`
    /// (unknown, not zero: the engine may not report it).
    pub cached_tokens: Option<u64>,
}

/// How the body is framed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Framing {
    /// One JSON value (`application/json`).
    Json,
    /// Server-sent events (`text/event-stream`), one JSON value per event.
    EventStream,
}

impl Framing {
    /// From the response's `content-type`: event stream if it says so,
    /// JSON otherwise.
    pub fn of_content_type(content_type: Option<&[u8]>) -> Framing {
        let event_stream = content_type.is_some_and(|value| {
            value
                .get(..17)
                .is_some_and(|head| head.eq_ignore_ascii_case(b"text/event-stream"))
        });
        if event_stream {
            Framing::EventStream
        } else {
            Framing::Json
        }
    }
}

/// The longest key the scanner compares (`prompt_tokens_details`).
const KEY_CAPACITY: usize = 21;

/// The key whose value comes next, in a tracked object.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Target {
    /// `usage`, in the top-level object.
    Usage,
    /// `prompt_tokens`, in `usage`.
    PromptTokens,
    /// `prompt_tokens_details`, in `usage`.
    Details,
    /// `cached_tokens`, in `prompt_tokens_details`.
    CachedTokens,
}

/// Where one JSON value's scan stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Progress {
    /// Nothing but whitespace yet.
    Before,
    /// Inside the top-level object.
    Inside,
    /// The top-level object closed.
    Complete,
    /// Not a JSON object, or malformed: no usage from this value.
    Failed,
}

/// Scans one JSON value for its top-level `usage`.
#[derive(Debug, Clone)]
struct ValueScan {
    progress: Progress,
    /// Containers open (the top-level object is depth 1).
    depth: u32,
    /// How many of the innermost open objects, from the top level, are
    /// followed: 1 the top-level object, 2 its `usage`, 3 `usage`'s
    /// `prompt_tokens_details`. Keys are read only at `depth == tracked`.
    tracked: u32,
    in_string: bool,
    escaped: bool,
    /// The next string in the followed object is a key.
    expect_key: bool,
    /// The key being read (`key_len > KEY_CAPACITY`: too long to matter).
    key: [u8; KEY_CAPACITY],
    key_len: usize,
    reading_key: bool,
    /// A key just read whose value matters, waiting for its `:`, then its value.
    after_key: Option<Target>,
    pending: Option<Target>,
    /// An integer value being read, and for what (`None` inside: not a
    /// non-negative integer that fits in u64).
    number: Option<(Target, Option<u64>)>,
    /// The usage being read, and the last complete one.
    prompt_tokens: Option<u64>,
    cached_tokens: Option<u64>,
    usage: Option<Usage>,
}

impl ValueScan {
    fn new() -> Self {
        ValueScan {
            progress: Progress::Before,
            depth: 0,
            tracked: 0,
            in_string: false,
            escaped: false,
            expect_key: false,
            key: [0; KEY_CAPACITY],
            key_len: 0,
            reading_key: false,
            after_key: None,
            pending: None,
            number: None,
            prompt_tokens: None,
            cached_tokens: None,
            usage: None,
        }
    }

    /// The usage of a complete value.
    fn result(&self) -> Option<Usage> {
        match self.progress {
            Progress::Complete => self.usage,
            _ => None,
        }
    }

    /// Scans `bytes` up to (not including) a byte `stop` says ends the
    /// value's text (an event stream's line end, outside strings); returns
    /// how many bytes it consumed.
    fn feed(&mut self, bytes: &[u8], stop_at_newline: bool) -> usize {
        let mut i = 0;
        while let Some(&byte) = bytes.get(i) {
            if self.progress == Progress::Failed {
                // Nothing more to learn from this value: skip to its end.
                if !stop_at_newline {
                    return bytes.len();
                }
                return i + memchr::memchr2(b'\n', b'\r', bytes.get(i..).unwrap_or_default())
                    .unwrap_or(bytes.len() - i);
            }
            if self.in_string {
                i += self.string_bytes(bytes.get(i..).unwrap_or_default(), stop_at_newline);
                continue;
            }
            if stop_at_newline && (byte == b'\n' || byte == b'\r') {
                return i;
            }
            self.structural(byte);
            i += 1;
        }
        i
    }

    /// An event stream's data line ended: whitespace between tokens, but
    /// inside a string the value is malformed.
    fn line_break(&mut self) {
        if self.in_string {
            self.progress = Progress::Failed;
        } else {
            self.feed(b" ", true);
        }
    }

    /// Inside a string: consumes up to and including its closing quote, or
    /// all of `bytes`; stops before a raw line end in an event stream (the
    /// value is then malformed).
    fn string_bytes(&mut self, bytes: &[u8], stop_at_newline: bool) -> usize {
        let mut i = 0;
        loop {
            if self.escaped {
                let Some(&byte) = bytes.get(i) else {
                    return i;
                };
                self.escaped = false;
                // An escaped key is never one of ours.
                self.key_len = KEY_CAPACITY + 1;
                if stop_at_newline && (byte == b'\n' || byte == b'\r') {
                    self.progress = Progress::Failed;
                    return i;
                }
                i += 1;
            }
            let rest = bytes.get(i..).unwrap_or_default();
            let found = if stop_at_newline {
                // A raw line end (`\n` or `\r`) ends the event's line.
                let stop = memchr::memchr3(b'"', b'\\', b'\n', rest);
                let run = rest.get(..stop.unwrap_or(rest.len())).unwrap_or_default();
                memchr::memchr(b'\r', run).or(stop)
            } else {
                memchr::memchr2(b'"', b'\\', rest)
            };
            let Some(at) = found else {
                self.take_key_bytes(rest);
                return bytes.len();
            };
            self.take_key_bytes(rest.get(..at).unwrap_or_default());
            i += at;
            match bytes.get(i) {
                Some(b'"') => {
                    self.in_string = false;
                    self.end_string();
                    return i + 1;
                }
                Some(b'\\') => {
                    self.escaped = true;
                    i += 1;
                }
                _ => {
                    self.progress = Progress::Failed;
                    return i;
                }
            }
        }
    }

    fn take_key_bytes(&mut self, bytes: &[u8]) {
        if !self.reading_key || bytes.is_empty() {
            return;
        }
        let end = self.key_len.saturating_add(bytes.len());
        match self.key.get_mut(self.key_len..end) {
            Some(slot) => slot.copy_from_slice(bytes),
            None => {
                self.key_len = KEY_CAPACITY + 1;
                return;
            }
        }
        self.key_len = end;
    }

    fn end_string(&mut self) {
        if !self.reading_key {
            return;
        }
        self.reading_key = false;
        let key = self.key.get(..self.key_len).unwrap_or_default();
        self.after_key = match (self.tracked, key) {
            (1, b"usage") => Some(Target::Usage),
            (2, b"prompt_tokens") => Some(Target::PromptTokens),
            (2, b"prompt_tokens_details") => Some(Target::Details),
            (3, b"cached_tokens") => Some(Target::CachedTokens),
            _ => None,
        };
    }

    /// One byte outside strings.
    fn structural(&mut self, byte: u8) {
        if let Some((target, value)) = self.number {
            match byte {
                b'0'..=b'9' => {
                    let digit = u64::from(byte - b'0');
                    let value = value.and_then(|v| v.checked_mul(10)?.checked_add(digit));
                    self.number = Some((target, value));
                    return;
                }
                b'-' | b'+' | b'.' | b'e' | b'E' => {
                    self.number = Some((target, None));
                    return;
                }
                _ => {
                    self.number = None;
                    match target {
                        Target::PromptTokens => self.prompt_tokens = value,
                        Target::CachedTokens => self.cached_tokens = value,
                        Target::Usage | Target::Details => {}
                    }
                }
            }
        }
        if self.progress == Progress::Complete {
            if !byte.is_ascii_whitespace() {
                self.progress = Progress::Failed;
            }
            return;
        }
        if self.progress == Progress::Before {
            match byte {
                b'{' => {
                    self.progress = Progress::Inside;
                    self.depth = 1;
                    self.tracked = 1;
                    self.expect_key = true;
                }
                _ if byte.is_ascii_whitespace() => {}
                _ => self.progress = Progress::Failed,
            }
            return;
        }
        let at_tracked = self.depth == self.tracked;
        match byte {
            b'"' => {
                self.in_string = true;
                if at_tracked && self.expect_key {
                    self.expect_key = false;
                    self.reading_key = true;
                    self.key_len = 0;
                }
                self.pending = None;
            }
            b':' => {
                if at_tracked {
                    self.pending = self.after_key.take();
                }
            }
            b',' => {
                if at_tracked {
                    self.expect_key = true;
                    self.after_key = None;
                    self.pending = None;
                }
            }
            b'{' => {
                let pending = self.pending.take();
                if at_tracked {
                    match pending {
                        Some(Target::Usage) => {
                            self.tracked = 2;
                            self.prompt_tokens = None;
                            self.cached_tokens = None;
                        }
                        Some(Target::Details) => self.tracked = 3,
                        _ => {}
                    }
                }
                self.depth = self.depth.saturating_add(1);
                self.expect_key = self.depth == self.tracked;
            }
            b'[' => {
                self.pending = None;
                self.depth = self.depth.saturating_add(1);
            }
            b'}' | b']' => {
                if at_tracked {
                    if byte == b']' {
                        self.progress = Progress::Failed;
                        return;
                    }
                    if self.tracked == 2 {
                        // The usage closes: it counts if it had its tokens.
                        if let Some(prompt_tokens) = self.prompt_tokens {
                            self.usage = Some(Usage {
                                prompt_tokens,
                                cached_tokens: self.cached_tokens,
                            });
                        }
                    }
                    self.tracked -= 1;
                }
                self.depth = self.depth.saturating_sub(1);
                self.pending = None;
                if self.depth == 0 {
                    self.progress = Progress::Complete;
                }
            }
            b'0'..=b'9' => {
                if let Some(target @ (Target::PromptTokens | Target::CachedTokens)) =
                    self.pending.take()
                {
                    self.number = Some((target, Some(u64::from(byte - b'0'))));
                }
            }
            _ if byte.is_ascii_whitespace() => {}
            // The rest of a number or literal (`null`: no value).
            _ => self.pending = None,
        }
    }
}

/// Where an event stream's line stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Line {
    /// At its start: `matched` bytes of `data:` seen.
    Field { matched: u8 },
    /// After `data:`: the optional space not yet seen.
    DataStart,
    /// In a `data:` line's value.
    Data,
    /// A line of another field, or a comment.
    Skip,
}

/// The response body scanner. See the module documentation.
#[derive(Debug, Clone)]
pub struct UsageScanner {
    framing: Framing,
    value: ValueScan,
    /// Event stream: the line, whether the event has data, and the last
    /// usage an event reported.
    line: Line,
    event_has_data: bool,
    /// The previous line ended with `\r` (a `\n` next ends no other line).
    after_cr: bool,
    last_event_usage: Option<Usage>,
}

impl UsageScanner {
    pub fn new(framing: Framing) -> Self {
        UsageScanner {
            framing,
            value: ValueScan::new(),
            line: Line::Field { matched: 0 },
            event_has_data: false,
            after_cr: false,
            last_event_usage: None,
        }
    }

    /// The next chunk of the body.
    pub fn feed(&mut self, chunk: &[u8]) {
        match self.framing {
            Framing::Json => {
                self.value.feed(chunk, false);
            }
            Framing::EventStream => self.feed_events(chunk),
        }
    }

    /// At the end of the body: what it reported (`None` if no usage, or a
    /// malformed or truncated body).
    pub fn finish(mut self) -> Option<Usage> {
        match self.framing {
            Framing::Json => self.value.result(),
            Framing::EventStream => {
                // A stream may end without the blank line after its last event.
                self.end_event();
                self.last_event_usage
            }
        }
    }

    fn feed_events(&mut self, chunk: &[u8]) {
        let mut i = 0;
        while let Some(rest) = chunk.get(i..).filter(|rest| !rest.is_empty()) {
            let at_event_start =
                self.line == (Line::Field { matched: 0 }) && !self.event_has_data && !self.after_cr;
            let skipped = if at_event_start {
                events_without_usage(rest)
            } else {
                0
            };
            i += match rest.get(skipped..) {
                Some(rest) if !rest.is_empty() => skipped + self.step(rest),
                _ => skipped.max(1).min(rest.len()),
            };
        }
    }

    /// Consumes the start of `rest` (not empty): one byte, or a run a
    /// memchr finds; returns how many bytes.
    fn step(&mut self, rest: &[u8]) -> usize {
        let Some(&byte) = rest.first() else {
            return 0;
        };
        if byte == b'\n' || byte == b'\r' {
            let crlf = byte == b'\n' && self.after_cr;
            self.after_cr = byte == b'\r';
            if !crlf {
                self.end_line();
            }
            return 1;
        }
        self.after_cr = false;
        match self.line {
            Line::Field { matched } => {
                let at = usize::from(matched);
                self.line = match b"data:".get(at) {
                    Some(&expected) if expected == byte && at + 1 == 5 => Line::DataStart,
                    Some(&expected) if expected == byte => Line::Field {
                        matched: matched + 1,
                    },
                    _ => Line::Skip,
                };
                1
            }
            Line::DataStart => {
                self.line = Line::Data;
                self.event_has_data = true;
                usize::from(byte == b' ')
            }
            Line::Data => self.value.feed(rest, true),
            Line::Skip => memchr::memchr2(b'\n', b'\r', rest).unwrap_or(rest.len()),
        }
    }

    fn end_line(&mut self) {
        match self.line {
            // A blank line ends the event.
            Line::Field { matched: 0 } => self.end_event(),
            Line::DataStart => self.event_has_data = true,
            // Data lines of one event join with a line feed: JSON whitespace.
            Line::Data => self.value.line_break(),
            Line::Field { .. } | Line::Skip => {}
        }
        self.line = Line::Field { matched: 0 };
    }

    fn end_event(&mut self) {
        if self.event_has_data {
            if let Some(usage) = self.value.result() {
                self.last_event_usage = Some(usage);
            }
        }
        self.event_has_data = false;
        self.value = ValueScan::new();
    }
}

/// How many bytes at the start of `events` (at an event's start) are whole
/// events, each ended by a blank line, before the first `"usage"` that may
/// open an object: events that report nothing, whatever their chunking.
fn events_without_usage(events: &[u8]) -> usize {
    let mut until = events.len();
    for at in memchr::memmem::find_iter(events, b"\"usage\"") {
        let after = events.get(at + 7..).unwrap_or_default();
        let mut value = after.iter().filter(|b| !b.is_ascii_whitespace());
        // Certainly not a usage object: a string value ends there, or the
        // key's value starts as no object does (`null` above all). Anything
        // else, a line break into another data line included, may be one.
        let certainly_not = match (value.next(), value.next()) {
            (Some(b',' | b'}' | b']'), _) => true,
            (Some(b':'), Some(second)) => {
                matches!(
                    second,
                    b'n' | b'"' | b'[' | b't' | b'f' | b'-' | b'0'..=b'9'
                )
            }
            _ => false,
        };
        let object = !certainly_not;
        if object {
            until = at;
            break;
        }
    }
    let head = events.get(..until).unwrap_or_default();
    // The last blank line: `\n\n`, or `\n\r\n` with CRLF line ends.
    let lf = memchr::memmem::rfind(head, b"\n\n").map(|at| at + 2);
    let crlf = memchr::memmem::rfind(head, b"\n\r\n").map(|at| at + 3);
    lf.max(crlf).unwrap_or(0)
}

/// The usage in a whole body, for tests and fuzzing.
pub fn scan(framing: Framing, body: &[u8]) -> Option<Usage> {
    let mut scanner = UsageScanner::new(framing);
    scanner.feed(body);
    scanner.finish()
}

#[cfg(test)]
mod tests;
