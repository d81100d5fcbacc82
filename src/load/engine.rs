//! What an engine (vLLM, SGLang, llama.cpp) last reported about its own load,
//! as one shared record per instance, and how a decision turns that report
//! into the instance's load for the whole fleet.
//!
//! Why: every count the filter keeps is this Envoy's. With N proxies in front
//! of a fleet (gateway replicas, or a sidecar per client pod) an instance
//! receives what all of them send, and only the engine sees that sum. The
//! engine's figure is a sample, though: since it was taken, this Envoy has
//! sent more. So the load a decision sees is the engine's running + waiting
//! plus this Envoy's in-flight requests on the instance beyond what it had in
//! flight when the sample arrived ([`EngineRecord::estimated_requests`]).
//! Requests other proxies sent since the sample are not seen until the next
//! one; the sampling interval bounds how stale that is.

use super::codec::{Reader, Writer};
use super::table::Record;

const ENGINE_VERSION: u8 = 4;

/// What the engine reported: its running and waiting requests and, where it
/// exports it, the share of its KV cache in use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct EngineLoad {
    pub running: u32,
    pub waiting: u32,
    /// KV-cache usage in thousandths (0..=1000); None if the engine does not
    /// export it (llama.cpp).
    pub kv_usage_permille: Option<u16>,
}

/// A set of adapter names (the adapters an engine lists in `/v1/models`, or
/// those its requests run or wait for), as a Bloom filter of the names' xxh3
/// ([`crate::config::AdaptersConfig::adapter_name`]): one record of fixed
/// size whatever the count. It may hold a name it was not given (then the
/// request goes as without the list), never miss one it was. Shared, not
/// copied: every decision hands each candidate its engine's lists.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdapterNames {
    bits: std::rc::Rc<[u8; NAMES_BYTES]>,
    /// The names' hashes, sorted, when the set was built from a whole list
    /// of at most [`MAX_LISTED`]; empty otherwise.
    listed: std::rc::Rc<[u64]>,
    /// Their hash, which changes with the list (0: none).
    listed_hash: u64,
}

impl Default for AdapterNames {
    fn default() -> Self {
        Self {
            bits: std::rc::Rc::new([0; NAMES_BYTES]),
            listed: std::rc::Rc::from([]),
            listed_hash: 0,
        }
    }
}

/// The most names an engine's list keeps exactly (besides the filter).
pub const MAX_LISTED: usize = 64;

fn hash_of_listed(listed: &[u64]) -> u64 {
    if listed.is_empty() {
        return 0;
    }
    let mut hasher = xxhash_rust::xxh3::Xxh3::new();
    for name in listed {
        hasher.update(&name.to_le_bytes());
    }
    hasher.digest()
}

/// The hash an adapter is known by: its name as a request gives it and as an
/// engine lists it.
pub fn adapter_hash(name: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(name)
}

const NAMES_BYTES: usize = 128;
const NAMES_BITS: u64 = NAMES_BYTES as u64 * 8;

impl AdapterNames {
    /// The filter's two bits for `adapter`: from either half of its hash.
    fn bits(adapter: u64) -> [u64; 2] {
        [adapter % NAMES_BITS, (adapter >> 32) % NAMES_BITS]
    }

    pub fn insert(&mut self, adapter: u64) {
        for bit in Self::bits(adapter) {
            let bits = std::rc::Rc::make_mut(&mut self.bits);
            if let Some(byte) = bits.get_mut((bit / 8) as usize) {
                *byte |= 1 << (bit % 8);
            }
        }
    }

    /// The set of a whole list of names, each with whether it names an
    /// adapter: the filter of them all, and the adapters themselves if
    /// there are at most [`MAX_LISTED`].
    pub fn of_list(names: impl IntoIterator<Item = (u64, bool)>) -> Self {
        let mut set = Self::default();
        let mut listed: Vec<u64> = Vec::new();
        for (name, adapter) in names {
            set.insert(name);
            if adapter {
                listed.push(name);
            }
        }
        listed.sort_unstable();
        listed.dedup();
        if listed.len() <= MAX_LISTED {
            set.listed_hash = hash_of_listed(&listed);
            set.listed = listed.into();
        }
        set
    }

    /// The hash of [`Self::listed`] (0: none).
    pub fn listed_hash(&self) -> u64 {
        self.listed_hash
    }

    /// The adapters, sorted, if known exactly (else empty).
    pub fn listed(&self) -> &[u64] {
        &self.listed
    }

    pub fn contains(&self, adapter: u64) -> bool {
        Self::bits(adapter).iter().all(|bit| {
            self.bits
                .get((bit / 8) as usize)
                .is_some_and(|byte| byte & (1 << (bit % 8)) != 0)
        })
    }
}

/// The fleet-wide overload rule: an instance whose estimated load reaches a
/// bound takes no new request while another instance is below it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct EngineBounds {
    /// Bound of running + waiting (estimated, see the module documentation).
    pub max_requests: Option<u32>,
    /// Bound of KV-cache usage, in thousandths.
    pub max_kv_usage_permille: Option<u16>,
}

/// How a deciding configuration uses the engine samples: how old one may be,
/// and the fleet-wide bounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct EngineView {
    pub max_age_ms: u64,
    pub bounds: EngineBounds,
}

/// One instance's last engine sample, under `engine/<slot>`. The default
/// record (a missing key) holds no sample.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(crate) struct EngineRecord {
    /// Hash of the instance's address: a slot reused by another instance
    /// does not inherit the sample.
    pub(crate) addr_hash: u64,
    /// When the sample arrived (host clock, ms); 0: no sample.
    pub(crate) sampled_at_ms: u64,
    pub(crate) load: EngineLoad,
    /// This Envoy's in-flight requests on the instance when the sample
    /// arrived (all worker VMs).
    pub(crate) base_in_flight: u32,
    /// The adapters its last `/v1/models` answer listed; None: not known.
    pub(crate) served: Option<AdapterNames>,
    /// The adapters with requests running or waiting in the sample
    /// (`vllm:lora_requests_info`); None: not reported.
    pub(crate) active_adapters: Option<AdapterNames>,
}

impl EngineRecord {
    /// True if the record holds a sample of `addr_hash` at most `max_age_ms`
    /// old at `now_ms`.
    pub(crate) fn is_fresh(&self, addr_hash: u64, now_ms: u64, max_age_ms: u64) -> bool {
        self.sampled_at_ms != 0
            && self.addr_hash == addr_hash
            && now_ms.saturating_sub(self.sampled_at_ms) <= max_age_ms
    }

    /// The instance's load for the whole fleet: the engine's running +
    /// waiting, plus what this Envoy has in flight there beyond what it had
    /// when the sample arrived, and never less than this Envoy has in flight.
    pub(crate) fn estimated_requests(&self, in_flight_now: u32) -> u32 {
        self.load
            .running
            .saturating_add(self.load.waiting)
            .saturating_add(in_flight_now.saturating_sub(self.base_in_flight))
            // The engine may not have seen requests still on their way to it.
            .max(in_flight_now)
    }

    /// Requests the instance may still take under `bounds.max_requests`.
    pub(crate) fn room(&self, bounds: &EngineBounds, in_flight_now: u32) -> Option<u32> {
        bounds
            .max_requests
            .map(|max| max.saturating_sub(self.estimated_requests(in_flight_now)))
    }

    /// True if the estimate reaches a configured bound.
    pub(crate) fn over(&self, bounds: &EngineBounds, in_flight_now: u32) -> bool {
        let requests = bounds
            .max_requests
            .is_some_and(|max| self.estimated_requests(in_flight_now) >= max);
        let kv = match (bounds.max_kv_usage_permille, self.load.kv_usage_permille) {
            (Some(max), Some(used)) => used >= max,
            _ => false,
        };
        requests || kv
    }
}

/// `u16::MAX` encodes "not exported".
const NO_KV_USAGE: u16 = u16::MAX;

impl Record for EngineRecord {
    fn encode(&self) -> Vec<u8> {
        let lists = [&self.served, &self.active_adapters];
        let flags = lists.iter().enumerate().fold(0u8, |flags, (at, list)| {
            flags | u8::from(list.is_some()) << at
        });
        let mut w = Writer::with_capacity(32 + 2 * NAMES_BYTES);
        w.u8(ENGINE_VERSION)
            .u64(self.addr_hash)
            .u64(self.sampled_at_ms)
            .u32(self.load.running)
            .u32(self.load.waiting)
            .u16(self.load.kv_usage_permille.unwrap_or(NO_KV_USAGE))
            .u32(self.base_in_flight)
            .u8(flags);
        for list in lists.into_iter().flatten() {
            w.bytes(&list.bits[..]);
            w.u16(u16::try_from(list.listed.len()).unwrap_or(0));
            for &name in list.listed.iter() {
                w.u64(name);
            }
        }
        w.finish()
    }

    fn decode(buf: &[u8]) -> Option<Self> {
        let mut r = Reader::new(buf);
        if r.u8()? != ENGINE_VERSION {
            return None;
        }
        let addr_hash = r.u64()?;
        let sampled_at_ms = r.u64()?;
        let running = r.u32()?;
        let waiting = r.u32()?;
        let kv = r.u16()?;
        let base_in_flight = r.u32()?;
        let flags = r.u8()?;
        let mut list = |at: u8| -> Option<Option<AdapterNames>> {
            if flags & (1 << at) == 0 {
                return Some(None);
            }
            let bits: [u8; NAMES_BYTES] = r.bytes(NAMES_BYTES)?.try_into().ok()?;
            let count = usize::from(r.u16()?).min(MAX_LISTED);
            let listed: Vec<u64> = (0..count).map(|_| r.u64()).collect::<Option<_>>()?;
            Some(Some(AdapterNames {
                bits: std::rc::Rc::new(bits),
                listed_hash: hash_of_listed(&listed),
                listed: listed.into(),
            }))
        };
        let served = list(0)?;
        let active_adapters = list(1)?;
        r.is_empty().then_some(Self {
            addr_hash,
            sampled_at_ms,
            load: EngineLoad {
                running,
                waiting,
                kv_usage_permille: (kv != NO_KV_USAGE).then_some(kv.min(1000)),
            },
            base_in_flight,
            served,
            active_adapters,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(running: u32, waiting: u32, kv: Option<u16>, base: u32) -> EngineRecord {
        EngineRecord {
            addr_hash: 7,
            sampled_at_ms: 1_000,
            load: EngineLoad {
                running,
                waiting,
                kv_usage_permille: kv,
            },
            base_in_flight: base,
            served: None,
            active_adapters: None,
        }
    }

    #[test]
    fn served_adapters_round_trip_and_never_deny_a_listed_adapter() {
        let mut served = AdapterNames::default();
        let listed: Vec<u64> = (0..100u64)
            .map(|a| adapter_hash(format!("lora-{a}").as_bytes()))
            .collect();
        for &adapter in &listed {
            served.insert(adapter);
        }
        assert!(listed.iter().all(|&a| served.contains(a)));
        let unlisted = (100..1_100u64)
            .filter(|a| served.contains(adapter_hash(format!("lora-{a}").as_bytes())))
            .count();
        // A hundred listed adapters in 1,024 bits: a few unlisted ones pass.
        assert!(unlisted < 100, "{unlisted} of 1,000 unlisted adapters pass");
        assert!(!AdapterNames::default().contains(listed[0]));
        let mut active = AdapterNames::default();
        active.insert(listed[7]);
        // A whole list of at most MAX_LISTED adapters is kept exactly too.
        let exact = AdapterNames::of_list(listed[..10].iter().map(|&a| (a, true)));
        assert_eq!(exact.listed().len(), 10);
        let long = AdapterNames::of_list(listed.iter().map(|&a| (a, true)));
        assert!(long.listed().is_empty() && long.contains(listed[99]));
        for (served, active_adapters) in [
            (Some(served.clone()), None),
            (None, Some(active.clone())),
            (Some(served), Some(active)),
            (Some(exact), None),
        ] {
            let record = EngineRecord {
                served,
                active_adapters,
                ..sample(3, 2, Some(450), 1)
            };
            assert_eq!(EngineRecord::decode(&record.encode()), Some(record.clone()));
            let mut cut = record.encode();
            cut.pop();
            assert_eq!(EngineRecord::decode(&cut), None);
        }
    }

    #[test]
    fn round_trip_with_and_without_kv_usage_and_foreign_bytes() {
        for record in [sample(3, 2, Some(450), 1), sample(0, 0, None, 0)] {
            assert_eq!(EngineRecord::decode(&record.encode()), Some(record));
        }
        let mut other_version = sample(1, 1, None, 0).encode();
        other_version[0] = ENGINE_VERSION + 1;
        assert_eq!(EngineRecord::decode(&other_version), None);
        let mut long = sample(1, 1, None, 0).encode();
        long.push(0);
        assert_eq!(EngineRecord::decode(&long), None);
        assert_eq!(EngineRecord::decode(&[ENGINE_VERSION, 1, 2]), None);
    }

    #[test]
    fn freshness_needs_a_sample_of_this_address_within_the_age() {
        let record = sample(1, 0, None, 0);
        assert!(record.is_fresh(7, 1_500, 500));
        assert!(!record.is_fresh(7, 1_501, 500));
        assert!(!record.is_fresh(8, 1_100, 500));
        assert!(!EngineRecord::default().is_fresh(0, 0, u64::MAX));
    }

    #[test]
    fn estimate_adds_only_what_this_envoy_sent_since_the_sample() {
        let record = sample(4, 2, None, 3);
        assert_eq!(record.estimated_requests(3), 6);
        assert_eq!(record.estimated_requests(5), 8);
        // Requests that finished since the sample are already out of the
        // engine's next figure; they do not make the estimate negative.
        assert_eq!(record.estimated_requests(0), 6);
        // Never below what this Envoy itself has in flight there.
        assert_eq!(sample(1, 0, None, 3).estimated_requests(3), 3);
        assert_eq!(sample(1, 0, None, 3).room(&bounds(4), 3), Some(1));
        assert_eq!(record.room(&bounds(4), 3), Some(0));
        assert_eq!(record.room(&EngineBounds::default(), 3), None);
    }

    fn bounds(max_requests: u32) -> EngineBounds {
        EngineBounds {
            max_requests: Some(max_requests),
            max_kv_usage_permille: None,
        }
    }

    #[test]
    fn over_either_bound_and_never_without_one() {
        let record = sample(4, 2, Some(900), 0);
        let none = EngineBounds::default();
        assert!(!record.over(&none, 10));
        let requests = EngineBounds {
            max_requests: Some(7),
            max_kv_usage_permille: None,
        };
        assert!(!record.over(&requests, 0));
        assert!(record.over(&requests, 1));
        let kv = EngineBounds {
            max_requests: None,
            max_kv_usage_permille: Some(900),
        };
        assert!(record.over(&kv, 0));
        assert!(!sample(4, 2, None, 0).over(&kv, 0));
        assert!(!sample(4, 2, Some(899), 0).over(&kv, 0));
    }
}
