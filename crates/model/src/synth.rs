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

    /// Builds the GGUF file.
    pub fn build(&self) -> Result<GgufWriter, String> {
        self.validate()?;
        let mut w = GgufWriter::new();
        let s = |v: &str| MetaValue::String(v.to_string());
        let u = |v: usize| MetaValue::U32(v as u32);
        w.meta("general.architecture", s("llama"));
        w.meta("general.name", s("kvwarden-synthetic"));
        w.meta("llama.block_count", u(self.layers));
        w.meta("llama.embedding_length", u(self.dim));
        w.meta("llama.attention.head_count", u(self.heads));
        w.meta("llama.attention.head_count_kv", u(self.kv_heads));
        w.meta("llama.feed_forward_length", u(self.ffn_dim));
        w.meta("llama.context_length", u(self.context));
        w.meta("llama.rope.dimension_count", u(self.dim / self.heads));
        w.meta("llama.rope.freq_base", MetaValue::F32(10000.0));
        w.meta(
            "llama.attention.layer_norm_rms_epsilon",
            MetaValue::F32(1e-5),
        );
        w.meta("llama.vocab_size", u(self.vocab));

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
        w.meta("tokenizer.ggml.model", s("gpt2"));
        w.meta("tokenizer.ggml.pre", s("smollm"));
        w.meta("tokenizer.ggml.tokens", MetaValue::Array(tokens));
        w.meta("tokenizer.ggml.token_type", MetaValue::Array(types));
        w.meta("tokenizer.ggml.merges", MetaValue::Array(Vec::new()));
        w.meta("tokenizer.ggml.bos_token_id", u(1));
        w.meta("tokenizer.ggml.eos_token_id", u(2));
        w.meta("tokenizer.ggml.add_bos_token", MetaValue::Bool(false));
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
        let kv_dim = self.dim / self.heads * self.kv_heads;
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
            matrix(&mut w, &p("attn_q"), self.dim, self.dim, ty);
            matrix(&mut w, &p("attn_k"), kv_dim, self.dim, ty);
            matrix(&mut w, &p("attn_v"), kv_dim, self.dim, ty);
            matrix(&mut w, &p("attn_output"), self.dim, self.dim, ty);
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
        Ok(w)
    }
}
