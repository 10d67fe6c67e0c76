//! Memory for weights built at load (repacked tiles): anonymous memory the kernel is asked
//! to back with 2 MiB pages where it can (`MADV_HUGEPAGE`; with transparent huge pages in
//! `madvise` mode, the common default, nothing else gets them). A product walks hundreds of
//! megabytes of weights: on 4 KiB pages every 4 KiB is a TLB entry and a stop for the
//! hardware prefetcher, and the load itself faults once per page.

use std::ops::{Deref, DerefMut};

/// Zeroed bytes, on huge pages where the system grants them, else on ordinary ones.
pub(crate) enum LoadBuffer {
    Mapped(memmap2::MmapMut),
    Heap(Vec<u8>),
}

impl LoadBuffer {
    pub(crate) fn zeroed(len: usize) -> Self {
        if len == 0 {
            return LoadBuffer::Heap(Vec::new());
        }
        match memmap2::MmapMut::map_anon(len) {
            Ok(map) => {
                // Advice only: refused (no THP in this kernel), the pages are ordinary ones.
                #[cfg(target_os = "linux")]
                let _ = map.advise(memmap2::Advice::HugePage);
                LoadBuffer::Mapped(map)
            }
            Err(_) => LoadBuffer::Heap(vec![0u8; len]),
        }
    }
}

impl Deref for LoadBuffer {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        match self {
            LoadBuffer::Mapped(m) => m,
            LoadBuffer::Heap(v) => v,
        }
    }
}

impl DerefMut for LoadBuffer {
    fn deref_mut(&mut self) -> &mut [u8] {
        match self {
            LoadBuffer::Mapped(m) => m,
            LoadBuffer::Heap(v) => v,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::LoadBuffer;

    #[test]
    fn a_load_buffer_is_zeroed_writable_and_its_own_length() {
        // Empty, under a page, and past two huge pages with a ragged end.
        for len in [0, 1, 4095, (5 << 20) + 77] {
            let mut b = LoadBuffer::zeroed(len);
            assert_eq!(b.len(), len);
            assert!(b.iter().all(|&x| x == 0), "{len} bytes not zeroed");
            for (i, x) in b.iter_mut().enumerate() {
                *x = (i % 251) as u8;
            }
            assert!(b.iter().enumerate().all(|(i, &x)| x == (i % 251) as u8));
        }
    }
}
