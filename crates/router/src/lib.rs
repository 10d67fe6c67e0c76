//! `kvwarden router`: the OpenAI API in front of prefill and decode nodes.
//!
//! The router authenticates, renders and tokenizes (the same `server` pipeline as
//! `kvwarden serve`), then runs each request through the handoff, one step at a time:
//!
//! 1. a prefill node's own admission (`Admit`): a rejection ends the request with that
//!    original error, and no decode node ever hears of it;
//! 2. a decode node's admission and page reservation (`Decode`, first event `Reserved`);
//! 3. `Prefill`: the prefill node computes the prompt's K/V and pushes it straight to that
//!    decode node, which verifies it (`engine::handoff`) and only then streams tokens.
//!
//! At start it refuses a cluster whose nodes serve another model, whose pools cannot hold
//! the context it would advertise, or that lacks a reachable node of either role. A pool
//! given as `dns:NAME:PORT` follows that name's records while the router runs
//! (`discovery`): a new address becomes a node once it passes the same checks (and holds
//! the advertised context), a vanished one is drained.

#![forbid(unsafe_code)]

mod cluster;
mod discovery;
mod handoff;

pub use cluster::{Cluster, ClusterConfig, StartupError};
pub use discovery::{Discovery, NodeSource};
