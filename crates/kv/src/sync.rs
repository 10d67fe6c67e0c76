//! The synchronization primitives the pool is built on, in one place so that the loom
//! model check (`crates/kv/loom.sh`, `tests/loom_pool.rs`) can swap in loom's versions and
//! explore every interleaving of concurrent allocate/release/freeze/drop. Nothing else in
//! the crate may name `std::sync` directly, or loom would not see that synchronization.

#[cfg(loom)]
pub use loom::sync::{Arc, Mutex, MutexGuard};

#[cfg(not(loom))]
pub use std::sync::{Arc, Mutex, MutexGuard};
