//! Fuzzes the reading of Envoy's admin `/clusters` answer (`discovery`) and
//! of the shared list it becomes: any bytes and any cluster name give no
//! panic; the hosts found are sorted, distinct, at most `MAX_INSTANCES`,
//! each `ip:port` on a line of the answer; and the shared list decodes to
//! the hosts it was written from.
//!
//! Input layout: byte 0 the cluster name's length (at most 32), then the
//! name, then the answer.

#![no_main]

use libfuzzer_sys::fuzz_target;
use prefix_router::config::MAX_INSTANCES;
use prefix_router::discovery::{decode, encode, healthy_hosts};

fuzz_target!(|data: &[u8]| {
    let Some((&length, rest)) = data.split_first() else {
        return;
    };
    let (name, body) = rest.split_at(rest.len().min(usize::from(length % 33)));
    let cluster = String::from_utf8_lossy(name);
    let Ok(hosts) = healthy_hosts(body, &cluster) else {
        return;
    };
    assert!(hosts.len() <= MAX_INSTANCES);
    assert!(hosts.windows(2).all(|pair| pair[0] < pair[1]), "{hosts:?}");
    for host in &hosts {
        let line = format!("{cluster}::{host}::health_flags::");
        assert!(
            body.windows(line.len()).any(|window| window == line.as_bytes()),
            "{host} is on no line of the answer"
        );
    }
    assert_eq!(decode(&encode(&hosts)), hosts);
});
