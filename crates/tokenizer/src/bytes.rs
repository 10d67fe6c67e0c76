//! GPT-2's reversible byte <-> printable-character mapping (`bytes_to_unicode`).
//!
//! Byte-level BPE vocabularies store every token as a string of these stand-in characters
//! so that whitespace and control bytes survive JSON/GGUF round trips; encoding maps input
//! bytes to them and decoding maps them back.

/// All stand-in characters are below this code point.
const SPAN: usize = 0x144;

fn is_printable(b: u32) -> bool {
    matches!(b, 0x21..=0x7E | 0xA1..=0xAC | 0xAE..=0xFF)
}

pub(crate) struct ByteMap {
    to_char: [char; 256],
    from_char: [Option<u8>; SPAN],
}

impl ByteMap {
    pub(crate) fn new() -> Self {
        let mut to_char = ['\0'; 256];
        let mut from_char = [None; SPAN];
        let mut next_extra = 256u32;
        for b in 0u8..=255 {
            let cp = if is_printable(u32::from(b)) {
                u32::from(b)
            } else {
                // Non-printable bytes are shifted past 255 in byte order, as GPT-2 does.
                next_extra += 1;
                next_extra - 1
            };
            // Every value here is below SPAN, far from the surrogate range.
            let c = char::from_u32(cp).unwrap_or('\u{FFFD}');
            to_char[usize::from(b)] = c;
            if let Some(slot) = from_char.get_mut(cp as usize) {
                *slot = Some(b);
            }
        }
        ByteMap { to_char, from_char }
    }

    pub(crate) fn char_of(&self, b: u8) -> char {
        self.to_char[usize::from(b)]
    }

    /// The byte a stand-in character encodes, `None` for characters outside the mapping.
    pub(crate) fn byte_of(&self, c: char) -> Option<u8> {
        self.from_char.get(c as usize).copied().flatten()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mapping_is_a_bijection() {
        let map = ByteMap::new();
        let mut seen = std::collections::HashSet::new();
        for b in 0u8..=255 {
            let c = map.char_of(b);
            assert!(seen.insert(c), "duplicate stand-in for byte {b}");
            assert_eq!(map.byte_of(c), Some(b));
        }
        assert_eq!(map.char_of(b' '), 'Ġ');
        assert_eq!(map.char_of(b'\n'), 'Ċ');
        assert_eq!(map.char_of(b'\t'), 'ĉ');
        assert_eq!(map.char_of(b'a'), 'a');
        assert_eq!(map.byte_of('\u{144}'), None);
        assert_eq!(map.byte_of(' '), None);
        assert_eq!(map.byte_of('日'), None);
    }
}
