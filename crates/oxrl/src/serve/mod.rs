//! `oxrl serve`: an OpenAI-compatible server over the continuous-batching engine, with vLLM's
//! token route and weight-reload routes so that a training run's `backend = "vllm"` can sample
//! from it.
//!
//! One thread per connection parses and answers; one scheduler thread owns the model and steps
//! the batch that every connection's prompts join.

mod http;
mod metrics;
mod openai;
mod scheduler;
mod token_route;

use crate::load::{load, DTypeArg, ModelArgs};
use crate::output::say;
use anyhow::{Context, Result};
use http::{read_json, respond_json, respond_text, ApiError, EventStream};
use metrics::ServeMetrics;
use openai::{Options, Route, TextStream};
use oxrl_models::image::{prompt_image_sources, ImageSource};
use oxrl_models::{DeviceSpec, Tokenizer};
use oxrl_rollout::{Batcher, Completion, VersionSpan};
use scheduler::{Event, Prompt, Scheduler};
use serde_json::{json, Map, Value};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

#[derive(clap::Args)]
pub struct ServeArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// The name clients give as `model`; the `--model` argument when absent.
    #[arg(long)]
    served_model_name: Option<String>,
    #[arg(long, value_enum, default_value = "f32")]
    dtype: DTypeArg,
    /// Where the model runs: cpu, cuda or cuda:N (a GPU needs a build with `--features cuda`).
    #[arg(long, default_value_t = DeviceSpec::Cpu)]
    device: DeviceSpec,
    /// Most sequences decoded together; more requests wait in the queue.
    #[arg(long, default_value_t = 256)]
    max_num_seqs: usize,
    /// Most prompt tokens prefilled in one step.
    #[arg(long, default_value_t = 8192)]
    max_prefill_tokens: usize,
    /// Most requests handled at once; more are answered 503.
    #[arg(long, default_value_t = 1024)]
    max_connections: usize,
    /// A directory whose images chat requests may name by path (or `file://` URL); without it,
    /// only data URLs are taken.
    #[arg(long)]
    allowed_media_dir: Option<PathBuf>,
    /// Serve the weight-reload control routes (`/pause`, `/resume`, `/collective_rpc`
    /// `reload_weights`, `/update_weight_version`), as vLLM does with `VLLM_SERVER_DEV_MODE=1`:
    /// they let any client load weights from the server's disk.
    #[arg(long)]
    control_routes: bool,
}

/// What every connection thread shares.
struct Server {
    name: String,
    scheduler: Scheduler,
    tokenizer: Option<Arc<Tokenizer>>,
    context: usize,
    metrics: Arc<ServeMetrics>,
    media_dir: Option<PathBuf>,
    control_routes: bool,
    next_id: AtomicU64,
    started: u64,
}

pub fn run(args: ServeArgs) -> Result<()> {
    let loaded = load(&args.model, args.dtype, args.device)?;
    let media_dir = match &args.allowed_media_dir {
        Some(d) => Some(
            d.canonicalize()
                .with_context(|| format!("--allowed-media-dir {}", d.display()))?,
        ),
        None => None,
    };
    let context = loaded.model.max_positions();
    let mut batcher = Batcher::new(loaded.model, loaded.tokenizer.clone(), loaded.eos_token_ids);
    batcher.max_num_seqs = args.max_num_seqs.max(1);
    batcher.max_prefill_tokens = args.max_prefill_tokens.max(1);
    let metrics = Arc::new(ServeMetrics::default());
    let scheduler = Scheduler::start(batcher, args.dtype.dtype(), metrics.clone())?;
    let address = format!("{}:{}", args.host, args.port);
    let listener = tiny_http::Server::http(&address)
        .map_err(|e| anyhow::anyhow!("listening on {address}: {e}"))?;
    let bound = listener
        .server_addr()
        .to_ip()
        .map_or(address.clone(), |a| a.to_string());
    let server = Arc::new(Server {
        name: args.served_model_name.unwrap_or(args.model.model.clone()),
        scheduler,
        tokenizer: loaded.tokenizer,
        context,
        metrics,
        media_dir,
        control_routes: args.control_routes,
        next_id: AtomicU64::new(0),
        started: unix_seconds(),
    });
    say!(
        "serving {} on http://{bound} (OpenAI routes under /v1, token route \
         /inference/v1/generate{}, metrics /metrics)",
        server.name,
        if args.control_routes {
            ", weight-reload routes"
        } else {
            ""
        }
    )?;
    let open = Arc::new(AtomicUsize::new(0));
    for request in listener.incoming_requests() {
        if open.load(Relaxed) >= args.max_connections {
            refuse_busy(request, args.max_connections);
            continue;
        }
        open.fetch_add(1, Relaxed);
        let (server, held) = (server.clone(), open.clone());
        let spawned = std::thread::Builder::new()
            .name("connection".into())
            .spawn(move || {
                server.handle(request);
                held.fetch_sub(1, Relaxed);
            });
        if let Err(e) = spawned {
            // The request went down with the closure (its client sees the connection close).
            open.fetch_sub(1, Relaxed);
            oxrl_train::note!("serve: could not start a connection thread: {e}");
        }
    }
    Ok(())
}

/// Answers 503 on a thread of its own: once answered, tiny_http drains the rest of the request's
/// body, and a client that never sends it would otherwise stop the accept loop for everyone.
fn refuse_busy(request: tiny_http::Request, limit: usize) {
    let e = ApiError {
        status: 503,
        message: format!("the server is handling {limit} requests, its limit (--max-connections)"),
        param: None,
    };
    let refused = std::thread::Builder::new()
        .name("refusal".into())
        .spawn(move || respond_json(request, 503, &e.body()));
    if let Err(e) = refused {
        // The request went down with the closure (its client sees the connection close).
        oxrl_train::note!("serve: could not start a thread to refuse a request: {e}");
    }
}

fn unix_seconds() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

impl Server {
    fn handle(&self, mut request: tiny_http::Request) {
        let arrived = Instant::now();
        let method = request.method().as_str().to_string();
        let url = request.url().to_string();
        let (path, query) = url.split_once('?').unwrap_or((&url, ""));
        let path = path.to_string();
        let query = query.to_string();
        let route = self.route_name(&path);
        let status = match (method.as_str(), path.as_str()) {
            ("GET", "/health") => {
                respond_text(request, 200, "text/plain", String::new());
                200
            }
            ("GET", "/metrics") => {
                respond_text(
                    request,
                    200,
                    "text/plain; version=0.0.4",
                    self.metrics.exposition(),
                );
                200
            }
            ("GET", "/v1/models") => {
                respond_json(request, 200, &self.models());
                200
            }
            ("POST", "/v1/completions" | "/v1/chat/completions" | "/inference/v1/generate") => {
                match read_json(&mut request) {
                    Err(e) => self.fail(request, &e),
                    Ok(body) => {
                        let body = body.as_object().cloned().unwrap_or_default();
                        match path.as_str() {
                            "/inference/v1/generate" => self.generate_tokens(request, &body),
                            "/v1/completions" => {
                                self.openai(request, Route::Completions, &body, arrived)
                            }
                            _ => self.openai(request, Route::Chat, &body, arrived),
                        }
                    }
                }
            }
            (
                "POST" | "GET",
                "/pause" | "/resume" | "/is_paused" | "/collective_rpc" | "/update_weight_version",
            ) => self.control(request, &path, &query),
            (
                _,
                "/health"
                | "/metrics"
                | "/v1/models"
                | "/v1/completions"
                | "/v1/chat/completions"
                | "/inference/v1/generate",
            ) => {
                let e = ApiError {
                    status: 405,
                    message: format!("{path} does not take {method}"),
                    param: None,
                };
                self.fail(request, &e)
            }
            _ => self.fail(request, &ApiError::not_found(format!("no route {path}"))),
        };
        self.metrics.answered(route, status);
        if path != "/metrics" && path != "/health" {
            self.metrics
                .latency
                .observe(arrived.elapsed().as_secs_f64());
        }
    }

    /// The route label of a path in the metrics; unknown paths share one, so scanners cannot
    /// grow the label set.
    fn route_name(&self, path: &str) -> &'static str {
        const KNOWN: [&str; 11] = [
            "/health",
            "/metrics",
            "/v1/models",
            "/v1/completions",
            "/v1/chat/completions",
            "/inference/v1/generate",
            "/pause",
            "/resume",
            "/is_paused",
            "/collective_rpc",
            "/update_weight_version",
        ];
        KNOWN.into_iter().find(|k| *k == path).unwrap_or("other")
    }

    fn fail(&self, request: tiny_http::Request, e: &ApiError) -> u16 {
        respond_json(request, e.status, &e.body());
        e.status
    }

    fn models(&self) -> Value {
        json!({"object": "list", "data": [{
            "id": self.name,
            "object": "model",
            "created": self.started,
            "owned_by": "oxrl",
            "max_model_len": self.context,
        }]})
    }

    fn next_id(&self, prefix: &str) -> String {
        let n = self.next_id.fetch_add(1, Relaxed);
        format!("{prefix}-{n}-{:08x}", rand::random::<u32>())
    }

    fn check_model(&self, body: &Map<String, Value>) -> Result<(), ApiError> {
        match body.get("model").and_then(Value::as_str) {
            Some(m) if m != self.name => Err(ApiError::not_found(format!(
                "The model `{m}` does not exist: this server serves `{}`",
                self.name
            ))),
            _ => Ok(()),
        }
    }

    fn tokenizer(&self) -> Result<&Tokenizer, ApiError> {
        self.tokenizer.as_deref().ok_or_else(|| {
            ApiError::bad_request(
                "the model has no tokenizer.json: send token ids to /inference/v1/generate",
            )
        })
    }

    /// A chat request's prompt: its messages through the chat template, its images processed
    /// and their pads expanded.
    fn chat_prompt(&self, body: &Map<String, Value>) -> Result<Prompt, ApiError> {
        let tok = self.tokenizer()?;
        let messages = body
            .get("messages")
            .filter(|m| m.as_array().is_some_and(|a| !a.is_empty()))
            .ok_or_else(|| ApiError::field("messages", "expected a non-empty list of messages"))?;
        let base = self.media_dir.clone().unwrap_or_default();
        let sources = prompt_image_sources(None, Some(messages), &base)
            .map_err(|e| ApiError::field("messages", e))?;
        self.check_media(&sources, "messages")?;
        let kwargs = openai::template_kwargs(body)?;
        let text = tok
            .apply_chat_template(&image_placeholders(messages), true, &kwargs)
            .map_err(|e| ApiError::field("messages", e))?;
        let ids = tok
            .encode(&text)
            .map_err(|e| ApiError::field("messages", e))?;
        self.with_images(ids, &sources, "messages")
    }

    /// A prompt with its images (checked by [`Self::check_media`]) processed and their pads
    /// expanded; `field` is what errors name.
    fn with_images(
        &self,
        ids: Vec<u32>,
        sources: &[ImageSource],
        field: &str,
    ) -> Result<Prompt, ApiError> {
        if sources.is_empty() {
            return Ok(Prompt {
                ids,
                images: Vec::new(),
            });
        }
        let model = self.scheduler.model();
        let images = model
            .prepare_images(sources)
            .map_err(|e| ApiError::field(field, e))?;
        let ids = model
            .expand_image_pads(&ids, &images)
            .map_err(|e| ApiError::field(field, e))?;
        Ok(Prompt { ids, images })
    }

    /// Images named by path must lie in `--allowed-media-dir`.
    fn check_media(&self, sources: &[ImageSource], field: &str) -> Result<(), ApiError> {
        sources
            .iter()
            .try_for_each(|source| self.check_one_medium(source, field))
    }

    fn check_one_medium(&self, source: &ImageSource, field: &str) -> Result<(), ApiError> {
        let ImageSource::Path(path) = source else {
            return Ok(());
        };
        let Some(dir) = &self.media_dir else {
            return Err(ApiError::field(
                field,
                "images by path need the server started with --allowed-media-dir; send a data \
                 URL instead",
            ));
        };
        match path.canonicalize() {
            Ok(p) if p.starts_with(dir) => Ok(()),
            Ok(_) => Err(ApiError::field(
                field,
                format!("{} is outside --allowed-media-dir", path.display()),
            )),
            Err(e) => Err(ApiError::field(field, format!("{}: {e}", path.display()))),
        }
    }

    /// The prompts and settings of an OpenAI request, checked and ready to queue.
    fn prepare(
        &self,
        route: Route,
        body: &Map<String, Value>,
    ) -> Result<(Vec<Prompt>, Options), ApiError> {
        self.check_model(body)?;
        let mut options = openai::options(route, body)?;
        let prompts = match route {
            Route::Completions => openai::completion_prompts(body, self.tokenizer()?)?
                .into_iter()
                .map(|ids| Prompt {
                    ids,
                    images: Vec::new(),
                })
                .collect(),
            Route::Chat => vec![self.chat_prompt(body)?],
        };
        let longest = prompts.iter().map(|p| p.ids.len()).max().unwrap_or(0);
        options.settle_length(longest, self.context)?;
        self.scheduler
            .validate(&prompts, &options.params)
            .map_err(|e| ApiError::bad_request(e.to_string()))?;
        Ok((prompts, options))
    }

    fn openai(
        &self,
        request: tiny_http::Request,
        route: Route,
        body: &Map<String, Value>,
        arrived: Instant,
    ) -> u16 {
        let (prompts, options) = match self.prepare(route, body) {
            Ok(p) => p,
            Err(e) => return self.fail(request, &e),
        };
        let prompt_tokens: usize = prompts.iter().map(|p| p.ids.len()).sum();
        let n_prompts = prompts.len();
        self.metrics
            .prompt_tokens
            .fetch_add(prompt_tokens as u64, Relaxed);
        let events = match self.scheduler.submit(prompts, options.params.clone()) {
            Ok(e) => e,
            Err(e) => return self.fail(request, &ApiError::internal(e.to_string())),
        };
        let job = Job {
            route,
            id: self.next_id(match route {
                Route::Completions => "cmpl",
                Route::Chat => "chatcmpl",
            }),
            created: unix_seconds(),
            n: options.params.n,
            total: n_prompts * options.params.n,
            prompt_tokens,
            options,
            arrived,
        };
        if job.options.stream {
            self.stream(request, &job, events)
        } else {
            self.answer(request, &job, events)
        }
    }

    fn answer(
        &self,
        request: tiny_http::Request,
        job: &Job,
        events: std::sync::mpsc::Receiver<Event>,
    ) -> u16 {
        let tok = match self.tokenizer() {
            Ok(t) => t,
            Err(e) => return self.fail(request, &e),
        };
        let mut choices: Vec<Option<Value>> = vec![None; job.total];
        let mut completion_tokens = 0;
        let mut first = true;
        for _ in 0..job.total {
            match next_finished(&events, &mut first, job, &self.metrics) {
                Ok((prompt, sample, completion, _)) => {
                    completion_tokens += completion.response_ids.len();
                    let index = prompt * job.n + sample;
                    choices[index] = Some(openai::choice(
                        job.route,
                        index,
                        &completion,
                        tok,
                        job.options.logprobs,
                    ));
                }
                Err(e) => return self.fail(request, &e),
            }
        }
        let mut answer = openai::envelope(job.route, &job.id, job.created, &self.name, false);
        answer["choices"] = Value::Array(choices.into_iter().flatten().collect());
        answer["usage"] = openai::usage(job.prompt_tokens, completion_tokens);
        respond_json(request, 200, &answer);
        200
    }

    /// Streams each sample's text as its tokens arrive; a client that goes away cancels the
    /// request (its sequences leave the batch at the next step).
    fn stream(
        &self,
        request: tiny_http::Request,
        job: &Job,
        events: std::sync::mpsc::Receiver<Event>,
    ) -> u16 {
        let tok = match self.tokenizer() {
            Ok(t) => t,
            Err(e) => return self.fail(request, &e),
        };
        let Ok(mut out) = EventStream::start(request) else {
            return 200;
        };
        let chunk = |index: usize, delta: Value, logprobs: Option<Value>, finish: Option<&str>| {
            let mut c = openai::envelope(job.route, &job.id, job.created, &self.name, true);
            let mut choice = match job.route {
                Route::Completions => json!({"index": index, "text": delta}),
                Route::Chat => json!({"index": index, "delta": delta}),
            };
            choice["logprobs"] = logprobs.unwrap_or(Value::Null);
            choice["finish_reason"] = json!(finish);
            c["choices"] = json!([choice]);
            c
        };
        let text_delta = |text: String| match job.route {
            Route::Completions => Value::String(text),
            Route::Chat => json!({ "content": text }),
        };
        if job.route == Route::Chat {
            for index in 0..job.total {
                let role = chunk(
                    index,
                    json!({"role": "assistant", "content": ""}),
                    None,
                    None,
                );
                if out.send(&role).is_err() {
                    return 200;
                }
            }
        }
        let stops = &job.options.params.stop_strings;
        let mut texts: Vec<TextStream> = (0..job.total).map(|_| TextStream::default()).collect();
        let mut offsets = vec![0usize; job.total];
        let (mut finished, mut completion_tokens, mut first) = (0, 0, true);
        while finished < job.total {
            let sent = match events.recv() {
                Ok(Event::Token {
                    prompt,
                    sample,
                    token,
                    logprob,
                }) => {
                    if std::mem::take(&mut first) {
                        self.metrics
                            .first_token
                            .observe(job.arrived.elapsed().as_secs_f64());
                    }
                    let index = prompt * job.n + sample;
                    let piece = texts[index].push(token, tok, stops);
                    let lp = job.options.logprobs.then(|| {
                        openai::logprobs_value(job.route, tok, &[token], &[logprob], offsets[index])
                    });
                    offsets[index] += piece.len();
                    out.send(&chunk(index, text_delta(piece), lp, None))
                }
                Ok(Event::Finished {
                    prompt,
                    sample,
                    completion,
                    ..
                }) => {
                    let index = prompt * job.n + sample;
                    finished += 1;
                    completion_tokens += completion.response_ids.len();
                    let rest = texts[index].finish(completion.text.as_deref().unwrap_or(""));
                    let finish = completion.finish_reason.as_str();
                    out.send(&chunk(index, text_delta(rest), None, Some(finish)))
                }
                Ok(Event::Failed(message)) => {
                    let _ = out.send(&ApiError::internal(message).body());
                    return 500;
                }
                Err(_) => {
                    let _ = out.send(&ApiError::internal("the scheduler stopped").body());
                    return 500;
                }
            };
            if sent.is_err() {
                // The client went away; dropping `events` cancels the rest.
                return 200;
            }
        }
        if job.options.include_usage {
            let mut c = openai::envelope(job.route, &job.id, job.created, &self.name, true);
            c["choices"] = json!([]);
            c["usage"] = openai::usage(job.prompt_tokens, completion_tokens);
            let _ = out.send(&c);
        }
        let _ = out.finish();
        200
    }

    /// vLLM's `/inference/v1/generate`: token ids in, token ids with log-probs and the weight
    /// versions that sampled them out.
    fn generate_tokens(&self, request: tiny_http::Request, body: &Map<String, Value>) -> u16 {
        let base = self.media_dir.clone().unwrap_or_default();
        let prepared = token_route::request(body, &base).and_then(|request| {
            self.check_media(&request.images, "content_parts")?;
            let prompt = self.with_images(request.ids, &request.images, "content_parts")?;
            let (ids, mut params) = (prompt.ids, request.params);
            if ids.len() >= self.context {
                return Err(ApiError::bad_request(format!(
                    "the prompt has {} tokens; the model's context is {}",
                    ids.len(),
                    self.context
                )));
            }
            params.max_new_tokens = params.max_new_tokens.min(self.context - ids.len());
            let prompts = vec![Prompt {
                ids,
                images: prompt.images,
            }];
            self.scheduler
                .validate(&prompts, &params)
                .map_err(|e| ApiError::bad_request(e.to_string()))?;
            Ok((prompts, params))
        });
        let (prompts, params) = match prepared {
            Ok(p) => p,
            Err(e) => return self.fail(request, &e),
        };
        let n = params.n;
        self.metrics
            .prompt_tokens
            .fetch_add(prompts[0].ids.len() as u64, Relaxed);
        let events = match self.scheduler.submit(prompts, params) {
            Ok(e) => e,
            Err(e) => return self.fail(request, &ApiError::internal(e.to_string())),
        };
        let mut choices: Vec<Option<Value>> = vec![None; n];
        loop {
            match events.recv() {
                Ok(Event::Finished {
                    sample,
                    completion,
                    versions,
                    ..
                }) => {
                    choices[sample] = Some(token_route::choice(sample, &completion, &versions));
                    if choices.iter().all(Option::is_some) {
                        break;
                    }
                }
                Ok(Event::Token { .. }) => {}
                Ok(Event::Failed(m)) => return self.fail(request, &ApiError::internal(m)),
                Err(_) => return self.fail(request, &ApiError::internal("the scheduler stopped")),
            }
        }
        let mut answer = json!({"choices": choices});
        if let Some(id) = body.get("request_id") {
            answer["request_id"] = id.clone();
        }
        respond_json(request, 200, &answer);
        200
    }

    /// The weight-reload routes, vLLM's names and bodies.
    fn control(&self, mut request: tiny_http::Request, path: &str, query: &str) -> u16 {
        if !self.control_routes {
            return self.fail(
                request,
                &ApiError::not_found(format!(
                    "{path} is a control route: start oxrl serve with --control-routes"
                )),
            );
        }
        let body = match path {
            "/collective_rpc" | "/update_weight_version" => match read_json(&mut request) {
                Ok(b) => b.as_object().cloned().unwrap_or_default(),
                Err(e) => return self.fail(request, &e),
            },
            _ => Map::new(),
        };
        let outcome: Result<Value, ApiError> = match path {
            "/pause" => {
                let mode = query
                    .split('&')
                    .find_map(|kv| kv.strip_prefix("mode="))
                    .unwrap_or("keep");
                if mode != "keep" {
                    Err(ApiError::field(
                        "mode",
                        format!(
                            "oxrl serve pauses with mode=keep (running requests wait), not {mode}"
                        ),
                    ))
                } else {
                    self.scheduler
                        .pause()
                        .map(|_| json!({}))
                        .map_err(|e| ApiError::internal(e.to_string()))
                }
            }
            "/resume" => self
                .scheduler
                .resume()
                .map(|_| json!({}))
                .map_err(|e| ApiError::internal(e.to_string())),
            "/is_paused" => Ok(json!({"is_paused": self.scheduler.paused.load(Relaxed)})),
            "/collective_rpc" => token_route::reload_dir(&body).and_then(|dir| {
                self.scheduler
                    .reload(dir)
                    .map(|_| json!({"results": [null]}))
                    .map_err(ApiError::bad_request)
            }),
            _ => token_route::version(&body).and_then(|v| {
                self.scheduler
                    .set_version(v)
                    .map(|_| {
                        self.metrics.weight_version.store(v.0, Relaxed);
                        json!({})
                    })
                    .map_err(ApiError::bad_request)
            }),
        };
        match outcome {
            Ok(answer) => {
                respond_json(request, 200, &answer);
                200
            }
            Err(e) => self.fail(request, &e),
        }
    }
}

/// `messages` with every image item as `{"type": "image"}`, the form Hugging Face chat
/// templates place image pads for (OpenAI clients send `image_url` items, which some templates
/// do not know); the images themselves were taken from the items already.
fn image_placeholders(messages: &Value) -> Value {
    let mut messages = messages.clone();
    for message in messages.as_array_mut().into_iter().flatten() {
        let items = message.get_mut("content").and_then(Value::as_array_mut);
        for item in items.into_iter().flatten() {
            if oxrl_models::image::is_image_item(item) {
                *item = json!({"type": "image"});
            }
        }
    }
    messages
}

/// One OpenAI request in flight.
struct Job {
    route: Route,
    id: String,
    created: u64,
    n: usize,
    /// Prompts × n.
    total: usize,
    prompt_tokens: usize,
    options: Options,
    arrived: Instant,
}

/// The next finished sample of a non-streamed request.
fn next_finished(
    events: &std::sync::mpsc::Receiver<Event>,
    first: &mut bool,
    job: &Job,
    metrics: &ServeMetrics,
) -> Result<(usize, usize, Completion, Vec<VersionSpan>), ApiError> {
    loop {
        match events.recv() {
            Ok(Event::Token { .. }) => {
                if std::mem::take(first) {
                    metrics
                        .first_token
                        .observe(job.arrived.elapsed().as_secs_f64());
                }
            }
            Ok(Event::Finished {
                prompt,
                sample,
                completion,
                versions,
            }) => return Ok((prompt, sample, completion, versions)),
            Ok(Event::Failed(m)) => return Err(ApiError::internal(m)),
            Err(_) => return Err(ApiError::internal("the scheduler stopped")),
        }
    }
}
