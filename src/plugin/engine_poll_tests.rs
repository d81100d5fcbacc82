//! The engine-load poller against the in-memory host: which calls reach
//! Envoy, what an answer does to the shared sample, the stats and the
//! gauges, and that one VM of an Envoy polls.

use std::rc::Rc;

use super::*;
use crate::config::Config;
use crate::host::{Host, HostStatus};
use crate::load::{InstanceRef, UpstreamStart};
use crate::shared::MemoryStore;
use crate::testing::memory_host::{MemoryHost, SentCall};

type TestVm = Vm<Rc<MemoryHost>>;

const A: &str = "10.0.0.1:8000";
const B: &str = "10.0.0.2:8000";

fn json(engine: &str) -> String {
    format!(r#"{{"instances": ["{A}", "{B}"], "engine_load": {engine}}}"#)
}

const ENGINE: &str = r#"{"cluster": "engine_metrics", "interval_ms": 500}"#;

fn body(running: u32, waiting: u32, kv: f64) -> Vec<u8> {
    format!(
        "# TYPE vllm:num_requests_running gauge\n\
         vllm:num_requests_running{{engine=\"0\"}} {running}\n\
         vllm:num_requests_waiting{{engine=\"0\"}} {waiting}\n\
         vllm:kv_cache_usage_perc{{engine=\"0\"}} {kv}\n"
    )
    .into_bytes()
}

struct Setup {
    store: Rc<MemoryStore>,
    host: Rc<MemoryHost>,
    vm: TestVm,
    root: PluginRoot,
    config: Config,
}

fn setup_on(store: Rc<MemoryStore>, json: &str) -> Setup {
    let host = MemoryHost::with_store(Rc::clone(&store));
    let mut vm = Vm::new(Rc::clone(&host));
    let mut root = PluginRoot::default();
    let size = host.set_configuration(json);
    assert!(root.configure(&mut vm, size), "{json}");
    host.take_calls();
    Setup {
        store,
        host,
        vm,
        root,
        config: Config::parse(json.as_bytes()).unwrap(),
    }
}

fn setup(engine: &str) -> Setup {
    setup_on(Rc::new(MemoryStore::new()), &json(engine))
}

impl Setup {
    fn tick(&mut self) -> Vec<SentCall> {
        self.root.tick(&mut self.vm);
        self.host.take_http_calls()
    }

    /// Answers `call` with `status` and `body` (`None`: no response).
    fn answer(&mut self, call: &SentCall, answer: Option<(u32, &[u8])>) {
        self.host.set_http_call_answer(answer);
        let (headers, size) = match answer {
            Some((_, body)) => (1, body.len()),
            None => (0, 0),
        };
        self.root
            .http_call_response(&mut self.vm, call.token, headers, size);
    }

    fn sample(&mut self, address: &str) -> Option<crate::load::EngineLoad> {
        let now = self.vm.now_ms();
        let max_age = self.config.engine_load.as_ref().unwrap().max_age_ms;
        self.vm.with_tracker(&self.config, |t| {
            let slot = t
                .engine_poll_targets(now)
                .into_iter()
                .find(|i| &*i.address == address)?
                .slot;
            let instance = InstanceRef::new(slot, address.into());
            t.engine_sample(&instance, max_age, now).map(|r| r.load)
        })
    }

    fn counter(&mut self, name: &str) -> i64 {
        self.vm.flush_metrics();
        self.host.counter(name)
    }
}

fn addresses(calls: &[SentCall]) -> Vec<&str> {
    let mut out: Vec<&str> = calls
        .iter()
        .map(|c| c.header(ORIGINAL_DST_HOST_HEADER).unwrap())
        .collect();
    out.sort_unstable();
    out
}

#[test]
fn without_engine_load_nothing_is_polled_and_the_tick_stays_at_a_second() {
    let mut s = setup_on(
        Rc::new(MemoryStore::new()),
        &format!(r#"{{"instances": ["{A}", "{B}"]}}"#),
    );
    assert_eq!(s.host.tick_period_ms(), Some(TICK_PERIOD_MS));
    for _ in 0..5 {
        assert!(s.tick().is_empty());
        s.host.advance_ms(1_000);
    }
    assert!(s.host.metric(crate::engine_load::POLLS).is_none());
}

#[test]
fn each_instance_is_polled_through_the_cluster_with_its_address_and_the_timeout() {
    let mut s = setup(ENGINE);
    assert_eq!(s.host.tick_period_ms(), Some(50), "a tenth of the interval");
    let calls = s.tick();
    assert_eq!(addresses(&calls), vec![A, B]);
    for call in &calls {
        assert_eq!(call.cluster, "engine_metrics");
        assert_eq!(call.header(":method"), Some("GET"));
        assert_eq!(call.header(":path"), Some("/metrics"));
        assert_eq!(
            call.header(":authority"),
            call.header(ORIGINAL_DST_HOST_HEADER)
        );
        assert_eq!(call.timeout_ms, 400);
    }
    assert_eq!(s.counter(crate::engine_load::POLLS), 2);
}

#[test]
fn a_fleet_names_the_pollers_stats_and_gauges() {
    let json =
        format!(r#"{{"instances": ["{A}", "{B}"], "engine_load": {ENGINE}, "fleet": "llama"}}"#);
    let mut s = setup_on(Rc::new(MemoryStore::new()), &json);
    let calls = s.tick();
    let call_a = calls
        .iter()
        .find(|c| c.header(":authority") == Some(A))
        .unwrap();
    s.answer(call_a, Some((500, b"")));
    let call_b = calls
        .iter()
        .find(|c| c.header(":authority") == Some(B))
        .unwrap();
    s.answer(call_b, Some((200, &body(3, 2, 0.45))));
    let named = |name: &str| crate::metrics::fleet_stat_name(Some("llama"), name);
    assert_eq!(s.counter(&named(crate::engine_load::POLLS)), 2);
    assert_eq!(
        s.counter(&named(&crate::engine_load::poll_failure_counter_name(
            "status"
        ))),
        1
    );
    let gauge = crate::metrics::instance_stat_name(crate::engine_load::REQUESTS_GAUGE_PREFIX, B);
    assert_eq!(s.host.gauge(&named(&gauge)), Some(5));
    let names = s.host.metric_names();
    assert!(
        names
            .iter()
            .all(|n| n.starts_with("prefix_router.fleet.llama.")),
        "{names:?}"
    );
}

#[test]
fn a_good_answer_becomes_the_shared_sample_and_the_gauges() {
    let mut s = setup(ENGINE);
    let calls = s.tick();
    let call_a = calls
        .iter()
        .find(|c| c.header(":authority") == Some(A))
        .unwrap();
    s.host.advance_ms(5);
    s.answer(call_a, Some((200, &body(3, 2, 0.45))));
    assert_eq!(
        s.sample(A),
        Some(crate::load::EngineLoad {
            running: 3,
            waiting: 2,
            kv_usage_permille: Some(450)
        })
    );
    assert_eq!(s.sample(B), None, "B has not answered");
    let gauge = |prefix: &str| crate::metrics::instance_stat_name(prefix, A);
    assert_eq!(
        s.host
            .gauge(&gauge(crate::engine_load::REQUESTS_GAUGE_PREFIX)),
        Some(5)
    );
    assert_eq!(
        s.host
            .gauge(&gauge(crate::engine_load::KV_USAGE_GAUGE_PREFIX)),
        Some(450)
    );
    // Another VM of the same Envoy reads it from shared data.
    let mut other = setup_on(Rc::clone(&s.store), &json(ENGINE));
    assert!(other.sample(A).is_some());
    // Too old to be used once max_age_ms (3 intervals) has passed.
    s.host.advance_ms(1_501);
    assert_eq!(s.sample(A), None);
}

#[test]
fn the_sample_keeps_this_envoys_in_flight_count_when_it_arrived() {
    let mut s = setup(ENGINE);
    let calls = s.tick();
    let now = s.vm.now_ms();
    let ticket = s.vm.with_tracker(&s.config, |t| {
        t.upstream_started(
            UpstreamStart {
                address: A,
                key: None,
                overridden: false,
                counted: None,
            },
            now,
        )
    });
    assert!(ticket.is_some());
    let call_a = calls
        .iter()
        .find(|c| c.header(":authority") == Some(A))
        .unwrap();
    s.answer(call_a, Some((200, &body(4, 0, 0.1))));
    let max_age = s.config.engine_load.as_ref().unwrap().max_age_ms;
    let record = s.vm.with_tracker(&s.config, |t| {
        let instance = t
            .engine_poll_targets(now)
            .into_iter()
            .find(|i| &*i.address == A)
            .unwrap();
        t.engine_sample(&instance, max_age, now).unwrap()
    });
    assert_eq!(record.base_in_flight, 1);
    assert_eq!(record.estimated_requests(1), 4, "nothing sent since");
    assert_eq!(record.estimated_requests(3), 6);
}

#[test]
fn an_open_poll_is_not_repeated_and_the_next_is_jittered_around_the_interval() {
    let mut s = setup(ENGINE);
    let first = s.tick();
    assert_eq!(first.len(), 2);
    // Not due again before 400 ms (interval - 20 %).
    for _ in 0..7 {
        s.host.advance_ms(50);
        assert!(s.tick().is_empty());
    }
    // Past 600 ms both are due, but their calls are still open.
    s.host.advance_ms(300);
    assert!(s.tick().is_empty(), "never two open calls of one instance");
    assert_eq!(s.counter(crate::engine_load::POLLS_SKIPPED), 2);
    assert_eq!(s.vm.engine_polling().open_calls(), 2);
    for call in &first {
        s.answer(call, Some((200, &body(1, 0, 0.0))));
    }
    assert_eq!(s.vm.engine_polling().open_calls(), 0);
    s.host.advance_ms(600);
    assert_eq!(addresses(&s.tick()), vec![A, B]);
}

#[test]
fn faults_but_a_timeout_clear_the_sample_at_once_are_counted_by_reason_and_recover() {
    let mut s = setup(ENGINE);
    let answer_a = |s: &mut Setup, answer: Option<(u32, &[u8])>, wait: u64| {
        s.host.advance_ms(600);
        let calls = s.tick();
        let call = calls
            .iter()
            .find(|c| c.header(":authority") == Some(A))
            .unwrap();
        s.host.advance_ms(wait);
        s.answer(call, answer);
        for other in calls.iter().filter(|c| c.token != call.token) {
            s.answer(other, Some((200, &body(0, 0, 0.0))));
        }
    };
    let good = body(2, 1, 0.3);
    answer_a(&mut s, Some((200, &good)), 5);
    assert!(s.sample(A).is_some());

    answer_a(&mut s, Some((500, b"boom")), 5);
    assert_eq!(s.sample(A), None, "a 500 clears the sample");
    assert_eq!(s.counter("prefix_router.engine.poll_failures.status"), 1);

    answer_a(&mut s, Some((200, &good)), 5);
    assert!(s.sample(A).is_some(), "recovered");

    answer_a(&mut s, Some((200, b"<html>not metrics</html>")), 5);
    assert_eq!(s.sample(A), None);
    assert_eq!(s.counter("prefix_router.engine.poll_failures.body"), 1);

    answer_a(&mut s, Some((200, &good)), 5);
    assert!(s.sample(A).is_some(), "recovered");
    // A slow answer leaves the last sample to age out at max_age_ms.
    answer_a(&mut s, Some((504, b"upstream request timeout")), 400);
    assert_eq!(s.counter("prefix_router.engine.poll_failures.timeout"), 1);
    let max_age = s.config.engine_load.as_ref().unwrap().max_age_ms;
    assert!(max_age > 1_000, "the sample is 1 s old: {max_age}");
    assert_eq!(
        s.sample(A).map(|l| l.running),
        Some(2),
        "kept after a timeout"
    );

    let refused: &[u8] = b"upstream connect error or disconnect/reset before headers. \
                           reset reason: remote connection failure";
    answer_a(&mut s, Some((503, refused)), 1);
    answer_a(&mut s, None, 1);
    assert_eq!(
        s.counter("prefix_router.engine.poll_failures.unreachable"),
        2
    );
    assert_eq!(s.sample(A), None);

    answer_a(&mut s, Some((200, &good)), 5);
    assert!(s.sample(A).is_some(), "recovers by itself");
    assert_eq!(s.counter("prefix_router.engine.poll_failures.status"), 1);
    assert_eq!(s.sample(B).map(|l| l.running), Some(0), "B unaffected");
}

#[test]
fn a_refused_dispatch_and_a_call_never_answered_are_faults_and_polling_goes_on() {
    let mut s = setup(ENGINE);
    s.host.refuse_http_calls(Some(HostStatus(2)));
    assert!(s.tick().is_empty());
    assert_eq!(
        s.counter("prefix_router.engine.poll_failures.unreachable"),
        2
    );
    assert_eq!(s.vm.engine_polling().open_calls(), 0);
    s.host.refuse_http_calls(None);
    s.host.advance_ms(600);
    let calls = s.tick();
    assert_eq!(calls.len(), 2);
    // Envoy never answers: given up after the timeout and a grace.
    s.host.advance_ms(400 + 1_001);
    let again = s.tick();
    assert_eq!(s.counter("prefix_router.engine.poll_failures.timeout"), 2);
    assert_eq!(addresses(&again), vec![A, B], "polled again");
    // The late answer to a given-up call is ignored.
    s.answer(&calls[0], Some((200, &body(9, 9, 0.9))));
    assert_eq!(s.sample(calls[0].header(":authority").unwrap()), None);
}

#[test]
fn one_vm_of_an_envoy_polls_and_another_takes_over_when_it_stops() {
    let store = Rc::new(MemoryStore::new());
    let mut first = setup_on(Rc::clone(&store), &json(ENGINE));
    let mut second = setup_on(Rc::clone(&store), &json(ENGINE));
    // Distinct entropy, so distinct VM nonces (as in Envoy).
    second.host.set_entropy(Some(0xBEEF));
    assert_eq!(first.tick().len(), 2);
    let mut polled_by_second = 0;
    for _ in 0..40 {
        first.host.advance_ms(50);
        second.host.advance_ms(50);
        for call in first.tick() {
            first.answer(&call, Some((200, &body(1, 1, 0.1))));
        }
        polled_by_second += second.tick().len();
    }
    assert_eq!(polled_by_second, 0, "the lease holder polls alone");
    // The first VM stops ticking (gone); after the lease time (1.5 s) the
    // second takes over.
    let mut taken_over_after = None;
    for step in 1..=40 {
        second.host.advance_ms(50);
        if !second.tick().is_empty() {
            taken_over_after = Some(step * 50);
            break;
        }
    }
    let after = taken_over_after.expect("the second VM took over");
    assert!((1_000..=1_600).contains(&after), "after {after} ms");
}

/// A request through the listener: an invoke prompt of `seed`, decided;
/// returns the stream and the instance it was sent to.
fn route_invoke(s: &mut Setup, seed: u8) -> (Stream, String) {
    let body: Vec<u8> = (0..2_000u32)
        .map(|i| b'a' + (i as u8 ^ seed) % 26)
        .collect();
    s.host.start_request(&[(":path", "/invocations")]);
    let mut stream = s.root.new_stream();
    assert_eq!(stream.on_request_headers(&mut s.vm, false), Flow::Pause);
    let size = s.host.arrive(&body);
    assert_eq!(
        stream.on_request_body(&mut s.vm, size, true),
        Flow::Continue
    );
    let chosen = s
        .host
        .request_header("x-prefix-route-host")
        .expect("an instance is named");
    (stream, chosen)
}

/// `stream`'s response from `address`, with `report` as its ORCA header.
fn respond(s: &mut Setup, mut stream: Stream, address: &str, report: Option<&str>) {
    if let Some(report) = report {
        s.host
            .replace_response_header(crate::engine_load::orca::REPORT_HEADER, report.as_bytes())
            .unwrap();
    }
    s.host.set_property("upstream.address", Some(address));
    assert_eq!(stream.on_response_headers(&mut s.vm), Flow::Continue);
    stream.on_done(&mut s.vm);
}

#[test]
fn an_orca_report_on_a_response_refreshes_the_kv_usage_between_polls() {
    let mut s = setup(r#"{"cluster": "engine_metrics", "interval_ms": 500, "max_kv_usage": 0.9}"#);
    for call in s.tick() {
        s.answer(&call, Some((200, &body(1, 0, 0.1))));
    }
    let (first, held_by) = route_invoke(&mut s, 3);
    let other = if held_by == A { B } else { A };
    respond(&mut s, first, &held_by, None);
    // Held by `held_by`: sent there again while its KV usage is the poll's.
    let (second, chosen) = route_invoke(&mut s, 3);
    assert_eq!(chosen, held_by);
    respond(
        &mut s,
        second,
        &held_by,
        Some("TEXT named_metrics.kv_cache_usage_perc=high"),
    );
    assert_eq!(s.counter("prefix_router.engine.orca_reports_unreadable"), 1);
    assert_eq!(s.sample(&held_by).unwrap().kv_usage_permille, Some(100));
    let (third, chosen) = route_invoke(&mut s, 3);
    assert_eq!(chosen, held_by, "an unreadable report changes nothing");
    respond(
        &mut s,
        third,
        &held_by,
        Some("TEXT named_metrics.num_requests_waiting=0.0, named_metrics.kv_cache_usage_perc=0.95"),
    );
    assert_eq!(s.counter("prefix_router.engine.orca_reports"), 1);
    let sample = s.sample(&held_by).unwrap();
    assert_eq!(
        (sample.running, sample.waiting, sample.kv_usage_permille),
        (1, 0, Some(950)),
        "only the KV usage is the report's"
    );
    // At the bound now, before the next poll: the prompt moves.
    let (fourth, chosen) = route_invoke(&mut s, 3);
    assert_eq!(chosen, other);
    respond(&mut s, fourth, other, None);
    // The next poll's figure replaces the report's.
    s.host.advance_ms(600);
    for call in s.tick() {
        s.answer(&call, Some((200, &body(1, 0, 0.2))));
    }
    assert_eq!(s.sample(&held_by).unwrap().kv_usage_permille, Some(200));
}

#[test]
fn a_report_without_a_poll_sample_or_without_engine_load_is_not_used() {
    let mut s = setup(ENGINE);
    // No poll answered yet: nothing to refresh, the instance stays weighed
    // by this Envoy's counts.
    let (stream, chosen) = route_invoke(&mut s, 5);
    respond(
        &mut s,
        stream,
        &chosen,
        Some("TEXT named_metrics.kv_cache_usage_perc=0.5"),
    );
    assert_eq!(s.counter("prefix_router.engine.orca_reports"), 0);
    assert_eq!(s.sample(&chosen), None);
    // Without engine_load (nor the usage) the headers are not even read.
    let mut off = setup_on(
        Rc::new(MemoryStore::new()),
        &format!(r#"{{"instances": ["{A}", "{B}"], "read_usage": false}}"#),
    );
    let (stream, chosen) = route_invoke(&mut off, 5);
    off.host.take_calls();
    respond(
        &mut off,
        stream,
        &chosen,
        Some("TEXT named_metrics.kv_cache_usage_perc=0.5"),
    );
    let calls = off.host.take_calls();
    assert!(!calls.iter().any(|c| c == "response_headers"), "{calls:?}");
    // Read for the usage, without engine_load: the report is in the headers
    // read, and still not used.
    let mut usage = setup_on(
        Rc::new(MemoryStore::new()),
        &format!(r#"{{"instances": ["{A}", "{B}"]}}"#),
    );
    for report in [
        "TEXT named_metrics.kv_cache_usage_perc=0.5",
        "TEXT named_metrics.kv_cache_usage_perc=high",
    ] {
        let (stream, chosen) = route_invoke(&mut usage, 5);
        usage.host.take_calls();
        respond(&mut usage, stream, &chosen, Some(report));
        let calls = usage.host.take_calls();
        assert!(calls.iter().any(|c| c == "response_headers"), "{calls:?}");
    }
    assert_eq!(usage.counter("prefix_router.engine.orca_reports"), 0);
    assert_eq!(
        usage.counter("prefix_router.engine.orca_reports_unreadable"),
        0
    );
}

/// The candidates as decisions read them (another VM of the same Envoy,
/// through shared data), by address.
fn candidates_as_read(s: &Setup, json: &str) -> Vec<crate::load::Candidate> {
    use crate::load::LoadView;
    let mut other = setup_on(Rc::clone(&s.store), json);
    let now = other.vm.now_ms();
    let config = other.config.clone();
    let engine = config.engine_load.as_ref().unwrap();
    let view = crate::load::EngineView {
        max_age_ms: engine.max_age_ms,
        bounds: engine.bounds(),
    };
    let mut read = other.vm.with_tracker(&config, |t| {
        t.set_engine_view(Some(view));
        t.candidates(now)
    });
    read.sort_by(|a, b| a.instance.address.cmp(&b.instance.address));
    read
}

/// Whether each instance's engine lists `adapter` (None: not known).
fn served_as_read(s: &Setup, json: &str, adapter: &str) -> Vec<(String, Option<bool>)> {
    let hash = crate::load::adapter_hash(adapter.as_bytes());
    candidates_as_read(s, json)
        .into_iter()
        .map(|c| {
            (
                c.instance.address.to_string(),
                c.served.map(|s| s.contains(hash)),
            )
        })
        .collect()
}

/// A and B with `adapters` and engine load.
fn with_adapters() -> String {
    format!(
        r#"{{"instances": ["{A}", "{B}"], "include_model": true,
            "adapters": {{"base_models": ["base"]}}, "engine_load": {ENGINE}}}"#
    )
}

#[test]
fn with_adapters_each_poll_also_reads_the_adapters_the_engine_lists() {
    let json = with_adapters();
    let mut s = setup_on(Rc::new(MemoryStore::new()), &json);
    let calls = s.tick();
    let path_of = |address: &str, path: &str| {
        calls
            .iter()
            .find(|c| c.header(":authority") == Some(address) && c.header(":path") == Some(path))
            .unwrap_or_else(|| panic!("{path} of {address}"))
            .clone()
    };
    assert_eq!(calls.len(), 4, "/metrics and /v1/models of each");
    let models = |ids: &[&str]| {
        let data: Vec<String> = ids.iter().map(|id| format!(r#"{{"id":"{id}"}}"#)).collect();
        format!(r#"{{"object":"list","data":[{}]}}"#, data.join(",")).into_bytes()
    };
    for address in [A, B] {
        s.answer(&path_of(address, "/metrics"), Some((200, &body(0, 0, 0.1))));
    }
    s.answer(
        &path_of(A, "/v1/models"),
        Some((200, &models(&["base", "lora-1"]))),
    );
    s.answer(&path_of(B, "/v1/models"), Some((200, &models(&["base"]))));
    assert_eq!(
        served_as_read(&s, &json, "lora-1"),
        [(A.to_string(), Some(true)), (B.to_string(), Some(false))]
    );
    // The next poll: lora-1 unloaded from A; B's answer unusable (not
    // known, so not denied); a later poll of A that gets no response at
    // all leaves A's last list standing.
    s.host.advance_ms(600);
    let calls = s.tick();
    let next = |address: &str| {
        calls
            .iter()
            .find(|c| {
                c.header(":authority") == Some(address) && c.header(":path") == Some("/v1/models")
            })
            .unwrap()
            .clone()
    };
    s.answer(&next(A), Some((200, &models(&["base"]))));
    s.answer(&next(B), Some((404, b"not found")));
    for call in calls
        .iter()
        .filter(|c| c.header(":path") == Some("/metrics"))
    {
        s.answer(call, Some((200, &body(0, 0, 0.1))));
    }
    assert_eq!(
        served_as_read(&s, &json, "lora-1"),
        [(A.to_string(), Some(false)), (B.to_string(), None)]
    );
    s.host.advance_ms(600);
    let calls = s.tick();
    let metrics = body(0, 0, 0.1);
    for call in &calls {
        let answer = (call.header(":path") == Some("/metrics")).then_some((200, &metrics[..]));
        s.answer(call, answer);
    }
    assert_eq!(
        served_as_read(&s, &json, "lora-1")[0],
        (A.to_string(), Some(false))
    );
    // Without adapters, only the metrics path is polled.
    let mut plain = setup(ENGINE);
    assert!(plain
        .tick()
        .iter()
        .all(|c| c.header(":path") == Some("/metrics")));
}

#[test]
fn with_adapters_the_metrics_say_which_adapters_each_engine_runs() {
    let json = with_adapters();
    let mut s = setup_on(Rc::new(MemoryStore::new()), &json);
    let lora_info = |running: &str, at: u32| {
        let mut metrics = body(1, 0, 0.1);
        metrics.extend_from_slice(
            format!(
                "vllm:lora_requests_info{{max_lora=\"2\",waiting_lora_adapters=\"\",running_lora_adapters=\"{running}\"}} {at}\n"
            )
            .as_bytes(),
        );
        metrics
    };
    let (a_metrics, b_metrics) = (lora_info("lora-1,lora-2", 7), lora_info("lora-2", 7));
    for call in s.tick() {
        let answer = match (call.header(":authority"), call.header(":path")) {
            (Some(A), Some("/metrics")) => Some((200, &a_metrics[..])),
            (Some(B), Some("/metrics")) => Some((200, &b_metrics[..])),
            _ => Some((200, &br#"{"data":[]}"#[..])),
        };
        s.answer(&call, answer);
    }
    let runs = |s: &Setup, adapter: &str| -> Vec<bool> {
        let hash = crate::load::adapter_hash(adapter.as_bytes());
        candidates_as_read(s, &json)
            .iter()
            .map(|c| c.runs(hash))
            .collect()
    };
    assert_eq!(runs(&s, "lora-1"), [true, false]);
    assert_eq!(runs(&s, "lora-2"), [true, true]);
    // Listed by neither /v1/models, yet A may serve lora-1: it runs it.
    let hash = crate::load::adapter_hash(b"lora-1");
    let may: Vec<bool> = candidates_as_read(&s, &json)
        .iter()
        .map(|c| c.may_serve(hash))
        .collect();
    assert_eq!(may, [true, false]);
    // The next samples: A idle now, B's body without the gauge.
    s.host.advance_ms(600);
    let idle = lora_info("", 9);
    let plain = body(0, 0, 0.1);
    for call in s.tick() {
        let answer = match (call.header(":authority"), call.header(":path")) {
            (Some(A), Some("/metrics")) => Some((200, &idle[..])),
            (Some(B), Some("/metrics")) => Some((200, &plain[..])),
            _ => None,
        };
        s.answer(&call, answer);
    }
    assert_eq!(runs(&s, "lora-2"), [false, false]);
    let reported: Vec<bool> = candidates_as_read(&s, &json)
        .iter()
        .map(|c| c.active_adapters.is_some())
        .collect();
    assert_eq!(reported, [true, false]);
    // Without adapters the gauge is not read.
    let json = format!(r#"{{"instances": ["{A}", "{B}"], "engine_load": {ENGINE}}}"#);
    let mut s = setup_on(Rc::new(MemoryStore::new()), &json);
    for call in s.tick() {
        s.answer(&call, Some((200, &a_metrics[..])));
    }
    let read = candidates_as_read(&s, &json);
    assert!(read
        .iter()
        .all(|c| c.load == 1 && c.active_adapters.is_none()));
}
