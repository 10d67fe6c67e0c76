//! Server-side counters and the Prometheus text rendering of `/metrics`.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use engine::{EngineHandle, EngineMetrics};
use histogram::Histogram;

/// How a request to a generation endpoint ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// EOS, a stop token or a stop string.
    Stop,
    /// `max_tokens` reached.
    Length,
    /// Failed after admission (engine or server fault).
    Error,
    /// The client went away before the end.
    Cancelled,
    /// Refused before reaching the engine (validation, auth, admission).
    Rejected,
}

impl Outcome {
    const ALL: [Outcome; 5] = [
        Outcome::Stop,
        Outcome::Length,
        Outcome::Error,
        Outcome::Cancelled,
        Outcome::Rejected,
    ];

    fn label(self) -> &'static str {
        match self {
            Outcome::Stop => "stop",
            Outcome::Length => "length",
            Outcome::Error => "error",
            Outcome::Cancelled => "cancelled",
            Outcome::Rejected => "rejected",
        }
    }
}

/// Upper bounds in seconds.
const TTFT_BUCKETS: &[f64] = &[
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];
const ITL_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5,
];
/// A constraint compiles in microseconds to about 20 ms (llguidance's compile fuel).
const COMPILE_BUCKETS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
];

/// One LoRA adapter's use, for the operator (`kvwarden_adapter_*`).
#[derive(Debug, Default, Clone, Copy)]
struct AdapterUse {
    requests: u64,
    prompt_tokens: u64,
    generated_tokens: u64,
}

#[derive(Debug)]
pub struct ServerMetrics {
    outcomes: [AtomicU64; 5],
    /// By adapter name: bounded by the adapters the operator loaded.
    adapters: Mutex<BTreeMap<String, AdapterUse>>,
    rejections: Mutex<BTreeMap<&'static str, u64>>,
    pub ttft: Histogram,
    pub itl: Histogram,
    /// Structured outputs' and forced tool calls' compile times, on the prompt workers.
    pub constraint_compile: Histogram,
}

impl Default for ServerMetrics {
    fn default() -> Self {
        Self {
            outcomes: Default::default(),
            adapters: Mutex::default(),
            rejections: Mutex::default(),
            ttft: Histogram::new(TTFT_BUCKETS),
            itl: Histogram::new(ITL_BUCKETS),
            constraint_compile: Histogram::new(COMPILE_BUCKETS),
        }
    }
}

impl ServerMetrics {
    pub fn outcome(&self, outcome: Outcome) {
        let i = Outcome::ALL.iter().position(|&o| o == outcome).unwrap_or(0);
        if let Some(c) = self.outcomes.get(i) {
            c.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// A request refused before the engine, labelled by its error code.
    pub fn rejected(&self, code: &'static str) {
        self.outcome(Outcome::Rejected);
        let mut map = self.rejections.lock().unwrap_or_else(|p| p.into_inner());
        *map.entry(code).or_insert(0) += 1;
    }

    /// A request admitted under adapter `name`, with its prompt's tokens.
    pub fn adapter_request(&self, name: &str, prompt_tokens: usize) {
        let mut map = self.adapters.lock().unwrap_or_else(|p| p.into_inner());
        let u = map.entry(name.to_owned()).or_default();
        u.requests += 1;
        u.prompt_tokens += prompt_tokens as u64;
    }

    /// Tokens a request under adapter `name` generated, once it has ended.
    pub fn adapter_generated(&self, name: &str, tokens: usize) {
        let mut map = self.adapters.lock().unwrap_or_else(|p| p.into_inner());
        map.entry(name.to_owned()).or_default().generated_tokens += tokens as u64;
    }

    /// The text of `/metrics`. `adapter_names`: whether the reader may see every adapter's
    /// name (the operator's own listener, or a server with one tenant): a tenant sees only
    /// the adapters granted to it, even by name, so behind API keys the per-adapter series
    /// are left out.
    pub fn render(&self, backend: &dyn crate::Backend, adapter_names: bool) -> String {
        let mut out = String::with_capacity(4096);
        let counter = |out: &mut String, name: &str, help: &str, ty: &str| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {ty}");
        };

        counter(
            &mut out,
            "kvwarden_requests_total",
            "Generation requests by how their client saw them end (the only count of requests).",
            "counter",
        );
        for (o, c) in Outcome::ALL.iter().zip(&self.outcomes) {
            let _ = writeln!(
                out,
                "kvwarden_requests_total{{outcome=\"{}\"}} {}",
                o.label(),
                c.load(Ordering::Relaxed)
            );
        }
        counter(
            &mut out,
            "kvwarden_rejections_total",
            "Requests refused before reaching the engine, by error code.",
            "counter",
        );
        {
            let map = self.rejections.lock().unwrap_or_else(|p| p.into_inner());
            for (code, n) in map.iter() {
                let _ = writeln!(out, "kvwarden_rejections_total{{reason=\"{code}\"}} {n}");
            }
        }
        if adapter_names {
            let map = self.adapters.lock().unwrap_or_else(|p| p.into_inner());
            for (name, help, get) in [
                (
                    "kvwarden_adapter_requests_total",
                    "Requests admitted under each LoRA adapter.",
                    (|u: &AdapterUse| u.requests) as fn(&AdapterUse) -> u64,
                ),
                (
                    "kvwarden_adapter_prompt_tokens_total",
                    "Prompt tokens of the requests under each LoRA adapter.",
                    |u| u.prompt_tokens,
                ),
                (
                    "kvwarden_adapter_generated_tokens_total",
                    "Tokens generated under each LoRA adapter, counted when a request ends.",
                    |u| u.generated_tokens,
                ),
            ] {
                counter(&mut out, name, help, "counter");
                for (adapter, u) in map.iter() {
                    // Adapter names are checked at load: no quote or backslash to escape.
                    let _ = writeln!(out, "{name}{{adapter=\"{adapter}\"}} {}", get(u));
                }
            }
        }
        self.ttft.render(
            &mut out,
            "kvwarden_time_to_first_token_seconds",
            "From admission to the first generated token.",
        );
        self.itl.render(
            &mut out,
            "kvwarden_inter_token_latency_seconds",
            "Between consecutive tokens of a request.",
        );
        self.constraint_compile.render(
            &mut out,
            "kvwarden_constraint_compile_seconds",
            "Compiling a request's structured output or forced tool call (each request compiles its own).",
        );

        backend.render_metrics(&mut out);
        out
    }
}

/// The local engine's part of `/metrics`: its pool and its own counters.
pub fn render_engine(engine: &EngineHandle, out: &mut String) {
    let counter = |out: &mut String, name: &str, help: &str, ty: &str| {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {ty}");
    };
    {
        let pool = engine.pool_counts();
        counter(out, "kvwarden_kv_pages", "KV pool pages by state.", "gauge");
        for (state, n) in [
            ("total", pool.total),
            ("free", pool.free),
            ("leased", pool.leased),
            ("cached", pool.cached),
        ] {
            let _ = writeln!(out, "kvwarden_kv_pages{{state=\"{state}\"}} {n}");
        }

        let m = engine.metrics();
        let get = EngineMetrics::get;
        counter(
            out,
            "kvwarden_isolation_check_failures_total",
            "KV ownership or extent checks that refused an access (each failed its request).",
            "counter",
        );
        let _ = writeln!(
            out,
            "kvwarden_isolation_check_failures_total {}",
            get(&m.isolation_failures)
        );
        counter(
            out,
            "kvwarden_prompt_tokens_total",
            "Prompt tokens of requests the engine started (once per request).",
            "counter",
        );
        let _ = writeln!(
            out,
            "kvwarden_prompt_tokens_total {}",
            get(&m.prompt_tokens)
        );
        counter(
            out,
            "kvwarden_generation_tokens_total",
            "Tokens the engine generated, including any dropped after a stop string.",
            "counter",
        );
        let _ = writeln!(
            out,
            "kvwarden_generation_tokens_total {}",
            get(&m.generated_tokens)
        );
        counter(
            out,
            "kvwarden_cached_prompt_tokens_total",
            "Prompt tokens served from the requesting domain's prefix cache.",
            "counter",
        );
        let _ = writeln!(
            out,
            "kvwarden_cached_prompt_tokens_total {}",
            get(&m.cached_prompt_tokens)
        );
        counter(
            out,
            "kvwarden_engine_steps_total",
            "Engine forward steps.",
            "counter",
        );
        let _ = writeln!(out, "kvwarden_engine_steps_total {}", get(&m.steps));
        counter(
            out,
            "kvwarden_engine_paused_steps_total",
            "Steps paused between two layers to give a lighter tenant's request its first token.",
            "counter",
        );
        let _ = writeln!(
            out,
            "kvwarden_engine_paused_steps_total {}",
            get(&m.paused_steps)
        );
        counter(
            out,
            "kvwarden_preemptions_total",
            "Requests that gave their KV pages back to let older ones grow, to recompute later.",
            "counter",
        );
        let _ = writeln!(out, "kvwarden_preemptions_total {}", get(&m.preemptions));
        for (name, help, value) in [
            (
                "kvwarden_draft_tokens_total",
                "Speculative decoding: draft tokens verified.",
                get(&m.draft_tokens),
            ),
            (
                "kvwarden_accepted_draft_tokens_total",
                "Speculative decoding: draft tokens kept (each the token plain decoding gives).",
                get(&m.accepted_draft_tokens),
            ),
        ] {
            counter(out, name, help, "counter");
            let _ = writeln!(out, "{name} {value}");
        }
        for (name, help, value) in [
            (
                "kvwarden_constrained_tokens_total",
                "Tokens sampled under a structured output's mask.",
                get(&m.constrained_tokens) as f64,
            ),
            (
                "kvwarden_constraint_mask_seconds_total",
                "Time spent computing structured outputs' masks, on a thread beside the forward pass.",
                get(&m.mask_micros) as f64 / 1e6,
            ),
            (
                "kvwarden_constraint_mask_wait_seconds_total",
                "Time the engine waited for masks after its forward pass had finished.",
                get(&m.mask_wait_micros) as f64 / 1e6,
            ),
        ] {
            counter(out, name, help, "counter");
            let _ = writeln!(out, "{name} {value}");
        }
        counter(
            out,
            "kvwarden_requests_running",
            "Requests holding KV pages.",
            "gauge",
        );
        let _ = writeln!(out, "kvwarden_requests_running {}", get(&m.running));
        counter(
            out,
            "kvwarden_requests_waiting",
            "Admitted requests waiting for KV pages.",
            "gauge",
        );
        let _ = writeln!(out, "kvwarden_requests_waiting {}", get(&m.waiting));
    }
}
