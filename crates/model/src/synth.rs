//! Synthetic llama models with deterministic random weights and a byte-level tokenizer,
//! written as real GGUF files so tests exercise the same loader as production.

use gguf::{GgmlType, GgufWriter, MetaValue};

/// Shape and seed of a synthetic model.
#[derive(Debug, Clone)]
pub struct SynthSpec {
    pub layers: usize,
    pub dim: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub ffn_dim: usize,
    pub vocab: usize,
    pub context: usize,
    pub seed: u64,
    pub weight_type: GgmlType,
}

/// Which architecture's metadata and tensors a synthetic file has (the forward pass is
/// chosen by `general.architecture`, as for a real file).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SynthArch {
    /// llama, rope base 10,000, no BOS added (SmolLM-like).
    Llama,
    /// llama with Llama 3's RoPE: base 500,000 and `rope_freqs.weight` frequency factors,
    /// the `llama-bpe` pre-tokenizer, and a BOS (token 0) the prompt must start with.
    Llama3,
    /// qwen2: Q, K and V biases, NeoX rotary halves, rope base 1,000,000.
    Qwen2,
    /// qwen3: per-head Q and K RMSNorm weights, NeoX rotary halves, and heads twice as wide
    /// as `dim / heads` (`attention.key_length`), as Qwen 3's query width exceeds its model
    /// width.
    Qwen3,
    /// gemma3: Qwen 3's head norms and wide heads, post-attention and post-FFN norms,
    /// GeGLU, scaled embeddings, and a sliding window of [`GEMMA3_WINDOW`] positions on
    /// every layer but each second one (`sliding_window_pattern` 2), whose RoPE base is
    /// llama.cpp's default 10,000.
    Gemma3,
}

/// The sliding window of synthetic gemma3 files: short, so that short prompts cross it.
pub const GEMMA3_WINDOW: usize = 8;

impl SynthArch {
    pub const NAMES: &'static str = "llama, llama3, qwen2, qwen3, gemma3";

    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "llama" => Some(SynthArch::Llama),
            "llama3" => Some(SynthArch::Llama3),
            "qwen2" => Some(SynthArch::Qwen2),
            "qwen3" => Some(SynthArch::Qwen3),
            "gemma3" => Some(SynthArch::Gemma3),
            _ => None,
        }
    }

    /// The GGUF `general.architecture` it writes.
    pub fn gguf_name(self) -> &'static str {
        match self {
            SynthArch::Llama | SynthArch::Llama3 => "llama",
            SynthArch::Qwen2 => "qwen2",
            SynthArch::Qwen3 => "qwen3",
            SynthArch::Gemma3 => "gemma3",
        }
    }

    pub fn rope_base(self) -> f32 {
        match self {
            SynthArch::Llama => 10_000.0,
            SynthArch::Llama3 => 500_000.0,
            SynthArch::Qwen2 | SynthArch::Qwen3 | SynthArch::Gemma3 => 1_000_000.0,
        }
    }
}

/// Llama 3.1's frequency factors for `head_dim`-wide heads (factor 8, low/high frequency
/// factors 1 and 4, original context 8192, as Meta's configuration publishes them): pairs
/// whose wavelength is short keep their frequency, long ones are slowed by the factor, and
/// the band between is interpolated smoothly. Stored as the divisor of each pair's angle.
pub fn llama3_rope_factors(head_dim: usize, base: f32) -> Vec<f32> {
    let (factor, low, high, orig) = (8.0f64, 1.0f64, 4.0f64, 8192.0f64);
    let (low_wavelen, high_wavelen) = (orig / low, orig / high);
    (0..head_dim / 2)
        .map(|i| {
            let freq = (base as f64).powf(-2.0 * i as f64 / head_dim as f64);
            let wavelen = 2.0 * std::f64::consts::PI / freq;
            let ff = if wavelen < high_wavelen {
                1.0
            } else if wavelen > low_wavelen {
                factor
            } else {
                let smooth = (orig / wavelen - low) / (high - low);
                1.0 / ((1.0 - smooth) / factor + smooth)
            };
            ff as f32
        })
        .collect()
}

/// Control tokens of the synthetic vocabulary; ids 0, 1, 2 like the default model.
pub const SYNTH_CONTROL: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];
/// Byte `b` is token `BYTE_BASE + b`.
pub const BYTE_BASE: u32 = 3;

const CHATML: &str = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

/// GPT-2's reversible byte-to-character map, so byte tokens are valid vocab strings.
pub fn byte_to_unicode() -> [char; 256] {
    let mut printable: Vec<u32> = (b'!' as u32..=b'~' as u32)
        .chain(0xA1..=0xAC)
        .chain(0xAE..=0xFF)
        .collect();
    let mut map = ['\0'; 256];
    for &b in &printable {
        map[b as usize] = char::from_u32(b).unwrap_or('?');
    }
    let mut extra = 0;
    for b in 0..256u32 {
        if !printable.contains(&b) {
            map[b as usize] = char::from_u32(256 + extra).unwrap_or('?');
            extra += 1;
            printable.push(b);
        }
    }
    map
}

struct Rng(u64);

impl Rng {
    fn uniform(&mut self) -> f32 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
}

impl SynthSpec {
    /// The small model the tests share: 2 layers, width 64, 4 heads over 2 KV heads, a
    /// 300-token vocabulary (the 3 control tokens and the 256 bytes first).
    pub fn small(seed: u64, weight_type: GgmlType, context: usize) -> Self {
        Self {
            layers: 2,
            dim: 64,
            heads: 4,
            kv_heads: 2,
            ffn_dim: 128,
            vocab: 300,
            context,
            seed,
            weight_type,
        }
    }

    /// Writes the model as GGUF bytes and loads it back, as a served file would be.
    pub fn load(&self) -> Result<crate::Model, String> {
        let file = gguf::GgufFile::parse(self.build()?.to_bytes()).map_err(|e| e.to_string())?;
        crate::Model::load(&file).map_err(|e| e.to_string())
    }

    pub fn validate(&self) -> Result<(), String> {
        if self.layers == 0 || self.heads == 0 || self.kv_heads == 0 || self.context == 0 {
            return Err("layers, heads, kv-heads and context must be positive".into());
        }
        if !self.dim.is_multiple_of(self.heads) || !self.heads.is_multiple_of(self.kv_heads) {
            return Err(format!(
                "heads ({}) must divide dim ({}) and kv-heads ({}) must divide heads",
                self.heads, self.dim, self.kv_heads
            ));
        }
        if !(self.dim / self.heads).is_multiple_of(2) {
            return Err("head dimension must be even (rotary pairs)".into());
        }
        if !self.dim.is_multiple_of(32)
            || !self.ffn_dim.is_multiple_of(32)
            || !(self.dim / self.heads * self.kv_heads).is_multiple_of(32)
        {
            return Err("dim, ffn dim and kv dim must be multiples of 32".into());
        }
        if self.vocab < 256 + BYTE_BASE as usize {
            return Err(format!("vocab must be at least {}", 256 + BYTE_BASE));
        }
        Ok(())
    }

    /// Width of one attention head of `arch`'s file.
    pub fn head_dim(&self, arch: SynthArch) -> usize {
        match arch {
            SynthArch::Qwen3 | SynthArch::Gemma3 => 2 * self.dim / self.heads,
            _ => self.dim / self.heads,
        }
    }

    /// Builds the GGUF file of a llama model (as SmolLM's).
    pub fn build(&self) -> Result<GgufWriter, String> {
        self.build_arch(SynthArch::Llama)
    }

    /// Builds the GGUF file with `arch`'s metadata and tensors.
    pub fn build_arch(&self, arch: SynthArch) -> Result<GgufWriter, String> {
        self.validate()?;
        let hd = self.head_dim(arch);
        if !(hd * self.heads).is_multiple_of(32) || !(hd * self.kv_heads).is_multiple_of(32) {
            return Err("query and kv widths must be multiples of 32".into());
        }
        let block = self.weight_type.block_elems();
        if [self.dim, hd * self.heads, self.ffn_dim]
            .iter()
            .any(|c| !c.is_multiple_of(block))
        {
            return Err(format!(
                "{:?} weights need dim, query width and ffn dim to be multiples of {block}",
                self.weight_type
            ));
        }
        let mut w = GgufWriter::new();
        let s = |v: &str| MetaValue::String(v.to_string());
        let u = |v: usize| MetaValue::U32(v as u32);
        let a = arch.gguf_name();
        let k = |key: &str| format!("{a}.{key}");
        w.meta("general.architecture", s(a));
        w.meta("general.name", s("kvwarden-synthetic"));
        w.meta(&k("block_count"), u(self.layers));
        w.meta(&k("embedding_length"), u(self.dim));
        w.meta(&k("attention.head_count"), u(self.heads));
        w.meta(&k("attention.head_count_kv"), u(self.kv_heads));
        w.meta(&k("feed_forward_length"), u(self.ffn_dim));
        w.meta(&k("context_length"), u(self.context));
        w.meta(&k("rope.dimension_count"), u(hd));
        w.meta(&k("rope.freq_base"), MetaValue::F32(arch.rope_base()));
        w.meta(&k("attention.layer_norm_rms_epsilon"), MetaValue::F32(1e-5));
        w.meta(&k("vocab_size"), u(self.vocab));
        if matches!(arch, SynthArch::Qwen3 | SynthArch::Gemma3) {
            w.meta(&k("attention.key_length"), u(hd));
            w.meta(&k("attention.value_length"), u(hd));
        }
        if arch == SynthArch::Gemma3 {
            w.meta(&k("attention.sliding_window"), u(GEMMA3_WINDOW));
            w.meta(&k("attention.sliding_window_pattern"), u(2));
        }

        let bytes = byte_to_unicode();
        let mut tokens = Vec::with_capacity(self.vocab);
        let mut types = Vec::with_capacity(self.vocab);
        for c in SYNTH_CONTROL {
            tokens.push(s(c));
            types.push(MetaValue::I32(3));
        }
        for ch in bytes {
            tokens.push(MetaValue::String(ch.to_string()));
            types.push(MetaValue::I32(1));
        }
        for i in tokens.len()..self.vocab {
            tokens.push(MetaValue::String(format!("<|unused_{i}|>")));
            types.push(MetaValue::I32(5));
        }
        let pre = match arch {
            SynthArch::Llama => "smollm",
            SynthArch::Llama3 => "llama-bpe",
            SynthArch::Qwen2 | SynthArch::Qwen3 | SynthArch::Gemma3 => "qwen2",
        };
        w.meta("tokenizer.ggml.model", s("gpt2"));
        w.meta("tokenizer.ggml.pre", s(pre));
        w.meta("tokenizer.ggml.tokens", MetaValue::Array(tokens));
        w.meta("tokenizer.ggml.token_type", MetaValue::Array(types));
        w.meta("tokenizer.ggml.merges", MetaValue::Array(Vec::new()));
        // Llama 3's files ask for a BOS (`<|begin_of_text|>`) before every prompt; here it
        // is token 0, which the ChatML template never renders, so the server must add it.
        let add_bos = arch == SynthArch::Llama3;
        w.meta(
            "tokenizer.ggml.bos_token_id",
            u(if add_bos { 0 } else { 1 }),
        );
        w.meta("tokenizer.ggml.eos_token_id", u(2));
        w.meta("tokenizer.ggml.add_bos_token", MetaValue::Bool(add_bos));
        w.meta("tokenizer.chat_template", s(CHATML));

        let mut rng = Rng(self.seed ^ 0x5EED_0FC0_FFEE);
        let mut matrix =
            |w: &mut GgufWriter, name: &str, rows: usize, cols: usize, ty: GgmlType| {
                let scale = 1.0 / (cols as f32).sqrt();
                let vals: Vec<f32> = (0..rows * cols)
                    .map(|_| rng.uniform() * scale * 1.7)
                    .collect();
                w.tensor_f32(name, &[cols as u64, rows as u64], ty, &vals);
            };
        // Biases and norm weights come from their own stream, so the matrices of a seed are
        // the same in every architecture.
        let mut extra = Rng(self.seed ^ 0xB1A5_0F0F);
        let kv_dim = hd * self.kv_heads;
        let q_dim = hd * self.heads;
        let ty = self.weight_type;
        matrix(
            &mut w,
            "token_embd.weight",
            self.vocab,
            self.dim,
            GgmlType::Q8_0,
        );
        for l in 0..self.layers {
            let p = |n: &str| format!("blk.{l}.{n}.weight");
            let ones = vec![1.0f32; self.dim];
            w.tensor_f32(&p("attn_norm"), &[self.dim as u64], GgmlType::F32, &ones);
            w.tensor_f32(&p("ffn_norm"), &[self.dim as u64], GgmlType::F32, &ones);
            matrix(&mut w, &p("attn_q"), q_dim, self.dim, ty);
            matrix(&mut w, &p("attn_k"), kv_dim, self.dim, ty);
            matrix(&mut w, &p("attn_v"), kv_dim, self.dim, ty);
            matrix(&mut w, &p("attn_output"), self.dim, q_dim, ty);
            if arch == SynthArch::Qwen2 {
                for (n, len) in [("attn_q", q_dim), ("attn_k", kv_dim), ("attn_v", kv_dim)] {
                    let bias: Vec<f32> = (0..len).map(|_| extra.uniform() * 0.5).collect();
                    let name = format!("blk.{l}.{n}.bias");
                    w.tensor_f32(&name, &[len as u64], GgmlType::F32, &bias);
                }
            }
            if matches!(arch, SynthArch::Qwen3 | SynthArch::Gemma3) {
                for n in ["attn_q_norm", "attn_k_norm"] {
                    // Around 1, varied so that a norm applied to the wrong axis shows.
                    let g: Vec<f32> = (0..hd).map(|_| 1.0 + extra.uniform() * 0.4).collect();
                    w.tensor_f32(&p(n), &[hd as u64], GgmlType::F32, &g);
                }
            }
            if arch == SynthArch::Gemma3 {
                for n in ["post_attention_norm", "post_ffw_norm"] {
                    let g: Vec<f32> = (0..self.dim).map(|_| 1.0 + extra.uniform() * 0.4).collect();
                    w.tensor_f32(&p(n), &[self.dim as u64], GgmlType::F32, &g);
                }
            }
            matrix(&mut w, &p("ffn_gate"), self.ffn_dim, self.dim, ty);
            matrix(&mut w, &p("ffn_up"), self.ffn_dim, self.dim, ty);
            matrix(&mut w, &p("ffn_down"), self.dim, self.ffn_dim, ty);
        }
        w.tensor_f32(
            "output_norm.weight",
            &[self.dim as u64],
            GgmlType::F32,
            &vec![1.0f32; self.dim],
        );
        if arch == SynthArch::Llama3 {
            let f = llama3_rope_factors(hd, arch.rope_base());
            w.tensor_f32("rope_freqs.weight", &[f.len() as u64], GgmlType::F32, &f);
        }
        Ok(w)
    }
}
