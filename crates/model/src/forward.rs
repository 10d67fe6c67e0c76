use gguf::GgufFile;
use half::f16;
use kv::{KvRun, KvSlice, SequenceKv};
use rayon::prelude::*;

use crate::config::Arch;
use crate::kernels::{matmul, matmul_group, KvElem};
use crate::weights::{load_vector, quantize_row_q8_1, BlockQ8_1, Matrix, QK};
use crate::{LlamaConfig, ModelError};

struct Layer {
    attn_norm: Vec<f32>,
    wq: Matrix,
    wk: Matrix,
    wv: Matrix,
    wo: Matrix,
    ffn_norm: Vec<f32>,
    w_gate: Matrix,
    w_up: Matrix,
    w_down: Matrix,
    /// Q, K and V projection biases (qwen2; optional in every architecture, as in llama.cpp).
    bq: Option<Vec<f32>>,
    bk: Option<Vec<f32>>,
    bv: Option<Vec<f32>>,
    /// Per-head RMSNorm weights of Q and K, applied before the rotation (qwen3).
    q_norm: Option<Vec<f32>>,
    k_norm: Option<Vec<f32>>,
}

/// A loaded llama-family model.
pub struct Model {
    pub config: LlamaConfig,
    embed: Matrix,
    layers: Vec<Layer>,
    output_norm: Vec<f32>,
    /// `None` when the output projection is tied to the token embedding.
    output: Option<Matrix>,
    /// Llama 3's RoPE frequency factors (`rope_freqs.weight`): rotary pair `i` turns at
    /// `theta_i / factor_i`.
    rope_freqs: Option<Vec<f32>>,
    /// Kernels run inside this pool: a forward pass enters it once, and every parallel loop
    /// inside then starts on the calling worker instead of handing off to a sleeping thread
    /// (a handoff per matrix costs milliseconds when another process shares the cores).
    threads: rayon::ThreadPool,
}

/// Which positions of an item need logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogitsWanted {
    /// Intermediate prefill chunk: nothing to sample yet.
    None,
    /// The next-token distribution after the item's last token.
    Last,
    /// One distribution per input token (scoring, tests).
    All,
}

/// `vocab_size` logits per wanted position, concatenated.
pub type Logits = Vec<f32>;

/// One sequence's share of a forward pass: its new tokens, appended at positions
/// `kv.len()..kv.len() + tokens.len()`. The KV view must already hold pages for them.
pub struct BatchItem<'a> {
    pub kv: &'a mut SequenceKv,
    pub tokens: &'a [u32],
    pub logits: LogitsWanted,
}

impl Model {
    pub fn load(file: &GgufFile) -> Result<Self, ModelError> {
        let config = LlamaConfig::from_gguf(file)?;
        let c = &config;
        // Every tensor the file holds must be one this architecture reads: a tensor left
        // unread (an output bias, a fused QKV, LongRoPE factors) would change the answer, so
        // the model is refused naming it instead.
        let used = std::cell::RefCell::new(std::collections::HashSet::<String>::new());
        let tensor = |name: &str| {
            used.borrow_mut().insert(name.to_string());
            file.tensor(name).ok_or_else(|| ModelError::Tensor {
                name: name.to_string(),
                reason: "missing".into(),
            })
        };
        let mat = |name: &str, rows: usize, cols: usize| -> Result<Matrix, ModelError> {
            if !cols.is_multiple_of(QK) {
                return Err(ModelError::Unsupported(format!(
                    "{name}: row length {cols} is not a multiple of {QK}"
                )));
            }
            Matrix::load(file, tensor(name)?, rows, cols)
        };
        let vec = |name: &str, len: usize| load_vector(file, tensor(name)?, len);
        let opt_vec = |name: &str, len: usize| match file.tensor(name) {
            Some(_) => vec(name, len).map(Some),
            None => Ok(None),
        };
        let (kv_dim, q_dim, hd) = (c.kv_dim(), c.q_dim(), c.head_dim);
        let qk_norms = c.arch == Arch::Qwen3;
        let mut layers = Vec::with_capacity(c.n_layers);
        for i in 0..c.n_layers {
            let p = |s: &str| format!("blk.{i}.{s}.weight");
            let b = |s: &str| format!("blk.{i}.{s}.bias");
            layers.push(Layer {
                attn_norm: vec(&p("attn_norm"), c.dim)?,
                wq: mat(&p("attn_q"), q_dim, c.dim)?,
                wk: mat(&p("attn_k"), kv_dim, c.dim)?,
                wv: mat(&p("attn_v"), kv_dim, c.dim)?,
                wo: mat(&p("attn_output"), c.dim, q_dim)?,
                ffn_norm: vec(&p("ffn_norm"), c.dim)?,
                w_gate: mat(&p("ffn_gate"), c.ffn_dim, c.dim)?,
                w_up: mat(&p("ffn_up"), c.ffn_dim, c.dim)?,
                w_down: mat(&p("ffn_down"), c.dim, c.ffn_dim)?,
                bq: opt_vec(&b("attn_q"), q_dim)?,
                bk: opt_vec(&b("attn_k"), kv_dim)?,
                bv: opt_vec(&b("attn_v"), kv_dim)?,
                q_norm: if qk_norms {
                    Some(vec(&p("attn_q_norm"), hd)?)
                } else {
                    None
                },
                k_norm: if qk_norms {
                    Some(vec(&p("attn_k_norm"), hd)?)
                } else {
                    None
                },
            });
        }
        let embed = mat("token_embd.weight", c.vocab_size, c.dim)?;
        let output = match file.tensor("output.weight") {
            Some(_) => Some(mat("output.weight", c.vocab_size, c.dim)?),
            None => None,
        };
        // llama.cpp reads frequency factors for the llama graph only.
        let rope_freqs = if c.arch == Arch::Llama {
            let f = opt_vec("rope_freqs.weight", c.rope_dims / 2)?;
            if let Some(v) = &f {
                if v.iter().any(|x| !(x.is_finite() && *x > 0.0)) {
                    return Err(ModelError::Tensor {
                        name: "rope_freqs.weight".into(),
                        reason: "frequency factors must be finite and positive".into(),
                    });
                }
            }
            f
        } else {
            None
        };
        let output_norm = vec("output_norm.weight", c.dim)?;
        let used = used.into_inner();
        if let Some(extra) = file.tensors().iter().find(|t| !used.contains(&t.name)) {
            return Err(ModelError::Unsupported(format!(
                "tensor {:?} is not used by kvwarden's {} architecture",
                extra.name,
                c.arch.name()
            )));
        }
        let threads = rayon::ThreadPoolBuilder::new()
            .thread_name(|i| format!("kvwarden-compute-{i}"))
            .build()
            .map_err(|e| ModelError::Unsupported(format!("cannot start compute threads: {e}")))?;
        Ok(Self {
            threads,
            output_norm,
            config,
            embed,
            layers,
            output,
            rope_freqs,
        })
    }

    pub fn kv_layout(&self, page_tokens: usize, dtype: kv::KvDtype) -> kv::KvLayout {
        kv::KvLayout {
            n_layers: self.config.n_layers,
            kv_dim: self.config.kv_dim(),
            page_tokens,
            dtype,
        }
    }

    /// Sets the number of compute threads (default: `RAYON_NUM_THREADS` or all cores).
    pub fn set_threads(&mut self, n: usize) -> Result<(), ModelError> {
        self.threads = rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .thread_name(|i| format!("kvwarden-compute-{i}"))
            .build()
            .map_err(|e| ModelError::Unsupported(format!("cannot start compute threads: {e}")))?;
        Ok(())
    }

    /// Runs one step over a batch. Each item's result is independent: an item whose KV
    /// access fails gets its error and is left out of the rest of the step, the others go on.
    pub fn forward(&self, items: &mut [BatchItem<'_>]) -> Vec<Result<Logits, ModelError>> {
        self.threads.install(|| self.forward_in_pool(items))
    }

    fn forward_in_pool(&self, items: &mut [BatchItem<'_>]) -> Vec<Result<Logits, ModelError>> {
        let c = &self.config;
        let (dim, kv_dim, q_dim, hd) = (c.dim, c.kv_dim(), c.q_dim(), c.head_dim);
        let mut status: Vec<Result<(), ModelError>> = items
            .iter()
            .map(
                |it| match it.tokens.iter().find(|&&t| t as usize >= c.vocab_size) {
                    Some(&id) => Err(ModelError::TokenOutOfRange {
                        id,
                        vocab: c.vocab_size,
                    }),
                    None => Ok(()),
                },
            )
            .collect();
        // Flat rows: (item, absolute position).
        let mut rows: Vec<(usize, usize)> = Vec::new();
        let mut starts = Vec::with_capacity(items.len());
        for (i, it) in items.iter().enumerate() {
            starts.push(rows.len());
            let base = it.kv.len();
            rows.extend((0..it.tokens.len()).map(|t| (i, base + t)));
        }
        let n = rows.len();
        if n == 0 {
            return status.into_iter().map(|s| s.map(|_| Vec::new())).collect();
        }

        let mut x = vec![0f32; n * dim];
        for (i, it) in items.iter().enumerate() {
            if status[i].is_err() {
                continue;
            }
            for (t, &tok) in it.tokens.iter().enumerate() {
                let r = starts[i] + t;
                self.embed
                    .row_f32(tok as usize, &mut x[r * dim..(r + 1) * dim]);
            }
        }
        let rope = RopeTable::new(c, self.rope_freqs.as_deref(), rows.iter().map(|&(_, p)| p));

        let mut xn = vec![0f32; n * dim];
        let mut xq = vec![BlockQ8_1::default(); n * dim / QK];
        let mut aq = vec![BlockQ8_1::default(); n * q_dim / QK];
        let mut q = vec![0f32; n * q_dim];
        let mut k = vec![0f32; n * kv_dim];
        let mut v = vec![0f32; n * kv_dim];
        let mut attn = vec![0f32; n * q_dim];
        let mut proj = vec![0f32; n * dim];
        let mut gate = vec![0f32; n * c.ffn_dim];
        let mut up = vec![0f32; n * c.ffn_dim];
        let mut hq = vec![BlockQ8_1::default(); n * c.ffn_dim / QK];

        for (li, layer) in self.layers.iter().enumerate() {
            rms_norm_rows(&x, &layer.attn_norm, c.rms_eps, dim, &mut xn);
            quantize_rows(&xn, dim, &mut xq);
            matmul_group(
                &[&layer.wq, &layer.wk, &layer.wv],
                &xn,
                &xq,
                n,
                &mut [&mut q, &mut k, &mut v],
            );
            // As llama.cpp's graph: bias after the product, then the per-head norm, then RoPE.
            for (out, bias, width) in [
                (&mut q, &layer.bq, q_dim),
                (&mut k, &layer.bk, kv_dim),
                (&mut v, &layer.bv, kv_dim),
            ] {
                if let Some(b) = bias {
                    for row in out.chunks_exact_mut(width) {
                        add_in_place(row, b);
                    }
                }
            }
            for (out, norm) in [(&mut q, &layer.q_norm), (&mut k, &layer.k_norm)] {
                if let Some(w) = norm {
                    let heads = out.clone();
                    rms_norm_rows(&heads, w, c.rms_eps, hd, out);
                }
            }
            for (r, _) in rows.iter().enumerate() {
                rope.apply(r, &mut q[r * q_dim..(r + 1) * q_dim], hd);
                rope.apply(r, &mut k[r * kv_dim..(r + 1) * kv_dim], hd);
            }
            for (i, it) in items.iter_mut().enumerate() {
                if status[i].is_err() {
                    continue;
                }
                let base = it.kv.len();
                for t in 0..it.tokens.len() {
                    let r = starts[i] + t;
                    if let Err(e) = it.kv.write(
                        li,
                        base + t,
                        &k[r * kv_dim..(r + 1) * kv_dim],
                        &v[r * kv_dim..(r + 1) * kv_dim],
                    ) {
                        status[i] = Err(e.into());
                        break;
                    }
                }
            }
            self.attention(li, items, &starts, &mut status, &q, &mut attn);
            quantize_rows(&attn, q_dim, &mut aq);
            matmul(&layer.wo, &attn, &aq, n, &mut proj);
            add_in_place(&mut x, &proj);

            rms_norm_rows(&x, &layer.ffn_norm, c.rms_eps, dim, &mut xn);
            quantize_rows(&xn, dim, &mut xq);
            matmul_group(
                &[&layer.w_gate, &layer.w_up],
                &xn,
                &xq,
                n,
                &mut [&mut gate, &mut up],
            );
            crate::kernels::swiglu(&mut gate, &up);
            quantize_rows(&gate, c.ffn_dim, &mut hq);
            matmul(&layer.w_down, &gate, &hq, n, &mut proj);
            add_in_place(&mut x, &proj);
        }

        for (i, it) in items.iter_mut().enumerate() {
            if status[i].is_ok() {
                let new_len = it.kv.len() + it.tokens.len();
                if let Err(e) = it.kv.commit(new_len) {
                    status[i] = Err(e.into());
                }
            }
        }

        // Final norm and output projection only for the rows that are sampled from.
        let mut wanted: Vec<usize> = Vec::new();
        for (i, it) in items.iter().enumerate() {
            if status[i].is_err() || it.tokens.is_empty() {
                continue;
            }
            match it.logits {
                LogitsWanted::None => {}
                LogitsWanted::Last => wanted.push(starts[i] + it.tokens.len() - 1),
                LogitsWanted::All => wanted.extend(starts[i]..starts[i] + it.tokens.len()),
            }
        }
        let m = wanted.len();
        let mut sel = vec![0f32; m * dim];
        for (j, &r) in wanted.iter().enumerate() {
            sel[j * dim..(j + 1) * dim].copy_from_slice(&x[r * dim..(r + 1) * dim]);
        }
        let mut seln = vec![0f32; m * dim];
        rms_norm_rows(&sel, &self.output_norm, c.rms_eps, dim, &mut seln);
        let mut selq = vec![BlockQ8_1::default(); m * dim / QK];
        quantize_rows(&seln, dim, &mut selq);
        let out_w = self.output.as_ref().unwrap_or(&self.embed);
        let mut logits = vec![0f32; m * c.vocab_size];
        if m > 0 {
            matmul(out_w, &seln, &selq, m, &mut logits);
        }

        let mut cursor = 0;
        items
            .iter()
            .zip(status)
            .map(|(it, st)| {
                st?;
                let count = match it.logits {
                    LogitsWanted::None => 0,
                    _ if it.tokens.is_empty() => 0,
                    LogitsWanted::Last => 1,
                    LogitsWanted::All => it.tokens.len(),
                };
                let out = logits[cursor * c.vocab_size..(cursor + count) * c.vocab_size].to_vec();
                cursor += count;
                Ok(out)
            })
            .collect()
    }

    /// Causal attention of each item's new rows over its own KV view (pages leased to it and
    /// its domain's shared prefix pages; nothing else is reachable from `SequenceKv`).
    fn attention(
        &self,
        layer: usize,
        items: &[BatchItem<'_>],
        starts: &[usize],
        status: &mut [Result<(), ModelError>],
        q: &[f32],
        attn: &mut [f32],
    ) {
        let c = &self.config;
        // Rows of `q` and `attn` are the concatenated query heads.
        let (dim, hd) = (c.q_dim(), c.head_dim);
        let group = c.n_heads / c.n_kv_heads;
        let scale = 1.0 / (hd as f32).sqrt();

        let mut views: Vec<Option<Vec<KvRun<'_>>>> = Vec::with_capacity(items.len());
        for (i, it) in items.iter().enumerate() {
            if status[i].is_err() {
                views.push(None);
                continue;
            }
            let upto = it.kv.len() + it.tokens.len();
            match it.kv.runs(layer, upto) {
                Ok(runs) => views.push(Some(runs)),
                Err(e) => {
                    status[i] = Err(e.into());
                    views.push(None);
                }
            }
        }
        // Tasks: (item, KV head, block of new rows). Rows are independent, so splitting a long
        // prompt's rows keeps both cores busy without changing any row's arithmetic.
        const ROWS_PER_TASK: usize = 16;
        let tasks: Vec<(usize, usize, usize, usize)> = (0..items.len())
            .filter(|&i| views[i].is_some())
            .flat_map(|i| {
                let n = items[i].tokens.len();
                (0..c.n_kv_heads).flat_map(move |g| {
                    (0..n)
                        .step_by(ROWS_PER_TASK)
                        .map(move |t0| (i, g, t0, (t0 + ROWS_PER_TASK).min(n)))
                })
            })
            .collect();
        let results: Vec<(usize, usize, usize, Vec<f32>)> = tasks
            .par_iter()
            .map(|&(i, g, t0, t1)| {
                let runs = views[i].as_deref().unwrap_or(&[]);
                let it = &items[i];
                let shape = HeadShape {
                    g,
                    group,
                    hd,
                    kv_dim: c.kv_dim(),
                    scale,
                };
                let rows = &q[(starts[i] + t0) * dim..(starts[i] + t1) * dim];
                // Position of row t0 in the sequence.
                let first = it.kv.len() + t0;
                let out = match runs.first().map(|r| r.k) {
                    Some(KvSlice::F32(_)) => {
                        let typed: Vec<_> = runs
                            .iter()
                            .filter_map(|r| match (r.k, r.v) {
                                (KvSlice::F32(k), KvSlice::F32(v)) => Some((k, v, r.tokens)),
                                _ => None,
                            })
                            .collect();
                        attend_group::<f32>(&typed, rows, first, dim, &shape)
                    }
                    _ => {
                        let typed: Vec<_> = runs
                            .iter()
                            .filter_map(|r| match (r.k, r.v) {
                                (KvSlice::F16(k), KvSlice::F16(v)) => Some((k, v, r.tokens)),
                                _ => None,
                            })
                            .collect();
                        attend_group::<f16>(&typed, rows, first, dim, &shape)
                    }
                };
                (i, g, t0, out)
            })
            .collect();
        for (i, g, t0, out) in results {
            for (t, row) in out.chunks_exact(group * hd).enumerate() {
                let r = starts[i] + t0 + t;
                attn[r * dim + g * group * hd..r * dim + (g + 1) * group * hd].copy_from_slice(row);
            }
        }
    }
}

struct HeadShape {
    /// The KV head this task serves.
    g: usize,
    /// Query heads per KV head.
    group: usize,
    hd: usize,
    kv_dim: usize,
    scale: f32,
}

/// Causal attention of the query heads that share KV head `shape.g`, for each of the new
/// rows in `q_rows` (which sit at the end of the cached positions).
/// `q_rows` are consecutive new rows, the first at sequence position `first`.
fn attend_group<T: KvElem>(
    runs: &[(&[T], &[T], usize)],
    q_rows: &[f32],
    first: usize,
    dim: usize,
    shape: &HeadShape,
) -> Vec<f32> {
    let HeadShape {
        g,
        group,
        hd,
        kv_dim,
        scale,
    } = *shape;
    let mut k_rows: Vec<&[T]> = Vec::new();
    let mut v_rows: Vec<&[T]> = Vec::new();
    for (k, v, n) in runs {
        for j in 0..*n {
            let at = j * kv_dim + g * hd;
            k_rows.push(&k[at..at + hd]);
            v_rows.push(&v[at..at + hd]);
        }
    }
    let n_new = q_rows.len() / dim;
    let mut out = vec![0f32; n_new * group * hd];
    let mut acc = vec![T::Acc::default(); hd];
    let mut qh = vec![0f32; hd];
    for t in 0..n_new {
        let visible = first + t + 1;
        for h in 0..group {
            let head = g * group + h;
            for (qv, &x) in qh
                .iter_mut()
                .zip(&q_rows[t * dim + head * hd..t * dim + (head + 1) * hd])
            {
                // llama.cpp converts Q to the cache's element type before the product.
                *qv = T::round_query(x);
            }
            let o = &mut out[(t * group + h) * hd..(t * group + h + 1) * hd];
            attend_head(
                &qh,
                &k_rows[..visible],
                &v_rows[..visible],
                scale,
                &mut acc,
                o,
            );
        }
    }
    out
}

/// One query head over its visible positions, computed as llama.cpp's CPU flash-attention
/// kernel does (the reference our goldens come from): one pass in position order with a
/// running maximum, the V sum accumulated in the cache's element type (f16 for an f16
/// cache, rounding after every update), normalized at the end. Matching its roundings keeps
/// greedy output within llama.cpp's near-tie margins; the order is fixed, so the result does
/// not depend on the batch.
fn attend_head<T: KvElem>(
    q: &[f32],
    k: &[&[T]],
    v: &[&[T]],
    scale: f32,
    acc: &mut [T::Acc],
    out: &mut [f32],
) {
    T::attend(q, k, v, scale, acc, out);
}

fn add_in_place(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

fn quantize_rows(x: &[f32], width: usize, out: &mut [BlockQ8_1]) {
    let nb = width / QK;
    for (row, o) in x.chunks_exact(width).zip(out.chunks_exact_mut(nb)) {
        quantize_row_q8_1(row, o);
    }
}

/// RMSNorm as ggml computes it (sum of squares in f64), then the learned scale.
fn rms_norm_rows(x: &[f32], weight: &[f32], eps: f32, width: usize, out: &mut [f32]) {
    for (row, o) in x.chunks_exact(width).zip(out.chunks_exact_mut(width)) {
        let sum: f64 = row.iter().map(|&v| (v * v) as f64).sum();
        let mean = (sum / width as f64) as f32;
        let scale = 1.0 / (mean + eps).sqrt();
        for ((ov, &xv), &w) in o.iter_mut().zip(row).zip(weight) {
            *ov = (xv * scale) * w;
        }
    }
}

/// Rotary embedding angles per batch row, computed as ggml does: `theta_i = pos *
/// base^(-2i/d)` built by repeated multiplication, divided by the pair's frequency factor
/// (Llama 3) and multiplied by the linear scale. The pairs are adjacent dimensions (llama's
/// NORMAL mode) or dimension `i` with `i + d/2` (NEOX mode, the Qwen families).
struct RopeTable {
    half: usize,
    neox: bool,
    cos: Vec<f32>,
    sin: Vec<f32>,
}

impl RopeTable {
    fn new(c: &LlamaConfig, freqs: Option<&[f32]>, positions: impl Iterator<Item = usize>) -> Self {
        let half = c.rope_dims / 2;
        let theta_scale = c.rope_base.powf(-2.0 / c.rope_dims as f32);
        let mut cos = Vec::new();
        let mut sin = Vec::new();
        for p in positions {
            let mut theta = p as f32;
            for i in 0..half {
                // With no factors and no scaling both operations are exact (x / 1, 1 * x),
                // so llama's original path keeps its bits.
                let ff = freqs.map_or(1.0, |f| f[i]);
                let t = c.rope_freq_scale * (theta / ff);
                cos.push(t.cos());
                sin.push(t.sin());
                theta *= theta_scale;
            }
        }
        Self {
            half,
            neox: c.arch.rope_neox(),
            cos,
            sin,
        }
    }

    fn apply(&self, row: usize, x: &mut [f32], hd: usize) {
        let cs = &self.cos[row * self.half..(row + 1) * self.half];
        let sn = &self.sin[row * self.half..(row + 1) * self.half];
        // Index of the second element of pair `i`, relative to the first.
        let (stride, offset) = if self.neox { (1, self.half) } else { (2, 1) };
        for head in x.chunks_exact_mut(hd) {
            for i in 0..self.half {
                let j = stride * i;
                let (a, b) = (head[j], head[j + offset]);
                // The contractions GCC makes of ggml's `x0*cos - x1*sin` and
                // `x0*sin + x1*cos`: the first product fused, the second rounded.
                head[j] = a.mul_add(cs[i], -(b * sn[i]));
                head[j + offset] = a.mul_add(sn[i], b * cs[i]);
            }
        }
    }
}
