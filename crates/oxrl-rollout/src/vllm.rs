//! Rollouts on vLLM servers (`[rollout] backend = "vllm"`): token ids in, sampled token ids and
//! their log-probs out, over vLLM's `POST /inference/v1/generate` (servers started with
//! `--enable-scale-out --logprobs-mode processed_logprobs`, so the log-probs are of the
//! temperature-scaled distribution, as the local engine's are).
//!
//! Each prompt's `n` samples go to one server in one request (a GRPO group shares its prefill
//! and prefix cache); prompts are spread over the servers round-robin and sent concurrently,
//! at most [`MAX_REQUESTS_IN_FLIGHT`] per server. Stop strings are applied to the answers here
//! (the servers run without a tokenizer and stop on token ids).
//! A transport error or a 5xx is retried with exponential backoff; anything else fails the
//! step with the server's URL and answer.
//!
//! Weights reach the servers through a directory they can read (`sync = "disk"`): the policy is
//! saved there as a Hugging Face checkpoint, then each server is paused (`/pause?mode=keep`),
//! reloads (`/collective_rpc` `reload_weights`), resumes, and takes the new version
//! (`/update_weight_version`), which it stamps on every later sample (`weight_versions`). Those
//! stamps are what the completions carry, so the trainer sees what really sampled them.
//! These control routes exist only on servers started with `VLLM_SERVER_DEV_MODE=1`.
//!
//! With `sync = "nccl"` the weights go device to device instead, over vLLM's NCCL weight
//! transfer ([`crate::weight_transfer`]); the trainer brings the [`Broadcaster`].

use crate::engine::{
    Completion, Engine, EngineError, FinishReason, PromptImage, PromptImages, Result,
    SamplingParams, WeightVersion,
};
use crate::weight_transfer::{self, Broadcaster};
use oxrl_models::checkpoint::{save_safetensors_synced, MAX_SHARD_BYTES};
use oxrl_models::{PolicyModel, Tokenizer};
use serde_json::{json, Value};
use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How the servers get the trainer's weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightSync {
    /// Save to `sync_dir`, then each server reloads from it.
    Disk,
    /// Broadcast every tensor over NCCL to every server's workers (GPU builds).
    Nccl,
    /// Never: the servers keep the weights they started with (benchmarks, and a test that
    /// shows the log-prob gap of an unsynced engine). Samples stay at their start version.
    None,
}

impl WeightSync {
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "disk" => Some(Self::Disk),
            "nccl" => Some(Self::Nccl),
            "none" => Some(Self::None),
            _ => None,
        }
    }
}

/// The settings of a vLLM engine.
#[derive(Debug, Clone, PartialEq)]
pub struct VllmSpec {
    /// Base URLs (`http://host:port`), one per server.
    pub server_urls: Vec<String>,
    pub sync: WeightSync,
    /// Where `sync = "disk"` saves the policy; every server must be able to read it. `None`:
    /// the directory the caller gives [`VllmEngine::connect`] (a run's output directory).
    pub sync_dir: Option<PathBuf>,
    /// Per request, connect to last byte (a generation request of a whole group included).
    pub timeout: Duration,
    pub max_retries: u32,
    /// Wait before the first retry; doubled for each further one.
    pub backoff: Duration,
}

/// Requests one engine keeps in flight per server; more prompts wait for a free slot (a batch
/// of 1024 prompts is not 1024 threads and sockets).
pub const MAX_REQUESTS_IN_FLIGHT: usize = 64;

/// vLLM's token-in/token-out generation route.
const TOKEN_ROUTE: &str = "/inference/v1/generate";

pub struct VllmEngine {
    spec: VllmSpec,
    /// `spec.sync_dir` or the default, absolute: the servers resolve it from their own cwd.
    sync_dir: PathBuf,
    agent: ureq::Agent,
    tokenizer: Option<Arc<Tokenizer>>,
    eos_token_ids: Vec<u32>,
    version: WeightVersion,
    /// Per server: requests, seconds, failed attempts (reset by `take_metrics`).
    stats: std::sync::Mutex<Vec<(u64, f64, u64)>>,
    /// Set when a server answered 404 to the token route: `/v1/completions` from then on.
    use_completions: std::sync::atomic::AtomicBool,
    /// The trainer's end of the NCCL group (`sync = "nccl"`), and whether it has joined. In a
    /// mutex only so the engine can be shared with its request threads; one sync uses it.
    broadcaster: std::sync::Mutex<Option<Box<dyn Broadcaster>>>,
    nccl_joined: bool,
    /// The model's image pad (`image_token_id`), for image prompts.
    image_token_id: Option<u32>,
    /// The checkpoint whose tokenizer and processor files go beside the synced weights.
    checkpoint_files: Option<PathBuf>,
    /// A data-parallel rank other than 0: rank 0 moves the servers' weights, and this engine
    /// only takes the version once it has ([`VllmEngine::as_follower`]).
    follower: bool,
}

/// One prompt as sent: its ids (image pads compact) and its images as vLLM's `content_parts`.
#[derive(Debug)]
struct RemotePrompt {
    ids: Vec<u32>,
    content_parts: Vec<Value>,
}

/// A request that failed for good: the URL, the last HTTP status (if any) and what happened.
struct RemoteFailure {
    status: Option<u16>,
    url: String,
    message: String,
}

/// Why one attempt failed, and whether another may succeed.
struct Failure {
    message: String,
    retry: bool,
    /// The HTTP status, when the server answered with one.
    status: Option<u16>,
}

impl VllmEngine {
    /// Connects to every server: each must answer `GET /health`, or the error names it.
    /// `default_sync_dir` is where weights go when the spec names no `sync_dir`.
    pub fn connect(
        spec: VllmSpec,
        default_sync_dir: &std::path::Path,
        tokenizer: Option<Arc<Tokenizer>>,
        eos_token_ids: Vec<u32>,
    ) -> Result<Self> {
        if spec.server_urls.is_empty() {
            return Err(EngineError::InvalidRequest(
                "backend = \"vllm\" needs at least one URL in server_urls".into(),
            ));
        }
        let agent = ureq::AgentBuilder::new().timeout(spec.timeout).build();
        for url in &spec.server_urls {
            let health = format!("{}/health", url.trim_end_matches('/'));
            agent
                .get(&health)
                .timeout(Duration::from_secs(10))
                .call()
                .map_err(|e| EngineError::Remote {
                    url: health.clone(),
                    message: format!("the server is not answering its health check: {e}"),
                })?;
        }
        let n = spec.server_urls.len();
        let chosen = spec.sync_dir.as_deref().unwrap_or(default_sync_dir);
        let sync_dir = std::path::absolute(chosen).map_err(|e| {
            EngineError::InvalidRequest(format!("sync_dir {}: {e}", chosen.display()))
        })?;
        Ok(Self {
            spec,
            sync_dir,
            agent,
            tokenizer,
            eos_token_ids,
            version: WeightVersion::default(),
            stats: std::sync::Mutex::new(vec![(0, 0.0, 0); n]),
            use_completions: Default::default(),
            broadcaster: Default::default(),
            nccl_joined: false,
            follower: false,
            image_token_id: None,
            checkpoint_files: None,
        })
    }

    /// How the servers get the weights.
    pub fn sync(&self) -> WeightSync {
        self.spec.sync
    }

    /// The model's image pad token, so that image prompts can be sent (vision models).
    pub fn with_image_token_id(mut self, id: Option<u32>) -> Self {
        self.image_token_id = id;
        self
    }

    /// Copy the tokenizer and processor files of the checkpoint in `dir` beside each synced
    /// policy, so that the sync directory is a whole checkpoint (a server that reloads it whole,
    /// as `oxrl serve` does, keeps processing images as the trainer does).
    pub fn with_checkpoint_files(mut self, dir: &std::path::Path) -> Self {
        self.checkpoint_files = Some(dir.to_path_buf());
        self
    }

    /// For a data-parallel rank other than 0, which shares the servers with rank 0: its
    /// `sync_weights` sends nothing and only takes the version, which rank 0's sync has put on
    /// the servers by then (the trainer waits for it).
    pub fn as_follower(mut self) -> Self {
        self.follower = true;
        self
    }

    /// The sender `sync = "nccl"` broadcasts through (the CUDA build's NCCL communicator).
    pub fn with_broadcaster(mut self, broadcaster: Box<dyn Broadcaster>) -> Self {
        self.broadcaster = std::sync::Mutex::new(Some(broadcaster));
        self
    }

    fn attempt(
        &self,
        method: &str,
        url: &str,
        body: Option<&Value>,
    ) -> std::result::Result<Value, Failure> {
        let request = self.agent.request(method, url);
        let sent = match body {
            Some(b) => request.send_json(b),
            None => request.call(),
        };
        let response = match sent {
            Ok(r) => r,
            Err(ureq::Error::Status(code, r)) => {
                let text = r.into_string().unwrap_or_default();
                return Err(Failure {
                    message: format!("HTTP status {code}: {}", text.trim()),
                    retry: code >= 500 || code == 408 || code == 429,
                    status: Some(code),
                });
            }
            Err(ureq::Error::Transport(t)) => {
                return Err(Failure {
                    message: t.to_string(),
                    retry: true,
                    status: None,
                })
            }
        };
        let text = response.into_string().map_err(|e| Failure {
            message: format!("reading the answer: {e}"),
            retry: true,
            status: None,
        })?;
        serde_json::from_str(&text).map_err(|e| Failure {
            message: format!("the answer is not JSON ({e}): {}", shorten(&text)),
            retry: false,
            status: None,
        })
    }

    /// `POST <server><path>` with retries; the error names the URL and the last failure.
    fn post(&self, server: usize, path: &str, body: Option<&Value>) -> Result<Value> {
        self.request(server, "POST", path, body, self.spec.max_retries)
    }

    /// `POST <server><path>` once: a request that is half of a collective (the other half is
    /// the trainer's NCCL call) cannot be sent again on its own.
    fn post_once(&self, server: usize, path: &str, body: &Value) -> Result<Value> {
        self.request(server, "POST", path, Some(body), 0)
    }

    fn request(
        &self,
        server: usize,
        method: &str,
        path: &str,
        body: Option<&Value>,
        retries: u32,
    ) -> Result<Value> {
        self.request_with_status(server, method, path, body, retries)
            .map_err(|f| EngineError::Remote {
                url: f.url,
                message: f.message,
            })
    }

    /// [`Self::request`], keeping the HTTP status of a final failure.
    fn request_with_status(
        &self,
        server: usize,
        method: &str,
        path: &str,
        body: Option<&Value>,
        retries: u32,
    ) -> std::result::Result<Value, RemoteFailure> {
        let url = format!(
            "{}{path}",
            self.spec.server_urls[server].trim_end_matches('/')
        );
        let mut attempt = 0;
        loop {
            let start = Instant::now();
            let result = self.attempt(method, &url, body);
            let mut stats = self.stats.lock().unwrap_or_else(|e| e.into_inner());
            match result {
                Ok(v) => {
                    stats[server].0 += 1;
                    stats[server].1 += start.elapsed().as_secs_f64();
                    return Ok(v);
                }
                Err(f) => {
                    stats[server].2 += 1;
                    drop(stats);
                    if !(f.retry && attempt < retries) {
                        let tries = attempt + 1;
                        return Err(RemoteFailure {
                            status: f.status,
                            url,
                            message: format!("{} (after {tries} attempts)", f.message),
                        });
                    }
                    std::thread::sleep(self.spec.backoff * 2u32.saturating_pow(attempt));
                    attempt += 1;
                }
            }
        }
    }

    /// One prompt's group from `server`, in the token route's answer shape: the token route,
    /// or `/v1/completions` with prompt ids on a server that lacks it (said once on stderr).
    fn generate_one(
        &self,
        server: usize,
        prompt: &RemotePrompt,
        index: usize,
        params: &SamplingParams,
    ) -> Result<Value> {
        use std::sync::atomic::Ordering::SeqCst;
        let body = self.request_body(prompt, index, params);
        if !self.use_completions.load(SeqCst) {
            let retries = self.spec.max_retries;
            match self.request_with_status(server, "POST", TOKEN_ROUTE, Some(&body), retries) {
                Ok(answer) => return Ok(answer),
                Err(RemoteFailure {
                    status: Some(404), ..
                }) => {
                    if !self.use_completions.swap(true, SeqCst) {
                        let url = &self.spec.server_urls[server];
                        let _ = writeln!(
                            std::io::stderr(),
                            "rollout: {url} has no /inference/v1/generate (start vLLM with \
                             --enable-scale-out); using /v1/completions with prompt ids, which \
                             needs the server's tokenizer"
                        );
                    }
                }
                Err(f) => {
                    return Err(EngineError::Remote {
                        url: f.url,
                        message: f.message,
                    })
                }
            }
        }
        if !prompt.content_parts.is_empty() {
            return Err(EngineError::Remote {
                url: self.spec.server_urls[server].clone(),
                message: "image prompts need the token route (/inference/v1/generate, vLLM \
                          started with --enable-scale-out); /v1/completions takes no images"
                    .into(),
            });
        }
        let mut completion = body["sampling_params"].clone();
        completion["prompt"] = body["token_ids"].clone();
        completion["return_token_ids"] = json!(true);
        completion["return_weight_versions"] = json!(true);
        let answer = self.post(server, "/v1/completions", Some(&completion))?;
        Ok(token_route_shape(&answer))
    }

    /// The body of one prompt's generation request.
    fn request_body(&self, prompt: &RemotePrompt, index: usize, params: &SamplingParams) -> Value {
        let s = &params.sampler;
        let stop = params.stop_ids(&self.eos_token_ids);
        let mut body = json!({
            "token_ids": prompt.ids,
            "sampling_params": {
                "n": params.n,
                "max_tokens": params.max_new_tokens,
                "temperature": s.temperature,
                "top_p": s.top_p,
                "top_k": s.top_k,
                "min_p": s.min_p,
                // One stream per prompt, reproducible for a given seed and prompt order.
                "seed": request_seed(params.seed, params.first_prompt as usize + index),
                "stop_token_ids": stop,
                "ignore_eos": params.ignore_eos,
                "logprobs": 0,
                "detokenize": false,
                "skip_special_tokens": false,
            },
        });
        if !prompt.content_parts.is_empty() {
            body["content_parts"] = json!(prompt.content_parts);
        }
        body
    }

    /// A prompt as vLLM takes it: each image's run of pads back to the single pad the chat
    /// template writes (vLLM expands it again from the image it processes itself; given the
    /// expanded run it would expand every pad), and the images as `content_parts`.
    fn remote_prompt(&self, ids: &[u32], images: &[PromptImage]) -> Result<RemotePrompt> {
        if images.is_empty() {
            return Ok(RemotePrompt {
                ids: ids.to_vec(),
                content_parts: Vec::new(),
            });
        }
        let pad = self.image_token_id.ok_or_else(|| {
            EngineError::InvalidRequest(
                "an image prompt for a model without an image token (not a vision model)".into(),
            )
        })?;
        let compact = collapse_image_pads(ids, pad);
        let runs = compact.iter().filter(|&&t| t == pad).count();
        if runs != images.len() {
            return Err(EngineError::InvalidRequest(format!(
                "the prompt has {runs} image placeholders for {} images",
                images.len()
            )));
        }
        let content_parts = images
            .iter()
            .map(|image| Ok(json!({"type": "image_url", "url": image_url(image)?})))
            .collect::<Result<_>>()?;
        Ok(RemotePrompt {
            ids: compact,
            content_parts,
        })
    }

    /// The `n` completions in a server's answer.
    fn completions(&self, answer: &Value, params: &SamplingParams) -> Result<Vec<Completion>> {
        let bad = |m: String| EngineError::InvalidRequest(format!("vLLM's answer: {m}"));
        let choices = answer
            .get("choices")
            .and_then(Value::as_array)
            .ok_or_else(|| {
                bad(format!(
                    "no `choices` list in {}",
                    shorten(&answer.to_string())
                ))
            })?;
        if choices.len() != params.n {
            return Err(bad(format!(
                "{} choices for n = {}",
                choices.len(),
                params.n
            )));
        }
        let mut out = Vec::with_capacity(choices.len());
        for c in choices {
            let ids: Vec<u32> = c
                .get("token_ids")
                .and_then(Value::as_array)
                .ok_or_else(|| bad("a choice without `token_ids`".into()))?
                .iter()
                .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()))
                .collect::<Option<_>>()
                .ok_or_else(|| bad("a token id that is not a u32".into()))?;
            let logprobs: Vec<f32> = c
                .pointer("/logprobs/content")
                .and_then(Value::as_array)
                .ok_or_else(|| bad("a choice without `logprobs.content`".into()))?
                .iter()
                .map(|l| l.get("logprob").and_then(Value::as_f64).map(|x| x as f32))
                .collect::<Option<_>>()
                .ok_or_else(|| bad("a log-prob that is not a number".into()))?;
            if logprobs.len() != ids.len() {
                return Err(bad(format!(
                    "{} log-probs for {} tokens",
                    logprobs.len(),
                    ids.len()
                )));
            }
            let finish_reason = match c.get("finish_reason").and_then(Value::as_str) {
                Some("length") => FinishReason::Length,
                _ => FinishReason::Stop,
            };
            let mut completion = Completion {
                text: match &self.tokenizer {
                    Some(t) => Some(t.decode(&ids, true)?),
                    None => None,
                },
                response_ids: ids,
                logprobs,
                finish_reason,
                weight_version: sampled_version(c).unwrap_or(self.version),
                episode: None,
            };
            if let Some(t) = &self.tokenizer {
                cut_at_stop_string(&mut completion, &params.stop_strings, t)?;
            }
            out.push(completion);
        }
        Ok(out)
    }

    /// Every server: pause (keeping in-flight requests), reload from `dir`, resume, take the
    /// version.
    fn reload_all(&self, dir: &std::path::Path, version: WeightVersion) -> Result<()> {
        let weights_path = dir.display().to_string();
        for server in 0..self.spec.server_urls.len() {
            self.post(server, "/pause?mode=keep", None)?;
            let rpc = json!({"method": "reload_weights", "kwargs": {"weights_path": weights_path}});
            let reloaded = self.post(server, "/collective_rpc", Some(&rpc));
            // Resume even when the reload failed, so the server is not left paused.
            self.post(server, "/resume", None)?;
            reloaded?;
            let named = json!({"new_version": version_name(version)});
            self.post(server, "/update_weight_version", Some(&named))?;
        }
        Ok(())
    }

    /// `sync = "nccl"`: joins the NCCL group on first use, then on every server
    /// `/start_weight_update` → `/update_weights` (answered once the broadcasts it announces
    /// have arrived, so it is open while they are sent) → `/finish_weight_update` with the
    /// version.
    fn broadcast_all(&mut self, policy: &dyn PolicyModel, version: WeightVersion) -> Result<()> {
        let taken = self.broadcaster.get_mut().map(Option::take);
        let mut broadcaster = taken.ok().flatten().ok_or_else(|| {
            EngineError::InvalidRequest(
                "sync = \"nccl\" needs an NCCL broadcaster, which only the CUDA build has; \
                 use sync = \"disk\""
                    .into(),
            )
        })?;
        let sent = self.transfer(broadcaster.as_mut(), policy, version);
        self.broadcaster = std::sync::Mutex::new(Some(broadcaster));
        sent
    }

    fn transfer(
        &mut self,
        broadcaster: &mut dyn Broadcaster,
        policy: &dyn PolicyModel,
        version: WeightVersion,
    ) -> Result<()> {
        if !self.nccl_joined {
            self.join_group(broadcaster)?;
            self.nccl_joined = true;
        }
        let servers = self.spec.server_urls.len();
        for server in 0..servers {
            self.post(server, "/start_weight_update", Some(&json!({})))?;
        }
        let params = policy.named_parameters()?;
        let update = weight_transfer::update_body(&params)?;
        self.alongside_every_server("/update_weights", &update, || {
            params
                .iter()
                .try_for_each(|(_, tensor)| broadcaster.broadcast(tensor))
        })?;
        let finish = weight_transfer::finish_body(version);
        for server in 0..servers {
            self.post(server, "/finish_weight_update", Some(&finish))?;
        }
        Ok(())
    }

    /// Asks every server how many workers it runs, then has them all join a new group (each
    /// from its rank offset) while the trainer joins as rank 0.
    fn join_group(&self, broadcaster: &mut dyn Broadcaster) -> Result<()> {
        let workers = (0..self.spec.server_urls.len())
            .map(|server| {
                let answer = self.request(server, "GET", "/get_world_size", None, 0)?;
                weight_transfer::world_size_of(&answer).ok_or_else(|| EngineError::Remote {
                    url: format!("{}/get_world_size", self.spec.server_urls[server]),
                    message: format!("expected {{\"world_size\": N ≥ 1}}, got {answer}"),
                })
            })
            .collect::<Result<Vec<usize>>>()?;
        let (offsets, world_size) = weight_transfer::rank_offsets(&workers);
        let id = broadcaster.unique_id()?;
        let bodies: Vec<Value> = offsets
            .iter()
            .map(|&offset| weight_transfer::init_body(&id, offset, world_size))
            .collect();
        self.alongside_each_server("/init_weight_transfer_engine", &bodies, || {
            broadcaster.join(&id, world_size)
        })
    }

    /// Posts `body` to every server, each from its own thread, while `local` runs here: the
    /// two halves of one collective. The first error of either side is the answer.
    fn alongside_every_server(
        &self,
        path: &str,
        body: &Value,
        local: impl FnOnce() -> Result<()>,
    ) -> Result<()> {
        let bodies = vec![body.clone(); self.spec.server_urls.len()];
        self.alongside_each_server(path, &bodies, local)
    }

    /// [`Self::alongside_every_server`] with one body per server.
    fn alongside_each_server(
        &self,
        path: &str,
        bodies: &[Value],
        local: impl FnOnce() -> Result<()>,
    ) -> Result<()> {
        std::thread::scope(|scope| {
            let posts: Vec<_> = bodies
                .iter()
                .enumerate()
                .map(|(server, body)| scope.spawn(move || self.post_once(server, path, body)))
                .collect();
            let here = local();
            let answers = posts.into_iter().map(|p| {
                p.join().unwrap_or_else(|_| {
                    Err(EngineError::InvalidRequest(format!(
                        "the {path} request thread panicked"
                    )))
                })
            });
            let mut first_error = here.err();
            for answer in answers {
                if let (None, Err(e)) = (&first_error, answer) {
                    first_error = Some(e);
                }
            }
            first_error.map_or(Ok(()), Err)
        })
    }
}

/// Ends `c` where the local engine would have: at the first token whose text completes a stop
/// string, the text cut before it. The servers sample with stop token ids only (they run
/// without a tokenizer), so stop strings are applied to their answers here; tokens sampled
/// past the stop are dropped with their log-probs.
fn cut_at_stop_string(c: &mut Completion, stops: &[String], tok: &Tokenizer) -> Result<()> {
    let full = c.text.as_deref().unwrap_or("");
    if stops.is_empty() || !stops.iter().any(|s| full.contains(s.as_str())) {
        return Ok(());
    }
    for k in 1..=c.response_ids.len() {
        let text = tok.decode(&c.response_ids[..k], true)?;
        if let Some(at) = stops.iter().filter_map(|s| text.find(s.as_str())).min() {
            c.response_ids.truncate(k);
            c.logprobs.truncate(k);
            c.text = Some(text[..at].to_string());
            c.finish_reason = FinishReason::Stop;
            break;
        }
    }
    Ok(())
}

/// `ids` with every run of `pad` shortened to one.
fn collapse_image_pads(ids: &[u32], pad: u32) -> Vec<u32> {
    let mut out: Vec<u32> = Vec::with_capacity(ids.len());
    for &t in ids {
        if !(t == pad && out.last() == Some(&pad)) {
            out.push(t);
        }
    }
    out
}

/// An image as a `data:` URL, which every server can read (a path may not exist there).
fn image_url(image: &PromptImage) -> Result<String> {
    use base64::Engine as _;
    let Some(source) = &image.source else {
        return Err(EngineError::InvalidRequest(
            "an image made in memory has no file or data URL to send to a vLLM server".into(),
        ));
    };
    if source.starts_with("data:") {
        return Ok(source.clone());
    }
    let bytes = std::fs::read(source)
        .map_err(|e| EngineError::InvalidRequest(format!("image {source}: {e}")))?;
    let extension = std::path::Path::new(source)
        .extension()
        .and_then(|e| e.to_str())
        .map(str::to_ascii_lowercase);
    let media_type = match extension.as_deref() {
        Some("png") => "image/png",
        Some("jpg" | "jpeg") => "image/jpeg",
        Some("webp") => "image/webp",
        Some("gif") => "image/gif",
        _ => "image",
    };
    let payload = base64::engine::general_purpose::STANDARD.encode(bytes);
    Ok(format!("data:{media_type};base64,{payload}"))
}

/// vLLM's in-place reload does not re-tie a tied `lm_head` to the embedding it reloads (it
/// logs "ParallelLMHead: Failed to load weights" and keeps the old head), so a tied policy's
/// head goes to the servers as a tensor of its own, in a file beside the model's.
fn untied_lm_head(policy: &dyn PolicyModel, dir: &std::path::Path) -> oxrl_models::Result<()> {
    let params = policy.named_parameters()?;
    if params.iter().any(|(name, _)| name == "lm_head.weight") {
        return Ok(());
    }
    let Some((_, embed)) = params
        .into_iter()
        .find(|(name, _)| name.ends_with("embed_tokens.weight"))
    else {
        return Ok(());
    };
    let head = std::collections::HashMap::from([("lm_head.weight".to_string(), embed)]);
    save_safetensors_synced(&head, &dir.join("lm_head.safetensors"))
}

/// A `/v1/completions` answer (`choices[i].{index, token_ids, logprobs.token_logprobs,
/// finish_reason, weight_versions}`, in any order) in the token route's shape.
fn token_route_shape(answer: &Value) -> Value {
    let mut choices: Vec<Value> = answer
        .get("choices")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    choices.sort_by_key(|c| c.get("index").and_then(Value::as_u64).unwrap_or(0));
    let choices: Vec<Value> = choices
        .into_iter()
        .map(|c| {
            let content: Vec<Value> = c
                .pointer("/logprobs/token_logprobs")
                .and_then(Value::as_array)
                .map(|lps| lps.iter().map(|lp| json!({ "logprob": lp })).collect())
                .unwrap_or_default();
            json!({
                "index": c.get("index"),
                "finish_reason": c.get("finish_reason"),
                "token_ids": c.get("token_ids"),
                "logprobs": {"content": content},
                "weight_versions": c.get("weight_versions"),
            })
        })
        .collect();
    json!({ "choices": choices })
}

/// The version name oxrl gives vLLM (`v3`), and back.
fn version_name(v: WeightVersion) -> String {
    v.to_string()
}

/// The oldest weight version that sampled any token of a choice (`weight_versions`), if the
/// server reported them in oxrl's names.
fn sampled_version(choice: &Value) -> Option<WeightVersion> {
    choice
        .get("weight_versions")?
        .as_array()?
        .iter()
        .filter_map(|span| {
            span.get("version")?
                .as_str()?
                .strip_prefix('v')?
                .parse()
                .ok()
        })
        .min()
        .map(WeightVersion)
}

/// The seed of prompt `index`'s request: vLLM takes a signed 64-bit seed.
fn request_seed(seed: u64, index: usize) -> i64 {
    (seed.wrapping_add(index as u64) & (i64::MAX as u64)) as i64
}

fn shorten(s: &str) -> String {
    match s.char_indices().nth(300) {
        Some((i, _)) => format!("{}…", &s[..i]),
        None => s.to_string(),
    }
}

impl Engine for VllmEngine {
    fn weight_version(&self) -> WeightVersion {
        self.version
    }

    /// Per server since the last call: `server_latency_s/<url>` (mean seconds per answered
    /// request) and `server_errors/<url>` (failed attempts, retried or not).
    fn take_metrics(&mut self) -> std::collections::BTreeMap<String, f64> {
        let mut stats = self.stats.lock().unwrap_or_else(|e| e.into_inner());
        let mut m = std::collections::BTreeMap::new();
        for (url, s) in self.spec.server_urls.iter().zip(stats.iter_mut()) {
            let (answered, seconds, failed) = std::mem::take(s);
            if answered > 0 {
                m.insert(format!("server_latency_s/{url}"), seconds / answered as f64);
            }
            m.insert(format!("server_errors/{url}"), failed as f64);
        }
        m
    }

    fn sync_weights(&mut self, policy: &dyn PolicyModel, version: WeightVersion) -> Result<()> {
        // Checked before any I/O; the engine takes the version only once the servers have it.
        let mut next = self.version;
        next.advance_to(version)?;
        if self.follower {
            self.version = next;
            return Ok(());
        }
        match self.spec.sync {
            WeightSync::None => return Ok(()),
            WeightSync::Disk => {
                let side_files = self.checkpoint_files.as_deref();
                policy.save_with(&self.sync_dir, side_files, MAX_SHARD_BYTES, &|dir| {
                    untied_lm_head(policy, dir)
                })?;
                self.reload_all(&self.sync_dir, version)?;
            }
            WeightSync::Nccl => self.broadcast_all(policy, version)?,
        }
        self.version = next;
        Ok(())
    }

    fn generate_with_images(
        &mut self,
        prompts: &[Vec<u32>],
        images: &PromptImages,
        params: &SamplingParams,
    ) -> Result<Vec<Vec<Completion>>> {
        if !params.stop_strings.is_empty() && self.tokenizer.is_none() {
            return Err(EngineError::InvalidRequest(
                "stop strings need a tokenizer, and the model has no tokenizer.json".into(),
            ));
        }
        // No image lists at all: text prompts.
        if !images.is_empty() && images.len() != prompts.len() {
            return Err(EngineError::InvalidRequest(format!(
                "{} image lists for {} prompts",
                images.len(),
                prompts.len()
            )));
        }
        let prompts = prompts
            .iter()
            .enumerate()
            .map(|(i, ids)| {
                let images = images.get(i).map_or(&[][..], Vec::as_slice);
                self.remote_prompt(ids, images).map_err(|e| match e {
                    EngineError::InvalidRequest(m) => {
                        EngineError::InvalidRequest(format!("prompt {i}: {m}"))
                    }
                    other => other,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let prompts = &prompts;
        let servers = self.spec.server_urls.len();
        let this = &*self;
        // A bounded pool: at most MAX_REQUESTS_IN_FLIGHT per server, each taking the next
        // prompt; prompt `i` still goes to server `i % servers` (its group's prefix cache).
        let next = std::sync::atomic::AtomicUsize::new(0);
        let failed = std::sync::atomic::AtomicBool::new(false);
        let workers = prompts.len().min(MAX_REQUESTS_IN_FLIGHT * servers);
        let answers: Vec<(usize, Result<Vec<Completion>>)> = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..workers)
                .map(|_| {
                    let (next, failed) = (&next, &failed);
                    scope.spawn(move || {
                        use std::sync::atomic::Ordering::Relaxed;
                        let mut done = Vec::new();
                        // The first failure fails the step: stop taking prompts.
                        while !failed.load(Relaxed) {
                            let i = next.fetch_add(1, Relaxed);
                            let Some(prompt) = prompts.get(i) else {
                                return done;
                            };
                            let answer = this
                                .generate_one(i % servers, prompt, i, params)
                                .and_then(|a| this.completions(&a, params));
                            if answer.is_err() {
                                failed.store(true, Relaxed);
                            }
                            done.push((i, answer));
                        }
                        done
                    })
                })
                .collect();
            handles
                .into_iter()
                .flat_map(|h| {
                    h.join().unwrap_or_else(|_| {
                        vec![(
                            usize::MAX,
                            Err(EngineError::InvalidRequest(
                                "a request thread panicked".into(),
                            )),
                        )]
                    })
                })
                .collect()
        });
        let mut ordered: Vec<Option<Vec<Completion>>> = vec![None; prompts.len()];
        for (i, answer) in answers {
            let completions = answer?;
            ordered[i] = Some(completions);
        }
        ordered
            .into_iter()
            .enumerate()
            .map(|(i, c)| {
                c.ok_or_else(|| EngineError::InvalidRequest(format!("prompt {i} got no answer")))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::SamplerConfig;

    fn engine() -> VllmEngine {
        VllmEngine {
            spec: VllmSpec {
                server_urls: vec!["http://a".into(), "http://b".into()],
                sync: WeightSync::Disk,
                sync_dir: None,
                timeout: Duration::from_secs(1),
                max_retries: 0,
                backoff: Duration::from_millis(1),
            },
            sync_dir: PathBuf::from("/tmp/x"),
            agent: ureq::agent(),
            tokenizer: None,
            eos_token_ids: vec![7],
            version: WeightVersion(2),
            stats: std::sync::Mutex::new(vec![(0, 0.0, 0); 2]),
            use_completions: Default::default(),
            broadcaster: Default::default(),
            nccl_joined: false,
            follower: false,
            image_token_id: Some(9),
            checkpoint_files: None,
        }
    }

    #[test]
    fn a_request_carries_every_sampling_setting_and_the_eos_ids() {
        let params = SamplingParams {
            n: 4,
            max_new_tokens: 9,
            sampler: SamplerConfig {
                temperature: 0.7,
                top_k: 5,
                top_p: 0.9,
                min_p: 0.05,
            },
            seed: 11,
            stop_token_ids: vec![3],
            stop_strings: Vec::new(),
            ignore_eos: false,
            first_prompt: 0,
        };
        let prompt = RemotePrompt {
            ids: vec![1, 2],
            content_parts: Vec::new(),
        };
        let body = engine().request_body(&prompt, 2, &params);
        let sp = &body["sampling_params"];
        assert_eq!(body["token_ids"], json!([1, 2]));
        assert_eq!(sp["n"], 4);
        assert_eq!(sp["max_tokens"], 9);
        assert_eq!(sp["top_k"], 5);
        assert_eq!(sp["seed"], 13);
        assert_eq!(sp["stop_token_ids"], json!([3, 7]));
        assert_eq!(sp["logprobs"], 0);
        assert!((sp["temperature"].as_f64().unwrap() - 0.7).abs() < 1e-6);
    }

    #[test]
    fn answers_become_completions_stamped_with_the_sampling_version() {
        let answer = json!({"choices": [
            {"index": 0, "finish_reason": "stop", "token_ids": [5, 7],
             "logprobs": {"content": [{"token_id": 5, "logprob": -0.5}, {"token_id": 7, "logprob": -1.5}]},
             "weight_versions": [{"version": "v3", "start": 0, "end": 2}]},
            {"index": 1, "finish_reason": "length", "token_ids": [6],
             "logprobs": {"content": [{"token_id": 6, "logprob": -2.0}]},
             "weight_versions": null}
        ]});
        let params = SamplingParams {
            n: 2,
            ..SamplingParams::default()
        };
        let c = engine().completions(&answer, &params).unwrap();
        assert_eq!(c[0].response_ids, vec![5, 7]);
        assert_eq!(c[0].logprobs, vec![-0.5, -1.5]);
        assert_eq!(c[0].finish_reason, FinishReason::Stop);
        assert_eq!(c[0].weight_version, WeightVersion(3));
        assert_eq!(c[1].finish_reason, FinishReason::Length);
        assert_eq!(
            c[1].weight_version,
            WeightVersion(2),
            "no stamp: the engine's version"
        );
        let short = json!({"choices": [answer["choices"][0].clone()]});
        assert!(engine().completions(&short, &params).is_err());
    }

    #[test]
    fn a_stop_string_cuts_the_answer_where_the_local_engine_stops() {
        let tok =
            Tokenizer::from_dir(&oxrl_fixtures::repo().join("examples/arithmetic/policy")).unwrap();
        let ids = tok.encode("12\n34").unwrap();
        let mut c = Completion {
            text: Some(tok.decode(&ids, true).unwrap()),
            logprobs: vec![-0.5; ids.len()],
            response_ids: ids.clone(),
            finish_reason: FinishReason::Length,
            weight_version: WeightVersion(0),
            episode: None,
        };
        cut_at_stop_string(&mut c, &["\n".to_string()], &tok).unwrap();
        assert_eq!(c.text.as_deref(), Some("12"));
        assert_eq!(c.finish_reason, FinishReason::Stop);
        let upto = tok.encode("12\n").unwrap().len();
        assert_eq!(
            c.response_ids,
            ids[..upto].to_vec(),
            "the stop token is kept"
        );
        assert_eq!(c.logprobs.len(), upto);
        let mut none = c.clone();
        cut_at_stop_string(&mut none, &["#".to_string()], &tok).unwrap();
        assert_eq!(none, c, "no stop string, no change");
    }

    #[test]
    fn an_image_prompt_goes_with_one_pad_per_image_and_its_pictures_as_data_urls() {
        let dir = oxrl_fixtures::temp_dir("vllm-image-url");
        let png = dir.join("a.png");
        std::fs::write(&png, [1u8, 2, 3]).unwrap();
        let image = |source: Option<String>| PromptImage {
            pixels: Arc::new(oxrl_models::image::ProcessedImage {
                pixel_values: Vec::new(),
                grid_thw: [1, 2, 2],
            }),
            source,
        };
        let images = [
            image(Some(png.display().to_string())),
            image(Some("data:image/jpeg;base64,AAAA".into())),
        ];
        let ids = [1, 8, 9, 9, 9, 9, 4, 8, 9, 9, 4, 5];
        let prompt = engine().remote_prompt(&ids, &images).unwrap();
        assert_eq!(prompt.ids, vec![1, 8, 9, 4, 8, 9, 4, 5]);
        assert_eq!(
            prompt.content_parts,
            vec![
                json!({"type": "image_url", "url": "data:image/png;base64,AQID"}),
                json!({"type": "image_url", "url": "data:image/jpeg;base64,AAAA"}),
            ]
        );
        let body = engine().request_body(&prompt, 0, &SamplingParams::default());
        assert_eq!(body["content_parts"], json!(prompt.content_parts));
        let text = engine().request_body(
            &engine().remote_prompt(&ids, &[]).unwrap(),
            0,
            &SamplingParams::default(),
        );
        assert!(text.get("content_parts").is_none());

        let one = engine().remote_prompt(&ids, &images[..1]).unwrap_err();
        assert!(
            one.to_string()
                .contains("2 image placeholders for 1 images"),
            "{one}"
        );
        let unsaved = engine()
            .remote_prompt(&[8, 9, 4], &[image(None)])
            .unwrap_err();
        assert!(unsaved.to_string().contains("made in memory"), "{unsaved}");
    }

    #[test]
    fn a_choice_spanning_two_versions_is_as_old_as_its_oldest_token() {
        let c = json!({"weight_versions": [{"version": "v4"}, {"version": "v3"}]});
        assert_eq!(sampled_version(&c), Some(WeightVersion(3)));
        assert_eq!(request_seed(u64::MAX, 1), 0);
    }
}
