//! A `/metrics` answer shaped as a vLLM server's, for the overhead
//! benchmark's instant upstreams: what the engine-load poller fetches and
//! parses on every poll costs in proportion to the body, so the body has the
//! families, label sets and bucket bounds vLLM's v1 engine exports for one
//! model through `prometheus_client` (its process and GC series, the
//! scheduler gauges, the token and request counters with their `_created`
//! samples, and the latency and size histograms), with plausible values. It
//! is modelled on that exporter, not captured from a running vLLM.

use std::fmt::Write as _;

/// The labels of every vLLM series (one engine, one model).
const LABELS: &str = r#"engine="0",model_name="meta-llama/Llama-3.1-70B-Instruct""#;

/// Bucket bounds as vLLM's v1 Prometheus logger sets them.
const ITERATION_TOKENS: &[f64] = &[
    1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0,
];
const TTFT: &[f64] = &crate::sim::metrics::TTFT_BUCKETS;
const TOKEN_LATENCY: &[f64] = &[
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
];
const REQUEST_LATENCY: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];
/// 1, 2, 5 per decade up to the model's length (131,072 tokens).
const TOKENS: &[f64] = &[
    1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0, 5000.0, 10000.0, 20000.0,
    50000.0, 100000.0,
];
const PARAMS_N: &[f64] = &[1.0, 2.0, 5.0, 10.0, 20.0];

/// When the families were created (`_created`), Unix seconds.
const CREATED: f64 = 1.764e9;

/// The body, with the engine at `running` + `waiting` requests and
/// `kv_usage` (0..1) of its KV cache in use.
pub fn vllm_metrics_body(running: u32, waiting: u32, kv_usage: f64) -> String {
    let mut out = String::with_capacity(48 * 1024);
    process_series(&mut out);
    let gauge = |out: &mut String, name: &str, help: &str, value: f64| {
        family(out, name, help, "gauge");
        let _ = writeln!(out, "{name}{{{LABELS}}} {value:?}");
    };
    gauge(
        &mut out,
        "vllm:num_requests_running",
        "Number of requests in model execution batches.",
        f64::from(running),
    );
    gauge(
        &mut out,
        "vllm:num_requests_waiting",
        "Number of requests waiting to be processed.",
        f64::from(waiting),
    );
    gauge(
        &mut out,
        "vllm:kv_cache_usage_perc",
        "KV-cache usage. 1 means 100 percent usage.",
        kv_usage,
    );
    let counters: [(&str, &str, f64); 6] = [
        (
            "vllm:num_preemptions",
            "Cumulative number of preemption from the engine.",
            12.0,
        ),
        (
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            48_213_344.0,
        ),
        (
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            31_990_128.0,
        ),
        (
            "vllm:prompt_tokens",
            "Number of prefill tokens processed.",
            48_213_344.0,
        ),
        (
            "vllm:generation_tokens",
            "Number of generation tokens processed.",
            6_402_117.0,
        ),
        (
            "vllm:request_success",
            "Count of successfully processed requests.",
            0.0,
        ),
    ];
    for (name, help, value) in counters {
        family(&mut out, name, help, "counter");
        if name == "vllm:request_success" {
            for (reason, count) in [("stop", 20_811.0), ("length", 1_377.0), ("abort", 41.0)] {
                let _ = writeln!(
                    out,
                    "{name}_total{{{LABELS},finished_reason=\"{reason}\"}} {count:?}"
                );
            }
        } else {
            let _ = writeln!(out, "{name}_total{{{LABELS}}} {value:?}");
        }
        created(&mut out, name);
    }
    let histograms: [(&str, &str, &[f64]); 14] = [
        (
            "vllm:iteration_tokens_total",
            "Histogram of number of tokens per engine_step.",
            ITERATION_TOKENS,
        ),
        (
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            TTFT,
        ),
        (
            "vllm:time_per_output_token_seconds",
            "Histogram of time per output token in seconds.",
            TOKEN_LATENCY,
        ),
        (
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            TOKEN_LATENCY,
        ),
        (
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            REQUEST_LATENCY,
        ),
        (
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            REQUEST_LATENCY,
        ),
        (
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            REQUEST_LATENCY,
        ),
        (
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            REQUEST_LATENCY,
        ),
        (
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            REQUEST_LATENCY,
        ),
        (
            "vllm:request_prompt_tokens",
            "Number of prefill tokens processed.",
            TOKENS,
        ),
        (
            "vllm:request_generation_tokens",
            "Number of generation tokens processed.",
            TOKENS,
        ),
        (
            "vllm:request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.",
            TOKENS,
        ),
        (
            "vllm:request_params_n",
            "Histogram of the n request parameter.",
            PARAMS_N,
        ),
        (
            "vllm:request_params_max_tokens",
            "Histogram of the max_tokens request parameter.",
            TOKENS,
        ),
    ];
    for (name, help, bounds) in histograms {
        histogram(&mut out, name, help, bounds);
    }
    family(
        &mut out,
        "vllm:cache_config_info",
        "Information of the LLMEngine CacheConfig",
        "gauge",
    );
    let _ = writeln!(
        out,
        "vllm:cache_config_info{{block_size=\"16\",cache_dtype=\"auto\",calculate_kv_scales=\"False\",cpu_offload_gb=\"0\",enable_prefix_caching=\"True\",engine=\"0\",gpu_memory_utilization=\"0.9\",is_attention_free=\"False\",num_cpu_blocks=\"None\",num_gpu_blocks=\"20844\",num_gpu_blocks_override=\"None\",prefix_caching_hash_algo=\"sha256\",sliding_window=\"None\",swap_space=\"4\",swap_space_bytes=\"4294967296\"}} 1.0"
    );
    family(
        &mut out,
        "vllm:lora_requests_info",
        "Running stats on lora requests.",
        "gauge",
    );
    let _ = writeln!(
        out,
        "vllm:lora_requests_info{{max_lora=\"0\",running_lora_adapters=\"\",waiting_lora_adapters=\"\"}} {CREATED:?}"
    );
    out
}

fn family(out: &mut String, name: &str, help: &str, kind: &str) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
}

/// The `<name>_created` gauge `prometheus_client` adds to counters and histograms.
fn created(out: &mut String, name: &str) {
    let base = name.strip_suffix("_total").unwrap_or(name);
    family(out, &format!("{base}_created"), name_help(name), "gauge");
    let _ = writeln!(out, "{base}_created{{{LABELS}}} {CREATED:?}");
}

fn name_help(name: &str) -> &str {
    name.rsplit(':').next().unwrap_or(name)
}

/// A cumulative histogram with counts growing towards the middle buckets.
fn histogram(out: &mut String, name: &str, help: &str, bounds: &[f64]) {
    let base = name.strip_suffix("_total").unwrap_or(name);
    family(out, name, help, "histogram");
    let mut cumulative = 0.0;
    for (i, bound) in bounds.iter().enumerate() {
        cumulative += (3_000.0 * (i as f64 + 1.0)).round();
        let _ = writeln!(
            out,
            "{base}_bucket{{{LABELS},le=\"{bound:?}\"}} {cumulative:?}"
        );
    }
    let _ = writeln!(out, "{base}_bucket{{{LABELS},le=\"+Inf\"}} {cumulative:?}");
    let _ = writeln!(out, "{base}_count{{{LABELS}}} {cumulative:?}");
    let _ = writeln!(out, "{base}_sum{{{LABELS}}} {:?}", cumulative * 0.731);
    created(out, base);
}

/// What `prometheus_client` exports of the Python process itself.
fn process_series(out: &mut String) {
    family(
        out,
        "python_gc_objects_collected_total",
        "Objects collected during gc",
        "counter",
    );
    for (generation, count) in [(0, 18_221.0), (1, 6_204.0), (2, 1_337.0)] {
        let _ = writeln!(
            out,
            "python_gc_objects_collected_total{{generation=\"{generation}\"}} {count:?}"
        );
    }
    family(
        out,
        "python_gc_objects_uncollectable_total",
        "Uncollectable objects found during GC",
        "counter",
    );
    for generation in 0..3 {
        let _ = writeln!(
            out,
            "python_gc_objects_uncollectable_total{{generation=\"{generation}\"}} 0.0"
        );
    }
    family(
        out,
        "python_gc_collections_total",
        "Number of times this generation was collected",
        "counter",
    );
    for (generation, count) in [(0, 2_211.0), (1, 200.0), (2, 12.0)] {
        let _ = writeln!(
            out,
            "python_gc_collections_total{{generation=\"{generation}\"}} {count:?}"
        );
    }
    family(out, "python_info", "Python platform information", "gauge");
    let _ = writeln!(
        out,
        "python_info{{implementation=\"CPython\",major=\"3\",minor=\"12\",patchlevel=\"11\",version=\"3.12.11\"}} 1.0"
    );
    for (name, help, value) in [
        (
            "process_virtual_memory_bytes",
            "Virtual memory size in bytes.",
            8.0157e10,
        ),
        (
            "process_resident_memory_bytes",
            "Resident memory size in bytes.",
            4.9231e9,
        ),
        (
            "process_start_time_seconds",
            "Start time of the process since unix epoch in seconds.",
            1.764e9,
        ),
        (
            "process_cpu_seconds_total",
            "Total user and system CPU time spent in seconds.",
            8812.31,
        ),
        (
            "process_open_fds",
            "Number of open file descriptors.",
            312.0,
        ),
        (
            "process_max_fds",
            "Maximum number of open file descriptors.",
            1_048_576.0,
        ),
    ] {
        let kind = if name.ends_with("_total") {
            "counter"
        } else {
            "gauge"
        };
        family(out, name, help, kind);
        let _ = writeln!(out, "{name} {value:?}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_body_carries_the_three_series_the_poller_reads_and_is_tens_of_kib() {
        let body = vllm_metrics_body(3, 1, 0.42);
        let value = |series: &str| {
            body.lines()
                .find(|l| l.starts_with(&format!("{series}{{")))
                .and_then(|l| l.rsplit(' ').next())
                .map(str::to_string)
        };
        assert_eq!(value("vllm:num_requests_running").as_deref(), Some("3.0"));
        assert_eq!(value("vllm:num_requests_waiting").as_deref(), Some("1.0"));
        assert_eq!(value("vllm:kv_cache_usage_perc").as_deref(), Some("0.42"));
        assert!(
            (20_000..80_000).contains(&body.len()),
            "{} bytes",
            body.len()
        );
        assert!(body.ends_with('\n'));
    }
}
