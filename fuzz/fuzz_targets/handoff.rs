//! A decode node's reservation fed arbitrary manifests and pages (`engine::handoff`), as a
//! compromised or broken prefill node could send them: edited manifest fields, pages out of
//! order, wrong slot counts, corrupted payloads (with checksums that match or not), raw
//! bytes. Whatever arrives: the import either fails with a `HandoffError` or is verified;
//! a verified import decodes to a terminal event; and afterwards no page is left leased.
#![no_main]

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use engine::handoff::{page_checksum, Manifest, PrefillOutput, Ticket};
use engine::{EngineConfig, EngineHandle, Event, GenerateRequest, IsolationDomain, SamplingParams};
use kv::ScrubPolicy;
use libfuzzer_sys::arbitrary::{self, Arbitrary};
use libfuzzer_sys::fuzz_target;

const PROMPT_LENS: [usize; 3] = [5, 16, 37];

struct Fixture {
    rt: tokio::runtime::Runtime,
    decode: EngineHandle,
    outputs: Vec<(GenerateRequest, PrefillOutput)>,
}

fn engine() -> EngineHandle {
    let file = gguf::GgufFile::parse(kvwarden_fuzz::small_model_bytes().to_vec())
        .unwrap_or_else(|e| panic!("{e}"));
    let model = model::Model::load(&file).unwrap_or_else(|e| panic!("{e}"));
    engine::start(
        model,
        EngineConfig {
            pool_tokens: 512,
            scrub: ScrubPolicy::Poison,
            prefix_cache: false,
            ..EngineConfig::default()
        },
    )
    .unwrap_or_else(|e| panic!("{e}"))
}

fn request(len: usize) -> GenerateRequest {
    GenerateRequest {
        adapter: None,
        weight: 1,
        domain: IsolationDomain::tenant("alice"),
        prompt: (0..len as u32).map(|i| 3 + (i * 37 + 5) % 250).collect(),
        max_tokens: 3,
        sampling: SamplingParams {
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            seed: 0,
            ..SamplingParams::default()
        },
        ignore_eos: true,
        logprobs: Some(2),
        constraint: None,
    }
}

fn fixture() -> &'static Fixture {
    static F: OnceLock<Fixture> = OnceLock::new();
    F.get_or_init(|| {
        let prefill = engine();
        let outputs = PROMPT_LENS
            .iter()
            .map(|&len| {
                let req = request(len);
                let admitted = prefill
                    .admission()
                    .admit(req.clone())
                    .unwrap_or_else(|r| panic!("{r}"));
                let mut h = prefill
                    .submit_prefill(admitted)
                    .unwrap_or_else(|e| panic!("{e}"));
                match h.events.blocking_recv() {
                    Some(Event::Prefilled(out)) => (req, *out),
                    other => panic!("expected the prefilled K/V, got {other:?}"),
                }
            })
            .collect();
        Fixture {
            rt: tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap_or_else(|e| panic!("{e}")),
            decode: engine(),
            outputs,
        }
    })
}

#[derive(Debug, Arbitrary)]
enum Payload {
    /// The truthful page `i` (modulo the page count).
    Truthful(u8),
    /// Page `i` with bytes XORed at the given offsets.
    Corrupted(u8, Vec<(u16, u8)>),
    /// Arbitrary bytes.
    Raw(Vec<u8>),
}

#[derive(Debug, Arbitrary)]
struct PageOp {
    index: u8,
    /// `None`: the slot count the prompt puts at that index.
    tokens: Option<u8>,
    payload: Payload,
    /// Put this payload's checksum into the manifest (a lying prefill node).
    matching_checksum: bool,
}

#[derive(Debug, Arbitrary)]
struct Input {
    request: u8,
    wrong_ticket: bool,
    request_id: Option<String>,
    tenant: Option<String>,
    salt: Option<String>,
    prompt_len: Option<u16>,
    token_checksum: Option<u64>,
    first_token: Option<u32>,
    page_tokens: Option<u8>,
    page_count: Option<u8>,
    cached_tokens: Option<u16>,
    pages: Vec<PageOp>,
    finish: bool,
    decode: bool,
}

fn payload(out: &PrefillOutput, p: &Payload) -> Vec<u8> {
    let pick = |i: u8| &out.pages[usize::from(i) % out.pages.len()];
    match p {
        Payload::Truthful(i) => pick(*i).clone(),
        Payload::Corrupted(i, flips) => {
            let mut page = pick(*i).clone();
            for &(at, x) in flips {
                let at = usize::from(at) % page.len();
                page[at] ^= x;
            }
            page
        }
        Payload::Raw(bytes) => bytes.clone(),
    }
}

fn wait_idle(engine: &EngineHandle) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while engine.pool_counts().leased != 0 {
        assert!(
            Instant::now() < deadline,
            "pages still leased after the import ended: {:?}",
            engine.pool_counts()
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

fuzz_target!(|input: Input| {
    let f = fixture();
    let (req, out) = &f.outputs[usize::from(input.request) % f.outputs.len()];
    let admitted = f
        .decode
        .admission()
        .admit(req.clone())
        .unwrap_or_else(|r| panic!("{r}"));
    let reservation =
        f.rt.block_on(f.decode.reserve_import(admitted, "r".to_owned()))
            .unwrap_or_else(|e| panic!("the pool is idle between inputs: {e}"));

    let ticket = if input.wrong_ticket {
        Ticket(reservation.ticket().0 ^ 1)
    } else {
        reservation.ticket()
    };
    let domain = match (&input.tenant, &input.salt) {
        (None, None) => req.domain.clone(),
        (t, s) => {
            transfer::wire::domain(t.clone().unwrap_or_else(|| "alice".to_owned()), s.clone())
        }
    };
    let mut manifest = Manifest::describe(ticket, "r".to_owned(), domain, out);
    if let Some(id) = &input.request_id {
        manifest.request_id = id.clone();
    }
    if let Some(n) = input.prompt_len {
        manifest.prompt_len = usize::from(n);
    }
    if let Some(c) = input.token_checksum {
        manifest.token_checksum = c;
    }
    if let Some(t) = input.first_token {
        manifest.first_token.id = t;
    }
    if let Some(n) = input.page_tokens {
        manifest.page_tokens = usize::from(n);
    }
    if let Some(n) = input.cached_tokens {
        manifest.cached_tokens = usize::from(n);
    }
    if let Some(n) = input.page_count {
        manifest.page_checksums.resize(usize::from(n), 0);
    }
    let pages: Vec<(usize, usize, Vec<u8>)> = input
        .pages
        .iter()
        .take(16)
        .map(|op| {
            let index = usize::from(op.index);
            let data = payload(out, &op.payload);
            if op.matching_checksum {
                if let Some(c) = manifest.page_checksums.get_mut(index) {
                    *c = page_checksum(index, &data);
                }
            }
            let tokens = op.tokens.map(usize::from).unwrap_or_else(|| {
                out.prompt
                    .len()
                    .saturating_sub(index * out.page_tokens)
                    .min(out.page_tokens)
            });
            (index, tokens, data)
        })
        .collect();

    if let Ok(mut transfer) = reservation.begin(manifest) {
        let mut ok = true;
        for (index, tokens, data) in &pages {
            if transfer.receive_page(*index, *tokens, data).is_err() {
                ok = false;
                break;
            }
        }
        if ok && input.finish {
            if let Ok(verified) = transfer.finish() {
                if input.decode {
                    let mut h = f
                        .decode
                        .submit_import(verified)
                        .unwrap_or_else(|e| panic!("the engine is idle: {e}"));
                    let mut tokens = 0;
                    loop {
                        match h.events.blocking_recv() {
                            Some(Event::Token(_)) => tokens += 1,
                            Some(Event::Finished { usage, .. }) => {
                                assert_eq!(usage.completion_tokens, tokens);
                                break;
                            }
                            Some(Event::Failed(_)) => break,
                            Some(Event::Prefilled(_)) => panic!("prefilled on a decode stream"),
                            None => panic!("the stream ended without a terminal event"),
                        }
                    }
                }
            }
        }
    }
    wait_idle(&f.decode);
});
