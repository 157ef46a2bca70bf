//! `oxrl sft`: supervised fine-tuning on chat data. Every assistant turn of a conversation is one
//! example whose loss covers only the assistant's tokens: the prompt is the conversation before
//! the turn rendered with the generation prompt, the response is what the full render adds.

use crate::config::RunConfig;
use crate::data::{read_rows, DataCursor, DataError, DataOrder, Row};
use crate::grpo::{build_trainer, open_device};
use crate::interrupt::Interrupt;
use crate::observe::{Gauges, MetricsLog, Progress};
use crate::run_dir::RunDir;
use crate::state::{self, TrainerState};
use crate::update::{Result, TrainError};
use oxrl_models::image::{is_image_item, prompt_image_sources};
use oxrl_models::{hub::resolve_model, ImagePrompting, ScoreRequest, Tokenizer};
use serde_json::{Map, Value};
use std::path::{Path, PathBuf};
use std::time::Instant;

/// The longest example a model can train on (its positions), and what a longer one does:
/// dropped and counted, or an error naming its row.
#[derive(Debug, Clone, Copy)]
pub struct LengthLimit {
    pub max_tokens: usize,
    pub drop: bool,
}

/// The (prompt, assistant response) token pairs of every conversation in `files`, and how many
/// were dropped for `limit`. Each row's `column` holds the chat messages; their image items
/// (with sources, or filled in order from the `image_key` column) come with every turn after
/// them, for a policy that takes images.
pub fn load_examples(
    files: &[PathBuf],
    column: &str,
    image_key: &str,
    tok: &Tokenizer,
    kwargs: &Map<String, Value>,
    prompting: Option<&ImagePrompting>,
    limit: Option<LengthLimit>,
) -> std::result::Result<(Vec<ScoreRequest>, usize), DataError> {
    let mut out = Vec::new();
    let mut dropped = 0;
    for file in files {
        let base = file.parent().unwrap_or(Path::new("."));
        for Row { at, columns } in read_rows(file)? {
            let messages = columns
                .get(column)
                .and_then(Value::as_array)
                .ok_or_else(|| {
                    DataError::row(
                        &at,
                        format!("`{column}` must be a list of chat messages (data.prompt_key)"),
                    )
                })?;
            let all = Value::Array(messages.clone());
            let sources = prompt_image_sources(columns.get(image_key), Some(&all), base)
                .map_err(|e| DataError::row(&at, e))?;
            let images = ImagePrompting::prepare_with(prompting, &sources)
                .map_err(|e| DataError::row(&at, e))?;
            for (turn, m) in messages.iter().enumerate() {
                if m.get("role").and_then(Value::as_str) != Some("assistant") {
                    continue;
                }
                let seen = image_items(&messages[..turn]).min(images.len());
                let turn_images = &images[..seen];
                let render = |upto: usize, gen: bool| {
                    let ids = tok
                        .apply_chat_template(&Value::Array(messages[..upto].to_vec()), gen, kwargs)
                        .and_then(|t| tok.encode(&t))
                        .map_err(|e| DataError::row(&at, e))?;
                    match prompting {
                        Some(p) if seen > 0 => p
                            .expand(&ids, turn_images)
                            .map_err(|e| DataError::row(&at, e)),
                        _ => Ok(ids),
                    }
                };
                let prompt_ids = render(turn, true)?;
                let full = render(turn + 1, false)?;
                if !full.starts_with(&prompt_ids) || full.len() == prompt_ids.len() {
                    return Err(DataError::row(&at, format!("turn {turn}: the chat template does not render the conversation as the prompt followed by the reply"
                    )));
                }
                if let Some(limit) = limit.filter(|l| full.len() > l.max_tokens) {
                    if limit.drop {
                        dropped += 1;
                        continue;
                    }
                    return Err(DataError::row(
                        &at,
                        format!(
                            "turn {turn}: {} tokens, more than the model's {} positions",
                            full.len(),
                            limit.max_tokens
                        ),
                    ));
                }
                out.push(ScoreRequest {
                    response_ids: full[prompt_ids.len()..].to_vec(),
                    prompt_ids,
                    temperature: 1.0,
                    images: turn_images.to_vec(),
                });
            }
        }
    }
    if out.is_empty() {
        let names: Vec<String> = files.iter().map(|f| f.display().to_string()).collect();
        return Err(DataError::row(
            names.join(", "),
            match dropped {
                0 => "the dataset has no assistant turns to train on".to_string(),
                n => format!(
                    "all {n} assistant turns are longer than the model's {} positions",
                    limit.map_or(0, |l| l.max_tokens)
                ),
            },
        ));
    }
    Ok((out, dropped))
}

/// Image items in the contents of `messages` (what the chat template turns into image pads).
fn image_items(messages: &[Value]) -> usize {
    messages
        .iter()
        .filter_map(|m| m.get("content").and_then(Value::as_array))
        .flatten()
        .filter(|item| is_image_item(item))
        .count()
}

/// Where an SFT run ended.
#[derive(Debug, Clone)]
pub struct SftSummary {
    pub steps: u64,
    /// The newest checkpoint: the final weights, or the last ones saved before an interrupt.
    pub last: PathBuf,
    /// The signal that stopped the run before `max_steps`.
    pub interrupted: Option<i32>,
}

/// Runs SFT for `max_steps` steps of `trainer.batch_size` examples; checkpoints like GRPO runs,
/// and stops like them at a step boundary with a checkpoint when `interrupt` asks.
pub fn run(cfg: &RunConfig, resume: bool, interrupt: &Interrupt) -> Result<SftSummary> {
    let model_dir = resolve_model(&cfg.model_path)?;
    let tok = Tokenizer::from_dir(&model_dir)?;
    let mut kwargs = Map::new();
    if let Some(t) = cfg.data.enable_thinking {
        kwargs.insert("enable_thinking".into(), Value::Bool(t));
    }
    if cfg.data.train_files.is_empty() {
        return Err(TrainError::Invalid(format!(
            "{}: [data] train_files is required",
            cfg.source.display()
        )));
    }
    let prompting = ImagePrompting::from_dir(&model_dir)?;
    let run_dir = RunDir::open(&cfg.output_dir, resume)?;
    let resumed = run_dir.resumed.clone();
    let policy_dir = resumed
        .as_ref()
        .map_or(model_dir.clone(), |(_, d)| d.clone());
    let mut trainer = build_trainer(cfg, &policy_dir, &open_device(cfg)?, resumed.is_some())?;
    let limit = LengthLimit {
        max_tokens: trainer.policy.max_positions(),
        drop: cfg.data.filter_overlong,
    };
    let (examples, dropped) = load_examples(
        &cfg.data.train_files,
        &cfg.data.prompt_key,
        &cfg.data.image_key,
        &tok,
        &kwargs,
        prompting.as_ref(),
        Some(limit),
    )?;
    if dropped > 0 {
        crate::note!(
            "data: dropped {dropped} assistant turns longer than the model's {} positions \
             ([data] overlong_prompts = \"error\" stops instead)",
            limit.max_tokens
        );
    }
    let (mut step, cursor) = match &resumed {
        Some((_, dir)) => {
            let s = state::load_state(dir)?;
            state::load_optimizer(dir, &mut trainer, &s)?;
            (s.step, s.data)
        }
        None => (
            0,
            DataCursor {
                epoch: 0,
                position: 0,
            },
        ),
    };
    let mut order = DataOrder::new(examples.len(), cfg.seed, cfg.data.shuffle, cursor);
    let metrics = MetricsLog::open(&cfg.output_dir.join("metrics.jsonl"), step)?;
    let gauges = Gauges::default();
    if let Some(port) = cfg.prometheus_port {
        gauges.serve(&cfg.prometheus_host, port)?;
    }
    let progress = Progress::new(cfg.max_steps);
    let save = |trainer: &crate::PolicyTrainer, step: u64, cursor| -> Result<PathBuf> {
        let s = TrainerState {
            step,
            optimizer_step: trainer.optimizer_steps(),
            data: cursor,
            seed: cfg.seed,
            optimizer_shards: None,
            critic_optimizer_step: None,
            kl_reward_coef: None,
        };
        state::save(&cfg.output_dir, trainer, &s, Some(&model_dir))
    };
    let mut last = policy_dir;
    let mut interrupted = None;
    while step < cfg.max_steps {
        if let Some(signal) = interrupt.signal() {
            interrupted = Some(signal);
            break;
        }
        let start = Instant::now();
        let batch: Vec<ScoreRequest> = order
            .next_batch(cfg.batch_size)
            .into_iter()
            .map(|i| examples[i].clone())
            .collect();
        let mut m = trainer.sft_step(&batch)?;
        step += 1;
        m.insert("time/step".into(), start.elapsed().as_secs_f64());
        metrics.append(&m, step)?;
        gauges.set(&m);
        progress.step(step, &m);
        let periodic = cfg.save_every > 0 && step.is_multiple_of(cfg.save_every);
        if periodic || step == cfg.max_steps || interrupt.signal().is_some() {
            last = save(&trainer, step, order.cursor)?;
        }
    }
    Ok(SftSummary {
        steps: step,
        last,
        interrupted,
    })
}

/// The directory a finished SFT run's final weights are in.
pub fn final_checkpoint(out_dir: &Path) -> Option<PathBuf> {
    state::latest(out_dir).map(|(_, d)| d)
}
