//! The engine end to end on a synthetic model: batching never changes a request's tokens,
//! the prefix cache is scoped to a domain, cancellation and completion return every page.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use engine::{
    EngineConfig, EngineError, EngineHandle, Event, FinishReason, GenerateRequest, IsolationDomain,
    QueueFull, SamplingParams, StartupError,
};
use gguf::GgmlType;
use kv::ScrubPolicy;
use model::synth::SynthSpec;

fn synth_model(context: usize) -> model::Model {
    SynthSpec::small(7, GgmlType::Q4_1, context).load().unwrap()
}

/// An engine over the synthetic model (no prefix cache) whose every step's batch (the
/// tokens of each item) is recorded.
fn recording_engine() -> (EngineHandle, Steps) {
    let (engine, steps, _) = recording_engine_with(None);
    (engine, steps)
}

/// [`recording_engine`], whose first step is held until the returned flag is set once
/// `hold` (where given) has been told it started: a test can queue requests behind a step
/// that has certainly begun, however long its own thread stalls.
fn recording_engine_with(
    hold: Option<std::sync::mpsc::Sender<()>>,
) -> (EngineHandle, Steps, Arc<AtomicBool>) {
    let steps = Steps::default();
    let release = Arc::<AtomicBool>::default();
    let engine = engine::start(
        Faulty {
            inner: synth_model(4096),
            panics: Arc::default(),
            steps: steps.clone(),
            hold_first: std::sync::Mutex::new(hold.map(|h| (h, release.clone()))),
        },
        EngineConfig {
            prefix_cache: false,
            ..EngineConfig::default()
        },
    )
    .unwrap();
    (engine, steps, release)
}

/// Each step's rows, by their tokens.
type Steps = Arc<std::sync::Mutex<Vec<Vec<Vec<u32>>>>>;

/// Each recorded step's rows, by how many tokens each fed.
fn sizes(steps: &Steps) -> Vec<Vec<usize>> {
    let steps = steps.lock().unwrap();
    steps
        .iter()
        .map(|s| s.iter().map(Vec::len).collect())
        .collect()
}

fn start(config: EngineConfig) -> EngineHandle {
    engine::start(synth_model(4096), config).unwrap()
}

fn request(domain: &str, prompt: Vec<u32>, max_tokens: usize) -> GenerateRequest {
    GenerateRequest {
        adapter: None,
        weight: 1,
        domain: IsolationDomain::tenant(domain),
        prompt,
        max_tokens,
        sampling: SamplingParams::default(),
        ignore_eos: true,
        logprobs: Some(2),
        constraint: None,
    }
}

#[derive(Debug, PartialEq)]
struct Output {
    tokens: Vec<(u32, u32)>,
    finish: FinishReason,
    cached: usize,
}

fn collect(mut handle: engine::RequestHandle) -> Output {
    let mut tokens = Vec::new();
    loop {
        match handle.events.blocking_recv() {
            Some(Event::Token(t)) => tokens.push((t.id, t.logprob.unwrap().to_bits())),
            Some(Event::Finished { reason, usage }) => {
                return Output {
                    tokens,
                    finish: reason,
                    cached: usage.cached_tokens,
                }
            }
            Some(Event::Failed(e)) => panic!("request failed: {e}"),
            Some(Event::Prefilled(_)) => panic!("a client request ended as a prefill"),
            None => panic!("stream ended without a terminal event"),
        }
    }
}

fn run(engine: &EngineHandle, req: GenerateRequest) -> Output {
    collect(
        engine
            .submit(engine.admission().admit(req).unwrap())
            .unwrap(),
    )
}

fn prompt(seed: u32, len: usize) -> Vec<u32> {
    (0..len as u32)
        .map(|i| 3 + (i * 31 + seed * 17) % 250)
        .collect()
}

/// Waits until `slots` requests run (a flood has filled the slots).
fn wait_for_running(engine: &EngineHandle, slots: u64) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while engine.metrics().running.load(Ordering::Relaxed) < slots {
        assert!(
            Instant::now() < deadline,
            "the flood never filled the {slots} slots"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn wait_for_no_leases(engine: &EngineHandle) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while engine.pool_counts().leased != 0 {
        assert!(
            Instant::now() < deadline,
            "pages still leased: {:?}",
            engine.pool_counts()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn batched_output_is_identical_to_solo_output() {
    let config = EngineConfig {
        pool_tokens: 4096,
        scrub: ScrubPolicy::Poison,
        prefix_cache: false,
        max_batch_tokens: 64,
        ..EngineConfig::default()
    };
    let engine = start(config);
    let requests: Vec<GenerateRequest> = (0..16)
        .map(|i| request("t", prompt(i, 5 + 11 * i as usize), 12))
        .collect();
    let solo: Vec<Output> = requests.iter().map(|r| run(&engine, r.clone())).collect();
    // All at once, submitted in reverse order so batch composition and positions differ.
    let handles: Vec<_> = requests
        .iter()
        .rev()
        .map(|r| {
            engine
                .submit(engine.admission().admit(r.clone()).unwrap())
                .unwrap()
        })
        .collect();
    let mut batched: Vec<Output> = handles.into_iter().map(collect).collect();
    batched.reverse();
    for (i, (a, b)) in solo.iter().zip(&batched).enumerate() {
        assert_eq!(a.tokens.len(), 12);
        assert_eq!(a, b, "request {i}: batched output differs from solo output");
    }
    wait_for_no_leases(&engine);
    assert!(
        engine
            .metrics()
            .steps
            .load(std::sync::atomic::Ordering::Relaxed)
            > 0
    );
}

#[test]
fn prefix_cache_is_scoped_to_the_domain() {
    let engine = start(EngineConfig {
        pool_tokens: 2048,
        scrub: ScrubPolicy::Poison,
        ..EngineConfig::default()
    });
    let p = prompt(3, 70);
    let first = run(&engine, request("alice", p.clone(), 8));
    assert_eq!(first.cached, 0);
    let again = run(&engine, request("alice", p.clone(), 8));
    assert_eq!(
        again.cached, 64,
        "alice's second request reuses her four full pages"
    );
    assert_eq!(
        first.tokens, again.tokens,
        "cached K/V gives the same tokens"
    );
    let bob = run(&engine, request("bob", p.clone(), 8));
    assert_eq!(bob.cached, 0, "bob must not hit alice's cache");
    assert_eq!(bob.tokens, first.tokens);
    let mut salted = request("alice", p, 8);
    salted.domain = IsolationDomain::tenant("alice").narrowed("salt-1");
    let salted = run(&engine, salted);
    assert_eq!(
        salted.cached, 0,
        "a salt narrows sharing: no hit on the unsalted domain"
    );
    let counts = engine.pool_counts();
    assert_eq!(counts.free + counts.leased + counts.cached, counts.total);
}

#[test]
fn public_prefixes_are_shared_across_domains() {
    let public = prompt(9, 40);
    let engine = start(EngineConfig {
        pool_tokens: 2048,
        public_prefixes: vec![public.clone()],
        ..EngineConfig::default()
    });
    let mut a = public.clone();
    a.extend(prompt(1, 10));
    let mut b = public.clone();
    b.extend(prompt(2, 10));
    assert_eq!(run(&engine, request("alice", a, 4)).cached, 0);
    // Two whole pages lie inside the public prefix; the third straddles it and stays private.
    assert_eq!(run(&engine, request("bob", b, 4)).cached, 32);
}

/// A block-format cache (Q8_0, Q4_0: rows stored rotated) under the prefix cache: a
/// request that reuses a cached prefix gives the bits it gives cold, and another tenant's
/// identical prompt reuses nothing and computes the same bits.
#[test]
fn block_kv_prefix_hits_give_the_cold_bits_and_stay_in_their_domain() {
    // Heads of 64 values: whole blocks, and rotated.
    let spec = SynthSpec {
        dim: 256,
        ..SynthSpec::small(7, GgmlType::Q4_1, 4096)
    };
    for dtype in [kv::KvDtype::Q8_0, kv::KvDtype::Q4_0] {
        let engine = engine::start(
            spec.load().unwrap(),
            EngineConfig {
                kv_dtype: dtype,
                scrub: ScrubPolicy::Poison,
                ..EngineConfig::default()
            },
        )
        .unwrap();
        let p = prompt(3, 40);
        let cold = run(&engine, request("a", p.clone(), 8));
        assert_eq!(cold.cached, 0, "{dtype:?}");
        let warm = run(&engine, request("a", p.clone(), 8));
        assert_eq!(warm.cached, 32, "{dtype:?}: two whole pages of the prompt");
        assert_eq!(
            warm.tokens, cold.tokens,
            "{dtype:?}: a prefix hit changed the bits"
        );
        let other = run(&engine, request("b", p, 8));
        assert_eq!(other.cached, 0, "{dtype:?}: a prefix crossed tenants");
        assert_eq!(other.tokens, cold.tokens, "{dtype:?}");
        wait_for_no_leases(&engine);
    }
}

#[test]
fn a_dropped_request_releases_its_pages() {
    let engine = start(EngineConfig {
        pool_tokens: 4096,
        prefix_cache: false,
        ..EngineConfig::default()
    });
    // Nearly the whole context: a stalled test thread still finds it running (900 tokens
    // took the synthetic model about 65 ms).
    let mut handle = engine
        .submit(
            engine
                .admission()
                .admit(request("t", prompt(1, 20), 4000))
                .unwrap(),
        )
        .unwrap();
    // Wait until it runs, then hang up.
    match handle.events.blocking_recv() {
        Some(Event::Token(_)) => {}
        other => panic!("expected a token, got {other:?}"),
    }
    assert!(engine.pool_counts().leased > 0);
    drop(handle);
    wait_for_no_leases(&engine);
}

#[test]
fn a_full_pool_makes_requests_wait_not_fail() {
    // Room for two requests at a time; ten arrive together.
    let engine = start(EngineConfig {
        pool_tokens: 128,
        max_context: Some(64),
        prefix_cache: false,
        ..EngineConfig::default()
    });
    let reqs: Vec<_> = (0..10).map(|i| request("t", prompt(i, 30), 30)).collect();
    let solo: Vec<Output> = reqs
        .iter()
        .take(3)
        .map(|r| run(&engine, r.clone()))
        .collect();
    let handles: Vec<_> = reqs
        .iter()
        .map(|r| {
            engine
                .submit(engine.admission().admit(r.clone()).unwrap())
                .unwrap()
        })
        .collect();
    let outs: Vec<Output> = handles.into_iter().map(collect).collect();
    for o in &outs {
        assert_eq!(o.tokens.len(), 30);
        assert_eq!(o.finish, FinishReason::Length);
    }
    assert_eq!(&outs[..3], &solo[..]);
    wait_for_no_leases(&engine);
}

#[test]
fn context_larger_than_pool_refuses_to_start() {
    let err = engine::start(
        synth_model(1 << 20),
        EngineConfig {
            pool_tokens: 4096,
            max_context: Some(1 << 20),
            ..EngineConfig::default()
        },
    )
    .err()
    .expect("must refuse");
    assert!(matches!(
        err,
        StartupError::ContextExceedsPool {
            context: 1048576,
            pool: 4096
        }
    ));
    let msg = err.to_string();
    assert!(msg.contains("1048576") && msg.contains("4096"), "{msg}");
}

#[test]
fn default_context_never_exceeds_the_pool() {
    // The model advertises 1,048,576 tokens; the node promises only what its pool holds.
    let engine = engine::start(
        synth_model(1 << 20),
        EngineConfig {
            pool_tokens: 4096,
            ..EngineConfig::default()
        },
    )
    .unwrap();
    assert_eq!(engine.max_context(), 4096);
    let over = engine.admission().admit(request("t", prompt(1, 4096), 1));
    assert_eq!(over.unwrap_err().code(), "context_length_exceeded");
    let fits = engine
        .admission()
        .admit(request("t", prompt(1, 4095), 1))
        .unwrap();
    assert_eq!(collect(engine.submit(fits).unwrap()).tokens.len(), 1);
}

#[test]
fn preempted_requests_recompute_to_the_same_tokens() {
    // Sixteen pages; each request grows to 64 + 80 = 144 positions (nine pages), so two
    // cannot both finish without one giving its pages back.
    let engine = start(EngineConfig {
        pool_tokens: 256,
        max_context: Some(256),
        prefix_cache: false,
        scrub: ScrubPolicy::Poison,
        ..EngineConfig::default()
    });
    let reqs: Vec<_> = (0..4)
        .map(|i| request("t", prompt(i + 20, 64), 80))
        .collect();
    let solo: Vec<Output> = reqs.iter().map(|r| run(&engine, r.clone())).collect();
    assert_eq!(
        engine
            .metrics()
            .preemptions
            .load(std::sync::atomic::Ordering::Relaxed),
        0
    );
    let handles: Vec<_> = reqs
        .iter()
        .map(|r| {
            engine
                .submit(engine.admission().admit(r.clone()).unwrap())
                .unwrap()
        })
        .collect();
    let outs: Vec<Output> = handles.into_iter().map(collect).collect();
    assert_eq!(
        outs, solo,
        "preemption and recomputation changed the output"
    );
    assert!(
        engine
            .metrics()
            .preemptions
            .load(std::sync::atomic::Ordering::Relaxed)
            > 0,
        "the pool was meant to run dry"
    );
    wait_for_no_leases(&engine);
}

/// The synthetic model, made to panic in `forward` as many times as `panics` says,
/// recording each step's batch (per item, the tokens it fed), and holding its first step
/// until the flag is set where `hold_first` says so (telling its sender when it started).
struct Faulty {
    inner: model::Model,
    panics: Arc<AtomicUsize>,
    steps: Steps,
    hold_first: std::sync::Mutex<Option<(std::sync::mpsc::Sender<()>, Arc<AtomicBool>)>>,
}

impl engine::StepModel for Faulty {
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
        let fault = self
            .panics
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        if fault {
            panic!("injected fault in forward");
        }
        if let Some((entered, release)) = self.hold_first.lock().unwrap().take() {
            let _ = entered.send(());
            let deadline = Instant::now() + Duration::from_secs(30);
            while !release.load(Ordering::SeqCst) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        self.steps
            .lock()
            .unwrap()
            .push(items.iter().map(|i| i.tokens.to_vec()).collect());
        self.inner.forward(items)
    }
}

fn faulty_engine(config: EngineConfig) -> (EngineHandle, Arc<AtomicUsize>) {
    let panics = Arc::new(AtomicUsize::new(0));
    let model = Faulty {
        inner: synth_model(4096),
        panics: panics.clone(),
        steps: Arc::default(),
        hold_first: std::sync::Mutex::new(None),
    };
    (engine::start(model, config).unwrap(), panics)
}

/// The terminal event of a request, whatever came before it.
fn outcome(mut handle: engine::RequestHandle) -> Event {
    loop {
        match handle.events.blocking_recv() {
            Some(Event::Token(_)) => {}
            Some(end) => return end,
            None => panic!("stream ended without a terminal event"),
        }
    }
}

#[test]
fn a_panicking_step_fails_its_requests_and_the_engine_goes_on() {
    let (engine, panics) = faulty_engine(EngineConfig {
        pool_tokens: 1024,
        ..EngineConfig::default()
    });
    panics.store(1, Ordering::SeqCst);
    let admit = |r| engine.admission().admit(r).unwrap();
    match outcome(
        engine
            .submit(admit(request("t", prompt(1, 20), 5)))
            .unwrap(),
    ) {
        Event::Failed(EngineError::Model(msg)) => assert!(msg.contains("panicked"), "{msg}"),
        other => panic!("expected a model failure, got {other:?}"),
    }
    assert!(engine.is_alive());
    // The next request is served as if nothing happened, and no page stayed leased.
    let out = run(&engine, request("t", prompt(2, 20), 5));
    assert_eq!(out.tokens.len(), 5);
    wait_for_no_leases(&engine);
}

#[test]
fn an_engine_whose_steps_keep_panicking_stops() {
    let (engine, panics) = faulty_engine(EngineConfig {
        pool_tokens: 1024,
        ..EngineConfig::default()
    });
    panics.store(usize::MAX, Ordering::SeqCst);
    let admit = |i| {
        engine
            .admission()
            .admit(request("t", prompt(i, 20), 5))
            .unwrap()
    };
    for i in 0..3 {
        assert!(matches!(
            outcome(engine.submit(admit(i)).unwrap()),
            Event::Failed(EngineError::Model(_))
        ));
    }
    // Liveness only: the engine thread ends soon after its third failed step.
    let deadline = Instant::now() + Duration::from_secs(30);
    while engine.is_alive() {
        assert!(Instant::now() < deadline, "the engine is still running");
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(
        outcome(engine.submit(admit(9)).unwrap()),
        Event::Failed(EngineError::Shutdown)
    );
    assert_eq!(engine.pool_counts().leased, 0);
}

#[test]
fn a_full_queue_refuses_requests_until_a_place_frees() {
    let engine = start(EngineConfig {
        pool_tokens: 4096,
        max_running: 1,
        max_waiting: 1,
        prefix_cache: false,
        ..EngineConfig::default()
    });
    // Long enough to hold the engine for a while; never read.
    let long = |i| {
        engine
            .admission()
            .admit(request("t", prompt(i, 8), 4000))
            .unwrap()
    };
    let running = engine.submit(long(1)).unwrap();
    let _waiting = engine.submit(long(2)).unwrap();
    assert_eq!(
        engine.submit(long(3)).unwrap_err(),
        QueueFull::Full { limit: 2 }
    );
    // Hanging up frees the place at the engine's next step.
    drop(running);
    let deadline = Instant::now() + Duration::from_secs(30);
    let third = loop {
        match engine.submit(long(3)) {
            Ok(h) => break h,
            Err(_) => {
                assert!(Instant::now() < deadline, "the place never freed");
                std::thread::sleep(Duration::from_millis(5));
            }
        }
    };
    drop(third);
}

/// With no limit configured, one tenant's flood (more requests than running slots) does
/// not queue another tenant's request behind it: the flood's youngest running request
/// gives its slot back, the other tenant's request finishes long before any of the flood's,
/// and the preempted requests recompute to exactly their solo tokens.
/// Weights share the running slots: two tenants flooding four slots, one of weight 3 and
/// one of weight 1, decode three tokens to one while both are waiting for slots (equal
/// weights give one to one).
#[test]
fn running_slots_follow_the_tenants_weights() {
    let engine = start(EngineConfig {
        max_running: 4,
        pool_tokens: 16384,
        prefix_cache: false,
        ..EngineConfig::default()
    });
    let submit = |tenant: &str, weight: u32, i: u32| {
        let r = GenerateRequest {
            adapter: None,
            weight,
            ..request(tenant, prompt(i, 16), 4000)
        };
        engine.submit(engine.admission().admit(r).unwrap()).unwrap()
    };
    // The light tenant's flood first, holding every slot, then the heavy one's: the order
    // in which the extra row once kept a 3:2 split for as long as the requests ran.
    let mut light: Vec<_> = (0..6).map(|i| submit("light", 1, i)).collect();
    wait_for_running(&engine, 4);
    let mut heavy: Vec<_> = (0..6).map(|i| submit("heavy", 3, i + 20)).collect();
    let count = |handles: &mut Vec<engine::RequestHandle>| {
        let mut n = 0;
        for h in handles.iter_mut() {
            while let Ok(ev) = h.events.try_recv() {
                match ev {
                    Event::Token(_) => n += 1,
                    other => panic!("a flood request ended: {other:?}"),
                }
            }
        }
        n
    };
    // Windows counted in engine steps, not wall-clock time: every step gives each running
    // request one token, so until the light tenant's next `steps` tokens the counts are the
    // tenants' slots times the same steps, however loaded the machine is. Draining both
    // often keeps the edges within a step or two.
    let mut window = |steps: usize| {
        let (mut h, mut l) = (0, 0);
        let deadline = Instant::now() + Duration::from_secs(60);
        while l < steps && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(2));
            h += count(&mut heavy);
            l += count(&mut light);
        }
        (h, l)
    };
    // Past the start, when the slots have moved to their shares.
    window(8);
    let mut windows: Vec<(usize, usize)> = (0..3).map(|_| window(40)).collect();
    assert!(
        windows.iter().all(|&(_, l)| l >= 40),
        "the light tenant starved: {windows:?}"
    );
    windows.sort_by(|a, b| (a.0 * b.1).cmp(&(b.0 * a.1)));
    let (h, l) = windows[1];
    let ratio = h as f64 / l as f64;
    assert!(
        (2.5..=3.5).contains(&ratio),
        "heavy {h} tokens, light {l}: {ratio:.2} (windows {windows:?})"
    );
    drop(light);
    drop(heavy);
    wait_for_no_leases(&engine);
}

#[test]
fn one_tenants_flood_does_not_queue_another_tenant() {
    let engine = start(EngineConfig {
        max_running: 4,
        prefix_cache: false,
        scrub: ScrubPolicy::Poison,
        ..EngineConfig::default()
    });
    let flood: Vec<_> = (0..12)
        .map(|i| request("flood", prompt(i + 40, 16), 1000))
        .collect();
    let solo: Vec<Output> = flood.iter().map(|r| run(&engine, r.clone())).collect();
    let mut handles: Vec<_> = flood
        .iter()
        .map(|r| {
            engine
                .submit(engine.admission().admit(r.clone()).unwrap())
                .unwrap()
        })
        .collect();
    wait_for_running(&engine, 4);
    // One quiet request runs in an extra row: nobody recomputes for it.
    let quiet = run(&engine, request("quiet", prompt(99, 16), 4));
    assert_eq!(quiet.tokens.len(), 4);
    assert_eq!(engine.metrics().preemptions.load(Ordering::Relaxed), 0);
    // Two at once: the extra row (one, for four slots) holds one, a flood request gives
    // its slot to the other.
    let quiet: Vec<_> = (0..2)
        .map(|i| {
            let r = request("quiet", prompt(97 + i, 16), 4);
            engine.submit(engine.admission().admit(r).unwrap()).unwrap()
        })
        .collect();
    for q in quiet {
        assert_eq!(collect(q).tokens.len(), 4);
    }
    let mut early: Vec<Vec<(u32, u32)>> = Vec::new();
    for h in &mut handles {
        let mut tokens = Vec::new();
        while let Ok(ev) = h.events.try_recv() {
            match ev {
                Event::Token(t) => tokens.push((t.id, t.logprob.unwrap().to_bits())),
                other => panic!("a flood request ended before the quiet tenant's: {other:?}"),
            }
        }
        early.push(tokens);
    }
    assert!(engine.metrics().preemptions.load(Ordering::Relaxed) > 0);
    // The preempted requests recomputed their streams: every flood answer, the tokens
    // taken above and the rest, is its solo answer.
    for ((h, mut tokens), solo) in handles.into_iter().zip(early).zip(&solo) {
        let rest = collect(h);
        tokens.extend(rest.tokens);
        assert_eq!(
            (&tokens, rest.finish),
            (&solo.tokens, solo.finish),
            "a slot preemption changed a flood request's tokens"
        );
    }
    wait_for_no_leases(&engine);
}

/// A step's prefill budget is shared between tenants: one tenant's long prompts, already
/// running, do not hold back another tenant's short one until they are all in KV.
#[test]
fn long_prompts_of_one_tenant_share_the_prefill_budget() {
    let (entered_tx, entered) = std::sync::mpsc::channel();
    let (engine, steps, release) = recording_engine_with(Some(entered_tx));
    let long: Vec<_> = (0..4)
        .map(|i| {
            let r = request("flood", prompt(i + 60, 1500), 2);
            engine.submit(engine.admission().admit(r).unwrap()).unwrap()
        })
        .collect();
    // The first step (long prompts' chunks only) is held: the quiet prompt is queued
    // while nearly all of the 6,000 long prompt tokens are still to be computed.
    entered
        .recv_timeout(Duration::from_secs(30))
        .expect("the first step started");
    let quiet_prompt = prompt(97, 16);
    let r = request("quiet", quiet_prompt.clone(), 1);
    let quiet = engine.submit(engine.admission().admit(r).unwrap()).unwrap();
    release.store(true, Ordering::SeqCst);
    assert_eq!(collect(quiet).tokens.len(), 1);
    for h in long {
        assert_eq!(collect(h).tokens.len(), 2);
    }
    // At 512 prompt tokens a step the long prompts take many steps; the quiet prompt must
    // not wait for them.
    let steps = steps.lock().unwrap().clone();
    let long_chunk = |row: &Vec<u32>| row.len() > 1 && *row != quiet_prompt;
    assert!(
        steps[0].iter().all(long_chunk),
        "the held step was not the long prompts'"
    );
    let quiet_at = steps
        .iter()
        .position(|s| s.contains(&quiet_prompt))
        .expect("no step computed the quiet prompt");
    // Shared, the step after the held one computes the quiet prompt; in arrival order the
    // long prompts' chunks would fill steps until their caps left room (step 9 here).
    assert_eq!(
        quiet_at, 1,
        "the quiet prompt waited behind the long prompts' chunks"
    );
    let last_long_chunk = steps
        .iter()
        .rposition(|s| s.iter().any(long_chunk))
        .expect("no step computed a long prompt");
    assert!(
        quiet_at < last_long_chunk,
        "the quiet prompt waited for every long prompt: steps {:?}",
        steps
            .iter()
            .map(|s| s.iter().map(Vec::len).collect::<Vec<_>>())
            .collect::<Vec<_>>()
    );
    wait_for_no_leases(&engine);
}

/// A lighter tenant's first token does not wait for a heavier tenant's whole batch of
/// decode rows: its prompt is computed in a step of its own, and the decode rows go on in
/// the very next step (never two such steps in a row).
#[test]
fn a_light_tenants_first_token_gets_a_step_of_its_own() {
    let (engine, steps) = recording_engine();
    let heavy: Vec<_> = (0..6)
        .map(|i| {
            engine
                .submit(
                    engine
                        .admission()
                        .admit(request("heavy", prompt(i + 80, 8), 2000))
                        .unwrap(),
                )
                .unwrap()
        })
        .collect();
    // Wait until the heavy tenant is decoding: a step of six one-token rows.
    let deadline = Instant::now() + Duration::from_secs(10);
    while !sizes(&steps).iter().any(|s| s == &[1; 6]) {
        assert!(Instant::now() < deadline, "the heavy tenant never decoded");
        std::thread::sleep(Duration::from_millis(1));
    }
    let light = run(&engine, request("light", prompt(96, 37), 1));
    assert_eq!(light.tokens.len(), 1);
    let at = sizes(&steps)
        .iter()
        .position(|s| s.contains(&37))
        .expect("no step computed the light prompt");
    // The step after it, taken before the heavy requests hang up (which shrinks steps).
    while steps.lock().unwrap().len() < at + 2 {
        assert!(
            Instant::now() < deadline,
            "no step after the light prompt's"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    let steps = sizes(&steps);
    drop(heavy);
    assert_eq!(
        steps[at],
        [37],
        "the light prompt shared its step with decode rows"
    );
    let next = &steps[at + 1];
    assert!(next.iter().filter(|&&n| n == 1).count() >= 6, "{next:?}");
    wait_for_no_leases(&engine);
}

/// A long prompt's chunks shrink as it gets deeper, so a step never costs much more than a
/// full-budget step at a prompt's start: other streams' next token waits at most about that
/// long however deep the prompt (`step_cost.rs`). The first chunk keeps the whole budget.
#[test]
fn a_long_prompts_deep_chunks_are_shorter() {
    let (engine, steps) = recording_engine();
    let done = run(&engine, request("long", prompt(5, 3800), 1));
    assert_eq!(done.tokens.len(), 1);
    let steps = sizes(&steps);
    let chunks: Vec<usize> = steps.iter().map(|s| s.iter().sum()).collect();
    assert_eq!(chunks.iter().sum::<usize>(), 3800, "{chunks:?}");
    assert_eq!(chunks[0], 512, "{chunks:?}");
    assert!(
        chunks.windows(2).all(|w| w[1] <= w[0]),
        "chunks grew deeper in the prompt: {chunks:?}"
    );
    assert!(
        chunks.len() > 3800usize.div_ceil(512),
        "no chunk was capped by its depth: {chunks:?}"
    );
    wait_for_no_leases(&engine);
}

/// Every end-of-generation token ends an answer, not only the file's end-of-sequence token
/// (the synthetic vocabulary's EOS is `<|im_end|>`; `<|endoftext|>` ends a generation in
/// llama.cpp too), unless the request ignores the end.
#[test]
fn every_end_of_generation_token_ends_the_answer() {
    let engine = start(EngineConfig::default());
    let model = synth_model(4096);
    assert_eq!(model.config.eos_token, Some(2));
    assert_eq!(
        model.config.end_tokens,
        vec![0, 2],
        "<|endoftext|> and <|im_end|>"
    );
    for end in [0u32, 2] {
        let mut req = request("t", prompt(1, 12), 6);
        req.ignore_eos = false;
        req.sampling.logit_bias = Arc::from([(end, 100.0)]);
        let out = run(&engine, req.clone());
        assert_eq!(out.finish, FinishReason::Stop, "token {end}");
        assert!(
            out.tokens.is_empty(),
            "token {end} was emitted: {:?}",
            out.tokens
        );
        req.ignore_eos = true;
        let out = run(&engine, req);
        assert_eq!(out.finish, FinishReason::Length, "token {end}");
        assert_eq!(out.tokens.len(), 6);
    }
}

/// A request's own stop tokens end its answer (even with `ignore_eos`), and `min_tokens`
/// holds every token that would end it off until the answer has that many: the biased end
/// token comes right after them.
#[test]
fn stop_tokens_end_and_min_tokens_hold_the_end_off() {
    let engine = start(EngineConfig::default());
    let free = run(&engine, request("t", prompt(3, 12), 8));
    let third = free.tokens[2].0;
    let mut req = request("t", prompt(3, 12), 8);
    req.sampling.stop_tokens = Arc::from([third]);
    let out = run(&engine, req);
    assert_eq!(out.finish, FinishReason::Stop);
    let first = free.tokens.iter().position(|&(t, _)| t == third).unwrap();
    assert_eq!(
        out.tokens,
        free.tokens[..first],
        "ends before the stop token"
    );

    for (end, ignore_eos) in [(2u32, false), (third, true)] {
        let mut req = request("t", prompt(3, 12), 8);
        req.ignore_eos = ignore_eos;
        req.sampling.logit_bias = Arc::from([(end, 100.0)]);
        if ignore_eos {
            req.sampling.stop_tokens = Arc::from([end]);
        }
        req.sampling.min_tokens = 3;
        let out = run(&engine, req);
        assert_eq!(out.finish, FinishReason::Stop, "end {end}");
        assert_eq!(out.tokens.len(), 3, "end {end}: {:?}", out.tokens);
        assert!(out.tokens.iter().all(|&(t, _)| t != end));
    }
}
