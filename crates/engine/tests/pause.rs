//! A step pauses between its layers for a tenant running fewer requests than the heaviest:
//! that tenant's first token comes while the paused step is still in its forward pass, the
//! heaviest tenant's request waits for a normal step, a decode node's reservation and
//! imported first token do not wait either, and no request's tokens or log-probabilities
//! change.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use engine::{EngineConfig, EngineHandle, Event, GenerateRequest, IsolationDomain, SamplingParams};
use gguf::GgmlType;
use model::synth::SynthSpec;

fn spec() -> SynthSpec {
    SynthSpec::small(7, GgmlType::Q4_1, 4096)
}

fn synth_model() -> model::Model {
    spec().load().unwrap()
}

fn tokenizer() -> std::sync::Arc<tokenizer::Tokenizer> {
    let file = gguf::GgufFile::parse(spec().build().unwrap().to_bytes()).unwrap();
    std::sync::Arc::new(tokenizer::Tokenizer::from_gguf(&file).unwrap())
}

/// How long a held step waits for the test before going on by itself: far longer than any
/// step, so a first token that comes before it ends came from a pause.
const HOLD: Duration = Duration::from_secs(30);

/// The synthetic model, whose first step that decodes `rows` rows or more (while `armed`)
/// is held in its forward pass (calling back between layers, as a long step does) until
/// `release`. Counting the rows holds the step the test means even when the engine ran a
/// smaller decode step before the test had submitted every request (a stalled test thread).
struct Held {
    inner: model::Model,
    rows: usize,
    armed: AtomicBool,
    release: Arc<AtomicBool>,
    entered: Mutex<mpsc::Sender<()>>,
}

impl engine::StepModel for Held {
    fn config(&self) -> &model::LlamaConfig {
        &self.inner.config
    }

    fn kv_layout(&self, page_tokens: usize, dtype: kv::KvDtype) -> kv::KvLayout {
        self.inner.kv_layout(page_tokens, dtype)
    }

    fn forward(
        &self,
        items: &mut [model::BatchItem<'_>],
    ) -> Vec<Result<model::Logits, model::ModelError>> {
        self.inner.forward(items)
    }

    fn forward_yielding(
        &self,
        items: &mut [model::BatchItem<'_>],
        between_layers: &mut (dyn FnMut() + Send),
    ) -> Vec<Result<model::Logits, model::ModelError>> {
        // The first step that only decodes `rows` rows: every one of them has had its
        // first token, and none can have finished before it.
        let decoding = items.len() >= self.rows && items.iter().all(|i| i.tokens.len() == 1);
        if decoding && self.armed.swap(false, Ordering::SeqCst) {
            let _ = self.entered.lock().unwrap().send(());
            let deadline = Instant::now() + HOLD;
            while !self.release.load(Ordering::SeqCst) && Instant::now() < deadline {
                between_layers();
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        self.inner.forward_yielding(items, between_layers)
    }
}

/// An engine over [`Held`], armed from the start, and its controls: see the step held,
/// release it.
struct HeldEngine {
    engine: EngineHandle,
    release: Arc<AtomicBool>,
    entered: Mutex<mpsc::Receiver<()>>,
}

impl HeldEngine {
    /// Holds the first step that decodes `rows` rows or more.
    fn start(rows: usize) -> Self {
        Self::start_with(EngineConfig::default(), rows)
    }

    /// Speculation is off: the held step is the first whose rows each decode one token, and
    /// `Auto` drafts for a step with nothing else to do, so once a synthetic model's
    /// repetitive output gave prompt lookup its drafts the step to hold never came (it
    /// timed out in a CI run on a busy 2-core machine).
    fn start_with(mut config: EngineConfig, rows: usize) -> Self {
        config.speculation.mode = engine::SpeculationMode::Off;
        let release = Arc::<AtomicBool>::default();
        let (entered_tx, entered) = mpsc::channel();
        let engine = engine::start(
            Held {
                inner: synth_model(),
                rows: rows.max(2),
                armed: AtomicBool::new(true),
                release: Arc::clone(&release),
                entered: Mutex::new(entered_tx),
            },
            config,
        )
        .unwrap();
        HeldEngine {
            engine,
            release,
            entered: Mutex::new(entered),
        }
    }

    /// Waits until the engine's first step that decodes the armed rows is held.
    fn wait_held(&self) {
        let entered = self.entered.lock().unwrap();
        entered.recv_timeout(HOLD).expect("a step held");
    }
}

/// Bob's request: a structured output (its first mask is computed in the pause).
fn bob_request() -> GenerateRequest {
    let tok = tokenizer();
    let vocab = constraint::Vocabulary::new(tok.clone(), spec().vocab, tok.eos_id());
    let choice = constraint::ConstraintSpec::Choice(vec!["alpha".into(), "beta".into()]);
    GenerateRequest {
        constraint: Some(vocab.compile(&choice).unwrap()),
        ..request("bob", 9, 4)
    }
}

fn request(tenant: &str, seed: u32, max_tokens: usize) -> GenerateRequest {
    let prompt = (0..12 + seed)
        .map(|i| (seed * 31 + i * 7) % 250 + 3)
        .collect();
    GenerateRequest {
        adapter: None,
        weight: 1,
        domain: IsolationDomain::tenant(tenant),
        prompt,
        max_tokens,
        sampling: SamplingParams::default(),
        ignore_eos: true,
        logprobs: Some(2),
        constraint: None,
    }
}

/// A request's events, forwarded to a channel that can be waited on with a timeout.
fn events_of(engine: &EngineHandle, r: GenerateRequest) -> mpsc::Receiver<Event> {
    let mut handle = engine.submit(engine.admission().admit(r).unwrap()).unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        while let Some(ev) = handle.events.blocking_recv() {
            if tx.send(ev).is_err() {
                return;
            }
        }
    });
    rx
}

/// Token ids and log-probability bits up to the terminal event.
fn rest(rx: &mpsc::Receiver<Event>, mut tokens: Vec<(u32, u32)>) -> Vec<(u32, u32)> {
    loop {
        match rx.recv_timeout(HOLD * 2).expect("an event") {
            Event::Token(t) => tokens.push((t.id, t.logprob.unwrap().to_bits())),
            Event::Finished { .. } => return tokens,
            other => panic!("unexpected event {other:?}"),
        }
    }
}

fn token(ev: Event) -> (u32, u32) {
    match ev {
        Event::Token(t) => (t.id, t.logprob.unwrap().to_bits()),
        other => panic!("expected a token, got {other:?}"),
    }
}

#[test]
fn a_lighter_tenants_first_token_comes_while_a_busy_step_is_paused() {
    let held = HeldEngine::start(4);
    let engine = &held.engine;

    // Alice's three requests and one of Carol's decode together; their first such step
    // is held.
    let mut running: Vec<_> = (0..3)
        .map(|i| events_of(engine, request("alice", i, 200)))
        .collect();
    running.push(events_of(engine, request("carol", 4, 200)));
    let firsts: Vec<_> = running
        .iter()
        .map(|rx| token(rx.recv_timeout(HOLD).expect("a first token")))
        .collect();
    held.wait_held();

    // Bob runs nothing and Carol one request, fewer than Alice: their requests start in a
    // pause of the held step. Alice's fourth waits for a normal step: she is the heaviest.
    let alice_later = events_of(engine, request("alice", 3, 6));
    let bob = events_of(engine, bob_request());
    let carol = events_of(engine, request("carol", 5, 5));
    let bob_first = bob
        .recv_timeout(HOLD / 2)
        .expect("Bob's first token while Alice's step is held");
    let carol_first = carol
        .recv_timeout(HOLD / 2)
        .expect("Carol's second request's first token while the step is held");
    assert!(
        matches!(alice_later.try_recv(), Err(mpsc::TryRecvError::Empty)),
        "the heaviest tenant's request started in a pause"
    );
    assert!(engine.metrics().paused_steps.load(Ordering::Relaxed) >= 1);
    held.release.store(true, Ordering::SeqCst);

    let bob_tokens = rest(&bob, vec![token(bob_first)]);
    let carol_tokens = rest(&carol, vec![token(carol_first)]);
    let running_tokens: Vec<_> = running
        .iter()
        .zip(firsts)
        .map(|(rx, first)| rest(rx, vec![first]))
        .collect();
    let later_tokens = rest(&alice_later, Vec::new());

    // Each request alone, on an engine that never pauses: the same bits.
    let alone = engine::start(synth_model(), EngineConfig::default()).unwrap();
    let run = |r| rest(&events_of(&alone, r), Vec::new());
    assert_eq!(bob_tokens, run(bob_request()));
    let ids: Vec<u32> = bob_tokens.iter().map(|&(id, _)| id).collect();
    let text = tokenizer().decode(&ids).unwrap();
    assert!(
        "alpha".starts_with(&text) || "beta".starts_with(&text),
        "Bob's constrained answer {text:?}"
    );
    assert_eq!(carol_tokens, run(request("carol", 5, 5)));
    for (i, tokens) in running_tokens.iter().enumerate() {
        let (tenant, seed) = if i < 3 {
            ("alice", i as u32)
        } else {
            ("carol", 4)
        };
        assert_eq!(
            tokens,
            &run(request(tenant, seed, 200)),
            "{tenant}'s request {seed}"
        );
    }
    assert_eq!(later_tokens, run(request("alice", 3, 6)));
    assert_eq!(alone.metrics().paused_steps.load(Ordering::Relaxed), 0);
}

/// With every slot taken by the held step, its pause gives the extra row to a tenant
/// running nothing, not to one already running a request (who would keep it, and leave the
/// next idle tenant waiting for the whole held step).
#[test]
fn a_paused_steps_extra_row_goes_to_a_tenant_running_nothing() {
    let held = HeldEngine::start_with(
        EngineConfig {
            max_running: 4,
            ..EngineConfig::default()
        },
        4,
    );
    let engine = &held.engine;
    let mut running: Vec<_> = (0..3)
        .map(|i| events_of(engine, request("alice", i, 200)))
        .collect();
    running.push(events_of(engine, request("carol", 4, 200)));
    for rx in &running {
        rx.recv_timeout(HOLD).expect("a first token");
    }
    held.wait_held();

    // Carol's second request comes first and runs less than Alice, but Carol already runs
    // one: only Bob, running nothing, takes the one extra row in the pause.
    let carol = events_of(engine, request("carol", 5, 5));
    let bob = events_of(engine, bob_request());
    bob.recv_timeout(HOLD / 2)
        .expect("Bob's first token while the step holds every slot");
    assert!(
        matches!(carol.try_recv(), Err(mpsc::TryRecvError::Empty)),
        "a tenant already running took the extra row in a pause"
    );
    held.release.store(true, Ordering::SeqCst);
    // Carol's request runs once the step ends, and every answer still completes.
    assert_eq!(rest(&carol, Vec::new()).len(), 5);
    rest(&bob, Vec::new());
}

/// Runs `f` on a thread; its result, unless it takes longer than `limit`.
fn within<T: Send + 'static>(limit: Duration, f: impl FnOnce() -> T + Send + 'static) -> Option<T> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(limit).ok()
}

fn block_on<F: std::future::Future>(f: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(f)
}

/// On a decode node, a reservation and an imported sequence's first token do not wait for
/// the step in progress either.
#[test]
fn a_decode_nodes_reservation_and_first_token_do_not_wait_for_a_busy_step() {
    use engine::handoff::{Manifest, PrefillOutput};

    let held = Arc::new(HeldEngine::start(2));
    let decode = &held.engine;
    let prefill = engine::start(synth_model(), EngineConfig::default()).unwrap();

    let alice: Vec<_> = (0..2)
        .map(|i| events_of(decode, request("alice", i, 200)))
        .collect();
    for rx in &alice {
        token(rx.recv_timeout(HOLD).expect("Alice's first token"));
    }
    held.wait_held();

    let bob = request("bob", 5, 5);
    let mut handle = prefill
        .submit_prefill(prefill.admission().admit(bob.clone()).unwrap())
        .unwrap();
    let out: PrefillOutput = match handle.events.blocking_recv() {
        Some(Event::Prefilled(out)) => *out,
        other => panic!("expected the prefilled K/V, got {other:?}"),
    };
    let admitted = decode.admission().admit(bob.clone()).unwrap();
    let reserving = Arc::clone(&held);
    let reservation = within(HOLD / 2, move || {
        block_on(reserving.engine.reserve_import(admitted, "b".into())).unwrap()
    })
    .expect("the reservation while Alice's step is held");
    let manifest = Manifest::describe(reservation.ticket(), "b".into(), bob.domain.clone(), &out);
    let mut transfer = reservation.begin(manifest).unwrap();
    for (i, page) in out.pages.iter().enumerate() {
        let tokens = (out.prompt.len() - i * out.page_tokens).min(out.page_tokens);
        transfer.receive_page(i, tokens, page).unwrap();
    }
    let mut imported = decode.submit_import(transfer.finish().unwrap()).unwrap();
    let (tx, bob_events) = mpsc::channel();
    std::thread::spawn(move || {
        while let Some(ev) = imported.events.blocking_recv() {
            if tx.send(ev).is_err() {
                return;
            }
        }
    });
    let first = bob_events
        .recv_timeout(HOLD / 2)
        .expect("Bob's first token while Alice's step is held");
    held.release.store(true, Ordering::SeqCst);
    let split = rest(&bob_events, vec![token(first)]);

    let alone = engine::start(synth_model(), EngineConfig::default()).unwrap();
    assert_eq!(split, rest(&events_of(&alone, bob), Vec::new()));
    for rx in &alice {
        rest(rx, Vec::new());
    }
}
