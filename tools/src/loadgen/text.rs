//! Seeded, realistic-looking prompt text with an exact token count under the
//! simulator's tokenizer, so workloads hit their intended prompt lengths and
//! shared prefixes are exactly as long as specified.
//!
//! Text is sentences of common English words, capitalised and ending with a
//! full stop. Every word but the text's first carries a leading space, so
//! pieces never merge across words; the last word is picked to land exactly
//! on the requested count (one-token words always exist). Parts of a prompt
//! joined with "\n\n" tokenize as the sum of their parts.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::sim::tokenizer::count_tokens;

/// Common English words, short and long, so text looks like prose and costs
/// 1 to 4 tokens per word.
#[rustfmt::skip]
const WORDS: &[&str] = &[
    "the", "of", "and", "to", "in", "is", "it", "for", "on", "as", "with", "was", "that", "by",
    "this", "from", "are", "be", "at", "or", "an", "have", "not", "which", "their", "will",
    "can", "all", "has", "more", "one", "new", "when", "also", "been", "would", "into", "other",
    "than", "time", "only", "some", "could", "these", "two", "may", "first", "then", "about",
    "any", "like", "over", "such", "our", "what", "most", "after", "very", "system", "model",
    "request", "cache", "memory", "server", "prefix", "token", "latency", "cluster", "routing",
    "instance", "network", "service", "response", "performance", "throughput", "application",
    "customer", "account", "payment", "invoice", "contract", "policy", "document", "section",
    "report", "analysis", "summary", "question", "answer", "context", "history", "language",
    "program", "function", "variable", "structure", "algorithm", "database", "storage",
    "compute", "balance", "traffic", "capacity", "schedule", "resource", "process", "control",
    "quality", "measure", "result", "example", "problem", "solution", "approach", "method",
    "feature", "support", "product", "market", "company", "business", "strategy", "decision",
    "important", "different", "available", "particular", "significant", "information",
    "development", "environment", "management", "government", "experience", "understanding",
    "relationship", "organization", "international", "responsibility", "configuration",
    "deployment", "infrastructure", "observability", "reliability", "availability", "team",
    "user", "data", "code", "test", "build", "run", "plan", "goal", "risk", "cost", "rate",
    "load", "node", "path", "file", "line", "page", "book", "city", "river", "mountain",
    "weather", "morning", "evening", "garden", "kitchen", "window", "friend", "family",
    "student", "teacher", "doctor", "patient", "travel", "journey", "history", "science",
    "music", "picture", "story", "letter", "energy", "nature", "ocean", "forest", "season",
    "quickly", "carefully", "usually", "always", "never", "often", "together", "however",
    "therefore", "because", "although", "during", "between", "without", "within", "against",
    "simple", "complex", "large", "small", "early", "late", "strong", "clear", "recent",
    "public", "private", "local", "global", "common", "special", "possible", "necessary",
];

/// Words of exactly one token with a leading space, to finish on the exact count.
const ONE_TOKEN_WORDS: &[&str] = &[
    "the", "of", "and", "to", "in", "is", "it", "for", "on", "as",
];

/// Generates text of exactly `tokens` tokens from `rng`.
pub fn text_with_tokens(rng: &mut impl Rng, tokens: usize) -> String {
    let mut out = String::with_capacity(tokens * 5);
    let mut left = tokens;
    let mut sentence_len = 0usize;
    let mut sentence_target = rng.gen_range(8..20);
    while left > 0 {
        // Close the sentence with a full stop (one token) when it is long enough.
        if sentence_len >= sentence_target && left >= 2 && !out.ends_with('.') {
            out.push('.');
            left -= 1;
            sentence_len = 0;
            sentence_target = rng.gen_range(8..20);
            continue;
        }
        let word = WORDS[rng.gen_range(0..WORDS.len())];
        let mut piece = String::with_capacity(word.len() + 1);
        if !out.is_empty() {
            piece.push(' ');
        }
        if sentence_len == 0 {
            let mut chars = word.chars();
            if let Some(c) = chars.next() {
                piece.push(c.to_ascii_uppercase());
                piece.push_str(chars.as_str());
            }
        } else {
            piece.push_str(word);
        }
        let cost = count_tokens(piece.as_bytes());
        if cost > left {
            // Finish with one-token words; " the" style pieces cost exactly 1.
            let filler = ONE_TOKEN_WORDS[rng.gen_range(0..ONE_TOKEN_WORDS.len())];
            if out.is_empty() {
                out.push_str(filler);
            } else {
                out.push(' ');
                out.push_str(filler);
            }
            left -= 1;
        } else {
            out.push_str(&piece);
            left -= cost;
        }
        sentence_len += 1;
    }
    out
}

/// Text of exactly `tokens` tokens determined by `seed` alone.
pub fn seeded_text(seed: u64, tokens: usize) -> String {
    text_with_tokens(&mut StdRng::seed_from_u64(seed), tokens)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exact_token_counts() {
        for (seed, n) in [
            (1, 0),
            (2, 1),
            (3, 2),
            (4, 17),
            (5, 1024),
            (6, 8000),
            (7, 3),
        ] {
            let t = seeded_text(seed, n);
            assert_eq!(
                count_tokens(t.as_bytes()),
                n,
                "seed {seed}, {n} tokens: {t:?}"
            );
        }
    }

    #[test]
    fn one_token_words_are_one_token() {
        for w in ONE_TOKEN_WORDS {
            assert_eq!(count_tokens(format!(" {w}").as_bytes()), 1, "{w}");
            assert_eq!(count_tokens(w.as_bytes()), 1, "{w}");
        }
    }

    #[test]
    fn deterministic_per_seed_and_varied_across_seeds() {
        assert_eq!(seeded_text(42, 500), seeded_text(42, 500));
        assert_ne!(seeded_text(42, 500), seeded_text(43, 500));
    }

    #[test]
    fn looks_like_prose() {
        let t = seeded_text(9, 300);
        assert!(t.chars().next().is_some_and(|c| c.is_ascii_uppercase()));
        assert!(t.matches(". ").count() >= 5, "{t}");
        let words = t.split_whitespace().count();
        // Between 1 and 4 tokens per word on average.
        assert!((75..=300).contains(&words), "{words}");
    }

    #[test]
    fn parts_joined_by_blank_lines_add_up() {
        let a = seeded_text(1, 100);
        let b = seeded_text(2, 50);
        let joined = format!("{a}\n\n{b}");
        assert_eq!(count_tokens(joined.as_bytes()), 100 + 1 + 50);
    }
}
