//! The memory under one page: an anonymous mapping of its own, asked for 2 MiB pages.
//!
//! Why not a `Box` per page: a pool is gigabytes, written once at start so that a pool the
//! machine cannot hold fails there and not under load. On 4 KiB pages that is one fault per
//! 4 KiB (0.48 s of a 0.54 s start for a 1 GiB pool on a 2-core Xeon), and every page walk
//! of attention crosses a TLB entry per 4 KiB. A page of the pool is smaller than 2 MiB, so
//! its mapping alone could never hold a huge page; but the kernel places consecutive
//! anonymous mappings side by side and merges neighbours of equal flags into one region,
//! whose aligned 2 MiB spans can then be backed by huge pages. So a pool maps and advises
//! every page first and commits (touches) them only afterwards ([`PageMemory::commit`]).
//! Each page keeps its own mapping and owner: the merge is the kernel's bookkeeping, not
//! shared ownership, and unmapping one page splits the region again.
//!
//! Nothing here depends on the merge or on huge pages being granted: without them the pages
//! are ordinary ones, and where a mapping is refused (say, the process's map count is
//! reached) the page falls back to the heap. The values are the same bytes either way.

use std::hint::black_box;
use std::ops::{Deref, DerefMut};

use bytemuck::Pod;

/// Bytes between two touches in [`PageMemory::commit`]: the smallest page size of the
/// systems served.
const COMMIT_STRIDE: usize = 4096;

/// `len` values of `T`, all bytes zero until written.
pub(crate) struct PageMemory<T: Pod> {
    backing: Backing<T>,
}

enum Backing<T> {
    Mapped(memmap2::MmapMut),
    Heap(Box<[T]>),
}

impl<T: Pod> PageMemory<T> {
    /// `len` values, all-zero bytes, not yet committed: the system may not have backed them.
    pub(crate) fn zeroed_uncommitted(len: usize) -> Self {
        let bytes = len * size_of::<T>();
        let backing = match bytes {
            0 => Backing::Heap(Box::default()),
            _ => match memmap2::MmapMut::map_anon(bytes) {
                Ok(map) => {
                    // Advice only: refused (no transparent huge pages), the pages are
                    // ordinary ones.
                    #[cfg(target_os = "linux")]
                    let _ = map.advise(memmap2::Advice::HugePage);
                    Backing::Mapped(map)
                }
                Err(_) => Backing::Heap(bytemuck::zeroed_slice_box(len)),
            },
        };
        PageMemory { backing }
    }

    /// Makes the system back every byte now (a write per 4 KiB, of the zero already there),
    /// so that memory the machine lacks fails here rather than at a later first write.
    pub(crate) fn commit(&mut self) {
        let bytes: &mut [u8] = match &mut self.backing {
            Backing::Mapped(map) => map,
            Backing::Heap(values) => bytemuck::cast_slice_mut(values),
        };
        for at in (0..bytes.len()).step_by(COMMIT_STRIDE) {
            // Through `black_box`, so the store of a zero into memory the compiler may know
            // to be zero (a zeroed allocation) is not elided.
            bytes[at] = black_box(0);
        }
    }
}

impl<T: Pod> Deref for PageMemory<T> {
    type Target = [T];

    fn deref(&self) -> &[T] {
        match &self.backing {
            // A mapping starts on a system page boundary, so it is aligned for any `T`, and
            // its length is a whole number of `T`: the cast cannot fail.
            Backing::Mapped(map) => bytemuck::cast_slice(map),
            Backing::Heap(values) => values,
        }
    }
}

impl<T: Pod> DerefMut for PageMemory<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        match &mut self.backing {
            Backing::Mapped(map) => bytemuck::cast_slice_mut(map),
            Backing::Heap(values) => values,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::PageMemory;
    use half::f16;

    /// Empty, under a system page, ragged, and past two huge pages: zero, writable, its own
    /// length, before and after committing, and pages never share bytes.
    #[test]
    fn page_memory_is_zeroed_private_and_its_own_length() {
        for len in [0, 1, 2047, 2049, (5 << 20) / 2 + 77] {
            let mut pages: Vec<PageMemory<f16>> = (0..3)
                .map(|_| PageMemory::zeroed_uncommitted(len))
                .collect();
            for page in &mut pages {
                assert_eq!(page.len(), len);
                assert!(
                    page.iter().all(|&x| x == f16::ZERO),
                    "{len} values not zero"
                );
                page.commit();
                assert!(page.iter().all(|&x| x == f16::ZERO), "commit wrote {len}");
            }
            for (p, page) in pages.iter_mut().enumerate() {
                for (i, x) in page.iter_mut().enumerate() {
                    *x = f16::from_f32((p * 1000 + i % 251) as f32);
                }
            }
            for (p, page) in pages.iter().enumerate() {
                let want = |i: usize| f16::from_f32((p * 1000 + i % 251) as f32);
                assert!(
                    page.iter().enumerate().all(|(i, &x)| x == want(i)),
                    "page {p}"
                );
            }
        }
    }
}
