//! The client side of the engine: the startup checks, and the handles that submit requests
//! to the engine thread ([`crate::worker`]) and receive their events.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};

use kv::{KvPool, PoolConfig, PoolCounts, PrefixCache, PublicPrefixes, RequestId};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};
use tokio::sync::oneshot;

use crate::admission::{Admission, Admitted};
use crate::command::{Command, Lifecycle};
use crate::config::EngineConfig;
use crate::handoff::{ImportReservation, ReserveError, VerifiedImport};
use crate::slot::{Places, QueueFull, Slot};
use crate::worker::Worker;
use crate::{EngineError, EngineMetrics, Event, SharedMetrics, StepModel};

/// Reasons a node refuses to start.
#[derive(Debug, thiserror::Error)]
pub enum StartupError {
    #[error("--max-context {context} exceeds the KV pool capacity of {pool} tokens: a request of the advertised length could not be held. Enlarge the pool (--kv-pool-tokens or --kv-pool-mib) to at least {context} tokens or lower --max-context.")]
    ContextExceedsPool { context: usize, pool: usize },
    #[error("--max-context {context} exceeds the model's context length of {model}")]
    ContextExceedsModel { context: usize, model: usize },
    #[error("invalid engine configuration: {0}")]
    Config(String),
}

/// Clears `alive` when the engine thread ends, by return or by panic.
struct AliveGuard(Arc<Lifecycle>);

impl Drop for AliveGuard {
    fn drop(&mut self) {
        self.0.alive.store(false, Ordering::Release);
    }
}

/// The client side of one request: its events, in order, ending with `Finished` or
/// `Failed`. Dropping it cancels the request.
///
/// The event channel is unbounded on purpose: the engine thread must never wait for a slow
/// client. It is bounded all the same, by the request: at most one event per completion
/// token plus the terminal one, and `max_tokens` is within the advertised context.
#[derive(Debug)]
pub struct RequestHandle {
    pub id: RequestId,
    pub events: UnboundedReceiver<Event>,
}

/// A cheap, cloneable handle to a running engine.
#[derive(Clone)]
pub struct EngineHandle {
    /// Bounded: it never holds more than the requests the engine has places for.
    commands: mpsc::SyncSender<Command>,
    admission: Admission,
    pool: KvPool,
    /// The draft model's pool, when drafts come from one.
    draft_pool: Option<KvPool>,
    metrics: SharedMetrics,
    next_id: Arc<std::sync::atomic::AtomicU64>,
    /// Requests submitted and not yet ended, by tenant, and the most there may be.
    places: Arc<Places>,
    lifecycle: Arc<Lifecycle>,
}

impl EngineHandle {
    pub fn admission(&self) -> &Admission {
        &self.admission
    }

    pub fn max_context(&self) -> usize {
        self.admission.max_context()
    }

    /// The KV pool's accounting. Only the counts: the pool itself can allocate, which only
    /// the engine thread may do.
    ///
    /// ```compile_fail
    /// fn grab(engine: &engine::EngineHandle) {
    ///     let _ = engine.pool();
    /// }
    /// ```
    pub fn pool_counts(&self) -> PoolCounts {
        self.pool.counts()
    }

    /// The draft model's pool's accounting, when drafts come from a draft model.
    pub fn draft_pool_counts(&self) -> Option<PoolCounts> {
        self.draft_pool.as_ref().map(KvPool::counts)
    }

    pub fn metrics(&self) -> &EngineMetrics {
        &self.metrics
    }

    /// False once the engine thread has ended (shut down, or died of a fault it could not
    /// recover from): nothing submitted will run.
    pub fn is_alive(&self) -> bool {
        self.lifecycle.alive.load(Ordering::Acquire)
    }

    /// A place in the engine for a request of `domain`'s tenant, or `QueueFull` when the
    /// engine already holds `max_running + max_waiting` requests (reservations included) or
    /// that tenant holds its share of them (`crate::slot`).
    fn take_slot(&self, domain: &kv::IsolationDomain) -> Result<Slot, QueueFull> {
        self.places.take(domain.tenant_name())
    }

    fn next_id(&self) -> RequestId {
        RequestId(self.next_id.fetch_add(1, Ordering::Relaxed))
    }

    /// Sends a command that carries a request's event sender. If the engine is gone, the
    /// stream carries a single `Failed(Shutdown)`.
    fn send_with_events(
        &self,
        id: RequestId,
        command: Command,
        rx: UnboundedReceiver<Event>,
    ) -> Result<RequestHandle, QueueFull> {
        match self.commands.try_send(command) {
            Ok(()) => {}
            Err(mpsc::TrySendError::Disconnected(
                Command::Submit { events, .. } | Command::SubmitImport { events, .. },
            )) => {
                let _ = events.send(Event::Failed(EngineError::Shutdown));
            }
            // The channel has a place for every slot, so this cannot happen; the command
            // (and its slot) is dropped, and the client is told to retry.
            Err(mpsc::TrySendError::Full(_)) => {
                return Err(QueueFull::Full {
                    limit: self.places.capacity(),
                })
            }
            Err(mpsc::TrySendError::Disconnected(_)) => {}
        }
        Ok(RequestHandle { id, events: rx })
    }

    /// Hands an admitted request to the engine, or refuses it when the engine already holds
    /// `max_running + max_waiting` requests. If the engine is gone, the stream carries a
    /// single `Failed(Shutdown)`.
    pub fn submit(&self, admitted: Admitted) -> Result<RequestHandle, QueueFull> {
        self.submit_with(admitted, false)
    }

    /// Prefill role: runs the prompt, samples the first token, and ends the request with
    /// [`Event::Prefilled`] carrying the prompt's K/V. Its pages are then released (or
    /// kept by the prefix cache of the request's own domain).
    pub fn submit_prefill(&self, admitted: Admitted) -> Result<RequestHandle, QueueFull> {
        self.submit_with(admitted, true)
    }

    fn submit_with(
        &self,
        admitted: Admitted,
        prefill_only: bool,
    ) -> Result<RequestHandle, QueueFull> {
        let slot = self.take_slot(&admitted.request.domain)?;
        let id = self.next_id();
        let (tx, rx) = unbounded_channel();
        let command = Command::Submit {
            id,
            admitted,
            events: tx,
            slot,
            prefill_only,
        };
        self.send_with_events(id, command, rx)
    }

    /// Decode role: reserves pages for the prompt of `admitted`, whose K/V another node
    /// will send. Waits while the pool is full; gives up when the returned future is
    /// dropped.
    pub async fn reserve_import(
        &self,
        admitted: Admitted,
        request_id: String,
    ) -> Result<ImportReservation, ReserveError> {
        let slot = self.take_slot(&admitted.request.domain)?;
        let (reply, answer) = oneshot::channel();
        let command = Command::Reserve {
            id: self.next_id(),
            admitted,
            request_id,
            slot,
            reply,
        };
        match self.commands.try_send(command) {
            Ok(()) => {}
            Err(mpsc::TrySendError::Full(_)) => {
                return Err(ReserveError::Full(QueueFull::Full {
                    limit: self.places.capacity(),
                }))
            }
            Err(mpsc::TrySendError::Disconnected(_)) => {
                return Err(ReserveError::Engine(EngineError::Shutdown))
            }
        }
        answer
            .await
            .unwrap_or(Err(ReserveError::Engine(EngineError::Shutdown)))
    }

    /// Decode role: runs a verified sequence; its first event is the prefill node's first
    /// token.
    pub fn submit_import(&self, verified: VerifiedImport) -> Result<RequestHandle, QueueFull> {
        let id = verified.id;
        let (tx, rx) = unbounded_channel();
        let command = Command::SubmitImport {
            verified: Box::new(verified),
            events: tx,
        };
        self.send_with_events(id, command, rx)
    }

    /// Asks the engine to end every request with `Failed(Shutdown)` and stop.
    pub fn shutdown(&self) {
        self.lifecycle.stopping.store(true, Ordering::Release);
        // A wake-up for an idle engine; a full channel means it is busy and will see the
        // flag at its next step.
        let _ = self.commands.try_send(Command::Shutdown);
    }
}

/// Checks the capacity promise, allocates the pool and starts the engine thread.
///
/// A panic inside a forward step fails that step's requests (HTTP 500) and the engine goes
/// on: the model keeps no state between steps, and the failed requests' pages are dropped.
/// After several consecutive steps that panic, the engine fails every request and stops,
/// and [`EngineHandle::is_alive`] turns false. A panic anywhere else ends the engine
/// thread the same way.
pub fn start(model: impl StepModel, config: EngineConfig) -> Result<EngineHandle, StartupError> {
    start_with_draft(model, None, config)
}

/// [`start`], with the drafts of speculative decoding proposed by `draft` instead of by
/// prompt lookup. Refused unless the two models have one vocabulary size (the server
/// checks the tokens themselves) and the draft model's K/V can be stored as `kv_dtype`.
pub fn start_with_draft(
    model: impl StepModel,
    draft: Option<crate::DraftModel>,
    config: EngineConfig,
) -> Result<EngineHandle, StartupError> {
    if !kv::CHECKS_ENABLED {
        return Err(StartupError::Config(
            "this build has the KV read checks compiled out (benchmark-only feature); it must not serve".into(),
        ));
    }
    if config.page_tokens == 0 || config.max_batch_tokens == 0 || config.max_running == 0 {
        return Err(StartupError::Config(
            "page size, batch tokens and running limit must be positive".into(),
        ));
    }
    let per_element = config.kv_dtype.values_per_element();
    let draft_config = draft.as_ref().map(|d| d.model.config());
    for (whose, c) in [
        ("this model", Some(model.config())),
        ("the draft model", draft_config),
    ] {
        let Some(c) = c else { continue };
        if !c.head_dim.is_multiple_of(per_element) {
            return Err(StartupError::Config(format!(
                "--kv-dtype {} stores K/V in blocks of {per_element} values; {whose}'s attention heads have {}",
                config.kv_dtype.name(),
                c.head_dim
            )));
        }
    }
    if let Some(d) = draft_config {
        if d.vocab_size != model.config().vocab_size {
            return Err(StartupError::Config(format!(
                "the draft model has a vocabulary of {} tokens, the model {}: drafts must be the model's own tokens",
                d.vocab_size,
                model.config().vocab_size
            )));
        }
    }
    let pages = config.pool_tokens.div_ceil(config.page_tokens);
    let pool_tokens = pages * config.page_tokens;
    let model_context = model.config().context_length;
    let max_context = match config.max_context {
        None => model_context.min(pool_tokens),
        Some(c) if c > pool_tokens => {
            return Err(StartupError::ContextExceedsPool {
                context: c,
                pool: pool_tokens,
            })
        }
        Some(c) if c > model_context => {
            return Err(StartupError::ContextExceedsModel {
                context: c,
                model: model_context,
            })
        }
        Some(c) => c,
    };
    let pool = KvPool::new(PoolConfig {
        layout: model.kv_layout(config.page_tokens, config.kv_dtype),
        pages,
        scrub: config.scrub,
    });
    let admission = Admission::new(max_context, model.config().vocab_size);
    let capacity = config.max_running.saturating_add(config.max_waiting);
    // A place for every request the engine may hold, and one for a shutdown wake-up.
    let (tx, rx) = mpsc::sync_channel(capacity.saturating_add(1));
    let lifecycle = Arc::new(Lifecycle {
        stopping: AtomicBool::new(false),
        alive: AtomicBool::new(true),
    });
    let metrics: SharedMetrics = Arc::default();
    let cache = config.prefix_cache.then(|| {
        PrefixCache::with_public_prefixes(
            config.page_tokens,
            PublicPrefixes::new(config.public_prefixes.clone()),
        )
    });
    let draft = draft.map(|d| {
        let draft_pool = KvPool::new(PoolConfig {
            layout: d.model.kv_layout(config.page_tokens, config.kv_dtype),
            pages: d.pool_tokens.div_ceil(config.page_tokens).max(1),
            scrub: config.scrub,
        });
        let cost = d.relative_cost.unwrap_or_else(|| {
            let measured = crate::speculation::relative_step_cost(
                d.model.as_ref(),
                &draft_pool,
                &model,
                &pool,
            );
            tracing::info!("a draft model step costs {measured:.2} of the model's");
            measured
        });
        if config.speculation.mode == crate::SpeculationMode::Auto
            && !config.speculation.can_pay(cost)
        {
            tracing::warn!(
                "at {cost:.2} of the model's step, no draft of the draft model can pay: --speculation auto will not draft with it (on forces it)"
            );
        }
        (d.model, draft_pool, cost.max(0.0))
    });
    let draft_pool = draft.as_ref().map(|(_, pool, _)| pool.clone());
    let worker = Worker::new(
        Box::new(model),
        pool.clone(),
        config,
        metrics.clone(),
        cache,
        lifecycle.clone(),
        draft,
    );
    let guard = AliveGuard(lifecycle.clone());
    std::thread::Builder::new()
        .name("kvwarden-engine".into())
        .spawn(move || {
            let _guard = guard;
            worker.run(rx)
        })
        .map_err(|e| StartupError::Config(format!("cannot start engine thread: {e}")))?;
    Ok(EngineHandle {
        commands: tx,
        admission,
        pool,
        draft_pool,
        metrics,
        next_id: Arc::new(std::sync::atomic::AtomicU64::new(1)),
        places: Places::new(capacity),
        lifecycle,
    })
}
