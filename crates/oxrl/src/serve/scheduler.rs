//! The one thread that owns the model and its [`Batcher`]: requests from every connection join
//! its running batch between steps (continuous batching), and weight reloads happen between
//! steps too, so no forward ever sees half-replaced weights.

use super::metrics::ServeMetrics;
use anyhow::{Context, Result};
use oxrl_models::{load_policy, PolicyModel};
use oxrl_rollout::{
    Batcher, Completion, EngineError, Group, GroupSink, VersionSpan, WeightVersion,
};
use std::path::PathBuf;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::Arc;

/// What a connection hears about one prompt of its request.
#[derive(Debug)]
pub enum Event {
    Token {
        prompt: usize,
        sample: usize,
        token: u32,
        logprob: f32,
    },
    Finished {
        prompt: usize,
        sample: usize,
        completion: Completion,
        versions: Vec<VersionSpan>,
    },
    Failed(String),
}

/// Forwards a group's tokens to its connection; a closed connection cancels the group.
struct ChannelSink {
    prompt: usize,
    events: Sender<Event>,
    /// Tokens are counted here, before the answer that holds them can go out.
    metrics: Arc<ServeMetrics>,
}

impl GroupSink for ChannelSink {
    fn token(&mut self, sample: usize, token: u32, logprob: f32) -> bool {
        self.metrics.generated_tokens.fetch_add(1, Relaxed);
        let prompt = self.prompt;
        self.events
            .send(Event::Token {
                prompt,
                sample,
                token,
                logprob,
            })
            .is_ok()
    }

    fn finished(&mut self, sample: usize, completion: Completion, versions: Vec<VersionSpan>) {
        let _ = self.events.send(Event::Finished {
            prompt: self.prompt,
            sample,
            completion,
            versions,
        });
    }

    fn failed(&mut self, error: &EngineError) {
        let _ = self.events.send(Event::Failed(error.to_string()));
    }
}

/// A prompt ready for the batch: ids (image pads expanded) and its processed images.
pub struct Prompt {
    pub ids: Vec<u32>,
    pub images: Vec<Arc<oxrl_models::ProcessedImage>>,
}

enum Command {
    Submit(Vec<Group>),
    Pause,
    Resume,
    Reload {
        dir: PathBuf,
        done: Sender<Result<(), String>>,
    },
    Version {
        version: WeightVersion,
        done: Sender<Result<(), String>>,
    },
}

/// The handle connections use; cloning it is cheap.
#[derive(Clone)]
pub struct Scheduler {
    commands: Sender<Command>,
    metrics: Arc<ServeMetrics>,
    /// A copy of the batcher's settings for checking requests before they queue.
    checker: Arc<std::sync::Mutex<Batcher>>,
    pub paused: Arc<std::sync::atomic::AtomicBool>,
}

impl Scheduler {
    /// Starts the scheduler thread over `batcher`. `dtype` and `device` are what reloaded
    /// weights are converted to.
    pub fn start(
        batcher: Batcher,
        dtype: candle_core::DType,
        metrics: Arc<ServeMetrics>,
    ) -> Result<Scheduler> {
        let (commands, inbox) = mpsc::channel();
        let checker = Batcher::new(
            batcher.model().clone(),
            batcher.tokenizer().cloned(),
            batcher.eos_token_ids().to_vec(),
        );
        let paused = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let seen = paused.clone();
        let shared_metrics = metrics.clone();
        let checker = Arc::new(std::sync::Mutex::new(checker));
        let shared = checker.clone();
        std::thread::Builder::new()
            .name("scheduler".into())
            .spawn(move || run(batcher, shared, inbox, dtype, shared_metrics, seen))
            .context("starting the scheduler thread")?;
        Ok(Scheduler {
            commands,
            metrics,
            checker,
            paused,
        })
    }

    /// The model new requests are checked against (its image processor, its vocabulary).
    pub fn model(&self) -> Arc<dyn PolicyModel> {
        let checker = self.checker.lock().unwrap_or_else(|e| e.into_inner());
        checker.model().clone()
    }

    /// Checks a request against the model (settings, ids, images) before it queues.
    pub fn validate(
        &self,
        prompts: &[Prompt],
        params: &oxrl_rollout::SamplingParams,
    ) -> Result<(), EngineError> {
        let checker = self.checker.lock().unwrap_or_else(|e| e.into_inner());
        checker.validate_params(params)?;
        for (i, p) in prompts.iter().enumerate() {
            checker.validate_prompt(&p.ids, &p.images, &format!("prompt {i}"))?;
        }
        Ok(())
    }

    /// Queues every prompt of a request; its events arrive on the returned channel.
    pub fn submit(
        &self,
        prompts: Vec<Prompt>,
        params: oxrl_rollout::SamplingParams,
    ) -> Result<Receiver<Event>> {
        let (events, arrived) = mpsc::channel();
        let params = Arc::new(params);
        let groups = prompts
            .into_iter()
            .enumerate()
            .map(|(i, p)| Group {
                prompt: p.ids,
                images: p.images,
                params: params.clone(),
                first_stream: 0,
                sink: Box::new(ChannelSink {
                    prompt: i,
                    events: events.clone(),
                    metrics: self.metrics.clone(),
                }),
            })
            .collect();
        self.send(Command::Submit(groups))?;
        Ok(arrived)
    }

    pub fn pause(&self) -> Result<()> {
        self.paused.store(true, Relaxed);
        self.send(Command::Pause)
    }

    pub fn resume(&self) -> Result<()> {
        self.paused.store(false, Relaxed);
        self.send(Command::Resume)
    }

    /// Loads the checkpoint in `dir` and samples from it from the next step on.
    pub fn reload(&self, dir: PathBuf) -> Result<(), String> {
        let (done, answer) = mpsc::channel();
        self.send(Command::Reload { dir, done })
            .map_err(|e| e.to_string())?;
        answer
            .recv()
            .map_err(|_| "the scheduler stopped".to_string())?
    }

    /// Stamps samples from now on with `version`.
    pub fn set_version(&self, version: WeightVersion) -> Result<(), String> {
        let (done, answer) = mpsc::channel();
        self.send(Command::Version { version, done })
            .map_err(|e| e.to_string())?;
        answer
            .recv()
            .map_err(|_| "the scheduler stopped".to_string())?
    }

    fn send(&self, command: Command) -> Result<()> {
        self.commands
            .send(command)
            .ok()
            .context("the scheduler thread has stopped")
    }
}

/// The scheduler loop: take commands, step while there is work and the server is not paused.
fn run(
    mut batcher: Batcher,
    checker: Arc<std::sync::Mutex<Batcher>>,
    inbox: Receiver<Command>,
    dtype: candle_core::DType,
    metrics: Arc<ServeMetrics>,
    paused_flag: Arc<std::sync::atomic::AtomicBool>,
) {
    let mut paused = false;
    loop {
        // Block when there is nothing to do; otherwise only drain what has arrived.
        let first = if paused || batcher.is_idle() {
            match inbox.recv() {
                Ok(c) => Some(c),
                Err(_) => return,
            }
        } else {
            None
        };
        for command in first.into_iter().chain(inbox.try_iter()) {
            match command {
                Command::Submit(groups) => {
                    for g in groups {
                        batcher.submit(g);
                    }
                }
                Command::Pause => paused = true,
                Command::Resume => paused = false,
                Command::Reload { dir, done } => {
                    let reloaded = reload(&mut batcher, &dir, dtype);
                    if reloaded.is_ok() {
                        // The checker must not keep the old weights alive.
                        let mut c = checker.lock().unwrap_or_else(|e| e.into_inner());
                        let version = c.version();
                        let _ = c.set_model(batcher.model().clone(), version);
                    }
                    let _ = done.send(reloaded);
                }
                Command::Version { version, done } => {
                    let _ = done.send(batcher.set_version(version).map_err(|e| e.to_string()));
                }
            }
        }
        paused_flag.store(paused, Relaxed);
        metrics.queue_depth.store(batcher.waiting() as u64, Relaxed);
        metrics.running.store(batcher.running() as u64, Relaxed);
        if paused || batcher.is_idle() {
            continue;
        }
        match batcher.step() {
            Ok(_) => {
                metrics.steps.fetch_add(1, Relaxed);
            }
            Err(e) => oxrl_train::note!("serve: a step failed: {e}"),
        }
    }
}

/// Replaces the batcher's model with the checkpoint in `dir`, which must have the same
/// architecture and shapes (it is the same policy, trained further).
fn reload(
    batcher: &mut Batcher,
    dir: &std::path::Path,
    dtype: candle_core::DType,
) -> Result<(), String> {
    let device = batcher.model().device().clone();
    let fresh: Box<dyn PolicyModel> = load_policy(dir, dtype, &device)
        .map_err(|e| format!("loading weights from {}: {e}", dir.display()))?;
    let old = batcher.model();
    if fresh.architecture() != old.architecture() || fresh.vocab_size() != old.vocab_size() {
        return Err(format!(
            "{} holds a {} with {} tokens; the server runs a {} with {}",
            dir.display(),
            fresh.architecture(),
            fresh.vocab_size(),
            old.architecture(),
            old.vocab_size()
        ));
    }
    // vLLM's reload_weights keeps the processor it started with; a checkpoint that would
    // process images differently (one saved without its preprocessor_config.json) would make
    // the server's prompts differ from the trainer's, silently.
    if fresh.image_prompting() != old.image_prompting() {
        return Err(format!(
            "{} processes images differently from the served model (its \
             preprocessor_config.json or vision token ids differ, or are missing)",
            dir.display()
        ));
    }
    let version = batcher.version();
    batcher
        .set_model(Arc::from(fresh), version)
        .map_err(|e| e.to_string())
}
