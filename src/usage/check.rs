//! What a response's usage says of the prefix index: the decision predicted
//! that the chosen instance held `matched_bytes` of the prompt, and its
//! engine reports the `cached_tokens` it found.
//!
//! Engines evict the least recently used blocks first. So when an engine
//! held well under the prediction, of a holding recorded long enough ago
//! that the prefill which made it is done, every holding the index has for
//! that instance used no later than this one is presumed gone too: the
//! instance's forget mark moves to when this holding was last used, and the
//! index no longer believes those entries ([`Verdict::Missed`]). A restarted
//! engine loses its whole past at its first such miss; one whose cache is
//! smaller than the index assumes loses its oldest entries as they prove
//! gone. A prompt the engine held beyond the prediction (another replica
//! sent it there) needs nothing: the decision recorded the whole prompt.
//!
//! The index counts bytes and engines count tokens: the bytes per token are
//! learned per model (tokenizers differ) from the responses whose whole
//! prompt the index saw.

use super::Usage;

/// Responses a [`TokenBytes`] learns from before it is used: one odd
/// prompt must not make every prediction look wrong.
const LEARN_SAMPLES: u32 = 8;

/// A holding this old at the decision is settled: the request that made it
/// has been prefilled, so a miss on it means the engine lost it, not that
/// it is still computing it.
pub const SETTLED_SECS: u32 = 30;

/// A shortfall smaller than this is no miss: engines never cache a prompt's
/// last partial block, nor always the tokens a chat template adds.
const MIN_SHORTFALL_TOKENS: u64 = 64;

/// Bytes per token of the prompts one worker VM routes, learned as an
/// exponential average (weight 1/16) in thousandths.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TokenBytes {
    milli: u64,
    samples: u32,
}

impl TokenBytes {
    /// Learns from a response whose whole prompt was `prompt_bytes` long
    /// and counted `prompt_tokens`.
    pub fn learn(&mut self, prompt_bytes: u64, prompt_tokens: u64) {
        if prompt_bytes == 0 || prompt_tokens == 0 {
            return;
        }
        // Between a tenth of a byte and a kilobyte per token: anything else
        // is not text this filter indexed.
        let sample = (prompt_bytes.saturating_mul(1000) / prompt_tokens).clamp(100, 1_000_000);
        self.milli = match self.samples {
            0 => sample,
            _ => (self.milli * 15 + sample) / 16,
        };
        self.samples = self.samples.saturating_add(1);
    }

    /// Bytes per token in thousandths, once learned.
    pub fn milli(&self) -> Option<u64> {
        (self.samples >= LEARN_SAMPLES).then_some(self.milli)
    }

    /// `bytes` in tokens, once learned.
    pub fn tokens_of(&self, bytes: u64) -> Option<u64> {
        Some(bytes.saturating_mul(1000) / self.milli()?.max(1))
    }
}

/// Models whose bytes per token are learned apart; a prompt for another
/// model, or for one not learned yet, counts at every prompt's ratio.
const MODELS: usize = 16;

/// Bytes per token per model (the body's `model`, hashed), and over every
/// prompt.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ModelTokenBytes {
    every: TokenBytes,
    models: Vec<(u64, TokenBytes)>,
}

impl ModelTokenBytes {
    /// Learns from a response for `model` whose whole prompt was
    /// `prompt_bytes` long and counted `prompt_tokens`.
    pub fn learn(&mut self, model: Option<u64>, prompt_bytes: u64, prompt_tokens: u64) {
        self.every.learn(prompt_bytes, prompt_tokens);
        let Some(model) = model else { return };
        if let Some((_, token_bytes)) = self.models.iter_mut().find(|(m, _)| *m == model) {
            token_bytes.learn(prompt_bytes, prompt_tokens);
        } else if self.models.len() < MODELS {
            let mut token_bytes = TokenBytes::default();
            token_bytes.learn(prompt_bytes, prompt_tokens);
            self.models.push((model, token_bytes));
        }
    }

    /// The ratio to count `model`'s prompts at: its own once learned.
    pub fn of(&self, model: Option<u64>) -> &TokenBytes {
        model
            .and_then(|model| {
                self.models
                    .iter()
                    .find(|(m, t)| *m == model && t.milli().is_some())
            })
            .map_or(&self.every, |(_, token_bytes)| token_bytes)
    }
}

/// What a decision predicted for the instance it chose.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Prediction {
    /// Bytes of the prompt the index had the instance hold.
    pub matched_bytes: u64,
    /// Bytes of the prompt the index saw.
    pub prompt_bytes: u64,
    /// The index saw the whole prompt (it was not cut at `prefix_length`).
    pub whole_prompt: bool,
    /// When the index last recorded the instance's holding of the matched
    /// prefix, before this decision (seconds of the host clock).
    pub held_since_s: Option<u32>,
    /// When the decision was made (seconds of the host clock).
    pub decided_s: u32,
    /// The body's `model`, hashed, where the key includes it.
    pub model: Option<u64>,
}

/// See the module documentation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Nothing to check: no `cached_tokens`, nothing predicted, or the bytes
    /// per token not learned yet.
    Unchecked,
    /// The engine held at least half of the prediction.
    Held,
    /// The engine held less: the index was wrong about this instance. For
    /// a settled holding, the forget mark to move to.
    Missed { forget_through_s: Option<u32> },
}

/// Learns from `usage` and judges `prediction` by it.
pub fn check(prediction: &Prediction, usage: Usage, token_bytes: &mut ModelTokenBytes) -> Verdict {
    let model = prediction.model;
    if prediction.whole_prompt {
        token_bytes.learn(model, prediction.prompt_bytes, usage.prompt_tokens);
    }
    let (Some(cached), Some(predicted)) = (
        usage.cached_tokens,
        token_bytes.of(model).tokens_of(prediction.matched_bytes),
    ) else {
        return Verdict::Unchecked;
    };
    if prediction.matched_bytes == 0 {
        return Verdict::Unchecked;
    }
    let shortfall = predicted.saturating_sub(cached);
    if cached.saturating_mul(2) >= predicted || shortfall < MIN_SHORTFALL_TOKENS {
        return Verdict::Held;
    }
    let settled = |since: &u32| prediction.decided_s.saturating_sub(*since) >= SETTLED_SECS;
    Verdict::Missed {
        forget_through_s: prediction.held_since_s.filter(settled),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Four bytes per token, learned.
    fn learned() -> ModelTokenBytes {
        let mut token_bytes = ModelTokenBytes::default();
        for _ in 0..LEARN_SAMPLES {
            token_bytes.learn(None, 4_000, 1_000);
        }
        token_bytes
    }

    fn prediction(matched_bytes: u64, held_since_s: Option<u32>) -> Prediction {
        Prediction {
            matched_bytes,
            prompt_bytes: 8_000,
            whole_prompt: false,
            held_since_s,
            decided_s: 1_000,
            model: None,
        }
    }

    fn usage(prompt_tokens: u64, cached_tokens: Option<u64>) -> Usage {
        Usage {
            prompt_tokens,
            cached_tokens,
        }
    }

    #[test]
    fn bytes_per_token_are_used_only_once_learned_from_whole_prompts() {
        let mut token_bytes = ModelTokenBytes::default();
        let whole = Prediction {
            whole_prompt: true,
            ..prediction(4_000, Some(0))
        };
        for _ in 1..LEARN_SAMPLES {
            let verdict = check(&whole, usage(2_000, Some(0)), &mut token_bytes);
            assert_eq!(verdict, Verdict::Unchecked);
        }
        let cut = prediction(4_000, Some(0));
        check(&cut, usage(1, Some(0)), &mut token_bytes);
        assert_eq!(
            token_bytes.of(None).milli(),
            None,
            "a cut prompt teaches nothing"
        );
        check(&whole, usage(2_000, Some(0)), &mut token_bytes);
        assert_eq!(token_bytes.of(None).milli(), Some(4_000));
        assert_eq!(token_bytes.of(None).tokens_of(4_000), Some(1_000));
    }

    /// `model`'s whole prompts of `milli` thousandths of a byte per token.
    fn teach(token_bytes: &mut ModelTokenBytes, model: u64, milli: u64, times: u32) {
        for _ in 0..times {
            token_bytes.learn(Some(model), milli * 1_000, 1_000_000);
        }
    }

    #[test]
    fn each_model_counts_at_its_own_ratio_once_learned() {
        let mut token_bytes = ModelTokenBytes::default();
        teach(&mut token_bytes, 1, 3_000, LEARN_SAMPLES);
        teach(&mut token_bytes, 2, 5_000, LEARN_SAMPLES - 1);
        assert_eq!(token_bytes.of(Some(1)).milli(), Some(3_000));
        // Not learned yet, or never seen: every prompt's ratio.
        let every = token_bytes.of(None).milli().unwrap();
        assert!((3_000..5_000).contains(&every), "{every}");
        assert_eq!(token_bytes.of(Some(2)).milli(), Some(every));
        assert_eq!(token_bytes.of(Some(3)).milli(), Some(every));
        teach(&mut token_bytes, 2, 5_000, 1);
        assert_eq!(token_bytes.of(Some(2)).milli(), Some(5_000));
        // 900 tokens held of a predicted 8,000 bytes, judged at each model's
        // ratio: of model 2's 1,600 tokens more than half, of model 1's
        // 2,666 less.
        let mut judged = |model: u64| {
            let predicted = Prediction {
                model: Some(model),
                ..prediction(8_000, Some(0))
            };
            check(&predicted, usage(3_000, Some(900)), &mut token_bytes)
        };
        assert_eq!(judged(2), Verdict::Held);
        let at_model_1 = judged(1);
        assert!(
            matches!(at_model_1, Verdict::Missed { .. }),
            "{at_model_1:?}"
        );
    }

    #[test]
    fn models_past_the_bound_count_at_every_prompts_ratio() {
        let mut token_bytes = ModelTokenBytes::default();
        for model in 0..MODELS as u64 {
            teach(&mut token_bytes, model, 4_000, LEARN_SAMPLES);
        }
        let extra = MODELS as u64;
        teach(&mut token_bytes, extra, 9_000, 64);
        assert!(token_bytes.of(Some(0)).milli() == Some(4_000));
        let every = token_bytes.of(None).milli();
        assert_eq!(token_bytes.of(Some(extra)).milli(), every);
        assert_ne!(every, Some(9_000));
    }

    #[test]
    fn the_average_follows_a_new_ratio_and_bounds_an_impossible_one() {
        let mut token_bytes = TokenBytes::default();
        for _ in 0..LEARN_SAMPLES {
            token_bytes.learn(4_000, 1_000);
        }
        for _ in 0..64 {
            token_bytes.learn(3_000, 1_000);
        }
        let milli = token_bytes.milli().unwrap();
        assert!((3_000..=3_015).contains(&milli), "{milli}");
        token_bytes.learn(u64::MAX, 1);
        token_bytes.learn(0, 5);
        token_bytes.learn(5, 0);
        let milli = token_bytes.milli().unwrap();
        assert!(milli <= 3_015 + 1_000_000 / 16, "{milli}");
    }

    #[test]
    fn an_engine_that_held_half_the_prediction_or_more_agrees() {
        let mut token_bytes = learned();
        let predicted = prediction(8_000, Some(100));
        for cached in [1_000, 2_000, 5_000] {
            let verdict = check(&predicted, usage(3_000, Some(cached)), &mut token_bytes);
            assert_eq!(verdict, Verdict::Held, "{cached}");
        }
    }

    #[test]
    fn a_settled_holding_the_engine_lost_moves_the_forget_mark_to_its_last_use() {
        let mut token_bytes = learned();
        let settled = prediction(8_000, Some(1_000 - SETTLED_SECS));
        let verdict = check(&settled, usage(3_000, Some(16)), &mut token_bytes);
        assert_eq!(
            verdict,
            Verdict::Missed {
                forget_through_s: Some(1_000 - SETTLED_SECS)
            }
        );
    }

    #[test]
    fn a_recent_holding_is_a_miss_that_forgets_nothing() {
        // Still being prefilled by the request that made it, perhaps.
        let mut token_bytes = learned();
        let recent = prediction(8_000, Some(1_000 - SETTLED_SECS + 1));
        let verdict = check(&recent, usage(3_000, Some(0)), &mut token_bytes);
        assert_eq!(
            verdict,
            Verdict::Missed {
                forget_through_s: None
            }
        );
    }

    #[test]
    fn unknown_cached_tokens_nothing_predicted_or_a_small_shortfall_judge_nothing() {
        let mut token_bytes = learned();
        let settled = prediction(8_000, Some(0));
        assert_eq!(
            check(&settled, usage(3_000, None), &mut token_bytes),
            Verdict::Unchecked,
            "absent cached_tokens is unknown, not zero"
        );
        assert_eq!(
            check(
                &prediction(0, None),
                usage(3_000, Some(0)),
                &mut token_bytes
            ),
            Verdict::Unchecked
        );
        // 200 bytes are 50 tokens: a last partial block, not a miss.
        assert_eq!(
            check(
                &prediction(200, Some(0)),
                usage(60, Some(0)),
                &mut token_bytes
            ),
            Verdict::Held
        );
    }
}
