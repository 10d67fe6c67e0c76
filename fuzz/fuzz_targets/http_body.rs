//! HTTP request bodies: JSON to the typed requests, then validation, as the routes do it.
//! Every failure must be a typed client error (4xx), never a panic or a 5xx.
#![no_main]

use libfuzzer_sys::fuzz_target;
use server::body;
use server::request::{ChatRequest, CompletionRequest};
use server::ApiError;

fn client_error(e: &ApiError) {
    let status = e.status();
    assert!(
        status.is_client_error(),
        "a body error became {status}: {e:?}"
    );
}

fuzz_target!(|data: &[u8]| {
    match body::decode::<ChatRequest>(data) {
        Ok(req) => match req.validate() {
            Ok(_) => {
                for (i, m) in req.messages.iter().enumerate() {
                    if let Err(e) = m.text(i) {
                        client_error(&e);
                    }
                    let _ = server::chat_prompt::normalize_role(&m.role);
                }
            }
            Err(e) => client_error(&e),
        },
        Err(e) => client_error(&e),
    }
    match body::decode::<CompletionRequest>(data) {
        Ok(req) => match req.validate() {
            Ok(_) => {
                if let Err(e) = req.single_prompt() {
                    client_error(&e);
                }
            }
            Err(e) => client_error(&e),
        },
        Err(e) => client_error(&e),
    }
});
