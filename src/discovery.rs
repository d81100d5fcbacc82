//! The fleet read from Envoy itself (`discovery`): where the cluster's
//! hosts come from DNS or EDS, no static `instances` list can stay right, and
//! a wasm module cannot list a cluster's hosts (its properties describe the
//! chosen host only). Envoy's admin interface can: `GET /clusters` prints
//! every host of every cluster, one `cluster::host::stat::value` per line.
//! This file builds that request and reads its answer, with no host calls
//! (the plugin makes them, `plugin::discovery_poll`).
//!
//! Only hosts whose `health_flags` are `healthy` count: Envoy sends no
//! request to the others while healthy ones remain, so the filter should
//! not nominate them either. A host that leaves the list is then treated as
//! one learned from traffic, forgotten after `instance_ttl_ms`.

use crate::config::{is_socket_address, MAX_INSTANCES};

/// The stat, after its host, of a host's health in a `/clusters` line.
const HEALTH_FLAGS: &[u8] = b"::health_flags";

/// The most body bytes read from `/clusters`: room for [`MAX_INSTANCES`]
/// hosts several times over.
pub const MAX_BODY_BYTES: usize = 1 << 20;

/// Why an answer gave no fleet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DiscoveryFault {
    /// No answer, or Envoy's own error for an admin it could not reach.
    Unreachable(String),
    /// An answer other than 200.
    Status(u32),
    /// Longer than [`MAX_BODY_BYTES`].
    TooLarge,
    /// No host of the cluster in the answer: a cluster name that matches
    /// none, or a cluster with no host at all (then nothing is replaced).
    NoHosts,
}

impl std::fmt::Display for DiscoveryFault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DiscoveryFault::Unreachable(why) => write!(f, "no answer from the admin ({why})"),
            DiscoveryFault::Status(status) => write!(f, "the admin answered {status}"),
            DiscoveryFault::TooLarge => write!(f, "the answer is over {MAX_BODY_BYTES} bytes"),
            DiscoveryFault::NoHosts => write!(f, "the answer lists no host of the cluster"),
        }
    }
}

/// The admin path that lists `cluster`'s hosts alone: `/clusters` with an
/// anchored RE2 `filter`, every character but `[A-Za-z0-9_]` escaped as
/// `\x{..}` and the whole query percent-encoded.
pub fn admin_path(cluster: &str) -> String {
    let mut regex = String::from("^");
    for c in cluster.chars() {
        if c.is_ascii_alphanumeric() || c == '_' {
            regex.push(c);
        } else {
            regex.push_str(&format!("\\x{{{:x}}}", u32::from(c)));
        }
    }
    regex.push('$');
    let mut path = String::from("/clusters?filter=");
    for byte in regex.bytes() {
        if byte.is_ascii_alphanumeric() || byte == b'_' {
            path.push(char::from(byte));
        } else {
            path.push_str(&format!("%{byte:02X}"));
        }
    }
    path
}

/// The healthy hosts of `cluster` in a `/clusters` answer, sorted, each as
/// `upstream.address` spells it, at most [`MAX_INSTANCES`]; lines that are
/// not of the cluster, not a host's `health_flags`, or not `ip:port` are
/// passed over.
pub fn healthy_hosts(body: &[u8], cluster: &str) -> Result<Vec<String>, DiscoveryFault> {
    if body.len() > MAX_BODY_BYTES {
        return Err(DiscoveryFault::TooLarge);
    }
    let mut hosts = Vec::new();
    let mut any = false;
    for line in body.split(|&b| b == b'\n') {
        // `<cluster>::<host>::<stat>::<value>`: the host's health is the
        // line whose stat is `health_flags` (an IPv6 host holds "::" too).
        let Some((rest, flags)) = rsplit_pair(line) else {
            continue;
        };
        let Some(rest) = rest.strip_suffix(HEALTH_FLAGS) else {
            continue;
        };
        let Some(host) = rest
            .strip_prefix(cluster.as_bytes())
            .and_then(|rest| rest.strip_prefix(b"::"))
            .and_then(|host| std::str::from_utf8(host).ok())
        else {
            continue;
        };
        if !is_socket_address(host) {
            continue;
        }
        any = true;
        if flags.trim_ascii_end() == b"healthy" && hosts.len() < MAX_INSTANCES {
            hosts.push(host.to_string());
        }
    }
    if !any {
        return Err(DiscoveryFault::NoHosts);
    }
    hosts.sort();
    hosts.dedup();
    Ok(hosts)
}

/// A line split at its last `::`.
fn rsplit_pair(line: &[u8]) -> Option<(&[u8], &[u8])> {
    let at = line.windows(2).rposition(|pair| pair == b"::")?;
    Some((line.get(..at)?, line.get(at + 2..)?))
}

/// The list as shared data holds it: one address a line.
pub fn encode(hosts: &[String]) -> Vec<u8> {
    hosts.join("\n").into_bytes()
}

/// A list written by [`encode`]; anything else gives the addresses it holds.
pub fn decode(bytes: &[u8]) -> Vec<String> {
    String::from_utf8_lossy(bytes)
        .lines()
        .filter(|line| is_socket_address(line))
        .take(MAX_INSTANCES)
        .map(str::to_string)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `/clusters` as Envoy 1.40 prints it (trimmed to the lines that vary).
    const ANSWER: &str = "\
vllm::observability_name::vllm
vllm::default_priority::max_connections::1024
vllm::added_via_api::false
vllm::10.0.0.12:8000::cx_active::0
vllm::10.0.0.12:8000::health_flags::healthy
vllm::[fd00::7]:8000::hostname::vllm-2
vllm::[fd00::7]:8000::health_flags::healthy
vllm::10.0.0.11:8000::rq_total::4
vllm::10.0.0.11:8000::health_flags::healthy
vllm::10.0.0.13:8000::health_flags::/failed_active_hc/failed_outlier_check
vllm_canary::10.0.0.99:8000::health_flags::healthy
";

    #[test]
    fn reads_the_healthy_hosts_of_the_cluster_alone_sorted() {
        assert_eq!(
            healthy_hosts(ANSWER.as_bytes(), "vllm"),
            Ok(vec![
                "10.0.0.11:8000".to_string(),
                "10.0.0.12:8000".to_string(),
                "[fd00::7]:8000".to_string(),
            ])
        );
        assert_eq!(
            healthy_hosts(ANSWER.as_bytes(), "vllm_canary"),
            Ok(vec!["10.0.0.99:8000".to_string()])
        );
    }

    #[test]
    fn a_cluster_with_no_healthy_host_is_an_empty_list_and_none_at_all_a_fault() {
        let down = "vllm::10.0.0.13:8000::health_flags::/failed_eds_health\n";
        assert_eq!(healthy_hosts(down.as_bytes(), "vllm"), Ok(vec![]));
        assert_eq!(
            healthy_hosts(ANSWER.as_bytes(), "other"),
            Err(DiscoveryFault::NoHosts)
        );
        assert_eq!(healthy_hosts(b"", "vllm"), Err(DiscoveryFault::NoHosts));
    }

    #[test]
    fn malformed_lines_are_passed_over_and_never_panic() {
        let body = b"vllm::\nvllm::::health_flags::healthy\nvllm::x:1::health_flags::healthy\n\
vllm::10.0.0.1:0::health_flags::healthy\n\xff\xfe::health_flags\nvllm::10.0.0.1:80::health_flags::healthy\r\n";
        assert_eq!(
            healthy_hosts(body, "vllm"),
            Ok(vec!["10.0.0.1:80".to_string()])
        );
        for cut in 0..ANSWER.len() {
            let _ = healthy_hosts(&ANSWER.as_bytes()[..cut], "vllm");
        }
    }

    #[test]
    fn a_body_past_the_cap_is_refused_and_the_list_is_bounded() {
        assert_eq!(
            healthy_hosts(&vec![b'a'; MAX_BODY_BYTES + 1], "vllm"),
            Err(DiscoveryFault::TooLarge)
        );
        let many: String = (0..MAX_INSTANCES + 10)
            .map(|i| {
                format!(
                    "vllm::10.0.{}.{}:8000::health_flags::healthy\n",
                    i / 200,
                    i % 200 + 1
                )
            })
            .collect();
        assert_eq!(
            healthy_hosts(many.as_bytes(), "vllm").map(|h| h.len()),
            Ok(MAX_INSTANCES)
        );
    }

    #[test]
    fn the_path_anchors_and_escapes_the_cluster_name() {
        assert_eq!(admin_path("vllm"), "/clusters?filter=%5Evllm%24");
        assert_eq!(
            admin_path("outbound|8000||vllm.ns.svc"),
            "/clusters?filter=%5Eoutbound%5Cx%7B7c%7D8000%5Cx%7B7c%7D%5Cx%7B7c%7Dvllm%5Cx%7B2e%7Dns%5Cx%7B2e%7Dsvc%24"
        );
        assert!(admin_path("é").contains("%5Cx%7Be9%7D"));
    }

    #[test]
    fn the_shared_list_round_trips_and_garbage_gives_only_addresses() {
        let hosts = vec!["10.0.0.11:8000".to_string(), "[fd00::7]:8000".to_string()];
        assert_eq!(decode(&encode(&hosts)), hosts);
        assert_eq!(decode(&encode(&[])), Vec::<String>::new());
        assert_eq!(
            decode(b"junk\n10.0.0.1:80\n\xff"),
            vec!["10.0.0.1:80".to_string()]
        );
    }
}
