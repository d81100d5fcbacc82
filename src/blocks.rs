//! A prompt as LONGEST_PREFIX matches it: the prefix the extractor returned
//! (canonical text or raw bytes, at most `prefix_length`), cut into blocks of
//! `block_bytes` bytes, each block's hash chained to the previous one, the
//! chain seeded with tenant, model and prefix source, so tenants and models
//! never share a chain. `chain[i]` names the whole prefix through block `i`:
//! two prompts share `chain[i]` exactly when their first `i + 1` blocks agree.
//!
//! Also what the decision needs of the prompt's structure (canonical text
//! only; raw bytes have none):
//! - the **opening**: the prompt through its first message that is not a
//!   system (or developer, or `/responses` instructions) message, at most
//!   [`OWN_OPENING_BYTES`] of that message, capped at the prefix. A
//!   conversation's turns all begin with it, a document's questions with
//!   the document (whatever the question after it, so replicas that each
//!   see another question first still agree); a cold prompt is placed by
//!   its hash. Raw bytes: the first [`RAW_OPENING_BYTES`].
//! - the **conversation's start**: where that first own message begins,
//!   after the system messages (a system prompt, shared by many
//!   conversations or by one group's requests), which the fleet may hold
//!   everywhere.
//! - the **history**: the bytes before the prompt's last message, when that
//!   message follows the first own one (a conversation's later turn). Its
//!   earlier turns, answers included, are what the instance that served
//!   them holds in its KV cache, whether or not this Envoy routed them.
//!
//! Blocks are also cut at the conversation's start and at the opening's
//! end, so a conversation's turns share the blocks of their opening however
//! short its first message: a next turn always matches one block past the
//! system messages. (Cut every `block_bytes` only, a first message of a few
//! words ended in a partial block the next turn did not share.)

use xxhash_rust::xxh3::{xxh3_64_with_seed, Xxh3};

use crate::extract::canonical::{ESCAPE, RECORD_END};
use crate::extract::PrefixSource;
use crate::key::KeyMaterial;
use crate::load::SPAN_BLOCKS;

/// The opening of a raw-byte prompt, which has no messages: the first KiB,
/// the fixed prefix that comes nearest the oracle on conversations
/// (`docs/benchmarks.md`).
pub const RAW_OPENING_BYTES: usize = 1024;

/// The most of the first own message the opening takes: enough to tell
/// conversations apart, short enough that questions placed after a
/// document of 500 characters or more open alike.
pub const OWN_OPENING_BYTES: usize = 512;

const DOMAIN_TAG: &[u8] = b"prefix-router/blocks/v1";

/// What a padding entry hashes (chained to the entry before it).
const PADDING_TAG: &[u8] = b"prefix-router/blocks/padding";

/// Leading records that are shared preamble, not the conversation's own.
const PREAMBLE_RECORDS: [&str; 3] = ["role=system\u{1f}", "role=developer\u{1f}", "instructions="];

/// See the module documentation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PromptBlocks {
    /// `chain[i]`: hash of blocks `0..=i` (the last block may be partial).
    pub chain: Vec<u64>,
    /// Bytes per block.
    pub block_bytes: usize,
    /// Bytes of the prefix (so the last block's length is known).
    pub prefix_bytes: usize,
    /// Where blocks are cut besides every `block_bytes`: the start of the
    /// conversation's own text and the end of its opening (canonical text;
    /// zeros for raw bytes). Cut there, a conversation's turns share the
    /// blocks of their opening however short its first message, so a next
    /// turn always matches into the conversation's own text.
    pub cuts: [usize; 2],
    /// (blocks of the system messages, entries after them that stand for no
    /// bytes): the system messages are padded to whole spans of the prefix
    /// index ([`SPAN_BLOCKS`]), so the conversation's own blocks begin a span
    /// of their own. A span's blocks share one bucket; unpadded, every
    /// conversation behind one system prompt put its first own blocks in
    /// the bucket of that prompt's last span, whose entries (the prompt's
    /// holders among them) then evicted each other.
    pub padding: (usize, usize),
    /// Hash of the opening (cold placement ranks instances by it).
    pub opening: u64,
    /// Bytes before the last message, when it follows the first own one (a
    /// conversation's later turn); 0 otherwise and for raw bytes.
    pub history_bytes: usize,
    /// Bytes of the previous turn's prompt (through the message before the
    /// last answer), when [`PromptBlocks::history_bytes`] is not 0; 0
    /// otherwise.
    pub previous_prompt_bytes: usize,
}

impl PromptBlocks {
    /// The blocks of `material.prefix`; `block_bytes` at least 1.
    pub fn new(material: &KeyMaterial<'_>, block_bytes: usize) -> Self {
        let block_bytes = block_bytes.max(1);
        let prefix = material.prefix;
        let seed = chain_seed(material);
        let (start, opening_end, cuts, history_bytes, previous_prompt_bytes) = match material.source
        {
            PrefixSource::CanonicalText => {
                let (start, own_end) = canonical_opening(prefix);
                // Only what follows the first own record is searched.
                let history_bytes = match prefix.get(own_end..) {
                    Some(rest) if !rest.is_empty() => own_end + last_record_start(rest),
                    _ => 0,
                };
                // The previous turn's prompt ends where the record before
                // the last one (its answer) starts, or with the first own
                // record when that answer is the only record between them.
                let previous_prompt_bytes = match prefix.get(own_end..history_bytes) {
                    Some(between) if !between.is_empty() => own_end + last_record_start(between),
                    _ => 0,
                };
                let end = own_end.min(start.saturating_add(OWN_OPENING_BYTES));
                (
                    start,
                    end,
                    [start, end],
                    history_bytes,
                    previous_prompt_bytes,
                )
            }
            PrefixSource::RawBytes => (0, RAW_OPENING_BYTES.min(prefix.len()), [0, 0], 0, 0),
        };
        // The system messages' blocks (none for raw bytes), padded to whole
        // spans of the prefix index when the conversation's own text follows.
        let system_blocks = cuts[0].min(prefix.len()).div_ceil(block_bytes);
        let padding = if system_blocks > 0 && start < prefix.len() {
            (SPAN_BLOCKS - system_blocks % SPAN_BLOCKS) % SPAN_BLOCKS
        } else {
            0
        };
        let mut chain = Vec::with_capacity(prefix.len().div_ceil(block_bytes) + 2 + padding);
        let mut previous = seed;
        for segment in segments(prefix.len(), cuts) {
            if segment.start == start && padding > 0 {
                for _ in 0..padding {
                    previous = xxh3_64_with_seed(PADDING_TAG, previous);
                    chain.push(previous);
                }
            }
            for block in prefix.get(segment).unwrap_or_default().chunks(block_bytes) {
                previous = xxh3_64_with_seed(block, previous);
                chain.push(previous);
            }
        }
        let opening = xxh3_64_with_seed(prefix.get(..opening_end).unwrap_or(prefix), seed);
        PromptBlocks {
            chain,
            block_bytes,
            prefix_bytes: prefix.len(),
            cuts,
            padding: (system_blocks, padding),
            opening,
            history_bytes,
            previous_prompt_bytes,
        }
    }

    /// Bytes of the prefix past the first `matched_bytes`: what sending it to
    /// an instance that held that much adds to what the instance holds.
    pub fn placed_bytes(&self, matched_bytes: usize) -> usize {
        self.prefix_bytes.saturating_sub(matched_bytes)
    }

    /// Bytes of the prefix the first `blocks` blocks cover.
    pub fn bytes_of(&self, blocks: usize) -> usize {
        let (at, padding) = self.padding;
        let mut left = if blocks > at {
            at + blocks.saturating_sub(at + padding)
        } else {
            blocks
        };
        for segment in segments(self.prefix_bytes, self.cuts) {
            let in_segment = segment.len().div_ceil(self.block_bytes);
            if left <= in_segment {
                let covered = left.saturating_mul(self.block_bytes).min(segment.len());
                return segment.start + covered;
            }
            left -= in_segment;
        }
        self.prefix_bytes
    }

    /// True unless this is a conversation's later turn and a match of
    /// `held_bytes` stops short of its previous turn's prompt: then another
    /// replica routed that turn, and this Envoy does not know whether it
    /// moved the conversation. A match of the previous turn's prompt ends
    /// within a block of it (that prompt's last block, partial, differs).
    pub fn previous_turn_held(&self, held_bytes: usize) -> bool {
        held_bytes.saturating_add(self.block_bytes) > self.previous_prompt_bytes
    }

    /// True if a match of `held_blocks` blocks leaves the request adding to
    /// what its holder holds, for the `share` term to weigh moving it: a
    /// conversation's later turn whose previous turn the match reaches
    /// ([`PromptBlocks::previous_turn_held`]), or a single prompt with text
    /// past the match (a new question after a held document). A single
    /// prompt held whole is one sent again: it stays with its holder. Raw
    /// bytes never: without messages, what a match covers may as well be a
    /// preamble every request shares (its hot prefixes move for load only).
    pub fn extends_held(&self, held_blocks: usize) -> bool {
        if self.history_bytes > 0 {
            self.previous_turn_held(self.bytes_of(held_blocks))
        } else {
            self.cuts[0] < self.cuts[1] && held_blocks < self.chain.len()
        }
    }

    /// The key header value for Envoy's fallback (Maglev), should the
    /// host-override header name an instance Envoy does not know: the
    /// opening's hash, so replicas fall back alike.
    pub fn opening_key(&self) -> String {
        format!("{:016x}", self.opening)
    }
}

/// The chain's seed: tenant, model and source, framed as the routing key
/// frames them (`crate::key`), under another domain tag.
fn chain_seed(material: &KeyMaterial<'_>) -> u64 {
    let mut hasher = Xxh3::new();
    hasher.update(DOMAIN_TAG);
    let framing = KeyMaterial {
        prefix: &[],
        ..*material
    };
    crate::key::update_frame(&mut hasher, &framing);
    hasher.digest()
}

/// The byte ranges of a prefix of `len` bytes between `cuts` (ascending,
/// at most `len`; empty ranges dropped), each cut into blocks on its own.
fn segments(len: usize, cuts: [usize; 2]) -> impl Iterator<Item = std::ops::Range<usize>> {
    let first = cuts[0].min(len);
    let second = cuts[1].clamp(first, len);
    [0..first, first..second, second..len]
        .into_iter()
        .filter(|range| !range.is_empty())
}

/// Canonical text: (start of the first own record, end of it), in bytes.
/// Without any own record: (end of the preamble, end of the prefix).
fn canonical_opening(text: &[u8]) -> (usize, usize) {
    let mut start = 0;
    let record_end = RECORD_END as u8;
    let escape = ESCAPE as u8;
    // Jumps from separator to separator (both ASCII, so a byte search is
    // exact): a byte-at-a-time loop cost most of a 4 KiB prefix's blocks.
    let mut at = 0;
    while let Some(found) = text
        .get(at..)
        .and_then(|rest| memchr::memchr2(escape, record_end, rest))
    {
        let i = at + found;
        if text.get(i) == Some(&escape) {
            // The escaped byte is content, whatever it is.
            at = i + 2;
            continue;
        }
        let record = text.get(start..i).unwrap_or_default();
        let preamble = PREAMBLE_RECORDS
            .iter()
            .any(|tag| record.starts_with(tag.as_bytes()));
        if !preamble {
            return (start, i + 1);
        }
        start = i + 1;
        at = i + 1;
    }
    // The prefix ends inside a record: the first own one, or still the
    // preamble (then the conversation starts past the prefix).
    let rest = text.get(start..).unwrap_or_default();
    if PREAMBLE_RECORDS
        .iter()
        .any(|tag| rest.starts_with(tag.as_bytes()))
    {
        return (text.len(), text.len());
    }
    (start.min(text.len()), text.len())
}

/// Canonical text (whole records and a last one, maybe cut short): where
/// its last record begins, 0 for the first. The final byte is left out of
/// the search: a record end there closes the last record.
fn last_record_start(text: &[u8]) -> usize {
    let record_end = RECORD_END as u8;
    let escape = ESCAPE as u8;
    let mut before = text.len().saturating_sub(1);
    while let Some(i) = text
        .get(..before)
        .and_then(|head| memchr::memrchr(record_end, head))
    {
        // Preceded by an odd run of escapes, it is content.
        let escapes = text
            .get(..i)
            .unwrap_or_default()
            .iter()
            .rev()
            .take_while(|&&b| b == escape)
            .count();
        if escapes % 2 == 0 {
            return i + 1;
        }
        before = i;
    }
    0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn canonical(text: &str) -> KeyMaterial<'_> {
        KeyMaterial {
            tenant: None,
            model: Some(b"m"),
            source: PrefixSource::CanonicalText,
            prefix: text.as_bytes(),
        }
    }

    fn record(role: &str, text: &str) -> String {
        format!("role={role}\u{1f}text={text}\u{1f}\u{1e}")
    }

    #[test]
    fn a_short_first_message_is_a_block_every_later_turn_shares() {
        let system = record("system", &"s".repeat(300));
        let first = system.clone() + &record("user", "hi");
        let second =
            first.clone() + &record("assistant", &"a".repeat(400)) + &record("user", "more");
        let (x, y) = (
            PromptBlocks::new(&canonical(&first), 256),
            PromptBlocks::new(&canonical(&second), 256),
        );
        // System (2 blocks: 256 + the rest), padded to a span of 4, then
        // "hi" as a block of its own.
        assert_eq!(x.cuts, [system.len(), first.len()]);
        assert_eq!(x.padding, (2, 2));
        assert_eq!(x.chain.len(), 5);
        assert_eq!(x.chain[..], y.chain[..5]);
        assert_eq!(y.bytes_of(1), 256);
        assert_eq!(y.bytes_of(2), system.len());
        assert_eq!(y.bytes_of(4), system.len(), "padding holds no bytes");
        assert_eq!(y.bytes_of(5), first.len());
        assert_eq!(y.bytes_of(6), first.len() + 256);
        assert_eq!(y.bytes_of(99), second.len());
        // Without own text, or without system messages, nothing is padded.
        let alone = PromptBlocks::new(&canonical(&system), 256);
        assert_eq!((alone.padding, alone.chain.len()), ((2, 0), 2));
        assert_eq!(alone.chain[..], x.chain[..2]);
        let own = PromptBlocks::new(&canonical(&record("user", "hi")), 256);
        assert_eq!((own.padding, own.chain.len()), ((0, 0), 1));
    }

    #[test]
    fn the_history_is_what_precedes_a_later_turns_last_message() {
        let system = record("system", &"s".repeat(300));
        let first = system.clone() + &record("user", "hi");
        let answered = first.clone() + &record("assistant", &"a".repeat(400));
        let second = answered.clone() + &record("user", "more");
        let history = |text: &str| PromptBlocks::new(&canonical(text), 256).history_bytes;
        assert_eq!(history(&first), 0, "a first turn has none");
        assert_eq!(history(&system), 0, "nor system messages alone");
        assert_eq!(history(&second), answered.len());
        assert_eq!(history(&answered), first.len());
        // Cut short inside its last message, the rest before it still counts.
        assert_eq!(history(&second[..second.len() - 3]), answered.len());
        // A record end inside a message's text is escaped content, and an
        // escaped escape before a record end leaves it a record end.
        let escaped = answered.clone() + &record("user", "x\u{10}\u{1e}y");
        assert_eq!(history(&escaped), answered.len());
        let even_escapes = answered.clone() + "role=user\u{1f}text=x\u{10}\u{10}\u{1e}";
        assert_eq!(
            history(&(even_escapes.clone() + &record("user", "z"))),
            even_escapes.len()
        );
        // One message, however long, has no history; raw bytes neither.
        assert_eq!(history(&record("user", &"d".repeat(2000))), 0);
        let raw = KeyMaterial {
            source: PrefixSource::RawBytes,
            ..canonical(&second)
        };
        assert_eq!(PromptBlocks::new(&raw, 256).history_bytes, 0);
    }

    #[test]
    fn a_later_turn_knows_where_its_previous_turns_prompt_ended() {
        let system = record("system", &"s".repeat(300));
        let first = system.clone() + &record("user", &"q".repeat(200));
        let second = first.clone()
            + &record("assistant", &"a".repeat(400))
            + &record("user", &"r".repeat(100));
        let third =
            second.clone() + &record("assistant", &"b".repeat(700)) + &record("user", "and?");
        let blocks = |text: &str| PromptBlocks::new(&canonical(text), 256);
        assert_eq!(blocks(&first).previous_prompt_bytes, 0);
        assert_eq!(blocks(&second).previous_prompt_bytes, first.len());
        assert_eq!(blocks(&third).previous_prompt_bytes, second.len());
        let raw = KeyMaterial {
            source: PrefixSource::RawBytes,
            ..canonical(&third)
        };
        assert_eq!(PromptBlocks::new(&raw, 256).previous_prompt_bytes, 0);
        // What the previous turn left in an index is its whole blocks: the
        // later turn's match of them holds that turn, one block short does
        // not.
        let (previous, later) = (blocks(&second), blocks(&third));
        let shared = previous
            .chain
            .iter()
            .zip(&later.chain)
            .take_while(|(a, b)| a == b)
            .count();
        let held = later.bytes_of(shared);
        assert!(held <= second.len() && held + 256 > second.len(), "{held}");
        assert!(later.previous_turn_held(held));
        assert!(!later.previous_turn_held(later.bytes_of(shared - 1)));
        // A first turn or a single prompt has no previous turn to miss.
        assert!(blocks(&first).previous_turn_held(0));
    }

    #[test]
    fn a_new_question_extends_what_is_held_a_prompt_sent_again_does_not() {
        let document = record("user", &format!("{}\n\nWho wrote it?", "d".repeat(2000)));
        let asked = PromptBlocks::new(&canonical(&document), 256);
        let whole = asked.chain.len();
        // Held whole: the same prompt again.
        assert!(!asked.extends_held(whole));
        // The document held, the question new.
        assert!(asked.extends_held(whole - 1));
        // A later turn: as far as its previous turn is held.
        let first = record("user", &"q".repeat(600));
        let second = first.clone()
            + &record("assistant", &"a".repeat(600))
            + &record("user", &"r".repeat(100));
        let later = PromptBlocks::new(&canonical(&second), 256);
        let of_first = PromptBlocks::new(&canonical(&first), 256).chain.len();
        assert!(later.extends_held(of_first));
        assert!(!later.extends_held(of_first - 2));
        // Raw bytes have no own text to tell from a shared preamble.
        let raw = KeyMaterial {
            source: PrefixSource::RawBytes,
            ..canonical(&document)
        };
        let raw = PromptBlocks::new(&raw, 256);
        assert!(!raw.extends_held(raw.chain.len() - 1));
    }

    #[test]
    fn raw_bytes_are_cut_every_block_only() {
        let bytes = "r".repeat(1100);
        let raw = KeyMaterial {
            source: PrefixSource::RawBytes,
            ..canonical(&bytes)
        };
        let blocks = PromptBlocks::new(&raw, 1000);
        assert_eq!(blocks.cuts, [0, 0]);
        assert_eq!(blocks.chain.len(), 2);
        assert_eq!((blocks.bytes_of(1), blocks.bytes_of(2)), (1000, 1100));
    }

    #[test]
    fn chain_hashes_agree_exactly_on_shared_blocks() {
        let a = "a".repeat(1000) + &"b".repeat(100);
        let b = "a".repeat(1000) + &"c".repeat(100);
        let (x, y) = (
            PromptBlocks::new(&canonical(&a), 256),
            PromptBlocks::new(&canonical(&b), 256),
        );
        assert_eq!(x.chain.len(), 5);
        // Blocks 0..=2 are all 'a'; block 3 holds bytes 768..1024 (232 'a' + 24 other).
        assert_eq!(x.chain[..3], y.chain[..3]);
        assert_ne!(x.chain[3], y.chain[3]);
        assert_ne!(x.chain[4], y.chain[4]);
        // Chained: the same block bytes after a different history differ.
        let z = PromptBlocks::new(&canonical(&("z".repeat(256) + &a[256..])), 256);
        assert_ne!(z.chain[1], x.chain[1]);
        assert_eq!(x.bytes_of(5), 1100);
        assert_eq!(x.bytes_of(2), 512);
    }

    #[test]
    fn tenant_model_and_source_seed_the_chain() {
        let text = "x".repeat(600);
        let base = PromptBlocks::new(&canonical(&text), 256);
        let other_model = KeyMaterial {
            model: Some(b"n"),
            ..canonical(&text)
        };
        let tenant = KeyMaterial {
            tenant: Some(b"t"),
            ..canonical(&text)
        };
        let raw = KeyMaterial {
            source: PrefixSource::RawBytes,
            ..canonical(&text)
        };
        for other in [other_model, tenant, raw] {
            let blocks = PromptBlocks::new(&other, 256);
            for (a, b) in base.chain.iter().zip(&blocks.chain) {
                assert_ne!(a, b);
            }
            assert_ne!(base.opening, blocks.opening);
        }
    }

    #[test]
    fn questions_after_one_document_open_alike_and_other_documents_do_not() {
        let document = "The quarterly report lists revenue by region. ".repeat(20);
        let ask = |doc: &str, question: &str| {
            let text = record("user", &format!("{doc}\n\n{question}"));
            PromptBlocks::new(&canonical(&text), 256).opening
        };
        assert!(document.len() > OWN_OPENING_BYTES);
        assert_eq!(
            ask(&document, "Summarise it."),
            ask(&document, "Which region grew most?")
        );
        let other = document.replacen("quarterly", "annual", 1);
        assert_ne!(
            ask(&document, "Summarise it."),
            ask(&other, "Summarise it.")
        );
        // A short first message is the opening whole.
        assert_ne!(
            ask("Hi.", "What is a KV cache?"),
            ask("Hi.", "Write a haiku.")
        );
    }

    #[test]
    fn the_opening_is_the_prompt_through_the_first_own_message() {
        let system = record("system", &"s".repeat(3000));
        let first = record("user", "What is a KV cache?");
        let turn1 = format!("{system}{first}");
        let turn2 = format!(
            "{turn1}{}{}",
            record("assistant", &"answer ".repeat(80)),
            record("user", "And prefix caching?")
        );
        let (a, b) = (
            PromptBlocks::new(&canonical(&turn1), 256),
            PromptBlocks::new(&canonical(&turn2), 256),
        );
        assert_eq!(a.opening, b.opening);
        // Another conversation behind the same system prompt opens differently.
        let other = format!("{system}{}", record("user", "Write a haiku."));
        assert_ne!(
            PromptBlocks::new(&canonical(&other), 256).opening,
            a.opening
        );
    }

    #[test]
    fn escaped_record_ends_do_not_end_the_opening() {
        // A literal RS inside the system text is escaped: not a record end.
        let system = "role=system\u{1f}text=a\u{10}\u{1e}b\u{1f}\u{1e}";
        let text = format!("{system}{}", record("user", "q"));
        assert_eq!(
            canonical_opening(text.as_bytes()),
            (system.len(), text.len())
        );
        // An escaped escape before RS: the RS is real.
        let system = "role=system\u{1f}text=a\u{10}\u{10}\u{1f}\u{1e}";
        let text = format!("{system}{}", record("user", "q"));
        assert_eq!(canonical_opening(text.as_bytes()).0, system.len());
    }

    /// The opening as a byte-at-a-time scan finds it: the reference the
    /// separator-to-separator search must agree with.
    fn opening_byte_by_byte(text: &[u8]) -> (usize, usize) {
        let (mut start, mut escaped) = (0, false);
        for (i, &byte) in text.iter().enumerate() {
            if escaped {
                escaped = false;
            } else if byte == ESCAPE as u8 {
                escaped = true;
            } else if byte == RECORD_END as u8 {
                let record = &text[start..i];
                if !PREAMBLE_RECORDS
                    .iter()
                    .any(|tag| record.starts_with(tag.as_bytes()))
                {
                    return (start, i + 1);
                }
                start = i + 1;
            }
        }
        let rest = &text[start..];
        if PREAMBLE_RECORDS
            .iter()
            .any(|tag| rest.starts_with(tag.as_bytes()))
        {
            return (text.len(), text.len());
        }
        (start, text.len())
    }

    #[test]
    fn the_opening_search_agrees_with_a_byte_by_byte_scan() {
        // Records of every kind with escapes anywhere (runs of them, before
        // a record end, as the last byte), cut at every length.
        let pieces = [
            "role=system\u{1f}text=",
            "role=developer\u{1f}text=",
            "instructions=",
            "role=user\u{1f}text=",
            "plain words ",
            "\u{10}",
            "\u{10}\u{10}",
            "\u{10}\u{1e}",
            "\u{1f}",
            "\u{1e}",
        ];
        let mut state = 0x2545_f491_4f6c_dd1d_u64;
        for _ in 0..400 {
            let mut text = String::new();
            for _ in 0..12 {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                text.push_str(pieces[(state % pieces.len() as u64) as usize]);
            }
            let bytes = text.as_bytes();
            for cut in 0..=bytes.len() {
                let prefix = &bytes[..cut];
                assert_eq!(
                    canonical_opening(prefix),
                    opening_byte_by_byte(prefix),
                    "{:?}",
                    String::from_utf8_lossy(prefix)
                );
            }
        }
    }

    #[test]
    fn responses_instructions_and_developer_messages_are_preamble() {
        let text = format!(
            "instructions=be brief\u{1f}\u{1e}{}{}",
            record("developer", "rules"),
            record("user", "hi")
        );
        let start = text.len() - record("user", "hi").len();
        assert_eq!(canonical_opening(text.as_bytes()), (start, text.len()));
    }

    #[test]
    fn raw_prompts_open_with_their_first_kib() {
        let body = "r".repeat(5000);
        let material = KeyMaterial {
            source: PrefixSource::RawBytes,
            ..canonical(&body)
        };
        let a = PromptBlocks::new(&material, 256);
        let longer = body.clone() + "more";
        let b = PromptBlocks::new(
            &KeyMaterial {
                source: PrefixSource::RawBytes,
                ..canonical(&longer)
            },
            256,
        );
        assert_eq!(a.opening, b.opening);
    }

    #[test]
    fn empty_and_short_prompts() {
        let empty = PromptBlocks::new(&canonical(""), 256);
        assert!(empty.chain.is_empty());
        let short = PromptBlocks::new(&canonical("hi"), 256);
        assert_eq!(short.chain.len(), 1);
    }

    #[test]
    fn golden_chain_never_changes() {
        // Pinned: a change here makes every index entry unreachable at once.
        let blocks = PromptBlocks::new(&canonical(&record("user", "hello")), 256);
        assert_eq!(blocks.chain.len(), 1);
        assert_eq!(format!("{:016x}", blocks.chain[0]), "9ee203ba6dda3bc9");
    }
}
