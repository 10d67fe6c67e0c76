//! Rollback (speculative decoding's rejected drafts) against a model of what each position
//! holds: random interleavings of in-order writes, commits, rollbacks, reads and sharing a
//! sequence's full pages. Every value written encodes its position and the how-manieth write
//! of that position it is, so a read that returned a rolled-back slot's old content would
//! carry an old generation and fail the comparison; a read of a forgotten position must be
//! refused exactly as a read of one never written.

// Under `--cfg loom` the crate hands out loom's `Arc`, usable only inside a loom model.
#![cfg(not(loom))]

use kv::{
    IsolationDomain, KvDtype, KvError, KvLayout, KvPool, Owner, PoolConfig, RequestId, ScrubPolicy,
    SequenceKv, Visibility,
};
use proptest::prelude::*;

const LAYERS: usize = 2;
const DIM: usize = 3;
const PAGE: usize = 4;
const PAGES: usize = 6;

#[derive(Debug, Clone)]
enum Op {
    /// Writes the next `count` positions on every layer, or on one.
    Write {
        layer: Option<usize>,
        count: usize,
    },
    Commit,
    Rollback {
        to: usize,
    },
    Read {
        layer: usize,
        upto: usize,
    },
    /// Freezes the committed full pages (as the engine does with a finished prompt).
    Share,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        5 => (prop::option::weighted(0.8, 0..LAYERS), 1usize..6)
            .prop_map(|(layer, count)| Op::Write { layer, count }),
        3 => Just(Op::Commit),
        4 => (0usize..=PAGE * PAGES).prop_map(|to| Op::Rollback { to }),
        4 => (0..LAYERS, 0usize..=PAGE * PAGES).prop_map(|(layer, upto)| Op::Read { layer, upto }),
        1 => Just(Op::Share),
    ]
}

/// Element 0: the position plus one; element 1: the write's generation; element 2: K or V.
fn row(pos: usize, generation: u32, kv: usize) -> [f32; DIM] {
    [(pos + 1) as f32, generation as f32, kv as f32]
}

struct Model {
    /// Per layer, the generation each written position holds, in order.
    written: [Vec<u32>; LAYERS],
    /// How often each position was written (on any layer), for the next generation.
    writes: Vec<u32>,
    len: usize,
    /// Positions below this lie in shared, frozen pages.
    frozen: usize,
}

fn run(ops: Vec<Op>, dtype: KvDtype) -> Result<(), TestCaseError> {
    let pool = KvPool::new(PoolConfig {
        layout: KvLayout {
            n_layers: LAYERS,
            kv_dim: DIM,
            page_tokens: PAGE,
            dtype,
        },
        pages: PAGES,
        scrub: ScrubPolicy::Poison,
    });
    let request = RequestId(7);
    let mut seq = SequenceKv::new(
        &pool,
        Owner {
            request,
            domain: IsolationDomain::tenant("a"),
        },
    );
    seq.reserve(PAGE * PAGES).unwrap();
    let mut m = Model {
        written: [Vec::new(), Vec::new()],
        writes: vec![0; PAGE * PAGES],
        len: 0,
        frozen: 0,
    };
    for op in ops {
        match op {
            Op::Write { layer, count } => {
                let layers: Vec<usize> = match layer {
                    Some(l) => vec![l],
                    None => (0..LAYERS).collect(),
                };
                for _ in 0..count {
                    for &l in &layers {
                        let pos = m.written[l].len();
                        if pos >= PAGE * PAGES {
                            continue;
                        }
                        m.writes[pos] += 1;
                        let g = m.writes[pos];
                        seq.write(l, pos, &row(pos, g, 0), &row(pos, g, 1))
                            .map_err(|e| TestCaseError::fail(format!("write {pos}: {e}")))?;
                        m.written[l].push(g);
                    }
                }
            }
            Op::Commit => {
                let complete = m.written.iter().map(Vec::len).min().unwrap();
                seq.commit(complete)
                    .map_err(|e| TestCaseError::fail(format!("commit {complete}: {e}")))?;
                m.len = complete;
            }
            Op::Rollback { to } => {
                let got = seq.rollback(to);
                if to > m.len {
                    prop_assert!(
                        matches!(got, Err(KvError::RollbackForward { .. })),
                        "rollback past the length: {got:?}"
                    );
                } else if to < m.frozen {
                    prop_assert!(
                        matches!(got, Err(KvError::RollbackIntoShared { .. })),
                        "rollback into a shared page: {got:?}"
                    );
                } else {
                    prop_assert!(got.is_ok(), "rollback to {to}: {got:?}");
                    for w in &mut m.written {
                        w.truncate(to);
                    }
                    m.len = to;
                }
            }
            Op::Read { layer, upto } => check_read(&seq, &m, layer, upto)?,
            Op::Share => {
                let pages = seq.share_full_pages(&Visibility::Domain(IsolationDomain::tenant("a")));
                m.frozen = m.frozen.max(pages.len() * PAGE);
            }
        }
        prop_assert_eq!(seq.len(), m.len);
        for layer in 0..LAYERS {
            check_read(&seq, &m, layer, m.written[layer].len())?;
            check_read(&seq, &m, layer, m.written[layer].len() + 1)?;
        }
    }
    Ok(())
}

/// A read returns every position's latest generation, or is refused at the first position
/// not written since the last rollback that forgot it.
fn check_read(seq: &SequenceKv, m: &Model, layer: usize, upto: usize) -> Result<(), TestCaseError> {
    let got = seq.runs(layer, upto);
    let held = m.written[layer].len();
    if upto > PAGE * PAGES {
        prop_assert!(got.is_err());
        return Ok(());
    }
    if upto > held {
        match got {
            Err(KvError::UnwrittenRead { position, .. }) => prop_assert_eq!(position, held),
            other => {
                return Err(TestCaseError::fail(format!(
                    "read of {upto} on layer {layer} with {held} written: {:?}",
                    other.map(|r| r.len())
                )))
            }
        }
        return Ok(());
    }
    let runs = got.map_err(|e| TestCaseError::fail(format!("read {upto}: {e}")))?;
    let mut pos = 0;
    for r in runs {
        let mut k = vec![0f32; r.k.len()];
        let mut v = vec![0f32; r.v.len()];
        r.k.to_f32(&mut k);
        r.v.to_f32(&mut v);
        for t in 0..r.tokens {
            let g = m.written[layer][pos];
            prop_assert_eq!(&k[t * DIM..(t + 1) * DIM], &row(pos, g, 0), "K at {}", pos);
            prop_assert_eq!(&v[t * DIM..(t + 1) * DIM], &row(pos, g, 1), "V at {}", pos);
            pos += 1;
        }
    }
    prop_assert_eq!(pos, upto);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(3000))]

    #[test]
    fn no_read_after_a_rollback_returns_a_rolled_back_slots_old_content(
        ops in prop::collection::vec(op(), 1..60),
        f16 in any::<bool>(),
    ) {
        run(ops, if f16 { KvDtype::F16 } else { KvDtype::F32 })?;
    }
}

#[test]
fn a_rolled_back_position_reads_as_never_written_until_rewritten() {
    let pool = KvPool::new(PoolConfig {
        layout: KvLayout {
            n_layers: 1,
            kv_dim: DIM,
            page_tokens: PAGE,
            dtype: KvDtype::F32,
        },
        pages: 2,
        scrub: ScrubPolicy::Zero,
    });
    let mut seq = SequenceKv::new(
        &pool,
        Owner {
            request: RequestId(1),
            domain: IsolationDomain::tenant("a"),
        },
    );
    seq.reserve(8).unwrap();
    for pos in 0..6 {
        seq.write(0, pos, &row(pos, 1, 0), &row(pos, 1, 1)).unwrap();
    }
    seq.commit(6).unwrap();
    seq.rollback(3).unwrap();
    assert_eq!(seq.len(), 3);
    assert!(matches!(
        seq.runs(0, 4),
        Err(KvError::UnwrittenRead { position: 3, .. })
    ));
    // The page's next write goes where the rollback left off, not after the old extent.
    assert!(matches!(
        seq.write(0, 1, &row(1, 2, 0), &row(1, 2, 1)),
        Err(KvError::OutOfOrderWrite { expected: 3, .. })
    ));
    seq.write(0, 3, &row(3, 2, 0), &row(3, 2, 1)).unwrap();
    seq.commit(4).unwrap();
    let runs = seq.runs(0, 4).unwrap();
    let mut k = vec![0f32; runs[0].k.len()];
    runs[0].k.to_f32(&mut k);
    assert_eq!(&k[3 * DIM..4 * DIM], &row(3, 2, 0));
}
