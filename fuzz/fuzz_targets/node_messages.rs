//! Node-to-node messages of the disaggregated mode: protobuf decoding of what a peer sends
//! (requests, manifests, KV frames, decode events, replies) and the `transfer::wire`
//! conversions that turn them into engine values. A message either converts or is an
//! `invalid_argument`; what converts survives a second round trip unchanged.
#![no_main]

use libfuzzer_sys::fuzz_target;
use prost::Message;
use transfer::{pb, wire};

fn request(m: pb::GenerateRequest) {
    // A constraint in the message is compiled against the synthetic byte vocabulary; a node
    // holding no adapter refuses every adapter request.
    let vocab = kvwarden_fuzz::byte_vocabulary();
    let adapters = engine::Adapters::new();
    let Ok((id, req)) = wire::request_from_pb(m, vocab, &adapters) else {
        return;
    };
    assert!(
        req.adapter.is_none(),
        "an adapter no node holds was resolved"
    );
    let once = wire::request_to_pb(&id, &req);
    let (id2, req2) = wire::request_from_pb(once.clone(), vocab, &adapters)
        .unwrap_or_else(|e| panic!("a request we encoded does not decode: {e}"));
    // Compared as bytes: a NaN field is unequal to itself but encodes the same.
    assert_eq!(
        once.encode_to_vec(),
        wire::request_to_pb(&id2, &req2).encode_to_vec()
    );
}

fn manifest(m: pb::Manifest) {
    let Ok((man, adapter)) = wire::manifest_from_pb(m) else {
        return;
    };
    // The domain is computed under the adapter the manifest names, whatever it says.
    assert_eq!(
        man.domain.adapter(),
        adapter.as_ref().map(|a| a.fingerprint)
    );
    let once = wire::manifest_to_pb(&man, adapter.as_ref());
    let (again, adapter2) = wire::manifest_from_pb(once.clone())
        .unwrap_or_else(|e| panic!("a manifest we encoded does not decode: {e}"));
    assert_eq!(adapter, adapter2);
    assert_eq!(
        once.encode_to_vec(),
        wire::manifest_to_pb(&again, adapter2.as_ref()).encode_to_vec()
    );
}

fn rejection(r: pb::Rejection) {
    if let Ok(rej) = wire::rejection_from_pb(r) {
        let once = wire::rejection_to_pb(&rej);
        assert_eq!(wire::rejection_from_pb(once).ok(), Some(rej));
    }
}

fn token(t: pb::Token) {
    if let Ok(tok) = wire::token_from_pb(t) {
        let again = wire::token_from_pb(wire::token_to_pb(&tok))
            .unwrap_or_else(|e| panic!("a token we encoded does not decode: {e}"));
        assert_eq!(again.id, tok.id);
        assert_eq!(again.top_logprobs.len(), tok.top_logprobs.len());
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&which, bytes)) = data.split_first() else {
        return;
    };
    match which % 6 {
        0 => {
            if let Ok(m) = pb::GenerateRequest::decode(bytes) {
                request(m);
            }
        }
        1 => {
            if let Ok(m) = pb::Manifest::decode(bytes) {
                manifest(m);
            }
        }
        2 => match pb::KvFrame::decode(bytes).map(|f| f.frame) {
            Ok(Some(pb::kv_frame::Frame::Manifest(m))) => manifest(m),
            Ok(Some(pb::kv_frame::Frame::Page(p))) => {
                let _ = engine::handoff::page_checksum(p.index as usize, &p.data);
            }
            _ => {}
        },
        3 => {
            use pb::decode_event::Event;
            match pb::DecodeEvent::decode(bytes).map(|e| e.event) {
                Ok(Some(Event::Rejected(r))) => rejection(r),
                Ok(Some(Event::Token(t))) => token(t),
                Ok(Some(Event::Finished(f))) => {
                    let (reason, usage) = wire::finished_from_pb(&f);
                    assert_eq!(wire::finished_to_pb(reason, &usage), f);
                }
                Ok(Some(Event::Reserved(r))) => {
                    let _ = engine::handoff::Ticket::from_bytes(&r.ticket);
                }
                _ => {}
            }
        }
        4 => {
            if let Ok(r) = pb::AdmitReply::decode(bytes) {
                if let Some(pb::admit_reply::Outcome::Rejected(r)) = r.outcome {
                    rejection(r);
                }
            }
        }
        _ => {
            if let Ok(r) = pb::PrefillRequest::decode(bytes) {
                if let Some(req) = r.request {
                    request(req);
                }
                let _ = engine::handoff::Ticket::from_bytes(&r.ticket);
            }
            let _ = pb::PrefillReply::decode(bytes);
            if let Ok(info) = pb::NodeInfo::decode(bytes) {
                // A node's adapter set: refused or a sorted list of distinct names.
                if let Ok(set) = wire::adapters_from_pb(info.adapters) {
                    assert!(set.windows(2).all(|w| w[0].name < w[1].name));
                }
            }
        }
    }
});
