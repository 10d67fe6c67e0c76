//! `/health` tells the truth about the engine, and a panic in a step is a 500 for that
//! step's requests, not a dead engine behind a healthy-looking server.

mod common;

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use common::*;
use engine::EngineConfig;
use serde_json::json;

fn completion(prompt: &[u32]) -> serde_json::Value {
    json!({"model": MODEL_NAME, "prompt": prompt, "max_tokens": 4, "temperature": 0})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_follows_the_engine_through_panics() {
    let (engine, panics) = faulty_engine(EngineConfig {
        pool_tokens: 1024,
        ..EngineConfig::default()
    });
    let (addr, _stop) = serve(state(engine.clone())).await;
    assert_eq!(get(addr, "/health").await.status, 200);

    // One panicking step: its request gets a 500 in OpenAI's shape, the engine goes on.
    panics.store(1, Ordering::SeqCst);
    let r = post_json(addr, "/v1/completions", &completion(&[5, 6, 7])).await;
    assert_eq!(r.status, 500, "{:?}", String::from_utf8_lossy(&r.body));
    let err = &r.json()["error"];
    assert_eq!(err["code"], "model_error");
    assert_eq!(err["type"], "server_error");
    assert!(
        !err["message"].as_str().unwrap_or("").contains("injected"),
        "{err}"
    );
    assert_eq!(get(addr, "/health").await.status, 200);
    let ok = post_json(addr, "/v1/completions", &completion(&[5, 6, 7])).await;
    assert_eq!(ok.status, 200, "{:?}", String::from_utf8_lossy(&ok.body));

    // Every step panics: the engine stops, and /health says so.
    panics.store(usize::MAX, Ordering::SeqCst);
    for _ in 0..3 {
        let r = post_json(addr, "/v1/completions", &completion(&[8, 9])).await;
        assert_eq!(r.status, 500);
    }
    // Liveness only: the engine thread ends right after its third failed step.
    let deadline = Instant::now() + Duration::from_secs(30);
    while engine.is_alive() {
        assert!(Instant::now() < deadline, "the engine is still running");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let health = get(addr, "/health").await;
    assert_eq!(health.status, 503);
    assert_eq!(health.json()["error"]["code"], "engine_unavailable");
    let r = post_json(addr, "/v1/completions", &completion(&[5, 6, 7])).await;
    assert_eq!(r.status, 503);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_fails_once_the_engine_is_shut_down() {
    let (engine, _) = faulty_engine(EngineConfig {
        pool_tokens: 1024,
        ..EngineConfig::default()
    });
    let (addr, _stop) = serve(state(engine.clone())).await;
    assert_eq!(get(addr, "/health").await.status, 200);
    engine.shutdown();
    let deadline = Instant::now() + Duration::from_secs(30);
    while engine.is_alive() {
        assert!(Instant::now() < deadline, "the engine is still running");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(get(addr, "/health").await.status, 503);
}
