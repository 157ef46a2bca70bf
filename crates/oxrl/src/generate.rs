//! `oxrl generate`: sample continuations with the batched KV-cache engine.

use crate::input::{prompt_with_images, read_jsonl, ChatOptions};
use crate::load::{load, DTypeArg, ModelArgs};
use crate::output::{say, write_jsonl};
use anyhow::{bail, Context, Result};
use oxrl_models::DeviceSpec;
use oxrl_rollout::{Engine, LocalEngine, PromptImage, SamplerConfig, SamplingParams};
use serde_json::{json, Value};
use std::io::IsTerminal;
use std::path::{Path, PathBuf};

#[derive(clap::Args)]
#[command(group(clap::ArgGroup::new("source").required(true).args(["prompt", "input"])))]
pub struct GenerateArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// One prompt; the completions are printed to the terminal.
    #[arg(long)]
    prompt: Option<String>,
    /// JSONL of prompts: `prompt_ids` | `prompt` (text) | `messages` (chat) per line, optional
    /// `images` (paths relative to this file, or data URLs).
    #[arg(long)]
    input: Option<PathBuf>,
    /// An image for `--prompt` (repeatable; Qwen3-VL): placed before the text in the user
    /// message, so it needs `--chat`.
    #[arg(long = "image", requires = "prompt")]
    images: Vec<PathBuf>,
    /// Where to write the completions (JSONL, one line per sample); stdout when absent.
    #[arg(long)]
    output: Option<PathBuf>,
    /// Render `--prompt` as a user message with the model's chat template.
    #[arg(long)]
    chat: bool,
    /// `enable_thinking` passed to the chat template.
    #[arg(long)]
    enable_thinking: Option<bool>,
    /// Samples per prompt.
    #[arg(long, default_value_t = 1)]
    n: usize,
    #[arg(long, default_value_t = 256)]
    max_new_tokens: usize,
    /// 0 means greedy.
    #[arg(long, default_value_t = 1.0)]
    temperature: f64,
    #[arg(long, default_value_t = 1.0)]
    top_p: f64,
    /// 0 keeps every token.
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    #[arg(long, default_value_t = 0.0)]
    min_p: f64,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// A text that ends a completion (repeatable); the text stops before it.
    #[arg(long)]
    stop: Vec<String>,
    /// Do not stop at the model's eos tokens.
    #[arg(long)]
    ignore_eos: bool,
    #[arg(long, value_enum, default_value = "f32")]
    dtype: DTypeArg,
    /// Where the model runs: cpu, cuda or cuda:N (a GPU needs a build with `--features cuda`).
    #[arg(long, default_value_t = DeviceSpec::Cpu)]
    device: DeviceSpec,
}

pub fn run(args: GenerateArgs) -> Result<()> {
    let lines = match &args.input {
        Some(path) => Some(read_jsonl(path)?),
        None => None,
    };
    let loaded = load(&args.model, args.dtype, args.device)?;
    let tok = loaded.tokenizer.as_deref();
    let chat = ChatOptions {
        enable_thinking: args.enable_thinking,
    };
    let (prompts, images): (Vec<Vec<u32>>, Vec<Vec<PromptImage>>) = match (&lines, &args.prompt) {
        (Some(lines), _) => {
            let path = args.input.clone().unwrap_or_default();
            let base = path.parent().unwrap_or(Path::new("."));
            lines
                .iter()
                .map(|line| {
                    prompt_with_images(&line.fields, tok, &chat, loaded.model.as_ref(), base)
                        .with_context(|| format!("{}:{}", path.display(), line.number))
                })
                .collect::<Result<Vec<_>>>()?
                .into_iter()
                .unzip()
        }
        (None, Some(text)) => {
            if !args.images.is_empty() && !args.chat {
                bail!("--image needs --chat: the chat template places the image in the prompt");
            }
            let mut fields = serde_json::Map::new();
            if args.chat {
                let mut content: Vec<Value> = args
                    .images
                    .iter()
                    .map(|p| json!({"type": "image", "image": p.display().to_string()}))
                    .collect();
                content.push(json!({"type": "text", "text": text}));
                fields.insert(
                    "messages".into(),
                    json!([{"role": "user", "content": content}]),
                );
            } else {
                fields.insert("prompt".into(), Value::String(text.clone()));
            }
            let (ids, imgs) =
                prompt_with_images(&fields, tok, &chat, loaded.model.as_ref(), Path::new("."))
                    .context("--prompt")?;
            (vec![ids], vec![imgs])
        }
        (None, None) => bail!("give --prompt or --input"),
    };
    let params = SamplingParams {
        n: args.n,
        max_new_tokens: args.max_new_tokens,
        sampler: SamplerConfig {
            temperature: args.temperature,
            top_k: args.top_k,
            top_p: args.top_p,
            min_p: args.min_p,
        },
        seed: args.seed,
        stop_token_ids: Vec::new(),
        stop_strings: args.stop.clone(),
        ignore_eos: args.ignore_eos,
        first_prompt: 0,
    };
    let mut engine = LocalEngine::new(
        loaded.model.clone(),
        loaded.tokenizer.clone(),
        loaded.eos_token_ids.clone(),
    );
    if std::io::stderr().is_terminal() {
        engine.on_progress(|p| {
            oxrl_train::note_inline!(
                "\rgenerating: {}/{} sequences done, {} tokens",
                p.finished,
                p.total,
                p.generated_tokens
            );
            if p.finished == p.total {
                oxrl_train::note!();
            }
        });
    }
    let results = engine
        .generate_with_images(&prompts, &images, &params)
        .with_context(|| format!("generating with {}", args.model.model))?;
    if args.prompt.is_some() && args.output.is_none() {
        for (j, c) in results[0].iter().enumerate() {
            if args.n > 1 {
                say!("--- sample {j} ({}) ---", c.finish_reason.as_str())?;
            }
            match &c.text {
                Some(text) => say!("{text}")?,
                None => say!("{:?}", c.response_ids)?,
            }
        }
        return Ok(());
    }
    let mut out: Vec<Value> = Vec::new();
    for (i, (prompt, samples)) in prompts.iter().zip(&results).enumerate() {
        for (j, c) in samples.iter().enumerate() {
            out.push(json!({
                "index": i,
                "sample": j,
                "prompt_ids": prompt,
                "response_ids": c.response_ids,
                "logprobs": c.logprobs,
                "finish_reason": c.finish_reason.as_str(),
                "text": c.text,
            }));
        }
    }
    write_jsonl(args.output.as_deref(), &out)
}
