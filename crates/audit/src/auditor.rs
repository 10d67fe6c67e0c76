//! The auditor's state, and how it sends requests: planned, at most `concurrency` at once,
//! each answer inspected for leaks and dishonest statuses the moment it arrives.

use std::sync::{Arc, Mutex};

use serde_json::Value;

use crate::canary::{Canary, CanaryMint};
use crate::config::Config;
use crate::inspect::{scan, wrong_status};
use crate::progress::Progress;
use crate::record::Record;
use crate::report::{CheckName, Finding, Kind, Leak, Severity};
use oai_client::Rng;
use oai_client::{Api, Call, Client, Exchange, Prompt};

/// An identity that sends requests: an API key, or a synthetic label on a keyless server.
#[derive(Debug, Clone)]
pub struct Tenant {
    pub name: String,
    pub key: Option<String>,
    /// The model this identity asks for, where it differs from the audit's (an adapter).
    pub model: Option<String>,
}

/// A request planned but not yet sent.
#[derive(Debug, Clone)]
pub(crate) struct Planned {
    pub(crate) tenant: usize,
    pub(crate) kind: Kind,
    pub(crate) call: Call,
    pub(crate) canary: Option<Canary>,
    pub(crate) replay_of: Option<usize>,
}

/// Shared state while requests are in flight.
pub(crate) struct Ledger {
    pub(crate) records: Vec<Record>,
    /// Every canary of the run, known before the first request, so leaks are seen live.
    pub(crate) canaries: Vec<(usize, Canary)>,
    pub(crate) next_id: usize,
    pub(crate) leaks: Vec<Leak>,
    pub(crate) wrong_statuses: usize,
}

pub struct Auditor {
    pub(crate) client: Arc<Client>,
    pub(crate) config: Config,
    pub(crate) tenants: Vec<Tenant>,
    pub(crate) real_tenants: bool,
    pub(crate) max_context: usize,
    pub(crate) context_source: String,
    pub(crate) health: Value,
    pub(crate) ledger: Arc<Mutex<Ledger>>,
    pub(crate) progress: Progress,
    pub(crate) rng: Rng,
    pub(crate) mint: CanaryMint,
    pub(crate) findings: Vec<Finding>,
    /// Bytes per token of canary text, measured on the server (1.0 until measured: no
    /// token is shorter than one byte, so byte counts never overshoot).
    pub(crate) bytes_per_token: f64,
    /// Filler words per token, measured likewise (1.0 until measured: a word is at least a
    /// token).
    pub(crate) words_per_token: f64,
}

pub(crate) fn lock(l: &Mutex<Ledger>) -> std::sync::MutexGuard<'_, Ledger> {
    // A panic in a request task cannot leave the ledger half-written (every update is one
    // push), so a poisoned lock is still usable.
    l.lock().unwrap_or_else(|p| p.into_inner())
}

impl Auditor {
    pub fn max_context(&self) -> usize {
        self.max_context
    }

    pub(crate) fn enabled(&self, c: CheckName) -> bool {
        self.config.checks.contains(&c)
    }

    pub(crate) fn call(&self, api: Api, prompt: Prompt, tenant: usize) -> Call {
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
            extra: match &self.tenants[tenant].model {
                Some(model) => [("model".to_string(), model.clone().into())]
                    .into_iter()
                    .collect(),
                None => Default::default(),
            },
        }
    }

    /// An over-length prompt asks for enough tokens that, were it wrongly answered from
    /// someone else's K/V, a whole canary (about 18 tokens of word and digits) would fit in
    /// the answer. A correct server refuses it before generating anything.
    pub(crate) fn over_length_call(&self, api: Api, prompt: String, tenant: usize) -> Call {
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
    pub(crate) async fn send_all(&self, planned: Vec<Planned>, concurrency: usize) -> Vec<usize> {
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

    pub(crate) async fn send_one(&self, p: Planned) -> Record {
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

    pub(crate) fn record(&self, id: usize) -> Option<Record> {
        lock(&self.ledger)
            .records
            .iter()
            .find(|r| r.id == id)
            .cloned()
    }

    pub(crate) fn find(
        &mut self,
        check: CheckName,
        severity: Severity,
        request: Option<usize>,
        msg: String,
    ) {
        self.findings.push(Finding {
            check,
            severity,
            message: msg,
            request,
        });
    }
}
