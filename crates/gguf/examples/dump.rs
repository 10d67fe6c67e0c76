//! Prints a GGUF file's metadata (arrays summarized) and tensor table.
fn main() {
    let path = std::env::args().nth(1).expect("usage: dump FILE.gguf");
    let f = gguf::GgufFile::open(&path).unwrap_or_else(|e| panic!("{e}"));
    let mut keys: Vec<_> = f.metadata().keys().collect();
    keys.sort();
    for k in keys {
        match &f.metadata()[k] {
            gguf::MetaValue::Array(a) => println!("{k}: array[{}] first={:?}", a.len(), a.first()),
            v => println!("{k}: {v:?}"),
        }
    }
    for t in f.tensors() {
        println!("{} {:?} {:?}", t.name, t.dims, t.ty);
    }
}
