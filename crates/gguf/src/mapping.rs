//! A model file mapped into memory, read-only: the one place outside the SIMD kernels with
//! `unsafe` code (the mapping itself).
//!
//! Weights used as they lie in the file are read from the mapping: no copy at start, the
//! page cache shared by every process serving the same file, and pages the kernel can drop
//! and read back under memory pressure. llama.cpp maps its files the same way by default.

use std::fs::File;
use std::path::Path;

/// The whole file, mapped read-only and private.
pub(crate) struct Mapping(memmap2::Mmap);

impl Mapping {
    /// Pages are read when first touched: the weights used in place are touched once at
    /// load (`TensorData::prefault`), so a server's first request does not wait for page
    /// faults, and the ones widened into memory are read once and released, so they are
    /// never resident twice.
    pub(crate) fn open(path: &Path) -> std::io::Result<Self> {
        let file = File::open(path)?;
        // SAFETY: memmap2's one requirement is that the mapped bytes not change while they
        // are borrowed. The file is opened read-only and the mapping is private (no write
        // through it reaches the file, and no write of ours is possible: `Mmap` only
        // derefs to `&[u8]`). Another process that truncates or rewrites a model file while
        // it is served breaks that requirement (a truncation is SIGBUS on the next read), as
        // it would for llama.cpp's mapping: the README says to replace a served file by
        // renaming a new one over it (which leaves this inode, and so these bytes, intact),
        // never by writing into it, and `--no-mmap` reads the file into memory instead.
        let map = unsafe { memmap2::MmapOptions::new().map_copy_read_only(&file)? };
        Ok(Mapping(map))
    }
}

impl Mapping {
    /// Drops the whole pages inside `[start, start + len)` from this process's memory.
    pub(crate) fn release(&self, start: usize, len: usize) {
        let page = 4096;
        let first = start.div_ceil(page) * page;
        let end = (start + len) / page * page;
        if end <= first || end > self.0.len() {
            return;
        }
        // SAFETY: MADV_DONTNEED on a private mapping discards the process's copies of
        // those pages; this mapping is never written, so no private copy exists and the
        // next read of any byte there reads the file again: every `&[u8]` borrowed from the
        // mapping keeps its contents. The range lies inside the mapping (checked above).
        // A refusal only leaves the pages resident, so its error is not a failure.
        let _ = unsafe {
            self.0
                .unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, first, end - first)
        };
    }
}

impl std::ops::Deref for Mapping {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        &self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mapped_file_reads_as_its_bytes() {
        let dir = std::env::temp_dir().join(format!("gguf-mapping-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("bytes.bin");
        let bytes: Vec<u8> = (0..100_003u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
            .collect();
        std::fs::write(&path, &bytes).unwrap();
        let map = Mapping::open(&path).unwrap();
        assert_eq!(&map[..], &bytes[..]);
        // Released pages read back as the file's bytes.
        map.release(5_000, 60_000);
        map.release(0, map.len());
        assert_eq!(&map[..], &bytes[..]);
        // Renaming a new file over the path, as the README says to replace a served
        // model, leaves the mapped bytes as they were.
        let next = dir.join("next.bin");
        std::fs::write(&next, vec![0u8; 10]).unwrap();
        std::fs::rename(&next, &path).unwrap();
        assert_eq!(&map[..], &bytes[..]);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_missing_file_is_an_error_not_a_mapping() {
        assert!(Mapping::open(Path::new("/nonexistent/model.gguf")).is_err());
    }
}
