//! The eight checks, one file each: the traffic a check sends and how it judges the run.
//! Each is a method of [`crate::auditor::Auditor`], called in order by `run`; a new check
//! is a file here, a [`crate::report::CheckName`] and a call in `run.rs` (and, if it must
//! look at every answer as it arrives, a rule in `inspect`).

mod canaries;
mod capacity;
mod differential;
mod side_channel;
mod status;
mod stream_equality;
mod structured;
mod tool_calls;
