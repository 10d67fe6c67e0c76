//! Shared set-up for the fuzz targets: the inputs they start from are built once per
//! process, so each execution spends its time in the code under test.
#![forbid(unsafe_code)]

use std::path::PathBuf;
use std::sync::OnceLock;

use gguf::GgmlType;
use model::synth::SynthSpec;
use tokenizer::{ChatTemplate, Tokenizer};

/// A small synthetic model (the smallest shape whose dims are multiples of 32, as the
/// quantized formats need): every tensor kind a real one has, a byte-level vocabulary and
/// a chat template, in a few tens of KiB, so a mutated copy loads in microseconds.
pub fn small_spec() -> SynthSpec {
    SynthSpec {
        layers: 1,
        dim: 64,
        heads: 2,
        kv_heads: 1,
        ffn_dim: 64,
        vocab: 260,
        context: 256,
        seed: 7,
        weight_type: GgmlType::Q4_1,
    }
}

/// The bytes of [`small_spec`]'s GGUF file.
pub fn small_model_bytes() -> &'static [u8] {
    static BYTES: OnceLock<Vec<u8>> = OnceLock::new();
    BYTES.get_or_init(|| {
        small_spec()
            .build()
            .unwrap_or_else(|e| panic!("synthetic model: {e}"))
            .to_bytes()
    })
}

/// The default model's vocabulary and chat template (the real ones, with ChatML control
/// tokens). Its file is `models/SmolLM2-135M-Instruct.Q4_1.gguf`, or `KVWARDEN_FUZZ_MODEL`.
pub fn real_tokenizer() -> &'static (Tokenizer, ChatTemplate) {
    static TOK: OnceLock<(Tokenizer, ChatTemplate)> = OnceLock::new();
    TOK.get_or_init(|| {
        let path = std::env::var_os("KVWARDEN_FUZZ_MODEL")
            .map(PathBuf::from)
            .unwrap_or_else(|| {
                PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                    .join("../models/SmolLM2-135M-Instruct.Q4_1.gguf")
            });
        // A missing model must stop the run loudly, not fuzz nothing.
        let file = gguf::GgufFile::open(&path)
            .unwrap_or_else(|e| panic!("{}: {e} (run scripts/fetch-model.sh)", path.display()));
        let tok = Tokenizer::from_gguf(&file).unwrap_or_else(|e| panic!("{e}"));
        let template = tok
            .compile_chat_template()
            .unwrap_or_else(|e| panic!("{e}"))
            .unwrap_or_else(|| panic!("the default model has a chat template"));
        (tok, template)
    })
}

/// The synthetic model's byte-level vocabulary as the constraint engine sees it (every
/// byte a token, so any text a grammar allows can be produced).
pub fn byte_vocabulary() -> &'static constraint::Vocabulary {
    static VOCAB: OnceLock<constraint::Vocabulary> = OnceLock::new();
    VOCAB.get_or_init(|| {
        let file = gguf::GgufFile::parse(small_model_bytes().to_vec())
            .unwrap_or_else(|e| panic!("synthetic model: {e}"));
        let tok = std::sync::Arc::new(
            Tokenizer::from_gguf(&file).unwrap_or_else(|e| panic!("synthetic vocabulary: {e}")),
        );
        constraint::Vocabulary::new(tok.clone(), small_spec().vocab, tok.eos_id())
    })
}
