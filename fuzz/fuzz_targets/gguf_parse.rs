//! `GgufFile::parse` on arbitrary bytes: header, metadata and tensor table. Whatever it
//! accepts must be safe to use: every tensor's bytes lie inside the file.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(file) = gguf::GgufFile::parse(data.to_vec()) else {
        return;
    };
    for (key, _) in file.metadata() {
        let _ = file.get_u64(key);
        let _ = file.get_str(key);
        let _ = file.get_array(key);
    }
    for info in file.tensors() {
        let bytes = file.tensor_bytes(info);
        // Cheap enough only for small tensors; the size check itself is the point.
        if bytes.len() <= 1 << 16 {
            let _ = file.tensor_f32(info);
        }
    }
});
