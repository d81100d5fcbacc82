//! The fleet read from Envoy's admin against the in-memory host: the call
//! that reaches Envoy, what an answer does to the shared list, the stats,
//! and that one VM of an Envoy reads the admin while every VM uses the list.

use std::rc::Rc;

use super::discovery_poll::{FAILURES, INSTANCES, READS};
use super::*;
use crate::config::Config;
use crate::host::HostStatus;
use crate::shared::MemoryStore;
use crate::testing::memory_host::{MemoryHost, SentCall};

const JSON: &str =
    r#"{"discovery": {"admin_cluster": "envoy_admin", "cluster": "vllm", "interval_ms": 500}}"#;

const ANSWER: &[u8] = b"vllm::observability_name::vllm\n\
vllm::10.0.0.2:8000::health_flags::healthy\n\
vllm::10.0.0.1:8000::cx_active::0\n\
vllm::10.0.0.1:8000::health_flags::healthy\n\
vllm::10.0.0.3:8000::health_flags::/failed_outlier_check\n";

struct Setup {
    host: Rc<MemoryHost>,
    vm: Vm<Rc<MemoryHost>>,
    root: PluginRoot,
    config: Config,
}

fn setup_on(store: Rc<MemoryStore>) -> Setup {
    let host = MemoryHost::with_store(store);
    let mut vm = Vm::new(Rc::clone(&host));
    let mut root = PluginRoot::default();
    let size = host.set_configuration(JSON);
    assert!(root.configure(&mut vm, size));
    host.take_calls();
    Setup {
        host,
        vm,
        root,
        config: Config::parse(JSON.as_bytes()).unwrap(),
    }
}

impl Setup {
    fn tick(&mut self) -> Vec<SentCall> {
        self.root.tick(&mut self.vm);
        self.host.take_http_calls()
    }

    fn answer(&mut self, call: &SentCall, answer: Option<(u32, &[u8])>) {
        self.host.set_http_call_answer(answer);
        let (headers, size) = answer.map_or((0, 0), |(_, body)| (1, body.len()));
        self.root
            .http_call_response(&mut self.vm, call.token, headers, size);
    }

    fn fleet(&mut self) -> Vec<String> {
        self.vm.discovered_fleet(&self.config).unwrap().to_vec()
    }
}

#[test]
fn one_vm_reads_the_admin_and_every_vm_decides_with_the_healthy_hosts() {
    let store = Rc::new(MemoryStore::new());
    let mut first = setup_on(Rc::clone(&store));
    assert_eq!(
        first.host.tick_period_ms(),
        Some(125),
        "a quarter of the interval"
    );
    let calls = first.tick();
    assert_eq!(calls.len(), 1);
    assert_eq!(calls[0].cluster, "envoy_admin");
    assert_eq!(
        calls[0].header(":path"),
        Some("/clusters?filter=%5Evllm%24")
    );
    assert_eq!(calls[0].header(":method"), Some("GET"));
    assert!(first.fleet().is_empty(), "nothing known before the answer");
    first.answer(&calls[0], Some((200, ANSWER)));
    assert_eq!(first.fleet(), ["10.0.0.1:8000", "10.0.0.2:8000"]);
    assert_eq!(first.host.gauge(INSTANCES), Some(2));

    let mut second = setup_on(store);
    // Distinct entropy, so distinct VM nonces (as in Envoy).
    second.host.set_entropy(Some(0xBEEF));
    assert!(second.tick().is_empty(), "the first VM holds the lease");
    assert_eq!(second.fleet(), ["10.0.0.1:8000", "10.0.0.2:8000"]);
    // The next read is due an interval later, not on every tick.
    assert!(first.tick().is_empty());
    first.host.advance_ms(500);
    assert_eq!(first.tick().len(), 1);
    assert_eq!(first.host.counter(READS), 2);
    assert_eq!(second.host.counter(READS), 0);
}

/// A VM whose tick read the shared list before the first answer decides
/// with the list from its next request on, not from its next tick.
#[test]
fn a_vm_without_a_list_reads_it_at_its_next_decision() {
    let store = Rc::new(MemoryStore::new());
    let mut first = setup_on(Rc::clone(&store));
    let mut second = setup_on(store);
    second.host.set_entropy(Some(0xBEEF));
    let calls = first.tick();
    assert!(second.tick().is_empty(), "the first VM holds the lease");
    assert!(second.fleet().is_empty(), "no list written yet");
    first.answer(&calls[0], Some((200, ANSWER)));
    assert_eq!(second.fleet(), ["10.0.0.1:8000", "10.0.0.2:8000"]);
}

#[test]
fn a_failed_read_is_counted_and_keeps_the_last_fleet() {
    let mut s = setup_on(Rc::new(MemoryStore::new()));
    let call = s.tick().remove(0);
    s.answer(&call, Some((200, ANSWER)));
    for answer in [
        Some((503, &b"no healthy upstream"[..])),
        None,
        Some((200, &b"other::10.0.0.9:80::health_flags::healthy\n"[..])),
    ] {
        s.host.advance_ms(500);
        let call = s.tick().remove(0);
        s.answer(&call, answer);
        assert_eq!(s.fleet(), ["10.0.0.1:8000", "10.0.0.2:8000"], "{answer:?}");
    }
    assert_eq!(s.host.counter(FAILURES), 3);
    s.host.advance_ms(500);
    s.host.refuse_http_calls(Some(HostStatus(2)));
    assert!(s.tick().is_empty());
    assert_eq!(s.host.counter(FAILURES), 4, "a call Envoy refused");
    s.host.refuse_http_calls(None);
    s.host.advance_ms(500);
    let call = s.tick().remove(0);
    s.answer(
        &call,
        Some((200, b"vllm::10.0.0.7:8000::health_flags::healthy\n")),
    );
    assert_eq!(s.fleet(), ["10.0.0.7:8000"]);
    assert_eq!(s.host.gauge(INSTANCES), Some(1));
}

#[test]
fn a_call_envoy_never_answers_is_given_up_and_sent_again() {
    let mut s = setup_on(Rc::new(MemoryStore::new()));
    assert_eq!(s.tick().len(), 1);
    s.host.advance_ms(600);
    assert!(
        s.tick().is_empty(),
        "still open within its timeout and grace"
    );
    s.host.advance_ms(1_000);
    assert_eq!(s.tick().len(), 1);
}

#[test]
fn another_token_is_left_to_the_engine_poller() {
    let mut s = setup_on(Rc::new(MemoryStore::new()));
    let mut call = s.tick().remove(0);
    call.token += 1000;
    s.answer(&call, Some((200, ANSWER)));
    assert!(s.fleet().is_empty());
}
