//! The client side of OpenAI-compatible servers, shared by `kvwarden audit` (which judges
//! what answers say) and `kvwarden bench` (which times them): one call and everything it
//! sent back ([`client`]), a server-sent events parser ([`sse`]) and a seeded generator
//! ([`rng`]). HTTP only, by design: it depends on no engine, KV or model crate.

#![forbid(unsafe_code)]

pub mod client;
pub mod rng;
pub mod sse;

pub use client::{Api, Call, Client, Exchange, Prompt, StreamSeen, ToolCallSeen, UsageSeen};
pub use rng::Rng;

/// Why a client could not be made.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("the server's address must be an http:// URL, got {0:?}")]
    BadUrl(String),
    #[error("cannot set up an HTTP client for {url}: {message}")]
    Setup { url: String, message: String },
}
