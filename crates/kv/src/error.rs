use crate::RequestId;

/// Every way a KV access can be refused. Each one fails the request that caused it; none
/// is ever turned into a silent read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KvError {
    #[error("KV pool exhausted: {needed} pages needed, {free} free")]
    PoolExhausted { needed: usize, free: usize },
    #[error("{request}: read of layer {layer} position {position}, but only {written} slots of that page were written under the current lease")]
    UnwrittenRead {
        request: RequestId,
        layer: usize,
        position: usize,
        written: usize,
    },
    #[error("{request}: write at position {position} is beyond the sequence's reserved capacity of {capacity} tokens")]
    AppendPastCapacity {
        request: RequestId,
        position: usize,
        capacity: usize,
    },
    #[error("{request}: write to layer {layer} at position {position} out of order (next writable slot is {expected})")]
    OutOfOrderWrite {
        request: RequestId,
        layer: usize,
        position: usize,
        expected: usize,
    },
    #[error("{request}: write to a shared, immutable page at position {position}")]
    WriteToShared { request: RequestId, position: usize },
    #[error("{request}: page belongs to another isolation domain")]
    ForeignPage { request: RequestId },
    #[error("{request}: shared page belongs to another KV pool")]
    ForeignPool { request: RequestId },
    #[error("{request}: lease is bound to another request ({owner})")]
    ForeignLease {
        request: RequestId,
        owner: RequestId,
    },
    #[error("page is not fully written ({written} of {capacity} slots on layer {layer}); only full pages can be shared")]
    NotFull {
        layer: usize,
        written: usize,
        capacity: usize,
    },
    #[error(
        "{request}: commit to {new_len} positions would forget committed positions (length {len})"
    )]
    CommitBackwards {
        request: RequestId,
        len: usize,
        new_len: usize,
    },
    #[error("{request}: rollback to {new_len} positions would move forward (length {len})")]
    RollbackForward {
        request: RequestId,
        len: usize,
        new_len: usize,
    },
    #[error("{request}: rollback to {new_len} positions would unwrite a shared, immutable page (page {page})")]
    RollbackIntoShared {
        request: RequestId,
        new_len: usize,
        page: usize,
    },
    #[error("K/V row has {got} values, layout wants {want}")]
    RowShape { got: usize, want: usize },
    #[error("received page payload has {got} bytes, its slot count and the layout make {want}")]
    PayloadShape { got: usize, want: usize },
    #[error("layer {layer} out of range ({layers} layers)")]
    NoSuchLayer { layer: usize, layers: usize },
}
