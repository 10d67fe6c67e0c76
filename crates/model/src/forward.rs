use gguf::GgufFile;
use kv::SequenceKv;
use rayon::prelude::*;

use crate::attention::attention;
use crate::config::{Arch, FfnAct, LayerAttention};
use crate::kernels::{matmul, matmul_group};
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
    /// Per-head RMSNorm weights of Q and K, applied before the rotation (qwen3, gemma3).
    q_norm: Option<Vec<f32>>,
    k_norm: Option<Vec<f32>>,
    /// RMSNorms of the attention output and of the FFN output before each residual add
    /// (gemma3).
    post_attn_norm: Option<Vec<f32>>,
    post_ffn_norm: Option<Vec<f32>>,
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
        let qk_norms = matches!(c.arch, Arch::Qwen3 | Arch::Gemma3);
        let post_norms = c.arch == Arch::Gemma3;
        let needed = |on: bool, name: String, len: usize| match on {
            true => vec(&name, len).map(Some),
            false => Ok(None),
        };
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
                q_norm: needed(qk_norms, p("attn_q_norm"), hd)?,
                k_norm: needed(qk_norms, p("attn_k_norm"), hd)?,
                post_attn_norm: needed(post_norms, p("post_attention_norm"), c.dim)?,
                post_ffn_norm: needed(post_norms, p("post_ffw_norm"), c.dim)?,
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
                let row = &mut x[r * dim..(r + 1) * dim];
                self.embed.row_f32(tok as usize, row);
                if let Some(s) = c.embed_scale {
                    row.iter_mut().for_each(|v| *v *= s);
                }
            }
        }
        // One table per distinct rotation (Gemma's local and global layers differ).
        let mut keys: Vec<(f32, f32)> = Vec::new();
        let mut ropes: Vec<RopeTable> = Vec::new();
        let mut rope_of = Vec::with_capacity(c.layers.len());
        for l in &c.layers {
            let key = (l.rope_base, l.rope_freq_scale);
            let at = match keys.iter().position(|k| *k == key) {
                Some(at) => at,
                None => {
                    let positions = rows.iter().map(|&(_, p)| p);
                    ropes.push(RopeTable::new(c, l, self.rope_freqs.as_deref(), positions));
                    keys.push(key);
                    keys.len() - 1
                }
            };
            rope_of.push(at);
        }

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
            let rope = &ropes[rope_of[li]];
            norm_quantize(&x, &layer.attn_norm, c.rms_eps, dim, &mut xn, &mut xq);
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
            let per = rows_per_chunk(n);
            let rotate = |(chunk, (qc, kc)): (usize, (&mut [f32], &mut [f32]))| {
                let rows = qc.chunks_exact_mut(q_dim).zip(kc.chunks_exact_mut(kv_dim));
                for (j, (qr, kr)) in rows.enumerate() {
                    rope.apply(chunk * per + j, qr, hd);
                    rope.apply(chunk * per + j, kr, hd);
                }
            };
            if per >= n {
                rotate((0, (&mut q[..], &mut k[..])));
            } else {
                let (qs, ks) = (
                    q.par_chunks_mut(per * q_dim),
                    k.par_chunks_mut(per * kv_dim),
                );
                qs.zip(ks).enumerate().for_each(rotate);
            }
            if let Some(s) = c.q_scale {
                q.iter_mut().for_each(|v| *v *= s);
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
            attention(c, li, items, &starts, &mut status, &q, &mut attn);
            quantize_rows(&attn, q_dim, &mut aq);
            matmul(&layer.wo, &attn, &aq, n, &mut proj);
            residual(&mut x, &mut proj, &layer.post_attn_norm, c.rms_eps, dim);
            norm_quantize(&x, &layer.ffn_norm, c.rms_eps, dim, &mut xn, &mut xq);
            matmul_group(
                &[&layer.w_gate, &layer.w_up],
                &xn,
                &xq,
                n,
                &mut [&mut gate, &mut up],
            );
            let ffn = c.ffn_dim;
            let per = rows_per_chunk(n);
            let activate = |((g, u), hq): ((&mut [f32], &[f32]), &mut [BlockQ8_1])| {
                match c.ffn_act {
                    FfnAct::Silu => crate::kernels::swiglu(g, u),
                    FfnAct::GeluTanh => crate::gemma3::geglu(g, u),
                }
                quantize_rows_here(g, ffn, hq);
            };
            if per >= n {
                activate(((&mut gate[..], &up[..]), &mut hq[..]));
            } else {
                let (gs, us) = (gate.par_chunks_mut(per * ffn), up.par_chunks(per * ffn));
                gs.zip(us)
                    .zip(hq.par_chunks_mut(per * ffn / QK))
                    .for_each(activate);
            }
            matmul(&layer.w_down, &gate, &hq, n, &mut proj);
            residual(&mut x, &mut proj, &layer.post_ffn_norm, c.rms_eps, dim);
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
}

/// Gemma's norm of a sublayer's output before it joins the residual stream.
fn post_norm(out: &mut [f32], weight: &Option<Vec<f32>>, eps: f32, width: usize) {
    if let Some(w) = weight {
        let raw = out.to_vec();
        rms_norm_rows(&raw, w, eps, width, out);
    }
}

fn add_in_place(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

/// Rows per parallel chunk of the per-row steps between the products (norms, quantization,
/// RoPE, activations, residual adds): every core takes a share instead of one core doing
/// them while the others wait for the next product (they were 6-7% of a prefill's CPU time,
/// all of it on one core). Each row's arithmetic is unchanged, so the bits are too.
/// Below [`PAR_ROWS_MIN`] rows (a decode step of a few streams) it is all of them, done on
/// the calling thread: there the fork-join cost more than it saved (-4% single-stream decode).
fn rows_per_chunk(n: usize) -> usize {
    if n < PAR_ROWS_MIN {
        n.max(1)
    } else {
        n.div_ceil(2 * rayon::current_num_threads())
    }
}

/// See [`rows_per_chunk`].
const PAR_ROWS_MIN: usize = 8;

/// `xn = rms_norm(x) * weight`, then `xq` its Q8_1 blocks, row chunks on every core.
fn norm_quantize(
    x: &[f32],
    weight: &[f32],
    eps: f32,
    width: usize,
    xn: &mut [f32],
    xq: &mut [BlockQ8_1],
) {
    let per = rows_per_chunk(x.len() / width);
    let step = |((x, xn), xq): ((&[f32], &mut [f32]), &mut [BlockQ8_1])| {
        rms_norm_rows(x, weight, eps, width, xn);
        quantize_rows_here(xn, width, xq);
    };
    if per * width >= x.len() {
        return step(((x, xn), xq));
    }
    let chunks = x
        .par_chunks(per * width)
        .zip(xn.par_chunks_mut(per * width));
    chunks
        .zip(xq.par_chunks_mut(per * width / QK))
        .for_each(step);
}

/// `x += post_norm(proj)`: a sublayer's output joining the residual stream (Gemma normalizes
/// it first), row chunks on every core.
fn residual(x: &mut [f32], proj: &mut [f32], post: &Option<Vec<f32>>, eps: f32, width: usize) {
    let per = rows_per_chunk(x.len() / width);
    let step = |(x, proj): (&mut [f32], &mut [f32])| {
        post_norm(proj, post, eps, width);
        add_in_place(x, proj);
    };
    if per * width >= x.len() {
        return step((x, proj));
    }
    let chunks = x
        .par_chunks_mut(per * width)
        .zip(proj.par_chunks_mut(per * width));
    chunks.for_each(step);
}

/// Each row's Q8_1 blocks, row chunks on every core.
fn quantize_rows(x: &[f32], width: usize, out: &mut [BlockQ8_1]) {
    let per = rows_per_chunk(x.len() / width);
    if per * width >= x.len() {
        return quantize_rows_here(x, width, out);
    }
    let chunks = x
        .par_chunks(per * width)
        .zip(out.par_chunks_mut(per * width / QK));
    chunks.for_each(|(x, out)| quantize_rows_here(x, width, out));
}

/// [`quantize_rows`] on the calling thread (within a chunk already parallel).
fn quantize_rows_here(x: &[f32], width: usize, out: &mut [BlockQ8_1]) {
    let nb = width / QK;
    for (row, o) in x.chunks_exact(width).zip(out.chunks_exact_mut(nb)) {
        quantize_row_q8_1(row, o);
    }
}

/// RMSNorm as ggml computes it (sum of squares in f64), then the learned scale.
fn rms_norm_rows(x: &[f32], weight: &[f32], eps: f32, width: usize, out: &mut [f32]) {
    // Each row's sum is one chain of dependent f64 additions, in element order as ggml adds
    // them; four rows' chains run side by side so that they overlap (same additions, same
    // order within each row).
    const ROWS_TOGETHER: usize = 4;
    let group = ROWS_TOGETHER * width;
    let (whole, rest) = x.split_at(x.len() / group * group);
    let (out_whole, out_rest) = out.split_at_mut(whole.len());
    for (xs, outs) in whole
        .chunks_exact(group)
        .zip(out_whole.chunks_exact_mut(group))
    {
        let rows: [&[f32]; ROWS_TOGETHER] =
            std::array::from_fn(|j| &xs[j * width..(j + 1) * width]);
        let mut sums = [0f64; ROWS_TOGETHER];
        for i in 0..width {
            for (sum, row) in sums.iter_mut().zip(&rows) {
                *sum += (row[i] * row[i]) as f64;
            }
        }
        for ((row, o), sum) in rows.iter().zip(outs.chunks_exact_mut(width)).zip(sums) {
            scale_row(row, weight, eps, width, sum, o);
        }
    }
    for (row, o) in rest
        .chunks_exact(width)
        .zip(out_rest.chunks_exact_mut(width))
    {
        let sum: f64 = row.iter().map(|&v| (v * v) as f64).sum();
        scale_row(row, weight, eps, width, sum, o);
    }
}

/// `o = row / sqrt(mean + eps) * weight`, the mean from the row's sum of squares.
fn scale_row(row: &[f32], weight: &[f32], eps: f32, width: usize, sum: f64, o: &mut [f32]) {
    let mean = (sum / width as f64) as f32;
    let scale = 1.0 / (mean + eps).sqrt();
    for ((ov, &xv), &w) in o.iter_mut().zip(row).zip(weight) {
        *ov = (xv * scale) * w;
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
    fn new(
        c: &LlamaConfig,
        layer: &LayerAttention,
        freqs: Option<&[f32]>,
        positions: impl Iterator<Item = usize>,
    ) -> Self {
        let half = c.rope_dims / 2;
        let theta_scale = layer.rope_base.powf(-2.0 / c.rope_dims as f32);
        let mut cos = Vec::new();
        let mut sin = Vec::new();
        for p in positions {
            let mut theta = p as f32;
            for i in 0..half {
                // With no factors and no scaling both operations are exact (x / 1, 1 * x),
                // so llama's original path keeps its bits.
                let ff = freqs.map_or(1.0, |f| f[i]);
                let t = layer.rope_freq_scale * (theta / ff);
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
        crate::kernels::rope_row(x, hd, cs, sn, self.neox);
    }
}
