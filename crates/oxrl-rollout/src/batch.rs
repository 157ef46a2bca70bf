//! Continuous batching over per-sequence KV caches, for any number of callers.
//!
//! A [`Group`] is one prompt and its `n` samples, with its own sampling settings and a
//! [`GroupSink`] that hears its tokens as they are sampled. Groups join the running batch
//! between steps and leave when finished, so a server can admit a new request while others are
//! half-way through (vLLM's scheduling), and the offline engine is the same loop fed once.
//!
//! Each [`Batcher::step`] either prefills newly admitted prompts (one forward over all their
//! tokens; the `n` samples of a prompt then start from copies of its cache) or decodes one token
//! for every running sequence in one forward.

use crate::engine::{
    Completion, EngineError, FinishReason, Result, SamplingParams, WeightVersion,
    MAX_SAMPLES_PER_PROMPT,
};
use crate::sampler::SamplerScratch;
use oxrl_models::{KvCache, PolicyModel, ProcessedImage, Tokenizer, VocabSlices};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

/// The tokens of a completion sampled under one weight version: `[start, end)` in its response.
/// A server that reloads weights while a request runs (vLLM's `pause?mode=keep`) samples the
/// rest of it under the new version.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VersionSpan {
    pub version: WeightVersion,
    pub start: usize,
    pub end: usize,
}

/// Where a group's results go. Calls come from the thread that steps the batcher, in sampling
/// order.
pub trait GroupSink: Send {
    /// Sample `sample` drew `token` with log-probability `logprob`. Returning `false` cancels
    /// the whole group (a client that went away): its sequences leave the batch at once.
    fn token(&mut self, sample: usize, token: u32, logprob: f32) -> bool;
    /// Sample `sample` finished.
    fn finished(&mut self, sample: usize, completion: Completion, versions: Vec<VersionSpan>);
    /// The step that ran this group's sequences failed; the group has left the batch.
    fn failed(&mut self, error: &EngineError);
}

/// One prompt and its `n` samples.
pub struct Group {
    pub prompt: Vec<u32>,
    pub images: Vec<Arc<ProcessedImage>>,
    pub params: Arc<SamplingParams>,
    /// Sample `j` draws from stream `first_stream + j` of `params.seed`: the offline engine gives
    /// prompt `i` the streams from `i·n`, so results do not depend on batching.
    pub first_stream: u64,
    pub sink: Box<dyn GroupSink>,
}

/// What one step did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StepReport {
    /// Tokens sampled in this step.
    pub sampled: usize,
    /// Sequences that finished in this step.
    pub finished: usize,
}

/// The settings a group's sequences share.
struct Rules {
    params: Arc<SamplingParams>,
    stop_ids: Vec<u32>,
}

/// A group in the batch: its settings and its caller.
struct Running {
    rules: Arc<Rules>,
    sink: Box<dyn GroupSink>,
    first_stream: u64,
    /// Samples not finished yet.
    left: usize,
}

struct Sequence {
    group: u64,
    rules: Arc<Rules>,
    sample: usize,
    cache: KvCache,
    rng: ChaCha8Rng,
    response: Vec<u32>,
    logprobs: Vec<f32>,
    versions: Vec<VersionSpan>,
    finish: Option<FinishReason>,
    /// Set when a stop string ended the sequence: the text up to it.
    stopped_text: Option<String>,
}

/// What ends a sequence besides its group's rules.
struct StopLimits<'a> {
    tokenizer: Option<&'a Tokenizer>,
    max_positions: usize,
}

impl StopLimits<'_> {
    /// Ends `seq` if its last token, text or length says so.
    fn check(&self, seq: &mut Sequence) -> Result<()> {
        let last = *seq.response.last().expect("checked after a token");
        let rules = &*seq.rules;
        if rules.stop_ids.contains(&last) {
            seq.finish = Some(FinishReason::Stop);
            return Ok(());
        }
        let strings = &rules.params.stop_strings;
        if let (false, Some(tok)) = (strings.is_empty(), self.tokenizer) {
            let text = tok.decode(&seq.response, true)?;
            let hit = strings.iter().filter_map(|s| text.find(s.as_str())).min();
            if let Some(at) = hit {
                seq.finish = Some(FinishReason::Stop);
                seq.stopped_text = Some(text[..at].to_string());
                return Ok(());
            }
        }
        // The token just sampled still has to be fed at position `cache.len()`.
        if seq.response.len() >= rules.params.max_new_tokens
            || seq.cache.len() >= self.max_positions
        {
            seq.finish = Some(FinishReason::Length);
        }
        Ok(())
    }
}

/// Sequences decoded together unless the caller says otherwise.
pub const DEFAULT_MAX_NUM_SEQS: usize = 256;
/// Prompt tokens prefilled in one forward unless the caller says otherwise.
pub const DEFAULT_MAX_PREFILL_TOKENS: usize = 8192;

pub struct Batcher {
    model: Arc<dyn PolicyModel>,
    tokenizer: Option<Arc<Tokenizer>>,
    eos_token_ids: Vec<u32>,
    /// Most sequences decoded together; more wait for a free slot.
    pub max_num_seqs: usize,
    /// Most prompt tokens prefilled in one forward (a longer prompt still goes alone).
    pub max_prefill_tokens: usize,
    version: WeightVersion,
    waiting: VecDeque<(u64, Group)>,
    groups: HashMap<u64, Running>,
    active: Vec<Sequence>,
    next_id: u64,
}

impl Batcher {
    pub fn new(
        model: Arc<dyn PolicyModel>,
        tokenizer: Option<Arc<Tokenizer>>,
        eos_token_ids: Vec<u32>,
    ) -> Self {
        Self {
            model,
            tokenizer,
            eos_token_ids,
            max_num_seqs: DEFAULT_MAX_NUM_SEQS,
            max_prefill_tokens: DEFAULT_MAX_PREFILL_TOKENS,
            version: WeightVersion::default(),
            waiting: VecDeque::new(),
            groups: HashMap::new(),
            active: Vec::new(),
            next_id: 0,
        }
    }

    pub fn model(&self) -> &Arc<dyn PolicyModel> {
        &self.model
    }

    pub fn tokenizer(&self) -> Option<&Arc<Tokenizer>> {
        self.tokenizer.as_ref()
    }

    pub fn eos_token_ids(&self) -> &[u32] {
        &self.eos_token_ids
    }

    pub fn version(&self) -> WeightVersion {
        self.version
    }

    /// Samples from now on come from `model` (new weights of the same architecture), stamped
    /// `version`. Running sequences keep their caches and go on under the new weights.
    pub fn set_model(&mut self, model: Arc<dyn PolicyModel>, version: WeightVersion) -> Result<()> {
        self.set_version(version)?;
        self.model = model;
        Ok(())
    }

    /// Stamps samples from now on with `version`, which must not go back.
    pub fn set_version(&mut self, version: WeightVersion) -> Result<()> {
        self.version.advance_to(version)
    }

    /// Groups waiting for room in the batch.
    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Sequences decoding now.
    pub fn running(&self) -> usize {
        self.active.len()
    }

    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.active.is_empty()
    }

    /// Checks the settings every sequence of a request shares.
    pub fn validate_params(&self, params: &SamplingParams) -> Result<()> {
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
        Ok(())
    }

    /// Checks one prompt (ids in the vocabulary, images matching their placeholder tokens);
    /// `what` names it in the error.
    pub fn validate_prompt(
        &self,
        prompt: &[u32],
        images: &[Arc<ProcessedImage>],
        what: &str,
    ) -> Result<()> {
        if prompt.is_empty() {
            return Err(EngineError::InvalidRequest(format!("{what} is empty")));
        }
        self.model.validate_ids(prompt, what)?;
        Ok(self.model.validate_images(prompt, images, what)?)
    }

    /// Queues a group; it joins the batch at the next step with room for it. Validate it first
    /// ([`Batcher::validate_params`], [`Batcher::validate_prompt`]).
    pub fn submit(&mut self, group: Group) {
        let id = self.next_id;
        self.next_id += 1;
        self.waiting.push_back((id, group));
    }

    /// Runs one prefill or decode step. A failed step (a model error, non-finite logits) fails
    /// every group it touched through their sinks and returns the error; the batcher stays
    /// usable for the groups still waiting.
    pub fn step(&mut self) -> Result<StepReport> {
        let admitted = self.admit();
        // A prefill touches only the groups it admits; a decode touches every running one.
        let touched: Vec<u64> = if admitted.is_empty() {
            self.groups.keys().copied().collect()
        } else {
            admitted.iter().map(|(id, _)| *id).collect()
        };
        let outcome = if admitted.is_empty() {
            self.decode()
        } else {
            self.prefill(admitted)
        };
        match outcome {
            Ok(report) => Ok(report),
            Err(error) => {
                for id in touched {
                    if let Some(mut group) = self.groups.remove(&id) {
                        group.sink.failed(&error);
                    }
                }
                self.active.retain(|s| self.groups.contains_key(&s.group));
                Err(error)
            }
        }
    }

    /// Takes waiting groups in order while they fit: the first always goes (a prompt longer
    /// than the prefill budget still runs, alone).
    fn admit(&mut self) -> Vec<(u64, Group)> {
        let mut admit = Vec::new();
        let (mut seqs, mut tokens) = (0, 0);
        while let Some((_, g)) = self.waiting.front() {
            let first = self.active.is_empty() && admit.is_empty();
            let fits = self.active.len() + seqs + g.params.n <= self.max_num_seqs
                && tokens + g.prompt.len() <= self.max_prefill_tokens;
            if !(first || fits) {
                break;
            }
            seqs += g.params.n;
            tokens += g.prompt.len();
            admit.push(self.waiting.pop_front().expect("front exists"));
        }
        admit
    }

    fn prefill(&mut self, admitted: Vec<(u64, Group)>) -> Result<StepReport> {
        let ids: Vec<u64> = admitted.iter().map(|(id, _)| *id).collect();
        let model = self.model.clone();
        let mut caches: Vec<KvCache> = admitted.iter().map(|_| model.new_cache()).collect();
        let chunks: Vec<&[u32]> = admitted.iter().map(|(_, g)| g.prompt.as_slice()).collect();
        let images: Vec<&[Arc<ProcessedImage>]> =
            admitted.iter().map(|(_, g)| g.images.as_slice()).collect();
        let mut fresh = Vec::new();
        let mut rows = Vec::new();
        let logits =
            model.forward_cached_with(&chunks, &images, &mut caches.iter_mut().collect::<Vec<_>>());
        for (id, group) in admitted {
            let running = Running {
                rules: Arc::new(Rules {
                    stop_ids: group.params.stop_ids(&self.eos_token_ids),
                    params: group.params.clone(),
                }),
                left: group.params.n,
                first_stream: group.first_stream,
                sink: group.sink,
            };
            self.groups.insert(id, running);
        }
        let logits = logits?;
        for (row, (&id, cache)) in ids.iter().zip(caches).enumerate() {
            let group = &self.groups[&id];
            let params = &group.rules.params;
            // A response never outgrows the model's positions, whatever max_new_tokens says.
            let reserve = params.max_new_tokens.min(model.max_positions());
            for sample in 0..params.n {
                let mut rng = ChaCha8Rng::seed_from_u64(params.seed);
                rng.set_stream(group.first_stream + sample as u64);
                fresh.push(Sequence {
                    group: id,
                    rules: group.rules.clone(),
                    sample,
                    cache: cache.fork()?,
                    rng,
                    response: Vec::with_capacity(reserve),
                    logprobs: Vec::with_capacity(reserve),
                    versions: Vec::new(),
                    finish: None,
                    stopped_text: None,
                });
                rows.push(row);
            }
        }
        self.sample_rows(&logits, &rows, &mut fresh)?;
        self.active.extend(fresh);
        Ok(self.emit(rows.len()))
    }

    fn decode(&mut self) -> Result<StepReport> {
        if self.active.is_empty() {
            return Ok(StepReport::default());
        }
        let last: Vec<[u32; 1]> = self
            .active
            .iter()
            .map(|s| [s.response[s.response.len() - 1]])
            .collect();
        let chunks: Vec<&[u32]> = last.iter().map(|t| t.as_slice()).collect();
        let mut caches: Vec<&mut KvCache> = self.active.iter_mut().map(|s| &mut s.cache).collect();
        let logits = self.model.forward_cached(&chunks, &mut caches)?;
        let rows: Vec<usize> = (0..self.active.len()).collect();
        let mut active = std::mem::take(&mut self.active);
        let sampled = self.sample_rows(&logits, &rows, &mut active);
        self.active = active;
        sampled?;
        Ok(self.emit(rows.len()))
    }

    /// Samples the next token of `seqs[k]` from logits row `rows[k]`, in parallel, and applies
    /// the stop rules.
    fn sample_rows(
        &self,
        logits: &VocabSlices,
        rows: &[usize],
        seqs: &mut [Sequence],
    ) -> Result<()> {
        let n_rows = rows.iter().max().map_or(0, |r| r + 1);
        let version = self.version;
        let limits = StopLimits {
            tokenizer: self.tokenizer.as_deref(),
            max_positions: self.model.max_positions(),
        };
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
                    let (token, logprob) =
                        seq.rules.params.sampler.sample(&row, &mut seq.rng, scratch);
                    // A sampled token always has a finite log-prob under finite logits; NaN or
                    // infinite logits (NaN weights, an overflow) would otherwise sample noise.
                    if !logprob.is_finite() {
                        return Err(EngineError::NonFiniteLogits {
                            prompt: seq.group as usize,
                            position: seq.response.len(),
                        });
                    }
                    seq.response.push(token);
                    seq.logprobs.push(logprob);
                    let at = seq.response.len();
                    match seq.versions.last_mut() {
                        Some(span) if span.version == version => span.end = at,
                        _ => seq.versions.push(VersionSpan {
                            version,
                            start: at - 1,
                            end: at,
                        }),
                    }
                    limits.check(seq)
                })
                .collect::<Result<Vec<()>>>()
        })??;
        Ok(())
    }

    /// Tells each sink its new tokens and finished samples, drops cancelled groups, and moves
    /// finished sequences out of the batch.
    fn emit(&mut self, sampled: usize) -> StepReport {
        let mut cancelled = Vec::new();
        for seq in &self.active {
            let Some(group) = self.groups.get_mut(&seq.group) else {
                continue;
            };
            if cancelled.contains(&seq.group) {
                continue;
            }
            let (token, logprob) = (
                seq.response[seq.response.len() - 1],
                seq.logprobs[seq.logprobs.len() - 1],
            );
            if !group.sink.token(seq.sample, token, logprob) {
                cancelled.push(seq.group);
            }
        }
        for id in &cancelled {
            self.groups.remove(id);
        }
        let (done, running): (Vec<_>, Vec<_>) = std::mem::take(&mut self.active)
            .into_iter()
            .filter(|s| self.groups.contains_key(&s.group))
            .partition(|s| s.finish.is_some());
        self.active = running;
        let finished = done.len();
        for seq in done {
            let text = match (seq.stopped_text, &self.tokenizer) {
                (Some(t), _) => Some(t),
                (None, Some(tok)) => tok.decode(&seq.response, true).ok(),
                (None, None) => None,
            };
            let oldest = seq.versions.iter().map(|s| s.version).min();
            let completion = Completion {
                response_ids: seq.response,
                logprobs: seq.logprobs,
                finish_reason: seq.finish.unwrap_or(FinishReason::Length),
                text,
                weight_version: oldest.unwrap_or(self.version),
                episode: None,
            };
            let group = self.groups.get_mut(&seq.group).expect("kept above");
            group.sink.finished(seq.sample, completion, seq.versions);
            group.left -= 1;
            if group.left == 0 {
                self.groups.remove(&seq.group);
            }
        }
        StepReport { sampled, finished }
    }
}
