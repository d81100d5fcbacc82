//! The routing benchmark's synthetic workloads as seeded prompt generators. Each
//! request is a list of chat messages (sent as such on the OpenAI API, and
//! as their contents joined by blank lines on the native invoke API), so
//! both APIs carry the same text and the same shared prefixes.
//!
//! - `no-shared-prefix`: fresh random 1,024-token prompts, 128 output tokens.
//! - `long-shared-prefix`: 100 groups, each a fixed ~8,000-token system
//!   prompt; every request adds a fresh 1,200-token question; 256 outputs;
//!   groups chosen uniformly.
//! - `generated-shared-prefix`: 64 groups × 16 prompts: a fixed 2,048-token
//!   system prompt per group and 16 fixed 128-token questions; 256 outputs;
//!   each request picks a group (uniformly, or Zipf(α) for
//!   `generated-shared-prefix-zipf`) and one of its questions uniformly.
//! - `multi-turn`: 256 open conversations of 4 to 8 turns sharing one
//!   512-token system prompt; each turn adds a 160-token user message after
//!   the previous answer as the server returned it (so the history grows and
//!   is a true prefix of the next turn); 192 outputs. Each request continues
//!   a random idle conversation; a finished conversation is replaced by a new
//!   one; if all are busy a new one opens. (ShareGPT-like turn sizes; the
//!   shared system prompt is what a chat product adds.)
//!
//! - `sharegpt`, `sharegpt-system`, `rag`: real text from the ShareGPT V3
//!   data set (see [`super::sharegpt`] and [`super::replay`]): recorded
//!   conversations replayed turn by turn (with one shared ~1,500-token system
//!   prompt for `sharegpt-system`), and pasted documents each asked several
//!   questions. They need the data: [`WorkloadGen::with_corpus`].
//! - `lora`: the `sharegpt` replay where each conversation is with one of 40
//!   LoRA adapters (the request's `model` names it, [`adapter_name`]),
//!   chosen by Zipf(1) popularity; each adapter has its own 1,000-token
//!   system prompt before the conversation.
//!
//! `scaled(f)` multiplies every token length by `f` (at least 1 token) for
//! quick runs; group and conversation counts are fields to set directly.

use std::collections::HashMap;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

use super::replay::ReplayGen;
use super::sharegpt::Corpus;
use super::text::{seeded_text, text_with_tokens};

/// A workload and its parameters.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case")]
pub enum Workload {
    /// Fresh random prompts: the control.
    NoSharedPrefix {
        prompt_tokens: usize,
        output_tokens: usize,
    },
    /// Long per-group prefixes with fresh questions.
    LongSharedPrefix {
        groups: usize,
        prefix_tokens: usize,
        question_tokens: usize,
        output_tokens: usize,
    },
    /// Per-group system prompts with a fixed set of questions each.
    GeneratedSharedPrefix {
        groups: usize,
        prompts_per_group: usize,
        system_tokens: usize,
        question_tokens: usize,
        output_tokens: usize,
        /// Zipf exponent of group popularity; `None` for uniform.
        zipf_alpha: Option<f64>,
    },
    /// Conversations whose history grows each turn.
    MultiTurn {
        conversations: usize,
        min_turns: usize,
        max_turns: usize,
        system_tokens: usize,
        user_tokens: usize,
        output_tokens: usize,
    },
    /// Recorded ShareGPT conversations, replayed turn by turn: each turn
    /// sends the recorded history and the next human message, after the
    /// previous turn's response and a think time.
    ShareGpt {
        /// Conversations per run, at most.
        conversations: usize,
        /// Turns per conversation, at most (later turns are not sent).
        max_turns: usize,
        /// Every message is cut to this many characters.
        max_message_chars: usize,
        /// Output tokens asked per turn: the recorded answer's, at most this.
        max_output_tokens: usize,
        /// One shared ~1,500-token system prompt before every conversation.
        system_prompt: bool,
        /// Mean of the exponential pause between a response and the next
        /// turn, simulated milliseconds.
        think_time_ms: f64,
    },
    /// ShareGPT conversations, each with a LoRA adapter of Zipf popularity
    /// and that adapter's own system prompt (`lora-no-system`: none, so
    /// nothing in a prompt but its `model` names its adapter).
    Lora {
        /// Adapters (`adapter-00` ...), most popular first.
        adapters: usize,
        /// Zipf exponent of adapter popularity.
        zipf_alpha: f64,
        /// Tokens of each adapter's system prompt.
        system_tokens: usize,
        conversations: usize,
        max_turns: usize,
        max_message_chars: usize,
        max_output_tokens: usize,
        think_time_ms: f64,
    },
    /// Real documents, each asked several questions; a request is one user
    /// message: the document, a blank line, the question.
    Rag {
        /// Documents per run.
        documents: usize,
        /// Questions per document (from a fixed list).
        questions: usize,
        output_tokens: usize,
    },
}

/// Names accepted by [`Workload::by_name`].
pub const WORKLOAD_NAMES: [&str; 5] = [
    "no-shared-prefix",
    "long-shared-prefix",
    "generated-shared-prefix",
    "generated-shared-prefix-zipf",
    "multi-turn",
];

/// Names of the workloads on real data, also accepted by [`Workload::by_name`]
/// (their generators need [`WorkloadGen::with_corpus`]).
pub const DATA_WORKLOAD_NAMES: [&str; 5] = [
    "sharegpt",
    "sharegpt-system",
    "rag",
    "lora",
    "lora-no-system",
];

/// The name of LoRA adapter `index` in the `lora` workload.
pub fn adapter_name(index: usize) -> String {
    format!("adapter-{index:02}")
}

impl Workload {
    /// The benchmark's parameters for a workload name (see [`WORKLOAD_NAMES`]).
    pub fn by_name(name: &str) -> Option<Workload> {
        let gsp = |zipf_alpha| Workload::GeneratedSharedPrefix {
            groups: 64,
            prompts_per_group: 16,
            system_tokens: 2048,
            question_tokens: 128,
            output_tokens: 256,
            zipf_alpha,
        };
        Some(match name {
            "no-shared-prefix" => Workload::NoSharedPrefix {
                prompt_tokens: 1024,
                output_tokens: 128,
            },
            "long-shared-prefix" => Workload::LongSharedPrefix {
                groups: 100,
                prefix_tokens: 8000,
                question_tokens: 1200,
                output_tokens: 256,
            },
            "generated-shared-prefix" => gsp(None),
            "generated-shared-prefix-zipf" => gsp(Some(1.0)),
            "multi-turn" => Workload::MultiTurn {
                conversations: 256,
                min_turns: 4,
                max_turns: 8,
                system_tokens: 512,
                user_tokens: 160,
                output_tokens: 192,
            },
            "sharegpt" | "sharegpt-system" => Workload::ShareGpt {
                conversations: 200,
                max_turns: 8,
                max_message_chars: super::replay::MAX_MESSAGE_CHARS,
                max_output_tokens: super::replay::MAX_OUTPUT_TOKENS,
                system_prompt: name == "sharegpt-system",
                think_time_ms: super::replay::THINK_TIME_MS,
            },
            "lora" | "lora-no-system" => Workload::Lora {
                adapters: 40,
                zipf_alpha: 1.0,
                system_tokens: if name == "lora" { 1000 } else { 0 },
                conversations: 200,
                max_turns: 8,
                max_message_chars: super::replay::MAX_MESSAGE_CHARS,
                max_output_tokens: super::replay::MAX_OUTPUT_TOKENS,
                think_time_ms: super::replay::THINK_TIME_MS,
            },
            "rag" => Workload::Rag {
                documents: 60,
                questions: 5,
                output_tokens: 128,
            },
            _ => return None,
        })
    }

    /// The workload's name.
    pub fn name(&self) -> &'static str {
        match self {
            Workload::NoSharedPrefix { .. } => "no-shared-prefix",
            Workload::LongSharedPrefix { .. } => "long-shared-prefix",
            Workload::GeneratedSharedPrefix {
                zipf_alpha: None, ..
            } => "generated-shared-prefix",
            Workload::GeneratedSharedPrefix { .. } => "generated-shared-prefix-zipf",
            Workload::MultiTurn { .. } => "multi-turn",
            Workload::ShareGpt {
                system_prompt: false,
                ..
            } => "sharegpt",
            Workload::ShareGpt { .. } => "sharegpt-system",
            Workload::Lora {
                system_tokens: 0, ..
            } => "lora-no-system",
            Workload::Lora { .. } => "lora",
            Workload::Rag { .. } => "rag",
        }
    }

    /// Whether requests come in conversations that wait for each answer
    /// (arrivals then start conversations, not requests).
    pub fn is_conversation_replay(&self) -> bool {
        matches!(self, Workload::ShareGpt { .. } | Workload::Lora { .. })
    }

    /// Whether the generator needs [`WorkloadGen::with_corpus`].
    pub fn needs_corpus(&self) -> bool {
        matches!(
            self,
            Workload::ShareGpt { .. } | Workload::Lora { .. } | Workload::Rag { .. }
        )
    }

    /// The same workload with every token length multiplied by `factor`.
    pub fn scaled(&self, factor: f64) -> Workload {
        let s = |n: usize| ((n as f64 * factor).round() as usize).max(1);
        match self.clone() {
            Workload::NoSharedPrefix {
                prompt_tokens,
                output_tokens,
            } => Workload::NoSharedPrefix {
                prompt_tokens: s(prompt_tokens),
                output_tokens: s(output_tokens),
            },
            Workload::LongSharedPrefix {
                groups,
                prefix_tokens,
                question_tokens,
                output_tokens,
            } => Workload::LongSharedPrefix {
                groups,
                prefix_tokens: s(prefix_tokens),
                question_tokens: s(question_tokens),
                output_tokens: s(output_tokens),
            },
            Workload::GeneratedSharedPrefix {
                groups,
                prompts_per_group,
                system_tokens,
                question_tokens,
                output_tokens,
                zipf_alpha,
            } => Workload::GeneratedSharedPrefix {
                groups,
                prompts_per_group,
                system_tokens: s(system_tokens),
                question_tokens: s(question_tokens),
                output_tokens: s(output_tokens),
                zipf_alpha,
            },
            Workload::MultiTurn {
                conversations,
                min_turns,
                max_turns,
                system_tokens,
                user_tokens,
                output_tokens,
            } => Workload::MultiTurn {
                conversations,
                min_turns,
                max_turns,
                system_tokens: s(system_tokens),
                user_tokens: s(user_tokens),
                output_tokens: s(output_tokens),
            },
            Workload::ShareGpt {
                conversations,
                max_turns,
                max_message_chars,
                max_output_tokens,
                system_prompt,
                think_time_ms,
            } => Workload::ShareGpt {
                conversations,
                max_turns,
                max_message_chars: s(max_message_chars),
                max_output_tokens: s(max_output_tokens),
                system_prompt,
                think_time_ms,
            },
            Workload::Lora {
                adapters,
                zipf_alpha,
                system_tokens,
                conversations,
                max_turns,
                max_message_chars,
                max_output_tokens,
                think_time_ms,
            } => Workload::Lora {
                adapters,
                zipf_alpha,
                system_tokens: s(system_tokens),
                conversations,
                max_turns,
                max_message_chars: s(max_message_chars),
                max_output_tokens: s(max_output_tokens),
                think_time_ms,
            },
            Workload::Rag {
                documents,
                questions,
                output_tokens,
            } => Workload::Rag {
                documents,
                questions,
                output_tokens: s(output_tokens),
            },
        }
    }

    /// Tokens of distinct shared prefix text the workload keeps reusing
    /// (group prefixes, or the multi-turn system prompt), for sizing caches.
    pub fn shared_prefix_tokens(&self) -> usize {
        match *self {
            Workload::NoSharedPrefix { .. } => 0,
            Workload::LongSharedPrefix {
                groups,
                prefix_tokens,
                ..
            } => groups * prefix_tokens,
            Workload::GeneratedSharedPrefix {
                groups,
                system_tokens,
                ..
            } => groups * system_tokens,
            Workload::MultiTurn { system_tokens, .. } => system_tokens,
            Workload::ShareGpt { system_prompt, .. } => {
                if system_prompt {
                    super::replay::system_prompt_tokens()
                } else {
                    0
                }
            }
            Workload::Lora {
                adapters,
                system_tokens,
                ..
            } => adapters * system_tokens,
            // The documents depend on the data: see `ReplayGen::reused_tokens`.
            Workload::Rag { .. } => 0,
        }
    }
}

/// A chat message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Message {
    /// `system`, `user` or `assistant`.
    pub role: String,
    /// The text.
    pub content: String,
}

impl Message {
    pub(super) fn new(role: &str, content: String) -> Self {
        Message {
            role: role.to_string(),
            content,
        }
    }
}

/// One request to send.
#[derive(Debug, Clone)]
pub struct PlannedRequest {
    /// The conversation so far, ending with the user's message.
    pub messages: Vec<Message>,
    /// Output tokens to ask for.
    pub output_tokens: usize,
    /// The prefix group, for workloads that have groups.
    pub group: Option<usize>,
    /// The conversation, for multi-turn (pass it back to [`WorkloadGen::complete`]).
    pub conversation: Option<u64>,
    /// The `model` to send instead of the run's (a LoRA adapter).
    pub model: Option<String>,
}

impl PlannedRequest {
    /// A system prompt and a user question of a prefix group.
    fn grouped(system: String, user: String, output_tokens: usize, group: usize) -> Self {
        PlannedRequest {
            messages: vec![Message::new("system", system), Message::new("user", user)],
            output_tokens,
            group: Some(group),
            conversation: None,
            model: None,
        }
    }

    /// The prompt as one text, for the native invoke API.
    pub fn text(&self) -> String {
        let mut out = String::new();
        for (i, m) in self.messages.iter().enumerate() {
            if i > 0 {
                out.push_str("\n\n");
            }
            out.push_str(&m.content);
        }
        out
    }
}

struct Conversation {
    turns: usize,
    done: usize,
    busy: bool,
    messages: Vec<Message>,
}

/// Produces a workload's requests, deterministically for a seed (for
/// multi-turn, given the same order of completions).
pub struct WorkloadGen {
    workload: Workload,
    /// Varies the traffic: group choices, questions, conversations.
    seed: u64,
    /// Fixes the shared texts (group prefixes, prompt pools, system prompt).
    shared_seed: u64,
    rng: StdRng,
    cache: HashMap<(u64, usize, usize), String>,
    zipf_cdf: Vec<f64>,
    conversations: Vec<(u64, Conversation)>,
    next_conversation: u64,
    /// The generator of the workloads on real data, once given the corpus.
    replay: Option<ReplayGen>,
}

/// Distinct seeds for distinct kinds of text, so that e.g. group 3's prefix
/// and conversation 3's first message differ.
pub(super) fn sub_seed(seed: u64, kind: u64, a: u64, b: u64) -> u64 {
    let mut buf = [0u8; 32];
    buf[..8].copy_from_slice(&seed.to_le_bytes());
    buf[8..16].copy_from_slice(&kind.to_le_bytes());
    buf[16..24].copy_from_slice(&a.to_le_bytes());
    buf[24..].copy_from_slice(&b.to_le_bytes());
    xxhash_rust::xxh3::xxh3_64(&buf)
}

/// The shared seed unless told otherwise.
pub const DEFAULT_SHARED_SEED: u64 = 1;

const PREFIX: u64 = 1;
const QUESTION: u64 = 2;
const SYSTEM: u64 = 3;
const USER_TURN: u64 = 4;
const CONVERSATION: u64 = 5;
/// The kind of text of a `lora` adapter's system prompt.
pub(super) const ADAPTER_SYSTEM: u64 = 6;

impl WorkloadGen {
    /// A generator for `workload` whose traffic is seeded by `seed`; its
    /// shared texts come from [`DEFAULT_SHARED_SEED`] (see
    /// [`WorkloadGen::with_shared_seed`]).
    pub fn new(workload: Workload, seed: u64) -> Self {
        let zipf_cdf = match workload {
            Workload::GeneratedSharedPrefix {
                groups,
                zipf_alpha: Some(alpha),
                ..
            } => zipf_cdf(groups, alpha),
            _ => Vec::new(),
        };
        WorkloadGen {
            workload,
            seed,
            shared_seed: DEFAULT_SHARED_SEED,
            rng: StdRng::seed_from_u64(seed),
            cache: HashMap::new(),
            zipf_cdf,
            conversations: Vec::new(),
            next_conversation: 0,
            replay: None,
        }
    }

    /// The same generator drawing real text from `corpus` (needed by
    /// `sharegpt`, `sharegpt-system` and `rag`; ignored by the others).
    pub fn with_corpus(mut self, corpus: std::sync::Arc<Corpus>) -> Self {
        self.replay = ReplayGen::new(&self.workload, corpus, self.seed, self.shared_seed);
        self
    }

    /// The real-data generator, if the workload has one and it was given the corpus.
    pub fn replay(&mut self) -> Option<&mut ReplayGen> {
        self.replay.as_mut()
    }

    /// The same generator with its shared texts (group prefixes, the
    /// generated prompt pool, the system prompt) from `shared_seed`. Runs
    /// with different seeds and the same shared seed are two samples of one
    /// workload: a warm-up warms the prefixes the measured run uses.
    pub fn with_shared_seed(mut self, shared_seed: u64) -> Self {
        self.shared_seed = shared_seed;
        self.cache.clear();
        if let Some(replay) = self.replay.take() {
            self.replay = ReplayGen::new(&self.workload, replay.corpus(), self.seed, shared_seed);
        }
        self
    }

    /// The workload.
    pub fn workload(&self) -> &Workload {
        &self.workload
    }

    fn fixed_text(&mut self, kind: u64, a: usize, b: usize, tokens: usize) -> String {
        let seed = self.shared_seed;
        self.cache
            .entry((kind, a, b))
            .or_insert_with(|| seeded_text(sub_seed(seed, kind, a as u64, b as u64), tokens))
            .clone()
    }

    fn pick_group(&mut self, groups: usize) -> usize {
        if self.zipf_cdf.is_empty() {
            self.rng.gen_range(0..groups.max(1))
        } else {
            let u: f64 = self.rng.gen();
            self.zipf_cdf
                .iter()
                .position(|&c| u < c)
                .unwrap_or(self.zipf_cdf.len() - 1)
        }
    }

    /// The next request.
    pub fn next_request(&mut self) -> PlannedRequest {
        match self.workload.clone() {
            Workload::NoSharedPrefix {
                prompt_tokens,
                output_tokens,
            } => PlannedRequest {
                messages: vec![Message::new(
                    "user",
                    text_with_tokens(&mut self.rng, prompt_tokens),
                )],
                output_tokens,
                group: None,
                conversation: None,
                model: None,
            },
            Workload::LongSharedPrefix {
                groups,
                prefix_tokens,
                question_tokens,
                output_tokens,
            } => {
                let g = self.pick_group(groups);
                let prefix = self.fixed_text(PREFIX, g, 0, prefix_tokens);
                let question = text_with_tokens(&mut self.rng, question_tokens);
                PlannedRequest::grouped(prefix, question, output_tokens, g)
            }
            Workload::GeneratedSharedPrefix {
                groups,
                prompts_per_group,
                system_tokens,
                question_tokens,
                output_tokens,
                ..
            } => {
                let g = self.pick_group(groups);
                let q = self.rng.gen_range(0..prompts_per_group.max(1));
                let system = self.fixed_text(PREFIX, g, 0, system_tokens);
                let question = self.fixed_text(QUESTION, g, q + 1, question_tokens);
                PlannedRequest::grouped(system, question, output_tokens, g)
            }
            Workload::MultiTurn {
                conversations,
                min_turns,
                max_turns,
                system_tokens,
                user_tokens,
                output_tokens,
            } => {
                while self.conversations.len() < conversations.max(1) {
                    self.open_conversation(min_turns, max_turns, system_tokens);
                }
                let idle: Vec<usize> = (0..self.conversations.len())
                    .filter(|&i| !self.conversations[i].1.busy)
                    .collect();
                let i = if idle.is_empty() {
                    self.open_conversation(min_turns, max_turns, system_tokens);
                    self.conversations.len() - 1
                } else {
                    idle[self.rng.gen_range(0..idle.len())]
                };
                let (id, conv) = &mut self.conversations[i];
                let id = *id;
                let turn = conv.done;
                conv.busy = true;
                let user =
                    seeded_text(sub_seed(self.seed, USER_TURN, id, turn as u64), user_tokens);
                conv.messages.push(Message::new("user", user));
                PlannedRequest {
                    messages: conv.messages.clone(),
                    output_tokens,
                    group: None,
                    conversation: Some(id),
                    model: None,
                }
            }
            Workload::ShareGpt { .. } | Workload::Lora { .. } | Workload::Rag { .. } => self
                .replay
                .as_mut()
                .and_then(ReplayGen::next_request)
                // No corpus, or every conversation sent: an empty prompt the
                // caller can see (run_workload checks the corpus up front).
                .unwrap_or(PlannedRequest {
                    messages: Vec::new(),
                    output_tokens: 1,
                    group: None,
                    conversation: None,
                    model: None,
                }),
        }
    }

    fn open_conversation(&mut self, min_turns: usize, max_turns: usize, system_tokens: usize) {
        let id = self.next_conversation;
        self.next_conversation += 1;
        let lo = min_turns.max(1);
        let hi = max_turns.max(lo);
        let mut rng = StdRng::seed_from_u64(sub_seed(self.seed, CONVERSATION, id, 0));
        let turns = rng.gen_range(lo..=hi);
        let system = self.fixed_text(SYSTEM, 0, 0, system_tokens);
        self.conversations.push((
            id,
            Conversation {
                turns,
                done: 0,
                busy: false,
                messages: vec![Message::new("system", system)],
            },
        ));
    }

    /// Reports a multi-turn request's answer (`None` if it failed, which
    /// ends the conversation). Other workloads ignore it.
    pub fn complete(&mut self, conversation: Option<u64>, answer: Option<String>) {
        let Some(id) = conversation else { return };
        let Some(i) = self.conversations.iter().position(|(c, _)| *c == id) else {
            return;
        };
        let conv = &mut self.conversations[i].1;
        conv.busy = false;
        conv.done += 1;
        let finished = match answer {
            Some(a) => {
                conv.messages.push(Message::new("assistant", a));
                conv.done >= conv.turns
            }
            None => true,
        };
        if finished {
            self.conversations.swap_remove(i);
        }
    }
}

/// Cumulative probabilities of ranks 1..=n under Zipf(alpha).
pub(super) fn zipf_cdf(n: usize, alpha: f64) -> Vec<f64> {
    let weights: Vec<f64> = (1..=n.max(1))
        .map(|k| 1.0 / (k as f64).powf(alpha))
        .collect();
    let total: f64 = weights.iter().sum();
    let mut acc = 0.0;
    weights
        .iter()
        .map(|w| {
            acc += w / total;
            acc
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::tokenizer::count_tokens;

    fn tokens(s: &str) -> usize {
        count_tokens(s.as_bytes())
    }

    #[test]
    fn runs_with_other_seeds_share_the_prefixes_but_not_the_traffic() {
        let w = Workload::by_name("long-shared-prefix").unwrap().scaled(0.1);
        let groups = |seed, shared_seed| {
            let mut g = WorkloadGen::new(w.clone(), seed).with_shared_seed(shared_seed);
            let mut by_group = std::collections::BTreeMap::new();
            for _ in 0..200 {
                let r = g.next_request();
                by_group.insert(r.group.unwrap(), r.messages);
            }
            by_group
        };
        let (warm_up, measured) = (groups(1001, 1), groups(1, 1));
        let mut shared = 0;
        for (group, messages) in &measured {
            if let Some(warm) = warm_up.get(group) {
                assert_eq!(warm[0], messages[0], "group {group}'s prefix");
                assert_ne!(warm[1], messages[1], "group {group}'s question");
                shared += 1;
            }
        }
        assert!(shared > 50, "{shared} groups in both runs");
        let other = groups(1, 2);
        assert!(measured
            .iter()
            .all(|(g, m)| other.get(g).is_none_or(|o| o[0] != m[0])));
    }

    #[test]
    fn same_seed_same_requests() {
        for name in WORKLOAD_NAMES {
            let w = Workload::by_name(name).unwrap().scaled(0.1);
            let mut a = WorkloadGen::new(w.clone(), 7);
            let mut b = WorkloadGen::new(w.clone(), 7);
            let mut c = WorkloadGen::new(w, 8);
            let ra: Vec<String> = (0..20).map(|_| a.next_request().text()).collect();
            let rb: Vec<String> = (0..20).map(|_| b.next_request().text()).collect();
            let rc: Vec<String> = (0..20).map(|_| c.next_request().text()).collect();
            assert_eq!(ra, rb, "{name}");
            assert_ne!(ra, rc, "{name}");
        }
    }

    #[test]
    fn long_shared_prefix_has_the_intended_structure() {
        let mut g = WorkloadGen::new(Workload::by_name("long-shared-prefix").unwrap(), 1);
        let mut by_group: HashMap<usize, Vec<PlannedRequest>> = HashMap::new();
        for _ in 0..300 {
            let r = g.next_request();
            assert_eq!(r.messages.len(), 2);
            assert_eq!(tokens(&r.messages[0].content), 8000);
            assert_eq!(tokens(&r.messages[1].content), 1200);
            assert_eq!(r.output_tokens, 256);
            by_group.entry(r.group.unwrap()).or_default().push(r);
        }
        // Uniform over 100 groups: most groups seen, none dominating.
        assert!(by_group.len() > 90, "{}", by_group.len());
        assert!(by_group.values().all(|v| v.len() < 15));
        let prefixes: std::collections::HashSet<&String> = by_group
            .values()
            .map(|v| &v[0].messages[0].content)
            .collect();
        assert_eq!(
            prefixes.len(),
            by_group.len(),
            "groups have distinct prefixes"
        );
        for reqs in by_group.values().filter(|v| v.len() > 1) {
            assert_eq!(reqs[0].messages[0], reqs[1].messages[0]);
            assert_ne!(reqs[0].messages[1], reqs[1].messages[1], "fresh questions");
        }
    }

    #[test]
    fn generated_shared_prefix_repeats_a_fixed_question_set() {
        let mut g = WorkloadGen::new(Workload::by_name("generated-shared-prefix").unwrap(), 3);
        let mut prompts = std::collections::HashSet::new();
        let mut per_group: HashMap<usize, std::collections::HashSet<String>> = HashMap::new();
        for _ in 0..4000 {
            let r = g.next_request();
            assert_eq!(tokens(&r.messages[0].content), 2048);
            assert_eq!(tokens(&r.messages[1].content), 128);
            per_group
                .entry(r.group.unwrap())
                .or_default()
                .insert(r.messages[1].content.clone());
            prompts.insert(r.text());
        }
        assert_eq!(per_group.len(), 64);
        assert!(per_group.values().all(|qs| qs.len() <= 16));
        assert!(prompts.len() <= 64 * 16 && prompts.len() > 900);
    }

    #[test]
    fn zipf_popularity_is_skewed_like_zipf() {
        let mut g = WorkloadGen::new(
            Workload::by_name("generated-shared-prefix-zipf").unwrap(),
            5,
        );
        let mut counts = vec![0usize; 64];
        for _ in 0..20_000 {
            counts[g.next_request().group.unwrap()] += 1;
        }
        // P(rank 1) = 1 / H(64) ≈ 0.21; rank 2 about half of that.
        let p1 = counts[0] as f64 / 20_000.0;
        assert!((0.19..0.23).contains(&p1), "{p1}");
        let ratio = counts[0] as f64 / counts[1] as f64;
        assert!((1.7..2.3).contains(&ratio), "{ratio}");
        assert!(counts[63] > 0 && counts[63] < counts[10]);
    }

    #[test]
    fn multi_turn_history_grows_with_the_answers() {
        let w = Workload::MultiTurn {
            conversations: 2,
            min_turns: 3,
            max_turns: 3,
            system_tokens: 50,
            user_tokens: 20,
            output_tokens: 10,
        };
        let mut g = WorkloadGen::new(w, 11);
        let first = g.next_request();
        assert_eq!(first.messages.len(), 2);
        assert_eq!(tokens(&first.messages[0].content), 50);
        assert_eq!(tokens(&first.messages[1].content), 20);
        g.complete(first.conversation, Some("the answer".into()));
        // Continue until the same conversation comes up again.
        let mut seen = 0;
        loop {
            let r = g.next_request();
            if r.conversation == first.conversation {
                assert_eq!(r.messages.len(), 4);
                assert_eq!(r.messages[..2], first.messages[..]);
                assert_eq!(
                    r.messages[2],
                    Message::new("assistant", "the answer".into())
                );
                assert!(r.text().starts_with(&first.text()));
                break;
            }
            g.complete(r.conversation, Some("x".into()));
            seen += 1;
            assert!(seen < 100);
        }
    }

    #[test]
    fn multi_turn_conversations_end_and_busy_ones_are_not_reused() {
        let w = Workload::MultiTurn {
            conversations: 1,
            min_turns: 2,
            max_turns: 2,
            system_tokens: 5,
            user_tokens: 5,
            output_tokens: 1,
        };
        let mut g = WorkloadGen::new(w, 1);
        let a = g.next_request();
        // The only conversation is busy: a new one opens.
        let b = g.next_request();
        assert_ne!(a.conversation, b.conversation);
        g.complete(a.conversation, Some("ok".into()));
        g.complete(b.conversation, None); // failed: b ends
        let a2 = g.next_request();
        assert_eq!(a2.conversation, a.conversation);
        assert_eq!(a2.messages.len(), 4);
        g.complete(a2.conversation, Some("ok".into())); // 2 turns: a ends
        let c = g.next_request();
        assert!(c.conversation > b.conversation);
        assert_eq!(c.messages.len(), 2);
    }

    #[test]
    fn scaling_shrinks_token_lengths_only() {
        let w = Workload::by_name("long-shared-prefix")
            .unwrap()
            .scaled(0.25);
        assert_eq!(
            w,
            Workload::LongSharedPrefix {
                groups: 100,
                prefix_tokens: 2000,
                question_tokens: 300,
                output_tokens: 64
            }
        );
        assert_eq!(w.shared_prefix_tokens(), 200_000);
        let json = serde_json::to_string(&w).unwrap();
        assert!(json.contains("\"kind\":\"long-shared-prefix\""));
        assert_eq!(serde_json::from_str::<Workload>(&json).unwrap(), w);
    }
}
