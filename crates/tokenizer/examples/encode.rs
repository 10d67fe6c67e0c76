//! Prints the tokens of each argument: `encode MODEL.gguf TEXT...`.
fn main() {
    let mut args = std::env::args().skip(1);
    let path = args.next().expect("usage: encode MODEL.gguf TEXT...");
    let file = gguf::GgufFile::open(&path).unwrap_or_else(|e| panic!("{e}"));
    let tok = tokenizer::Tokenizer::from_gguf(&file).unwrap_or_else(|e| panic!("{e}"));
    for text in args {
        let ids = tok.encode(&text);
        let pieces: Vec<&str> = ids
            .iter()
            .map(|&i| tok.token_text(i).unwrap_or("?"))
            .collect();
        println!("{text:?} -> {ids:?} {pieces:?}");
    }
}
