//! State-machine test of the isolation promise: random interleavings of requests from
//! several tenants (one with a salted sub-domain) creating sequences (some from prefix-cache
//! lookups), reserving, writing, committing, reading, sharing into the prefix cache,
//! releasing and evicting, on a small pool so that pages are reused all the time.
//!
//! Every K/V value written encodes (request, domain, layer, position, K or V), so a read
//! can be checked element by element: it must return what the reader itself wrote, or
//! what a request of its own domain (or a declared-public prefix) wrote for the very same
//! tokens, or fail. After every step the model also re-reads every live sequence, checks
//! that reads past the written extent fail with `UnwrittenRead`, that free pages hold no
//! data, and that the pool's accounting matches the model's.

// Under `--cfg loom` the crate hands out loom's `Arc`, usable only inside a loom model.
#![cfg(not(loom))]

use std::cell::RefCell;
use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use kv::{
    IsolationDomain, KvDtype, KvError, KvLayout, KvPool, KvRun, Owner, PoolConfig, PrefixCache,
    PrefixError, PublicPrefixes, RequestId, ScrubPolicy, SequenceKv, SharedPage, Visibility,
};
use proptest::prelude::*;
use proptest::test_runner::TestRunner;

/// Cases and operations per case: thousands of cases of up to `MAX_OPS` operations run in
/// a few seconds; `PROPTEST_CASES` overrides the case count.
const CASES: u32 = 5000;
const MAX_OPS: usize = 80;
const LAYERS: usize = 2;
const DIM: usize = 4;
/// Tenants A, B, C and A narrowed by a salt.
const DOMAINS: usize = 4;
/// The operator-declared public prefix (say, a shared system prompt).
const PUBLIC: [u32; 8] = [1, 2, 1, 2, 1, 2, 1, 2];
/// A prefix every tenant happens to send too; it is not public, so it must never be a
/// cross-tenant hit.
const COMMON: [u32; 6] = [3, 1, 3, 1, 3, 1];

fn domain(i: usize) -> IsolationDomain {
    match i {
        0 => IsolationDomain::tenant("a"),
        1 => IsolationDomain::tenant("b"),
        2 => IsolationDomain::tenant("c"),
        _ => IsolationDomain::tenant("a").narrowed("salt"),
    }
}

/// The value request `req` (of domain `dom`) writes at element `j` of the K (`kv = 0`) or
/// V row of `pos` on `layer`. Small positive integers: exact in f16, never 0 or NaN (the
/// scrub patterns), and distinct for distinct (req, pos, layer, kv).
fn value(req: u64, dom: usize, layer: usize, pos: usize, kv: usize, j: usize) -> f32 {
    match j {
        0 => req as f32,
        1 => (pos + 1) as f32,
        2 => (layer * 2 + kv + 1) as f32,
        _ => (dom + 1) as f32,
    }
}

fn row(req: u64, dom: usize, layer: usize, pos: usize, kv: usize) -> [f32; DIM] {
    std::array::from_fn(|j| value(req, dom, layer, pos, kv, j))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ShareMode {
    /// As the engine does: public pages as far as the public prefix goes.
    Split,
    /// The single-visibility `share_full_pages` with the sequence's own domain.
    Legacy,
    /// A buggy caller claiming every page is public; the cache must not believe it.
    Overclaim,
}

#[derive(Debug, Clone)]
enum Template {
    /// The first `n` tokens of the public prefix.
    Public(usize),
    Common,
    Random,
}

#[derive(Debug, Clone)]
enum Op {
    Create {
        domain: usize,
        template: Template,
        suffix: Vec<u32>,
        use_cache: bool,
        max_pages: usize,
    },
    /// A whole request, as the engine runs it: create (from a cache lookup), reserve its
    /// prompt (evicting cached pages if the pool is short), write and commit every
    /// position, then share its full pages into the cache. The sequence stays live.
    Serve {
        domain: usize,
        template: Template,
        suffix: Vec<u32>,
        use_cache: bool,
    },
    Reserve {
        seq: usize,
        total: usize,
    },
    /// Writes the next `count` positions (on one layer, or on every layer).
    Write {
        seq: usize,
        layer: Option<usize>,
        count: usize,
    },
    /// A write at an arbitrary position (mostly refused).
    WriteAt {
        seq: usize,
        layer: usize,
        pos: usize,
    },
    /// Commits `upto` tokens, or as many as are complete.
    Commit {
        seq: usize,
        upto: Option<usize>,
    },
    Read {
        seq: usize,
        layer: usize,
        upto: usize,
    },
    Share {
        seq: usize,
        mode: ShareMode,
    },
    /// Offers a sequence's pages to another domain's tree, or tries to share them under
    /// another domain.
    Misuse {
        seq: usize,
        domain: usize,
        public: bool,
    },
    Probe {
        domain: usize,
        template: Template,
        suffix: Vec<u32>,
    },
    Drop {
        seq: usize,
    },
    Evict {
        pages: usize,
    },
}

fn template() -> impl Strategy<Value = Template> {
    prop_oneof![
        (1..=PUBLIC.len()).prop_map(Template::Public),
        Just(Template::Common),
        Just(Template::Random)
    ]
}

fn tokens_for(template: &Template, suffix: &[u32]) -> Vec<u32> {
    let mut t = match template {
        Template::Public(n) => PUBLIC[..*n].to_vec(),
        Template::Common => COMMON.to_vec(),
        Template::Random => Vec::new(),
    };
    t.extend_from_slice(suffix);
    t.truncate(12);
    if t.is_empty() {
        t.push(1);
    }
    t
}

fn op() -> impl Strategy<Value = Op> {
    let suffix = prop::collection::vec(1u32..=3, 0..6);
    prop_oneof![
        4 => (0..DOMAINS, template(), suffix.clone(), prop::bool::weighted(0.8)).prop_map(
            |(domain, template, suffix, use_cache)| Op::Serve {
                domain,
                template,
                suffix,
                use_cache,
            }
        ),
        2 => (0..DOMAINS, template(), suffix.clone(), any::<bool>(), 0usize..6).prop_map(
            |(domain, template, suffix, use_cache, max_pages)| Op::Create {
                domain,
                template,
                suffix,
                use_cache: use_cache || max_pages > 1,
                max_pages,
            }
        ),
        2 => (any::<usize>(), 0usize..16).prop_map(|(seq, total)| Op::Reserve { seq, total }),
        4 => (any::<usize>(), prop::option::weighted(0.7, Just(())), 0..LAYERS, 1usize..8)
            .prop_map(|(seq, all, layer, count)| Op::Write {
                seq,
                layer: if all.is_some() { None } else { Some(layer) },
                count,
            }),
        1 => (any::<usize>(), 0..=LAYERS, 0usize..16)
            .prop_map(|(seq, layer, pos)| Op::WriteAt { seq, layer, pos }),
        3 => (any::<usize>(), prop::option::weighted(0.8, 0usize..16))
            .prop_map(|(seq, upto)| Op::Commit { seq, upto }),
        2 => (any::<usize>(), 0..=LAYERS, 0usize..16)
            .prop_map(|(seq, layer, upto)| Op::Read { seq, layer, upto }),
        3 => (
            any::<usize>(),
            prop_oneof![
                3 => Just(ShareMode::Split),
                1 => Just(ShareMode::Legacy),
                1 => Just(ShareMode::Overclaim)
            ]
        )
            .prop_map(|(seq, mode)| Op::Share { seq, mode }),
        1 => (any::<usize>(), 0..DOMAINS, any::<bool>())
            .prop_map(|(seq, domain, public)| Op::Misuse { seq, domain, public }),
        2 => (0..DOMAINS, template(), suffix)
            .prop_map(|(domain, template, suffix)| Op::Probe { domain, template, suffix }),
        4 => any::<usize>().prop_map(|seq| Op::Drop { seq }),
        1 => (0usize..6).prop_map(|pages| Op::Evict { pages }),
    ]
}

#[derive(Debug, Clone)]
struct Setup {
    dtype: KvDtype,
    scrub: ScrubPolicy,
    page_tokens: usize,
    pages: usize,
}

fn setup() -> impl Strategy<Value = Setup> {
    (
        prop_oneof![Just(KvDtype::F32), Just(KvDtype::F16)],
        prop_oneof![
            2 => Just(ScrubPolicy::Poison),
            2 => Just(ScrubPolicy::Zero),
            1 => Just(ScrubPolicy::None)
        ],
        2usize..=3,
        4usize..=16,
    )
        .prop_map(|(dtype, scrub, page_tokens, pages)| Setup {
            dtype,
            scrub,
            page_tokens,
            pages,
        })
}

/// Whose data a shared page holds.
#[derive(Debug, Clone, Copy)]
struct Src {
    writer: u64,
    writer_domain: usize,
    public: bool,
}

#[derive(Debug)]
enum MPage {
    Owned { written: [usize; LAYERS] },
    Shared(Src),
}

struct MSeq {
    kv: SequenceKv,
    req: u64,
    domain: usize,
    tokens: Vec<u32>,
    pages: Vec<MPage>,
    len: usize,
    /// Every shared page of the sequence, in order (they are its leading pages).
    shared: Vec<Arc<SharedPage>>,
    /// Shared once with `ShareMode::Overclaim`.
    overclaimed: bool,
}

impl MSeq {
    fn capacity(&self, p: usize) -> usize {
        self.pages.len() * p
    }

    /// What `runs(layer, upto)` must return: `Ok` or the exact `UnwrittenRead`.
    fn read_outcome(&self, p: usize, layer: usize, upto: usize) -> Result<(), KvError> {
        let request = RequestId(self.req);
        if upto > self.capacity(p) {
            return Err(KvError::UnwrittenRead {
                request,
                layer,
                position: upto - 1,
                written: self.capacity(p),
            });
        }
        if layer >= LAYERS {
            return if upto == 0 {
                Ok(())
            } else {
                Err(KvError::NoSuchLayer {
                    layer,
                    layers: LAYERS,
                })
            };
        }
        for (i, page) in self.pages.iter().enumerate() {
            let start = i * p;
            if start >= upto {
                break;
            }
            let n = (upto - start).min(p);
            if let MPage::Owned { written } = page {
                if n > written[layer] {
                    return Err(KvError::UnwrittenRead {
                        request,
                        layer,
                        position: start + written[layer],
                        written: start + written[layer],
                    });
                }
            }
        }
        Ok(())
    }

    /// Longest prefix readable on every layer.
    fn readable(&self, p: usize) -> usize {
        (0..=self.capacity(p))
            .rev()
            .find(|&u| (0..LAYERS).all(|l| self.read_outcome(p, l, u).is_ok()))
            .unwrap_or(0)
    }

    /// The position the next in-order write on `layer` goes to.
    fn next_pos(&self, p: usize, layer: usize) -> usize {
        for (i, page) in self.pages.iter().enumerate() {
            if let MPage::Owned { written } = page {
                if written[layer] < p {
                    return i * p + written[layer];
                }
            }
        }
        self.capacity(p)
    }

    fn write_outcome(&self, p: usize, layer: usize, pos: usize) -> Result<(), KvError> {
        let request = RequestId(self.req);
        let capacity = self.capacity(p);
        match self.pages.get(pos / p) {
            None => Err(KvError::AppendPastCapacity {
                request,
                position: pos,
                capacity,
            }),
            Some(MPage::Shared(_)) => Err(KvError::WriteToShared {
                request,
                position: pos,
            }),
            Some(MPage::Owned { written }) => {
                let w = written.get(layer).copied().unwrap_or(0);
                if pos % p != w {
                    Err(KvError::OutOfOrderWrite {
                        request,
                        layer,
                        position: pos,
                        expected: (pos / p) * p + w,
                    })
                } else if layer >= LAYERS {
                    Err(KvError::NoSuchLayer {
                        layer,
                        layers: LAYERS,
                    })
                } else {
                    Ok(())
                }
            }
        }
    }

    fn owned(&self) -> usize {
        self.pages
            .iter()
            .filter(|p| matches!(p, MPage::Owned { .. }))
            .count()
    }
}

struct World {
    setup: Setup,
    pool: KvPool,
    cache: PrefixCache,
    seqs: Vec<MSeq>,
    /// Every request ever created: domain and tokens, to judge cached pages it wrote.
    writers: HashMap<u64, (usize, Vec<u32>)>,
    /// (domain, tokens) of every private page ever inserted into the cache.
    private_chains: HashSet<(usize, Vec<u32>)>,
    next_req: u64,
    cov: Coverage,
}

fn to_f32(s: kv::KvSlice<'_>) -> Vec<f32> {
    let mut out = vec![0f32; s.len()];
    s.to_f32(&mut out);
    out
}

impl World {
    fn new(setup: Setup) -> Self {
        let pool = KvPool::new(PoolConfig {
            layout: KvLayout {
                n_layers: LAYERS,
                kv_dim: DIM,
                page_tokens: setup.page_tokens,
                dtype: setup.dtype,
            },
            pages: setup.pages,
            scrub: setup.scrub,
        });
        let public = PublicPrefixes::new([PUBLIC.to_vec()]);
        Self {
            cache: PrefixCache::with_public_prefixes(setup.page_tokens, public),
            pool,
            setup,
            seqs: Vec::new(),
            writers: HashMap::new(),
            private_chains: HashSet::new(),
            next_req: 1,
            cov: Coverage::default(),
        }
    }

    fn p(&self) -> usize {
        self.setup.page_tokens
    }

    /// An independent statement of "page `i` may be public": all of its tokens, and all
    /// before it, lie inside the public prefix.
    fn may_be_public(&self, tokens: &[u32], i: usize) -> bool {
        let end = (i + 1) * self.p();
        end <= PUBLIC.len() && tokens.len() >= end && tokens[..end] == PUBLIC[..end]
    }

    /// Checks a page offered by the cache at index `i` to a reader of `reader_domain` with
    /// `tokens`: it must be readable, hold exactly what a legitimate writer wrote for the
    /// same tokens, and have been written in the reader's domain unless public.
    fn judge_cached_page(
        &self,
        page: &SharedPage,
        i: usize,
        reader: &Owner,
        reader_domain: usize,
        tokens: &[u32],
    ) -> Src {
        let p = self.p();
        let (k, _) = page
            .read(reader, 0, p)
            .expect("the cache offered a page its reader cannot read");
        let writer = to_f32(k)[0] as u64;
        let (writer_domain, writer_tokens) = self
            .writers
            .get(&writer)
            .unwrap_or_else(|| panic!("page data from unknown writer {writer}"));
        let end = (i + 1) * p;
        assert!(
            writer_tokens.len() >= end && tokens.len() >= end,
            "page {i} beyond the tokens"
        );
        assert_eq!(
            writer_tokens[..end],
            tokens[..end],
            "page {i} was written for other tokens"
        );
        let public = match page.visibility() {
            Visibility::Public => {
                assert!(
                    self.may_be_public(tokens, i),
                    "public page {i} outside the public prefix"
                );
                true
            }
            Visibility::Domain(d) => {
                assert_eq!(*d, domain(reader_domain), "page of another domain offered");
                assert_eq!(
                    *writer_domain, reader_domain,
                    "domain page written by another domain"
                );
                false
            }
        };
        let src = Src {
            writer,
            writer_domain: *writer_domain,
            public,
        };
        for layer in 0..LAYERS {
            let (k, v) = page.read(reader, layer, p).unwrap();
            let run = KvRun { k, v, tokens: p };
            check_run(&run, i, p, layer, src.writer, src.writer_domain);
        }
        src
    }

    fn lookup(
        &mut self,
        dom: usize,
        tokens: &[u32],
        max_pages: usize,
        req: u64,
    ) -> Vec<(Arc<SharedPage>, Src)> {
        let p = self.p();
        let m = self.cache.lookup(&domain(dom), tokens, max_pages);
        assert_eq!(m.tokens(), m.len() * p);
        assert!(m.len() <= max_pages && m.tokens() <= tokens.len());
        let k = m.len();
        if k < max_pages.min(tokens.len() / p)
            && (0..DOMAINS).any(|e| {
                e != dom
                    && self
                        .private_chains
                        .contains(&(e, tokens[..(k + 1) * p].to_vec()))
            })
        {
            self.cov.cross_domain_misses += 1;
        }
        let reader = Owner {
            request: RequestId(req),
            domain: domain(dom),
        };
        let found: Vec<_> = m
            .into_pages()
            .into_iter()
            .enumerate()
            .map(|(i, page)| {
                let src = self.judge_cached_page(&page, i, &reader, dom, tokens);
                (page, src)
            })
            .collect();
        for (_, src) in &found {
            if src.public && src.writer_domain != dom {
                self.cov.public_cross_hits += 1;
            } else if src.writer != req && src.writer_domain == dom {
                self.cov.own_domain_hits += 1;
            }
        }
        found
    }

    fn apply(&mut self, op: &Op) {
        let p = self.p();
        let n = self.seqs.len();
        let pick = |seq: usize| if n == 0 { None } else { Some(seq % n) };
        match op {
            Op::Create {
                domain: dom,
                template,
                suffix,
                use_cache,
                max_pages,
            } => {
                let tokens = tokens_for(template, suffix);
                let req = self.next_req;
                self.next_req += 1;
                self.writers.insert(req, (*dom, tokens.clone()));
                let owner = Owner {
                    request: RequestId(req),
                    domain: domain(*dom),
                };
                let found = if *use_cache {
                    self.lookup(*dom, &tokens, *max_pages, req)
                } else {
                    Vec::new()
                };
                let shared: Vec<_> = found.iter().map(|(pg, _)| pg.clone()).collect();
                let kv = SequenceKv::with_prefix(&self.pool, owner, shared.clone())
                    .expect("a page the cache offered was refused");
                assert_eq!(kv.len(), found.len() * p);
                self.seqs.push(MSeq {
                    kv,
                    req,
                    domain: *dom,
                    tokens,
                    len: found.len() * p,
                    pages: found.iter().map(|(_, s)| MPage::Shared(*s)).collect(),
                    shared,
                    overclaimed: false,
                });
            }
            Op::Serve {
                domain: dom,
                template,
                suffix,
                use_cache,
            } => {
                let tokens = tokens_for(template, suffix);
                self.apply(&Op::Create {
                    domain: *dom,
                    template: template.clone(),
                    suffix: suffix.clone(),
                    use_cache: *use_cache,
                    max_pages: (tokens.len() - 1) / p,
                });
                self.check();
                let s = self.seqs.len() - 1;
                let need = self.seqs[s].kv.pages_needed(tokens.len());
                let free = self.pool.counts().free;
                if need > free {
                    self.apply(&Op::Evict { pages: need - free });
                    self.check();
                }
                self.reserve(s, tokens.len());
                self.check();
                for pos in self.seqs[s].len..tokens.len().min(self.seqs[s].capacity(p)) {
                    for layer in 0..LAYERS {
                        self.write(s, layer, pos);
                    }
                }
                self.check();
                self.apply(&Op::Commit { seq: s, upto: None });
                self.check();
                self.share(s, ShareMode::Split);
            }
            Op::Reserve { seq, total } => {
                let Some(s) = pick(*seq) else { return };
                self.reserve(s, *total);
            }
            Op::Write { seq, layer, count } => {
                let Some(s) = pick(*seq) else { return };
                let layers: Vec<usize> = match layer {
                    Some(l) => vec![*l],
                    None => (0..LAYERS).collect(),
                };
                for _ in 0..*count {
                    for &l in &layers {
                        let pos = self.seqs[s].next_pos(p, l);
                        if pos >= self.seqs[s].tokens.len() {
                            continue;
                        }
                        self.write(s, l, pos);
                    }
                }
            }
            Op::WriteAt { seq, layer, pos } => {
                let Some(s) = pick(*seq) else { return };
                if *pos < self.seqs[s].tokens.len() {
                    self.write(s, *layer, *pos);
                }
            }
            Op::Commit { seq, upto } => {
                let Some(s) = pick(*seq) else { return };
                let m = &mut self.seqs[s];
                let upto = upto.unwrap_or_else(|| m.readable(p));
                let expect = if upto < m.len {
                    Err(KvError::CommitBackwards {
                        request: m.kv.owner().request,
                        len: m.len,
                        new_len: upto,
                    })
                } else {
                    (0..LAYERS).try_for_each(|l| m.read_outcome(p, l, upto))
                };
                let got = m.kv.commit(upto);
                assert_eq!(got, expect);
                if got.is_ok() {
                    m.len = upto;
                }
                assert_eq!(m.kv.len(), m.len);
            }
            Op::Read { seq, layer, upto } => {
                let Some(s) = pick(*seq) else { return };
                if check_read(&self.seqs[s], p, *layer, *upto) {
                    self.cov.runs_read += 1;
                } else {
                    self.cov.refused_reads += 1;
                }
            }
            Op::Share { seq, mode } => {
                let Some(s) = pick(*seq) else { return };
                self.share(s, *mode);
            }
            Op::Misuse {
                seq,
                domain: other,
                public,
            } => {
                let Some(s) = pick(*seq) else { return };
                self.misuse(s, *other, *public);
            }
            Op::Probe {
                domain: dom,
                template,
                suffix,
            } => {
                let tokens = tokens_for(template, suffix);
                // A probe reads as a request that never writes: reuse an id no one has.
                let req = u64::MAX - self.next_req;
                let found = self.lookup(*dom, &tokens, usize::MAX, req);
                // Never a hit on another tenant's private pages, whatever they sent.
                for (page, src) in &found {
                    assert!(src.public || src.writer_domain == *dom, "{src:?}");
                    assert!(page.visibility().readable_by(&domain(*dom)));
                }
            }
            Op::Drop { seq } => {
                let Some(s) = pick(*seq) else { return };
                let before = self.pool.counts();
                let m = self.seqs.swap_remove(s);
                let owned = m.owned();
                drop(m);
                let after = self.pool.counts();
                assert_eq!(after.leased, before.leased - owned);
            }
            Op::Evict { pages } => {
                let before = self.pool.counts();
                let freed = self.cache.evict(*pages);
                self.cov.evicted += freed;
                assert!(freed <= *pages);
                let after = self.pool.counts();
                assert_eq!(after.cached, before.cached - freed);
                assert_eq!(after.free, before.free + freed);
            }
        }
    }

    fn reserve(&mut self, s: usize, total: usize) {
        let p = self.p();
        let free = self.pool.counts().free;
        let m = &mut self.seqs[s];
        let want = total.div_ceil(p);
        let need = want.saturating_sub(m.pages.len());
        let got = m.kv.reserve(total);
        if need > free {
            self.cov.exhausted += 1;
            assert_eq!(got, Err(KvError::PoolExhausted { needed: need, free }));
        } else {
            got.unwrap();
            for _ in 0..need {
                m.pages.push(MPage::Owned {
                    written: [0; LAYERS],
                });
            }
        }
        assert_eq!(m.kv.pages(), m.pages.len());
    }

    fn write(&mut self, s: usize, layer: usize, pos: usize) {
        let p = self.p();
        let m = &mut self.seqs[s];
        let expect = m.write_outcome(p, layer, pos);
        let l = layer.min(LAYERS - 1);
        let got = m.kv.write(
            layer,
            pos,
            &row(m.req, m.domain, l, pos, 0),
            &row(m.req, m.domain, l, pos, 1),
        );
        assert_eq!(got, expect, "write layer {layer} pos {pos}");
        if got.is_ok() {
            self.cov.writes += 1;
        } else {
            self.cov.refused_writes += 1;
        }
        if got.is_ok() {
            let MPage::Owned { written } = &mut m.pages[pos / p] else {
                unreachable!()
            };
            written[layer] += 1;
        }
    }

    fn share(&mut self, s: usize, mode: ShareMode) {
        let p = self.p();
        let public_pages = match mode {
            ShareMode::Split => self
                .cache
                .public_pages(&self.seqs[s].tokens[..self.seqs[s].len]),
            ShareMode::Legacy => 0,
            ShareMode::Overclaim => usize::MAX,
        };
        let m = &mut self.seqs[s];
        let full = m.len / p;
        let own = Visibility::Domain(domain(m.domain));
        let pages = if mode == ShareMode::Legacy {
            m.kv.share_full_pages(&own)
        } else {
            m.kv.share_full_pages_split(public_pages)
        };
        for (i, page) in m.pages.iter_mut().enumerate().take(full) {
            if let MPage::Owned { written } = page {
                assert_eq!(*written, [p; LAYERS]);
                *page = MPage::Shared(Src {
                    writer: m.req,
                    writer_domain: m.domain,
                    public: i < public_pages,
                });
            }
        }
        let expected = if mode == ShareMode::Legacy {
            m.pages
                .iter()
                .take(full)
                .take_while(|pg| matches!(pg, MPage::Shared(s) if !s.public))
                .count()
        } else {
            full
        };
        assert_eq!(pages.len(), expected);
        for (page, mp) in pages.iter().zip(&m.pages) {
            let MPage::Shared(src) = mp else {
                unreachable!()
            };
            let want = if src.public {
                Visibility::Public
            } else {
                own.clone()
            };
            assert_eq!(*page.visibility(), want);
        }
        assert_eq!(m.kv.owned_pages(), m.owned());
        // Keep the sequence's shared pages for the accounting check (the sequence holds
        // them anyway, so this pins nothing extra).
        let all_shared = m.kv.share_full_pages_split(0);
        assert_eq!(all_shared.len(), full);
        let common = all_shared.len().min(m.shared.len());
        assert!(all_shared[..common]
            .iter()
            .zip(&m.shared)
            .all(|(a, b)| Arc::ptr_eq(a, b)));
        // A commit may have lowered `len` below a cached prefix the sequence started on.
        if all_shared.len() > m.shared.len() {
            m.shared = all_shared;
        }

        let tokens = m.tokens[..pages.len() * p].to_vec();
        let expect = expected_insert(p, &own, &tokens, &pages);
        let got = self.cache.insert(&own, &tokens, &pages).map(|_| ());
        assert_eq!(got, expect);
        m.overclaimed |= mode == ShareMode::Overclaim;
        // Pages once frozen public by mistake stay so: every later offer of them is refused.
        if !m.overclaimed {
            assert_eq!(got, Ok(()), "legitimate insert refused");
        }
        if got.is_err() {
            self.cov.refused_inserts += 1;
            return;
        }
        for (i, page) in pages.iter().enumerate() {
            if *page.visibility() != Visibility::Public {
                self.private_chains
                    .insert((m.domain, tokens[..(i + 1) * p].to_vec()));
            }
        }
        // What was just inserted is found again, by the same domain.
        let dom = m.domain;
        let req = m.req;
        let found = self.lookup(dom, &tokens, usize::MAX, req);
        assert_eq!(found.len(), pages.len());
    }

    fn misuse(&mut self, s: usize, other: usize, public: bool) {
        let p = self.p();
        let m = &mut self.seqs[s];
        if other != m.domain {
            // Sharing under another domain freezes nothing.
            let owned = m.kv.owned_pages();
            assert!(m
                .kv
                .share_full_pages(&Visibility::Domain(domain(other)))
                .is_empty());
            assert_eq!(m.kv.owned_pages(), owned);
        }
        // Handing the pages to a request of `other` directly: refused for private pages of
        // another domain, at the page and at the block table.
        let reader = Owner {
            request: RequestId(u64::MAX - 1),
            domain: domain(other),
        };
        let mut foreign = false;
        for page in &m.shared {
            let readable = *page.visibility() == Visibility::Public || other == m.domain;
            foreign |= !readable;
            match page.read(&reader, 0, 1) {
                Ok(_) => assert!(readable),
                Err(e) => {
                    assert!(!readable);
                    assert_eq!(
                        e,
                        KvError::ForeignPage {
                            request: reader.request
                        }
                    );
                }
            }
        }
        match SequenceKv::with_prefix(&self.pool, reader.clone(), m.shared.clone()) {
            Ok(borrowed) => {
                assert!(!foreign);
                for layer in 0..LAYERS {
                    let runs = borrowed.runs(layer, borrowed.len()).unwrap();
                    for (i, run) in runs.iter().enumerate() {
                        let MPage::Shared(src) = &m.pages[i] else {
                            unreachable!()
                        };
                        check_run(run, i, p, layer, src.writer, src.writer_domain);
                    }
                }
            }
            Err(e) => {
                assert!(foreign);
                assert_eq!(
                    e,
                    KvError::ForeignPage {
                        request: reader.request
                    }
                );
            }
        }

        let target = if public {
            Visibility::Public
        } else {
            Visibility::Domain(domain(other))
        };
        let tokens = &m.tokens[..m.shared.len() * p];
        let expect = expected_insert(p, &target, tokens, &m.shared);
        let got = self.cache.insert(&target, tokens, &m.shared).map(|_| ());
        assert_eq!(got, expect);
        if got.is_err() {
            self.cov.refused_inserts += 1;
        }
    }

    fn check(&mut self) {
        let p = self.p();
        let c = self.pool.counts();
        assert_eq!(c.free + c.leased + c.cached, c.total, "{c:?}");
        let owned: usize = self.seqs.iter().map(|m| m.owned()).sum();
        assert_eq!(c.leased, owned, "leased pages vs live sequences");
        // Cached = distinct shared pages held by live sequences or the cache.
        let mut held: Vec<Arc<SharedPage>> = self.cache.debug_pages();
        for m in &self.seqs {
            assert_eq!(m.kv.owned_pages(), m.owned());
            assert_eq!(m.shared.len(), m.pages.len() - m.owned());
            for page in &m.shared {
                if !held.iter().any(|h| Arc::ptr_eq(h, page)) {
                    held.push(page.clone());
                }
            }
        }
        assert_eq!(c.cached, held.len(), "cached pages vs holders");
        assert_eq!(self.cache.cached_pages(), self.cache.debug_pages().len());
        self.cache.debug_check().unwrap();

        // Free pages hold no request's data.
        if let Some(free) = self.pool.debug_free_pages_raw() {
            assert_eq!(free.len(), c.free);
            for page in free {
                let ok = match self.setup.scrub {
                    ScrubPolicy::Zero => page.iter().all(|&x| x == 0.0),
                    // Never-leased pages still hold their initial zeros.
                    _ => page.iter().all(|x| x.is_nan()) || page.iter().all(|&x| x == 0.0),
                };
                assert!(ok, "free page holds data: {page:?}");
            }
        }

        // Every live sequence still reads exactly its own data, and nothing past it.
        let (mut ok, mut refused) = (0, 0);
        for m in &self.seqs {
            assert_eq!(m.kv.len(), m.len);
            for layer in 0..LAYERS {
                assert!(check_read(m, p, layer, m.len));
                let upto = (0..=m.capacity(p))
                    .rev()
                    .find(|&u| m.read_outcome(p, layer, u).is_ok())
                    .unwrap();
                assert!(check_read(m, p, layer, upto));
                assert!(!check_read(m, p, layer, upto + 1));
                ok += 2;
                refused += 1;
            }
        }
        self.cov.runs_read += ok;
        self.cov.refused_reads += refused;
    }
}

/// What `PrefixCache::insert(target, tokens, pages)` must answer, from an independent
/// reading of the rules: a public page must lie inside the public prefix, a private page
/// must be tagged with the target tree's domain; the first offending page is reported.
fn expected_insert(
    p: usize,
    target: &Visibility,
    tokens: &[u32],
    pages: &[Arc<SharedPage>],
) -> Result<(), PrefixError> {
    let public_pages = (0..=PUBLIC.len() / p)
        .rev()
        .find(|&k| tokens.len() >= k * p && tokens[..k * p] == PUBLIC[..k * p])
        .unwrap_or(0);
    for (i, page) in pages.iter().enumerate() {
        match page.visibility() {
            Visibility::Public if i >= public_pages => {
                return Err(PrefixError::NotPublic {
                    page: i,
                    public_pages,
                })
            }
            Visibility::Public => {}
            private if private != target => return Err(PrefixError::WrongVisibility { page: i }),
            _ => {}
        }
    }
    Ok(())
}

/// Checks one run (page `i`, `run.tokens` slots) against what `writer` wrote.
fn check_run(run: &KvRun<'_>, i: usize, p: usize, layer: usize, writer: u64, dom: usize) {
    let k = to_f32(run.k);
    let v = to_f32(run.v);
    assert_eq!(k.len(), run.tokens * DIM);
    assert_eq!(v.len(), run.tokens * DIM);
    for slot in 0..run.tokens {
        let pos = i * p + slot;
        for j in 0..DIM {
            let got = (k[slot * DIM + j], v[slot * DIM + j]);
            let want = (
                value(writer, dom, layer, pos, 0, j),
                value(writer, dom, layer, pos, 1, j),
            );
            assert_eq!(
                got, want,
                "layer {layer} pos {pos} elem {j}: read {got:?}, {writer} wrote {want:?}"
            );
        }
    }
}

/// `runs(layer, upto)` must fail exactly as the model says, or return exactly the data of
/// each page's writer: the reader for its own pages, the recorded writer for shared ones.
fn check_read(m: &MSeq, p: usize, layer: usize, upto: usize) -> bool {
    let expect = m.read_outcome(p, layer, upto);
    match m.kv.runs(layer, upto) {
        Err(e) => {
            assert_eq!(Err(e), expect, "read layer {layer} upto {upto}");
            false
        }
        Ok(runs) => {
            assert_eq!(expect, Ok(()), "read layer {layer} upto {upto} succeeded");
            assert_eq!(runs.len(), upto.div_ceil(p));
            for (i, run) in runs.iter().enumerate() {
                assert_eq!(run.tokens, (upto - i * p).min(p));
                let (writer, dom) = match &m.pages[i] {
                    MPage::Owned { .. } => (m.req, m.domain),
                    MPage::Shared(src) => {
                        assert!(src.public || src.writer_domain == m.domain);
                        (src.writer, src.writer_domain)
                    }
                };
                check_run(run, i, p, layer, writer, dom);
            }
            true
        }
    }
}

fn cases() -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(CASES)
}

/// How often each interesting situation came up, so that a change to the generators that
/// stops exercising one fails loudly instead of passing vacuously.
#[derive(Debug, Default, Clone)]
struct Coverage {
    ops: usize,
    writes: usize,
    refused_writes: usize,
    runs_read: usize,
    refused_reads: usize,
    /// Cached pages a request got that another request of its domain wrote.
    own_domain_hits: usize,
    /// Public pages a request got that a request of another domain wrote.
    public_cross_hits: usize,
    /// Lookups that stopped short although another domain had cached private pages for
    /// the same tokens.
    cross_domain_misses: usize,
    evicted: usize,
    exhausted: usize,
    refused_inserts: usize,
}

impl Coverage {
    fn add(&mut self, o: &Coverage) {
        self.ops += o.ops;
        self.writes += o.writes;
        self.refused_writes += o.refused_writes;
        self.runs_read += o.runs_read;
        self.refused_reads += o.refused_reads;
        self.own_domain_hits += o.own_domain_hits;
        self.public_cross_hits += o.public_cross_hits;
        self.cross_domain_misses += o.cross_domain_misses;
        self.evicted += o.evicted;
        self.exhausted += o.exhausted;
        self.refused_inserts += o.refused_inserts;
    }
}

fn run_case(setup: Setup, ops: &[Op]) -> Coverage {
    let mut world = World::new(setup);
    world.check();
    for op in ops {
        world.apply(op);
        world.check();
        world.cov.ops += 1;
    }
    // Releasing everything and emptying the cache returns every page.
    world.seqs.clear();
    world.cache.evict(usize::MAX);
    let c = world.pool.counts();
    assert_eq!((c.free, c.leased, c.cached), (c.total, 0, 0));
    world.cov
}

#[test]
fn no_request_reads_another_domains_data() {
    let cases = cases();
    let mut runner = TestRunner::new(ProptestConfig {
        cases,
        // Integration tests have no lib.rs for proptest's regression files to sit next
        // to: a failure reports its minimal case instead.
        failure_persistence: None,
        ..ProptestConfig::default()
    });
    let total = RefCell::new(Coverage::default());
    let strategy = (setup(), prop::collection::vec(op(), 1..=MAX_OPS));
    let result = runner.run(&strategy, |(setup, ops): (Setup, Vec<Op>)| {
        let cov = run_case(setup, &ops);
        total.borrow_mut().add(&cov);
        Ok(())
    });
    if let Err(e) = result {
        panic!("{e}");
    }
    let cov = total.into_inner();
    eprintln!("{cases} cases: {cov:?}");
    if cases >= 1000 {
        let floors = [
            ("writes", cov.writes, 10_000),
            ("refused_writes", cov.refused_writes, 1_000),
            ("runs_read", cov.runs_read, 10_000),
            ("refused_reads", cov.refused_reads, 1_000),
            ("own_domain_hits", cov.own_domain_hits, 100),
            ("public_cross_hits", cov.public_cross_hits, 100),
            ("cross_domain_misses", cov.cross_domain_misses, 100),
            ("evicted", cov.evicted, 100),
            ("exhausted", cov.exhausted, 100),
            ("refused_inserts", cov.refused_inserts, 100),
        ];
        for (name, got, floor) in floors {
            assert!(got >= floor, "only {got} {name} in {cases} cases: {cov:?}");
        }
    }
}
