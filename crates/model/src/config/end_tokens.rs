//! The tokens that end a generation: llama.cpp's end-of-generation set (`llama_vocab`'s
//! `special_eog_ids`), so an answer ends where llama.cpp's would. A file names only one
//! end-of-sequence token, but chat models end their turns with another (Gemma 3's
//! `<end_of_turn>`, while its EOS is `<eos>`; Llama 3.1's `<|eom_id|>` after a tool call),
//! and llama.cpp finds those by their text.

use gguf::GgufFile;

/// Texts of tokens that end a generation, as llama.cpp 0.3.36 lists them.
const END_TEXTS: [&str; 20] = [
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<｜end▁of▁sentence｜>",
];

/// Texts of fill-in-the-middle padding, repository and file-separator tokens, which also
/// end a generation in llama.cpp (a code model's completion stops at the next file).
const FIM_TEXTS: [&str; 11] = [
    "<|fim_pad|>",
    "<fim-pad>",
    "<fim_pad>",
    "<PAD>",
    "[PAD]",
    "<|fim_repo|>",
    "<|repo_name|>",
    "<fim-repo>",
    "<REPO>",
    "<reponame>",
    "<|file_sep|>",
];

/// The ids the file names for these roles.
const END_KEYS: [&str; 6] = [
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.eot_token_id",
    "tokenizer.ggml.eom_token_id",
    "tokenizer.ggml.fim_pad_token_id",
    "tokenizer.ggml.fim_rep_token_id",
    "tokenizer.ggml.fim_sep_token_id",
];

/// The end-of-generation tokens of `f`'s vocabulary (below `vocab_size`), sorted.
pub(super) fn end_tokens(f: &GgufFile, vocab_size: usize) -> Vec<u32> {
    let mut ids: Vec<u32> = END_KEYS
        .iter()
        .filter_map(|key| f.get(key).and_then(|v| v.as_u64()))
        .filter_map(|id| u32::try_from(id).ok())
        .collect();
    let texts: Vec<&str> = match f.get_array("tokenizer.ggml.tokens") {
        Ok(tokens) => tokens.iter().map(|t| t.as_str().unwrap_or("")).collect(),
        Err(_) => Vec::new(),
    };
    let id_of = |text: &str| texts.iter().position(|t| *t == text);
    for (id, text) in texts.iter().enumerate() {
        if END_TEXTS.contains(text) || FIM_TEXTS.contains(text) {
            ids.push(id as u32);
        }
    }
    // llama.cpp's exceptions: where `<|return|>` and `<|call|>` (or `<|calls|>` and
    // `<|flush|>`) exist, `<|end|>` only ends a message; where `<|tool_response>` or
    // `<|plamo:eos|>` exist, `</s>` is a normal token.
    let has = |text: &str| id_of(text).is_some_and(|id| ids.contains(&(id as u32)));
    let harmony = has("<|return|>") && has("<|call|>") || has("<|calls|>") && has("<|flush|>");
    let mut exceptions = Vec::new();
    if harmony {
        exceptions.extend(id_of("<|end|>"));
    }
    if id_of("<|tool_response>").is_some() || id_of("<|plamo:eos|>").is_some() {
        exceptions.extend(id_of("</s>"));
    }
    ids.retain(|&id| (id as usize) < vocab_size && !exceptions.contains(&(id as usize)));
    ids.sort_unstable();
    ids.dedup();
    ids
}

#[cfg(test)]
mod tests {
    use super::*;
    use gguf::{GgufWriter, MetaValue};

    fn file(tokens: &[&str], meta: &[(&str, u32)]) -> GgufFile {
        let mut w = GgufWriter::new();
        let list = tokens
            .iter()
            .map(|t| MetaValue::String((*t).to_owned()))
            .collect();
        w.meta("tokenizer.ggml.tokens", MetaValue::Array(list));
        for (k, v) in meta {
            w.meta(k, MetaValue::U32(*v));
        }
        GgufFile::parse(w.to_bytes()).unwrap()
    }

    #[test]
    fn ends_are_the_named_ids_and_llama_cpps_texts() {
        // Gemma 3: EOS is <eos>, turns end with <end_of_turn>.
        let gemma = file(
            &[
                "<pad>",
                "<eos>",
                "<bos>",
                "<start_of_turn>",
                "<end_of_turn>",
                "a",
            ],
            &[("tokenizer.ggml.eos_token_id", 1)],
        );
        assert_eq!(end_tokens(&gemma, 6), vec![1, 4]);
        // Llama 3.1: <|eot_id|> the EOS, <|eom_id|> after a tool call, <|end_of_text|>.
        let llama = file(
            &[
                "<|begin_of_text|>",
                "<|end_of_text|>",
                "<|eom_id|>",
                "<|eot_id|>",
                "x",
            ],
            &[("tokenizer.ggml.eos_token_id", 3)],
        );
        assert_eq!(end_tokens(&llama, 5), vec![1, 2, 3]);
        // An id past the vocabulary is not a token.
        let far = file(&["a", "b"], &[("tokenizer.ggml.eot_token_id", 9)]);
        assert_eq!(end_tokens(&far, 2), Vec::<u32>::new());
        // Qwen's code tokens end a completion too; ordinary text does not.
        let qwen = file(&["<|endoftext|>", "<|im_end|>", "<|file_sep|>", "end"], &[]);
        assert_eq!(end_tokens(&qwen, 4), vec![0, 1, 2]);
    }

    #[test]
    fn llama_cpps_exceptions_hold() {
        let harmony = file(&["<|return|>", "<|call|>", "<|end|>"], &[]);
        assert_eq!(end_tokens(&harmony, 3), vec![0, 1]);
        let plain_end = file(&["<|end|>"], &[]);
        assert_eq!(end_tokens(&plain_end, 1), vec![0]);
        let s_normal = file(&["</s>", "<|tool_response>"], &[]);
        assert_eq!(end_tokens(&s_normal, 2), Vec::<u32>::new());
    }
}
