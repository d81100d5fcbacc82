//! Reads an engine's load from its `/metrics` body (the Prometheus text
//! exposition format): the running and waiting requests and the KV-cache
//! usage, under the series names the configuration gives.
//!
//! Why a parser of its own: the filter may carry no crate beyond its few
//! dependencies, and it needs three numbers out of a body that real engines
//! fill with hundreds of histogram lines. It reads line by line, takes only
//! the named series, and never allocates per line.
//!
//! Rules (what the engines export, see `docs/design.md`, "Engine load"):
//! - A series may come with several label sets (vLLM exports one per
//!   engine or model): running and waiting are summed over them, KV usage is
//!   the largest (the fullest engine behind the address bounds it).
//! - A body that lacks a needed series, or gives it a value that is not a
//!   finite number >= 0, is a fault, never a zero: a zero would make a
//!   broken endpoint look idle and draw the whole fleet's traffic.
//! - `# HELP` / `# TYPE` and other comments, empty lines, CRLF line ends,
//!   timestamps after the value, and lines of other series are skipped.

use crate::load::EngineLoad;

/// The most of a body that is read (real vLLM bodies, histograms included,
/// are estimated at tens of KiB per model; see the design document). Past
/// it the body is cut at its last complete line.
pub const MAX_BODY_BYTES: usize = 1024 * 1024;

/// The series names to read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Series {
    pub running: String,
    pub waiting: String,
    /// None: the engine exports no KV usage (llama.cpp).
    pub kv_usage: Option<String>,
}

/// Why a body gave no load.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BodyFault {
    /// A needed series is not in the body.
    Missing(String),
    /// A needed series has a value that is not a finite number >= 0 (NaN,
    /// an infinity, a negative number, or text that is no number).
    BadValue { series: String, value: String },
}

impl std::fmt::Display for BodyFault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BodyFault::Missing(series) => write!(f, "no series {series} in the body"),
            BodyFault::BadValue { series, value } => {
                write!(
                    f,
                    "series {series} has the value {value:?}, not a number >= 0"
                )
            }
        }
    }
}

/// What was found of one series.
#[derive(Debug, Default, Clone, Copy)]
struct Found {
    seen: bool,
    sum: f64,
    max: f64,
}

impl Found {
    fn add(&mut self, value: f64) {
        if self.seen {
            self.sum += value;
            self.max = self.max.max(value);
        } else {
            *self = Found {
                seen: true,
                sum: value,
                max: value,
            };
        }
    }
}

/// The engine's load in `body` (see the module documentation).
pub fn parse(body: &[u8], series: &Series) -> Result<EngineLoad, BodyFault> {
    let mut running = Found::default();
    let mut waiting = Found::default();
    let mut kv = Found::default();
    for (name, _, value) in samples(body) {
        let slot = if name == series.running.as_bytes() {
            &mut running
        } else if name == series.waiting.as_bytes() {
            &mut waiting
        } else if series.kv_usage.as_deref().map(str::as_bytes) == Some(name) {
            &mut kv
        } else {
            continue;
        };
        let parsed = number(value).filter(|v| *v >= 0.0);
        match parsed {
            Some(v) => slot.add(v),
            None => {
                return Err(BodyFault::BadValue {
                    series: String::from_utf8_lossy(name).into_owned(),
                    value: String::from_utf8_lossy(value.get(..64).unwrap_or(value)).into_owned(),
                })
            }
        }
    }
    let count = |found: Found, name: &str| -> Result<u32, BodyFault> {
        if !found.seen {
            return Err(BodyFault::Missing(name.to_string()));
        }
        // Saturating float-to-int conversion; counts are whole numbers.
        Ok(found.sum.round() as u32)
    };
    let running = count(running, &series.running)?;
    let waiting = count(waiting, &series.waiting)?;
    let kv_usage_permille = match &series.kv_usage {
        None => None,
        Some(name) if !kv.seen => return Err(BodyFault::Missing(name.clone())),
        Some(_) => Some((kv.max.min(1.0) * 1000.0).round() as u16),
    };
    Ok(EngineLoad {
        running,
        waiting,
        kv_usage_permille,
    })
}

/// A sample's value text as a finite number.
pub(crate) fn number(value: &[u8]) -> Option<f64> {
    std::str::from_utf8(value)
        .ok()
        .and_then(|v| v.parse::<f64>().ok())
        .filter(|v| v.is_finite())
}

/// `body`, or its first [`MAX_BODY_BYTES`] cut at the last complete line.
fn within_cap(body: &[u8]) -> &[u8] {
    match body.get(..MAX_BODY_BYTES) {
        Some(head) if body.len() > MAX_BODY_BYTES => {
            let end = head.iter().rposition(|b| *b == b'\n').unwrap_or(0);
            head.get(..end).unwrap_or_default()
        }
        _ => body,
    }
}

/// The sample lines of `body` (within [`MAX_BODY_BYTES`]): each one's
/// metric name, label block (`{...}`, or empty) and value text. Comments,
/// empty lines and lines that are no sample are skipped.
pub(crate) fn samples(body: &[u8]) -> impl Iterator<Item = (&[u8], &[u8], &[u8])> {
    within_cap(body).split(|b| *b == b'\n').filter_map(|line| {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        if line.first() == Some(&b'#') {
            return None;
        }
        sample(line)
    })
}

/// A sample line's metric name, label block and value text, or None if the
/// line is not one (`name [{labels}] value [timestamp]`).
fn sample(line: &[u8]) -> Option<(&[u8], &[u8], &[u8])> {
    let name_end = line
        .iter()
        .position(|b| *b == b'{' || *b == b' ' || *b == b'\t')?;
    let (name, mut rest) = line.split_at(name_end);
    if name.is_empty() {
        return None;
    }
    let mut labels: &[u8] = &[];
    if rest.first() == Some(&b'{') {
        let end = labels_end(rest)?;
        labels = rest.get(..end)?;
        rest = rest.get(end..)?;
    }
    let rest = trim_start(rest);
    let value_end = rest
        .iter()
        .position(|b| *b == b' ' || *b == b'\t')
        .unwrap_or(rest.len());
    let value = rest.get(..value_end)?;
    (!value.is_empty()).then_some((name, labels, value))
}

/// The value of label `key` in a label block (`{a="x",b="y"}`), with its
/// `\\`, `\"` and `\n` escapes undone; None if the block has no such label.
pub(crate) fn label_value(labels: &[u8], key: &[u8]) -> Option<Vec<u8>> {
    let mut rest = labels.strip_prefix(b"{")?;
    loop {
        rest = trim_start(rest);
        rest = rest.strip_prefix(b",").map_or(rest, trim_start);
        let equals = rest.iter().position(|b| *b == b'=')?;
        let name = trim_start(rest.get(..equals)?).trim_ascii_end();
        rest = trim_start(rest.get(equals + 1..)?).strip_prefix(b"\"")?;
        let mut value = Vec::new();
        let mut bytes = rest.iter().enumerate();
        let end = loop {
            match bytes.next()? {
                (at, b'"') => break at,
                (_, b'\\') => value.push(match bytes.next()?.1 {
                    b'n' => b'\n',
                    other => *other,
                }),
                (_, byte) => value.push(*byte),
            }
        };
        if name == key {
            return Some(value);
        }
        rest = rest.get(end + 1..)?;
    }
}

/// Where the label block that `text` starts with ends (just past its `}`),
/// honouring quoted values with `\"` and `\\` escapes.
fn labels_end(text: &[u8]) -> Option<usize> {
    let mut in_quotes = false;
    let mut escaped = false;
    for (at, byte) in text.iter().enumerate() {
        match (in_quotes, escaped, *byte) {
            (true, true, _) => escaped = false,
            (true, false, b'\\') => escaped = true,
            (true, false, b'"') => in_quotes = false,
            (false, _, b'"') => in_quotes = true,
            (false, _, b'}') => return Some(at + 1),
            _ => {}
        }
    }
    None
}

fn trim_start(text: &[u8]) -> &[u8] {
    let start = text
        .iter()
        .position(|b| *b != b' ' && *b != b'\t')
        .unwrap_or(text.len());
    text.get(start..).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vllm() -> Series {
        Series {
            running: "vllm:num_requests_running".into(),
            waiting: "vllm:num_requests_waiting".into(),
            kv_usage: Some("vllm:kv_cache_usage_perc".into()),
        }
    }

    fn load(running: u32, waiting: u32, kv: Option<u16>) -> EngineLoad {
        EngineLoad {
            running,
            waiting,
            kv_usage_permille: kv,
        }
    }

    #[test]
    fn reads_the_three_series_with_help_type_and_labels() {
        let body = "\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 3.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 2.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"m\"} 0.4567
vllm:num_requests_running_total 99
";
        assert_eq!(parse(body.as_bytes(), &vllm()), Ok(load(3, 2, Some(457))));
    }

    #[test]
    fn sums_counts_over_label_sets_and_takes_the_largest_kv_usage() {
        let body = "\
vllm:num_requests_running{engine=\"0\"} 3
vllm:num_requests_running{engine=\"1\"} 4
vllm:num_requests_waiting{engine=\"0\"} 1
vllm:num_requests_waiting{engine=\"1\"} 0
vllm:kv_cache_usage_perc{engine=\"0\"} 0.2
vllm:kv_cache_usage_perc{engine=\"1\"} 0.9
vllm:kv_cache_usage_perc{engine=\"2\"} 0.5
";
        assert_eq!(parse(body.as_bytes(), &vllm()), Ok(load(7, 1, Some(900))));
    }

    #[test]
    fn reads_a_label_value_wherever_it_stands_and_undoes_its_escapes() {
        let labels = br#"{a="1", b = "x\"}\\y\nz",c="",d="}"}"#;
        assert_eq!(label_value(labels, b"a").as_deref(), Some(&b"1"[..]));
        assert_eq!(
            label_value(labels, b"b").as_deref(),
            Some(&b"x\"}\\y\nz"[..])
        );
        assert_eq!(label_value(labels, b"c").as_deref(), Some(&b""[..]));
        assert_eq!(label_value(labels, b"d").as_deref(), Some(&b"}"[..]));
        assert_eq!(label_value(labels, b"e"), None);
        for broken in [&b""[..], b"{", b"{a}", b"{a=1}", br#"{a="1"#] {
            assert_eq!(label_value(broken, b"a"), None, "{broken:?}");
        }
    }

    #[test]
    fn label_values_may_hold_braces_quotes_and_spaces() {
        let body = "\
vllm:num_requests_running{model_name=\"a } b \\\" c\\\\\",x=\"{\"} 5
vllm:num_requests_waiting{} 6 1712345678901
vllm:kv_cache_usage_perc 1
";
        assert_eq!(parse(body.as_bytes(), &vllm()), Ok(load(5, 6, Some(1000))));
    }

    #[test]
    fn crlf_tabs_exponents_and_usage_above_one() {
        let body = "vllm:num_requests_running\t1.2e1\r\n\
                    vllm:num_requests_waiting 2E0\r\n\
                    vllm:kv_cache_usage_perc 1.5\r\n";
        assert_eq!(parse(body.as_bytes(), &vllm()), Ok(load(12, 2, Some(1000))));
    }

    #[test]
    fn a_missing_series_is_a_fault_not_a_zero() {
        let body = "vllm:num_requests_running 1\nvllm:kv_cache_usage_perc 0.1\n";
        assert_eq!(
            parse(body.as_bytes(), &vllm()),
            Err(BodyFault::Missing("vllm:num_requests_waiting".into()))
        );
        let no_kv = "vllm:num_requests_running 1\nvllm:num_requests_waiting 0\n";
        assert_eq!(
            parse(no_kv.as_bytes(), &vllm()),
            Err(BodyFault::Missing("vllm:kv_cache_usage_perc".into()))
        );
        // Only in a comment, or as a longer name: still missing.
        let near = "# vllm:num_requests_waiting 3\nvllm:num_requests_waiting_x 3\n\
                    vllm:num_requests_running 1\nvllm:kv_cache_usage_perc 0\n";
        assert_eq!(
            parse(near.as_bytes(), &vllm()),
            Err(BodyFault::Missing("vllm:num_requests_waiting".into()))
        );
        assert_eq!(
            parse(b"", &vllm()),
            Err(BodyFault::Missing("vllm:num_requests_running".into()))
        );
    }

    #[test]
    fn nan_infinities_negatives_and_words_are_faults() {
        for value in ["NaN", "+Inf", "-Inf", "-1", "many", "0x10"] {
            let body = format!(
                "vllm:num_requests_running {value}\nvllm:num_requests_waiting 0\n\
                 vllm:kv_cache_usage_perc 0\n"
            );
            assert_eq!(
                parse(body.as_bytes(), &vllm()),
                Err(BodyFault::BadValue {
                    series: "vllm:num_requests_running".into(),
                    value: value.into()
                }),
                "{value}"
            );
        }
        // A NaN in a series not asked for does not matter.
        let body = "other NaN\nvllm:num_requests_running 1\nvllm:num_requests_waiting 0\n\
                    vllm:kv_cache_usage_perc 0\n";
        assert_eq!(parse(body.as_bytes(), &vllm()), Ok(load(1, 0, Some(0))));
    }

    #[test]
    fn an_engine_without_kv_usage_needs_only_the_counts() {
        let series = Series {
            running: "llamacpp:requests_processing".into(),
            waiting: "llamacpp:requests_deferred".into(),
            kv_usage: None,
        };
        let body = "llamacpp:requests_processing 2\nllamacpp:requests_deferred 5\n";
        assert_eq!(parse(body.as_bytes(), &series), Ok(load(2, 5, None)));
    }

    #[test]
    fn garbage_gives_a_fault() {
        let garbage: Vec<u8> = (0..4096u32).map(|i| (i * 31 % 251) as u8).collect();
        assert!(parse(&garbage, &vllm()).is_err());
        assert!(parse(b"<html>502 Bad Gateway</html>", &vllm()).is_err());
        // A line cut inside its labels is no sample.
        let cut = "vllm:num_requests_running{a=\"1\" 3\nvllm:num_requests_waiting 0\n\
                   vllm:kv_cache_usage_perc 0\n";
        assert_eq!(
            parse(cut.as_bytes(), &vllm()),
            Err(BodyFault::Missing("vllm:num_requests_running".into()))
        );
        // A name with no value.
        let bare = "vllm:num_requests_running\nvllm:num_requests_waiting 0\n\
                    vllm:kv_cache_usage_perc 0\n";
        assert!(parse(bare.as_bytes(), &vllm()).is_err());
    }

    #[test]
    fn counts_saturate_and_round() {
        let body = "vllm:num_requests_running 1e12\nvllm:num_requests_waiting 2.6\n\
                    vllm:kv_cache_usage_perc 0.0004\n";
        assert_eq!(
            parse(body.as_bytes(), &vllm()),
            Ok(load(u32::MAX, 3, Some(0)))
        );
    }

    #[test]
    fn a_huge_body_is_read_up_to_the_cap_at_a_line_end() {
        let head = "vllm:num_requests_running 1\nvllm:num_requests_waiting 2\n\
                    vllm:kv_cache_usage_perc 0.5\n";
        let filler = "x_histogram_bucket{le=\"0.1\"} 12345\n";
        let mut body = head.to_string();
        while body.len() < MAX_BODY_BYTES + 10_000 {
            body.push_str(filler);
        }
        assert_eq!(parse(body.as_bytes(), &vllm()), Ok(load(1, 2, Some(500))));
        // A series past the cap is not read: a fault, not a guess.
        let mut late = String::new();
        while late.len() < MAX_BODY_BYTES {
            late.push_str(filler);
        }
        late.push_str(head);
        assert_eq!(
            parse(late.as_bytes(), &vllm()),
            Err(BodyFault::Missing("vllm:num_requests_running".into()))
        );
        // The line the cap cuts is dropped, not read as a shorter number.
        let mut cut = String::new();
        while cut.len() < MAX_BODY_BYTES - 30 {
            cut.push_str("y 1\n");
        }
        cut.push_str("vllm:num_requests_running 12345678901234567890\n");
        assert!(!String::from_utf8_lossy(within_cap(cut.as_bytes())).contains("vllm:"));
        assert_eq!(
            parse(cut.as_bytes(), &vllm()),
            Err(BodyFault::Missing("vllm:num_requests_running".into()))
        );
    }
}
