//! `kvwarden serve --role prefill|decode`: the internal API over mutual TLS, and a plain
//! HTTP port with `/health` and `/metrics` only. Clients never reach a node directly.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use axum::routing::get;
use engine::EngineHandle;
use transfer::{NodeIdentity, NodeService, TransferMetrics};

use crate::serve_args::ServeArgs;
use crate::shutdown_signal;

pub fn run(
    args: ServeArgs,
    engine: EngineHandle,
    identity: NodeIdentity,
    vocabulary: Arc<constraint::Vocabulary>,
    adapters: Arc<engine::Adapters>,
) -> Result<()> {
    let tls = args.tls.load()?;
    let metrics = Arc::new(TransferMetrics::default());
    let role = identity.role;
    let service = Arc::new(NodeService::new(
        identity,
        engine.clone(),
        metrics.clone(),
        transfer::Deadlines {
            handoff: Duration::from_secs(args.handoff_timeout_secs.max(1)),
            ..transfer::Deadlines::default()
        },
        tls.clone(),
        vocabulary,
        adapters,
    ));
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let serving = engine.clone();
    runtime.block_on(async move {
        let engine = serving;
        let listener = tokio::net::TcpListener::bind((args.edge.host.as_str(), args.edge.port))
            .await
            .with_context(|| format!("binding {}:{}", args.edge.host, args.edge.port))?;
        let addr = listener.local_addr()?;
        if let Some(port) = args.metrics_port {
            let http = tokio::net::TcpListener::bind((args.edge.host.as_str(), port))
                .await
                .with_context(|| format!("binding {}:{port}", args.edge.host))?;
            eprintln!(
                "kvwarden: {} node metrics on http://{}",
                role.name(),
                http.local_addr()?
            );
            let (engine, metrics) = (engine.clone(), metrics.clone());
            let app = axum::Router::new()
                .route(
                    "/health",
                    get(|| async { axum::Json(serde_json::json!({"status": "ok"})) }),
                )
                .route(
                    "/metrics",
                    get(move || {
                        let mut out = String::new();
                        server::metrics::render_engine(&engine, &mut out);
                        metrics.render(&mut out);
                        async move {
                            (
                                [(
                                    axum::http::header::CONTENT_TYPE,
                                    "text/plain; version=0.0.4; charset=utf-8",
                                )],
                                out,
                            )
                        }
                    }),
                );
            tokio::spawn(async move {
                if let Err(e) = axum::serve(http, app).await {
                    tracing::error!("metrics port failed: {e}");
                }
            });
        }
        eprintln!(
            "kvwarden: {} node internal API on {addr} (mutual TLS; max context {})",
            role.name(),
            engine.max_context()
        );
        let on_signal = {
            let engine = engine.clone();
            async move {
                shutdown_signal().await;
                eprintln!("kvwarden: shutting down");
                engine.shutdown();
            }
        };
        transfer::serve_node(listener, service, &tls, metrics, on_signal)
            .await
            .context("serving the internal API")
    })?;
    engine.shutdown();
    Ok(())
}
