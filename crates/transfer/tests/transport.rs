//! The internal API over real mutual TLS on loopback, with a synthetic model: an honest
//! handoff gives the monolithic tokens, under the base model and under each LoRA adapter;
//! every corruption injected through the transport (an adapter other than the request's
//! among them) is refused with its own reason and metric, and returns the decode node's
//! pages; a node refuses a request for an adapter it does not hold in exactly the version
//! named; a client without a cluster certificate is refused at the handshake.

use std::sync::Arc;
use std::time::{Duration, Instant};

use engine::handoff::{Manifest, PrefillOutput, Ticket};
use engine::{
    AdapterRef, Adapters, EngineConfig, EngineHandle, Event, GenerateRequest, IsolationDomain,
    SamplingParams,
};
use gguf::GgmlType;
use kv::ScrubPolicy;
use model::lora::synth::LoraSpec;
use model::lora::LoraAdapter;
use model::synth::SynthSpec;
use tonic::transport::Channel;
use transfer::certs::ClusterCa;
use transfer::pb::{self, node_client::NodeClient};
use transfer::wire::AdapterId;
use transfer::{wire, Deadlines, NodeIdentity, NodeService, Role, TlsIdentity, TransferMetrics};

fn synth_model() -> model::Model {
    SynthSpec::small(5, GgmlType::Q8_0, 4096).load().unwrap()
}

fn synth_vocabulary() -> constraint::Vocabulary {
    let spec = SynthSpec::small(5, GgmlType::Q8_0, 4096);
    let file = gguf::GgufFile::parse(spec.build().unwrap().to_bytes()).unwrap();
    let tok = Arc::new(tokenizer::Tokenizer::from_gguf(&file).unwrap());
    constraint::Vocabulary::new(tok.clone(), tok.vocab_size(), tok.eos_id())
}

/// A synthetic adapter for the synthetic model, written in llama.cpp's adapter format and
/// loaded back as a node loads one: `seed` decides what it computes, `file` stands for its
/// file's checksum (two loads of one seed with two `file`s: one arithmetic, two files).
fn lora(seed: u64, file: u128) -> Arc<LoraAdapter> {
    let base = SynthSpec::small(5, GgmlType::Q8_0, 4096);
    let base = gguf::GgufFile::parse(base.build().unwrap().to_bytes()).unwrap();
    let spec = LoraSpec {
        seed,
        ..LoraSpec::default()
    };
    let adapter = gguf::GgufFile::parse(spec.build(&base).unwrap().to_bytes()).unwrap();
    Arc::new(LoraAdapter::load(&adapter, file, &synth_model().lora_base(), 1.0).unwrap())
}

/// A node's set: `alpha` (seed 1) and `beta` (seed 2), each loaded afresh, as every node of
/// a cluster loads its own copy of the same files.
fn alpha_and_beta() -> Arc<Adapters> {
    let set = Adapters::new();
    set.insert("alpha", lora(1, 0xa1)).unwrap();
    set.insert("beta", lora(2, 0xb2)).unwrap();
    Arc::new(set)
}

const POOL: usize = 512;

fn engine(prefix_cache: bool) -> EngineHandle {
    engine::start(
        synth_model(),
        EngineConfig {
            pool_tokens: POOL,
            max_context: Some(POOL),
            scrub: ScrubPolicy::Poison,
            prefix_cache,
            ..EngineConfig::default()
        },
    )
    .unwrap()
}

fn identity(ca: &ClusterCa, name: &str) -> TlsIdentity {
    let id = ca.identity(name).unwrap();
    TlsIdentity::from_pem(
        ca.pem().as_bytes().to_vec(),
        id.cert.into_bytes(),
        id.key.into_bytes(),
    )
}

struct TestNode {
    addr: String,
    engine: EngineHandle,
    metrics: Arc<TransferMetrics>,
}

async fn start_node(role: Role, ca: &ClusterCa, deadlines: Deadlines) -> TestNode {
    start_node_with(role, ca, deadlines, Arc::new(Adapters::new())).await
}

async fn start_node_with(
    role: Role,
    ca: &ClusterCa,
    deadlines: Deadlines,
    adapters: Arc<Adapters>,
) -> TestNode {
    let engine = engine(role == Role::Prefill);
    let tls = identity(ca, role.name());
    let metrics = Arc::new(TransferMetrics::default());
    let service = Arc::new(NodeService::new(
        NodeIdentity {
            role,
            model_checksum: 1,
            pool_tokens: POOL,
            page_tokens: 16,
            n_layers: 2,
            kv_dim: 32,
            kv_dtype: kv::KvDtype::F16,
        },
        engine.clone(),
        metrics.clone(),
        deadlines,
        tls.clone(),
        Arc::new(synth_vocabulary()),
        adapters,
    ));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let m = metrics.clone();
    tokio::spawn(async move {
        transfer::serve_node(listener, service, &tls, m, std::future::pending())
            .await
            .unwrap()
    });
    TestNode {
        addr,
        engine,
        metrics,
    }
}

fn client(addr: &str, tls: &TlsIdentity) -> NodeClient<Channel> {
    NodeClient::new(transfer::connect_lazy(addr, tls, Duration::from_secs(5)).unwrap())
        .max_decoding_message_size(8 << 20)
        .max_encoding_message_size(8 << 20)
}

fn request(tenant: &str, len: usize, max_tokens: usize) -> GenerateRequest {
    GenerateRequest {
        adapter: None,
        weight: 1,
        domain: IsolationDomain::tenant(tenant),
        prompt: (0..len as u32).map(|i| 3 + (i * 53 + 1) % 290).collect(),
        max_tokens,
        sampling: SamplingParams::default(),
        ignore_eos: true,
        logprobs: None,
        constraint: None,
    }
}

async fn collect_local(engine: &EngineHandle, req: GenerateRequest) -> Vec<u32> {
    let mut h = engine
        .submit(engine.admission().admit(req).unwrap())
        .unwrap();
    let mut out = Vec::new();
    loop {
        match h.events.recv().await {
            Some(Event::Token(t)) => out.push(t.id),
            Some(Event::Finished { .. }) => return out,
            other => panic!("unexpected {other:?}"),
        }
    }
}

/// Opens a decode stream and returns it with its reservation's ticket.
async fn reserve(
    decode: &mut NodeClient<Channel>,
    id: &str,
    req: &GenerateRequest,
) -> (tonic::Streaming<pb::DecodeEvent>, Vec<u8>) {
    let mut stream = decode
        .decode(wire::request_to_pb(id, req))
        .await
        .unwrap()
        .into_inner();
    match stream.message().await.unwrap().unwrap().event {
        Some(pb::decode_event::Event::Reserved(r)) => (stream, r.ticket),
        other => panic!("expected a reservation, got {other:?}"),
    }
}

/// Tokens until the end, or the failure's reason.
async fn drain(stream: &mut tonic::Streaming<pb::DecodeEvent>) -> Result<Vec<u32>, String> {
    let mut out = Vec::new();
    loop {
        match stream.message().await {
            Ok(Some(pb::DecodeEvent { event: Some(e) })) => match e {
                pb::decode_event::Event::Token(t) => out.push(t.id),
                pb::decode_event::Event::Finished(_) => return Ok(out),
                pb::decode_event::Event::Failed(f) => return Err(f.reason),
                other => return Err(format!("unexpected {other:?}")),
            },
            other => return Err(format!("stream ended: {other:?}")),
        }
    }
}

async fn wait_idle(engine: &EngineHandle) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while engine.pool_counts().leased != 0 {
        assert!(Instant::now() < deadline, "decode pages still leased");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_honest_handoff_gives_the_monolithic_tokens() {
    let ca = ClusterCa::generate("test CA").unwrap();
    let router = identity(&ca, "router");
    let (pre, dec) = (
        start_node(Role::Prefill, &ca, Deadlines::default()).await,
        start_node(Role::Decode, &ca, Deadlines::default()).await,
    );
    let mono = engine(false);
    for (i, (len, max_tokens)) in [(7, 9), (40, 12), (16, 1)].into_iter().enumerate() {
        let req = request("alice", len, max_tokens);
        let id = format!("req-{i}");
        let expected = collect_local(&mono, request("alice", len, max_tokens)).await;
        let mut d = client(&dec.addr, &router);
        let (mut stream, ticket) = reserve(&mut d, &id, &req).await;
        let reply = client(&pre.addr, &router)
            .prefill(pb::PrefillRequest {
                request: Some(wire::request_to_pb(&id, &req)),
                decode_addr: dec.addr.clone(),
                ticket,
            })
            .await
            .unwrap()
            .into_inner();
        assert!(
            matches!(reply.outcome, Some(pb::prefill_reply::Outcome::Done(_))),
            "{reply:?}"
        );
        assert_eq!(drain(&mut stream).await.unwrap(), expected, "case {i}");
    }
    wait_idle(&dec.engine).await;
    assert_eq!(
        dec.metrics
            .transfers
            .load(std::sync::atomic::Ordering::Relaxed),
        3
    );
    assert!(
        dec.metrics
            .bytes_received
            .load(std::sync::atomic::Ordering::Relaxed)
            > 0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_admission_refuses_over_length_before_any_work() {
    let ca = ClusterCa::generate("test CA").unwrap();
    let router = identity(&ca, "router");
    let pre = start_node(Role::Prefill, &ca, Deadlines::default()).await;
    let mut p = client(&pre.addr, &router);
    for (len, max_tokens, ok) in [(POOL - 1, 1, true), (POOL, 1, false), (POOL + 1, 1, false)] {
        let reply = p
            .admit(wire::request_to_pb("r", &request("alice", len, max_tokens)))
            .await
            .unwrap()
            .into_inner();
        match reply.outcome {
            Some(pb::admit_reply::Outcome::Admitted(_)) => assert!(ok, "{len} admitted"),
            Some(pb::admit_reply::Outcome::Rejected(r)) => {
                assert!(!ok, "{len} rejected");
                let r = wire::rejection_from_pb(r).unwrap();
                assert_eq!(r.code(), "context_length_exceeded");
                assert!(r.to_string().contains(&POOL.to_string()), "{r}");
            }
            None => panic!("no verdict"),
        }
    }
    // Admission is a check only: nothing was computed or held.
    assert_eq!(pre.engine.pool_counts().leased, 0);
    let steps = engine::EngineMetrics::get(&pre.engine.metrics().steps);
    assert_eq!(steps, 0, "admission ran the model");
}

type Corrupt = fn(&mut Manifest, &mut PrefillOutput);

/// Each corruption, injected by a peer that holds a valid cluster certificate, is refused
/// with its own reason, counted under it, reported on the decode stream, and leaves no
/// page leased.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_injected_corruption_is_refused_with_its_own_reason() {
    let ca = ClusterCa::generate("test CA").unwrap();
    let peer = identity(&ca, "rogue-prefill");
    let dec = start_node(Role::Decode, &ca, Deadlines::default()).await;
    let local_prefill = engine(false);
    let req = request("alice", 40, 4);
    let mut h = local_prefill
        .submit_prefill(
            local_prefill
                .admission()
                .admit(request("alice", 40, 4))
                .unwrap(),
        )
        .unwrap();
    let output = match h.events.recv().await {
        Some(Event::Prefilled(out)) => *out,
        other => panic!("{other:?}"),
    };
    let cases: Vec<(&str, &str, Corrupt)> = vec![
        ("corrupted page checksum", "checksum", |_, o| {
            o.pages[0][3] ^= 1
        }),
        ("missing page", "coverage", |_, o| {
            o.pages.pop();
        }),
        ("wrong token count", "manifest", |m, _| m.prompt_len = 41),
        ("manifest for another tenant", "manifest", |m, _| {
            m.domain = IsolationDomain::tenant("bob")
        }),
        ("placeholder prompt", "checksum", |m, o| {
            o.prompt.truncate(1);
            m.token_checksum = engine::handoff::token_checksum(&o.prompt);
        }),
    ];
    for (i, (name, reason, corrupt)) in cases.into_iter().enumerate() {
        let id = format!("inj-{i}");
        let mut d = client(&dec.addr, &peer);
        let (mut stream, ticket) = reserve(&mut d, &id, &req).await;
        let ticket = Ticket::from_bytes(&ticket).unwrap();
        let mut manifest = Manifest::describe(ticket, id.clone(), req.domain.clone(), &output);
        let mut sent = output.clone();
        corrupt(&mut manifest, &mut sent);
        let mut frames = vec![pb::KvFrame {
            frame: Some(pb::kv_frame::Frame::Manifest(wire::manifest_to_pb(
                &manifest, None,
            ))),
        }];
        for (index, page) in sent.pages.iter().enumerate() {
            frames.push(pb::KvFrame {
                frame: Some(pb::kv_frame::Frame::Page(pb::Page {
                    index: index as u32,
                    tokens: (40 - index * 16).min(16) as u32,
                    data: page.clone(),
                })),
            });
        }
        let before = dec.metrics.failures(reason);
        let reply = d
            .push_kv(tokio_stream::iter(frames))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(
            reply.failed.as_ref().map(|f| f.reason.as_str()),
            Some(reason),
            "{name}: {reply:?}"
        );
        assert_eq!(drain(&mut stream).await, Err(reason.to_owned()), "{name}");
        assert_eq!(dec.metrics.failures(reason), before + 1, "{name}: metric");
        wait_idle(&dec.engine).await;
    }
    assert_eq!(
        dec.metrics
            .transfers
            .load(std::sync::atomic::Ordering::Relaxed),
        0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_push_to_an_unknown_ticket_is_refused() {
    let ca = ClusterCa::generate("test CA").unwrap();
    let dec = start_node(Role::Decode, &ca, Deadlines::default()).await;
    let local_prefill = engine(false);
    let req = request("alice", 20, 2);
    let mut h = local_prefill
        .submit_prefill(
            local_prefill
                .admission()
                .admit(request("alice", 20, 2))
                .unwrap(),
        )
        .unwrap();
    let Some(Event::Prefilled(output)) = h.events.recv().await else {
        panic!("no prefill");
    };
    let manifest = Manifest::describe(Ticket::random(), "x".into(), req.domain.clone(), &output);
    let frames = vec![pb::KvFrame {
        frame: Some(pb::kv_frame::Frame::Manifest(wire::manifest_to_pb(
            &manifest, None,
        ))),
    }];
    let reply = client(&dec.addr, &identity(&ca, "p"))
        .push_kv(tokio_stream::iter(frames))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(reply.failed.unwrap().reason, "manifest");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reservation_without_its_kv_times_out_and_returns_its_pages() {
    let ca = ClusterCa::generate("test CA").unwrap();
    // Long enough that the lease check below runs before the deadline on a loaded machine.
    let deadlines = Deadlines {
        handoff: Duration::from_secs(3),
        frame: Duration::from_secs(5),
    };
    let dec = start_node(Role::Decode, &ca, deadlines).await;
    let mut d = client(&dec.addr, &identity(&ca, "router"));
    let (mut stream, _ticket) = reserve(&mut d, "late", &request("alice", 40, 4)).await;
    assert!(dec.engine.pool_counts().leased > 0);
    assert_eq!(drain(&mut stream).await, Err("timeout".to_owned()));
    wait_idle(&dec.engine).await;
    assert_eq!(dec.metrics.failures("timeout"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_without_a_cluster_certificate_is_refused() {
    let ca = ClusterCa::generate("test CA").unwrap();
    let dec = start_node(Role::Decode, &ca, Deadlines::default()).await;
    let outsider_ca = ClusterCa::generate("another CA").unwrap();
    // Trusts the node's CA (so the client side would accept the server) but presents a
    // certificate the node's CA never signed.
    let foreign = outsider_ca.identity("intruder").unwrap();
    let intruder = TlsIdentity::from_pem(
        ca.pem().as_bytes().to_vec(),
        foreign.cert.into_bytes(),
        foreign.key.into_bytes(),
    );
    let refused = client(&dec.addr, &intruder)
        .decode(wire::request_to_pb("x", &request("alice", 10, 2)))
        .await;
    assert!(refused.is_err(), "an uncertified client was served");
    let deadline = Instant::now() + Duration::from_secs(5);
    while dec.metrics.failures("auth") == 0 {
        assert!(
            Instant::now() < deadline,
            "the refused handshake was not counted"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        dec.metrics
            .decode_requests
            .load(std::sync::atomic::Ordering::Relaxed),
        0
    );
    // The same node serves a certified client.
    let ok = client(&dec.addr, &identity(&ca, "router"))
        .info(pb::InfoRequest {})
        .await;
    assert!(ok.is_ok(), "{ok:?}");
}

/// A frame over the node's message bound ends only its own transfer: the reservation fails
/// with `protocol`, its pages return, and the node goes on serving an honest handoff.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversized_frame_ends_only_its_own_transfer() {
    let ca = ClusterCa::generate("test CA").unwrap();
    let peer = identity(&ca, "p");
    let (pre, dec) = (
        start_node(Role::Prefill, &ca, Deadlines::default()).await,
        start_node(Role::Decode, &ca, Deadlines::default()).await,
    );
    let req = request("alice", 20, 3);
    let local_prefill = engine(false);
    let mut h = local_prefill
        .submit_prefill(
            local_prefill
                .admission()
                .admit(request("alice", 20, 3))
                .unwrap(),
        )
        .unwrap();
    let Some(Event::Prefilled(output)) = h.events.recv().await else {
        panic!("no prefill");
    };
    let mut d = client(&dec.addr, &peer).max_encoding_message_size(64 << 20);
    let (mut stream, ticket) = reserve(&mut d, "big", &req).await;
    let ticket = Ticket::from_bytes(&ticket).unwrap();
    let manifest = Manifest::describe(ticket, "big".into(), req.domain.clone(), &output);
    let frames = vec![
        pb::KvFrame {
            frame: Some(pb::kv_frame::Frame::Manifest(wire::manifest_to_pb(
                &manifest, None,
            ))),
        },
        pb::KvFrame {
            frame: Some(pb::kv_frame::Frame::Page(pb::Page {
                index: 0,
                tokens: 16,
                data: vec![0; 16 << 20],
            })),
        },
    ];
    let reply = d.push_kv(tokio_stream::iter(frames)).await;
    let refused = match reply {
        Ok(r) => r.into_inner().failed.is_some(),
        Err(_) => true,
    };
    assert!(refused, "an oversized frame was accepted");
    assert!(drain(&mut stream).await.is_err());
    wait_idle(&dec.engine).await;
    // The node still serves.
    let mono = engine(false);
    let expected = collect_local(&mono, request("alice", 20, 3)).await;
    let router = identity(&ca, "router");
    let mut d = client(&dec.addr, &router);
    let (mut stream, ticket) = reserve(&mut d, "ok", &req).await;
    client(&pre.addr, &router)
        .prefill(pb::PrefillRequest {
            request: Some(wire::request_to_pb("ok", &req)),
            decode_addr: dec.addr.clone(),
            ticket,
        })
        .await
        .unwrap();
    assert_eq!(drain(&mut stream).await.unwrap(), expected);
}

/// A malformed manifest ends its reservation at once, not at the deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_manifest_ends_its_reservation_at_once() {
    let ca = ClusterCa::generate("test CA").unwrap();
    let dec = start_node(Role::Decode, &ca, Deadlines::default()).await;
    let mut d = client(&dec.addr, &identity(&ca, "p"));
    let (mut stream, ticket) = reserve(&mut d, "m", &request("alice", 20, 3)).await;
    let manifest = pb::Manifest {
        ticket,
        request_id: "m".into(),
        ..Default::default()
    };
    let reply = d
        .push_kv(tokio_stream::iter(vec![pb::KvFrame {
            frame: Some(pb::kv_frame::Frame::Manifest(manifest)),
        }]))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(reply.failed.unwrap().reason, "manifest");
    assert_eq!(drain(&mut stream).await, Err("manifest".to_owned()));
    wait_idle(&dec.engine).await;
}

fn with_adapter(mut req: GenerateRequest, adapter: Option<AdapterRef>) -> GenerateRequest {
    req.adapter = adapter;
    req
}

/// Prefill through `pre` and decode on `dec`, as the router runs a request: its tokens, or
/// the failure's reason.
async fn split(
    pre: &TestNode,
    dec: &TestNode,
    router: &TlsIdentity,
    id: &str,
    req: &GenerateRequest,
) -> Result<Vec<u32>, String> {
    let mut d = client(&dec.addr, router);
    let (mut stream, ticket) = reserve(&mut d, id, req).await;
    let reply = client(&pre.addr, router)
        .prefill(pb::PrefillRequest {
            request: Some(wire::request_to_pb(id, req)),
            decode_addr: dec.addr.clone(),
            ticket,
        })
        .await
        .unwrap()
        .into_inner();
    assert!(
        matches!(reply.outcome, Some(pb::prefill_reply::Outcome::Done(_))),
        "{id}: {reply:?}"
    );
    drain(&mut stream).await
}

/// The router names an adapter by identity only (no weights); each node computes under its
/// own copy. Under the base model, `alpha` and `beta` the same prompt gives three different
/// texts, each exactly the monolithic engine's under that adapter.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handoff_under_an_adapter_gives_that_adapters_monolithic_tokens() {
    let ca = ClusterCa::generate("test CA").unwrap();
    let router = identity(&ca, "router");
    let (pre, dec) = (
        start_node_with(Role::Prefill, &ca, Deadlines::default(), alpha_and_beta()).await,
        start_node_with(Role::Decode, &ca, Deadlines::default(), alpha_and_beta()).await,
    );
    let mono = engine(false);
    let local = alpha_and_beta();
    let mut seen = Vec::new();
    for name in [None, Some("alpha"), Some("beta")] {
        let adapter = name.map(|n| local.get(n).unwrap());
        let remote = adapter.as_ref().map(|a| AdapterId::of(a).to_remote());
        let expected = collect_local(&mono, with_adapter(request("alice", 40, 12), adapter)).await;
        let got = split(
            &pre,
            &dec,
            &router,
            &format!("{name:?}"),
            &with_adapter(request("alice", 40, 12), remote),
        )
        .await
        .unwrap();
        assert_eq!(got, expected, "{name:?}: split differs from monolithic");
        seen.push(got);
    }
    assert_ne!(seen[0], seen[1], "alpha computes what the base model does");
    assert_ne!(seen[0], seen[2], "beta computes what the base model does");
    assert_ne!(seen[1], seen[2], "alpha and beta compute the same");
    wait_idle(&dec.engine).await;

    // Info reports the set, sorted by name, with each adapter's identity and scale.
    let info = client(&pre.addr, &router)
        .info(pb::InfoRequest {})
        .await
        .unwrap()
        .into_inner();
    let reported = wire::adapters_from_pb(info.adapters).unwrap();
    assert_eq!(reported, local.list());
}

/// A node holding no adapter under the name, or another version under it (what it
/// computes, or only its file), refuses the request at admission with
/// `adapter_not_loaded`, on both roles, before anything is computed or held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_refuses_an_adapter_it_does_not_hold_in_exactly_that_version() {
    let ca = ClusterCa::generate("test CA").unwrap();
    let router = identity(&ca, "router");
    let (pre, dec) = (
        start_node_with(Role::Prefill, &ca, Deadlines::default(), alpha_and_beta()).await,
        start_node_with(Role::Decode, &ca, Deadlines::default(), alpha_and_beta()).await,
    );
    let versions = [
        ("an adapter the node does not hold", "gamma", lora(3, 0xc3)),
        ("another version of alpha", "alpha", lora(3, 0xa1)),
        (
            "alpha's arithmetic from another file",
            "alpha",
            lora(1, 0xa2),
        ),
        ("beta's identity under alpha's name", "alpha", lora(2, 0xb2)),
    ];
    for (i, (case, name, weights)) in versions.into_iter().enumerate() {
        let named = AdapterId::of(&AdapterRef::local(name, weights)).to_remote();
        let req = with_adapter(request("alice", 20, 4), Some(named));
        let refused = |r: Option<pb::Rejection>| {
            let r = wire::rejection_from_pb(r.expect("a rejection")).unwrap();
            assert_eq!(
                r,
                engine::Rejection::AdapterNotLoaded { name: name.into() },
                "{case}"
            );
        };
        match client(&pre.addr, &router)
            .admit(wire::request_to_pb(&format!("a{i}"), &req))
            .await
            .unwrap()
            .into_inner()
            .outcome
        {
            Some(pb::admit_reply::Outcome::Rejected(r)) => refused(Some(r)),
            other => panic!("{case}: prefill admitted it: {other:?}"),
        }
        let mut stream = client(&dec.addr, &router)
            .decode(wire::request_to_pb(&format!("d{i}"), &req))
            .await
            .unwrap()
            .into_inner();
        match stream.message().await.unwrap().and_then(|e| e.event) {
            Some(pb::decode_event::Event::Rejected(r)) => refused(Some(r)),
            other => panic!("{case}: decode reserved for it: {other:?}"),
        }
        // The prefill call re-admits on its own values and refuses as well.
        let reply = client(&pre.addr, &router)
            .prefill(pb::PrefillRequest {
                request: Some(wire::request_to_pb(&format!("p{i}"), &req)),
                decode_addr: dec.addr.clone(),
                ticket: Ticket::random().to_bytes().to_vec(),
            })
            .await
            .unwrap()
            .into_inner();
        match reply.outcome {
            Some(pb::prefill_reply::Outcome::Rejected(r)) => refused(Some(r)),
            other => panic!("{case}: prefill computed it: {other:?}"),
        }
    }
    let get = |c: &std::sync::atomic::AtomicU64| c.load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(get(&pre.metrics.rejected), 4);
    assert_eq!(get(&dec.metrics.rejected), 4);
    assert_eq!(dec.engine.pool_counts().leased, 0);
    let steps = engine::EngineMetrics::get(&pre.engine.metrics().steps);
    assert_eq!(steps, 0, "a refused adapter request ran the model");
}

/// A case: its name, the adapter the request runs under, the one its K/V was computed
/// under, and the failure expected (`None`: it verifies).
type AdapterCase = (
    &'static str,
    Option<AdapterRef>,
    Option<AdapterRef>,
    Option<&'static str>,
);

/// A push whose manifest names another adapter than the one the decode node's own request
/// resolved to (another adapter, another version, the same arithmetic from another file,
/// the base model) is refused as a manifest mismatch, counted, ends the request with that
/// reason, and returns the reservation's pages. A push computed under the base model for a
/// base request, and under alpha for an alpha request, still verifies.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_push_computed_under_another_adapter_is_refused_and_counted() {
    let ca = ClusterCa::generate("test CA").unwrap();
    let peer = identity(&ca, "other-version-prefill");
    let dec = start_node_with(Role::Decode, &ca, Deadlines::default(), alpha_and_beta()).await;
    let held = alpha_and_beta();
    // What a prefill node computed, under `adapter`'s weights, for a 40-token prompt.
    let prefill = |adapter: Option<AdapterRef>| async move {
        let local = engine(false);
        let req = with_adapter(request("alice", 40, 4), adapter);
        let mut h = local
            .submit_prefill(local.admission().admit(req).unwrap())
            .unwrap();
        match h.events.recv().await {
            Some(Event::Prefilled(out)) => *out,
            other => panic!("{other:?}"),
        }
    };
    let other = |name: &str, w: Arc<LoraAdapter>| Some(AdapterRef::local(name, w));
    let cases: Vec<AdapterCase> = vec![
        (
            "beta's K/V",
            held.get("alpha"),
            held.get("beta"),
            Some("manifest"),
        ),
        (
            "another version's K/V",
            held.get("alpha"),
            other("alpha", lora(3, 0xa1)),
            Some("manifest"),
        ),
        (
            "another file's K/V",
            held.get("alpha"),
            other("alpha", lora(1, 0xa2)),
            Some("manifest"),
        ),
        (
            "the base model's K/V",
            held.get("alpha"),
            None,
            Some("manifest"),
        ),
        (
            "alpha's K/V for a base request",
            None,
            held.get("alpha"),
            Some("manifest"),
        ),
        (
            "alpha's own K/V",
            held.get("alpha"),
            held.get("alpha"),
            None,
        ),
        ("the base model's own K/V", None, None, None),
    ];
    let mut refused = 0;
    for (i, (case, runs_under, computed_under, reason)) in cases.into_iter().enumerate() {
        let id = format!("adapter-{i}");
        let req = with_adapter(
            request("alice", 40, 4),
            runs_under.map(|a| AdapterId::of(&a).to_remote()),
        );
        let mut d = client(&dec.addr, &peer);
        let (mut stream, ticket) = reserve(&mut d, &id, &req).await;
        let named = computed_under.as_ref().map(AdapterId::of);
        let output = prefill(computed_under).await;
        // The manifest a prefill node that ran `computed_under` writes, truthfully.
        let domain = req
            .domain
            .computed_under(named.as_ref().map(|a| a.fingerprint));
        let manifest = Manifest::describe(
            Ticket::from_bytes(&ticket).unwrap(),
            id.clone(),
            domain,
            &output,
        );
        let mut frames = vec![pb::KvFrame {
            frame: Some(pb::kv_frame::Frame::Manifest(wire::manifest_to_pb(
                &manifest,
                named.as_ref(),
            ))),
        }];
        for (index, page) in output.pages.iter().enumerate() {
            frames.push(pb::KvFrame {
                frame: Some(pb::kv_frame::Frame::Page(pb::Page {
                    index: index as u32,
                    tokens: (40 - index * 16).min(16) as u32,
                    data: page.clone(),
                })),
            });
        }
        let before = dec.metrics.failures("manifest");
        let reply = d
            .push_kv(tokio_stream::iter(frames))
            .await
            .unwrap()
            .into_inner();
        match reason {
            Some(reason) => {
                refused += 1;
                let f = reply.failed.expect(case);
                assert_eq!(f.reason, reason, "{case}: {f:?}");
                assert!(
                    f.message.contains("computed under"),
                    "{case}: {}",
                    f.message
                );
                assert_eq!(drain(&mut stream).await, Err(reason.to_owned()), "{case}");
                assert_eq!(dec.metrics.failures(reason), before + 1, "{case}: metric");
            }
            None => {
                assert!(reply.failed.is_none(), "{case}: {reply:?}");
                assert_eq!(drain(&mut stream).await.map(|t| t.len()), Ok(4), "{case}");
            }
        }
        wait_idle(&dec.engine).await;
    }
    assert_eq!(refused, 5);
}
