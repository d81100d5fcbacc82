//! How long reading a body takes, per API and size, fed as Envoy delivers it
//! (16 KiB chunks). The figures are relative: compare the rows side by side.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use prefix_router::classify::ApiKind;
use prefix_router::extract::{Extraction, Extractor, Limits, Progress};
use std::hint::black_box;

const CHUNK: usize = 16 * 1024;

fn limits(prefix_length: usize) -> Limits {
    Limits {
        prefix_length,
        max_body_bytes: 1 << 20,
        include_model: true,
        want_body_tenant: true,
    }
}

fn run(kind: ApiKind, limits: Limits, body: &[u8]) -> Extraction {
    let mut x = Extractor::new(kind, limits);
    for chunk in body.chunks(CHUNK) {
        if x.feed(chunk) == Progress::Done {
            break;
        }
    }
    x.finish()
}

/// A chat body: a system prompt of `system_sentences` sentences (about 70
/// bytes each), then about `turns_size` bytes of user/assistant turns, with
/// `model` last so the whole body must be read.
fn chat_body(turns_size: usize, system_sentences: usize) -> Vec<u8> {
    let sentence = "The quick brown fox jumps over the lazy dog; naïve café, 日本語. ";
    let system = sentence.repeat(system_sentences);
    let mut messages = vec![serde_json::json!({"role": "system", "content": system})];
    let mut len = 0;
    let mut turn = 0;
    while len < turns_size {
        let role = if turn % 2 == 0 { "user" } else { "assistant" };
        let content = format!("turn {turn}: {}", sentence.repeat(8));
        len += content.len() + 40;
        messages.push(serde_json::json!({"role": role, "content": content}));
        turn += 1;
    }
    let messages = serde_json::to_string(&messages).expect("serialisable");
    format!(
        r#"{{"messages":{messages},"temperature":0.2,"prompt_cache_key":"tenant-1","model":"meta-llama/Llama-3-8B-Instruct"}}"#
    )
    .into_bytes()
}

fn bench(c: &mut Criterion) {
    let mut group = c.benchmark_group("extract");

    let invoke: Vec<u8> = (0..8192u32).map(|i| b'a' + (i % 26) as u8).collect();
    group.throughput(Throughput::Bytes(invoke.len() as u64));
    group.bench_function("invoke_4KiB_prefix_of_8KiB", |b| {
        b.iter(|| run(ApiKind::Invoke, limits(4096), black_box(&invoke)))
    });

    // Short system prompts, and (`_long_system`) one of a third of the body,
    // as in the overhead benchmark: its string is far longer than the prefix.
    for (name, turns_size, system_sentences) in [
        ("8KiB", 8 << 10, 20),
        ("64KiB", 64 << 10, 20),
        ("1MiB", (1 << 20) - 4096, 20),
        ("64KiB_long_system", 43 << 10, 300),
        ("1MiB_long_system", 680 << 10, 5000),
    ] {
        let body = chat_body(turns_size, system_sentences);
        let e = run(ApiKind::ChatCompletions, limits(4096), &body);
        assert_eq!(e.fallback, None);
        assert_eq!(
            e.bytes_inspected,
            body.len() - 1,
            "model last: all but the closing brace is read"
        );
        group.throughput(Throughput::Bytes(body.len() as u64));
        group.bench_with_input(
            BenchmarkId::new("chat_4096_chars", name),
            &body,
            |b, body| b.iter(|| run(ApiKind::ChatCompletions, limits(4096), black_box(body))),
        );
        // Baseline: serde_json parsing the whole body into a Value, what a
        // non-incremental extractor would do at least (side-by-side ratio).
        group.bench_with_input(
            BenchmarkId::new("baseline_serde_value", name),
            &body,
            |b, body| {
                b.iter(|| {
                    serde_json::from_slice::<serde_json::Value>(black_box(body))
                        .map(|v| v.is_object())
                })
            },
        );
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
