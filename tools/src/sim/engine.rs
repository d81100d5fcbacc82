//! The simulated engine: a waiting queue, continuous batching up to
//! `max_num_seqs`, the block pool, and the cost model that turns uncached
//! prompt tokens into time to first token. It holds no timers of its own:
//! admission computes when a request's first token is due and each request's
//! own task sleeps until then, so an idle simulator costs nothing.
//!
//! Scheduling, as vLLM v1's FCFS scheduler: requests are admitted in arrival
//! order while fewer than `max_num_seqs` run and the head request's blocks fit
//! (head-of-line blocking, as vLLM). Prefill compute is one shared FIFO
//! resource: a request's prefill starts when every earlier admitted prefill
//! has finished. That models a GPU saturated by prefill, where batching
//! prefills together does not make them cheaper (prefill is compute bound);
//! it is why cache hits, by shrinking everyone's prefill, shorten the queue
//! for all. A request's first token also waits at least one decode step (a
//! forward pass reads all weights however few tokens it computes).
//!
//! With LoRA slots ([`LoraSlots`]), a waiting request whose adapter cannot
//! get a slot is passed over for later ones (vLLM's scheduler skips it the
//! same way); an adapter made resident delays that request's prefill, and
//! every later one, by `lora_load_ms`.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::oneshot;
use tokio::time::Instant;

use super::lora::{Acquired, LoraSlots};
use super::metrics::LoraMetrics;
use super::metrics::{Histogram, MetricsSnapshot, TTFT_BUCKETS};
use super::prefix_cache::{block_hashes, AllocError, Allocation, BlockPool};
use super::tokenizer::TokenId;
use super::SimConfig;

/// One request as the engine sees it.
#[derive(Debug, Clone)]
pub struct Job {
    /// Prompt token ids.
    pub prompt: Vec<TokenId>,
    /// Output tokens to produce (the simulator always produces exactly this many).
    pub max_tokens: usize,
    /// Extra keys of block 0 (model, cache salt).
    pub first_extra: Vec<u8>,
    /// The LoRA adapter the request runs with; `None` for the base model.
    pub adapter: Option<String>,
}

/// What a request learns when it is admitted.
#[derive(Debug, Clone, Copy)]
pub struct Admission {
    /// Prompt tokens served from the prefix cache.
    pub hit_tokens: usize,
    /// When the first output token is due (real time).
    pub first_token_at: Instant,
    /// Real time between output tokens.
    pub inter_token: Duration,
}

/// Why a request was refused.
#[derive(Debug, PartialEq, Eq)]
pub enum SubmitError {
    /// Prompt plus outputs need more KV blocks than the instance has.
    TooLarge {
        needed_blocks: usize,
        capacity: usize,
    },
}

impl std::fmt::Display for SubmitError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SubmitError::TooLarge {
                needed_blocks,
                capacity,
            } => write!(
                f,
                "the request needs {needed_blocks} KV cache blocks (prompt plus max_tokens) but the instance has {capacity}"
            ),
        }
    }
}

struct Waiting {
    id: u64,
    hashes: Vec<u64>,
    num_tokens: usize,
    total_tokens: usize,
    arrived: Instant,
    reply: oneshot::Sender<Admission>,
    adapter: Option<String>,
}

struct Running {
    allocation: Allocation,
    adapter: Option<String>,
}

struct State {
    pool: BlockPool,
    waiting: VecDeque<Waiting>,
    running: HashMap<u64, Running>,
    prefill_free_at: Instant,
    next_id: u64,
    prefix_cache_queries: u64,
    prefix_cache_hits: u64,
    prompt_tokens: u64,
    generation_tokens: u64,
    request_success: u64,
    ttft: Histogram,
    /// Most requests running + waiting at once since the last
    /// [`Engine::take_peak_requests`].
    peak_requests: usize,
    lora: LoraSlots,
    /// Adapters the API serves, as (name, path), in the order they were added.
    adapters: Vec<(String, String)>,
    /// `vllm:lora_requests_info`'s series: (running adapters, waiting
    /// adapters, unix time the state was last seen).
    lora_states: Vec<(String, String, f64)>,
}

/// The engine of one simulated instance.
pub struct Engine {
    cfg: SimConfig,
    state: Mutex<State>,
}

impl Engine {
    /// An idle engine with an empty cache.
    pub fn new(cfg: SimConfig) -> Arc<Self> {
        let pool = BlockPool::new(cfg.kv_blocks, cfg.block_size);
        Arc::new(Engine {
            state: Mutex::new(State {
                pool,
                waiting: VecDeque::new(),
                running: HashMap::new(),
                prefill_free_at: Instant::now(),
                next_id: 0,
                prefix_cache_queries: 0,
                prefix_cache_hits: 0,
                prompt_tokens: 0,
                generation_tokens: 0,
                request_success: 0,
                ttft: Histogram::new(&TTFT_BUCKETS),
                peak_requests: 0,
                lora: LoraSlots::new(cfg.max_loras),
                adapters: cfg.lora_modules.clone(),
                lora_states: Vec::new(),
            }),
            cfg,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &SimConfig {
        &self.cfg
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock cannot leave the counters half
        // updated in a way worse than losing the instance, so carry on.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Simulated seconds of prefill compute for `uncached` tokens after
    /// `cached` tokens of context: a per-token term (weights) plus an
    /// attention term growing with each token's position.
    pub fn prefill_seconds(&self, cached: usize, uncached: usize) -> f64 {
        let n = uncached as f64;
        let c = cached as f64;
        let positions = n * c + n * (n - 1.0).max(0.0) / 2.0;
        n * self.cfg.prefill_us_per_token * 1e-6 + positions * self.cfg.prefill_attention_ns * 1e-9
    }

    /// Simulated seconds per output token with `running` sequences in the batch.
    pub fn decode_seconds(&self, running: usize) -> f64 {
        (self.cfg.decode_ms_per_token + self.cfg.decode_ms_per_seq * running as f64) * 1e-3
    }

    fn real(&self, simulated_seconds: f64) -> Duration {
        Duration::from_secs_f64((simulated_seconds / self.cfg.time_scale).max(0.0))
    }

    /// Queues a request. Await [`Ticket::admitted`] for its admission; drop
    /// the ticket (or call [`Ticket::finish`]) to release its blocks.
    pub fn submit(self: &Arc<Self>, job: Job) -> Result<Ticket, SubmitError> {
        let total_tokens = job.prompt.len() + job.max_tokens;
        let needed_blocks = total_tokens.div_ceil(self.cfg.block_size).max(1);
        if needed_blocks > self.cfg.kv_blocks {
            return Err(SubmitError::TooLarge {
                needed_blocks,
                capacity: self.cfg.kv_blocks,
            });
        }
        let hashes = block_hashes(&job.prompt, self.cfg.block_size, &job.first_extra);
        let (tx, rx) = oneshot::channel();
        let mut state = self.lock();
        let id = state.next_id;
        state.next_id += 1;
        state.waiting.push_back(Waiting {
            id,
            hashes,
            num_tokens: job.prompt.len(),
            total_tokens,
            arrived: Instant::now(),
            reply: tx,
            adapter: job.adapter.clone(),
        });
        let requests = state.waiting.len() + state.running.len();
        state.peak_requests = state.peak_requests.max(requests);
        self.schedule(&mut state);
        self.note_lora_state(&mut state);
        drop(state);
        Ok(Ticket {
            engine: Arc::clone(self),
            id,
            job,
            admission: rx,
        })
    }

    /// Admits waiting requests in order while a slot and their blocks are
    /// free, passing over those whose adapter cannot get a LoRA slot.
    fn schedule(&self, state: &mut State) {
        let mut next = 0;
        while state.running.len() < self.cfg.max_num_seqs {
            let Some(head) = state.waiting.get(next) else {
                break;
            };
            if let Some(adapter) = &head.adapter {
                if !state.lora.can_acquire(adapter) {
                    next += 1;
                    continue;
                }
            }
            let allocation =
                match state
                    .pool
                    .allocate(&head.hashes, head.num_tokens, head.total_tokens)
                {
                    Ok(a) => a,
                    // Checked in submit against the fixed capacity; wait either way.
                    Err(AllocError::NotNow) | Err(AllocError::TooLarge { .. }) => break,
                };
            let Some(head) = state.waiting.remove(next) else {
                break;
            };
            let loaded = match &head.adapter {
                Some(adapter) => state.lora.acquire(adapter) == Some(Acquired::Loaded),
                None => false,
            };
            let load = if loaded {
                self.real(self.cfg.lora_load_ms / 1000.0)
            } else {
                Duration::ZERO
            };
            let now = Instant::now();
            let hit = allocation.hit_tokens;
            let prefill = self.prefill_seconds(hit, head.num_tokens - hit);
            let start = state.prefill_free_at.max(now) + load;
            let prefill_done = start + self.real(prefill);
            state.prefill_free_at = prefill_done;
            let running_after = state.running.len() + 1;
            let step = self.decode_seconds(running_after);
            let first_token_at = prefill_done.max(now + self.real(step));
            let admission = Admission {
                hit_tokens: hit,
                first_token_at,
                inter_token: self.real(step),
            };
            state.prefix_cache_queries += head.num_tokens as u64;
            state.prefix_cache_hits += hit as u64;
            state.prompt_tokens += head.num_tokens as u64;
            let ttft = (first_token_at - head.arrived).as_secs_f64() * self.cfg.time_scale;
            state.ttft.observe(ttft);
            if head.reply.send(admission).is_ok() {
                state.running.insert(
                    head.id,
                    Running {
                        allocation,
                        adapter: head.adapter,
                    },
                );
            } else {
                state.pool.free(allocation);
                if let Some(adapter) = &head.adapter {
                    state.lora.release(adapter);
                }
            }
        }
    }

    fn release(&self, id: u64, outputs: Option<&[TokenId]>, job: &Job) {
        let mut state = self.lock();
        if let Some(pos) = state.waiting.iter().position(|w| w.id == id) {
            state.waiting.remove(pos);
            self.note_lora_state(&mut state);
            return;
        }
        let Some(Running {
            mut allocation,
            adapter,
        }) = state.running.remove(&id)
        else {
            return;
        };
        if let Some(adapter) = &adapter {
            state.lora.release(adapter);
        }
        if let Some(outputs) = outputs {
            let mut all = job.prompt.clone();
            all.extend_from_slice(outputs);
            let hashes = block_hashes(&all, self.cfg.block_size, &job.first_extra);
            state.pool.cache_full_blocks(&mut allocation, &hashes);
            state.generation_tokens += outputs.len() as u64;
            state.request_success += 1;
        }
        state.pool.free(allocation);
        self.schedule(&mut state);
        self.note_lora_state(&mut state);
    }

    /// Records the adapters running and waiting now as the latest
    /// `vllm:lora_requests_info` state (vLLM sets the gauge of the current
    /// label values to the current time at every step).
    fn note_lora_state(&self, state: &mut State) {
        if self.cfg.max_loras == 0 {
            return;
        }
        let names = |adapters: &mut dyn Iterator<Item = &Option<String>>| {
            let set: std::collections::BTreeSet<&str> =
                adapters.filter_map(|a| a.as_deref()).collect();
            set.into_iter().collect::<Vec<_>>().join(",")
        };
        let running = names(&mut state.running.values().map(|r| &r.adapter));
        let waiting = names(&mut state.waiting.iter().map(|w| &w.adapter));
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs_f64())
            .unwrap_or(0.0);
        match state
            .lora_states
            .iter_mut()
            .find(|(r, w, _)| *r == running && *w == waiting)
        {
            Some(series) => series.2 = now,
            None => state.lora_states.push((running, waiting, now)),
        }
    }

    /// Whether a request may name `model`: the base model, or with LoRA
    /// slots an adapter the API serves. Without slots any name is accepted.
    pub fn serves_model(&self, model: &str) -> bool {
        self.cfg.max_loras == 0
            || model == self.cfg.model
            || self.lock().adapters.iter().any(|(name, _)| name == model)
    }

    /// Adds an adapter to those served; false if its name is taken.
    pub fn add_adapter(&self, name: &str, path: &str) -> bool {
        let mut state = self.lock();
        if name == self.cfg.model || state.adapters.iter().any(|(n, _)| n == name) {
            return false;
        }
        state.adapters.push((name.to_string(), path.to_string()));
        true
    }

    /// Stops serving an adapter (like vLLM, a resident copy stays until
    /// evicted); false if it was not served.
    pub fn remove_adapter(&self, name: &str) -> bool {
        let mut state = self.lock();
        let before = state.adapters.len();
        state.adapters.retain(|(n, _)| n != name);
        state.adapters.len() < before
    }

    /// The adapters served, as (name, path).
    pub fn adapters(&self) -> Vec<(String, String)> {
        self.lock().adapters.clone()
    }

    /// Empties the prefix cache (between benchmark phases); false while
    /// requests are running or waiting. Counters are kept, as in vLLM.
    pub fn reset_prefix_cache(&self) -> bool {
        let mut state = self.lock();
        let idle = state.waiting.is_empty() && state.running.is_empty();
        if idle {
            state.lora.evict_idle();
        }
        idle && state.pool.reset_prefix_cache()
    }

    /// The most requests running + waiting at once since the last call (or
    /// the start), and starts the next period at the current count: what a
    /// bound on the engine's queue must hold, without sampling it.
    pub fn take_peak_requests(&self) -> usize {
        let mut state = self.lock();
        let now = state.waiting.len() + state.running.len();
        std::mem::replace(&mut state.peak_requests, now)
    }

    /// Current counters and gauges.
    pub fn snapshot(&self) -> MetricsSnapshot {
        let state = self.lock();
        let capacity = state.pool.capacity().max(1);
        let used: usize = state.running.values().map(|r| r.allocation.len()).sum();
        MetricsSnapshot {
            prefix_cache_queries: state.prefix_cache_queries,
            prefix_cache_hits: state.prefix_cache_hits,
            prompt_tokens: state.prompt_tokens,
            generation_tokens: state.generation_tokens,
            request_success: state.request_success,
            num_requests_running: state.running.len(),
            num_requests_waiting: state.waiting.len(),
            kv_cache_usage: used.min(capacity) as f64 / capacity as f64,
            ttft: state.ttft.clone(),
        }
    }

    /// The LoRA state `/metrics` shows; `None` without adapter slots.
    pub fn lora_metrics(&self) -> Option<LoraMetrics> {
        let state = self.lock();
        (self.cfg.max_loras > 0).then(|| LoraMetrics {
            max_lora: self.cfg.max_loras,
            states: state.lora_states.clone(),
            loads: state.lora.loads(),
        })
    }
}

/// A submitted request's hold on the engine. Dropping it (client gone)
/// leaves the queue or frees the blocks, so nothing leaks.
pub struct Ticket {
    engine: Arc<Engine>,
    id: u64,
    job: Job,
    admission: oneshot::Receiver<Admission>,
}

impl Ticket {
    /// Waits until the request is admitted.
    pub async fn admitted(&mut self) -> Admission {
        match (&mut self.admission).await {
            Ok(a) => a,
            // The engine never drops a waiting request's sender while the
            // ticket lives; if it did, waiting forever is the honest outcome.
            Err(_) => std::future::pending().await,
        }
    }

    /// The request's job.
    pub fn job(&self) -> &Job {
        &self.job
    }

    /// Completes the request with the output tokens it produced: their full
    /// blocks join the cache, then all blocks are freed.
    pub fn finish(self, outputs: &[TokenId]) {
        self.engine.release(self.id, Some(outputs), &self.job);
        // Drop's release then finds nothing to do.
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        self.engine.release(self.id, None, &self.job);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(max_num_seqs: usize, kv_blocks: usize) -> SimConfig {
        SimConfig {
            max_num_seqs,
            kv_blocks,
            // Large enough that timing never matters to these tests.
            time_scale: 1e6,
            ..SimConfig::default()
        }
    }

    fn job(seed: u32, n: usize) -> Job {
        Job {
            prompt: (0..n as u32).map(|i| seed * 1_000_000 + i).collect(),
            max_tokens: 4,
            first_extra: vec![],
            adapter: None,
        }
    }

    fn is_admitted(t: &mut Ticket) -> Option<Admission> {
        t.admission.try_recv().ok()
    }

    #[tokio::test]
    async fn max_num_seqs_queues_the_rest_in_order() {
        let engine = Engine::new(cfg(2, 1000));
        let mut a = engine.submit(job(1, 100)).unwrap();
        let mut b = engine.submit(job(2, 100)).unwrap();
        let mut c = engine.submit(job(3, 100)).unwrap();
        let mut d = engine.submit(job(4, 100)).unwrap();
        assert!(is_admitted(&mut a).is_some());
        assert!(is_admitted(&mut b).is_some());
        let snap = engine.snapshot();
        assert_eq!(
            (snap.num_requests_running, snap.num_requests_waiting),
            (2, 2)
        );
        // A finishing admits exactly the next in arrival order.
        a.finish(&[1, 2, 3, 4]);
        assert!(is_admitted(&mut c).is_some());
        assert!(is_admitted(&mut d).is_none());
        // A waiting request that goes away leaves the queue.
        drop(d);
        let snap = engine.snapshot();
        assert_eq!(
            (snap.num_requests_running, snap.num_requests_waiting),
            (2, 0)
        );
        drop(b);
        drop(c);
        let snap = engine.snapshot();
        assert_eq!(
            (snap.num_requests_running, snap.num_requests_waiting),
            (0, 0)
        );
        assert_eq!(snap.request_success, 1);
        assert_eq!(snap.generation_tokens, 4);
    }

    #[tokio::test]
    async fn the_peak_of_running_plus_waiting_is_kept_until_taken() {
        let engine = Engine::new(cfg(1, 1000));
        assert_eq!(engine.take_peak_requests(), 0);
        let a = engine.submit(job(1, 100)).unwrap();
        let b = engine.submit(job(2, 100)).unwrap();
        let c = engine.submit(job(3, 100)).unwrap();
        drop((b, c));
        // Three at once (one running, two waiting), one now.
        assert_eq!(engine.take_peak_requests(), 3);
        assert_eq!(engine.take_peak_requests(), 1);
        drop(a);
        assert_eq!(engine.take_peak_requests(), 1);
        assert_eq!(engine.take_peak_requests(), 0);
    }

    #[tokio::test]
    async fn requests_wait_for_kv_blocks_and_oversized_ones_are_refused() {
        // 10 blocks of 16 tokens; each job needs ceil(104 / 16) = 7 blocks.
        let engine = Engine::new(cfg(8, 10));
        let mut a = engine.submit(job(1, 100)).unwrap();
        let mut b = engine.submit(job(2, 100)).unwrap();
        assert!(is_admitted(&mut a).is_some());
        assert!(is_admitted(&mut b).is_none());
        drop(a);
        assert!(is_admitted(&mut b).is_some());
        assert!(matches!(
            engine.submit(job(3, 200)),
            Err(SubmitError::TooLarge {
                needed_blocks: 13,
                capacity: 10
            })
        ));
    }

    #[tokio::test]
    async fn counters_count_tokens_and_hits() {
        let engine = Engine::new(cfg(8, 1000));
        let mut a = engine.submit(job(1, 100)).unwrap();
        assert_eq!(is_admitted(&mut a).unwrap().hit_tokens, 0);
        a.finish(&[7; 4]);
        let mut b = engine.submit(job(1, 100)).unwrap();
        assert_eq!(is_admitted(&mut b).unwrap().hit_tokens, 96);
        let snap = engine.snapshot();
        assert_eq!(snap.prefix_cache_queries, 200);
        assert_eq!(snap.prefix_cache_hits, 96);
        assert_eq!(snap.ttft.count(), 2);
    }

    #[tokio::test]
    async fn prefill_is_one_fifo_resource_and_hits_shorten_it() {
        let engine = Engine::new(SimConfig {
            time_scale: 1.0,
            ..SimConfig::default()
        });
        let mut a = engine.submit(job(1, 8000)).unwrap();
        let mut b = engine.submit(job(2, 8000)).unwrap();
        let ta = is_admitted(&mut a).unwrap().first_token_at;
        let tb = is_admitted(&mut b).unwrap().first_token_at;
        let one = Duration::from_secs_f64(engine.prefill_seconds(0, 8000));
        // B's prefill queues behind A's.
        assert!(tb - ta >= one - Duration::from_millis(1));
        // A third request sharing A's prompt only computes its last block.
        let mut c = engine.submit(job(1, 8000)).unwrap();
        let ac = is_admitted(&mut c).unwrap();
        assert_eq!(ac.hit_tokens, 7984);
        assert!(ac.first_token_at - tb < Duration::from_millis(100));
    }

    fn adapter_job(seed: u32, adapter: Option<&str>) -> Job {
        Job {
            adapter: adapter.map(str::to_string),
            ..job(seed, 100)
        }
    }

    #[tokio::test]
    async fn a_request_whose_adapter_has_no_slot_waits_and_later_ones_pass_it() {
        let engine = Engine::new(SimConfig {
            max_loras: 1,
            ..cfg(8, 1000)
        });
        let mut a = engine.submit(adapter_job(1, Some("x"))).unwrap();
        let mut b = engine.submit(adapter_job(2, Some("y"))).unwrap();
        let mut c = engine.submit(adapter_job(3, Some("x"))).unwrap();
        let mut d = engine.submit(adapter_job(4, None)).unwrap();
        assert!(is_admitted(&mut a).is_some());
        assert!(is_admitted(&mut b).is_none(), "x holds the only slot");
        assert!(is_admitted(&mut c).is_some(), "x is resident");
        assert!(
            is_admitted(&mut d).is_some(),
            "the base model needs no slot"
        );
        let lora = engine.lora_metrics().unwrap();
        assert_eq!(lora.loads, 1);
        let (running, waiting, _) = lora.states.last().unwrap();
        assert_eq!((running.as_str(), waiting.as_str()), ("x", "y"));
        a.finish(&[1]);
        assert!(is_admitted(&mut b).is_none(), "x still runs c");
        c.finish(&[1]);
        assert!(is_admitted(&mut b).is_some(), "x is idle and evicted");
        let lora = engine.lora_metrics().unwrap();
        assert_eq!(lora.loads, 2);
        let (running, waiting, _) = lora.states.last().unwrap();
        assert_eq!((running.as_str(), waiting.as_str()), ("y", ""));
        // Resetting the cache evicts the idle adapters: y loads again.
        drop((b, d));
        assert!(engine.reset_prefix_cache());
        let mut e = engine.submit(adapter_job(5, Some("y"))).unwrap();
        assert!(is_admitted(&mut e).is_some());
        assert_eq!(engine.lora_metrics().unwrap().loads, 3);
    }

    #[tokio::test]
    async fn loading_an_adapter_delays_the_first_token_by_the_load_time() {
        let engine = Engine::new(SimConfig {
            max_loras: 2,
            lora_load_ms: 2_000.0,
            time_scale: 1.0,
            ..SimConfig::default()
        });
        let load = Duration::from_secs(2);
        let submitted = Instant::now();
        let mut a = engine.submit(adapter_job(1, Some("x"))).unwrap();
        let ta = is_admitted(&mut a).unwrap().first_token_at;
        assert!(ta - submitted >= load);
        a.finish(&[1]);
        // Resident now: the next request of x queues behind a's prefill
        // but pays no load of its own.
        let mut b = engine.submit(adapter_job(2, Some("x"))).unwrap();
        let tb = is_admitted(&mut b).unwrap().first_token_at;
        assert!(tb - ta < load);
        // Without slots there is no LoRA state at all.
        assert!(Engine::new(cfg(8, 1000)).lora_metrics().is_none());
    }

    #[test]
    fn cost_model_matches_the_calibration() {
        let engine = Engine::new(SimConfig::default());
        // ~47 µs per token for a reference-sized prompt (8,000 + 1,200 tokens).
        let per_token = engine.prefill_seconds(0, 9200) / 9200.0;
        assert!((40e-6..55e-6).contains(&per_token), "{per_token}");
        // 20-30 ms per output token across batch sizes.
        assert!((0.020..=0.030).contains(&engine.decode_seconds(1)));
        assert!((0.020..=0.030).contains(&engine.decode_seconds(64)));
        // Cached context makes the remaining tokens dearer (attention), not free.
        assert!(engine.prefill_seconds(8000, 100) > engine.prefill_seconds(0, 100));
    }
}
