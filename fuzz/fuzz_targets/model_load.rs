//! A whole load of a small synthetic model (reader, weights, vocabulary, chat template)
//! from a mutated copy of its file. The input is a list of edits: each 5 bytes are an
//! offset (u32, little-endian, modulo the file's length) and a byte XORed there; a
//! leftover byte, if any, truncates the file to that fraction of its length.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut bytes = kvwarden_fuzz::small_model_bytes().to_vec();
    let mut edits = data.chunks_exact(5);
    for e in &mut edits {
        let at = u32::from_le_bytes([e[0], e[1], e[2], e[3]]) as usize % bytes.len();
        bytes[at] ^= e[4];
    }
    if let [cut] = edits.remainder() {
        bytes.truncate(bytes.len() * usize::from(*cut) / 256);
    }
    let Ok(file) = gguf::GgufFile::parse(bytes) else {
        return;
    };
    let _ = model::Model::load(&file);
    if let Ok(tok) = tokenizer::Tokenizer::from_gguf(&file) {
        let ids = tok.encode("Hello <|im_start|> wörld\u{0}");
        let _ = tok.decode(&ids);
        if let Ok(Some(t)) = tok.compile_chat_template() {
            let _ = t.render(&[tokenizer::ChatMessage::new("user", "hi")], true);
        }
    }
});
