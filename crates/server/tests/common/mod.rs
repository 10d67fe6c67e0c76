//! A real server on a loopback port, over a synthetic model whose forward pass can be made
//! to panic, and a minimal HTTP/1.1 client that shows exactly what went over the wire.
// Each test binary uses its own part of this.
#![allow(dead_code)]

use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use engine::{EngineConfig, EngineHandle};
use gguf::GgmlType;
use model::synth::SynthSpec;
use server::{AppState, Auth};
use tokenizer::Tokenizer;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

pub const MODEL_NAME: &str = "synth";

/// The default model's tokenizer (token ids below the synthetic vocabulary decode fine).
pub fn tokenizer() -> Arc<Tokenizer> {
    let path =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        path.exists(),
        "{} is missing: run scripts/fetch-model.sh",
        path.display()
    );
    let file = gguf::GgufFile::open(&path).unwrap_or_else(|e| panic!("{e}"));
    Arc::new(Tokenizer::from_gguf(&file).unwrap_or_else(|e| panic!("{e}")))
}

/// The synthetic model, made to panic in `forward` as many times as `panics` says.
pub struct Faulty {
    inner: model::Model,
    pub panics: Arc<AtomicUsize>,
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
        self.inner.forward(items)
    }
}

pub fn synth_model() -> model::Model {
    SynthSpec::small(7, GgmlType::Q4_1, 4096).load().unwrap()
}

pub fn faulty_engine(config: EngineConfig) -> (EngineHandle, Arc<AtomicUsize>) {
    let panics = Arc::new(AtomicUsize::new(0));
    let model = Faulty {
        inner: synth_model(),
        panics: panics.clone(),
    };
    (engine::start(model, config).unwrap(), panics)
}

pub fn state(engine: EngineHandle) -> Arc<AppState> {
    Arc::new(AppState::new(
        Arc::new(engine),
        tokenizer(),
        None,
        MODEL_NAME.to_owned(),
        Auth::Open,
        1 << 20,
    ))
}

/// What came back: status, headers (lower-cased names), body.
#[derive(Debug)]
pub struct Reply {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Reply {
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&self.body)))
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

/// Sends `raw` on a fresh connection and reads until the server closes it.
pub async fn exchange(addr: std::net::SocketAddr, raw: &[u8]) -> Reply {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(raw).await.unwrap();
    let mut buf = Vec::new();
    let _ = s.read_to_end(&mut buf).await;
    parse(&buf)
}

pub fn parse(buf: &[u8]) -> Reply {
    let text = String::from_utf8_lossy(buf);
    let (head, body) = text
        .split_once("\r\n\r\n")
        .unwrap_or_else(|| panic!("no response head in {text:?}"));
    let mut lines = head.split("\r\n");
    let status = lines
        .next()
        .and_then(|l| l.split(' ').nth(1))
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("bad status line in {text:?}"));
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    let chunked = headers
        .iter()
        .any(|(n, v)| n == "transfer-encoding" && v.contains("chunked"));
    let body = if chunked {
        dechunk(body.as_bytes())
    } else {
        body.as_bytes().to_vec()
    };
    Reply {
        status,
        headers,
        body,
    }
}

fn dechunk(mut b: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        let Some(eol) = b.windows(2).position(|w| w == b"\r\n") else {
            return out;
        };
        let size = usize::from_str_radix(std::str::from_utf8(&b[..eol]).unwrap_or("0").trim(), 16)
            .unwrap_or(0);
        if size == 0 {
            return out;
        }
        let start = eol + 2;
        out.extend_from_slice(&b[start..(start + size).min(b.len())]);
        b = &b[(start + size + 2).min(b.len())..];
    }
}

pub async fn get(addr: std::net::SocketAddr, path: &str) -> Reply {
    exchange(
        addr,
        format!("GET {path} HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n").as_bytes(),
    )
    .await
}

pub async fn post_json(addr: std::net::SocketAddr, path: &str, body: &serde_json::Value) -> Reply {
    let body = body.to_string();
    exchange(
        addr,
        format!(
            "POST {path} HTTP/1.1\r\nHost: t\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .as_bytes(),
    )
    .await
}

/// Serves `state` on a loopback port until the returned sender is dropped or fired.
pub async fn serve(
    state: Arc<AppState>,
) -> (std::net::SocketAddr, tokio::sync::oneshot::Sender<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(async move {
        let _ = server::serve(listener, state, async move {
            let _ = rx.await;
        })
        .await;
    });
    (addr, tx)
}
