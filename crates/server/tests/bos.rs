//! A vocabulary that asks for a BOS (`tokenizer.ggml.add_bos_token`, as Llama 3's files do)
//! gets exactly one in front of every text prompt, for completions and for chat; one that
//! does not gets none, and token-id prompts are taken as they are.

mod common;

use std::sync::Arc;

use common::*;
use engine::EngineConfig;
use gguf::GgmlType;
use model::synth::{SynthArch, SynthSpec};
use serde_json::json;
use server::{AppState, Auth};
use tokenizer::Tokenizer;

async fn prompt_tokens(arch: SynthArch) -> (Arc<Tokenizer>, [u64; 3]) {
    let spec = SynthSpec {
        layers: 1,
        dim: 64,
        heads: 4,
        kv_heads: 2,
        ffn_dim: 128,
        vocab: 300,
        context: 4096,
        seed: 3,
        weight_type: GgmlType::Q8_0,
    };
    let file = gguf::GgufFile::parse(spec.build_arch(arch).unwrap().to_bytes()).unwrap();
    let tok = Arc::new(Tokenizer::from_gguf(&file).unwrap());
    let template = tok.compile_chat_template().unwrap();
    let model = model::Model::load(&file).unwrap();
    let engine = engine::start(
        model,
        EngineConfig {
            pool_tokens: 1024,
            ..EngineConfig::default()
        },
    )
    .unwrap();
    let state = Arc::new(AppState::new(
        Arc::new(engine),
        tok.clone(),
        template,
        MODEL_NAME.to_owned(),
        Auth::Open,
        1 << 20,
    ));
    let (addr, _stop) = serve(state).await;
    let usage = |r: Reply| {
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
        r.json()["usage"]["prompt_tokens"].as_u64().unwrap()
    };
    let text = json!({"model": MODEL_NAME, "prompt": "Hi there", "max_tokens": 1});
    let ids = json!({"model": MODEL_NAME, "prompt": [40, 50, 60], "max_tokens": 1});
    let chat = json!({"model": MODEL_NAME, "max_tokens": 1,
        "messages": [{"role": "user", "content": "Hi there"}]});
    let counts = [
        usage(post_json(addr, "/v1/completions", &text).await),
        usage(post_json(addr, "/v1/completions", &ids).await),
        usage(post_json(addr, "/v1/chat/completions", &chat).await),
    ];
    (tok, counts)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bos_is_added_exactly_when_the_vocabulary_asks() {
    let chat_text = "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n";
    for (arch, bos) in [
        (SynthArch::Llama3, true),
        (SynthArch::Qwen2, false),
        (SynthArch::Llama, false),
    ] {
        let (tok, [text, ids, chat]) = prompt_tokens(arch).await;
        assert_eq!(tok.add_bos(), bos, "{arch:?}");
        let extra = u64::from(bos);
        assert_eq!(
            text,
            tok.encode("Hi there").len() as u64 + extra,
            "{arch:?}"
        );
        assert_eq!(ids, 3, "{arch:?}: token-id prompts are taken as they are");
        assert_eq!(chat, tok.encode(chat_text).len() as u64 + extra, "{arch:?}");
    }
}
