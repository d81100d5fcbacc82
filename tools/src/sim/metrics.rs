//! The counters a vLLM instance exports and their Prometheus text rendering,
//! under vLLM's own metric names so that dashboards and the benchmark read
//! the simulator exactly as they would read vLLM.

use std::fmt::Write as _;

/// vLLM's buckets for `vllm:time_to_first_token_seconds`.
pub const TTFT_BUCKETS: [f64; 22] = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];

/// A cumulative Prometheus histogram with fixed buckets.
#[derive(Debug, Clone)]
pub struct Histogram {
    bounds: &'static [f64],
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    /// An empty histogram over `bounds` (ascending upper bounds; +Inf is implied).
    pub fn new(bounds: &'static [f64]) -> Self {
        Histogram {
            bounds,
            counts: vec![0; bounds.len()],
            sum: 0.0,
            count: 0,
        }
    }

    /// Records one value.
    pub fn observe(&mut self, value: f64) {
        if let Some(i) = self.bounds.iter().position(|&b| value <= b) {
            self.counts[i] += 1;
        }
        self.sum += value;
        self.count += 1;
    }

    /// Number of values recorded.
    pub fn count(&self) -> u64 {
        self.count
    }

    fn render(&self, out: &mut String, name: &str, labels: &str) {
        let mut cumulative = 0;
        for (bound, n) in self.bounds.iter().zip(&self.counts) {
            cumulative += n;
            let _ = writeln!(out, "{name}_bucket{{{labels},le=\"{bound}\"}} {cumulative}");
        }
        let _ = writeln!(out, "{name}_bucket{{{labels},le=\"+Inf\"}} {}", self.count);
        let _ = writeln!(out, "{name}_sum{{{labels}}} {}", self.sum);
        let _ = writeln!(out, "{name}_count{{{labels}}} {}", self.count);
    }
}

/// Everything `/metrics` shows, as a snapshot.
#[derive(Debug, Clone)]
pub struct MetricsSnapshot {
    /// Prompt tokens looked up in the prefix cache.
    pub prefix_cache_queries: u64,
    /// Of those, tokens found in the cache.
    pub prefix_cache_hits: u64,
    /// Prompt tokens of admitted requests.
    pub prompt_tokens: u64,
    /// Output tokens produced by completed requests.
    pub generation_tokens: u64,
    /// Requests that finished normally.
    pub request_success: u64,
    /// Requests holding a batch slot.
    pub num_requests_running: usize,
    /// Requests waiting for a slot or for KV blocks.
    pub num_requests_waiting: usize,
    /// KV blocks in use by running requests, as a fraction of all blocks.
    pub kv_cache_usage: f64,
    /// Time to first token in simulated seconds.
    pub ttft: Histogram,
}

/// What `/metrics` shows of the LoRA adapters.
#[derive(Debug, Clone)]
pub struct LoraMetrics {
    /// `--max-loras`.
    pub max_lora: usize,
    /// Every (running adapters, waiting adapters) state seen, each with the
    /// unix time it was last seen: `vllm:lora_requests_info`'s series.
    pub states: Vec<(String, String, f64)>,
    /// Adapters made resident since the start.
    pub loads: u64,
}

impl LoraMetrics {
    /// Prometheus text: `vllm:lora_requests_info` with vLLM's labels in its
    /// order (no engine or model label), then `vllm_sim:lora_loads_total`.
    pub fn render(&self, model: &str) -> String {
        let mut out = String::new();
        let name = "vllm:lora_requests_info";
        let _ = writeln!(out, "# HELP {name} Running stats on lora requests.");
        let _ = writeln!(out, "# TYPE {name} gauge");
        for (running, waiting, at) in &self.states {
            let _ = writeln!(
                out,
                "{name}{{max_lora=\"{}\",waiting_lora_adapters=\"{}\",running_lora_adapters=\"{}\"}} {}",
                self.max_lora,
                escape_label(waiting),
                escape_label(running),
                go_float(*at)
            );
        }
        let name = "vllm_sim:lora_loads_total";
        let _ = writeln!(
            out,
            "# HELP {name} Adapters made resident in a LoRA slot (simulator only)."
        );
        let _ = writeln!(out, "# TYPE {name} counter");
        let _ = writeln!(
            out,
            "{name}{{engine=\"0\",model_name=\"{}\"}} {}",
            escape_label(model),
            self.loads
        );
        out
    }
}

/// A float as Python's `prometheus_client` writes it (`floatToGoString`):
/// Python's shortest form, in exponent form from 10^7 up, as Go does.
fn go_float(v: f64) -> String {
    let s = format!("{v:?}");
    match s.find('.') {
        Some(dot) if v > 0.0 && dot > 6 && !s.contains('e') => {
            let digits = format!("{}{}", &s[1..dot], &s[dot + 1..]);
            let mantissa = format!("{}.{digits}", &s[..1]);
            let mantissa = mantissa.trim_end_matches('0').trim_end_matches('.');
            format!("{mantissa}e+0{}", dot - 1)
        }
        _ => s,
    }
}

impl MetricsSnapshot {
    /// Prometheus text exposition (format 0.0.4), labelled like vLLM.
    pub fn render(&self, model: &str) -> String {
        let labels = format!("engine=\"0\",model_name=\"{}\"", escape_label(model));
        let mut out = String::new();
        let counter = |out: &mut String, name: &str, help: &str, v: u64| {
            let _ = writeln!(out, "# HELP {name}_total {help}");
            let _ = writeln!(out, "# TYPE {name}_total counter");
            let _ = writeln!(out, "{name}_total{{{labels}}} {v}");
        };
        let gauge = |out: &mut String, name: &str, help: &str, v: f64| {
            let _ = writeln!(out, "# HELP {name} {help}");
            let _ = writeln!(out, "# TYPE {name} gauge");
            let _ = writeln!(out, "{name}{{{labels}}} {v}");
        };
        counter(
            &mut out,
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            self.prefix_cache_queries,
        );
        counter(
            &mut out,
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            self.prefix_cache_hits,
        );
        counter(
            &mut out,
            "vllm:prompt_tokens",
            "Number of prefill tokens processed.",
            self.prompt_tokens,
        );
        counter(
            &mut out,
            "vllm:generation_tokens",
            "Number of generation tokens processed.",
            self.generation_tokens,
        );
        counter(
            &mut out,
            "vllm:request_success",
            "Count of successfully processed requests.",
            self.request_success,
        );
        gauge(
            &mut out,
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            self.num_requests_running as f64,
        );
        gauge(
            &mut out,
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            self.num_requests_waiting as f64,
        );
        gauge(
            &mut out,
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            self.kv_cache_usage,
        );
        let name = "vllm:time_to_first_token_seconds";
        let _ = writeln!(
            out,
            "# HELP {name} Histogram of time to first token in seconds."
        );
        let _ = writeln!(out, "# TYPE {name} histogram");
        self.ttft.render(&mut out, name, &labels);
        out
    }
}

/// The request header that asks for an ORCA load report on the response, as
/// vLLM 0.33 reads it (`vllm/entrypoints/openai/chat_completion/api_router.py`).
pub const ORCA_FORMAT_HEADER: &str = "endpoint-load-metrics-format";

/// The response header carrying the ORCA load report.
pub const ORCA_REPORT_HEADER: &str = "endpoint-load-metrics";

impl MetricsSnapshot {
    /// The `endpoint-load-metrics` value vLLM 0.33 sends when a request
    /// asked for `format` (`TEXT` or `JSON`, any case; `None` for any other):
    /// `num_requests_waiting` and `kv_cache_usage_perc` in the order vLLM
    /// registers their gauges (`vllm/entrypoints/serve/utils/orca_metrics.py`
    /// reads its Prometheus registry), floats printed as Python prints them
    /// (`2.0`, `0.4`).
    pub fn orca_report(&self, format: &str) -> Option<String> {
        let metrics = [
            ("num_requests_waiting", self.num_requests_waiting as f64),
            ("kv_cache_usage_perc", self.kv_cache_usage),
        ];
        if format.eq_ignore_ascii_case("text") {
            let pairs: Vec<String> = metrics
                .iter()
                .map(|(name, value)| format!("named_metrics.{name}={value:?}"))
                .collect();
            Some(format!("TEXT {}", pairs.join(", ")))
        } else if format.eq_ignore_ascii_case("json") {
            // json.dumps' default separators: ", " and ": ".
            let pairs: Vec<String> = metrics
                .iter()
                .map(|(name, value)| format!("\"{name}\": {value:?}"))
                .collect();
            Some(format!(
                "JSON {{\"named_metrics\": {{{}}}}}",
                pairs.join(", ")
            ))
        } else {
            None
        }
    }
}

fn escape_label(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// Reads one unlabelled-or-labelled sample's value from Prometheus text:
/// the first line whose metric name is exactly `name`. Used by tests and the
/// benchmark to read instances' counters.
pub fn parse_sample(text: &str, name: &str) -> Option<f64> {
    text.lines().find_map(|line| {
        let line = line.trim();
        if line.starts_with('#') {
            return None;
        }
        let rest = line.strip_prefix(name)?;
        let value = if let Some(after) = rest.strip_prefix('{') {
            after.split_once('}')?.1
        } else if rest.starts_with(' ') {
            rest
        } else {
            return None;
        };
        value.split_whitespace().next()?.parse().ok()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn snapshot(waiting: usize, kv_cache_usage: f64) -> MetricsSnapshot {
        MetricsSnapshot {
            prefix_cache_queries: 0,
            prefix_cache_hits: 0,
            prompt_tokens: 0,
            generation_tokens: 0,
            request_success: 0,
            num_requests_running: 0,
            num_requests_waiting: waiting,
            kv_cache_usage,
            ttft: Histogram::new(&TTFT_BUCKETS),
        }
    }

    #[test]
    fn orca_reports_read_like_vllms() {
        let snap = snapshot(2, 0.4);
        assert_eq!(
            snap.orca_report("TEXT").as_deref(),
            Some("TEXT named_metrics.num_requests_waiting=2.0, named_metrics.kv_cache_usage_perc=0.4")
        );
        assert_eq!(snap.orca_report("text"), snap.orca_report("TEXT"));
        assert_eq!(
            snapshot(0, 0.0).orca_report("json").as_deref(),
            Some(
                r#"JSON {"named_metrics": {"num_requests_waiting": 0.0, "kv_cache_usage_perc": 0.0}}"#
            )
        );
        let json = snap.orca_report("JSON").unwrap();
        let parsed: serde_json::Value =
            serde_json::from_str(json.strip_prefix("JSON ").unwrap()).unwrap();
        assert_eq!(parsed["named_metrics"]["num_requests_waiting"], 2.0);
        assert_eq!(snap.orca_report("BIN"), None);
        assert_eq!(snap.orca_report(""), None);
    }

    #[test]
    fn renders_vllm_names_and_parses_back() {
        let mut ttft = Histogram::new(&TTFT_BUCKETS);
        ttft.observe(0.03);
        ttft.observe(3.0);
        let snap = MetricsSnapshot {
            prefix_cache_queries: 1000,
            prefix_cache_hits: 640,
            prompt_tokens: 1000,
            generation_tokens: 20,
            request_success: 2,
            num_requests_running: 3,
            num_requests_waiting: 4,
            kv_cache_usage: 0.5,
            ttft,
        };
        let text = snap.render("llama\"3");
        assert!(text.contains("model_name=\"llama\\\"3\""));
        assert_eq!(
            parse_sample(&text, "vllm:prefix_cache_queries_total"),
            Some(1000.0)
        );
        assert_eq!(
            parse_sample(&text, "vllm:prefix_cache_hits_total"),
            Some(640.0)
        );
        assert_eq!(parse_sample(&text, "vllm:num_requests_running"), Some(3.0));
        assert_eq!(parse_sample(&text, "vllm:num_requests_waiting"), Some(4.0));
        assert_eq!(
            parse_sample(&text, "vllm:time_to_first_token_seconds_count"),
            Some(2.0)
        );
        assert!(text.contains("vllm:time_to_first_token_seconds_bucket{engine=\"0\",model_name=\"llama\\\"3\",le=\"0.04\"} 1"));
        assert!(text.contains("le=\"2.5\"} 1\n"));
        assert!(text.contains("le=\"5\"} 2\n"));
        assert_eq!(parse_sample(&text, "vllm:prefix_cache"), None);
    }

    #[test]
    fn lora_requests_info_reads_like_vllms() {
        let lora = LoraMetrics {
            max_lora: 4,
            states: vec![
                ("a0".into(), String::new(), 1_733_450_000.25),
                ("a0,a1".into(), "a2".into(), 1_733_450_001.0),
            ],
            loads: 3,
        };
        let text = lora.render("m");
        assert!(text.contains("# TYPE vllm:lora_requests_info gauge\n"));
        assert!(text.contains(
            "vllm:lora_requests_info{max_lora=\"4\",waiting_lora_adapters=\"\",running_lora_adapters=\"a0\"} 1.73345000025e+09\n"
        ), "{text}");
        assert!(text.contains(
            "vllm:lora_requests_info{max_lora=\"4\",waiting_lora_adapters=\"a2\",running_lora_adapters=\"a0,a1\"} 1.733450001e+09\n"
        ), "{text}");
        assert_eq!(parse_sample(&text, "vllm_sim:lora_loads_total"), Some(3.0));
        assert_eq!(go_float(0.5), "0.5");
        assert_eq!(go_float(2.0), "2.0");
    }
}
