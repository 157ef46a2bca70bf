//! Multi-turn rollouts: each sampled trajectory is an episode in which the policy's turns
//! alternate with an environment's (`oxrl_env`). A turn is one generation from the episode's
//! whole context; the environment's answer to it is written back as a tool response in Qwen's
//! ChatML form — `<|im_start|>user\n<tool_response>\n…\n</tool_response><|im_end|>\n` then
//! `<|im_start|>assistant\n`, what Qwen3's chat template renders for a `tool` message — and the
//! next turn continues from there. The episode ends when the environment says so, after
//! `max_turns` policy turns, when a turn hits `max_new_tokens`, or when the context would pass
//! the model's positions. Its response is every turn and observation in order; the
//! observation tokens are marked (`EpisodeTokens::generated`) so they stay out of the loss.
//!
//! Every active episode's turn goes to the engine in one call (`n = 1` per context), so the
//! local engine batches them and vLLM serves them concurrently. Sampling is reproducible for a
//! given number of ranks: a turn's seed is the step's mixed with the turn.

use crate::data::PromptRow;
use crate::update::Result;
use oxrl_env::{EnvError, Environment, EnvironmentFactory};
use oxrl_models::Tokenizer;
use oxrl_rollout::{Completion, Engine, EpisodeTokens, FinishReason, SamplingParams};
use serde_json::json;

/// The limits of an episode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EpisodeLimits {
    /// Policy turns at most.
    pub max_turns: usize,
    /// The model's positions: an episode whose next context would pass them ends.
    pub max_positions: usize,
}

/// What the episodes of one call scored, prompt-major like the completions.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EpisodeScores {
    /// Each episode's summed reward (0 for a failed one).
    pub rewards: Vec<f64>,
    /// Each episode's policy turns.
    pub turns: Vec<usize>,
    /// Episodes whose environment failed (an error, a remote that did not answer).
    pub failures: usize,
}

/// One episode in progress.
struct Episode {
    env: Box<dyn Environment>,
    /// The prompt, then every turn and observation so far.
    context: Vec<u32>,
    prompt_len: usize,
    /// The episode's own prompt, when its environment replaced the row's.
    own_prompt: bool,
    logprobs: Vec<f32>,
    generated: Vec<bool>,
    reward: f64,
    turns: usize,
    failed: bool,
    last: Option<Completion>,
    done: bool,
}

/// The tokens of an observation written back after a turn that ended with its end-of-turn token.
fn observation_ids(tokenizer: &Tokenizer, text: &str) -> Result<Vec<u32>> {
    Ok(tokenizer.encode(&format!(
        "\n<|im_start|>user\n<tool_response>\n{text}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    ))?)
}

/// `params.n` episodes of each prompt in `rows`, each with a fresh environment from
/// `environments`. Returns each episode as a completion (prompt-major, `n` per prompt) and
/// their scores.
pub fn run_episodes(
    engine: &mut dyn Engine,
    tokenizer: &Tokenizer,
    environments: &dyn EnvironmentFactory,
    rows: &[&PromptRow],
    params: &SamplingParams,
    limits: EpisodeLimits,
) -> Result<(Vec<Vec<Completion>>, EpisodeScores)> {
    let mut episodes = Vec::with_capacity(rows.len() * params.n);
    for row in rows {
        for _ in 0..params.n {
            episodes.push(start(environments.make(), tokenizer, row)?);
        }
    }
    for turn in 0..limits.max_turns {
        let active: Vec<usize> = (0..episodes.len()).filter(|&i| !episodes[i].done).collect();
        if active.is_empty() {
            break;
        }
        let contexts: Vec<Vec<u32>> = active
            .iter()
            .map(|&i| episodes[i].context.clone())
            .collect();
        let turn_params = SamplingParams {
            n: 1,
            seed: params
                .seed
                .wrapping_add((turn as u64).wrapping_mul(0xA24B_AED4_963E_E407)),
            first_prompt: params.first_prompt * params.n as u64,
            ..params.clone()
        };
        let generated = engine.generate(&contexts, &turn_params)?;
        for (&i, mut samples) in active.iter().zip(generated) {
            let Some(c) = samples.pop() else { continue };
            let last_turn = turn + 1 == limits.max_turns;
            take_turn(&mut episodes[i], c, tokenizer, limits, last_turn)?;
        }
    }
    let mut scores = EpisodeScores::default();
    let mut completions: Vec<Vec<Completion>> = Vec::with_capacity(rows.len());
    for (k, e) in episodes.into_iter().enumerate() {
        if k % params.n.max(1) == 0 {
            completions.push(Vec::with_capacity(params.n));
        }
        scores.rewards.push(if e.failed { 0.0 } else { e.reward });
        scores.turns.push(e.turns);
        scores.failures += usize::from(e.failed);
        if let Some(group) = completions.last_mut() {
            group.push(finish(e, tokenizer)?);
        }
    }
    Ok((completions, scores))
}

/// A fresh episode on `row`: the environment's first observation as the user's message, or
/// the row's prompt.
fn start(mut env: Box<dyn Environment>, tokenizer: &Tokenizer, row: &PromptRow) -> Result<Episode> {
    let (context, own_prompt, failed) = match env.reset(&row.row) {
        Ok(None) => (row.prompt_ids.clone(), false, false),
        Ok(Some(text)) => {
            let messages = json!([{"role": "user", "content": text}]);
            let rendered = match tokenizer.has_chat_template() {
                true => tokenizer.apply_chat_template(&messages, true, &Default::default())?,
                false => text,
            };
            (tokenizer.encode(&rendered)?, true, false)
        }
        Err(EnvError::Failed(why)) => {
            crate::note!("environment: {}: reset failed: {why}", row.at);
            (row.prompt_ids.clone(), false, true)
        }
    };
    Ok(Episode {
        env,
        prompt_len: context.len(),
        context,
        own_prompt,
        logprobs: Vec::new(),
        generated: Vec::new(),
        reward: 0.0,
        turns: 0,
        failed,
        last: None,
        done: failed,
    })
}

/// Adds the policy's turn `c` to the episode and hands its text to the environment.
fn take_turn(
    e: &mut Episode,
    c: Completion,
    tokenizer: &Tokenizer,
    limits: EpisodeLimits,
    last_turn: bool,
) -> Result<()> {
    e.turns += 1;
    // A turn that reached the last position sampled one token past it: drop it, so the
    // episode fits the model (the tokens before it were sampled within the limit).
    let mut c = c;
    let room = limits.max_positions.saturating_sub(e.context.len());
    if c.response_ids.len() > room {
        c.response_ids.truncate(room);
        c.logprobs.truncate(room);
        c.text = None;
        c.finish_reason = FinishReason::Length;
    }
    e.context.extend(&c.response_ids);
    e.logprobs.extend(&c.logprobs);
    e.generated
        .extend(std::iter::repeat_n(true, c.response_ids.len()));
    let text = match &c.text {
        Some(t) => t.clone(),
        None => tokenizer.decode(&c.response_ids, true)?,
    };
    let cut = c.finish_reason == FinishReason::Length;
    e.last = Some(c);
    let step = match e.env.step(&text) {
        Ok(s) => s,
        Err(EnvError::Failed(why)) => {
            crate::note!("environment: step failed: {why}");
            e.failed = true;
            e.done = true;
            return Ok(());
        }
    };
    e.reward += step.reward;
    e.done = step.done || cut || last_turn;
    if e.done {
        return Ok(());
    }
    if let Some(text) = step.observation {
        let ids = observation_ids(tokenizer, &text)?;
        // The next turn needs at least one position of its own.
        if e.context.len() + ids.len() >= limits.max_positions {
            e.done = true;
            return Ok(());
        }
        e.context.extend(&ids);
        e.logprobs.extend(std::iter::repeat_n(0.0, ids.len()));
        e.generated.extend(std::iter::repeat_n(false, ids.len()));
    }
    Ok(())
}

/// The finished episode as one completion of its prompt.
fn finish(e: Episode, tokenizer: &Tokenizer) -> Result<Completion> {
    let response_ids = e.context[e.prompt_len..].to_vec();
    let text = tokenizer.decode(&response_ids, true)?;
    let (finish_reason, weight_version) = match &e.last {
        Some(c) => (c.finish_reason, c.weight_version),
        None => (FinishReason::Stop, Default::default()),
    };
    Ok(Completion {
        response_ids,
        logprobs: e.logprobs,
        finish_reason,
        text: Some(text),
        weight_version,
        episode: Some(EpisodeTokens {
            prompt_ids: e.own_prompt.then(|| e.context[..e.prompt_len].to_vec()),
            generated: e.generated,
        }),
    })
}
