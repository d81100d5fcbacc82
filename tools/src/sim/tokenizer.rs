//! A deterministic stand-in for a BPE tokenizer, so that the simulator can
//! count tokens and form 16-token KV blocks without shipping a real
//! vocabulary.
//!
//! The approximation follows the shape of GPT/Llama pre-tokenisation, then
//! charges about 4 bytes per token, the usual figure for English under
//! Llama 3's tokenizer:
//! - the input is split into pieces: a word (a run of ASCII letters/digits or
//!   non-ASCII bytes) with at most one leading space, a punctuation run with
//!   at most one leading space, or a run of other whitespace (a space that
//!   directly precedes a word or punctuation goes with it, as in GPT-2);
//! - a piece of `n` bytes is `ceil(n / 4)` tokens, its consecutive 4-byte
//!   chunks; each token's id is a hash of its chunk, so equal text gives equal
//!   ids and different text almost surely different ids.
//!
//! Consequences the load generator relies on: " the" is one token, " house"
//! two; concatenating texts that meet at a piece boundary (e.g. after a
//! newline, or rendered between special tokens) concatenates their tokens.
//! Tokenisation works on bytes, so any body, valid UTF-8 or not, has tokens.

use xxhash_rust::xxh3::xxh3_64;

/// A token id. Ordinary tokens are below [`SPECIAL_BASE`], like a 128k vocabulary.
pub type TokenId = u32;

/// Ids at and above this are special tokens (chat template markers).
pub const SPECIAL_BASE: TokenId = 128_000;
/// `<|begin_of_text|>`
pub const BOS: TokenId = SPECIAL_BASE;
/// `<|start_header_id|>`
pub const START_HEADER: TokenId = SPECIAL_BASE + 6;
/// `<|end_header_id|>`
pub const END_HEADER: TokenId = SPECIAL_BASE + 7;
/// `<|eot_id|>`
pub const EOT: TokenId = SPECIAL_BASE + 9;
/// Stands for a non-text content part (an image, an audio clip) in a chat message.
pub const MEDIA_PART: TokenId = SPECIAL_BASE + 256;

/// Bytes per token inside one piece.
pub const BYTES_PER_TOKEN: usize = 4;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Class {
    Word,
    Space,
    OtherSpace,
    Punct,
}

fn class(b: u8) -> Class {
    match b {
        b' ' => Class::Space,
        b'\n' | b'\r' | b'\t' | 0x0b | 0x0c => Class::OtherSpace,
        b if b.is_ascii_alphanumeric() || b >= 0x80 => Class::Word,
        _ => Class::Punct,
    }
}

/// Splits `bytes` into pre-tokenisation pieces (see the module doc).
pub fn pieces(bytes: &[u8]) -> Vec<&[u8]> {
    let mut out = Vec::new();
    let mut start = 0;
    while start < bytes.len() {
        let first = class(bytes[start]);
        let mut end = start + 1;
        match first {
            Class::Space
                if end < bytes.len() && matches!(class(bytes[end]), Class::Word | Class::Punct) =>
            {
                let run = class(bytes[end]);
                end += 1;
                while end < bytes.len() && class(bytes[end]) == run {
                    end += 1;
                }
            }
            Class::Word | Class::Punct => {
                while end < bytes.len() && class(bytes[end]) == first {
                    end += 1;
                }
            }
            Class::Space | Class::OtherSpace => {
                while end < bytes.len()
                    && matches!(class(bytes[end]), Class::Space | Class::OtherSpace)
                {
                    end += 1;
                }
                // Leave a final space to the word or punctuation that follows.
                if end < bytes.len() && end - start > 1 && bytes[end - 1] == b' ' {
                    end -= 1;
                }
            }
        }
        out.push(&bytes[start..end]);
        start = end;
    }
    out
}

/// The token ids of `text`.
pub fn tokenize(text: &[u8]) -> Vec<TokenId> {
    let mut ids = Vec::with_capacity(text.len() / BYTES_PER_TOKEN + 1);
    for piece in pieces(text) {
        for chunk in piece.chunks(BYTES_PER_TOKEN) {
            ids.push((xxh3_64(chunk) % u64::from(SPECIAL_BASE)) as TokenId);
        }
    }
    ids
}

/// How many tokens `text` has, without materialising them.
pub fn count_tokens(text: &[u8]) -> usize {
    pieces(text)
        .iter()
        .map(|p| p.len().div_ceil(BYTES_PER_TOKEN))
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_text_same_tokens_and_different_text_differs() {
        let a = tokenize(b"The quick brown fox jumps over the lazy dog.");
        let b = tokenize(b"The quick brown fox jumps over the lazy dog.");
        let c = tokenize(b"The quick brown fox jumps over the lazy cat.");
        assert_eq!(a, b);
        assert_ne!(a, c);
        // Only the differing word's tokens differ.
        assert_eq!(a[..a.len() - 2], c[..c.len() - 2]);
    }

    #[test]
    fn pieces_attach_one_leading_space() {
        let p: Vec<&[u8]> = pieces(b"Hi  there, you!\n\nok");
        let expected: Vec<&[u8]> =
            vec![b"Hi", b" ", b" there", b",", b" you", b"!", b"\n\n", b"ok"];
        assert_eq!(p, expected);
    }

    #[test]
    fn about_four_bytes_per_token_within_a_piece() {
        assert_eq!(count_tokens(b" the"), 1);
        assert_eq!(count_tokens(b" house"), 2);
        assert_eq!(count_tokens(b"internationalization"), 5);
        assert_eq!(count_tokens(b""), 0);
        let text = b"Tokenisation is deterministic, byte based and cheap.";
        assert_eq!(count_tokens(text), tokenize(text).len());
    }

    #[test]
    fn concatenation_at_a_newline_concatenates_tokens() {
        let a = b"first line of text\n".to_vec();
        let b = b"second line".to_vec();
        let joined = [a.clone(), b.clone()].concat();
        assert_eq!(tokenize(&joined), [tokenize(&a), tokenize(&b)].concat());
    }

    #[test]
    fn arbitrary_bytes_tokenize_and_stay_below_special_ids() {
        let bytes: Vec<u8> = (0..=255u8).cycle().take(3000).collect();
        let ids = tokenize(&bytes);
        assert_eq!(ids.len(), count_tokens(&bytes));
        assert!(ids.iter().all(|&t| t < SPECIAL_BASE));
        assert_eq!(ids, tokenize(&bytes));
    }
}
