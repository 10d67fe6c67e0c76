//! An adapter file loaded against a small synthetic base model (with an output projection
//! of its own, so every kind of pair can load). The first byte chooses the file: even, the
//! rest of the input is the file itself; odd, the rest is a list of edits to a valid
//! synthetic adapter, as in `model_load` (each 5 bytes an offset, u32 little-endian modulo
//! the file's length, and a byte XORed there; a leftover byte truncates the file to that
//! fraction of its length). A load either is refused or yields pairs that fit the base
//! model, hold only finite values, and fingerprint the same when loaded again.
#![no_main]

use std::sync::OnceLock;

use gguf::{GgmlType, GgufFile};
use libfuzzer_sys::fuzz_target;
use model::lora::synth::LoraSpec;
use model::lora::{LoraAdapter, LoraPair, Target, MAX_RANK};
use model::Model;

/// The base model and a valid adapter's bytes, built once per process.
fn setup() -> &'static (Model, Vec<u8>) {
    static SETUP: OnceLock<(Model, Vec<u8>)> = OnceLock::new();
    SETUP.get_or_init(|| {
        let spec = kvwarden_fuzz::small_spec();
        let mut w = spec
            .build()
            .unwrap_or_else(|e| panic!("synthetic model: {e}"));
        let out: Vec<f32> = (0..spec.dim * spec.vocab)
            .map(|i| ((i % 17) as f32 - 8.0) / 64.0)
            .collect();
        let dims = [spec.dim as u64, spec.vocab as u64];
        w.tensor_f32("output.weight", &dims, GgmlType::Q8_0, &out);
        let base = GgufFile::parse(w.to_bytes()).unwrap_or_else(|e| panic!("{e}"));
        let mut model = Model::load(&base).unwrap_or_else(|e| panic!("{e}"));
        // One compute thread: the fuzzer runs the load on its own thread anyway.
        model.set_threads(1).unwrap_or_else(|e| panic!("{e}"));
        let mut lora = LoraSpec {
            rank: 4,
            seed: 3,
            ..LoraSpec::default()
        };
        lora.set_targets("q,k,v,o,gate,up,down,output")
            .unwrap_or_else(|e| panic!("{e}"));
        let bytes = lora
            .build(&base)
            .unwrap_or_else(|e| panic!("synthetic adapter: {e}"))
            .to_bytes();
        // The unedited adapter must load, or the edits fuzz nothing but refusals.
        load(&model, bytes.clone()).unwrap_or_else(|| panic!("the valid adapter is refused"));
        (model, bytes)
    })
}

fn load(model: &Model, bytes: Vec<u8>) -> Option<LoraAdapter> {
    // The checksum names the file and plays no part in the checks.
    let file = GgufFile::parse(bytes).ok()?;
    LoraAdapter::load(&file, 0, &model.lora_base(), 1.0).ok()
}

/// What a loaded pair must be for the base weight `[n_in, n_out]`.
fn check(p: &LoraPair, n_in: usize, n_out: usize) -> usize {
    assert_eq!((p.n_in, p.n_out), (n_in, n_out));
    assert!(p.rank >= 1 && p.rank <= n_in.min(n_out).min(MAX_RANK));
    assert_eq!(p.a.len(), p.rank * n_in);
    assert_eq!(p.b.len(), n_out * p.rank);
    assert!(p.factor.is_finite());
    assert!(p.a.iter().chain(&p.b).all(|v| v.is_finite()));
    4 * (p.a.len() + p.b.len())
}

fuzz_target!(|data: &[u8]| {
    let (model, valid) = setup();
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let bytes = if mode % 2 == 0 {
        rest.to_vec()
    } else {
        let mut bytes = valid.clone();
        let mut edits = rest.chunks_exact(5);
        for e in &mut edits {
            let at = u32::from_le_bytes([e[0], e[1], e[2], e[3]]) as usize % bytes.len();
            bytes[at] ^= e[4];
        }
        if let [cut] = edits.remainder() {
            bytes.truncate(bytes.len() * usize::from(*cut) / 256);
        }
        bytes
    };
    let Some(adapter) = load(model, bytes.clone()) else {
        return;
    };
    let c = &model.config;
    let mut held = 0;
    for l in 0..c.n_layers {
        for t in Target::ALL {
            let (n_in, n_out) = match t {
                Target::Q => (c.dim, c.q_dim()),
                Target::K | Target::V => (c.dim, c.kv_dim()),
                Target::O => (c.q_dim(), c.dim),
                Target::Gate | Target::Up => (c.dim, c.ffn_dim),
                Target::Down => (c.ffn_dim, c.dim),
            };
            if let Some(p) = adapter.pair(l, t) {
                held += check(p, n_in, n_out);
            }
        }
    }
    assert!(adapter.pair(c.n_layers, Target::Q).is_none());
    if let Some(p) = adapter.output_pair() {
        held += check(p, c.dim, c.vocab_size);
    }
    assert!(held > 0);
    assert_eq!(adapter.bytes(), held);
    let again = load(model, bytes).unwrap_or_else(|| panic!("loaded once, refused again"));
    assert_eq!(again.fingerprint(), adapter.fingerprint());
});
