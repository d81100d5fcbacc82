//! Which worker VM of an Envoy makes a poller's calls (the engines'
//! `/metrics`, Envoy's admin): each VM draws a nonce once, takes or renews
//! the poller's lease in shared data on its tick, and logs when it starts or
//! stops holding it. The lease itself is [`crate::load::LoadTracker::hold_poller`].

use super::vm::Vm;
use crate::config::Config;
use crate::host::Host;
use crate::load::PollerKind;

/// This VM's side of one poller's lease.
#[derive(Debug, Default)]
pub struct PollerLease {
    /// This VM's identity in the lease (random, once per VM).
    nonce: Option<u64>,
    /// Whether this VM held the lease at its last tick.
    holding: bool,
}

impl PollerLease {
    /// Whether this VM makes `poller`'s calls now (see the module
    /// documentation).
    pub fn hold<H: Host + Clone>(
        &mut self,
        vm: &mut Vm<H>,
        config: &Config,
        poller: PollerKind,
        lease_ms: u64,
        now: u64,
    ) -> bool {
        let nonce = match self.nonce {
            Some(nonce) => nonce,
            None => *self.nonce.insert(vm.random().max(1)),
        };
        let holding = vm.with_tracker(config, |t| t.hold_poller(poller, nonce, now, lease_ms));
        if holding != self.holding {
            log::info!(
                "prefix-router: this worker VM {} the {} poller",
                if holding { "is now" } else { "is no longer" },
                match poller {
                    PollerKind::EngineLoad => "engine load",
                    PollerKind::Discovery => "discovery",
                }
            );
            self.holding = holding;
        }
        holding
    }
}
