//! The in-process engine over any [`PolicyModel`]: one [`Batcher`] fed a whole request, whose
//! prompts join the batch as room frees up.

use crate::batch::{
    Batcher, Group, GroupSink, VersionSpan, DEFAULT_MAX_NUM_SEQS, DEFAULT_MAX_PREFILL_TOKENS,
};
use crate::engine::{
    Completion, Engine, EngineError, PromptImages, Result, SamplingParams, WeightVersion,
    MAX_SEQUENCES_PER_REQUEST,
};
use oxrl_models::{PolicyModel, ProcessedImage, Tokenizer};
use std::sync::mpsc;
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

/// Sends each finished sample of prompt `prompt` back to `generate_with_images`.
struct Collect {
    prompt: usize,
    done: mpsc::Sender<(usize, usize, Completion)>,
}

impl GroupSink for Collect {
    fn token(&mut self, _sample: usize, _token: u32, _logprob: f32) -> bool {
        true
    }

    fn finished(&mut self, sample: usize, completion: Completion, _versions: Vec<VersionSpan>) {
        // The receiver lives until every sample has arrived.
        let _ = self.done.send((self.prompt, sample, completion));
    }

    fn failed(&mut self, _error: &EngineError) {}
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
            max_num_seqs: DEFAULT_MAX_NUM_SEQS,
            max_prefill_tokens: DEFAULT_MAX_PREFILL_TOKENS,
            progress: None,
            version: WeightVersion::default(),
        }
    }

    /// Calls `f` after every engine step, e.g. to draw a progress bar.
    pub fn on_progress(&mut self, f: impl FnMut(Progress) + Send + 'static) {
        self.progress = Some(Box::new(f));
    }

    fn batcher(&self) -> Result<Batcher> {
        let mut b = Batcher::new(
            self.model.clone(),
            self.tokenizer.clone(),
            self.eos_token_ids.clone(),
        );
        b.max_num_seqs = self.max_num_seqs;
        b.max_prefill_tokens = self.max_prefill_tokens;
        b.set_version(self.version)?;
        Ok(b)
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
        let mut batcher = self.batcher()?;
        batcher.validate_params(params)?;
        let n = params.n;
        let total = prompts.len().saturating_mul(n);
        if total > MAX_SEQUENCES_PER_REQUEST {
            return Err(EngineError::InvalidRequest(format!(
                "{} prompts × n = {n} = {total} sequences in one request; the engine takes at \
                 most {MAX_SEQUENCES_PER_REQUEST} (split the prompts)",
                prompts.len(),
            )));
        }
        if !images.is_empty() && images.len() != prompts.len() {
            return Err(EngineError::InvalidRequest(format!(
                "{} image lists for {} prompts: give one per prompt (or none)",
                images.len(),
                prompts.len()
            )));
        }
        let pixels: Vec<Vec<Arc<ProcessedImage>>> = (0..prompts.len())
            .map(|i| {
                images.get(i).map_or(Vec::new(), |im| {
                    im.iter().map(|i| i.pixels.clone()).collect()
                })
            })
            .collect();
        for (i, (p, im)) in prompts.iter().zip(&pixels).enumerate() {
            batcher.validate_prompt(p, im, &format!("prompt {i}"))?;
        }
        let params = Arc::new(params.clone());
        let (done, arrived) = mpsc::channel();
        for (i, (prompt, images)) in prompts.iter().zip(pixels).enumerate() {
            batcher.submit(Group {
                prompt: prompt.clone(),
                images,
                params: params.clone(),
                first_stream: (params.first_prompt + i as u64) * n as u64,
                sink: Box::new(Collect {
                    prompt: i,
                    done: done.clone(),
                }),
            });
        }
        let mut results: Vec<Vec<Option<Completion>>> = vec![vec![None; n]; prompts.len()];
        let (mut finished, mut generated) = (0, 0);
        while finished < total {
            let report = batcher.step()?;
            generated += report.sampled;
            for (p, s, completion) in arrived.try_iter() {
                results[p][s] = Some(completion);
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
