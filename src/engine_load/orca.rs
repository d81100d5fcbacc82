//! Reads the KV-cache usage out of an ORCA load report, the
//! `endpoint-load-metrics` response header vLLM adds to a non-streaming
//! response when the request asked for one (`endpoint-load-metrics-format:
//! TEXT` or `JSON`).
//!
//! Why: a poll's sample is up to an interval old, while a response's report
//! was taken as the response left the engine. Where a client asks for
//! reports, each response through this Envoy refreshes the instance's KV
//! usage (the figure `max_kv_usage` bounds) between polls. The report has no
//! running count, so it cannot refresh the request estimate; see
//! `docs/design.md`, "The ORCA response header".
//!
//! The two formats vLLM writes (`vllm/entrypoints/serve/utils/orca_metrics.py`,
//! `create_orca_header`), its gauges in the order it registers them:
//! - `TEXT named_metrics.num_requests_waiting=2.0, named_metrics.kv_cache_usage_perc=0.4`
//! - `JSON {"named_metrics": {"num_requests_waiting": 2.0, "kv_cache_usage_perc": 0.4}}`
//!
//! Rules, as for the `/metrics` body (`super::metrics_text`): a value that
//! is not a finite number >= 0 makes the report unreadable, never a zero;
//! the largest of repeated values counts (vLLM repeats a gauge once per
//! engine behind one server, and the fullest engine bounds the address); a
//! value above 1 reads as 1.

/// The response header carrying the report.
pub const REPORT_HEADER: &str = "endpoint-load-metrics";

/// The request header that asks vLLM for a report on the response.
pub const FORMAT_HEADER: &str = "endpoint-load-metrics-format";

/// vLLM's name for its KV-cache usage among the report's named metrics.
pub const KV_USAGE_METRIC: &str = "kv_cache_usage_perc";

/// Why a report gave no figure.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReportFault {
    /// Neither `TEXT ` nor `JSON ` (nor anything parseable after either).
    Format,
    /// The KV usage is there with a value that is not a finite number >= 0.
    BadValue(String),
}

impl std::fmt::Display for ReportFault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ReportFault::Format => write!(f, "not a TEXT or JSON ORCA report"),
            ReportFault::BadValue(value) => write!(
                f,
                "{KV_USAGE_METRIC} has the value {value:?}, not a number >= 0"
            ),
        }
    }
}

/// The KV-cache usage in thousandths that `report` (the header's value)
/// gives; `Ok(None)` for a readable report without it.
pub fn kv_usage_permille(report: &[u8]) -> Result<Option<u16>, ReportFault> {
    let report = std::str::from_utf8(report).map_err(|_| ReportFault::Format)?;
    let report = report.trim();
    let values = if let Some(text) = strip_format(report, "TEXT") {
        text_values(text)
    } else if let Some(json) = strip_format(report, "JSON") {
        json_values(json)?
    } else {
        return Err(ReportFault::Format);
    };
    let mut largest: Option<f64> = None;
    for value in values {
        let parsed = value
            .parse::<f64>()
            .ok()
            .filter(|v| v.is_finite() && *v >= 0.0)
            .ok_or_else(|| ReportFault::BadValue(value.chars().take(64).collect()))?;
        largest = Some(largest.map_or(parsed, |l| l.max(parsed)));
    }
    Ok(largest.map(|v| (v.min(1.0) * 1000.0).round() as u16))
}

/// The report after its format word (any case, as vLLM accepts it) and the
/// space that follows (none if nothing follows).
fn strip_format<'a>(report: &'a str, format: &str) -> Option<&'a str> {
    let head = report.get(..format.len())?;
    let rest = report.get(format.len()..)?;
    let separated = rest.is_empty() || rest.starts_with(' ');
    (head.eq_ignore_ascii_case(format) && separated).then(|| rest.trim_start())
}

/// The values of `named_metrics.kv_cache_usage_perc` among TEXT's
/// comma-separated `key=value` pairs.
fn text_values(text: &str) -> Vec<String> {
    text.split(',')
        .filter_map(|pair| pair.split_once('='))
        .filter(|(key, _)| {
            key.trim()
                .strip_prefix("named_metrics.")
                .is_some_and(|name| name == KV_USAGE_METRIC)
        })
        .map(|(_, value)| value.trim().to_string())
        .collect()
}

/// The value of `named_metrics.kv_cache_usage_perc` in JSON's object, as
/// text (so that a non-number reads as a bad value, not as absent).
fn json_values(json: &str) -> Result<Vec<String>, ReportFault> {
    let report: serde_json::Value = serde_json::from_str(json).map_err(|_| ReportFault::Format)?;
    let named = report
        .get("named_metrics")
        .and_then(serde_json::Value::as_object);
    Ok(named
        .and_then(|named| named.get(KV_USAGE_METRIC))
        .map(|value| match value {
            serde_json::Value::String(s) => s.clone(),
            other => other.to_string(),
        })
        .into_iter()
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(report: &str) -> Result<Option<u16>, ReportFault> {
        kv_usage_permille(report.as_bytes())
    }

    #[test]
    fn reads_both_formats_as_vllm_writes_them() {
        assert_eq!(
            read("TEXT named_metrics.num_requests_waiting=2.0, named_metrics.kv_cache_usage_perc=0.4"),
            Ok(Some(400))
        );
        assert_eq!(
            read(
                r#"JSON {"named_metrics": {"num_requests_waiting": 2.0, "kv_cache_usage_perc": 0.4}}"#
            ),
            Ok(Some(400))
        );
        assert_eq!(
            read("text named_metrics.kv_cache_usage_perc=0.0"),
            Ok(Some(0))
        );
        assert_eq!(
            read("  TEXT   named_metrics.kv_cache_usage_perc = 0.1234 "),
            Ok(Some(123))
        );
        assert_eq!(
            read("TEXT named_metrics.kv_cache_usage_perc=1e0"),
            Ok(Some(1000))
        );
    }

    #[test]
    fn a_readable_report_without_kv_usage_gives_none() {
        assert_eq!(
            read("TEXT named_metrics.num_requests_waiting=2.0"),
            Ok(None)
        );
        assert_eq!(read("TEXT "), Ok(None));
        assert_eq!(read("TEXT cpu_utilization=0.9"), Ok(None));
        // A standard field of that name is not vLLM's named metric.
        assert_eq!(read("TEXT kv_cache_usage_perc=0.9"), Ok(None));
        assert_eq!(read(r#"JSON {"cpu_utilization": 0.3}"#), Ok(None));
        assert_eq!(read(r#"JSON {"named_metrics": {}}"#), Ok(None));
    }

    #[test]
    fn repeated_values_give_the_largest_and_values_above_one_read_as_one() {
        assert_eq!(
            read(
                "TEXT named_metrics.kv_cache_usage_perc=0.2, named_metrics.kv_cache_usage_perc=0.7"
            ),
            Ok(Some(700))
        );
        assert_eq!(
            read("TEXT named_metrics.kv_cache_usage_perc=1.5"),
            Ok(Some(1000))
        );
    }

    #[test]
    fn bad_values_and_other_formats_are_faults_never_zero() {
        for bad in ["-0.1", "NaN", "inf", "high", ""] {
            assert_eq!(
                read(&format!("TEXT named_metrics.kv_cache_usage_perc={bad}")),
                Err(ReportFault::BadValue(bad.to_string())),
                "{bad}"
            );
        }
        assert_eq!(
            read(r#"JSON {"named_metrics": {"kv_cache_usage_perc": "high"}}"#),
            Err(ReportFault::BadValue("high".into()))
        );
        assert_eq!(
            read(r#"JSON {"named_metrics": {"kv_cache_usage_perc": null}}"#),
            Err(ReportFault::BadValue("null".into()))
        );
        for bad in [
            "BIN CgQIARAB",
            "TEXTnamed_metrics.x=1",
            "JSON {",
            "",
            "named_metrics.kv_cache_usage_perc=0.4",
        ] {
            assert_eq!(read(bad), Err(ReportFault::Format), "{bad}");
        }
        assert_eq!(kv_usage_permille(b"TEXT \xff"), Err(ReportFault::Format));
        let long = format!(
            "TEXT named_metrics.kv_cache_usage_perc={}",
            "9".repeat(100) + "x"
        );
        match read(&long) {
            Err(ReportFault::BadValue(value)) => assert_eq!(value.len(), 64),
            other => panic!("{other:?}"),
        }
    }
}
