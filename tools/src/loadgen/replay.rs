//! Requests of the workloads on real data (`sharegpt`, `sharegpt-system`,
//! `rag`) from a [`Corpus`]: which conversations and documents a run uses,
//! and what each request carries.
//!
//! - `sharegpt`: a run takes conversations in an order shuffled by its seed
//!   (a warm-up with another seed replays other conversations). Turn `i` of a
//!   conversation sends its recorded history (human messages as `user`, gpt
//!   messages as `assistant`) and human message `i`, so every turn's prompt
//!   extends the previous turn's. Each message is cut to
//!   [`MAX_MESSAGE_CHARS`] characters (ShareGPT has pasted messages of
//!   hundreds of kilobytes; 6,000 characters is ~1,500 tokens, about where
//!   vLLM's serving benchmark cuts its ShareGPT prompts), the same cut in
//!   every turn so histories stay true prefixes. Output tokens are the
//!   recorded answer's length in tokens, at most [`MAX_OUTPUT_TOKENS`].
//!   After each response the user thinks for an exponential time of mean
//!   [`THINK_TIME_MS`] (simulated): reading an answer and typing the next
//!   message takes people seconds, and the pause is what lets other
//!   conversations interleave on the instances.
//! - `sharegpt-system`: the same with [`SYSTEM_PROMPT`] first in every
//!   conversation: a fixed ~6,100-character system prompt of a product
//!   assistant, ~1,500 tokens at a real tokenizer's ~4 characters per token
//!   (~2,000 under the simulator's tokenizer, which charges short words and
//!   punctuation a token each).
//! - `lora`: the `sharegpt` replay where each conversation draws an adapter
//!   from the Zipf popularity with the run's seed, names it as `model` and
//!   starts with its system prompt (text seeded by the shared seed and the
//!   adapter); the adapter is the request's group.
//! - `rag`: the run's documents are the first `documents` of the corpus's
//!   documents shuffled by the shared seed (warm-up and measured run share
//!   them); every (document, question) pair is sent once, in an order
//!   shuffled by the run's seed, each as one user message: the document, a
//!   blank line, one of [`QUESTIONS`]. The document is the group.

use std::collections::VecDeque;
use std::sync::Arc;

use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

use super::sharegpt::{truncate_chars, Corpus};
use super::text::seeded_text;
use super::workload::{
    adapter_name, sub_seed, zipf_cdf, Message, PlannedRequest, Workload, ADAPTER_SYSTEM,
};
use crate::sim::tokenizer::count_tokens;

/// Characters a replayed message is cut to.
pub const MAX_MESSAGE_CHARS: usize = 6_000;
/// Output tokens a replayed turn asks for, at most.
pub const MAX_OUTPUT_TOKENS: usize = 512;
/// Mean think time between a response and the conversation's next turn, simulated ms.
pub const THINK_TIME_MS: f64 = 10_000.0;

/// The system prompt every `sharegpt-system` conversation starts with.
pub const SYSTEM_PROMPT: &str = include_str!("system_prompt.txt");

/// The questions asked of every `rag` document.
pub const QUESTIONS: [&str; 8] = [
    "Summarise the text above in three sentences.",
    "What are the main claims or requests in the text above, and what supports each of them?",
    "List every person, organisation, product and date the text above mentions.",
    "What is unclear, missing or contradictory in the text above?",
    "Rewrite the key points of the text above as a short list for a busy reader.",
    "What should the author of the text above do next? Give three concrete steps.",
    "Which technical terms in the text above would a newcomer need explained? Explain them briefly.",
    "Write two questions a careful reviewer would ask after reading the text above.",
];

/// Tokens of [`SYSTEM_PROMPT`] under the simulator's tokenizer.
pub fn system_prompt_tokens() -> usize {
    count_tokens(SYSTEM_PROMPT.as_bytes())
}

/// One conversation of a run: its turns in order and the think time after each.
#[derive(Debug, Clone)]
pub struct PlannedConversation {
    /// Sequential from 0 in the order the run starts conversations.
    pub id: u64,
    pub turns: Vec<PlannedRequest>,
    /// Pause after turn `i`'s response, simulated ms.
    pub think_ms: Vec<f64>,
}

/// The real-data part of a [`super::WorkloadGen`].
pub struct ReplayGen {
    corpus: Arc<Corpus>,
    kind: Kind,
    rng: StdRng,
}

enum Kind {
    Conversations {
        /// Corpus indices in the order the run uses them.
        order: Vec<usize>,
        next: usize,
        max_turns: usize,
        max_message_chars: usize,
        max_output_tokens: usize,
        system_prompt: bool,
        think_time_ms: f64,
        /// For `lora`: the adapters' popularity and system prompts.
        adapters: Option<Adapters>,
        /// Turns of started conversations not yet handed out by `next_request`.
        queued: VecDeque<PlannedRequest>,
    },
    Documents {
        /// Corpus document indices of the run's documents; the group is the position.
        documents: Vec<usize>,
        /// (group, question) pairs still to send this round.
        pairs: Vec<(usize, usize)>,
        questions: usize,
        output_tokens: usize,
    },
}

/// The `lora` workload's adapters.
struct Adapters {
    /// Cumulative popularity of adapters 0.. (Zipf).
    cdf: Vec<f64>,
    /// Each adapter's system prompt.
    system_prompts: Vec<String>,
}

impl Kind {
    /// The conversations of a run: `conversations` of the corpus in an order
    /// shuffled by `rng`; `limits` are (turns, message characters, output tokens).
    fn conversations(
        corpus: &Corpus,
        rng: &mut StdRng,
        conversations: usize,
        limits: (usize, usize, usize),
        system_prompt: bool,
        think_time_ms: f64,
        adapters: Option<Adapters>,
    ) -> Kind {
        let (max_turns, max_message_chars, max_output_tokens) = limits;
        let mut order: Vec<usize> = (0..corpus.conversations.len()).collect();
        order.shuffle(rng);
        order.truncate(conversations);
        Kind::Conversations {
            order,
            next: 0,
            max_turns: max_turns.max(1),
            max_message_chars,
            max_output_tokens: max_output_tokens.max(1),
            system_prompt,
            think_time_ms,
            adapters,
            queued: VecDeque::new(),
        }
    }
}

impl ReplayGen {
    /// The generator for `workload` (None if it is not on real data).
    pub fn new(
        workload: &Workload,
        corpus: Arc<Corpus>,
        seed: u64,
        shared_seed: u64,
    ) -> Option<ReplayGen> {
        let mut rng = StdRng::seed_from_u64(seed ^ 0x5a4e_7e9d_1c3b_0f27);
        let kind = match *workload {
            Workload::ShareGpt {
                conversations,
                max_turns,
                max_message_chars,
                max_output_tokens,
                system_prompt,
                think_time_ms,
            } => Kind::conversations(
                &corpus,
                &mut rng,
                conversations,
                (max_turns, max_message_chars, max_output_tokens),
                system_prompt,
                think_time_ms,
                None,
            ),
            Workload::Lora {
                adapters,
                zipf_alpha,
                system_tokens,
                conversations,
                max_turns,
                max_message_chars,
                max_output_tokens,
                think_time_ms,
            } => Kind::conversations(
                &corpus,
                &mut rng,
                conversations,
                (max_turns, max_message_chars, max_output_tokens),
                false,
                think_time_ms,
                Some(Adapters {
                    cdf: zipf_cdf(adapters, zipf_alpha),
                    system_prompts: (0..adapters.max(1))
                        .map(|a| {
                            let seed = sub_seed(shared_seed, ADAPTER_SYSTEM, a as u64, 0);
                            seeded_text(seed, system_tokens)
                        })
                        .collect(),
                }),
            ),
            Workload::Rag {
                documents,
                questions,
                output_tokens,
            } => {
                let mut chosen: Vec<usize> = (0..corpus.documents.len()).collect();
                chosen.shuffle(&mut StdRng::seed_from_u64(shared_seed ^ 0xd0c5));
                chosen.truncate(documents);
                Kind::Documents {
                    documents: chosen,
                    pairs: Vec::new(),
                    questions: questions.clamp(1, QUESTIONS.len()),
                    output_tokens: output_tokens.max(1),
                }
            }
            _ => return None,
        };
        Some(ReplayGen { corpus, kind, rng })
    }

    /// The corpus it draws from.
    pub fn corpus(&self) -> Arc<Corpus> {
        Arc::clone(&self.corpus)
    }

    /// The next conversation to start (None when the run's are used up, or
    /// the workload has no conversations).
    pub fn next_conversation(&mut self) -> Option<PlannedConversation> {
        let Kind::Conversations {
            order,
            next,
            max_turns,
            max_message_chars,
            max_output_tokens,
            system_prompt,
            think_time_ms,
            adapters,
            ..
        } = &mut self.kind
        else {
            return None;
        };
        let index = *order.get(*next)?;
        let id = *next as u64;
        *next += 1;
        let recorded = &self.corpus.conversations[index];
        let cut = |text: &str| truncate_chars(text, *max_message_chars).to_string();
        let mut history = Vec::new();
        if *system_prompt {
            history.push(Message::new("system", SYSTEM_PROMPT.to_string()));
        }
        let adapter = adapters.as_ref().map(|adapters| {
            let u: f64 = self.rng.gen();
            let a = adapters
                .cdf
                .iter()
                .position(|&c| u < c)
                .unwrap_or(adapters.cdf.len() - 1);
            let system = &adapters.system_prompts[a];
            if !system.is_empty() {
                history.push(Message::new("system", system.clone()));
            }
            a
        });
        let mut turns = Vec::new();
        let mut think_ms = Vec::new();
        for turn in recorded.iter().take(*max_turns) {
            history.push(Message::new("user", cut(&turn.human)));
            let answer = cut(&turn.gpt);
            let output_tokens = count_tokens(answer.as_bytes()).clamp(1, *max_output_tokens);
            turns.push(PlannedRequest {
                messages: history.clone(),
                output_tokens,
                group: adapter,
                conversation: Some(id),
                model: adapter.map(adapter_name),
            });
            history.push(Message::new("assistant", answer));
            let u: f64 = self.rng.gen_range(f64::MIN_POSITIVE..1.0);
            think_ms.push(-u.ln() * *think_time_ms);
        }
        Some(PlannedConversation {
            id,
            turns,
            think_ms,
        })
    }

    /// The next request: for `rag` the next (document, question) pair; for
    /// conversations the next turn in order, conversation after conversation
    /// (what one client replaying them back to back sends).
    pub fn next_request(&mut self) -> Option<PlannedRequest> {
        if let Kind::Conversations { queued, .. } = &mut self.kind {
            if let Some(turn) = queued.pop_front() {
                return Some(turn);
            }
            let conversation = self.next_conversation()?;
            if let Kind::Conversations { queued, .. } = &mut self.kind {
                queued.extend(conversation.turns);
                return queued.pop_front();
            }
            return None;
        }
        let Kind::Documents {
            documents,
            pairs,
            questions,
            output_tokens,
        } = &mut self.kind
        else {
            return None;
        };
        if documents.is_empty() {
            return None;
        }
        if pairs.is_empty() {
            // A new round: every pair once, in a fresh order.
            *pairs = (0..documents.len())
                .flat_map(|d| (0..*questions).map(move |q| (d, q)))
                .collect();
            pairs.shuffle(&mut self.rng);
        }
        let (group, question) = pairs.pop()?;
        let document = &self.corpus.documents[documents[group]];
        Some(PlannedRequest {
            messages: vec![Message::new(
                "user",
                format!("{document}\n\n{}", QUESTIONS[question]),
            )],
            output_tokens: *output_tokens,
            group: Some(group),
            conversation: None,
            model: None,
        })
    }

    /// Distinct prompt tokens the run keeps reusing, for sizing caches: the
    /// run's conversations' full histories (with the system prompt once), or
    /// the run's documents.
    pub fn reused_tokens(&self) -> usize {
        match &self.kind {
            Kind::Conversations {
                order,
                max_turns,
                max_message_chars,
                system_prompt,
                adapters,
                ..
            } => {
                let system = if *system_prompt {
                    system_prompt_tokens()
                } else {
                    0
                };
                let system = system
                    + adapters.as_ref().map_or(0, |a| {
                        a.system_prompts
                            .iter()
                            .map(|p| count_tokens(p.as_bytes()))
                            .sum()
                    });
                let histories: usize = order
                    .iter()
                    .map(|&i| {
                        self.corpus.conversations[i]
                            .iter()
                            .take(*max_turns)
                            .map(|t| {
                                count_tokens(
                                    truncate_chars(&t.human, *max_message_chars).as_bytes(),
                                ) + count_tokens(
                                    truncate_chars(&t.gpt, *max_message_chars).as_bytes(),
                                )
                            })
                            .sum::<usize>()
                    })
                    .sum();
                system + histories
            }
            Kind::Documents { documents, .. } => documents
                .iter()
                .map(|&d| count_tokens(self.corpus.documents[d].as_bytes()))
                .sum(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::loadgen::sharegpt::Turn;
    use crate::loadgen::WorkloadGen;

    fn turn(h: &str, g: &str) -> Turn {
        Turn {
            human: h.into(),
            gpt: g.into(),
        }
    }

    /// Ten conversations of 1 to 4 turns, and 6 documents.
    fn corpus() -> Arc<Corpus> {
        let conversations = (0..10)
            .map(|c| {
                (0..=(c % 4))
                    .map(|t| {
                        turn(
                            &format!("q{t} of c{c}"),
                            &format!("a{t} of c{c} ").repeat(t + 1),
                        )
                    })
                    .collect()
            })
            .collect();
        let documents = (0..6)
            .map(|d| format!("Document {d}. ").repeat(50))
            .collect();
        Arc::new(Corpus {
            conversations,
            documents,
            parsed: 10,
            skipped: 0,
        })
    }

    fn sharegpt(system_prompt: bool) -> Workload {
        Workload::ShareGpt {
            conversations: 8,
            max_turns: 3,
            max_message_chars: 14,
            max_output_tokens: 4,
            system_prompt,
            think_time_ms: 1000.0,
        }
    }

    #[test]
    fn a_turn_is_the_recorded_history_and_the_next_human_message() {
        let mut gen = ReplayGen::new(&sharegpt(false), corpus(), 1, 1).unwrap();
        let mut seen = std::collections::BTreeSet::new();
        while let Some(c) = gen.next_conversation() {
            assert!(seen.insert(c.id));
            assert_eq!(c.turns.len(), c.think_ms.len());
            assert!((1..=3).contains(&c.turns.len()), "capped at 3 turns");
            for (i, t) in c.turns.iter().enumerate() {
                assert_eq!(t.conversation, Some(c.id));
                assert_eq!(t.messages.len(), 2 * i + 1);
                for (j, m) in t.messages.iter().enumerate() {
                    assert_eq!(m.role, if j % 2 == 0 { "user" } else { "assistant" });
                    assert!(m.content.chars().count() <= 14, "{:?}", m.content);
                }
                if i > 0 {
                    // The previous turn's prompt is a prefix of this one's.
                    assert_eq!(t.messages[..2 * i - 1], c.turns[i - 1].messages[..]);
                    assert!(t.messages[2 * i - 1].content.starts_with('a'));
                }
                assert!((1..=4).contains(&t.output_tokens));
            }
            assert!(c.think_ms.iter().all(|&ms| ms > 0.0));
        }
        assert_eq!(seen.len(), 8, "capped at 8 conversations");
        // Distinct seeds pick different orders; the same seed the same.
        let firsts = |seed| {
            let mut g = ReplayGen::new(&sharegpt(false), corpus(), seed, 1).unwrap();
            (0..8)
                .map(|_| {
                    g.next_conversation().unwrap().turns[0].messages[0]
                        .content
                        .clone()
                })
                .collect::<Vec<_>>()
        };
        assert_eq!(firsts(3), firsts(3));
        assert_ne!(firsts(3), firsts(4));
    }

    #[test]
    fn the_system_variant_shares_one_long_system_prompt() {
        let mut gen = ReplayGen::new(&sharegpt(true), corpus(), 1, 1).unwrap();
        let a = gen.next_conversation().unwrap();
        let b = gen.next_conversation().unwrap();
        for c in [&a, &b] {
            assert_eq!(c.turns[0].messages[0].role, "system");
            assert_eq!(c.turns[0].messages[0].content, SYSTEM_PROMPT);
        }
        assert_ne!(a.turns[0].messages[1], b.turns[0].messages[1]);
        let chars = SYSTEM_PROMPT.chars().count();
        assert!((5_800..=6_200).contains(&chars), "{chars}");
        // ~1,500 tokens at a real tokenizer's ~4 characters per token; the
        // simulator's counts short words and punctuation dearer.
        let tokens = system_prompt_tokens();
        assert!((1_800..=2_200).contains(&tokens), "{tokens}");
    }

    #[test]
    fn lora_conversations_keep_one_adapter_with_its_own_system_prompt() {
        let w = Workload::Lora {
            adapters: 3,
            zipf_alpha: 1.0,
            system_tokens: 20,
            // As `sharegpt(false)`'s, to compare their reused tokens.
            conversations: 8,
            max_turns: 3,
            max_message_chars: 14,
            max_output_tokens: 4,
            think_time_ms: 1000.0,
        };
        let mut gen = ReplayGen::new(&w, corpus(), 1, 1).unwrap();
        let mut prompts = std::collections::BTreeMap::new();
        while let Some(c) = gen.next_conversation() {
            let adapter = c.turns[0].group.unwrap();
            assert!(adapter < 3);
            for turn in &c.turns {
                assert_eq!(turn.group, Some(adapter));
                assert_eq!(turn.model.as_deref(), Some(adapter_name(adapter).as_str()));
                assert_eq!(turn.messages[0].role, "system");
                assert_eq!(count_tokens(turn.messages[0].content.as_bytes()), 20);
                let prompt = prompts
                    .entry(adapter)
                    .or_insert_with(|| turn.messages[0].content.clone());
                assert_eq!(*prompt, turn.messages[0].content, "adapter {adapter}");
            }
        }
        assert!(prompts.len() > 1, "{prompts:?}");
        let distinct: std::collections::BTreeSet<&String> = prompts.values().collect();
        assert_eq!(distinct.len(), prompts.len());
        // The system prompts count once each in the reused tokens.
        let plain = ReplayGen::new(&sharegpt(false), corpus(), 1, 1).unwrap();
        assert_eq!(gen.reused_tokens(), plain.reused_tokens() + 3 * 20);
    }

    #[test]
    fn rag_asks_every_document_each_question_once_per_round() {
        let w = Workload::Rag {
            documents: 4,
            questions: 5,
            output_tokens: 7,
        };
        let mut gen = WorkloadGen::new(w.clone(), 2).with_corpus(corpus());
        let mut pairs = std::collections::BTreeSet::new();
        let mut documents = std::collections::BTreeMap::new();
        for _ in 0..20 {
            let r = gen.next_request();
            assert_eq!(r.messages.len(), 1);
            assert_eq!(r.output_tokens, 7);
            let (document, question) = r.messages[0].content.split_once("\n\n").unwrap();
            assert!(document.starts_with("Document "));
            assert!(QUESTIONS[..5].contains(&question));
            let group = r.group.unwrap();
            assert_eq!(
                documents.entry(group).or_insert(document.to_string()),
                document
            );
            assert!(pairs.insert((group, question.to_string())));
        }
        assert_eq!(documents.len(), 4);
        assert_eq!(pairs.len(), 20);
        // The next round starts over.
        assert!(gen.next_request().group.is_some());
        // Another run seed: the same documents in another order.
        let order = |seed| {
            let mut g = WorkloadGen::new(w.clone(), seed).with_corpus(corpus());
            (0..20).map(|_| g.next_request().text()).collect::<Vec<_>>()
        };
        let (a, b) = (order(1), order(5));
        assert_ne!(a, b);
        let (mut sa, mut sb) = (a.clone(), b.clone());
        sa.sort();
        sb.sort();
        assert_eq!(sa, sb);
    }

    #[test]
    fn without_a_corpus_a_data_workload_yields_empty_requests() {
        let mut gen = WorkloadGen::new(Workload::by_name("rag").unwrap(), 1);
        assert!(gen.next_request().messages.is_empty());
        assert!(gen.replay().is_none());
    }

    #[test]
    fn reused_tokens_count_each_history_once() {
        let corpus = Arc::new(Corpus {
            conversations: vec![vec![turn("aaaa bbbb", "cccc"), turn("dd", "ee")]],
            ..Corpus::default()
        });
        let w = |system_prompt| Workload::ShareGpt {
            conversations: 5,
            max_turns: 1,
            max_message_chars: 100,
            max_output_tokens: 100,
            system_prompt,
            think_time_ms: 1.0,
        };
        let plain = ReplayGen::new(&w(false), Arc::clone(&corpus), 1, 1).unwrap();
        assert_eq!(plain.reused_tokens(), 3 + 1);
        let with_system = ReplayGen::new(&w(true), corpus, 1, 1).unwrap();
        assert_eq!(with_system.reused_tokens(), 4 + system_prompt_tokens());
    }
}
