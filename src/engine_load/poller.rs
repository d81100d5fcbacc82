//! When each instance's `/metrics` is polled, which calls are open, and what
//! an answer means: the poller's schedule and state machine, with no host
//! calls (the plugin makes them and reports back here).
//!
//! Why its own state machine:
//! - **Never pile up.** At most one call per instance is open. A poll still
//!   open when the next is due is not repeated (counted as skipped); a call
//!   Envoy never answers is given up after its timeout plus a grace, so a
//!   lost callback cannot stop an instance's polling for good.
//! - **Jitter.** Each next poll is due `interval` +- 20 % after the last one
//!   was sent, so proxies started together drift apart instead of polling
//!   every instance in step.
//! - **Log once per change.** Each instance remembers whether its last poll
//!   gave a sample; only a change of that state is reported (a warning with
//!   the fault when it starts failing, an info line when it recovers), not
//!   every failed poll.

use std::collections::HashMap;

use super::metrics_text::{self, BodyFault, Series};
use crate::config::ENGINE_JITTER_PERCENT;
use crate::load::{EngineLoad, InstanceRef};

/// How long past its timeout an open call is given up when Envoy has not
/// answered it (Envoy answers a timed-out call itself, at the timeout).
pub const GIVE_UP_GRACE_MS: u64 = 1_000;

/// Why a poll gave no sample.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PollFault {
    /// No answer within the timeout (Envoy's 504 at the timeout, or no
    /// callback at all).
    Timeout,
    /// No answer: Envoy refused the call, reset it before any response, or
    /// answered its own 503 for an endpoint it cannot reach (refused,
    /// closed, gone).
    Unreachable(String),
    /// An answer other than 200 from the endpoint.
    Status { status: u32, excerpt: String },
    /// A 200 whose body lacks a needed series or gives it a bad value.
    Body(BodyFault),
}

impl PollFault {
    /// The reason names, in the stat names' order.
    pub const REASONS: [&'static str; 4] = ["timeout", "unreachable", "status", "body"];

    /// The reason as it appears in the failure stat's name.
    pub fn reason(&self) -> &'static str {
        match self {
            PollFault::Timeout => "timeout",
            PollFault::Unreachable(_) => "unreachable",
            PollFault::Status { .. } => "status",
            PollFault::Body(_) => "body",
        }
    }
}

impl std::fmt::Display for PollFault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PollFault::Timeout => write!(f, "no answer within the timeout"),
            PollFault::Unreachable(why) => write!(f, "no answer ({why})"),
            PollFault::Status { status, excerpt } if excerpt.is_empty() => {
                write!(f, "answered {status}")
            }
            PollFault::Status { status, excerpt } => write!(f, "answered {status}: {excerpt:?}"),
            PollFault::Body(fault) => write!(f, "unusable body: {fault}"),
        }
    }
}

/// How Envoy's 503 local replies begin when the endpoint cannot be reached
/// (`source/common/router/router.cc`; seen for a closed port and for a
/// server that closes the connection).
const ENVOY_UNREACHABLE: [&[u8]; 2] = [b"upstream connect error", b"no healthy upstream"];

/// What one answer to a poll says: the engine's load, or why there is none.
/// `status` None: Envoy reported no response at all; `elapsed_ms` is the
/// time since the call was sent.
pub fn judge(
    status: Option<u32>,
    body: &[u8],
    elapsed_ms: u64,
    timeout_ms: u64,
    series: &Series,
) -> Result<EngineLoad, PollFault> {
    // Envoy answers a call that reached its timeout with a 504 of its own.
    let timed_out = elapsed_ms.saturating_add(timeout_ms / 20) >= timeout_ms;
    match status {
        None if timed_out => Err(PollFault::Timeout),
        None => Err(PollFault::Unreachable("reset before a response".into())),
        Some(504) if timed_out => Err(PollFault::Timeout),
        // Envoy's own answer when it cannot reach the endpoint (refused,
        // reset, gone): the texts of its local replies.
        Some(503) if ENVOY_UNREACHABLE.iter().any(|t| body.starts_with(t)) => {
            Err(PollFault::Unreachable(excerpt(body)))
        }
        Some(200) => metrics_text::parse(body, series).map_err(PollFault::Body),
        Some(status) => Err(PollFault::Status {
            status,
            excerpt: excerpt(body),
        }),
    }
}

/// The start of a body, as text for a log line.
fn excerpt(body: &[u8]) -> String {
    const MAX: usize = 120;
    let text = String::from_utf8_lossy(body.get(..MAX).unwrap_or(body));
    text.trim().replace(['\n', '\r'], " ")
}

/// A change of an instance's polling state, to be logged.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    /// It gave no sample, and it did not fail for this reason before.
    Failing(PollFault),
    /// It gave a sample again after failing.
    Recovered,
}

/// One instance's polling state.
#[derive(Debug, Clone)]
struct Polled {
    instance: InstanceRef,
    /// When the next poll is due (host clock).
    due_ms: u64,
    /// The open call: its token and when it was sent.
    open: Option<(u32, u64)>,
    /// Why the last poll failed (None: it gave a sample, or none ended yet).
    failing: Option<&'static str>,
}

/// See the module documentation.
#[derive(Debug, Default)]
pub struct Poller {
    by_address: HashMap<String, Polled>,
}

/// What [`Poller::due`] found.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Due {
    /// To poll now.
    pub poll: Vec<InstanceRef>,
    /// Due, but the previous call is still open: not polled again.
    pub skipped: u32,
}

impl Poller {
    /// The instances of `targets` (the fleet the tracker knows) whose poll
    /// is due at `now_ms`. A new instance is due at once; an instance no
    /// longer in `targets` is forgotten once no call of it is open.
    pub fn due(&mut self, targets: &[InstanceRef], now_ms: u64) -> Due {
        self.by_address.retain(|address, polled| {
            polled.open.is_some() || targets.iter().any(|t| *t.address == **address)
        });
        let mut due = Due::default();
        for target in targets {
            let polled = self
                .by_address
                .entry(target.address.to_string())
                .or_insert_with(|| Polled {
                    instance: target.clone(),
                    due_ms: now_ms,
                    open: None,
                    failing: None,
                });
            // The slot may have changed (re-registered).
            polled.instance.slot = target.slot;
            if now_ms < polled.due_ms {
                continue;
            }
            if polled.open.is_some() {
                due.skipped += 1;
                // Looked at again one interval on, as if it had been sent.
                continue;
            }
            due.poll.push(target.clone());
        }
        due
    }

    /// A poll of `address` was sent as call `token` at `now_ms` (`None`:
    /// the host refused to send it). Either way the next one is due
    /// `interval_ms` +- 20 % later, `random` choosing where.
    pub fn sent(
        &mut self,
        address: &str,
        token: Option<u32>,
        now_ms: u64,
        interval_ms: u64,
        random: u64,
    ) {
        if let Some(polled) = self.by_address.get_mut(address) {
            polled.open = token.map(|t| (t, now_ms));
            polled.due_ms = now_ms.saturating_add(jittered(interval_ms, random));
        }
    }

    /// A skipped instance's next look: one interval on.
    pub fn postpone_skipped(&mut self, now_ms: u64, interval_ms: u64, random: u64) {
        for polled in self.by_address.values_mut() {
            if polled.open.is_some() && now_ms >= polled.due_ms {
                polled.due_ms = now_ms.saturating_add(jittered(interval_ms, random));
            }
        }
    }

    /// Call `token` was answered: its instance and when it was sent, and the
    /// call is closed. None: not a call of this poller (or given up).
    pub fn answered(&mut self, token: u32) -> Option<(InstanceRef, u64)> {
        let polled = self
            .by_address
            .values_mut()
            .find(|p| p.open.is_some_and(|(t, _)| t == token))?;
        let (_, sent_ms) = polled.open.take()?;
        Some((polled.instance.clone(), sent_ms))
    }

    /// Open calls sent more than `timeout_ms` + [`GIVE_UP_GRACE_MS`] ago:
    /// closed, and their instances returned (each a timeout).
    pub fn give_up(&mut self, now_ms: u64, timeout_ms: u64) -> Vec<InstanceRef> {
        let limit = timeout_ms.saturating_add(GIVE_UP_GRACE_MS);
        let mut gone = Vec::new();
        for polled in self.by_address.values_mut() {
            if let Some((_, sent_ms)) = polled.open {
                if now_ms.saturating_sub(sent_ms) > limit {
                    polled.open = None;
                    gone.push(polled.instance.clone());
                }
            }
        }
        gone
    }

    /// The earliest time something is due: a poll, or giving up an open
    /// call (`timeout_ms` + [`GIVE_UP_GRACE_MS`] after it was sent). None
    /// when no instance is known yet.
    pub fn next_due_ms(&self, timeout_ms: u64) -> Option<u64> {
        let give_up = timeout_ms.saturating_add(GIVE_UP_GRACE_MS) + 1;
        self.by_address
            .values()
            .map(|p| match p.open {
                Some((_, sent_ms)) => p.due_ms.min(sent_ms.saturating_add(give_up)),
                None => p.due_ms,
            })
            .min()
    }

    /// Calls open now.
    pub fn open_calls(&self) -> usize {
        self.by_address
            .values()
            .filter(|p| p.open.is_some())
            .count()
    }

    /// Records how a poll of `address` ended; returns the change to log,
    /// if its state changed.
    pub fn ended(&mut self, address: &str, outcome: Result<(), &PollFault>) -> Option<Change> {
        let polled = self.by_address.get_mut(address)?;
        match outcome {
            Ok(()) => polled.failing.take().map(|_| Change::Recovered),
            // Failing for another reason than before is no change of
            // state (the stats count each reason); an endpoint alternating
            // between two faults logs once.
            Err(fault) => polled
                .failing
                .replace(fault.reason())
                .is_none()
                .then(|| Change::Failing(fault.clone())),
        }
    }
}

/// `interval_ms` +- [`ENGINE_JITTER_PERCENT`] %, at least 1 ms, placed by
/// `random`.
pub fn jittered(interval_ms: u64, random: u64) -> u64 {
    let spread = interval_ms * ENGINE_JITTER_PERCENT / 100;
    let low = interval_ms - spread;
    let offset = random % (2 * spread + 1);
    (low + offset).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn instance(slot: u16, port: u16) -> InstanceRef {
        InstanceRef::new(slot, format!("127.0.0.1:{port}").into())
    }

    fn vllm() -> Series {
        crate::config::Engine::Vllm.series()
    }

    #[test]
    fn new_instances_are_due_at_once_then_after_a_jittered_interval() {
        let mut poller = Poller::default();
        let fleet = [instance(0, 8001), instance(1, 8002)];
        assert_eq!(poller.due(&fleet, 1_000).poll, fleet.to_vec());
        poller.sent(&fleet[0].address, Some(1), 1_000, 500, 0);
        poller.sent(&fleet[1].address, Some(2), 1_000, 500, 200);
        assert_eq!(poller.answered(1), Some((fleet[0].clone(), 1_000)));
        assert_eq!(poller.answered(2), Some((fleet[1].clone(), 1_000)));
        assert_eq!(poller.answered(2), None, "answered once");
        // Jitter 0 puts the first at 400 ms, 200 the second at 600 ms.
        assert!(poller.due(&fleet, 1_399).poll.is_empty());
        assert_eq!(poller.due(&fleet, 1_400).poll, vec![fleet[0].clone()]);
        assert_eq!(poller.due(&fleet, 1_600).poll, fleet.to_vec());
    }

    #[test]
    fn jitter_stays_within_twenty_percent_and_covers_it() {
        let values: Vec<u64> = (0..10_000u64)
            .map(|r| jittered(1_000, r.wrapping_mul(0x9E37_79B9_7F4A_7C15)))
            .collect();
        assert_eq!(values.iter().min(), Some(&800));
        assert_eq!(values.iter().max(), Some(&1_200));
        assert_eq!(jittered(50, u64::MAX), 50 - 10 + u64::MAX % 21);
        assert_eq!(jittered(1, 7), 1);
    }

    #[test]
    fn a_poll_still_open_when_the_next_is_due_is_not_repeated() {
        let mut poller = Poller::default();
        let fleet = [instance(0, 8001)];
        assert_eq!(poller.due(&fleet, 0).poll.len(), 1);
        poller.sent(&fleet[0].address, Some(7), 0, 100, 0);
        let due = poller.due(&fleet, 80);
        assert!(due.poll.is_empty());
        assert_eq!(due.skipped, 1);
        poller.postpone_skipped(80, 100, 0);
        assert_eq!(poller.due(&fleet, 100), Due::default(), "postponed");
        assert_eq!(poller.open_calls(), 1);
        // Answered late: polled again at its next due time.
        assert!(poller.answered(7).is_some());
        assert_eq!(poller.due(&fleet, 160).poll.len(), 1);
    }

    #[test]
    fn a_call_envoy_never_answers_is_given_up_after_timeout_and_grace() {
        let mut poller = Poller::default();
        let fleet = [instance(3, 8004)];
        poller.due(&fleet, 0);
        poller.sent(&fleet[0].address, Some(9), 0, 500, 0);
        assert!(poller.give_up(400 + GIVE_UP_GRACE_MS, 400).is_empty());
        assert_eq!(
            poller.give_up(401 + GIVE_UP_GRACE_MS, 400),
            vec![fleet[0].clone()]
        );
        assert_eq!(poller.open_calls(), 0);
        assert_eq!(poller.answered(9), None, "a late answer is ignored");
    }

    #[test]
    fn the_next_due_time_covers_polls_and_giving_up() {
        let mut poller = Poller::default();
        assert_eq!(poller.next_due_ms(400), None);
        let fleet = [instance(0, 8001), instance(1, 8002)];
        poller.due(&fleet, 0);
        assert_eq!(poller.next_due_ms(400), Some(0));
        poller.sent(&fleet[0].address, Some(1), 0, 10_000, 0);
        poller.sent(&fleet[1].address, None, 0, 10_000, 0);
        // Both next due at 8 s; the open call is given up first.
        assert_eq!(poller.next_due_ms(400), Some(400 + GIVE_UP_GRACE_MS + 1));
        poller.answered(1);
        assert_eq!(poller.next_due_ms(400), Some(8_000));
    }

    #[test]
    fn a_refused_send_leaves_no_open_call() {
        let mut poller = Poller::default();
        let fleet = [instance(0, 8001)];
        poller.due(&fleet, 0);
        poller.sent(&fleet[0].address, None, 0, 100, 0);
        assert_eq!(poller.open_calls(), 0);
        assert_eq!(poller.due(&fleet, 80).poll.len(), 1);
    }

    #[test]
    fn instances_leaving_the_fleet_are_forgotten_once_their_call_ended() {
        let mut poller = Poller::default();
        let both = [instance(0, 8001), instance(1, 8002)];
        poller.due(&both, 0);
        poller.sent(&both[0].address, Some(1), 0, 100, 0);
        poller.sent(&both[1].address, None, 0, 100, 0);
        poller.due(&[], 10);
        assert_eq!(poller.by_address.len(), 1, "the open call is kept");
        assert!(poller.answered(1).is_some());
        poller.due(&[], 20);
        assert!(poller.by_address.is_empty());
    }

    #[test]
    fn state_changes_are_reported_once() {
        let mut poller = Poller::default();
        let fleet = [instance(0, 8001)];
        poller.due(&fleet, 0);
        let address = &*fleet[0].address;
        assert_eq!(poller.ended(address, Ok(())), None, "first sample");
        let timeout = PollFault::Timeout;
        assert_eq!(
            poller.ended(address, Err(&timeout)),
            Some(Change::Failing(PollFault::Timeout))
        );
        assert_eq!(poller.ended(address, Err(&timeout)), None);
        let status = PollFault::Status {
            status: 500,
            excerpt: String::new(),
        };
        assert_eq!(
            poller.ended(address, Err(&status)),
            None,
            "another reason is the same state"
        );
        assert_eq!(poller.ended(address, Ok(())), Some(Change::Recovered));
        assert_eq!(poller.ended(address, Ok(())), None);
        assert_eq!(poller.ended("10.0.0.1:1", Ok(())), None, "unknown");
    }

    #[test]
    fn answers_are_judged_by_status_time_and_body() {
        let good = b"vllm:num_requests_running 2\nvllm:num_requests_waiting 1\n\
                     vllm:kv_cache_usage_perc 0.25\n";
        assert_eq!(
            judge(Some(200), good, 10, 400, &vllm()),
            Ok(EngineLoad {
                running: 2,
                waiting: 1,
                kv_usage_permille: Some(250)
            })
        );
        assert_eq!(
            judge(Some(504), b"upstream request timeout", 400, 400, &vllm()),
            Err(PollFault::Timeout)
        );
        assert_eq!(
            judge(Some(504), b"gateway", 10, 400, &vllm()).map_err(|f| f.reason()),
            Err("status"),
            "an engine's own quick 504 is a status"
        );
        assert_eq!(judge(None, b"", 400, 400, &vllm()), Err(PollFault::Timeout));
        assert_eq!(
            judge(None, b"", 3, 400, &vllm()).map_err(|f| f.reason()),
            Err("unreachable")
        );
        assert_eq!(
            judge(
                Some(503),
                b"upstream connect error or disconnect/reset before headers. reset reason: \
                  remote connection failure",
                3,
                400,
                &vllm()
            )
            .map_err(|f| f.reason()),
            Err("unreachable")
        );
        assert_eq!(
            judge(Some(503), b"overloaded\n", 3, 400, &vllm()),
            Err(PollFault::Status {
                status: 503,
                excerpt: "overloaded".into()
            })
        );
        assert_eq!(
            judge(Some(200), b"garbage", 3, 400, &vllm()).map_err(|f| f.reason()),
            Err("body")
        );
        for (fault, reason) in [
            (PollFault::Timeout, "timeout"),
            (PollFault::Unreachable(String::new()), "unreachable"),
            (
                PollFault::Status {
                    status: 1,
                    excerpt: String::new(),
                },
                "status",
            ),
            (PollFault::Body(BodyFault::Missing(String::new())), "body"),
        ] {
            assert_eq!(fault.reason(), reason);
            assert!(PollFault::REASONS.contains(&reason));
        }
    }
}
