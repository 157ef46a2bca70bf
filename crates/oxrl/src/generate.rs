//! `oxrl generate`: sample continuations with the batched KV-cache engine.

use crate::input::{chat_ids, prompt_ids, read_jsonl, reject_images, ChatOptions};
use crate::load::{load, DTypeArg};
use crate::output::write_jsonl;
use anyhow::{bail, Context, Result};
use oxrl_rollout::{Engine, LocalEngine, SamplerConfig, SamplingParams};
use serde_json::{json, Value};
use std::io::IsTerminal;
use std::path::PathBuf;

#[derive(clap::Args)]
#[command(group(clap::ArgGroup::new("source").required(true).args(["prompt", "input"])))]
pub struct GenerateArgs {
    /// Model directory or Hugging Face hub id.
    #[arg(long)]
    model: String,
    /// One prompt; the completions are printed to the terminal.
    #[arg(long)]
    prompt: Option<String>,
    /// JSONL of prompts: `prompt_ids` | `prompt` (text) | `messages` (chat) per line.
    #[arg(long)]
    input: Option<PathBuf>,
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
}

pub fn run(args: GenerateArgs) -> Result<()> {
    let lines = match &args.input {
        Some(path) => Some(read_jsonl(path)?),
        None => None,
    };
    let loaded = load(&args.model, args.dtype)?;
    let tok = loaded.tokenizer.as_deref();
    let chat = ChatOptions {
        enable_thinking: args.enable_thinking,
    };
    let prompts: Vec<Vec<u32>> = match (&lines, &args.prompt) {
        (Some(lines), _) => {
            let path = args
                .input
                .as_ref()
                .map(|p| p.display().to_string())
                .unwrap_or_default();
            lines
                .iter()
                .map(|line| {
                    reject_images(&line.fields)
                        .and_then(|()| prompt_ids(&line.fields, tok, &chat))
                        .with_context(|| format!("{path}:{}", line.number))
                })
                .collect::<Result<_>>()?
        }
        (None, Some(text)) if args.chat => {
            vec![
                chat_ids(&json!([{"role": "user", "content": text}]), tok, &chat)
                    .context("--prompt")?,
            ]
        }
        (None, Some(text)) => match tok {
            Some(t) => vec![t.encode(text)?],
            None => bail!("--prompt is text, but the model has no tokenizer.json"),
        },
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
    };
    let mut engine = LocalEngine::new(
        loaded.model.clone(),
        loaded.tokenizer.clone(),
        loaded.eos_token_ids.clone(),
    );
    if std::io::stderr().is_terminal() {
        engine.on_progress(|p| {
            eprint!(
                "\rgenerating: {}/{} sequences done, {} tokens",
                p.finished, p.total, p.generated_tokens
            );
            if p.finished == p.total {
                eprintln!();
            }
        });
    }
    let results = engine.generate(&prompts, &params)?;
    if args.prompt.is_some() && args.output.is_none() {
        for (j, c) in results[0].iter().enumerate() {
            if args.n > 1 {
                println!("--- sample {j} ({}) ---", c.finish_reason.as_str());
            }
            match &c.text {
                Some(text) => println!("{text}"),
                None => println!("{:?}", c.response_ids),
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
