//! The HTTP endpoints.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::body::Body;
use axum::extract::State;
use axum::http::{header, HeaderMap, Method, Uri};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use engine::{FinishReason, GenerateRequest, IsolationDomain, Usage};
use serde::de::DeserializeOwned;
use serde_json::{json, Value};
use tracing::Instrument;

use crate::conn::ConnectionControl;
use crate::error::ApiError;
use crate::format::{Api, ResponseMeta};
use crate::generation::{Chunk, Generation, Step};
use crate::reasoning::ReasoningStream;
use crate::tools::stream::ToolStream;
use crate::validation::{self, PromptInput, ServedModel, Settings, ValidChat};
use crate::{body, chat_prompt, AppState, MetricsAccess};

pub fn router(state: Arc<AppState>) -> Router {
    let api = Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route("/lora-adapters", get(lora_adapters))
        .route("/tokenize", post(crate::tokenize::tokenize))
        .route("/detokenize", post(crate::tokenize::detokenize))
        .route("/health", get(health));
    let api = match state.metrics_access {
        MetricsAccess::ApiKeys => api.route("/metrics", get(metrics_behind_keys)),
        MetricsAccess::OwnListener => api,
    };
    api.fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(state)
}

/// `/metrics` alone, for a listener of its own.
pub fn metrics_router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        // Health probes here use capacity that the API's clients cannot take.
        .route("/health", get(health))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(state)
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// A request that passed every check and is in the engine: one generation per choice.
struct Started {
    generations: Vec<Generation>,
    /// Choice 0's first step, taken before the other choices were submitted.
    first_step: Option<Step>,
    meta: ResponseMeta,
    settings: Settings,
    /// The request's place in its tenant's limits, held until the response ends.
    permit: crate::tenants::Permit,
}

/// The connection's controls, when the request came through `conn` (absent in tests that
/// drive the router directly).
type Control = Option<Extension<ConnectionControl>>;

async fn completions(
    State(app): State<Arc<AppState>>,
    control: Control,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let span = crate::trace::request_span("completions", &headers);
    answer(&app, control, start_completion(&app, &headers, body))
        .instrument(span)
        .await
}

async fn chat_completions(
    State(app): State<Arc<AppState>>,
    control: Control,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let span = crate::trace::request_span("chat.completions", &headers);
    answer(&app, control, start_chat(&app, &headers, body))
        .instrument(span)
        .await
}

/// The response to a request once its prologue has run: the generation's, or the refusal.
async fn answer(
    app: &AppState,
    control: Control,
    started: impl std::future::Future<Output = Result<Started, ApiError>>,
) -> Response {
    match started.await {
        Ok(started) => respond(started, control).await,
        Err(e) => refuse(app, e),
    }
}

/// An error before the request reached the engine.
pub(crate) fn refuse(app: &AppState, e: ApiError) -> Response {
    if e.status().is_client_error() {
        app.metrics.rejected(e.code());
    } else {
        app.metrics.outcome(crate::metrics::Outcome::Error);
    }
    e.into_response()
}

/// `settings.cache_salt` is already the fixed-size key of the client's salt.
fn domain_for(tenant: IsolationDomain, settings: &Settings) -> IsolationDomain {
    match &settings.cache_salt {
        Some(salt) => tenant.narrowed(salt.clone()),
        None => tenant,
    }
}

/// The prologue both endpoints share, in this order: authenticate, read the body, decode
/// it, then [`validation`]: every check that needs no model work, before any is spent.
async fn accept<R: DeserializeOwned, V>(
    app: &AppState,
    headers: &HeaderMap,
    body: Body,
    validate: impl FnOnce(&R, &ServedModel<'_>) -> Result<V, ApiError>,
) -> Result<(IsolationDomain, V), ApiError> {
    let tenant = app.auth.authenticate(headers)?;
    crate::trace::record_tenant(tenant.tenant_name());
    async {
        body::require_json(headers)?;
        body::require_known_transfer_encoding(headers)?;
        let bytes = body::read(body, app.max_body_bytes, app.body_timeout).await?;
        let req: R = body::decode(&bytes)?;
        let valid = validate(&req, &ServedModel::of(app, tenant.tenant_name()))?;
        Ok((tenant, valid))
    }
    .instrument(tracing::info_span!("validation"))
    .await
}

async fn start_completion(
    app: &Arc<AppState>,
    headers: &HeaderMap,
    body: Body,
) -> Result<Started, ApiError> {
    let (tenant, req) = accept(app, headers, body, validation::completion).await?;
    // The tenant's place is taken before any work on the prompt, so the work counts
    // against the tenant (and a request refused after it still counted while it ran).
    let permit = app.tenants.acquire(tenant.tenant_name(), 0)?;
    let constraint = compile_constraint(app, &tenant, &req.settings).await?;
    let prompt = match req.prompt {
        PromptInput::Tokens(t) => t,
        PromptInput::Text(text) => {
            app.backend
                .admission()
                .check_text_length(text.len(), app.max_bytes_per_token, req.settings.max_tokens)
                .map_err(|rejection| ApiError::rejected(rejection, "prompt"))?;
            let tok = app.tokenizer.clone();
            // The whole prompt is the client's own: control-token text is parsed, so
            // clients can format their own turns. The BOS the model expects goes in front
            // (token-id prompts are taken as they are, as llama.cpp does).
            app.prompt_workers
                .run(tenant.tenant_name(), move |cancel| {
                    tok.encode_cancellable(&text, &|| cancel.is_cancelled())
                        .map(|t| tok.with_bos(t))
                        .ok_or(ApiError::Abandoned)
                })
                .await?
        }
    };
    start(
        app,
        Caller { tenant, permit },
        Prepared {
            prompt,
            constraint,
            tools: None,
            thinking: None,
        },
        req.settings,
        req.logprobs,
        Api::Completion,
        "prompt",
    )
    .await
}

async fn start_chat(
    app: &Arc<AppState>,
    headers: &HeaderMap,
    body: Body,
) -> Result<Started, ApiError> {
    let (
        tenant,
        ValidChat {
            mut settings,
            logprobs,
            messages,
            template,
            tools,
            template_variables,
        },
    ) = accept(app, headers, body, validation::chat).await?;
    let permit = app.tenants.acquire(tenant.tenant_name(), 0)?;
    let tok = app.tokenizer.clone();
    let admission = *app.backend.admission();
    let (per_token, max_tokens) = (app.max_bytes_per_token, settings.max_tokens);
    // The rendered conversation is what is tokenized: its length bounds the tokens from
    // below, whatever the template did to the contents.
    let fits = move |bytes: usize| {
        admission
            .check_text_length(bytes, per_token, max_tokens)
            .map_err(|rejection| ApiError::rejected(rejection, "messages"))
    };
    let tools = tools.map(Arc::new);
    let rendered_tools = tools
        .as_ref()
        .filter(|t| t.format.template_renders_tools())
        .map(|t| t.declared.clone());
    let reasoning = app.reasoning_format;
    let (prompt, thinking) = app
        .prompt_workers
        .run(tenant.tenant_name(), move |cancel| {
            let chat = chat_prompt::ChatInput {
                messages: &messages,
                tools: rendered_tools.as_ref(),
                variables: template_variables.as_ref(),
            };
            let rendered = chat_prompt::render_prompt(&tok, &template, &chat, &fits, cancel)?;
            let thinking = reasoning.for_prompt(template.source(), &rendered.skeleton);
            Ok((tok.with_bos(rendered.tokens), thinking))
        })
        .await?;
    // A thinking model thinks first: a JSON schema or a forced call holds the answer after
    // its thoughts, as vLLM's reasoning-aware structured outputs do. A regular expression,
    // a choice or a grammar describes the whole text, thoughts included where wanted.
    if let (Some(thinking), Some(requested)) = (thinking, settings.constraint.as_mut()) {
        if crate::structured::describes_answer_only(requested) {
            requested.spec = constraint::ConstraintSpec::AfterThoughts {
                opened: thinking.starts_inside,
                answer: Box::new(requested.spec.clone()),
            };
        }
    }
    let constraint = compile_constraint(app, &tenant, &settings).await?;
    start(
        app,
        Caller { tenant, permit },
        Prepared {
            prompt,
            constraint,
            tools,
            thinking,
        },
        settings,
        logprobs,
        Api::Chat,
        "messages",
    )
    .await
}

/// Hands one admitted choice to the backend: a refusal is the request's error status.
async fn submit(
    app: &Arc<AppState>,
    admitted: engine::Admitted,
    input_param: &'static str,
) -> Result<engine::RequestHandle, ApiError> {
    // A client that leaves while a cluster places its request was still cancelled: once
    // the future resolves, the generation (or the refusal) records the outcome instead.
    let leaving = CancelledWhileSubmitting(Some(app.metrics.clone()));
    let submitted = app.backend.clone().submit(admitted).await;
    leaving.disarm();
    submitted.map_err(|e| match e {
        crate::SubmitError::Rejected(rejection) => ApiError::rejected(rejection, input_param),
        crate::SubmitError::Failed(e) => e,
    })
}

/// Records a cancelled request when dropped armed.
struct CancelledWhileSubmitting(Option<Arc<crate::metrics::ServerMetrics>>);

impl CancelledWhileSubmitting {
    fn disarm(mut self) {
        self.0 = None;
    }
}

impl Drop for CancelledWhileSubmitting {
    fn drop(&mut self) {
        if let Some(metrics) = self.0.take() {
            metrics.outcome(crate::metrics::Outcome::Cancelled);
        }
    }
}

/// Admission, then submission: a rejected request never reaches the engine.
/// Who sent a request, and its place in that tenant's limits (taken before its prompt was
/// prepared).
struct Caller {
    tenant: IsolationDomain,
    permit: crate::tenants::Permit,
}

/// A structured output's constraint compiled for this request alone, on the prompt
/// workers (bounded by `constraint::limits`, and counted against the tenant like its
/// prompt). Nothing compiled is cached: a cache shared between tenants would tell one
/// tenant, by its speed, which schemas another had sent.
async fn compile_constraint(
    app: &Arc<AppState>,
    tenant: &IsolationDomain,
    settings: &Settings,
) -> Result<Option<constraint::RowConstraint>, ApiError> {
    let Some(requested) = settings.constraint.clone() else {
        return Ok(None);
    };
    let vocabulary = app.vocabulary.clone();
    let metrics = app.metrics.clone();
    app.prompt_workers
        .run(tenant.tenant_name(), move |_| {
            let started = Instant::now();
            let compiled = vocabulary.compile(&requested.spec);
            metrics.constraint_compile.observe(started.elapsed());
            compiled
                .map(Some)
                .map_err(|e| crate::structured::compile_error(requested.param, &e))
        })
        .await
}

/// What the prompt workers made of a request: its tokens and its compiled constraint,
/// and the tools its answer is parsed for.
struct Prepared {
    prompt: Vec<u32>,
    constraint: Option<constraint::RowConstraint>,
    tools: Option<Arc<crate::tools::ToolCalling>>,
    /// Where the answer's thoughts are, for a thinking model's chat answer.
    thinking: Option<crate::reasoning::Thinking>,
}

async fn start(
    app: &Arc<AppState>,
    Caller { tenant, mut permit }: Caller,
    Prepared {
        prompt,
        constraint,
        tools,
        thinking,
    }: Prepared,
    settings: Settings,
    logprobs: Option<usize>,
    api: Api,
    input_param: &'static str,
) -> Result<Started, ApiError> {
    let admission = app.backend.admission();
    let prompt_tokens = prompt.len();
    let max_tokens = settings
        .max_tokens
        .unwrap_or_else(|| admission.default_max_tokens(prompt_tokens));
    let domain = domain_for(tenant, &settings);
    let admission_span = tracing::info_span!("admission");
    let entered = admission_span.enter();
    let mut admitted = Vec::with_capacity(settings.n);
    for choice in 0..settings.n {
        let mut sampling = settings.sampling.clone();
        sampling.seed = validation::choice_seed(sampling.seed, choice);
        let request = GenerateRequest {
            adapter: settings.adapter.clone(),
            weight: app.auth.weight_of(domain.tenant_name()),
            domain: domain.clone(),
            prompt: prompt.clone(),
            max_tokens,
            sampling,
            ignore_eos: settings.ignore_eos,
            logprobs,
            // A deep copy: each choice's parser advances by its own tokens only.
            constraint: constraint.clone(),
        };
        admitted.push(
            admission
                .admit(request)
                .map_err(|rejection| ApiError::rejected(rejection, input_param))?,
        );
    }
    // The tokens they may occupy, once admission has counted them, before the backend
    // sees them.
    permit.add_tokens(
        prompt_tokens
            .saturating_add(max_tokens)
            .saturating_mul(settings.n),
    )?;
    drop(entered);
    let admitted_at = Instant::now();
    let mut admitted = admitted.into_iter();
    let Some(first) = admitted.next() else {
        return Err(ApiError::Internal("a request with no choices".into()));
    };
    let adapter: Option<Arc<str>> = first.request().adapter.as_ref().map(|a| a.name().into());
    let handle = submit(app, first, input_param).await?;
    // Once per request, however many choices (`n`) it asks for; each choice's generated
    // tokens are counted when it ends.
    if let Some(name) = &adapter {
        app.metrics.adapter_request(name, prompt_tokens);
    }
    let id = match api {
        Api::Chat => app.response_id("chatcmpl", handle.id),
        Api::Completion => app.response_id("cmpl", handle.id),
    };
    let generation = |handle| {
        Generation::new(
            handle,
            app.tokenizer.clone(),
            settings.stops.clone(),
            prompt_tokens,
            admitted_at,
            app.metrics.clone(),
            adapter.clone(),
        )
        .with_min_tokens(settings.sampling.min_tokens)
    };
    let mut generations = vec![generation(handle)];
    let mut first_step = None;
    if settings.n > 1 {
        // The other choices start once the first has its prompt in KV (its first step
        // comes after that), so they take its full prompt pages from the domain's prefix
        // cache, shared read-only, instead of computing them again; each computes only its
        // prompt's last, partly filled page into pages of its own.
        match generations[0].next().await {
            Some(Step::Failed(e)) => return Err(e),
            step => first_step = step,
        }
        for a in admitted {
            let handle = submit(app, a, input_param).await?;
            generations.push(generation(handle));
        }
    }
    Ok(Started {
        generations,
        first_step,
        meta: ResponseMeta {
            api,
            id,
            created: unix_now(),
            model: app.model_name.clone(),
            logprobs: logprobs.is_some(),
            tok: app.tokenizer.clone(),
            tools,
            thinking,
        },
        settings,
        permit,
    })
}

async fn respond(started: Started, control: Control) -> Response {
    if started.settings.stream {
        stream(started, control.map(|Extension(c)| c)).into_response()
    } else {
        collect(started).await
    }
}

/// One request's choices, stepped together: the next step of whichever is ready.
struct Choices {
    generations: Vec<Generation>,
    ended: Vec<bool>,
    /// Choice 0's first step, taken before the others were submitted.
    first_step: Option<Step>,
}

impl Choices {
    fn new(generations: Vec<Generation>, first_step: Option<Step>) -> Self {
        let ended = vec![false; generations.len()];
        Self {
            generations,
            ended,
            first_step,
        }
    }

    fn len(&self) -> usize {
        self.generations.len()
    }

    /// Events the backend produced that no client has taken yet, over every choice.
    fn backlog(&self) -> usize {
        self.generations.iter().map(Generation::backlog).sum()
    }

    fn note(&mut self, i: usize, step: &Step) {
        if matches!(step, Step::Done { .. } | Step::Failed(_)) {
            self.ended[i] = true;
        }
    }

    /// The next step of a choice still running, with its index; `None` once all ended.
    async fn next(&mut self) -> Option<(usize, Step)> {
        if let Some(step) = self.first_step.take() {
            self.note(0, &step);
            return Some((0, step));
        }
        loop {
            // One choice (the common case, every token of it): its next step, with no
            // futures to build.
            if let [only] = self.generations.as_mut_slice() {
                if self.ended[0] {
                    return None;
                }
                let step = only.next().await;
                match &step {
                    Some(step) => self.note(0, step),
                    None => self.ended[0] = true,
                }
                return step.map(|step| (0, step));
            }
            let live: Vec<_> = self
                .generations
                .iter_mut()
                .zip(&self.ended)
                .enumerate()
                .filter(|(_, (_, &ended))| !ended)
                .map(|(i, (g, _))| Box::pin(async move { (i, g.next().await) }))
                .collect();
            if live.is_empty() {
                return None;
            }
            // `Generation::next` only awaits its event channel, so the futures not chosen
            // are dropped without losing anything.
            let ((i, step), _, rest) = futures_util::future::select_all(live).await;
            drop(rest);
            match step {
                Some(step) => {
                    self.note(i, &step);
                    return Some((i, step));
                }
                None => self.ended[i] = true,
            }
        }
    }
}

/// The usage of a request's choices: its prompt once (as choice 0 saw it), the completion
/// tokens of all.
fn add_usage(total: &mut Usage, choice: usize, usage: &Usage) {
    if choice == 0 {
        total.prompt_tokens = usage.prompt_tokens;
        total.cached_tokens = usage.cached_tokens;
    }
    total.completion_tokens += usage.completion_tokens;
}

const NO_USAGE: Usage = Usage {
    prompt_tokens: 0,
    completion_tokens: 0,
    cached_tokens: 0,
};

/// Waits for the whole output of every choice. A failure at any point answers with its
/// error status, never a 200 with partial text.
async fn collect(started: Started) -> Response {
    let Started {
        generations,
        first_step,
        meta,
        permit: _permit,
        ..
    } = started;
    let mut choices = Choices::new(generations, first_step);
    let mut outputs: Vec<(Chunk, Option<FinishReason>)> = vec![Default::default(); choices.len()];
    let mut usage = NO_USAGE;
    while let Some((i, step)) = choices.next().await {
        let (output, end) = &mut outputs[i];
        match step {
            Step::Chunk(c) => {
                output.text.push_str(&c.text);
                output.tokens.extend(c.tokens);
            }
            Step::Done {
                tail,
                reason,
                usage: u,
            } => {
                output.text.push_str(&tail.text);
                output.tokens.extend(tail.tokens);
                *end = Some(reason);
                add_usage(&mut usage, i, &u);
            }
            Step::Failed(e) => return e.into_response(),
        }
    }
    let Some(done) = outputs
        .into_iter()
        .map(|(c, r)| r.map(|r| (c, r)))
        .collect::<Option<Vec<_>>>()
    else {
        return ApiError::Internal("generation ended without a result".into()).into_response();
    };
    Json(meta.response(&done, &usage)).into_response()
}

struct StreamState {
    choices: Choices,
    /// Per choice, holds back text that may be a tool call, when the request declared
    /// tools.
    tool_streams: Vec<Option<ToolStream>>,
    /// Per choice, sorts a thinking model's thoughts from its content, ahead of the tool
    /// stream (which sees the content only).
    reasoning_streams: Vec<Option<ReasoningStream>>,
    usage: Usage,
    meta: ResponseMeta,
    include_usage: bool,
    /// Events ready for hyper, with their sizes on the wire.
    queue: VecDeque<(SseEvent, u64)>,
    finished: bool,
    /// Dropped with the stream: when it ends, or when the client hangs up.
    _permit: crate::tenants::Permit,
    control: Option<ConnectionControl>,
    /// The connection's bytes sent when this stream began, and the bytes of the events it
    /// has handed to hyper since.
    sent_before: u64,
    handed: u64,
    /// Since when the client has been behind ([`BEHIND_EVENTS`], [`BEHIND_BYTES`]).
    behind_since: Option<Instant>,
}

/// Events waiting for a client that count as falling behind (a client that keeps up finds
/// none or one waiting when it asks for more).
const BEHIND_EVENTS: usize = 8;
/// Bytes handed to hyper and not yet taken by the socket that count as falling behind:
/// hyper buffers up to 400 KiB of a response before it stops taking events, so a slow
/// reader's backlog waits there, not among the events.
const BEHIND_BYTES: u64 = 16 * 1024;

impl StreamState {
    /// True once the client has been behind its generation for the send timeout: it reads,
    /// but more slowly than tokens come, so the connection layer's timer (which needs a
    /// write with no progress at all) would never fire while the backlog grows.
    fn client_too_slow(&mut self) -> bool {
        let Some(control) = &self.control else {
            return false;
        };
        let unsent = self
            .handed
            .saturating_sub(control.bytes_sent().saturating_sub(self.sent_before));
        if self.choices.backlog() < BEHIND_EVENTS && unsent < BEHIND_BYTES {
            self.behind_since = None;
            return false;
        }
        let since = *self.behind_since.get_or_insert_with(Instant::now);
        if since.elapsed() < control.send_timeout {
            return false;
        }
        control.reset_when_closed();
        true
    }
}

/// An event and its size on the wire (`data: ` + the JSON + a blank line).
fn data(v: &Value) -> (SseEvent, u64) {
    let text = v.to_string();
    let size = text.len() as u64 + 8;
    (SseEvent::default().data(text), size)
}

/// Server-sent events. The stream owns the generation: when the client disconnects, the
/// response body is dropped, and with it the engine request.
fn stream(
    started: Started,
    control: Option<ConnectionControl>,
) -> Sse<impl futures_util::Stream<Item = Result<SseEvent, std::io::Error>>> {
    let include_usage = started.settings.include_usage;
    let choices = Choices::new(started.generations, started.first_step);
    let mut queue = VecDeque::new();
    if started.meta.api == Api::Chat {
        for i in 0..choices.len() {
            queue.push_back(data(&started.meta.role_chunk(i, include_usage)));
        }
    }
    let sent_before = control.as_ref().map_or(0, ConnectionControl::bytes_sent);
    let tools = started
        .meta
        .tools
        .clone()
        .filter(|_| started.meta.api == Api::Chat);
    let tool_streams = (0..choices.len())
        .map(|_| tools.clone().map(ToolStream::new))
        .collect();
    let reasoning_streams = (0..choices.len())
        .map(|_| started.meta.thinking.map(ReasoningStream::new))
        .collect();
    let state = StreamState {
        tool_streams,
        reasoning_streams,
        choices,
        usage: NO_USAGE,
        meta: started.meta,
        include_usage,
        queue,
        finished: false,
        _permit: started.permit,
        control,
        sent_before,
        handed: 0,
        behind_since: None,
    };
    let events = futures_util::stream::unfold(state, |mut st| async move {
        loop {
            if let Some((ev, size)) = st.queue.pop_front() {
                st.handed += size;
                return Some((Ok(ev), st));
            }
            if st.finished {
                return None;
            }
            if st.client_too_slow() {
                // An error ends the body without its last chunk: hyper drops the connection
                // (reset, as asked), and dropping the stream cancels the generation.
                let slow = std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    "the client fell behind its stream for the send timeout",
                );
                st.finished = true;
                return Some((Err(slow), st));
            }
            match st.choices.next().await {
                None => {
                    // Every choice has ended.
                    if st.include_usage {
                        st.queue.push_back(data(&st.meta.usage_chunk(&st.usage)));
                    }
                    st.queue.push_back((SseEvent::default().data("[DONE]"), 14));
                    st.finished = true;
                }
                Some((i, Step::Chunk(mut c))) => {
                    let mut thoughts = String::new();
                    if let Some(reasoning) = &mut st.reasoning_streams[i] {
                        let parts = reasoning.push(&c.text);
                        (thoughts, c.text) = (parts.thoughts, parts.content);
                    }
                    if let Some(tools) = &mut st.tool_streams[i] {
                        c.text = tools.push(&c.text);
                    }
                    let holds = st.tool_streams[i].is_some() || st.reasoning_streams[i].is_some();
                    if holds && c.text.is_empty() && thoughts.is_empty() && !st.meta.logprobs {
                        continue;
                    }
                    st.queue.push_back(data(&st.meta.delta_chunk_thinking(
                        i,
                        &thoughts,
                        &c,
                        None,
                        st.include_usage,
                    )));
                }
                Some((
                    i,
                    Step::Done {
                        mut tail,
                        reason,
                        usage,
                    },
                )) => {
                    add_usage(&mut st.usage, i, &usage);
                    let mut thoughts = String::new();
                    if let Some(reasoning) = &mut st.reasoning_streams[i] {
                        let mut parts = reasoning.push(&tail.text);
                        let end = reasoning.finish();
                        parts.thoughts.push_str(&end.thoughts);
                        parts.content.push_str(&end.content);
                        (thoughts, tail.text) = (parts.thoughts, parts.content);
                    }
                    let calls = match &mut st.tool_streams[i] {
                        Some(tools) => {
                            let (rest, calls) =
                                tools.finish(&tail.text, reason == engine::FinishReason::Stop);
                            tail.text = rest;
                            calls
                        }
                        None => Vec::new(),
                    };
                    if calls.is_empty() {
                        st.queue.push_back(data(&st.meta.delta_chunk_thinking(
                            i,
                            &thoughts,
                            &tail,
                            Some(reason),
                            st.include_usage,
                        )));
                    } else {
                        if !tail.text.is_empty() || !thoughts.is_empty() || st.meta.logprobs {
                            st.queue.push_back(data(&st.meta.delta_chunk_thinking(
                                i,
                                &thoughts,
                                &tail,
                                None,
                                st.include_usage,
                            )));
                        }
                        for ev in st.meta.tool_call_chunks(i, &calls, st.include_usage) {
                            st.queue.push_back(data(&ev));
                        }
                    }
                }
                Some((_, Step::Failed(e))) => {
                    // One error event, and no [DONE]: the client must not mistake a
                    // failed stream for a complete answer.
                    st.queue.push_back(data(&e.body()));
                    st.finished = true;
                }
            }
        }
    });
    Sse::new(events).keep_alive(KeepAlive::default())
}

/// The served model, then each adapter the caller's tenant may use (vLLM's shape: an
/// adapter's `parent` is the base). Another tenant's adapters are not listed.
async fn models(State(app): State<Arc<AppState>>, headers: HeaderMap) -> Response {
    let tenant = match app.auth.authenticate(&headers) {
        Ok(tenant) => tenant,
        Err(e) => return e.into_response(),
    };
    let max_model_len = app.backend.admission().max_context();
    let mut data = vec![json!({
        "id": app.model_name,
        "object": "model",
        "created": app.created,
        "owned_by": "kvwarden",
        "max_model_len": max_model_len,
    })];
    data.extend(
        app.adapters
            .visible(tenant.tenant_name())
            .into_iter()
            .map(|a| {
                json!({
                    "id": a.name,
                    "object": "model",
                    "created": app.created,
                    "owned_by": "kvwarden",
                    "root": a.name,
                    "parent": app.model_name,
                    "max_model_len": max_model_len,
                })
            }),
    );
    Json(json!({ "object": "list", "data": data })).into_response()
}

/// llama.cpp's list of adapters with the ids its `lora` field takes: only those the
/// caller's tenant may use. `path` is the adapter's name: where the operator keeps files
/// is no tenant's business.
async fn lora_adapters(State(app): State<Arc<AppState>>, headers: HeaderMap) -> Response {
    let tenant = match app.auth.authenticate(&headers) {
        Ok(tenant) => tenant,
        Err(e) => return e.into_response(),
    };
    let list: Vec<Value> = app
        .adapters
        .visible(tenant.tenant_name())
        .into_iter()
        .map(|a| json!({ "id": a.id, "name": a.name, "path": a.name, "scale": a.scale }))
        .collect();
    Json(Value::Array(list)).into_response()
}

/// 200 while the backend can serve (the engine thread runs; a cluster has a reachable node
/// of each role); 503 otherwise, since no generation request could then succeed.
async fn health(State(app): State<Arc<AppState>>) -> Response {
    if let Err(e) = app.backend.health() {
        return e.into_response();
    }
    #[allow(unused_mut)] // mutated only in fault-injection builds
    let mut body = json!({ "status": "ok" });
    // A build that can re-enact the incident's bug says so to anything that asks.
    #[cfg(feature = "fault-injection")]
    {
        body["fault_injection"] = json!(true);
        body["fault"] = json!(engine::fault::incident().then_some("incident"));
    }
    Json(body).into_response()
}

/// The totals describe every tenant's traffic: on the API listener they need an API key.
async fn metrics_behind_keys(State(app): State<Arc<AppState>>, headers: HeaderMap) -> Response {
    if let Err(e) = app.auth.authenticate(&headers) {
        return e.into_response();
    }
    let one_tenant = matches!(app.auth, crate::auth::Auth::Open);
    render_metrics(&app, one_tenant)
}

/// The operator's own listener.
async fn metrics(State(app): State<Arc<AppState>>) -> Response {
    render_metrics(&app, true)
}

fn render_metrics(app: &AppState, adapter_names: bool) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        app.metrics.render(app.backend.as_ref(), adapter_names),
    )
        .into_response()
}

/// Every listener's unknown route (the tenants' API and the operator's): OpenAI's error shape.
pub(crate) async fn not_found(method: Method, uri: Uri) -> Response {
    ApiError::RouteNotFound {
        method: method.to_string(),
        path: uri.path().to_owned(),
    }
    .into_response()
}

pub(crate) async fn method_not_allowed(method: Method, uri: Uri) -> Response {
    ApiError::MethodNotAllowed {
        method: method.to_string(),
        path: uri.path().to_owned(),
    }
    .into_response()
}
