//! How long reading Envoy's `/clusters` answer takes for `discovery`, per
//! fleet size, with every host's lines as Envoy 1.40 prints them. The answer
//! is read once per `interval_ms` per Envoy.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use prefix_router::discovery::healthy_hosts;
use std::hint::black_box;

/// The stats Envoy prints for each host, in its order.
const HOST_STATS: [&str; 9] = [
    "cx_active",
    "cx_connect_fail",
    "cx_total",
    "rq_active",
    "rq_error",
    "rq_pending_active",
    "rq_success",
    "rq_timeout",
    "rq_total",
];

fn answer(hosts: usize) -> Vec<u8> {
    let mut body = String::from("vllm::observability_name::vllm\nvllm::added_via_api::false\n");
    for i in 0..hosts {
        let host = format!("vllm::10.0.{}.{}:8000", i / 250, i % 250 + 1);
        for stat in HOST_STATS {
            body.push_str(&format!("{host}::{stat}::0\n"));
        }
        body.push_str(&format!("{host}::hostname::vllm-{i}.vllm-headless\n"));
        body.push_str(&format!("{host}::health_flags::healthy\n"));
        for (name, value) in [
            ("weight", "1"),
            ("region", ""),
            ("zone", ""),
            ("sub_zone", ""),
            ("canary", "false"),
            ("priority", "0"),
            ("success_rate", "-1"),
            ("local_origin_success_rate", "-1"),
        ] {
            body.push_str(&format!("{host}::{name}::{value}\n"));
        }
    }
    body.into_bytes()
}

fn bench(c: &mut Criterion) {
    let mut group = c.benchmark_group("discovery");
    for hosts in [8, 64, 256] {
        let body = answer(hosts);
        group.throughput(Throughput::Bytes(body.len() as u64));
        group.bench_with_input(
            BenchmarkId::new("healthy_hosts", hosts),
            &body,
            |b, body| b.iter(|| healthy_hosts(black_box(body), "vllm")),
        );
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
