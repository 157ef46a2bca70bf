//! The in-process engine over any [`PolicyModel`]: continuous batching with per-sequence KV
//! caches.
//!
//! Each step either prefills newly admitted prompts (one forward over all their tokens; the `n`
//! samples of a prompt then start from copies of its cache) or decodes one token for every active
//! sequence in one forward. Finished sequences leave and free room for waiting prompts.

use crate::engine::{
    Completion, Engine, EngineError, FinishReason, PromptImages, Result, SamplingParams,
    WeightVersion, MAX_SAMPLES_PER_PROMPT, MAX_SEQUENCES_PER_REQUEST,
};
use crate::sampler::SamplerScratch;
use oxrl_models::{KvCache, PolicyModel, ProcessedImage, Tokenizer, VocabSlices};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;
use std::sync::Arc;

/// What a progress callback hears after every engine step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Progress {
    pub finished: usize,
    pub total: usize,
    pub generated_tokens: usize,
}

type ProgressFn = Box<dyn FnMut(Progress) + Send>;

pub struct LocalEngine {
    model: Arc<dyn PolicyModel>,
    tokenizer: Option<Arc<Tokenizer>>,
    eos_token_ids: Vec<u32>,
    /// Most sequences decoded together; more wait for a free slot.
    pub max_num_seqs: usize,
    /// Most prompt tokens prefilled in one forward (a longer prompt still goes alone).
    pub max_prefill_tokens: usize,
    progress: Option<ProgressFn>,
    /// The version of the weights in `model`'s storage, as the last sync named it.
    version: WeightVersion,
}

struct Sequence {
    prompt: usize,
    sample: usize,
    cache: KvCache,
    rng: ChaCha8Rng,
    response: Vec<u32>,
    logprobs: Vec<f32>,
    finish: Option<FinishReason>,
    /// Set when a stop string ended the sequence: the text up to it.
    stopped_text: Option<String>,
}

/// The rules that end a sequence, fixed for one `generate` call.
struct StopRules<'a> {
    token_ids: Vec<u32>,
    strings: &'a [String],
    tokenizer: Option<&'a Tokenizer>,
    max_new_tokens: usize,
    max_positions: usize,
}

impl StopRules<'_> {
    fn check(&self, seq: &mut Sequence) -> Result<()> {
        let last = *seq
            .response
            .last()
            .expect("checked after a token was appended");
        if self.token_ids.contains(&last) {
            seq.finish = Some(FinishReason::Stop);
            return Ok(());
        }
        if let (false, Some(tok)) = (self.strings.is_empty(), self.tokenizer) {
            let text = tok.decode(&seq.response, true)?;
            let hit = self
                .strings
                .iter()
                .filter_map(|s| text.find(s.as_str()))
                .min();
            if let Some(at) = hit {
                seq.finish = Some(FinishReason::Stop);
                seq.stopped_text = Some(text[..at].to_string());
                return Ok(());
            }
        }
        // The token just sampled still has to be fed at position `cache.len()`.
        if seq.response.len() >= self.max_new_tokens || seq.cache.len() >= self.max_positions {
            seq.finish = Some(FinishReason::Length);
        }
        Ok(())
    }
}

impl LocalEngine {
    pub fn new(
        model: Arc<dyn PolicyModel>,
        tokenizer: Option<Arc<Tokenizer>>,
        eos_token_ids: Vec<u32>,
    ) -> Self {
        Self {
            model,
            tokenizer,
            eos_token_ids,
            max_num_seqs: 256,
            max_prefill_tokens: 8192,
            progress: None,
            version: WeightVersion::default(),
        }
    }

    /// Calls `f` after every engine step, e.g. to draw a progress bar.
    pub fn on_progress(&mut self, f: impl FnMut(Progress) + Send + 'static) {
        self.progress = Some(Box::new(f));
    }

    fn validate(
        &self,
        prompts: &[Vec<u32>],
        images: &PromptImages,
        params: &SamplingParams,
    ) -> Result<()> {
        let bad = |m: String| Err(EngineError::InvalidRequest(m));
        let s = &params.sampler;
        if params.n == 0 {
            return bad("n (samples per prompt) must be at least 1".into());
        }
        if params.n > MAX_SAMPLES_PER_PROMPT {
            return bad(format!(
                "n (samples per prompt) must be at most {MAX_SAMPLES_PER_PROMPT}, got {}",
                params.n
            ));
        }
        let sequences = prompts.len().saturating_mul(params.n);
        if sequences > MAX_SEQUENCES_PER_REQUEST {
            return bad(format!(
                "{} prompts × n = {} = {sequences} sequences in one request; the engine takes at \
                 most {MAX_SEQUENCES_PER_REQUEST} (split the prompts)",
                prompts.len(),
                params.n
            ));
        }
        if params.max_new_tokens == 0 {
            return bad("max_new_tokens must be at least 1".into());
        }
        if !(s.temperature >= 0.0 && s.temperature.is_finite()) {
            return bad(format!("temperature must be ≥ 0, got {}", s.temperature));
        }
        if !(s.top_p > 0.0 && s.top_p <= 1.0) {
            return bad(format!("top_p must be in (0, 1], got {}", s.top_p));
        }
        if !(0.0..=1.0).contains(&s.min_p) {
            return bad(format!("min_p must be in [0, 1], got {}", s.min_p));
        }
        if !params.stop_strings.is_empty() && self.tokenizer.is_none() {
            return bad(
                "stop strings need a tokenizer, and the model has no tokenizer.json".into(),
            );
        }
        for (i, p) in prompts.iter().enumerate() {
            if p.is_empty() {
                return bad(format!("prompt {i} is empty"));
            }
            self.model.validate_ids(p, &format!("prompt {i}"))?;
            if let Some(imgs) = images.get(i) {
                let pixels: Vec<Arc<ProcessedImage>> =
                    imgs.iter().map(|im| im.pixels.clone()).collect();
                self.model
                    .validate_images(p, &pixels, &format!("prompt {i}"))?;
            }
        }
        if !images.is_empty() && images.len() != prompts.len() {
            return bad(format!(
                "{} image lists for {} prompts: give one per prompt (or none)",
                images.len(),
                prompts.len()
            ));
        }
        Ok(())
    }

    /// Samples the next token of `seqs[k]` from logits row `rows[k]`, in parallel.
    fn sample_rows(
        &self,
        logits: &VocabSlices,
        rows: &[usize],
        seqs: &mut [Sequence],
        params: &SamplingParams,
        rules: &StopRules,
    ) -> Result<()> {
        let n_rows = rows.iter().max().map_or(0, |r| r + 1);
        logits.with_data(|parts| {
            seqs.par_iter_mut()
                .zip(rows)
                .map_init(SamplerScratch::default, |scratch, (seq, &r)| {
                    let row: Vec<&[f32]> = parts
                        .iter()
                        .map(|p| {
                            let width = p.len() / n_rows;
                            &p[r * width..(r + 1) * width]
                        })
                        .collect();
                    let (token, logprob) = params.sampler.sample(&row, &mut seq.rng, scratch);
                    // A sampled token always has a finite log-prob under finite logits; NaN or
                    // infinite logits (NaN weights, an overflow) would otherwise sample noise.
                    if !logprob.is_finite() {
                        return Err(EngineError::NonFiniteLogits {
                            prompt: seq.prompt,
                            position: seq.response.len(),
                        });
                    }
                    seq.response.push(token);
                    seq.logprobs.push(logprob);
                    rules.check(seq)
                })
                .collect::<Result<Vec<()>>>()
        })??;
        Ok(())
    }

    fn completion(&self, seq: Sequence) -> Result<Completion> {
        let text = match (seq.stopped_text, &self.tokenizer) {
            (Some(t), _) => Some(t),
            (None, Some(tok)) => Some(tok.decode(&seq.response, true)?),
            (None, None) => None,
        };
        Ok(Completion {
            response_ids: seq.response,
            logprobs: seq.logprobs,
            finish_reason: seq.finish.unwrap_or(FinishReason::Length),
            text,
            weight_version: self.version,
        })
    }
}

impl Engine for LocalEngine {
    fn weight_version(&self) -> WeightVersion {
        self.version
    }

    /// The model shares its storage with the trainer's variables, whose optimizer step already
    /// wrote the new weights in place: a sync only records their version.
    fn sync_weights(&mut self, _policy: &dyn PolicyModel, version: WeightVersion) -> Result<()> {
        self.version.advance_to(version)
    }

    fn generate_with_images(
        &mut self,
        prompts: &[Vec<u32>],
        images: &PromptImages,
        params: &SamplingParams,
    ) -> Result<Vec<Vec<Completion>>> {
        self.validate(prompts, images, params)?;
        let model = self.model.clone();
        let n = params.n;
        let token_ids = params.stop_ids(&self.eos_token_ids);
        let rules = StopRules {
            token_ids,
            strings: &params.stop_strings,
            tokenizer: self.tokenizer.as_deref(),
            max_new_tokens: params.max_new_tokens,
            max_positions: model.max_positions(),
        };
        let total = prompts.len() * n;
        let mut results: Vec<Vec<Option<Completion>>> = vec![vec![None; n]; prompts.len()];
        let mut active: Vec<Sequence> = Vec::new();
        let (mut next_prompt, mut finished, mut generated) = (0, 0, 0);
        while finished < total {
            let mut admit = Vec::new();
            let mut admit_tokens = 0;
            while next_prompt < prompts.len() {
                let len = prompts[next_prompt].len();
                let first = active.is_empty() && admit.is_empty();
                let fits = active.len() + (admit.len() + 1) * n <= self.max_num_seqs
                    && admit_tokens + len <= self.max_prefill_tokens;
                if !(first || fits) {
                    break;
                }
                admit.push(next_prompt);
                admit_tokens += len;
                next_prompt += 1;
            }
            if !admit.is_empty() {
                let mut caches: Vec<KvCache> = admit.iter().map(|_| model.new_cache()).collect();
                let chunks: Vec<&[u32]> = admit.iter().map(|&p| prompts[p].as_slice()).collect();
                let admitted_images: Vec<Vec<Arc<ProcessedImage>>> = admit
                    .iter()
                    .map(|&p| {
                        images.get(p).map_or(Vec::new(), |im| {
                            im.iter().map(|i| i.pixels.clone()).collect()
                        })
                    })
                    .collect();
                let chunk_images: Vec<&[Arc<ProcessedImage>]> =
                    admitted_images.iter().map(Vec::as_slice).collect();
                let logits = model.forward_cached_with(
                    &chunks,
                    &chunk_images,
                    &mut caches.iter_mut().collect::<Vec<_>>(),
                )?;
                // A response never outgrows the model's positions, whatever max_new_tokens says.
                let reserve = params.max_new_tokens.min(model.max_positions());
                let mut fresh = Vec::with_capacity(admit.len() * n);
                let mut rows = Vec::with_capacity(admit.len() * n);
                for (row, (&prompt, cache)) in admit.iter().zip(caches).enumerate() {
                    for sample in 0..n {
                        let mut rng = ChaCha8Rng::seed_from_u64(params.seed);
                        rng.set_stream((prompt * n + sample) as u64);
                        fresh.push(Sequence {
                            prompt,
                            sample,
                            cache: cache.clone(),
                            rng,
                            response: Vec::with_capacity(reserve),
                            logprobs: Vec::with_capacity(reserve),
                            finish: None,
                            stopped_text: None,
                        });
                        rows.push(row);
                    }
                }
                self.sample_rows(&logits, &rows, &mut fresh, params, &rules)?;
                generated += fresh.len();
                active.extend(fresh);
            } else {
                let last: Vec<[u32; 1]> = active
                    .iter()
                    .map(|s| [s.response[s.response.len() - 1]])
                    .collect();
                let chunks: Vec<&[u32]> = last.iter().map(|t| t.as_slice()).collect();
                let mut caches: Vec<&mut KvCache> =
                    active.iter_mut().map(|s| &mut s.cache).collect();
                let logits = model.forward_cached(&chunks, &mut caches)?;
                let rows: Vec<usize> = (0..active.len()).collect();
                self.sample_rows(&logits, &rows, &mut active, params, &rules)?;
                generated += active.len();
            }
            let (done, running): (Vec<_>, Vec<_>) =
                active.into_iter().partition(|s| s.finish.is_some());
            active = running;
            for seq in done {
                let (p, s) = (seq.prompt, seq.sample);
                results[p][s] = Some(self.completion(seq)?);
                finished += 1;
            }
            if let Some(f) = self.progress.as_mut() {
                f(Progress {
                    finished,
                    total,
                    generated_tokens: generated,
                });
            }
        }
        Ok(results
            .into_iter()
            .map(|r| {
                r.into_iter()
                    .map(|c| c.expect("every sequence finished"))
                    .collect()
            })
            .collect())
    }
}
