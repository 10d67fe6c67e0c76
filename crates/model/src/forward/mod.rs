//! The model and its forward pass: one step over a batch of sequences, each through its own
//! KV view, with logits only for the rows that are sampled from.

mod base_shapes;
mod load;
mod rope;
mod rows;

use rayon::prelude::*;

use crate::attention::attention;
use crate::batch::{BatchItem, Logits, LogitsWanted};
use crate::config::FfnAct;
use crate::kernels::{matmul, matmul_group, ActKind, RowSlice, WeightRows};
use crate::kv_rotation::{rotate_chunks, KvRotation};
use crate::lora::{add_lora_rows, RowAdapters, Site, Target, Update};
use crate::weights::{BlockQ8_1, Matrix, QK};
use crate::{LlamaConfig, ModelError};
use rope::RopeTable;
use rows::{
    add_in_place, norm_quantize, quantize_rows, quantize_rows_here, residual, rms_norm_rows,
    rows_per_chunk,
};

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

/// From this many sampled rows on, the output projection runs in [`OUTPUT_SLICES`]
/// vocabulary slices with a pause point between them
/// ([`Model::forward_yielding`]); the same values either way.
const OUTPUT_SLICED_FROM: usize = 8;
const OUTPUT_SLICES: usize = 4;

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

impl Model {
    /// How many of the weight matrices are read from the mapped file where they lie, of
    /// how many (the others were widened into memory of their own at load).
    pub fn mapped_matrices(&self) -> (usize, usize) {
        let matrices = std::iter::once(&self.embed)
            .chain(self.output.as_ref())
            .chain(
                self.layers
                    .iter()
                    .flat_map(|l| [&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down]),
            );
        matrices.fold((0, 0), |(mapped, all), m| {
            (mapped + usize::from(m.is_mapped()), all + 1)
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
        self.forward_yielding(items, &mut || {})
    }

    /// [`Self::forward`], calling `between_layers` before each layer and before the output
    /// projection, where the step may be paused to run another one (a nested call of
    /// [`Self::forward`] on other sequences) and then go on: every value the paused step
    /// holds is a local of this call, so a nested step neither sees nor changes it, and the
    /// paused step's bits are those it would have had.
    pub fn forward_yielding(
        &self,
        items: &mut [BatchItem<'_>],
        between_layers: &mut (dyn FnMut() + Send),
    ) -> Vec<Result<Logits, ModelError>> {
        self.threads
            .install(|| self.forward_in_pool(items, between_layers))
    }

    fn forward_in_pool(
        &self,
        items: &mut [BatchItem<'_>],
        between_layers: &mut (dyn FnMut() + Send),
    ) -> Vec<Result<Logits, ModelError>> {
        let c = &self.config;
        let (dim, kv_dim, q_dim, hd) = (c.dim, c.kv_dim(), c.q_dim(), c.head_dim);
        let base = items
            .iter()
            .any(|it| it.adapter.is_some())
            .then(|| self.lora_base());
        let mut status: Vec<Result<(), ModelError>> = items
            .iter()
            .map(|it| {
                if let Some(&id) = it.tokens.iter().find(|&&t| t as usize >= c.vocab_size) {
                    return Err(ModelError::TokenOutOfRange {
                        id,
                        vocab: c.vocab_size,
                    });
                }
                match (it.adapter, &base) {
                    (Some(a), Some(base)) if !a.fits(base) => Err(ModelError::AdapterDoesNotFit),
                    _ => Ok(()),
                }
            })
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
        let adapters = RowAdapters::new(rows.iter().map(|&(i, _)| items[i].adapter).collect());
        let lora = adapters.any();
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
        // Q8_1 blocks only for the inputs some layer's product reads as Q8_1 (the k-quants
        // take Q8_K: a Q4_K_M file reads none, and quantizing them was 1% of its prefill).
        let q8_1_blocks = |reads: bool, len: usize| match reads {
            true => vec![BlockQ8_1::default(); len],
            false => Vec::new(),
        };
        fn q8_1(m: &Matrix) -> bool {
            m.act_kind() == ActKind::Q8_1
        }
        let any_layer = |reads: fn(&Layer) -> bool| self.layers.iter().any(reads);
        let normed_q8 = any_layer(|l| {
            q8_1(&l.wq) || q8_1(&l.wk) || q8_1(&l.wv) || q8_1(&l.w_gate) || q8_1(&l.w_up)
        });
        let mut xq = q8_1_blocks(normed_q8, n * dim / QK);
        let mut aq = q8_1_blocks(any_layer(|l| q8_1(&l.wo)), n * q_dim / QK);
        let mut q = vec![0f32; n * q_dim];
        let mut k = vec![0f32; n * kv_dim];
        let mut v = vec![0f32; n * kv_dim];
        let mut attn = vec![0f32; n * q_dim];
        let mut proj = vec![0f32; n * dim];
        let mut gate = vec![0f32; n * c.ffn_dim];
        let mut up = vec![0f32; n * c.ffn_dim];
        let mut hq = q8_1_blocks(any_layer(|l| q8_1(&l.w_down)), n * c.ffn_dim / QK);

        for (li, layer) in self.layers.iter().enumerate() {
            between_layers();
            let rope = &ropes[rope_of[li]];
            norm_quantize(&x, &layer.attn_norm, c.rms_eps, dim, &mut xn, &mut xq);
            matmul_group(
                &[&layer.wq, &layer.wk, &layer.wv],
                &xn,
                &xq,
                n,
                &mut [&mut q, &mut k, &mut v],
            );
            if lora {
                let update = |target, out, n_out| Update {
                    site: Site::Layer(li, target),
                    out,
                    n_out,
                };
                let mut qkv = [
                    update(Target::Q, &mut q[..], q_dim),
                    update(Target::K, &mut k[..], kv_dim),
                    update(Target::V, &mut v[..], kv_dim),
                ];
                add_lora_rows(&adapters, &xn, dim, &mut qkv);
            }
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
            // A block-format cache stores K and V rotated (`kv_rotation`); each item's rows
            // by its own pool's element type.
            let rotations: Vec<Option<KvRotation>> = items
                .iter()
                .map(|it| KvRotation::of(it.kv.layout().dtype, hd))
                .collect();
            for (i, rot) in rotations.iter().enumerate() {
                if let Some(rot) = rot {
                    let rows = starts[i]..starts[i] + items[i].tokens.len();
                    rotate_chunks(&mut q[rows.start * q_dim..rows.end * q_dim], rot.k);
                    rotate_chunks(&mut k[rows.start * kv_dim..rows.end * kv_dim], rot.k);
                    rotate_chunks(&mut v[rows.start * kv_dim..rows.end * kv_dim], rot.v);
                }
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
            for (i, rot) in rotations.iter().enumerate() {
                if let Some(rot) = rot {
                    let rows = starts[i]..starts[i] + items[i].tokens.len();
                    rotate_chunks(&mut attn[rows.start * q_dim..rows.end * q_dim], rot.v);
                }
            }
            quantize_rows(&attn, q_dim, &mut aq);
            matmul(&layer.wo, &attn, &aq, n, &mut proj);
            if lora {
                let mut o = [Update {
                    site: Site::Layer(li, Target::O),
                    out: &mut proj[..],
                    n_out: dim,
                }];
                add_lora_rows(&adapters, &attn, q_dim, &mut o);
            }
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
            if lora {
                let mut gate_up = [
                    Update {
                        site: Site::Layer(li, Target::Gate),
                        out: &mut gate[..],
                        n_out: ffn,
                    },
                    Update {
                        site: Site::Layer(li, Target::Up),
                        out: &mut up[..],
                        n_out: ffn,
                    },
                ];
                add_lora_rows(&adapters, &xn, dim, &mut gate_up);
            }
            let per = rows_per_chunk(n);
            let activate = |((g, u), hq): ((&mut [f32], &[f32]), &mut [BlockQ8_1])| {
                match c.ffn_act {
                    FfnAct::Silu => crate::kernels::swiglu(g, u),
                    FfnAct::GeluTanh => crate::gemma3::geglu(g, u),
                }
                if !hq.is_empty() {
                    quantize_rows_here(g, ffn, hq);
                }
            };
            if per >= n {
                activate(((&mut gate[..], &up[..]), &mut hq[..]));
            } else {
                let (gs, us) = (gate.par_chunks_mut(per * ffn), up.par_chunks(per * ffn));
                if hq.is_empty() {
                    gs.zip(us).for_each(|gu| activate((gu, &mut [])));
                } else {
                    gs.zip(us)
                        .zip(hq.par_chunks_mut(per * ffn / QK))
                        .for_each(activate);
                }
            }
            matmul(&layer.w_down, &gate, &hq, n, &mut proj);
            if lora {
                let mut down = [Update {
                    site: Site::Layer(li, Target::Down),
                    out: &mut proj[..],
                    n_out: dim,
                }];
                add_lora_rows(&adapters, &gate, ffn, &mut down);
            }
            residual(&mut x, &mut proj, &layer.post_ffn_norm, c.rms_eps, dim);
        }

        between_layers();
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
                LogitsWanted::From(k) => {
                    wanted.extend(starts[i] + k.min(it.tokens.len())..starts[i] + it.tokens.len())
                }
            }
        }
        let m = wanted.len();
        let mut sel = vec![0f32; m * dim];
        for (j, &r) in wanted.iter().enumerate() {
            sel[j * dim..(j + 1) * dim].copy_from_slice(&x[r * dim..(r + 1) * dim]);
        }
        let mut seln = vec![0f32; m * dim];
        rms_norm_rows(&sel, &self.output_norm, c.rms_eps, dim, &mut seln);
        let out_w = self.output.as_ref().unwrap_or(&self.embed);
        let mut selq = q8_1_blocks(q8_1(out_w), m * dim / QK);
        quantize_rows(&seln, dim, &mut selq);
        let mut logits = vec![0f32; m * c.vocab_size];
        if m >= OUTPUT_SLICED_FROM {
            // A batch's output projection is a fifth of its step: in vocabulary slices, so
            // that a step can pause between them as between layers.
            let per = c.vocab_size.div_ceil(OUTPUT_SLICES);
            let mut part = vec![0f32; m * per];
            for r0 in (0..c.vocab_size).step_by(per) {
                between_layers();
                let rows = per.min(c.vocab_size - r0);
                let slice = RowSlice { w: out_w, r0, rows };
                let part = &mut part[..m * rows];
                matmul(&slice, &seln, &selq, m, part);
                for (t, values) in part.chunks_exact(rows).enumerate() {
                    logits[t * c.vocab_size + r0..t * c.vocab_size + r0 + rows]
                        .copy_from_slice(values);
                }
            }
        } else if m > 0 {
            matmul(out_w, &seln, &selq, m, &mut logits);
        }
        if m > 0 && lora && self.output.is_some() {
            let mut output = [Update {
                site: Site::Output,
                out: &mut logits[..],
                n_out: c.vocab_size,
            }];
            add_lora_rows(&adapters.select(&wanted), &seln, dim, &mut output);
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
                    LogitsWanted::From(k) => it.tokens.len().saturating_sub(k),
                };
                let out = logits[cursor * c.vocab_size..(cursor + count) * c.vocab_size].to_vec();
                cursor += count;
                Ok(out)
            })
            .collect()
    }
}
