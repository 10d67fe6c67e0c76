//! The prefill-to-decode handoff between two engines on the same synthetic model: the
//! split answer equals the monolithic one token for token, and every way a received
//! sequence can be wrong is refused before a token is decoded, with the pages returned.

use std::time::{Duration, Instant};

use engine::handoff::{HandoffError, ImportReservation, Manifest, PrefillOutput};
use engine::{EngineConfig, EngineHandle, Event, GenerateRequest, IsolationDomain, SamplingParams};
use gguf::GgmlType;
use kv::ScrubPolicy;
use model::synth::SynthSpec;

fn synth_model() -> model::Model {
    SynthSpec::small(11, GgmlType::Q4_1, 4096).load().unwrap()
}

fn start(prefix_cache: bool) -> EngineHandle {
    engine::start(
        synth_model(),
        EngineConfig {
            pool_tokens: 1024,
            scrub: ScrubPolicy::Poison,
            prefix_cache,
            max_batch_tokens: 48,
            ..EngineConfig::default()
        },
    )
    .unwrap()
}

fn request(tenant: &str, len: usize, max_tokens: usize, seed: u64) -> GenerateRequest {
    GenerateRequest {
        adapter: None,
        weight: 1,
        domain: IsolationDomain::tenant(tenant),
        prompt: (0..len as u32).map(|i| 3 + (i * 37 + 5) % 290).collect(),
        max_tokens,
        sampling: SamplingParams {
            temperature: if seed == 0 { 0.0 } else { 0.8 },
            top_p: 0.95,
            top_k: 0,
            seed,
            // Seeded requests also carry every history-dependent adjustment: a decode node
            // must sample from the prompt and the first token exactly as one node does.
            ..if seed == 0 {
                SamplingParams::default()
            } else {
                SamplingParams {
                    min_p: 0.05,
                    penalties: engine::Penalties {
                        presence: 0.2,
                        frequency: 0.3,
                        repetition: 1.1,
                        repeat_last_n: 16,
                    },
                    logit_bias: std::sync::Arc::from([(5, 2.0), (40, -3.0)]),
                    ..SamplingParams::default()
                }
            }
        },
        ignore_eos: true,
        logprobs: Some(2),
        constraint: None,
    }
}

/// Token ids and logprob bits, then the usage's completion count.
fn collect(mut handle: engine::RequestHandle) -> Result<(Vec<(u32, u32)>, usize), String> {
    let mut tokens = Vec::new();
    loop {
        match handle.events.blocking_recv() {
            Some(Event::Token(t)) => tokens.push((t.id, t.logprob.unwrap().to_bits())),
            Some(Event::Finished { usage, .. }) => return Ok((tokens, usage.completion_tokens)),
            Some(Event::Failed(e)) => return Err(e.to_string()),
            Some(Event::Prefilled(_)) => return Err("prefilled on a client stream".into()),
            None => return Err("stream ended without a terminal event".into()),
        }
    }
}

fn prefill(engine: &EngineHandle, req: &GenerateRequest) -> PrefillOutput {
    let mut handle = engine
        .submit_prefill(engine.admission().admit(req.clone()).unwrap())
        .unwrap();
    match handle.events.blocking_recv() {
        Some(Event::Prefilled(out)) => *out,
        other => panic!("expected the prefilled K/V, got {other:?}"),
    }
}

fn reserve(engine: &EngineHandle, req: &GenerateRequest, id: &str) -> ImportReservation {
    let admitted = engine.admission().admit(req.clone()).unwrap();
    block_on(engine.reserve_import(admitted, id.to_owned())).unwrap()
}

fn block_on<F: std::future::Future>(f: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(f)
}

/// Sends `out` with `manifest` into `reservation`, page by page, as a transport would.
fn transfer(
    reservation: ImportReservation,
    manifest: Manifest,
    out: &PrefillOutput,
) -> Result<engine::handoff::VerifiedImport, HandoffError> {
    let mut t = reservation.begin(manifest)?;
    for (i, page) in out.pages.iter().enumerate() {
        let tokens = (out.prompt.len() - i * out.page_tokens).min(out.page_tokens);
        t.receive_page(i, tokens, page)?;
    }
    t.finish()
}

fn leased(engine: &EngineHandle) -> usize {
    engine.pool_counts().leased
}

fn wait_idle(engine: &EngineHandle) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while leased(engine) != 0 {
        assert!(Instant::now() < deadline, "pages still leased");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn split_output_equals_monolithic_output() {
    let (mono, pre, dec) = (start(false), start(true), start(false));
    for (i, (len, max_tokens, seed)) in
        [(5, 9, 0), (16, 7, 0), (53, 12, 0), (40, 10, 42), (3, 1, 0)]
            .into_iter()
            .enumerate()
    {
        let req = request("alice", len, max_tokens, seed);
        let expected = collect(
            mono.submit(mono.admission().admit(req.clone()).unwrap())
                .unwrap(),
        )
        .unwrap();
        let out = prefill(&pre, &req);
        let reservation = reserve(&dec, &req, &format!("r{i}"));
        let manifest = Manifest::describe(
            reservation.ticket(),
            format!("r{i}"),
            req.domain.clone(),
            &out,
        );
        let verified = transfer(reservation, manifest, &out).unwrap();
        let got = collect(dec.submit_import(verified).unwrap()).unwrap();
        assert_eq!(got, expected, "case {i}: split output differs");
    }
    wait_idle(&dec);
    assert_eq!(
        leased(&pre),
        0,
        "the prefill node keeps no lease after handing over"
    );
}

#[test]
fn a_cached_prefix_on_the_prefill_node_hands_over_the_same_kv() {
    let (pre, dec) = (start(true), start(false));
    let req = request("alice", 70, 6, 0);
    let first = prefill(&pre, &req);
    let again = prefill(&pre, &req);
    assert_eq!(first.cached_tokens, 0);
    assert!(again.cached_tokens >= 64, "{}", again.cached_tokens);
    assert_eq!(first.pages, again.pages, "cached pages hold the same bits");
    let reservation = reserve(&dec, &req, "c");
    let manifest = Manifest::describe(reservation.ticket(), "c".into(), req.domain.clone(), &again);
    assert!(transfer(reservation, manifest, &again).is_ok());
}

/// Every way the received sequence can disagree with the reservation, each refused with
/// its own reason, and no page left leased on the decode node.
#[test]
fn every_mismatch_is_refused_and_releases_the_pages() {
    let (pre, dec) = (start(false), start(false));
    let req = request("alice", 40, 4, 0);
    let out = prefill(&pre, &req);
    type Corrupt = Box<dyn Fn(&mut Manifest, &mut PrefillOutput)>;
    let cases: Vec<(&str, &str, Corrupt)> = vec![
        (
            "wrong tenant",
            "manifest",
            Box::new(|m, _| m.domain = IsolationDomain::tenant("mallory")),
        ),
        (
            "wrong request id",
            "manifest",
            Box::new(|m, _| m.request_id = "other".into()),
        ),
        ("wrong ticket", "manifest", Box::new(|m, _| m.ticket.0 ^= 1)),
        (
            "wrong token count",
            "manifest",
            Box::new(|m, _| m.prompt_len -= 1),
        ),
        (
            "placeholder prompt",
            "checksum",
            Box::new(|m, o| {
                // The incident: prefill ran a 1-token placeholder, not the prompt.
                o.prompt = vec![o.prompt[0]];
                m.token_checksum = engine::handoff::token_checksum(&o.prompt);
            }),
        ),
        (
            "corrupted page",
            "checksum",
            Box::new(|_, o| o.pages[1][7] ^= 0x40),
        ),
        (
            "missing page",
            "coverage",
            Box::new(|_, o| {
                o.pages.pop();
            }),
        ),
        (
            "swapped pages",
            "checksum",
            Box::new(|_, o| o.pages.swap(0, 1)),
        ),
        (
            "truncated page, checksum recomputed",
            "coverage",
            Box::new(|m, o| {
                o.pages[0].truncate(100);
                m.page_checksums[0] = engine::handoff::page_checksum(0, &o.pages[0]);
            }),
        ),
        (
            "first token outside the vocabulary",
            "manifest",
            Box::new(|m, _| m.first_token.id = 10_000),
        ),
    ];
    for (name, reason, corrupt) in cases {
        let reservation = reserve(&dec, &req, "r");
        assert!(leased(&dec) > 0);
        let mut manifest =
            Manifest::describe(reservation.ticket(), "r".into(), req.domain.clone(), &out);
        let mut sent = out.clone();
        corrupt(&mut manifest, &mut sent);
        let err = transfer(reservation, manifest, &sent).expect_err(name);
        assert_eq!(err.reason(), reason, "{name}: {err}");
        assert_eq!(leased(&dec), 0, "{name}: pages left leased");
    }
    // The domain holds the tenant and the adapter: the refusal names which differs.
    for (domain, named) in [
        (IsolationDomain::tenant("mallory"), "tenant"),
        (req.domain.computed_under(Some(7)), "adapter"),
    ] {
        let reservation = reserve(&dec, &req, "r");
        let mut manifest =
            Manifest::describe(reservation.ticket(), "r".into(), req.domain.clone(), &out);
        manifest.domain = domain;
        let err = transfer(reservation, manifest, &out).expect_err(named);
        assert_eq!(err.reason(), "manifest");
        assert!(err.to_string().contains(named), "{err}");
        assert_eq!(leased(&dec), 0, "{named}: pages left leased");
    }
    // A page sent twice (the transport repeats a frame).
    let reservation = reserve(&dec, &req, "r");
    let manifest = Manifest::describe(reservation.ticket(), "r".into(), req.domain.clone(), &out);
    let mut t = reservation.begin(manifest).unwrap();
    t.receive_page(0, 16, &out.pages[0]).unwrap();
    assert_eq!(
        t.receive_page(0, 16, &out.pages[0]).unwrap_err().reason(),
        "coverage"
    );
}

#[test]
fn a_full_decode_pool_makes_reservations_wait_and_a_dropped_wait_frees_nothing_twice() {
    let dec = engine::start(
        synth_model(),
        EngineConfig {
            pool_tokens: 64,
            scrub: ScrubPolicy::Poison,
            prefix_cache: false,
            ..EngineConfig::default()
        },
    )
    .unwrap();
    let req = request("alice", 40, 4, 0);
    let held = reserve(&dec, &req, "a");
    // 40 + 40 tokens do not fit 64: the second waits until the first is dropped.
    let admitted = dec.admission().admit(req.clone()).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let waited = rt.block_on(async {
        tokio::time::timeout(
            Duration::from_millis(200),
            dec.reserve_import(admitted, "b".into()),
        )
        .await
    });
    assert!(waited.is_err(), "a reservation was granted beyond the pool");
    drop(held);
    let admitted = dec.admission().admit(req).unwrap();
    let second = rt
        .block_on(async {
            tokio::time::timeout(
                Duration::from_secs(10),
                dec.reserve_import(admitted, "c".into()),
            )
            .await
        })
        .expect("the freed pages were not given to the next reservation")
        .unwrap();
    drop(second);
    wait_idle(&dec);
}
