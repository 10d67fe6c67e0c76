//! Reading and checking an adapter file (llama.cpp's GGUF LoRA format, as
//! `convert_lora_to_gguf.py` writes it) against the base model it will run on.
//!
//! The file is untrusted: every key, name, shape and value is checked, and the f32 bytes the
//! adapter will hold are bounded, before anything is allocated for its weights. The rules
//! are llama.cpp's (`llama_adapter_lora_init_impl`) where it has one, and stricter where it
//! would run something other than what the file says: a tensor the forward pass would not
//! apply (token embeddings, norms, an output projection the model ties to its embeddings)
//! is refused naming it rather than ignored, and an activated LoRA
//! (`adapter.alora.invocation_tokens`), which llama.cpp switches on mid-sequence, is refused.

use std::collections::HashMap;
use std::io::Read;
use std::path::Path;

use gguf::{GgmlType, GgufFile, MetaValue, TensorInfo};
use xxhash_rust::xxh3::{xxh3_128, Xxh3};

use super::{LoraAdapter, LoraBase, LoraPair, Target};
use crate::LlamaConfig;

/// The largest rank accepted (PEFT adapters use 8 to 256).
pub const MAX_RANK: usize = 1024;

/// The most f32 bytes one adapter may hold once widened (checked before allocating).
pub const MAX_F32_BYTES: u64 = 4 << 30;

/// The largest adapter file [`LoraAdapter::load_path`] reads: its f32 weights at their
/// widest plus room for the header.
pub const MAX_FILE_BYTES: u64 = MAX_F32_BYTES + (64 << 20);

/// Why an adapter was refused.
#[derive(Debug, thiserror::Error)]
pub enum LoraError {
    // The causes are in the messages and not also `source()`s, so that a chain printed
    // whole (anyhow's `{:#}`) says each once.
    #[error("cannot read adapter {path}: {error}")]
    Io { path: String, error: std::io::Error },
    #[error("adapter {path} is {bytes} bytes (limit {limit})")]
    FileTooLarge {
        path: String,
        bytes: u64,
        limit: u64,
    },
    #[error("adapter file: {0}")]
    Gguf(gguf::GgufError),
    #[error("adapter metadata {key:?}: {reason}")]
    Metadata { key: String, reason: String },
    #[error("adapter for architecture {adapter:?}, but the base model is {base:?}")]
    Architecture { adapter: String, base: &'static str },
    #[error("adapter tensor {name:?}: {reason}")]
    Tensor { name: String, reason: String },
    #[error(
        "adapter tensor {name:?}: ggml type {ty} is not supported in an adapter (F32, F16, \
         BF16, Q8_0)"
    )]
    TensorType { name: String, ty: String },
    #[error("adapter scale {0} is not finite")]
    Scale(f32),
    #[error("the adapter holds no LoRA pairs")]
    Empty,
    #[error("adapter too large: {bytes} bytes of f32 weights (limit {limit})")]
    TooLarge { bytes: u64, limit: u64 },
    /// A pair given to [`LoraAdapter::from_pairs`] that is not consistent in itself.
    #[error("{0}")]
    Invalid(String),
}

impl From<gguf::GgufError> for LoraError {
    fn from(e: gguf::GgufError) -> Self {
        LoraError::Gguf(e)
    }
}

/// Where a pair applies: a layer's weight, or the output projection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Site {
    Layer(usize, Target),
    Output,
}

/// `(n_in, n_out)` of the base weight a pair updates: its ggml dims, row length first.
pub(crate) fn base_dims(c: &LlamaConfig, target: Target) -> (usize, usize) {
    match target {
        Target::Q => (c.dim, c.q_dim()),
        Target::K | Target::V => (c.dim, c.kv_dim()),
        Target::O => (c.q_dim(), c.dim),
        Target::Gate | Target::Up => (c.dim, c.ffn_dim),
        Target::Down => (c.ffn_dim, c.dim),
    }
}

/// `(n_in, n_out)` of the output projection.
pub(crate) fn output_dims(c: &LlamaConfig) -> (usize, usize) {
    (c.dim, c.vocab_size)
}

/// llama.cpp's `get_scale`: `scale · alpha / rank`, or `scale` alone when alpha is 0.
pub fn lora_factor(scale: f32, alpha: f32, rank: usize) -> f32 {
    if alpha == 0.0 {
        scale
    } else {
        scale * alpha / rank as f32
    }
}

impl LoraAdapter {
    /// Reads the adapter at `path` into memory (adapters are small, and a file read once
    /// cannot change under the server), checksums its bytes and loads it for `model`.
    pub fn load_path(path: &Path, base: &LoraBase, scale: f32) -> Result<Self, LoraError> {
        let io = |error| LoraError::Io {
            path: path.display().to_string(),
            error,
        };
        let too_large = |bytes| LoraError::FileTooLarge {
            path: path.display().to_string(),
            bytes,
            limit: MAX_FILE_BYTES,
        };
        let file = std::fs::File::open(path).map_err(io)?;
        let len = file.metadata().map_err(io)?.len();
        if len > MAX_FILE_BYTES {
            return Err(too_large(len));
        }
        // Bounded again as it is read: a file that grows meanwhile reads no further.
        let mut bytes = Vec::with_capacity(len as usize);
        file.take(MAX_FILE_BYTES + 1)
            .read_to_end(&mut bytes)
            .map_err(io)?;
        if bytes.len() as u64 > MAX_FILE_BYTES {
            return Err(too_large(bytes.len() as u64));
        }
        let checksum = xxh3_128(&bytes);
        let file = GgufFile::parse(bytes)?;
        Self::load(&file, checksum, base, scale)
    }

    /// Checks a parsed adapter file against `model` and widens its pairs to f32.
    /// `file_checksum` is the xxh3-128 of the file's bytes, kept to name the file.
    pub fn load(
        file: &GgufFile,
        file_checksum: u128,
        base: &LoraBase,
        scale: f32,
    ) -> Result<Self, LoraError> {
        let c = &base.config;
        if !scale.is_finite() {
            return Err(LoraError::Scale(scale));
        }
        let alpha = check_metadata(file, c.arch.name())?;
        if !(scale * alpha).is_finite() {
            return Err(LoraError::Metadata {
                key: ALPHA.into(),
                reason: format!("{alpha} times the scale {scale} overflows"),
            });
        }
        let sites = pair_tensors(file, c.n_layers, base.own_output)?;
        if sites.is_empty() {
            return Err(LoraError::Empty);
        }

        // Every shape and type first, and the total, so nothing is allocated for a file that
        // would be refused.
        let mut total = 0u64;
        let mut checked = Vec::with_capacity(sites.len());
        for (site, a, b) in sites {
            let (n_in, n_out) = match site {
                Site::Layer(_, t) => base_dims(c, t),
                Site::Output => output_dims(c),
            };
            let rank = check_pair(a, b, n_in, n_out)?;
            let values = (rank as u64) * (n_in as u64 + n_out as u64);
            total = total.saturating_add(values.saturating_mul(4));
            if total > MAX_F32_BYTES {
                return Err(LoraError::TooLarge {
                    bytes: total,
                    limit: MAX_F32_BYTES,
                });
            }
            checked.push((site, a, b, rank, n_in, n_out));
        }

        let mut layers: Vec<[Option<LoraPair>; 7]> = Vec::new();
        layers.resize_with(c.n_layers, Default::default);
        let mut output = None;
        for (site, a, b, rank, n_in, n_out) in checked {
            let pair = LoraPair {
                rank,
                n_in,
                n_out,
                a: widen(file, a)?,
                b: transpose(&widen(file, b)?, n_out, rank),
                factor: lora_factor(scale, alpha, rank),
            };
            match site {
                Site::Layer(l, t) => layers[l][target_index(t)] = Some(pair),
                Site::Output => output = Some(pair),
            }
        }
        Self::from_pairs(layers, output, scale, alpha, file_checksum)
    }

    /// An adapter from pairs already in memory (tests, and the engine), each with its own
    /// `factor` ([`LoraAdapter::load`] sets it by [`lora_factor`]; `scale` and `alpha` are
    /// recorded as given). Each pair is checked to be consistent in itself (its lengths,
    /// rank, factor and values), but not against a base model, which is `load`'s job.
    pub fn from_pairs(
        layers: Vec<[Option<LoraPair>; 7]>,
        output: Option<LoraPair>,
        scale: f32,
        alpha: f32,
        file_checksum: u128,
    ) -> Result<Self, LoraError> {
        if !scale.is_finite() {
            return Err(LoraError::Scale(scale));
        }
        if !(alpha.is_finite() && alpha >= 0.0) {
            return Err(LoraError::Metadata {
                key: ALPHA.into(),
                reason: format!("{alpha} is not a finite number at least 0"),
            });
        }
        let mut fingerprint = Xxh3::new();
        fingerprint.update(b"kvwarden lora v1");
        let (mut rank, mut bytes, mut pairs) = (0usize, 0u64, 0usize);
        let sites = layers
            .iter()
            .enumerate()
            .flat_map(|(l, targets)| {
                Target::ALL
                    .into_iter()
                    .zip(targets)
                    .map(move |(t, p)| (Site::Layer(l, t), p))
            })
            .chain(std::iter::once((Site::Output, &output)));
        for (site, slot) in sites {
            let Some(pair) = slot else { continue };
            check_in_memory(pair, site)?;
            bytes = bytes.saturating_add(4 * (pair.a.len() + pair.b.len()) as u64);
            if bytes > MAX_F32_BYTES {
                return Err(LoraError::TooLarge {
                    bytes,
                    limit: MAX_F32_BYTES,
                });
            }
            // The position first: one pair at two places computes two different things.
            let position = match site {
                Site::Layer(l, t) => [l as u64, target_index(t) as u64],
                Site::Output => [u64::MAX; 2],
            };
            rank = rank.max(pair.rank);
            pairs += 1;
            let shape = [pair.rank as u64, pair.n_in as u64, pair.n_out as u64];
            for v in position.into_iter().chain(shape) {
                fingerprint.update(&v.to_le_bytes());
            }
            fingerprint.update(&pair.factor.to_bits().to_le_bytes());
            hash_f32(&mut fingerprint, &pair.a);
            hash_f32(&mut fingerprint, &pair.b);
        }
        if pairs == 0 {
            return Err(LoraError::Empty);
        }
        Ok(Self {
            layers,
            output,
            fingerprint: fingerprint.digest128(),
            file_checksum,
            scale,
            alpha,
            rank,
            bytes: bytes as usize,
        })
    }
}

const ALPHA: &str = "adapter.lora.alpha";

/// The keys that say what the file is; returns alpha (0 when absent, as in llama.cpp).
fn check_metadata(file: &GgufFile, base_arch: &'static str) -> Result<f32, LoraError> {
    let string = |key: &str, want: &str| -> Result<String, LoraError> {
        let bad = |reason: String| LoraError::Metadata {
            key: key.into(),
            reason,
        };
        match file.get(key) {
            None => Err(bad(format!("missing (an adapter file says {want:?})"))),
            Some(MetaValue::String(s)) => Ok(s.clone()),
            Some(other) => Err(bad(format!("{other:?} is not a string"))),
        }
    };
    for (key, want) in [("general.type", "adapter"), ("adapter.type", "lora")] {
        let got = string(key, want)?;
        if got != want {
            return Err(LoraError::Metadata {
                key: key.into(),
                reason: format!("{got:?}, expected {want:?}"),
            });
        }
    }
    let arch = string("general.architecture", base_arch)?;
    if arch != base_arch {
        return Err(LoraError::Architecture {
            adapter: arch,
            base: base_arch,
        });
    }
    // llama.cpp would switch such an adapter on only after its invocation tokens; applied to
    // every position it would compute something else.
    let alora = "adapter.alora.invocation_tokens";
    if file.get(alora).is_some() {
        return Err(LoraError::Metadata {
            key: alora.into(),
            reason: "activated LoRA (aLoRA) adapters are not supported".into(),
        });
    }
    let alpha = match file.get(ALPHA) {
        None => 0.0,
        // llama.cpp reads it as a 32-bit float and no other type.
        Some(MetaValue::F32(a)) => *a,
        Some(other) => {
            return Err(LoraError::Metadata {
                key: ALPHA.into(),
                reason: format!("{other:?} is not a 32-bit float"),
            })
        }
    };
    if !(alpha.is_finite() && alpha >= 0.0) {
        return Err(LoraError::Metadata {
            key: ALPHA.into(),
            reason: format!("{alpha} is not a finite number at least 0"),
        });
    }
    Ok(alpha)
}

/// Where the base weight named `base` (`blk.N.attn_q.weight`, `output.weight`) lies, or why
/// an adapter may not change it.
fn site_of(base: &str, n_layers: usize, has_output: bool) -> Result<Site, String> {
    if base == "output.weight" {
        return match has_output {
            true => Ok(Site::Output),
            false => Err(
                "the base model ties its output projection to token_embd.weight \
                          (it has no output.weight of its own to adapt)"
                    .into(),
            ),
        };
    }
    if base == "token_embd.weight" {
        return Err("adapters of the token embeddings are not supported".into());
    }
    let unknown = || {
        String::from(
            "not a weight an adapter can change (blk.N.{attn_q,attn_k,attn_v,attn_output,\
             ffn_gate,ffn_up,ffn_down}.weight, or output.weight)",
        )
    };
    let rest = base.strip_prefix("blk.").ok_or_else(unknown)?;
    let (layer, rest) = rest.split_once('.').ok_or_else(unknown)?;
    let name = rest.strip_suffix(".weight").ok_or_else(unknown)?;
    let target = Target::ALL
        .into_iter()
        .find(|t| t.tensor() == name)
        .ok_or_else(unknown)?;
    // The base model's names are plain decimal: `blk.01` or `blk.+1` name no tensor of it.
    let n: usize = layer
        .parse()
        .ok()
        .filter(|n: &usize| n.to_string() == layer)
        .ok_or_else(unknown)?;
    if n >= n_layers {
        return Err(format!(
            "layer {n} is past the base model's {n_layers} layers"
        ));
    }
    Ok(Site::Layer(n, target))
}

/// The file's tensors as (site, lora_a, lora_b), in the order each site first appears;
/// any tensor that is not half of a pair the model can apply is refused naming it.
fn pair_tensors(
    file: &GgufFile,
    n_layers: usize,
    has_output: bool,
) -> Result<Vec<(Site, &TensorInfo, &TensorInfo)>, LoraError> {
    let mut order: Vec<Site> = Vec::new();
    let mut halves: HashMap<Site, [Option<&TensorInfo>; 2]> = HashMap::new();
    for t in file.tensors() {
        let refuse = |reason: String| LoraError::Tensor {
            name: t.name.clone(),
            reason,
        };
        let (base, half) = match (
            t.name.strip_suffix(".lora_a"),
            t.name.strip_suffix(".lora_b"),
        ) {
            (Some(base), _) => (base, 0),
            (_, Some(base)) => (base, 1),
            _ => {
                return Err(refuse(
                    "not a LoRA tensor (an adapter's names end in .lora_a or .lora_b)".into(),
                ))
            }
        };
        let site = site_of(base, n_layers, has_output).map_err(refuse)?;
        let slot = halves.entry(site).or_insert_with(|| {
            order.push(site);
            [None, None]
        });
        // The reader refuses repeated names; a site reached by two names would be a bug in
        // `site_of`, refused all the same.
        if slot[half].replace(t).is_some() {
            return Err(refuse("a second tensor for the same weight".into()));
        }
    }
    let mut pairs = Vec::with_capacity(order.len());
    for site in order {
        match halves.get(&site) {
            Some([Some(a), Some(b)]) => pairs.push((site, *a, *b)),
            Some([Some(one), None]) | Some([None, Some(one)]) => {
                let (have, missing) = match one.name.ends_with(".lora_a") {
                    true => ("lora_a", "lora_b"),
                    false => ("lora_b", "lora_a"),
                };
                return Err(LoraError::Tensor {
                    name: one.name.clone(),
                    reason: format!("{have} without its {missing}"),
                });
            }
            _ => {}
        }
    }
    Ok(pairs)
}

/// Checks one pair's dims and types against the base weight `[n_in, n_out]`; its rank.
fn check_pair(
    a: &TensorInfo,
    b: &TensorInfo,
    n_in: usize,
    n_out: usize,
) -> Result<usize, LoraError> {
    let refuse = |t: &TensorInfo, reason: String| LoraError::Tensor {
        name: t.name.clone(),
        reason,
    };
    for t in [a, b] {
        if !matches!(
            t.ty,
            GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 | GgmlType::Q8_0
        ) {
            return Err(LoraError::TensorType {
                name: t.name.clone(),
                ty: format!("{:?}", t.ty),
            });
        }
        if t.dims.len() != 2 {
            return Err(refuse(
                t,
                format!("dims {:?}: a LoRA tensor has 2 dimensions", t.dims),
            ));
        }
    }
    let (n_in64, n_out64) = (n_in as u64, n_out as u64);
    if a.dims[0] != n_in64 {
        return Err(refuse(
            a,
            format!(
                "dims {:?}: lora_a must be [{n_in}, rank] for a base weight of [{n_in}, \
                 {n_out}] (an adapter for another model, or lora_a not transposed?)",
                a.dims
            ),
        ));
    }
    if b.dims[1] != n_out64 {
        return Err(refuse(
            b,
            format!(
                "dims {:?}: lora_b must be [rank, {n_out}] for a base weight of [{n_in}, \
                 {n_out}] (an adapter for another model?)",
                b.dims
            ),
        ));
    }
    if a.dims[1] != b.dims[0] {
        return Err(refuse(
            b,
            format!(
                "rank {} differs from its lora_a's rank {} (lora_a must be stored transposed, \
                 as [n_in, rank])",
                b.dims[0], a.dims[1]
            ),
        ));
    }
    let rank = a.dims[1];
    let bound = n_in64.min(n_out64).min(MAX_RANK as u64);
    if rank == 0 || rank > bound {
        return Err(refuse(
            a,
            format!("rank {rank} is not between 1 and {bound} (min(n_in, n_out, {MAX_RANK}))"),
        ));
    }
    // The reader already refuses a row that is not whole blocks; checked again here because
    // the reference dequantization requires it.
    for t in [a, b] {
        if t.dims[0] % t.ty.block_elems() as u64 != 0 {
            return Err(refuse(
                t,
                format!(
                    "row length {} is not a multiple of the {:?} block size {}",
                    t.dims[0],
                    t.ty,
                    t.ty.block_elems()
                ),
            ));
        }
    }
    Ok(rank as usize)
}

/// A tensor widened to f32 by the reference dequantization; refused if any value is not
/// finite (which would poison every row the adapter touches).
fn widen(file: &GgufFile, t: &TensorInfo) -> Result<Vec<f32>, LoraError> {
    let values = file.tensor_f32(t);
    match values.iter().position(|v| !v.is_finite()) {
        None => Ok(values),
        Some(i) => Err(LoraError::Tensor {
            name: t.name.clone(),
            reason: format!("value {} at element {i} is not finite", values[i]),
        }),
    }
}

fn target_index(t: Target) -> usize {
    match t {
        Target::Q => 0,
        Target::K => 1,
        Target::V => 2,
        Target::O => 3,
        Target::Gate => 4,
        Target::Up => 5,
        Target::Down => 6,
    }
}

fn check_in_memory(p: &LoraPair, site: Site) -> Result<(), LoraError> {
    let invalid = |reason: String| {
        let at = match site {
            Site::Layer(l, t) => format!("layer {l} {t:?}"),
            Site::Output => "the output projection".into(),
        };
        Err(LoraError::Invalid(format!("pair at {at}: {reason}")))
    };
    if p.rank == 0 || p.rank > MAX_RANK || p.n_in == 0 || p.n_out == 0 {
        return invalid(format!(
            "rank {}, n_in {}, n_out {} (rank 1 to {MAX_RANK}, widths positive)",
            p.rank, p.n_in, p.n_out
        ));
    }
    if Some(p.a.len()) != p.rank.checked_mul(p.n_in) {
        return invalid(format!(
            "a holds {} values, not rank {} x n_in {}",
            p.a.len(),
            p.rank,
            p.n_in
        ));
    }
    if Some(p.b.len()) != p.n_out.checked_mul(p.rank) {
        return invalid(format!(
            "b holds {} values, not n_out {} x rank {}",
            p.b.len(),
            p.n_out,
            p.rank
        ));
    }
    if !p.factor.is_finite() {
        return invalid(format!("factor {} is not finite", p.factor));
    }
    if p.a.iter().chain(&p.b).any(|v| !v.is_finite()) {
        return invalid("a value is not finite".into());
    }
    Ok(())
}

/// Feeds the values' bits to the hash in bounded chunks (the fingerprint must not depend on
/// the platform's byte order).
fn hash_f32(h: &mut Xxh3, values: &[f32]) {
    let mut buf = Vec::with_capacity(4 * 1024);
    for chunk in values.chunks(1024) {
        buf.clear();
        for v in chunk {
            buf.extend_from_slice(&v.to_bits().to_le_bytes());
        }
        h.update(&buf);
    }
}

/// `rows × cols` row-major into `cols × rows` row-major (`lora_b` into the layout the
/// update reads).
pub(crate) fn transpose(m: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut t = vec![0f32; m.len()];
    for r in 0..rows {
        for c in 0..cols {
            t[c * rows + r] = m[r * cols + c];
        }
    }
    t
}
