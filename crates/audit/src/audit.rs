//! The audit itself: discovery, then the five checks, over HTTP only.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::canary::{Canary, CanaryMint, Normalized};
use crate::error::AuditError;
use crate::progress::Progress;
use crate::prompts;
use crate::report::{
    CapacityRow, CheckName, CheckResult, Differential, Finding, Kind, Leak, Report, RequestRow,
    Severity, SideChannel, SideChannelTrial, Verdict,
};
use oai_client::Rng;
use oai_client::{Api, Call, Client, Exchange, Prompt};

/// What to audit and how hard.
#[derive(Debug, Clone)]
pub struct Config {
    pub endpoint: String,
    pub api_keys: Vec<String>,
    pub model: Option<String>,
    pub max_context: Option<usize>,
    pub concurrency: usize,
    /// Requests in the concurrent canary mix.
    pub requests: usize,
    /// Sequential "fill the pool, then send an over-length prompt" pairs.
    pub pressure_pairs: usize,
    pub max_tokens: u32,
    /// Synthetic identities when fewer than two API keys are given.
    pub synthetic_tenants: usize,
    pub batch_invariant: bool,
    pub side_channel_tokens: Option<usize>,
    pub side_channel_trials: usize,
    pub checks: Vec<CheckName>,
    pub seed: u64,
    pub timeout: Duration,
    pub progress: bool,
}

impl Config {
    pub fn new(endpoint: impl Into<String>) -> Self {
        Self {
            endpoint: endpoint.into(),
            api_keys: Vec::new(),
            model: None,
            max_context: None,
            concurrency: 4,
            requests: 16,
            pressure_pairs: 2,
            max_tokens: 16,
            synthetic_tenants: 3,
            batch_invariant: false,
            side_channel_tokens: None,
            side_channel_trials: 2,
            checks: CheckName::ALL.to_vec(),
            seed: Rng::random_seed(),
            timeout: Duration::from_secs(600),
            progress: true,
        }
    }
}

/// An identity that sends requests: an API key, or a synthetic label on a keyless server.
#[derive(Debug, Clone)]
pub struct Tenant {
    pub name: String,
    pub key: Option<String>,
}

/// One request sent and what came back.
#[derive(Debug, Clone)]
pub struct Record {
    pub id: usize,
    pub tenant: usize,
    pub kind: Kind,
    pub call: Call,
    pub canary: Option<Canary>,
    /// Replays carry the id of the request they repeat: the same request, the same canary.
    pub replay_of: Option<usize>,
    pub ex: Exchange,
}

impl Record {
    fn owner(&self) -> usize {
        self.replay_of.unwrap_or(self.id)
    }
}

/// A request planned but not yet sent.
#[derive(Debug, Clone)]
struct Planned {
    tenant: usize,
    kind: Kind,
    call: Call,
    canary: Option<Canary>,
    replay_of: Option<usize>,
}

/// Shared state while requests are in flight.
struct Ledger {
    records: Vec<Record>,
    /// Every canary of the run, known before the first request, so leaks are seen live.
    canaries: Vec<(usize, Canary)>,
    next_id: usize,
    leaks: Vec<Leak>,
    wrong_statuses: usize,
}

pub struct Auditor {
    client: Arc<Client>,
    config: Config,
    tenants: Vec<Tenant>,
    real_tenants: bool,
    max_context: usize,
    context_source: String,
    health: Value,
    ledger: Arc<Mutex<Ledger>>,
    progress: Progress,
    rng: Rng,
    mint: CanaryMint,
    findings: Vec<Finding>,
    /// Bytes per token of canary text, measured on the server (1.0 until measured: no
    /// token is shorter than one byte, so byte counts never overshoot).
    bytes_per_token: f64,
    /// Filler words per token, measured likewise (1.0 until measured: a word is at least a
    /// token).
    words_per_token: f64,
}

fn lock(l: &Mutex<Ledger>) -> std::sync::MutexGuard<'_, Ledger> {
    // A panic in a request task cannot leave the ledger half-written (every update is one
    // push), so a poisoned lock is still usable.
    l.lock().unwrap_or_else(|p| p.into_inner())
}

/// Runs the audit against `config.endpoint`.
pub async fn run(config: Config) -> Result<Report, AuditError> {
    let mut auditor = Auditor::connect(config).await?;
    auditor.run_checks().await
}

impl Auditor {
    /// Finds the model and the advertised context.
    pub async fn connect(config: Config) -> Result<Self, AuditError> {
        let mut client = Client::new(&config.endpoint, config.timeout)?;
        let key = config.api_keys.first().map(String::as_str);
        let health = match client.get_json("/health", key).await {
            Ok((_, v)) => v,
            Err(e) => {
                return Err(AuditError::Unreachable {
                    url: client.base.clone(),
                    message: e,
                })
            }
        };
        let models = client.get_json("/v1/models", key).await.ok();
        let first = models
            .as_ref()
            .and_then(|(_, v)| v.get("data"))
            .and_then(|d| d.get(0))
            .cloned();
        let model = match (&config.model, &first) {
            (Some(m), _) => m.clone(),
            (None, Some(m)) => m
                .get("id")
                .and_then(Value::as_str)
                .map(str::to_owned)
                .ok_or_else(|| AuditError::NoModel("/v1/models lists no id".into()))?,
            (None, None) => {
                return Err(AuditError::NoModel(format!(
                    "/v1/models answered {:?}",
                    models.map(|m| m.0)
                )))
            }
        };
        let as_usize = |v: Option<&Value>| v.and_then(Value::as_u64).map(|n| n as usize);
        let (max_context, context_source) = if let Some(c) = config.max_context {
            (c, "--max-context".to_owned())
        } else if let Some(c) = as_usize(first.as_ref().and_then(|m| m.get("max_model_len"))) {
            (c, "/v1/models max_model_len".to_owned())
        } else {
            let props = client.get_json("/props", key).await.ok();
            let n_ctx = props.as_ref().and_then(|(_, p)| {
                as_usize(
                    p.get("default_generation_settings")
                        .and_then(|g| g.get("n_ctx")),
                )
                .or_else(|| as_usize(p.get("n_ctx")))
            });
            match n_ctx {
                Some(c) => (c, "/props n_ctx (llama.cpp, per slot)".to_owned()),
                None => {
                    return Err(AuditError::NoContext(
                        "neither /v1/models max_model_len nor /props n_ctx".into(),
                    ))
                }
            }
        };
        if max_context < 64 {
            return Err(AuditError::NoContext(format!(
                "a context of {max_context} tokens is too small to audit"
            )));
        }
        client.model = model;
        let real_tenants = config.api_keys.len() >= 2;
        let tenants: Vec<Tenant> = if real_tenants {
            config
                .api_keys
                .iter()
                .enumerate()
                .map(|(i, k)| Tenant {
                    name: format!("key-{}", i + 1),
                    key: Some(k.clone()),
                })
                .collect()
        } else {
            (0..config.synthetic_tenants.max(2))
                .map(|i| Tenant {
                    name: format!("identity-{}", i + 1),
                    key: config.api_keys.first().cloned(),
                })
                .collect()
        };
        let mut rng = Rng::new(config.seed);
        let mint = CanaryMint::new(Rng::new(rng.next_u64()));
        let progress = Progress::new(config.progress);
        Ok(Self {
            client: Arc::new(client),
            tenants,
            real_tenants,
            max_context,
            context_source,
            health,
            ledger: Arc::new(Mutex::new(Ledger {
                records: Vec::new(),
                canaries: Vec::new(),
                next_id: 1,
                leaks: Vec::new(),
                wrong_statuses: 0,
            })),
            progress,
            rng,
            mint,
            findings: Vec::new(),
            bytes_per_token: 1.0,
            words_per_token: 1.0,
            config,
        })
    }

    pub fn max_context(&self) -> usize {
        self.max_context
    }

    fn enabled(&self, c: CheckName) -> bool {
        self.config.checks.contains(&c)
    }

    fn call(&self, api: Api, prompt: Prompt, tenant: usize) -> Call {
        Call {
            api,
            prompt,
            max_tokens: self.config.max_tokens,
            temperature: 0.0,
            stream: false,
            logprobs: false,
            ignore_eos: false,
            cancel_after: None,
            key: self.tenants[tenant].key.clone(),
        }
    }

    /// An over-length prompt asks for enough tokens that, were it wrongly answered from
    /// someone else's K/V, a whole canary (about 18 tokens of word and digits) would fit in
    /// the answer. A correct server refuses it before generating anything.
    fn over_length_call(&self, api: Api, prompt: String, tenant: usize) -> Call {
        let mut call = self.call(api, Prompt::Text(prompt), tenant);
        call.max_tokens = call.max_tokens.max(48);
        call
    }

    /// Registers planned requests' canaries, so every response is scanned for them live.
    fn plan(&self, planned: &[Planned]) -> Vec<usize> {
        let mut l = lock(&self.ledger);
        let mut ids = Vec::with_capacity(planned.len());
        for p in planned {
            let id = l.next_id;
            l.next_id += 1;
            if let Some(c) = &p.canary {
                if p.replay_of.is_none() {
                    l.canaries.push((id, c.clone()));
                }
            }
            ids.push(id);
        }
        drop(l);
        self.progress.add_len(planned.len());
        ids
    }

    /// Sends planned requests, at most `concurrency` at once, in order of the list.
    async fn send_all(&self, planned: Vec<Planned>, concurrency: usize) -> Vec<usize> {
        let ids = self.plan(&planned);
        let sem = Arc::new(tokio::sync::Semaphore::new(concurrency.max(1)));
        let mut tasks = Vec::with_capacity(planned.len());
        for (p, &id) in planned.into_iter().zip(&ids) {
            let Ok(permit) = sem.clone().acquire_owned().await else {
                break;
            };
            let client = self.client.clone();
            let ledger = self.ledger.clone();
            let tenants: Vec<String> = self.tenants.iter().map(|t| t.name.clone()).collect();
            let progress = self.progress.clone();
            let max_context = self.max_context;
            tasks.push(tokio::spawn(async move {
                let ex = client.call(&p.call).await;
                drop(permit);
                let record = Record {
                    id,
                    tenant: p.tenant,
                    kind: p.kind,
                    call: p.call,
                    canary: p.canary,
                    replay_of: p.replay_of,
                    ex,
                };
                let mut l = lock(&ledger);
                let mut leaks = scan(&record, &l.canaries, &l.records, &tenants);
                if wrong_status(&record, max_context) {
                    l.wrong_statuses += 1;
                }
                l.leaks.append(&mut leaks);
                l.records.push(record);
                progress.tick(l.leaks.len(), l.wrong_statuses);
            }));
        }
        for t in tasks {
            // A task only panics on a bug in this crate; the request is then missing from
            // the ledger, which the report shows as a smaller count.
            let _ = t.await;
        }
        ids
    }

    async fn send_one(&self, p: Planned) -> Record {
        let ids = self.send_all(vec![p], 1).await;
        let l = lock(&self.ledger);
        ids.first()
            .and_then(|id| l.records.iter().find(|r| r.id == *id))
            .cloned()
            .unwrap_or_else(|| Record {
                id: 0,
                tenant: 0,
                kind: Kind::Calibration,
                call: self.call(Api::Completions, Prompt::Text(String::new()), 0),
                canary: None,
                replay_of: None,
                ex: Exchange::default(),
            })
    }

    fn record(&self, id: usize) -> Option<Record> {
        lock(&self.ledger)
            .records
            .iter()
            .find(|r| r.id == id)
            .cloned()
    }

    fn find(&mut self, check: CheckName, severity: Severity, request: Option<usize>, msg: String) {
        self.findings.push(Finding {
            check,
            severity,
            message: msg,
            request,
        });
    }

    /// Runs every enabled check and builds the report.
    pub async fn run_checks(&mut self) -> Result<Report, AuditError> {
        let started = Instant::now();
        let mut results = Vec::new();
        let mut capacity = Vec::new();
        if self.enabled(CheckName::Capacity) {
            let (result, rows) = self.capacity().await;
            capacity = rows;
            results.push(result);
        }
        let mut mix_ids = Vec::new();
        if self.enabled(CheckName::Canaries) {
            mix_ids = self.canaries().await;
        }
        let mut differential = Differential::default();
        if self.enabled(CheckName::Differential) {
            let (result, d) = self.differential(&mix_ids).await;
            differential = d;
            results.push(result);
        }
        let mut side_channel = None;
        if self.enabled(CheckName::SideChannel) {
            let (result, sc) = self.side_channel().await;
            side_channel = Some(sc);
            results.push(result);
        }
        self.progress.finish();
        // Canary and status verdicts come last: they cover every request of the run,
        // replays and side-channel probes included.
        let (leaks, records) = {
            let l = lock(&self.ledger);
            (l.leaks.clone(), l.records.clone())
        };
        if self.enabled(CheckName::Canaries) {
            results.push(self.canary_result(&leaks, &records));
        }
        if self.enabled(CheckName::Status) {
            results.push(self.status(&records));
        }
        results.sort_by_key(|r| CheckName::ALL.iter().position(|c| *c == r.check));
        let mut records = records;
        records.sort_by_key(|r| r.id);
        let requests = records.iter().map(|r| self.row(r)).collect();
        let passed = results.iter().all(|r| r.verdict != Verdict::Fail)
            && !self
                .findings
                .iter()
                .any(|f| f.severity == Severity::Failure);
        Ok(Report {
            endpoint: self.client.base.clone(),
            model: self.client.model.clone(),
            max_context: self.max_context,
            context_source: self.context_source.clone(),
            health: self.health.clone(),
            tenants: self.tenants.iter().map(|t| t.name.clone()).collect(),
            real_tenants: self.real_tenants,
            seed: self.config.seed,
            duration_s: started.elapsed().as_secs_f64(),
            checks: results,
            findings: self.findings.clone(),
            capacity,
            leaks,
            differential,
            side_channel,
            requests,
            passed,
        })
    }

    fn row(&self, r: &Record) -> RequestRow {
        RequestRow {
            id: r.id,
            tenant: self.tenants[r.tenant].name.clone(),
            kind: r.kind,
            api: r.call.api,
            stream: r.call.stream,
            prompt: r.call.prompt.describe(),
            max_tokens: r.call.max_tokens,
            status: r.ex.status,
            finish_reason: r.ex.finish_reason.clone(),
            usage: r.ex.usage,
            ttft_ms: r.ex.ttft.map(|d| d.as_secs_f64() * 1e3),
            total_ms: r.ex.total.as_secs_f64() * 1e3,
            bytes: r.ex.raw_bytes,
            content: clip(&r.ex.content, 400),
            canary: r.canary.clone(),
            replay_of: r.replay_of,
            error: r
                .ex
                .transport_error
                .clone()
                .or_else(|| r.ex.error_message.clone())
                .map(|e| clip(&e, 300)),
        }
    }

    // ---- 1. capacity honesty -------------------------------------------------------------

    /// Prompts of exactly the limit, one over and 1.5x over (token ids, so lengths are
    /// exact), and 1.5x over as chat text. Expect success, 4xx, 4xx, 4xx.
    pub async fn capacity(&mut self) -> (CheckResult, Vec<CapacityRow>) {
        let l = self.max_context;
        let cases: Vec<(Kind, String, Prompt, Api, u32)> = vec![
            (
                Kind::AtLimit,
                format!("at the limit: {} prompt + 1 completion = {l}", l - 1),
                Prompt::Tokens(prompts::token_ids(&mut self.rng, l - 1)),
                Api::Completions,
                1,
            ),
            (
                Kind::OneOver,
                format!("one over: {l} prompt + 1 completion = {}", l + 1),
                Prompt::Tokens(prompts::token_ids(&mut self.rng, l)),
                Api::Completions,
                1,
            ),
            (
                Kind::FarOver,
                format!("1.5x: {} prompt tokens", l * 3 / 2),
                Prompt::Tokens(prompts::token_ids(&mut self.rng, l * 3 / 2)),
                Api::Completions,
                1,
            ),
            (
                Kind::FarOverChat,
                format!("1.5x as chat text: over {} words", l * 3 / 2),
                Prompt::Text(prompts::filler(&mut self.rng, l * 3 / 2)),
                Api::Chat,
                self.config.max_tokens,
            ),
        ];
        let mut rows = Vec::new();
        for (kind, case, prompt, api, max_tokens) in cases {
            let prompt_tokens = match &prompt {
                Prompt::Tokens(t) => t.len(),
                Prompt::Text(t) => t.split_whitespace().count(),
            };
            let mut call = self.call(api, prompt, 0);
            call.max_tokens = max_tokens;
            let r = self
                .send_one(Planned {
                    tenant: 0,
                    kind,
                    call,
                    canary: None,
                    replay_of: None,
                })
                .await;
            let ok = r.ex.succeeded();
            let expect_ok = kind == Kind::AtLimit;
            let status = r.ex.status;
            let status_s = status.map_or("no answer".to_owned(), |s| format!("HTTP {s}"));
            let (verdict, detail) = if expect_ok {
                if ok {
                    (
                        Verdict::Pass,
                        format!(
                            "{status_s}, finish_reason {:?}",
                            r.ex.finish_reason.as_deref().unwrap_or("-")
                        ),
                    )
                } else {
                    let msg = format!(
                        "a prompt within the advertised context of {l} was refused: {status_s} {}",
                        clip(
                            r.ex.error_message
                                .as_deref()
                                .or(r.ex.transport_error.as_deref())
                                .unwrap_or(""),
                            200
                        )
                    );
                    self.find(
                        CheckName::Capacity,
                        Severity::Failure,
                        Some(r.id),
                        msg.clone(),
                    );
                    (Verdict::Fail, msg)
                }
            } else if r.ex.ok() && !stream_rejected(&r.ex) {
                let msg = format!(
                    "an over-length prompt ({case}) was answered {status_s} with {} bytes of content: {:?}",
                    r.ex.content.len(),
                    clip(&r.ex.content, 120)
                );
                self.find(
                    CheckName::Capacity,
                    Severity::Failure,
                    Some(r.id),
                    msg.clone(),
                );
                (Verdict::Fail, msg)
            } else if status.is_some_and(|s| (400..500).contains(&s)) || stream_rejected(&r.ex) {
                (
                    Verdict::Pass,
                    format!(
                        "{status_s}: {}",
                        clip(r.ex.error_message.as_deref().unwrap_or(""), 160)
                    ),
                )
            } else {
                let msg = format!(
                    "an over-length prompt ({case}) got {status_s} instead of a 4xx: {}",
                    clip(
                        r.ex.error_message
                            .as_deref()
                            .or(r.ex.transport_error.as_deref())
                            .unwrap_or(""),
                        160
                    )
                );
                self.find(
                    CheckName::Capacity,
                    Severity::Failure,
                    Some(r.id),
                    msg.clone(),
                );
                (Verdict::Fail, msg)
            };
            rows.push(CapacityRow {
                case,
                request: r.id,
                prompt_tokens,
                max_tokens,
                expected: if expect_ok { "2xx" } else { "4xx" },
                status,
                verdict,
                detail,
            });
        }
        let failed = rows.iter().filter(|r| r.verdict == Verdict::Fail).count();
        let statuses: Vec<String> = rows
            .iter()
            .map(|r| r.status.map_or("-".to_owned(), |s| s.to_string()))
            .collect();
        let result = CheckResult {
            check: CheckName::Capacity,
            title: CheckName::Capacity.title(),
            verdict: if failed == 0 { Verdict::Pass } else { Verdict::Fail },
            summary: format!(
                "context {l}: at limit / one over / 1.5x / 1.5x chat -> {} (expected 2xx/4xx/4xx/4xx)",
                statuses.join(" / ")
            ),
        };
        (result, rows)
    }

    // ---- 2. cross-tenant canaries ----------------------------------------------------------

    /// Measures bytes per token of canary text, so pool-filling prompts land near the limit.
    async fn calibrate(&mut self) {
        let c = self.mint.mint();
        let text = prompts::repeated(&c, 400);
        let bytes = text.len();
        let mut call = self.call(Api::Completions, Prompt::Text(text), 0);
        call.max_tokens = 1;
        let r = self
            .send_one(Planned {
                tenant: 0,
                kind: Kind::Calibration,
                call,
                canary: Some(c),
                replay_of: None,
            })
            .await;
        if let Some(t) = r.ex.usage.and_then(|u| u.prompt_tokens).filter(|&t| t > 0) {
            self.bytes_per_token = (bytes as f64 / t as f64).max(1.0);
        }
        let words = 200;
        let text = prompts::filler(&mut self.rng, words);
        let mut call = self.call(Api::Completions, Prompt::Text(text), 0);
        call.max_tokens = 1;
        let r = self
            .send_one(Planned {
                tenant: 0,
                kind: Kind::Calibration,
                call,
                canary: None,
                replay_of: None,
            })
            .await;
        if let Some(t) = r.ex.usage.and_then(|u| u.prompt_tokens).filter(|&t| t > 0) {
            self.words_per_token = (words as f64 / t as f64).min(1.0);
        }
    }

    /// A document of about `tokens` tokens with the canary at its start, middle and end.
    fn document_tokens(&mut self, c: &Canary, tokens: usize) -> String {
        let words = (tokens as f64 * self.words_per_token * 0.97) as usize;
        prompts::document(&mut self.rng, c, words)
    }

    /// Text of about `tokens` tokens of repeated canary.
    fn repeated_tokens(&self, c: &Canary, tokens: usize) -> String {
        // 3% under the estimate: a different tokenization of the tail must not push a
        // near-limit prompt over.
        prompts::repeated(c, (tokens as f64 * self.bytes_per_token * 0.97) as usize)
    }

    /// Plans and sends the canary traffic; returns the ids of the concurrent mix.
    pub async fn canaries(&mut self) -> Vec<usize> {
        self.calibrate().await;
        let l = self.max_context;
        let mt = self.config.max_tokens as usize;
        let t = self.tenants.len();
        // Pool pressure, sequentially: tenant A fills most of the context with a repeated
        // canary, then tenant B sends an over-length prompt. A server that keeps B alive on
        // a placeholder over A's stale pages (the incident) echoes A's canary to B.
        for i in 0..self.config.pressure_pairs {
            let (a, b) = (i % t, (i + 1) % t);
            let ca = self.mint.mint();
            let fill = self.repeated_tokens(&ca, (l * 9 / 10).saturating_sub(mt));
            let planned_a = Planned {
                tenant: a,
                kind: Kind::PressureFill,
                call: self.call(Api::Completions, Prompt::Text(fill), a),
                canary: Some(ca),
                replay_of: None,
            };
            self.send_all(vec![planned_a], 1).await;
            let cb = self.mint.mint();
            let over = prompts::over_length(&mut self.rng, &cb, l * 3 / 2);
            let mut call = self.over_length_call(Api::Completions, over, b);
            // Each pair asks for a few more tokens: were the over-length request wrongly
            // decoded over stale pages, its length shifts where it lands in A's text.
            call.max_tokens += 5 * i as u32;
            let planned_b = Planned {
                tenant: b,
                kind: Kind::OverLength,
                call,
                canary: Some(cb),
                replay_of: None,
            };
            self.send_all(vec![planned_b], 1).await;
        }
        // The concurrent mix: every kind of request at once, so pages change hands under
        // load, with preemption where the pool is smaller than the sum of the prompts.
        let mut planned = Vec::with_capacity(self.config.requests);
        for i in 0..self.config.requests {
            let tenant = i % t;
            let c = self.mint.mint();
            let (kind, api, prompt, stream, logprobs) = match i % 8 {
                0 => (
                    Kind::RepeatChat,
                    Api::Chat,
                    format!(
                        "Repeat the following code exactly, five times, separated by spaces: {}",
                        c.text()
                    ),
                    true,
                    true,
                ),
                1 => (
                    Kind::RepeatCompletion,
                    Api::Completions,
                    self.repeated_tokens(&c, l * 3 / 10),
                    false,
                    true,
                ),
                2 => (
                    Kind::Document,
                    Api::Completions,
                    self.document_tokens(&c, l * 2 / 5),
                    true,
                    false,
                ),
                3 => (
                    Kind::OverLength,
                    Api::Completions,
                    prompts::over_length(&mut self.rng, &c, l * 3 / 2),
                    false,
                    false,
                ),
                4 => (
                    Kind::Cancelled,
                    Api::Chat,
                    format!(
                        "Write a long story about a ship called {}. Start now.",
                        c.text()
                    ),
                    true,
                    false,
                ),
                5 => (
                    Kind::NearLimit,
                    Api::Completions,
                    self.repeated_tokens(&c, (l * 9 / 10).saturating_sub(mt)),
                    true,
                    false,
                ),
                6 => (
                    Kind::DocumentChat,
                    Api::Chat,
                    self.document_tokens(&c, l / 4),
                    false,
                    true,
                ),
                _ => (
                    Kind::OverLength,
                    Api::Chat,
                    prompts::over_length(&mut self.rng, &c, l * 3 / 2),
                    true,
                    false,
                ),
            };
            let mut call = if kind == Kind::OverLength {
                self.over_length_call(api, prompt, tenant)
            } else {
                self.call(api, Prompt::Text(prompt), tenant)
            };
            call.stream = stream;
            call.logprobs = logprobs;
            if kind == Kind::Cancelled {
                call.max_tokens = call.max_tokens.max(64);
                call.cancel_after = Some(3);
            }
            planned.push(Planned {
                tenant,
                kind,
                call,
                canary: Some(c),
                replay_of: None,
            });
        }
        let concurrency = self.config.concurrency;
        self.send_all(planned, concurrency).await
    }

    fn canary_result(&mut self, leaks: &[Leak], records: &[Record]) -> CheckResult {
        let canaries = records
            .iter()
            .filter(|r| r.canary.is_some() && r.replay_of.is_none())
            .count();
        let scanned: usize = records.iter().map(|r| r.ex.raw_bytes).sum();
        for l in leaks {
            let msg = format!(
                "LEAK: request #{} ({}, HTTP {}) received {:?}, the canary of request #{} ({}){}, in its {}: {}",
                l.found_in,
                l.found_tenant,
                l.status.map_or("-".to_owned(), |s| s.to_string()),
                l.canary,
                l.canary_of,
                l.canary_tenant,
                if l.cross_tenant { ", another tenant" } else { ", same tenant" },
                l.location,
                l.excerpt
            );
            self.find(
                CheckName::Canaries,
                Severity::Failure,
                Some(l.found_in),
                msg,
            );
        }
        let cross = leaks.iter().filter(|l| l.cross_tenant).count();
        CheckResult {
            check: CheckName::Canaries,
            title: CheckName::Canaries.title(),
            verdict: if leaks.is_empty() { Verdict::Pass } else { Verdict::Fail },
            summary: format!(
                "{} canaries in {} requests from {} tenants, {} bytes scanned: {} leaks ({} cross-tenant)",
                canaries,
                records.len(),
                self.tenants.len(),
                scanned,
                leaks.len(),
                cross
            ),
        }
    }

    // ---- 3. differential content -----------------------------------------------------------

    /// Replays each successful greedy request of the mix alone; the answer must not change.
    pub async fn differential(&mut self, ids: &[usize]) -> (CheckResult, Differential) {
        let originals: Vec<Record> = ids
            .iter()
            .filter_map(|&id| self.record(id))
            .filter(|r| {
                r.ex.succeeded()
                    && !r.ex.cancelled
                    && r.call.temperature == 0.0
                    && !r.kind.over_length()
            })
            .collect();
        let mut d = Differential {
            batch_invariance_claimed: self.config.batch_invariant,
            ..Default::default()
        };
        for orig in originals {
            let mut call = orig.call.clone();
            call.stream = false;
            call.logprobs = false;
            let replay = self
                .send_one(Planned {
                    tenant: orig.tenant,
                    kind: Kind::Replay,
                    call,
                    canary: orig.canary.clone(),
                    replay_of: Some(orig.id),
                })
                .await;
            if !replay.ex.succeeded() {
                continue;
            }
            d.compared += 1;
            if replay.ex.content == orig.ex.content {
                d.identical += 1;
            } else {
                d.differing.push((orig.id, replay.id));
                let msg = format!(
                    "request #{} alone gave a different answer than in the batch (#{}): batched {:?}, alone {:?}",
                    orig.id,
                    replay.id,
                    clip(&orig.ex.content, 100),
                    clip(&replay.ex.content, 100)
                );
                let sev = if self.config.batch_invariant {
                    Severity::Failure
                } else {
                    Severity::Warning
                };
                self.find(CheckName::Differential, sev, Some(replay.id), msg);
            }
        }
        let differing = d.compared - d.identical;
        let verdict = match (differing, self.config.batch_invariant, d.compared) {
            (_, _, 0) => Verdict::Skipped,
            (0, _, _) => Verdict::Pass,
            (_, true, _) => Verdict::Fail,
            (_, false, _) => Verdict::Warn,
        };
        let summary = format!(
            "{}/{} greedy answers identical alone and batched ({:.0}% differ){}",
            d.identical,
            d.compared,
            if d.compared == 0 {
                0.0
            } else {
                100.0 * differing as f64 / d.compared as f64
            },
            if self.config.batch_invariant {
                "; batch invariance claimed"
            } else {
                "; reported as a rate (no batch invariance claimed)"
            }
        );
        (
            CheckResult {
                check: CheckName::Differential,
                title: CheckName::Differential.title(),
                verdict,
                summary,
            },
            d,
        )
    }

    // ---- 4. status honesty -----------------------------------------------------------------

    fn status(&mut self, records: &[Record]) -> CheckResult {
        let mut bad = 0;
        let mut checked = 0;
        for r in records {
            checked += 1;
            for (sev, msg) in status_problems(r, self.max_context) {
                if sev == Severity::Failure {
                    bad += 1;
                }
                self.find(CheckName::Status, sev, Some(r.id), msg);
            }
        }
        let warnings = self
            .findings
            .iter()
            .filter(|f| f.check == CheckName::Status && f.severity == Severity::Warning)
            .count();
        CheckResult {
            check: CheckName::Status,
            title: CheckName::Status.title(),
            verdict: if bad > 0 {
                Verdict::Fail
            } else if warnings > 0 {
                Verdict::Warn
            } else {
                Verdict::Pass
            },
            summary: format!(
                "{checked} responses: {bad} dishonest statuses or bodies, {warnings} warnings"
            ),
        }
    }

    // ---- 5. prefix-cache side channel ------------------------------------------------------

    /// Time to first token of a long prefix: tenant A cold and again, then tenant B on the
    /// same prefix and on a fresh one of the same length.
    pub async fn side_channel(&mut self) -> (CheckResult, SideChannel) {
        let l = self.max_context;
        let len = self
            .config
            .side_channel_tokens
            .unwrap_or((l / 2).min(1024))
            .clamp(32, l.saturating_sub(16).max(32));
        let (a, b) = (0, 1 % self.tenants.len());
        let mut sc = SideChannel {
            tenants: (self.tenants[a].name.clone(), self.tenants[b].name.clone()),
            real_tenants: self.real_tenants,
            ..Default::default()
        };
        for _ in 0..self.config.side_channel_trials.max(1) {
            let prefix = prompts::token_ids(&mut self.rng, len);
            let fresh = prompts::token_ids(&mut self.rng, len);
            let probe = |tenant: usize, base: &[u32], rng: &mut Rng| {
                let mut ids = base.to_vec();
                ids.extend(prompts::token_ids(rng, 4));
                let mut call = self.call(Api::Completions, Prompt::Tokens(ids), tenant);
                call.stream = true;
                call.max_tokens = 1;
                Planned {
                    tenant,
                    kind: Kind::SideChannel,
                    call,
                    canary: None,
                    replay_of: None,
                }
            };
            let mut rng = self.rng.clone();
            let steps = [
                probe(a, &prefix, &mut rng),
                probe(a, &prefix, &mut rng),
                probe(b, &prefix, &mut rng),
                probe(b, &fresh, &mut rng),
            ];
            self.rng = rng;
            let mut got = Vec::new();
            for p in steps {
                got.push(self.send_one(p).await);
            }
            let ms = |r: &Record| r.ex.ttft.unwrap_or(r.ex.total).as_secs_f64() * 1e3;
            let cached = |r: &Record| r.ex.usage.and_then(|u| u.cached_tokens);
            sc.trials.push(SideChannelTrial {
                prefix_tokens: len,
                a_cold_ms: ms(&got[0]),
                a_repeat_ms: ms(&got[1]),
                b_same_prefix_ms: ms(&got[2]),
                b_fresh_ms: ms(&got[3]),
                a_repeat_cached: cached(&got[1]),
                b_same_prefix_cached: cached(&got[2]),
                b_fresh_cached: cached(&got[3]),
            });
        }
        let median = |f: &dyn Fn(&SideChannelTrial) -> f64| {
            let mut v: Vec<f64> = sc.trials.iter().map(f).collect();
            v.sort_by(f64::total_cmp);
            v.get(v.len() / 2).copied().unwrap_or(0.0)
        };
        let (a1, a2, bs, bf) = (
            median(&|t| t.a_cold_ms),
            median(&|t| t.a_repeat_ms),
            median(&|t| t.b_same_prefix_ms),
            median(&|t| t.b_fresh_ms),
        );
        // A fresh prefix costs the same for anyone; what matters is whether B's request for
        // A's prefix costs less than a fresh one. "Less" is a factor of 2, far outside the
        // noise of one machine, and only counted when A's own repeat shows the cache at all.
        sc.reported_cross_hit = sc
            .trials
            .iter()
            .any(|t| t.b_same_prefix_cached.is_some_and(|c| c > 0));
        sc.own_cache_visible = sc
            .trials
            .iter()
            .any(|t| t.a_repeat_cached.is_some_and(|c| c > 0))
            || a2 * 2.0 < a1;
        sc.timing_cross_hit = sc.own_cache_visible && bs * 2.0 < bf;
        let timings = format!(
            "TTFT medians over {} trials of {len} tokens: A cold {a1:.0} ms, A again {a2:.0} ms, B same prefix {bs:.0} ms, B fresh {bf:.0} ms",
            sc.trials.len()
        );
        let (verdict, summary) = if sc.reported_cross_hit {
            let cached = sc
                .trials
                .iter()
                .filter_map(|t| t.b_same_prefix_cached)
                .max()
                .unwrap_or(0);
            if self.real_tenants {
                let msg = format!(
                    "cross-tenant prefix cache hit: {} reused {cached} cached tokens of {}'s prefix ({timings})",
                    sc.tenants.1, sc.tenants.0
                );
                self.find(CheckName::SideChannel, Severity::Failure, None, msg.clone());
                (Verdict::Fail, msg)
            } else {
                let msg = format!(
                    "prefix cache shared across requesters: {} reused {cached} cached tokens of {}'s prefix; with no API keys the server cannot tell tenants apart, so its users can time each other's prompts ({timings})",
                    sc.tenants.1, sc.tenants.0
                );
                self.find(CheckName::SideChannel, Severity::Warning, None, msg.clone());
                (Verdict::Warn, msg)
            }
        } else if sc.timing_cross_hit {
            let msg = format!(
                "timings suggest {} hit {}'s cached prefix (B same prefix at least twice as fast as fresh): {timings}",
                sc.tenants.1, sc.tenants.0
            );
            self.find(CheckName::SideChannel, Severity::Warning, None, msg.clone());
            (Verdict::Warn, msg)
        } else if sc.own_cache_visible {
            (Verdict::Pass, format!("no cross-tenant hit; {timings}"))
        } else {
            (
                Verdict::Pass,
                format!("no cross-tenant hit and no visible prefix cache; {timings}"),
            )
        };
        (
            CheckResult {
                check: CheckName::SideChannel,
                title: CheckName::SideChannel.title(),
                verdict,
                summary,
            },
            sc,
        )
    }
}

/// A 2xx stream that carried only an error event: an honest refusal, in stream form.
fn stream_rejected(ex: &Exchange) -> bool {
    ex.stream
        .as_ref()
        .is_some_and(|s| s.error_events == 1 && !s.done)
        && ex.content.is_empty()
}

/// Counts toward the live "wrong statuses" figure.
fn wrong_status(r: &Record, max_context: usize) -> bool {
    status_problems(r, max_context)
        .iter()
        .any(|(s, _)| *s == Severity::Failure)
        || (r.kind.over_length() && r.ex.ok() && !stream_rejected(&r.ex))
}

/// What is dishonest about one response's status and body.
pub(crate) fn status_problems(r: &Record, max_context: usize) -> Vec<(Severity, String)> {
    let ex = &r.ex;
    let mut out = Vec::new();
    if let Some(e) = &ex.transport_error {
        if !ex.cancelled {
            out.push((
                Severity::Failure,
                format!("the connection failed: {}", clip(e, 200)),
            ));
        }
        return out;
    }
    let Some(status) = ex.status else {
        return out;
    };
    if !(200..300).contains(&status) {
        if !ex.error_body_ok {
            out.push((
                Severity::Failure,
                format!(
                    "HTTP {status} without an error body (got {:?})",
                    clip(&ex.raw, 120)
                ),
            ));
        }
        return out;
    }
    if r.kind.over_length() && !stream_rejected(ex) {
        out.push((
            Severity::Failure,
            format!(
                "HTTP {status} for an over-length prompt (advertised context {max_context}) with content {:?}",
                clip(&ex.content, 120)
            ),
        ));
    }
    if let Some(st) = &ex.stream {
        if st.error_events > 1 {
            out.push((
                Severity::Failure,
                format!("{} error events in one stream", st.error_events),
            ));
        }
        if st.events_after_end > 0 {
            out.push((
                Severity::Failure,
                format!(
                    "{} stream events after [DONE] or an error event",
                    st.events_after_end
                ),
            ));
        }
        if st.malformed > 0 {
            out.push((
                Severity::Failure,
                format!("{} stream events that are not JSON", st.malformed),
            ));
        }
        if !ex.cancelled && !st.done && st.error_events == 0 {
            out.push((
                Severity::Failure,
                "the stream ended with neither [DONE] nor an error event: a truncated answer that looks complete".into(),
            ));
        }
        if st.error_events > 0 {
            // An error event ends the request: its partial text is not an answer, and the
            // error said so. Nothing more to check.
            return out;
        }
    } else if ex.error_message.is_some() {
        out.push((
            Severity::Failure,
            format!(
                "HTTP {status} with an error body: {}",
                clip(ex.error_message.as_deref().unwrap_or(""), 160)
            ),
        ));
        return out;
    }
    if ex.cancelled {
        return out;
    }
    let finish = ex.finish_reason.as_deref();
    match finish {
        None => out.push((
            Severity::Failure,
            format!("HTTP {status} without a finish_reason"),
        )),
        Some("stop") | Some("length") => {}
        Some(other) => out.push((
            Severity::Warning,
            format!("unusual finish_reason {other:?}"),
        )),
    }
    let Some(usage) = ex.usage else {
        out.push((Severity::Warning, "no usage reported".into()));
        return out;
    };
    let max = u64::from(r.call.max_tokens);
    if let Some(n) = usage.completion_tokens {
        if n > max {
            out.push((
                Severity::Failure,
                format!("{n} completion tokens for max_tokens {max}"),
            ));
        }
        if finish == Some("length") && n != max {
            out.push((
                Severity::Failure,
                format!(
                    "finish_reason \"length\" after {n} completion tokens, but max_tokens is {max}"
                ),
            ));
        }
        if n == 0 && !ex.content.is_empty() {
            out.push((
                Severity::Failure,
                format!(
                    "0 completion tokens reported for {} bytes of text",
                    ex.content.len()
                ),
            ));
        }
        if let Some(tokens) = &ex.logprob_tokens {
            if tokens.len() as u64 != n {
                out.push((
                    Severity::Failure,
                    format!(
                        "{} logprob tokens but {n} completion tokens reported",
                        tokens.len()
                    ),
                ));
            } else if !tokens.iter().any(|t| t.contains('\u{fffd}'))
                && tokens.concat() != ex.content
            {
                out.push((
                    Severity::Warning,
                    format!(
                        "the logprob tokens spell {:?} but the text is {:?}",
                        clip(&tokens.concat(), 80),
                        clip(&ex.content, 80)
                    ),
                ));
            }
        }
    } else {
        out.push((Severity::Warning, "usage without completion_tokens".into()));
    }
    if let (Prompt::Tokens(ids), Some(p)) = (&r.call.prompt, usage.prompt_tokens) {
        if p != ids.len() as u64 {
            out.push((
                Severity::Warning,
                format!("sent {} prompt tokens, usage says {p}", ids.len()),
            ));
        }
    }
    out
}

/// Every other request's canaries found in what `r` received.
fn scan(
    r: &Record,
    canaries: &[(usize, Canary)],
    records: &[Record],
    tenants: &[String],
) -> Vec<Leak> {
    let lp =
        r.ex.logprob_tokens
            .as_ref()
            .map(|t| t.concat())
            .unwrap_or_default();
    let places: [(&'static str, &str); 4] = [
        ("content", &r.ex.content),
        ("logprobs", &lp),
        ("error message", r.ex.error_message.as_deref().unwrap_or("")),
        ("raw response bytes", &r.ex.raw),
    ];
    let normalized: Vec<(&'static str, &str, Normalized)> = places
        .iter()
        .filter(|(_, t)| !t.is_empty())
        .map(|(n, t)| (*n, *t, Normalized::new(t)))
        .collect();
    let mut seen = HashSet::new();
    let mut out = Vec::new();
    let owner = r.owner();
    for (id, canary) in canaries {
        if *id == owner || seen.contains(id) {
            continue;
        }
        for (place, text, norm) in &normalized {
            if let Some(part) = canary.found_in(norm) {
                seen.insert(*id);
                let canary_tenant = records.iter().find(|x| x.id == *id).map(|x| x.tenant);
                let name = |t: Option<usize>| {
                    t.and_then(|t| tenants.get(t))
                        .cloned()
                        .unwrap_or_else(|| "not yet answered".into())
                };
                out.push(Leak {
                    canary_of: *id,
                    canary_tenant: name(canary_tenant),
                    canary: part.to_owned(),
                    found_in: r.id,
                    found_tenant: name(Some(r.tenant)),
                    cross_tenant: canary_tenant != Some(r.tenant),
                    location: place,
                    status: r.ex.status,
                    excerpt: excerpt(text, part),
                });
                break;
            }
        }
    }
    out
}

/// About 160 characters of `text` around `needle` (or its start if the match was only found
/// after normalization).
fn excerpt(text: &str, needle: &str) -> String {
    let lower = text.to_lowercase();
    let at = lower.find(&needle.to_lowercase()).unwrap_or(0);
    let start = floor_char(text, at.saturating_sub(60));
    let end = floor_char(text, (at + needle.len() + 100).min(text.len()));
    let mut s = String::new();
    if start > 0 {
        s.push('…');
    }
    s.push_str(&text[start..end]);
    if end < text.len() {
        s.push('…');
    }
    s
}

fn floor_char(s: &str, mut i: usize) -> usize {
    i = i.min(s.len());
    while !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

/// At most `n` bytes of `s`, cut on a character boundary.
pub fn clip(s: &str, n: usize) -> String {
    if s.len() <= n {
        s.to_owned()
    } else {
        format!("{}…", &s[..floor_char(s, n)])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use oai_client::{StreamSeen, UsageSeen};

    fn record(
        id: usize,
        tenant: usize,
        kind: Kind,
        ex: Exchange,
        canary: Option<Canary>,
    ) -> Record {
        Record {
            id,
            tenant,
            kind,
            call: Call {
                api: Api::Completions,
                prompt: Prompt::Tokens(vec![100; 10]),
                max_tokens: 4,
                temperature: 0.0,
                stream: false,
                logprobs: false,
                ignore_eos: false,
                cancel_after: None,
                key: None,
            },
            canary,
            replay_of: None,
            ex,
        }
    }

    fn ok(content: &str, finish: &str, completion: u64) -> Exchange {
        Exchange {
            status: Some(200),
            content: content.into(),
            finish_reason: Some(finish.into()),
            usage: Some(UsageSeen {
                prompt_tokens: Some(10),
                completion_tokens: Some(completion),
                cached_tokens: None,
            }),
            ..Default::default()
        }
    }

    #[test]
    fn a_canary_in_another_requests_answer_is_a_leak() {
        let mut mint = CanaryMint::new(Rng::new(1));
        let (ca, cb) = (mint.mint(), mint.mint());
        let tenants = vec!["a".to_owned(), "b".to_owned()];
        let a = record(
            1,
            0,
            Kind::RepeatCompletion,
            ok(&ca.text(), "length", 4),
            Some(ca.clone()),
        );
        let leaked = format!("sure: {} {}", ca.word, ca.digits);
        let b = record(
            2,
            1,
            Kind::OverLength,
            ok(&leaked, "length", 4),
            Some(cb.clone()),
        );
        let canaries = vec![(1, ca.clone()), (2, cb)];
        let records = vec![a.clone(), b.clone()];
        // A's own canary in A's answer is not a leak.
        assert!(scan(&a, &canaries, &records, &tenants).is_empty());
        let leaks = scan(&b, &canaries, &records, &tenants);
        assert_eq!(leaks.len(), 1);
        let l = &leaks[0];
        assert_eq!((l.canary_of, l.found_in, l.cross_tenant), (1, 2, true));
        assert_eq!(l.location, "content");
        assert!(l.excerpt.contains(&ca.digits), "{}", l.excerpt);
        // A replay is the same request: its own canary is not a leak.
        let mut replay = record(3, 0, Kind::Replay, ok(&ca.text(), "length", 4), Some(ca));
        replay.replay_of = Some(1);
        assert!(scan(&replay, &canaries, &records, &tenants).is_empty());
    }

    #[test]
    fn dishonest_statuses_are_named() {
        let good = record(
            1,
            0,
            Kind::RepeatCompletion,
            ok("a b c d", "length", 4),
            None,
        );
        assert!(status_problems(&good, 100).is_empty());
        let short = record(1, 0, Kind::RepeatCompletion, ok("a b", "length", 2), None);
        assert!(status_problems(&short, 100)[0].1.contains("length"));
        let over = record(1, 0, Kind::OneOver, ok("text", "length", 4), None);
        assert!(wrong_status(&over, 100));
        assert!(status_problems(&over, 100)[0].1.contains("over-length"));
        let bare = Exchange {
            status: Some(500),
            raw: "oops".into(),
            ..Default::default()
        };
        assert_eq!(
            status_problems(&record(1, 0, Kind::Document, bare, None), 100)[0].0,
            Severity::Failure
        );
        let truncated = Exchange {
            stream: Some(StreamSeen {
                data_events: 3,
                ..Default::default()
            }),
            ..ok("abc", "length", 4)
        };
        let p = status_problems(&record(1, 0, Kind::Document, truncated, None), 100);
        assert!(
            p.iter()
                .any(|(s, m)| *s == Severity::Failure && m.contains("neither")),
            "{p:?}"
        );
        let refused_in_stream = Exchange {
            status: Some(200),
            error_message: Some("too long".into()),
            stream: Some(StreamSeen {
                data_events: 1,
                error_events: 1,
                ..Default::default()
            }),
            ..Default::default()
        };
        let r = record(1, 0, Kind::OverLength, refused_in_stream, None);
        assert!(status_problems(&r, 100).is_empty() && !wrong_status(&r, 100));
    }

    #[test]
    fn excerpts_and_clips_respect_char_boundaries() {
        let s = "é".repeat(100);
        assert!(clip(&s, 5).ends_with('…'));
        let e = excerpt(&format!("{s} CODE {s}"), "code");
        assert!(e.contains("CODE") && e.starts_with('…'));
    }
}
