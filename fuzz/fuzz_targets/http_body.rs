//! HTTP request bodies: JSON to the typed requests, then validation, as the routes do it.
//! Every failure must be a typed client error (4xx), never a panic or a 5xx.
#![no_main]

use std::sync::Arc;

use libfuzzer_sys::fuzz_target;
use server::body;
use server::request::{ChatRequest, CompletionRequest};
use server::validation::{self, ServedModel};
use server::adapters::Catalog;
use server::ApiError;

fn client_error(e: &ApiError) {
    let status = e.status();
    assert!(
        status.is_client_error(),
        "a body error became {status}: {e:?}"
    );
}

fuzz_target!(|data: &[u8]| {
    // No adapters: a body naming one, or a `lora` id, is the 404 of an unknown model.
    let adapters = Catalog::new("", Arc::new(engine::Adapters::new()));
    match body::decode::<ChatRequest>(data) {
        // The served model is the one the body names, so the checks after it are reached;
        // without a template, a request that passes them all is refused last (still a 400).
        Ok(req) => {
            let served = ServedModel {
                name: &req.model,
                tenant: "fuzz",
                adapters: &adapters,
                max_context: 8192,
                vocab_size: 49152,
                template: None,
                tool_format: server::tools::ToolFormat::Hermes,
                tool_marker: None,
            };
            if let Err(e) = validation::chat(&req, &served) {
                client_error(&e);
            }
        }
        Err(e) => client_error(&e),
    }
    match body::decode::<CompletionRequest>(data) {
        Ok(req) => {
            let served = ServedModel {
                name: &req.model,
                tenant: "fuzz",
                adapters: &adapters,
                max_context: 8192,
                vocab_size: 49152,
                template: None,
                tool_format: server::tools::ToolFormat::Hermes,
                tool_marker: None,
            };
            if let Err(e) = validation::completion(&req, &served) {
                client_error(&e);
            }
        }
        Err(e) => client_error(&e),
    }
});
