//! The plugin's callbacks against the in-memory host: what reaches Envoy's
//! headers, metrics and local replies, and what the load tables count.

use std::rc::Rc;

use super::*;
use crate::headers::{COUNTED_HEADER, PENDING_MARK, ROUTE_HEADER};
use crate::host::{Host, MetricKind};
use crate::load::InstanceLoad;
use crate::metrics::{
    fleet_stat_name, in_flight_gauge_name, placed_bytes_counter_name, Counter, UsageCounter,
    BYTES_INSPECTED, DECISION_KINDS,
};
use crate::testing::memory_host::MemoryHost;

type TestVm = Vm<Rc<MemoryHost>>;

const KEY_HEADER: &str = "x-prefix-route-key";
const HOST_HEADER: &str = "x-prefix-route-host";
const A: &str = "10.0.0.1:8000";
const B: &str = "10.0.0.2:8000";

/// What a response to a prefix-aware decision is read for: where it came
/// from and whether its body is scanned for the usage.
const USAGE_WATCH_CALLS: [&str; 2] = ["response_headers", "property upstream.address"];

/// [`configured_as`] with `match: FIXED_PREFIX` unless `json` names a
/// match: most of these tests pin the mechanics of Maglev keys.
fn configured(json: &str) -> (Rc<MemoryHost>, TestVm, PluginRoot) {
    configured_as(&crate::testing::fixed_prefix_unless_named(json))
}

fn configured_as(json: &str) -> (Rc<MemoryHost>, TestVm, PluginRoot) {
    let host = MemoryHost::new();
    let mut vm = Vm::new(Rc::clone(&host));
    let mut root = PluginRoot::default();
    let size = host.set_configuration(json);
    assert!(root.configure(&mut vm, size), "{json}");
    host.take_calls();
    (host, vm, root)
}

fn invoke_body(seed: u8) -> Vec<u8> {
    (0..2_000u32)
        .map(|i| b'a' + (i as u8 ^ seed) % 26)
        .collect()
}

/// A downstream request with `headers` and, if any, a body in one
/// callback: the stream (still open) and the flow of its last callback.
fn request(
    host: &MemoryHost,
    vm: &mut TestVm,
    root: &PluginRoot,
    headers: &[(&str, &str)],
    body: Option<&[u8]>,
) -> (Stream, Flow) {
    host.start_request(headers);
    let mut stream = root.new_stream();
    let flow = stream.on_request_headers(vm, body.is_none());
    let (Flow::Pause, Some(body)) = (flow, body) else {
        return (stream, flow);
    };
    let size = host.arrive(body);
    let flow = stream.on_request_body(vm, size, true);
    (stream, flow)
}

fn invoke(host: &MemoryHost, vm: &mut TestVm, root: &PluginRoot, seed: u8) -> Stream {
    let body = invoke_body(seed);
    let (stream, flow) = request(host, vm, root, &[(":path", "/invocations")], Some(&body));
    assert_eq!(flow, Flow::Continue);
    stream
}

/// The upstream filter's stream for a request the listener sent out with
/// these headers, started on `address`.
fn upstream(
    host: &MemoryHost,
    vm: &mut TestVm,
    root: &PluginRoot,
    headers: &[(&str, &str)],
    address: &str,
) -> Stream {
    host.start_request(headers);
    host.set_property("upstream.address", Some(address));
    let mut stream = root.new_stream();
    assert_eq!(stream.on_request_headers(vm, false), Flow::Continue);
    stream
}

fn in_flight(vm: &mut TestVm, host: &MemoryHost, address: &str) -> Option<u32> {
    let now = host.now_ms().unwrap_or_default();
    let config = crate::config::Config::default();
    vm.with_tracker(&config, |t| t.snapshot(now))
        .into_iter()
        .find(|l| l.address == address)
        .map(|l| l.in_flight)
}

#[test]
fn counters_are_batched_and_flushed_on_the_tick_with_their_deltas() {
    let (host, mut vm, root) = configured("{}");
    // Plus the prefix index's eviction counter.
    assert_eq!(
        host.defined(MetricKind::Counter),
        Counter::ALL.len() + DECISION_KINDS.len() + 1
    );
    assert_eq!(host.defined(MetricKind::Histogram), 3);
    let mut streams: Vec<Stream> = (0..3).map(|i| invoke(&host, &mut vm, &root, i)).collect();
    let (no_body, _) = request(&host, &mut vm, &root, &[(":path", "/invocations")], None);
    streams.push(no_body);
    assert!(
        !host.take_calls().iter().any(|c| c == "increment_metric"),
        "no counter reaches Envoy before the tick"
    );
    assert!(host.metric(BYTES_INSPECTED).unwrap().records.is_empty());

    root.tick(&mut vm);
    let keyed = host.metric(Counter::KeyedInvoke.name()).unwrap();
    assert_eq!(keyed.increments, vec![3], "one increment of the batch");
    assert_eq!(host.counter(Counter::NoKey.name()), 1);
    assert_eq!(host.counter(Counter::ShortBody.name()), 3);
    assert_eq!(host.counter("prefix_router.decision.prefix"), 3);
    assert_eq!(host.counter("prefix_router.decision.no_key"), 1);
    assert_eq!(
        host.metric(BYTES_INSPECTED).unwrap().records,
        vec![2_000, 2_000, 2_000]
    );

    // Nothing new: the next tick hands nothing to Envoy.
    host.advance_ms(1_000);
    root.tick(&mut vm);
    assert_eq!(
        host.metric(Counter::KeyedInvoke.name()).unwrap().increments,
        vec![3]
    );
    invoke(&host, &mut vm, &root, 9);
    host.advance_ms(1_000);
    root.tick(&mut vm);
    assert_eq!(
        host.metric(Counter::KeyedInvoke.name()).unwrap().increments,
        vec![3, 1]
    );
    for mut stream in streams {
        stream.on_done(&mut vm);
    }
}

#[test]
fn histogram_samples_past_the_batch_bound_are_recorded_at_once() {
    let (host, mut vm, _root) = configured("{}");
    let id = host
        .define_metric(MetricKind::Histogram, BYTES_INSPECTED)
        .unwrap();
    for value in 0..MAX_PENDING_SAMPLES as u64 {
        vm.record_later(id, value);
    }
    assert!(host.metric(BYTES_INSPECTED).unwrap().records.is_empty());
    vm.record_later(id, 7);
    assert_eq!(host.metric(BYTES_INSPECTED).unwrap().records, vec![7]);
    vm.flush_metrics();
    let records = host.metric(BYTES_INSPECTED).unwrap().records;
    assert_eq!(records.len(), MAX_PENDING_SAMPLES + 1);
    assert_eq!(records.get(1..4), Some(&[0, 1, 2][..]));
}

fn load(address: &str, in_flight: u32) -> InstanceLoad {
    InstanceLoad {
        address: address.to_string(),
        in_flight,
        fresh: true,
    }
}

#[test]
fn the_gauge_of_an_instance_that_left_drops_to_zero() {
    let host = MemoryHost::new();
    let mut vm = Vm::new(Rc::clone(&host));
    vm.publish_gauges(None, &[load(A, 2), load(B, 1)]);
    assert_eq!(host.gauge(&in_flight_gauge_name(A)), Some(2));
    assert_eq!(host.gauge(&in_flight_gauge_name(B)), Some(1));
    vm.publish_gauges(None, &[load(B, 3)]);
    assert_eq!(host.gauge(&in_flight_gauge_name(A)), Some(0), "left: 0");
    assert_eq!(host.gauge(&in_flight_gauge_name(B)), Some(3));
    // Back again: the same gauge, not a second one.
    vm.publish_gauges(None, &[load(A, 1), load(B, 3)]);
    assert_eq!(host.gauge(&in_flight_gauge_name(A)), Some(1));
    assert_eq!(host.defined(MetricKind::Gauge), 2);
}

#[test]
fn no_more_than_max_gauges_are_defined() {
    let host = MemoryHost::new();
    let mut vm = Vm::new(Rc::clone(&host));
    let loads: Vec<InstanceLoad> = (0..MAX_GAUGES + 6)
        .map(|i| load(&format!("10.0.1.{i}:80"), 1))
        .collect();
    vm.publish_gauges(None, &loads);
    assert_eq!(host.defined(MetricKind::Gauge), MAX_GAUGES);
    vm.publish_gauges(None, &loads);
    assert_eq!(host.defined(MetricKind::Gauge), MAX_GAUGES);
    let beyond = in_flight_gauge_name(&format!("10.0.1.{}:80", MAX_GAUGES));
    assert_eq!(host.gauge(&beyond), None);
}

#[test]
fn two_roots_ticking_in_the_same_period_do_the_work_once() {
    let (host, mut vm, listener) = configured("{}");
    let mut upstream = PluginRoot::default();
    let size = host.set_configuration("{}");
    assert!(upstream.configure(&mut vm, size));
    listener.tick(&mut vm);
    let reads = host.store().reads();
    assert!(reads > 0, "the tick reads the tables");
    host.advance_ms(10);
    upstream.tick(&mut vm);
    assert_eq!(host.store().reads(), reads, "done already this period");
    host.advance_ms(u64::from(TICK_PERIOD_MS));
    upstream.tick(&mut vm);
    assert!(host.store().reads() > reads, "next period: done again");
}

#[test]
fn configure_defines_the_metrics_once_and_sets_the_tick() {
    let (host, mut vm, mut root) = configured(r#"{"concurrency_threshold":3}"#);
    assert_eq!(host.tick_period_ms(), Some(TICK_PERIOD_MS));
    let defined = host.defined(MetricKind::Counter);
    let size = host.set_configuration(r#"{"concurrency_threshold":4}"#);
    assert!(root.configure(&mut vm, size));
    assert!(
        !host
            .take_calls()
            .iter()
            .any(|c| c.starts_with("define_metric")),
        "a reconfiguration defines nothing again"
    );
    assert_eq!(host.defined(MetricKind::Counter), defined);
    let size = host.set_configuration(r#"{"concurrency_threshold":0}"#);
    assert!(!root.configure(&mut vm, size), "out of range: rejected");
    assert!(root.configure(&mut vm, 0), "no configuration: defaults");
}

#[test]
fn a_host_without_a_monotonic_clock_is_refused() {
    let host = MemoryHost::new();
    let mut vm = Vm::new(Rc::clone(&host));
    let mut root = PluginRoot::default();
    let size = host.set_configuration("{}");
    host.set_clock_missing(true);
    assert!(!root.configure(&mut vm, size));
    host.set_clock_missing(false);
    assert!(root.configure(&mut vm, size));
}

#[test]
fn client_sent_owned_headers_are_removed_before_deciding() {
    let (host, mut vm, root) = configured(r#"{"strategy":"RANDOM"}"#);
    let spoofed = [
        (":path", "/invocations"),
        (KEY_HEADER, "0000000000000000"),
        (HOST_HEADER, "10.9.9.9:1"),
        (ROUTE_HEADER, "least_request"),
        (COUNTED_HEADER, A),
        ("x-other", "kept"),
    ];
    let (mut stream, flow) = request(&host, &mut vm, &root, &spoofed, Some(&invoke_body(1)));
    assert_eq!(flow, Flow::Continue);
    assert_eq!(
        host.request_header_names(),
        vec![":path".to_string(), "x-other".to_string()],
        "RANDOM sets none of them"
    );
    stream.on_done(&mut vm);

    let (host, mut vm, root) = configured("{}");
    let (mut stream, _) = request(&host, &mut vm, &root, &spoofed, Some(&invoke_body(1)));
    let key = host.request_header(KEY_HEADER).unwrap();
    assert_ne!(key, "0000000000000000");
    assert_eq!(key.len(), 16);
    assert_eq!(host.request_header(HOST_HEADER), None);
    assert_eq!(host.request_header(ROUTE_HEADER), None);
    assert_eq!(
        host.request_header(COUNTED_HEADER).as_deref(),
        Some(PENDING_MARK),
        "a new key goes out pending"
    );
    stream.on_done(&mut vm);
}

/// A host that cannot give the request headers: the filter's own headers
/// are removed unseen, so a client still cannot steer routing.
#[test]
fn owned_headers_are_removed_when_the_headers_cannot_be_read() {
    let (host, mut vm, root) = configured(r#"{"strategy":"RANDOM"}"#);
    host.start_request(&[
        (":path", "/invocations"),
        (HOST_HEADER, "10.9.9.9:1"),
        (ROUTE_HEADER, "least_request"),
        (COUNTED_HEADER, A),
        ("x-other", "kept"),
    ]);
    host.set_failing("request_headers", true);
    let mut stream = root.new_stream();
    assert_eq!(stream.on_request_headers(&mut vm, true), Flow::Continue);
    assert_eq!(
        host.request_header_names(),
        vec![":path".to_string(), "x-other".to_string()]
    );
    stream.on_done(&mut vm);
}

/// A local reply the host refuses does not end the stream: the request goes
/// on without a key rather than wait until it times out.
#[test]
fn a_refused_local_reply_lets_the_request_go_on() {
    let (host, mut vm, root) = configured("{}");
    host.start_request(&[
        (":path", "/v1/chat/completions"),
        ("x-amzn-sagemaker-prefix-aware-id", ""),
    ]);
    host.set_failing("send_local_response", true);
    let mut stream = root.new_stream();
    assert_eq!(stream.on_request_headers(&mut vm, false), Flow::Continue);
    assert_eq!(host.request_header(KEY_HEADER), None);
    let size = host.arrive(b"{}");
    assert_eq!(stream.on_request_body(&mut vm, size, true), Flow::Continue);
    stream.on_done(&mut vm);
}

/// A body the host cannot give is read again at the next callback, but not
/// held once Envoy buffers `max_body_bytes` (past it, Envoy would answer
/// 413): decided on what was read.
#[test]
fn a_body_that_cannot_be_read_is_not_held_past_max_body_bytes() {
    let (host, mut vm, root) = configured(r#"{"prefix_length":1024,"max_body_bytes":2048}"#);
    host.start_request(&[(":path", "/invocations")]);
    let mut stream = root.new_stream();
    assert_eq!(stream.on_request_headers(&mut vm, false), Flow::Pause);
    let body = vec![b'q'; 3000];
    let size = host.arrive(&body[..512]);
    assert_eq!(stream.on_request_body(&mut vm, size, false), Flow::Pause);
    host.set_failing("request_body", true);
    let size = host.arrive(&body[512..1500]);
    assert_eq!(stream.on_request_body(&mut vm, size, false), Flow::Pause);
    let size = host.arrive(&body[1500..]);
    assert_eq!(stream.on_request_body(&mut vm, size, false), Flow::Continue);
    assert!(
        host.request_header(KEY_HEADER).is_some(),
        "keyed on what was read"
    );
    stream.on_done(&mut vm);
}

#[test]
fn an_invalid_tenant_gets_the_local_reply_and_pause() {
    let (host, mut vm, root) = configured("{}");
    let long = "t".repeat(65);
    let headers = [
        (":path", "/v1/chat/completions"),
        ("x-amzn-sagemaker-prefix-aware-id", long.as_str()),
    ];
    host.start_request(&headers);
    let mut stream = root.new_stream();
    assert_eq!(stream.on_request_headers(&mut vm, false), Flow::Pause);
    let replies = host.replies();
    assert_eq!(replies.len(), 1);
    let reply = &replies[0];
    assert_eq!(reply.status, 400);
    assert_eq!(reply.details, "prefix_router_invalid_tenant_header");
    let body: serde_json::Value = serde_json::from_slice(&reply.body).unwrap();
    assert_eq!(body["error"]["code"], "invalid_tenant_header");
    assert_eq!(host.request_header(KEY_HEADER), None);
    // Envoy may still call the body callback: it reads and writes nothing.
    host.take_calls();
    let size = host.arrive(b"{}");
    assert_eq!(stream.on_request_body(&mut vm, size, true), Flow::Continue);
    assert_eq!(host.take_calls(), Vec::<String>::new());
    root.tick(&mut vm);
    assert_eq!(host.counter(Counter::TenantRejected.name()), 1);
    assert_eq!(host.counter(Counter::NoKey.name()), 0);
}

#[test]
fn the_decision_header_names_the_kind_and_the_instance() {
    let (host, mut vm, root) = configured(r#"{"decision_header":"x-decision"}"#);
    let mut stream = invoke(&host, &mut vm, &root, 2);
    host.set_property("upstream.address", Some(A));
    assert_eq!(stream.on_response_headers(&mut vm), Flow::Continue);
    assert_eq!(
        host.response_header("x-decision").as_deref(),
        Some("prefix; instance=10.0.0.1:8000")
    );
    stream.on_done(&mut vm);

    let (mut stream, _) = request(&host, &mut vm, &root, &[(":path", "/x")], None);
    stream.on_response_headers(&mut vm);
    assert_eq!(
        host.response_header("x-decision").as_deref(),
        Some("no_key")
    );
    stream.on_done(&mut vm);

    // No decision header, counted upstream: read for its usage only.
    for (json, read) in [
        ("{}", &USAGE_WATCH_CALLS[..]),
        (r#"{"read_usage": false}"#, &[]),
    ] {
        let (host, mut vm, root) = configured(json);
        // The cluster's upstream filter counts in this VM.
        upstream(&host, &mut vm, &root, &[(":path", "/invocations")], B).on_done(&mut vm);
        host.set_property("upstream.address", None);
        let mut stream = invoke(&host, &mut vm, &root, 2);
        host.set_property("upstream.address", Some(A));
        host.take_calls();
        stream.on_response_headers(&mut vm);
        assert_eq!(host.take_calls(), read, "{json}");
        stream.on_done(&mut vm);
    }
}

#[test]
fn the_upstream_role_counts_where_envoy_sent_the_request_and_strips_the_internal_headers() {
    let (host, mut vm, root) = configured("{}");
    let sent = [
        (":path", "/invocations"),
        (KEY_HEADER, "00000000000000aa"),
        (COUNTED_HEADER, PENDING_MARK),
        (ROUTE_HEADER, "x"),
    ];
    let mut stream = upstream(&host, &mut vm, &root, &sent, A);
    assert_eq!(
        host.request_header_names(),
        vec![":path".to_string(), KEY_HEADER.to_string()]
    );
    assert_eq!(in_flight(&mut vm, &host, A), Some(1));
    // The body passes untouched (no read): the listener decided already.
    host.take_calls();
    let size = host.arrive(b"body");
    assert_eq!(stream.on_request_body(&mut vm, size, true), Flow::Continue);
    assert_eq!(stream.on_response_headers(&mut vm), Flow::Continue);
    // The answer is looked for a failed mark to clear, in the copy of A's
    // record the count just read.
    assert_eq!(host.take_calls(), vec!["now_ms"]);
    stream.on_done(&mut vm);
    assert_eq!(in_flight(&mut vm, &host, A), Some(0), "released on done");
}

/// An upstream attempt that ends unanswered with a transport failure (its
/// connection was refused) marks its instance failed and counts it; the
/// instance's next answer clears the mark.
#[test]
fn an_attempt_whose_connection_failed_marks_its_instance_until_it_answers() {
    let (host, mut vm, root) = configured(&format!(r#"{{"instances": ["{A}", "{B}"]}}"#));
    let candidates = |vm: &mut TestVm, host: &MemoryHost| {
        let now = host.now_ms().unwrap_or_default();
        let config = crate::config::Config::default();
        let mut all: Vec<String> = vm
            .with_tracker(&config, |t| crate::load::LoadView::candidates(t, now))
            .into_iter()
            .map(|c| c.instance.address.to_string())
            .collect();
        all.sort();
        all
    };
    // An attempt that connected and ended without an answer (the client
    // went away) marks nothing.
    let mut served = upstream(&host, &mut vm, &root, &[(":path", "/x")], B);
    host.set_property("upstream.transport_failure_reason", Some(""));
    served.on_done(&mut vm);
    assert_eq!(candidates(&mut vm, &host), [A, B]);

    let reason = "delayed connect error: Connection refused";
    for _ in 0..2 {
        let mut refused = upstream(&host, &mut vm, &root, &[(":path", "/x")], B);
        host.set_property("upstream.transport_failure_reason", Some(reason));
        refused.on_done(&mut vm);
    }
    vm.flush_metrics();
    assert_eq!(host.counter(Counter::ConnectionFailed.name()), 2);
    assert_eq!(
        host.counter(Counter::InstanceFailed.name()),
        1,
        "newly failed once"
    );
    assert_eq!(candidates(&mut vm, &host), [A]);

    let mut answering = upstream(&host, &mut vm, &root, &[(":path", "/x")], B);
    host.set_property("upstream.transport_failure_reason", Some(""));
    assert_eq!(answering.on_response_headers(&mut vm), Flow::Continue);
    answering.on_done(&mut vm);
    assert_eq!(candidates(&mut vm, &host), [A, B], "back once it answered");
}

/// A downstream request's host calls: the role check, one header read,
/// the body read, the clock, the header writes; the release at the end.
#[test]
fn a_keyed_request_reads_headers_and_body_once_and_writes_two_headers() {
    let (host, mut vm, root) = configured("{}");
    // The key's first request, counted and learned by the upstream filter.
    let mut first = invoke(&host, &mut vm, &root, 3);
    let key = host.request_header(KEY_HEADER).unwrap();
    let sent = [(KEY_HEADER, key.as_str()), (COUNTED_HEADER, PENDING_MARK)];
    let mut first_upstream = upstream(&host, &mut vm, &root, &sent, A);
    first_upstream.on_done(&mut vm);
    first.on_done(&mut vm);
    host.take_calls();
    let mut stream = invoke(&host, &mut vm, &root, 3);
    assert_eq!(
        host.take_calls(),
        vec![
            "property upstream.address",
            "request_headers",
            "request_body",
            "now_ms",
            "replace_request_header x-prefix-route-key",
            "replace_request_header x-prefix-router-counted",
        ]
    );
    stream.on_done(&mut vm);
    assert_eq!(host.take_calls(), vec!["now_ms"]);
}

#[test]
fn a_body_ended_by_trailers_is_decided_at_the_trailers() {
    let (host, mut vm, root) = configured("{}");
    host.start_request(&[(":path", "/invocations")]);
    let mut stream = root.new_stream();
    assert_eq!(stream.on_request_headers(&mut vm, false), Flow::Pause);
    let size = host.arrive(b"short body");
    assert_eq!(stream.on_request_body(&mut vm, size, false), Flow::Pause);
    assert_eq!(host.request_header(KEY_HEADER), None);
    assert_eq!(stream.on_request_trailers(&mut vm), Flow::Continue);
    assert!(host.request_header(KEY_HEADER).is_some());
    stream.on_done(&mut vm);
}

/// `counting: LISTENER`: the first request of a key is counted at its
/// response; the next, claimed on the learned target, reads nothing at its
/// response unless its check is due or a decision header wants the
/// instance, and is moved if Envoy sent it elsewhere.
#[test]
fn counting_at_the_response_acts_only_when_it_should() {
    let (host, mut vm, root) = configured(r#"{"counting":"LISTENER"}"#);
    // Counting in the listener: no role check at the request headers.
    host.set_property("upstream.address", Some(B));
    let mut first = invoke(&host, &mut vm, &root, 4);
    assert!(!host.take_calls().iter().any(|c| c.starts_with("property")));
    assert_eq!(
        host.request_header(COUNTED_HEADER),
        None,
        "no counted header for a filter that is not there"
    );
    assert_eq!(in_flight(&mut vm, &host, A), None, "nothing counted yet");
    host.set_property("upstream.address", Some(A));
    first.on_response_headers(&mut vm);
    assert_eq!(
        in_flight(&mut vm, &host, A),
        Some(1),
        "counted at its response"
    );

    let mut second = invoke(&host, &mut vm, &root, 4);
    assert_eq!(
        in_flight(&mut vm, &host, A),
        Some(2),
        "claimed at the decision"
    );
    host.set_property("upstream.address", Some(A));
    host.take_calls();
    second.on_response_headers(&mut vm);
    assert_eq!(
        host.take_calls(),
        USAGE_WATCH_CALLS,
        "claimed on the target, check not due: only read for its usage"
    );
    assert_eq!(in_flight(&mut vm, &host, A), Some(2), "not counted twice");
    for mut stream in [first, second] {
        stream.on_done(&mut vm);
    }
    assert_eq!(in_flight(&mut vm, &host, A), Some(0));

    // With a decision header the instance is read anyway, and a count taken
    // on the wrong instance moves.
    let (host, mut vm, root) =
        configured(r#"{"counting":"LISTENER","decision_header":"x-decision"}"#);
    let mut first = invoke(&host, &mut vm, &root, 5);
    host.set_property("upstream.address", Some(A));
    first.on_response_headers(&mut vm);
    first.on_done(&mut vm);
    let mut second = invoke(&host, &mut vm, &root, 5);
    assert_eq!(in_flight(&mut vm, &host, A), Some(1), "claimed on A");
    host.set_property("upstream.address", Some(B));
    second.on_response_headers(&mut vm);
    assert_eq!(in_flight(&mut vm, &host, A), Some(0), "moved off A");
    assert_eq!(in_flight(&mut vm, &host, B), Some(1), "onto B");
    assert_eq!(
        host.response_header("x-decision").as_deref(),
        Some("prefix; instance=10.0.0.2:8000")
    );
    second.on_done(&mut vm);
    assert_eq!(in_flight(&mut vm, &host, B), Some(0));
}

/// Default counting, but no upstream filter ever ran in this VM (none on the
/// cluster, or another vm_id): the listener counts at the response, and the
/// stat says so; once an upstream filter runs, the listener leaves it.
#[test]
fn without_an_upstream_filter_the_listener_counts_and_says_so() {
    let (host, mut vm, root) = configured("{}");
    let mut first = invoke(&host, &mut vm, &root, 6);
    assert_eq!(in_flight(&mut vm, &host, A), None, "nothing counted yet");
    host.set_property("upstream.address", Some(A));
    first.on_response_headers(&mut vm);
    assert_eq!(
        in_flight(&mut vm, &host, A),
        Some(1),
        "no upstream filter: counted by the listener at the response"
    );
    host.set_property("upstream.address", None);
    let mut second = invoke(&host, &mut vm, &root, 6);
    assert_eq!(
        in_flight(&mut vm, &host, A),
        Some(2),
        "its target learned: claimed at the decision"
    );
    host.set_property("upstream.address", Some(A));
    second.on_response_headers(&mut vm);
    assert_eq!(in_flight(&mut vm, &host, A), Some(2), "not counted twice");
    for mut stream in [first, second] {
        stream.on_done(&mut vm);
    }
    assert_eq!(in_flight(&mut vm, &host, A), Some(0));
    root.tick(&mut vm);
    assert_eq!(host.counter(Counter::UpstreamFilterMissing.name()), 2);

    // A response that no instance sent (no upstream.address: Envoy's own
    // 503) says nothing about upstream filters.
    let (host, mut vm, root) = configured("{}");
    host.set_property("upstream.address", None);
    let mut local = invoke(&host, &mut vm, &root, 7);
    local.on_response_headers(&mut vm);
    local.on_done(&mut vm);
    root.tick(&mut vm);
    assert_eq!(host.counter(Counter::UpstreamFilterMissing.name()), 0);

    // With the upstream filter in the VM, the listener counts nothing.
    let (host, mut vm, root) = configured("{}");
    let mut listener = invoke(&host, &mut vm, &root, 8);
    let key = host.request_header(KEY_HEADER).unwrap();
    let sent = [(KEY_HEADER, key.as_str()), (COUNTED_HEADER, PENDING_MARK)];
    let mut counted = upstream(&host, &mut vm, &root, &sent, A);
    assert_eq!(
        in_flight(&mut vm, &host, A),
        Some(1),
        "the upstream filter's"
    );
    listener.on_response_headers(&mut vm);
    assert_eq!(
        in_flight(&mut vm, &host, A),
        Some(1),
        "the listener's: none"
    );
    counted.on_done(&mut vm);
    listener.on_done(&mut vm);
    assert_eq!(in_flight(&mut vm, &host, A), Some(0));
    root.tick(&mut vm);
    assert_eq!(host.counter(Counter::UpstreamFilterMissing.name()), 0);
}

/// The upstream filter's mark is seen by a listener in another VM of the
/// same Envoy (the same shared data), which then counts nothing itself.
#[test]
fn the_upstream_filters_mark_reaches_other_vms() {
    let (host, mut vm, root) = configured("{}");
    let mut marking = upstream(&host, &mut vm, &root, &[(":path", "/invocations")], B);
    marking.on_done(&mut vm);
    host.set_property("upstream.address", None);
    let mut other_vm = Vm::new(Rc::clone(&host));
    let mut listener = invoke(&host, &mut other_vm, &root, 9);
    host.set_property("upstream.address", Some(A));
    listener.on_response_headers(&mut other_vm);
    assert_eq!(
        in_flight(&mut other_vm, &host, A),
        None,
        "counted by the upstream filter, not here"
    );
    listener.on_done(&mut other_vm);
    root.tick(&mut other_vm);
    assert_eq!(host.counter(Counter::UpstreamFilterMissing.name()), 0);
}

#[test]
fn random_numbers_need_no_host_entropy() {
    let host = MemoryHost::new();
    host.set_entropy(None);
    let mut vm = Vm::new(Rc::clone(&host));
    let draws: Vec<u64> = (0..4).map(|_| vm.random()).collect();
    for (i, a) in draws.iter().enumerate() {
        for b in &draws[i + 1..] {
            assert_ne!(a, b, "{draws:?}");
        }
    }
    let seeded = |entropy: u64| {
        let host = MemoryHost::new();
        host.set_entropy(Some(entropy));
        Vm::new(host).random()
    };
    assert_ne!(seeded(1), seeded(2), "VMs with their own entropy differ");
    assert_eq!(
        host.take_calls()
            .iter()
            .filter(|c| *c == "random_u64")
            .count(),
        1,
        "the host's entropy is asked once per VM"
    );
}

#[test]
fn longest_prefix_names_the_instance_holding_the_prompt_and_fills_the_index() {
    let (host, mut vm, root) = configured_as(
        r#"{"decision_header":"x-decision","instances":["10.0.0.1:8000","10.0.0.2:8000"]}"#,
    );
    let mut first = invoke(&host, &mut vm, &root, 4);
    let chosen = host
        .request_header(HOST_HEADER)
        .expect("the chosen instance is named");
    assert!([A, B].contains(&chosen.as_str()), "{chosen}");
    host.set_property("upstream.address", Some(&chosen));
    first.on_response_headers(&mut vm);
    // Nothing held: both cost the whole prompt, the opening's rank chose.
    let other = if chosen == A { B } else { A };
    assert_eq!(
        host.response_header("x-decision"),
        Some(format!(
            "cold; instance={chosen}; matched=0; \
             cost 2.0 = load 0.0 + prefill 2.0 + share 0.0; \
             runner-up {other} cost 2.0 = load 0.0 + prefill 2.0 + share 0.0"
        ))
    );
    first.on_done(&mut vm);
    // The same prompt, longer: matched where the first went, on every block
    // the first one filled (2,000 bytes: 7 full blocks of 256).
    let mut body = invoke_body(4);
    body.extend_from_slice(b" and a follow-up question");
    let (mut second, _) = request(
        &host,
        &mut vm,
        &root,
        &[(":path", "/invocations")],
        Some(&body),
    );
    assert_eq!(host.request_header(HOST_HEADER), Some(chosen.clone()));
    host.set_property("upstream.address", Some(&chosen));
    second.on_response_headers(&mut vm);
    let decision = host.response_header("x-decision").unwrap();
    let prefix = format!("matched; instance={chosen}; matched=1792; cost ");
    assert!(decision.starts_with(&prefix), "{decision}");
    second.on_done(&mut vm);
    host.advance_ms(u64::from(TICK_PERIOD_MS));
    root.tick(&mut vm);
    // The first prompt's 8 blocks, then the second's last one (its 8th block,
    // 233 bytes, differs from the first's partial one). A gauge every VM adds
    // its own new entries to.
    assert_eq!(host.counter(crate::metrics::INDEX_ENTRIES), 9);
    assert_eq!(host.gauge(crate::metrics::INDEX_CAPACITY), Some(523_264));
    assert_eq!(
        host.metric(crate::metrics::MATCHED_BYTES).unwrap().records,
        vec![0, 1792]
    );
    // The bytes each decision added there: 2,000, then 2,025 - 1,792, in one
    // increment of the batch; the other instance got none.
    let placed = |address: &str| host.metric(&placed_bytes_counter_name(address));
    assert_eq!(placed(&chosen).unwrap().increments, vec![2_000 + 233]);
    let other = if chosen == A { B } else { A };
    assert!(placed(other).is_none(), "no stat for {other}");
    // A repeat adds nothing.
    invoke(&host, &mut vm, &root, 4).on_done(&mut vm);
    host.advance_ms(u64::from(TICK_PERIOD_MS));
    root.tick(&mut vm);
    assert_eq!(placed(&chosen).unwrap().increments, vec![2_000 + 233]);
}

#[test]
fn a_fleet_names_every_stat_and_an_update_to_another_fleet_names_the_next_ones() {
    let listed = r#""instances":["10.0.0.1:8000","10.0.0.2:8000"]"#;
    let (host, mut vm, mut root) = configured_as(&format!(r#"{{"fleet":"llama",{listed}}}"#));
    let mut first = invoke(&host, &mut vm, &root, 4);
    let chosen = host.request_header(HOST_HEADER).expect("named");
    host.set_property("upstream.address", Some(&chosen));
    first.on_response_headers(&mut vm);
    first.on_done(&mut vm);
    host.advance_ms(u64::from(TICK_PERIOD_MS));
    root.tick(&mut vm);
    let llama = |name: &str| fleet_stat_name(Some("llama"), name);
    assert_eq!(host.counter(&llama("prefix_router.decision.cold")), 1);
    assert_eq!(host.counter(&llama(Counter::KeyedInvoke.name())), 1);
    assert_eq!(host.counter(&llama(crate::metrics::INDEX_ENTRIES)), 8);
    assert_eq!(
        host.counter(&llama(&placed_bytes_counter_name(&chosen))),
        2_000
    );
    assert_eq!(host.gauge(&llama(&in_flight_gauge_name(A))), Some(0));
    assert_eq!(host.gauge(&llama(&in_flight_gauge_name(B))), Some(0));
    let names = host.metric_names();
    assert!(
        names
            .iter()
            .all(|n| n.starts_with("prefix_router.fleet.llama.")),
        "every stat is the fleet's: {names:?}"
    );
    // An update that renames the fleet: the next requests count under the
    // new names, the old stats stay as they were.
    let size = host.set_configuration(&format!(r#"{{"fleet":"llama-2",{listed}}}"#));
    assert!(root.configure(&mut vm, size));
    invoke(&host, &mut vm, &root, 4).on_done(&mut vm);
    host.advance_ms(u64::from(TICK_PERIOD_MS));
    root.tick(&mut vm);
    let renamed = |name: &str| fleet_stat_name(Some("llama-2"), name);
    assert_eq!(host.counter(&renamed("prefix_router.decision.matched")), 1);
    assert_eq!(host.counter(&llama("prefix_router.decision.matched")), 0);
    assert_eq!(host.counter(&llama("prefix_router.decision.cold")), 1);
    assert_eq!(host.gauge(&renamed(&in_flight_gauge_name(A))), Some(0));
    assert!(host.metric("prefix_router.decision.matched").is_none());
}

#[test]
fn without_a_listed_fleet_a_cold_prompt_goes_by_maglev_and_is_indexed_at_its_response() {
    let (host, mut vm, root) = configured_as(r#"{"decision_header":"x-decision"}"#);
    // The upstream filter has seen A serve: A is known, the fleet is not.
    upstream(&host, &mut vm, &root, &[(":path", "/invocations")], A).on_done(&mut vm);
    host.set_property("upstream.address", None);
    let mut first = invoke(&host, &mut vm, &root, 6);
    assert_eq!(host.request_header(HOST_HEADER), None, "Maglev decides");
    // Where Maglev sends it is not known at the decision: no bytes counted.
    host.advance_ms(u64::from(TICK_PERIOD_MS));
    root.tick(&mut vm);
    assert!(host.metric(&placed_bytes_counter_name(A)).is_none());
    let opening = host.request_header(KEY_HEADER).expect("the opening's key");
    host.set_property("upstream.address", Some(A));
    first.on_response_headers(&mut vm);
    assert_eq!(
        host.response_header("x-decision").as_deref(),
        Some("cold; instance=10.0.0.1:8000; matched=0")
    );
    first.on_done(&mut vm);
    let mut second = invoke(&host, &mut vm, &root, 6);
    assert_eq!(host.request_header(HOST_HEADER).as_deref(), Some(A));
    assert_eq!(host.request_header(KEY_HEADER), Some(opening));
    host.set_property("upstream.address", Some(A));
    second.on_response_headers(&mut vm);
    assert_eq!(
        host.response_header("x-decision").as_deref(),
        Some(
            "matched; instance=10.0.0.1:8000; matched=2000; \
             cost 0.0 = load 0.0 + prefill 0.0 + share 0.0"
        )
    );
    second.on_done(&mut vm);
}

/// Delivers a response from `address` with `headers` and `chunks` to
/// `stream`, every callback answering Continue, then ends the stream.
fn respond_with_body(
    host: &MemoryHost,
    vm: &mut TestVm,
    stream: &mut Stream,
    address: &str,
    headers: &[(&str, &str)],
    chunks: &[&[u8]],
) {
    host.set_property("upstream.address", Some(address));
    for (name, value) in headers {
        host.replace_response_header(name, value.as_bytes())
            .unwrap();
    }
    // Only the callbacks' own host calls remain to be taken.
    host.take_calls();
    assert_eq!(stream.on_response_headers(vm), Flow::Continue);
    for (i, chunk) in chunks.iter().enumerate() {
        let size = host.deliver_response_chunk(chunk);
        let end = i + 1 == chunks.len();
        assert_eq!(stream.on_response_body(vm, size, end), Flow::Continue);
    }
    stream.on_done(vm);
}

fn usage_count(host: &MemoryHost, counter: UsageCounter, address: &str) -> i64 {
    host.counter(&crate::metrics::instance_stat_name(
        counter.prefix(),
        address,
    ))
}

const JSON_OK: [(&str, &str); 2] = [(":status", "200"), ("content-type", "application/json")];

#[test]
fn a_prefix_aware_response_counts_the_usage_its_engine_reported() {
    let (host, mut vm, root) = configured("{}");
    let body = br#"{"id":"x","choices":[{"text":"\"usage\":{\"prompt_tokens\":1}"}],"usage":{"prompt_tokens":1536,"prompt_tokens_details":{"cached_tokens":1408}}}"#;
    let (head, tail) = body.split_at(70);
    let mut stream = invoke(&host, &mut vm, &root, 1);
    respond_with_body(&host, &mut vm, &mut stream, A, &JSON_OK, &[head, tail, b""]);
    let calls = host.take_calls();
    assert!(
        !calls.iter().any(|c| c.starts_with("replace_response")),
        "the response is not changed: {calls:?}"
    );
    assert_eq!(calls.iter().filter(|c| *c == "response_body").count(), 2);
    // A response with no usage, and one streamed with a usage chunk.
    let mut bare = invoke(&host, &mut vm, &root, 2);
    respond_with_body(&host, &mut vm, &mut bare, A, &JSON_OK, &[b"{}"]);
    let mut streamed = invoke(&host, &mut vm, &root, 3);
    let events = [(":status", "200"), ("content-type", "text/event-stream")];
    let chunks: [&[u8]; 2] = [
        b"data: {\"usage\":null}\n\ndata: {\"usage\":{\"prompt_tok",
        b"ens\":20}}\n\ndata: [DONE]\n\n",
    ];
    respond_with_body(&host, &mut vm, &mut streamed, B, &events, &chunks);
    root.tick(&mut vm);
    for (counter, at_a, at_b) in [
        (UsageCounter::Responses, 2, 1),
        (UsageCounter::Reported, 1, 1),
        (UsageCounter::ReportedCached, 1, 0),
        (UsageCounter::PromptTokens, 1536, 20),
        (UsageCounter::CachedTokens, 1408, 0),
    ] {
        assert_eq!(usage_count(&host, counter, A), at_a, "{counter:?}");
        assert_eq!(usage_count(&host, counter, B), at_b, "{counter:?}");
    }
}

#[test]
fn failed_encoded_unpredicted_or_switched_off_responses_are_not_read_for_usage() {
    let usage = br#"{"usage":{"prompt_tokens":5}}"#;
    let (host, mut vm, root) = configured("{}");
    let cases: [&[(&str, &str)]; 3] = [
        &[(":status", "503"), ("content-type", "application/json")],
        &[(":status", "200"), ("content-encoding", "gzip")],
        &[],
    ];
    for headers in cases {
        let mut stream = invoke(&host, &mut vm, &root, 1);
        respond_with_body(&host, &mut vm, &mut stream, A, headers, &[usage]);
        let calls = host.take_calls();
        assert!(!calls.contains(&"response_body".to_string()), "{calls:?}");
    }
    // No key: no prediction to compare with.
    let (mut no_key, _) = request(&host, &mut vm, &root, &[(":path", "/v1/models")], None);
    respond_with_body(&host, &mut vm, &mut no_key, A, &JSON_OK, &[usage]);
    let (lor_host, mut lor_vm, lor_root) =
        configured(r#"{"strategy": "LEAST_OUTSTANDING_REQUESTS"}"#);
    let mut least = invoke(&lor_host, &mut lor_vm, &lor_root, 1);
    respond_with_body(&lor_host, &mut lor_vm, &mut least, A, &JSON_OK, &[usage]);
    // `read_usage: false`: the response side off.
    let (off_host, mut off_vm, off_root) = configured(r#"{"read_usage": false}"#);
    let mut off = invoke(&off_host, &mut off_vm, &off_root, 1);
    respond_with_body(&off_host, &mut off_vm, &mut off, A, &JSON_OK, &[usage]);
    let calls = off_host.take_calls();
    assert!(!calls.contains(&"response_body".to_string()), "{calls:?}");
    root.tick(&mut vm);
    lor_root.tick(&mut lor_vm);
    off_root.tick(&mut off_vm);
    assert_eq!(usage_count(&host, UsageCounter::Responses, A), 0);
    assert_eq!(usage_count(&lor_host, UsageCounter::Responses, A), 0);
    assert_eq!(usage_count(&off_host, UsageCounter::Responses, A), 0);
}

#[test]
fn a_response_cut_short_counts_once_with_what_arrived() {
    let (host, mut vm, root) = configured("{}");
    let mut stream = invoke(&host, &mut vm, &root, 1);
    host.set_property("upstream.address", Some(A));
    for (name, value) in JSON_OK {
        host.replace_response_header(name, value.as_bytes())
            .unwrap();
    }
    stream.on_response_headers(&mut vm);
    let size = host.deliver_response_chunk(br#"{"usage":{"prompt_tokens":5}"#);
    assert_eq!(
        stream.on_response_body(&mut vm, size, false),
        Flow::Continue
    );
    stream.on_done(&mut vm);
    stream.on_done(&mut vm);
    // A chunk the host cannot hand over leaves the usage unknown.
    let mut unread = invoke(&host, &mut vm, &root, 2);
    host.set_failing("response_body", true);
    respond_with_body(
        &host,
        &mut vm,
        &mut unread,
        A,
        &JSON_OK,
        &[br#"{"usage":{"prompt_tokens":5}}"#],
    );
    root.tick(&mut vm);
    assert_eq!(usage_count(&host, UsageCounter::Responses, A), 2);
    assert_eq!(usage_count(&host, UsageCounter::Reported, A), 0);
}

#[test]
fn adapters_set_size_gauges_are_named_safely_and_bounded_per_vm() {
    let host = MemoryHost::new();
    let mut vm: TestVm = Vm::new(Rc::clone(&host));
    vm.set_adapter_instances(None, b"sql-lora", 2);
    vm.set_adapter_instances(None, b"sql-lora", 3);
    let gauge = |name: &[u8]| host.gauge(&crate::metrics::adapter_stat_name(name));
    assert_eq!(gauge(b"sql-lora"), Some(3), "its latest set");
    for n in 0..2 * vm::MAX_ADAPTER_GAUGES {
        vm.set_adapter_instances(None, format!("lora-{n}").as_bytes(), 1);
    }
    // sql-lora and the first 63 others.
    assert_eq!(gauge(b"lora-62"), Some(1));
    assert_eq!(gauge(b"lora-63"), None);
    vm.set_adapter_instances(Some("fleet-a"), b"sql-lora", 1);
    let in_fleet = fleet_stat_name(
        Some("fleet-a"),
        &crate::metrics::adapter_stat_name(b"sql-lora"),
    );
    assert_eq!(host.gauge(&in_fleet), Some(1));
}

/// A vLLM usage body: `prompt_tokens`, of which `cached_tokens` were found.
fn usage_body(prompt_tokens: u32, cached_tokens: u32) -> Vec<u8> {
    format!(
        r#"{{"usage":{{"prompt_tokens":{prompt_tokens},"prompt_tokens_details":{{"cached_tokens":{cached_tokens}}}}}}}"#
    )
    .into_bytes()
}

/// Sends `body` to `/invocations`, answers from the instance the decision
/// named with `usage`, and returns that instance and the decision header.
fn decide_and_answer(
    host: &MemoryHost,
    vm: &mut TestVm,
    root: &PluginRoot,
    body: &[u8],
    usage: &[u8],
) -> (String, String) {
    let (mut stream, _) = request(host, vm, root, &[(":path", "/invocations")], Some(body));
    let chosen = host.request_header(HOST_HEADER).expect("an instance named");
    respond_with_body(host, vm, &mut stream, &chosen, &JSON_OK, &[usage]);
    (
        chosen,
        host.response_header("x-decision").unwrap_or_default(),
    )
}

#[test]
fn an_engine_that_lost_a_settled_prefix_makes_the_index_forget_its_older_holdings() {
    let (host, mut vm, root) = configured_as(
        r#"{"decision_header":"x-decision","instances":["10.0.0.1:8000","10.0.0.2:8000"]}"#,
    );
    // Ten cold prompts of 2,000 bytes, 500 tokens each: 4 bytes per token.
    let cold = usage_body(500, 0);
    let placed: Vec<(u8, String)> = (1..=10)
        .map(|seed| {
            let (chosen, _) = decide_and_answer(&host, &mut vm, &root, &invoke_body(seed), &cold);
            (seed, chosen)
        })
        .collect();
    let lost_on = placed[0].1.clone();
    let other_on_lost = placed.iter().skip(1).find(|(_, at)| *at == lost_on);
    let on_the_other = placed.iter().find(|(_, at)| *at != lost_on);
    let (Some(&(other_seed, _)), Some(&(kept_seed, ref kept_at))) = (other_on_lost, on_the_other)
    else {
        panic!("both instances hold prompts: {placed:?}");
    };
    // A turn of the first prompt, settled, held by nothing its engine has.
    host.advance_ms(u64::from(crate::usage::check::SETTLED_SECS) * 1000);
    let mut turn = invoke_body(1);
    turn.extend_from_slice(b" and a follow-up question");
    let (chosen, decision) = decide_and_answer(&host, &mut vm, &root, &turn, &usage_body(506, 0));
    assert_eq!(chosen, lost_on);
    assert!(decision.contains("matched=1792"), "{decision}");
    root.tick(&mut vm);
    assert_eq!(usage_count(&host, UsageCounter::IndexMisses, &lost_on), 1);
    assert_eq!(usage_count(&host, UsageCounter::IndexForgets, &lost_on), 1);
    // Its other prompt of the same age is no longer believed held there;
    // the other instance's is, and so is the turn recorded since.
    let held = usage_body(500, 448);
    let (_, decision) = decide_and_answer(&host, &mut vm, &root, &invoke_body(other_seed), &held);
    assert!(decision.contains("matched=0"), "{decision}");
    let (at, decision) = decide_and_answer(&host, &mut vm, &root, &invoke_body(kept_seed), &held);
    assert_eq!(&at, kept_at);
    assert!(decision.contains("matched=2000"), "{decision}");
    let (at, decision) = decide_and_answer(&host, &mut vm, &root, &turn, &usage_body(506, 448));
    assert_eq!(at, lost_on);
    assert!(decision.contains("matched=2025"), "{decision}");
    root.tick(&mut vm);
    assert_eq!(
        usage_count(&host, UsageCounter::IndexMisses, &lost_on),
        1,
        "held as predicted: no miss"
    );
}

#[test]
fn a_miss_on_a_recent_holding_is_counted_and_forgets_nothing() {
    let (host, mut vm, root) = configured_as(
        r#"{"decision_header":"x-decision","instances":["10.0.0.1:8000","10.0.0.2:8000"]}"#,
    );
    let cold = usage_body(500, 0);
    for seed in 1..=10 {
        decide_and_answer(&host, &mut vm, &root, &invoke_body(seed), &cold);
    }
    // Still being prefilled by the request that recorded it, perhaps.
    host.advance_ms(1000);
    let (at, _) = decide_and_answer(&host, &mut vm, &root, &invoke_body(1), &cold);
    root.tick(&mut vm);
    assert_eq!(usage_count(&host, UsageCounter::IndexMisses, &at), 1);
    assert_eq!(usage_count(&host, UsageCounter::IndexForgets, &at), 0);
    let (again, decision) = decide_and_answer(&host, &mut vm, &root, &invoke_body(1), &cold);
    assert_eq!(again, at);
    assert!(decision.contains("matched=2000"), "{decision}");
}

#[test]
fn each_model_s_bytes_per_token_judge_its_own_responses() {
    let instances = ["10.0.0.1:8000", "10.0.0.2:8000"];
    let (host, mut vm, root) = configured_as(
        r#"{"decision_header":"x-decision","instances":["10.0.0.1:8000","10.0.0.2:8000"]}"#,
    );
    let chat = |model: &str, seed: u8| -> Vec<u8> {
        let text = String::from_utf8(invoke_body(seed)).unwrap();
        format!(r#"{{"model":"{model}","messages":[{{"role":"user","content":"{text}"}}]}}"#)
            .into_bytes()
    };
    let mut answer = |body: &[u8], usage: &[u8]| {
        let headers = [(":path", "/v1/chat/completions")];
        let (mut stream, _) = request(&host, &mut vm, &root, &headers, Some(body));
        let chosen = host.request_header(HOST_HEADER).expect("an instance named");
        respond_with_body(&host, &mut vm, &mut stream, &chosen, &JSON_OK, &[usage]);
        root.tick(&mut vm);
        instances
            .iter()
            .map(|at| usage_count(&host, UsageCounter::IndexMisses, at))
            .sum::<i64>()
    };
    // 2,000-byte prompts: 1,000 tokens to model "a", 250 to model "b".
    for seed in 1..=8 {
        assert_eq!(answer(&chat("a", seed), &usage_body(1_000, 0)), 0);
        assert_eq!(answer(&chat("b", seed), &usage_body(250, 0)), 0);
    }
    // Over every prompt the ratio is between: "b"'s held 150 of its 250
    // tokens would look like a miss, "a"'s 300 of its 1,000 like a hold.
    assert_eq!(answer(&chat("b", 1), &usage_body(250, 150)), 0, "held");
    assert_eq!(answer(&chat("a", 1), &usage_body(1_000, 300)), 1, "missed");
}
