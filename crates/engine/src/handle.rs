//! The client side of the engine: configuration, the startup checks, and the handles that
//! submit requests to the engine thread ([`crate::worker`]) and receive their events.

use std::sync::atomic::Ordering;
use std::sync::{mpsc, Arc};

use kv::{
    KvDtype, KvPool, PoolConfig, PoolCounts, PrefixCache, PublicPrefixes, RequestId, ScrubPolicy,
};
use model::Model;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};
use tokio::sync::oneshot;

use crate::admission::{Admission, Admitted};
use crate::handoff::{ImportReservation, VerifiedImport};
use crate::worker::Worker;
use crate::{EngineError, EngineMetrics, Event, SharedMetrics};

#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Advertised context; `None` means min(model context, pool capacity).
    pub max_context: Option<usize>,
    pub pool_tokens: usize,
    pub page_tokens: usize,
    pub kv_dtype: KvDtype,
    pub scrub: ScrubPolicy,
    /// Tokens per forward pass (decode rows plus prefill chunks).
    pub max_batch_tokens: usize,
    pub max_running: usize,
    /// Reuse the K/V of earlier prompts within an isolation domain.
    pub prefix_cache: bool,
    /// Token sequences the operator declares public: their pages may be shared across
    /// domains. Everything else is shared only within one domain.
    pub public_prefixes: Vec<Vec<u32>>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            max_context: None,
            pool_tokens: 16_384,
            page_tokens: 16,
            kv_dtype: KvDtype::F16,
            scrub: ScrubPolicy::Zero,
            max_batch_tokens: 512,
            max_running: 32,
            prefix_cache: true,
            public_prefixes: Vec::new(),
        }
    }
}

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

pub(crate) enum Command {
    Submit {
        id: RequestId,
        admitted: Admitted,
        events: UnboundedSender<Event>,
        /// Prefill role: stop after the first token and hand over the prompt's K/V.
        prefill_only: bool,
    },
    /// Decode role: reserve pages for a prompt whose K/V another node will send.
    Reserve {
        id: RequestId,
        admitted: Admitted,
        request_id: String,
        reply: oneshot::Sender<Result<ImportReservation, EngineError>>,
    },
    /// Decode role: run a received, verified sequence from its first token on.
    SubmitImport {
        verified: VerifiedImport,
        events: UnboundedSender<Event>,
    },
    Shutdown,
}

/// The client side of one request: its events, in order, ending with `Finished` or
/// `Failed`. Dropping it cancels the request.
pub struct RequestHandle {
    pub id: RequestId,
    pub events: UnboundedReceiver<Event>,
}

/// A cheap, cloneable handle to a running engine.
#[derive(Clone)]
pub struct EngineHandle {
    commands: mpsc::Sender<Command>,
    admission: Admission,
    pool: KvPool,
    metrics: SharedMetrics,
    next_id: Arc<std::sync::atomic::AtomicU64>,
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

    pub fn metrics(&self) -> &EngineMetrics {
        &self.metrics
    }

    fn next_id(&self) -> RequestId {
        RequestId(self.next_id.fetch_add(1, Ordering::Relaxed))
    }

    /// Sends a command that carries a request's event sender; if the engine is gone, the
    /// stream carries a single `Failed(Shutdown)`.
    fn send_with_events(
        &self,
        id: RequestId,
        command: Command,
        rx: UnboundedReceiver<Event>,
    ) -> RequestHandle {
        if let Err(mpsc::SendError(
            Command::Submit { events, .. } | Command::SubmitImport { events, .. },
        )) = self.commands.send(command)
        {
            let _ = events.send(Event::Failed(EngineError::Shutdown));
        }
        RequestHandle { id, events: rx }
    }

    /// Hands an admitted request to the engine. If the engine is gone, the stream carries
    /// a single `Failed(Shutdown)`.
    pub fn submit(&self, admitted: Admitted) -> RequestHandle {
        self.submit_with(admitted, false)
    }

    /// Prefill role: runs the prompt, samples the first token, and ends the request with
    /// [`Event::Prefilled`] carrying the prompt's K/V. Its pages are then released (or
    /// kept by the prefix cache of the request's own domain).
    pub fn submit_prefill(&self, admitted: Admitted) -> RequestHandle {
        self.submit_with(admitted, true)
    }

    fn submit_with(&self, admitted: Admitted, prefill_only: bool) -> RequestHandle {
        let id = self.next_id();
        let (tx, rx) = unbounded_channel();
        let command = Command::Submit {
            id,
            admitted,
            events: tx,
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
    ) -> Result<ImportReservation, EngineError> {
        let (reply, answer) = oneshot::channel();
        let command = Command::Reserve {
            id: self.next_id(),
            admitted,
            request_id,
            reply,
        };
        if self.commands.send(command).is_err() {
            return Err(EngineError::Shutdown);
        }
        answer.await.unwrap_or(Err(EngineError::Shutdown))
    }

    /// Decode role: runs a verified sequence; its first event is the prefill node's first
    /// token.
    pub fn submit_import(&self, verified: VerifiedImport) -> RequestHandle {
        let id = verified.id;
        let (tx, rx) = unbounded_channel();
        let command = Command::SubmitImport {
            verified,
            events: tx,
        };
        self.send_with_events(id, command, rx)
    }

    pub fn shutdown(&self) {
        let _ = self.commands.send(Command::Shutdown);
    }
}

/// Checks the capacity promise, allocates the pool and starts the engine thread.
pub fn start(model: Model, config: EngineConfig) -> Result<EngineHandle, StartupError> {
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
    let pages = config.pool_tokens.div_ceil(config.page_tokens);
    let pool_tokens = pages * config.page_tokens;
    let model_context = model.config.context_length;
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
    let admission = Admission::new(max_context, model.config.vocab_size);
    let (tx, rx) = mpsc::channel();
    let metrics: SharedMetrics = Arc::default();
    let cache = config.prefix_cache.then(|| {
        PrefixCache::with_public_prefixes(
            config.page_tokens,
            PublicPrefixes::new(config.public_prefixes.clone()),
        )
    });
    let worker = Worker::new(model, pool.clone(), config, metrics.clone(), cache);
    std::thread::Builder::new()
        .name("kvwarden-engine".into())
        .spawn(move || worker.run(rx))
        .map_err(|e| StartupError::Config(format!("cannot start engine thread: {e}")))?;
    Ok(EngineHandle {
        commands: tx,
        admission,
        pool,
        metrics,
        next_id: Arc::new(std::sync::atomic::AtomicU64::new(1)),
    })
}
