//! `oxrl score`: per-token log-probabilities of responses, through the same batched training-path
//! forward the trainer uses.

use crate::input::{prompt_with_images, read_jsonl, response_ids, ChatOptions};
use crate::load::{load, DTypeArg, ModelArgs};
use crate::output::write_jsonl;
use anyhow::{anyhow, bail, Context, Result};
use oxrl_models::DeviceSpec;
use oxrl_models::ScoreRequest;
use serde_json::{json, Value};
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct ScoreArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// JSONL: `prompt_ids` | `prompt` | `messages`, `response_ids` | `response`, optional
    /// `temperature`, optional `images` (paths relative to this file, or data URLs).
    #[arg(long)]
    input: PathBuf,
    /// Where to write the results (JSONL, one line per input line); stdout when absent.
    #[arg(long)]
    output: Option<PathBuf>,
    #[arg(long, value_enum, default_value = "f32")]
    dtype: DTypeArg,
    /// `enable_thinking` passed to the chat template for `messages` prompts.
    #[arg(long)]
    enable_thinking: Option<bool>,
    /// Where the model runs: cpu, cuda or cuda:N (a GPU needs a build with `--features cuda`).
    #[arg(long, default_value_t = DeviceSpec::Cpu)]
    device: DeviceSpec,
}

pub fn run(args: ScoreArgs) -> Result<()> {
    let lines = read_jsonl(&args.input)?;
    let loaded = load(&args.model, args.dtype, args.device)?;
    let tok = loaded.tokenizer.as_deref();
    let chat = ChatOptions {
        enable_thinking: args.enable_thinking,
    };
    let base = args.input.parent().unwrap_or(std::path::Path::new("."));
    let mut requests = Vec::with_capacity(lines.len());
    for line in &lines {
        let at = || format!("{}:{}", args.input.display(), line.number);
        let request = (|| -> Result<ScoreRequest> {
            let temperature = match line.fields.get("temperature") {
                None => 1.0,
                Some(t) => t
                    .as_f64()
                    .filter(|t| *t > 0.0)
                    .ok_or_else(|| anyhow!("`temperature`: expected a positive number, got {t}"))?,
            };
            let (prompt_ids, images) =
                prompt_with_images(&line.fields, tok, &chat, loaded.model.as_ref(), base)?;
            let request = ScoreRequest {
                prompt_ids,
                response_ids: response_ids(&line.fields, tok)?,
                temperature,
                images: images.into_iter().map(|im| im.pixels).collect(),
            };
            let all: Vec<u32> = request
                .prompt_ids
                .iter()
                .chain(&request.response_ids)
                .copied()
                .collect();
            loaded.model.validate_ids(&all, "prompt + response")?;
            loaded
                .model
                .validate_images(&request.prompt_ids, &request.images, "prompt")?;
            if request.prompt_ids.is_empty() || request.response_ids.is_empty() {
                return Err(anyhow!(
                    "the prompt and the response each need at least one token"
                ));
            }
            Ok(request)
        })()
        .with_context(at)?;
        requests.push(request);
    }
    let scored = loaded.model.score_batch(&requests)?;
    // JSON has no NaN: a non-finite log-prob would be written as `null` and pass unnoticed.
    if let Some(i) = scored
        .iter()
        .position(|lp| lp.iter().any(|x| !x.is_finite()))
    {
        bail!(
            "{}:{}: the model gives non-finite log-probs (NaN or infinity): its weights in {} \
             hold NaN or infinite values, or overflow in {:?}",
            args.input.display(),
            lines[i].number,
            args.model.model,
            args.dtype
        );
    }
    let out: Vec<Value> = scored
        .iter()
        .map(|lp| {
            let sum: f64 = lp.iter().map(|&x| x as f64).sum();
            json!({"logprobs": lp, "sum": sum})
        })
        .collect();
    write_jsonl(args.output.as_deref(), &out)
}
