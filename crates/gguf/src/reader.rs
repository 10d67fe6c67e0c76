use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use crate::mapping::Mapping;
use crate::{GgmlType, GgufError, MetaValue, Result};

const MAGIC: u32 = 0x4655_4747; // "GGUF" read as little-endian u32
const MAX_DIMS: u32 = 4;
const MAX_ARRAY_DEPTH: u32 = 2;

/// A tensor's place in the file, validated against the file's size.
#[derive(Debug, Clone)]
pub struct TensorInfo {
    pub name: String,
    /// ggml order: `dims[0]` is the row length (the innermost, contiguous dimension).
    pub dims: Vec<u64>,
    pub ty: GgmlType,
    /// Absolute byte range of the data in the file.
    pub start: usize,
    pub len: usize,
}

impl TensorInfo {
    pub fn elements(&self) -> u64 {
        self.dims.iter().product()
    }
}

/// A file's bytes: read into memory, or mapped (see `mapping`).
enum FileBytes {
    Read(Vec<u8>),
    Mapped(Mapping),
}

impl std::ops::Deref for FileBytes {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        match self {
            FileBytes::Read(v) => v,
            FileBytes::Mapped(m) => m,
        }
    }
}

/// How [`GgufFile::open_with`] brings a file's bytes into memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Load {
    /// Mapped read-only (the default): no copy, the page cache shared between processes,
    /// and a process that reads only the metadata (the router) reads only those pages.
    Map,
    /// Read into memory the process owns (`--no-mmap`).
    Read,
}

/// One tensor's bytes, which can outlive the [`GgufFile`] they came from: a mapped file's
/// weights are used where they lie, so the matrices hold the mapping.
#[derive(Clone)]
pub struct TensorData {
    file: Arc<FileBytes>,
    start: usize,
    len: usize,
}

impl TensorData {
    /// Bytes of no file (tests, and matrices made in memory).
    pub fn from_vec(bytes: Vec<u8>) -> Self {
        let len = bytes.len();
        TensorData {
            file: Arc::new(FileBytes::Read(bytes)),
            start: 0,
            len,
        }
    }

    pub fn bytes(&self) -> &[u8] {
        &self.file[self.start..self.start + self.len]
    }

    /// Reads one byte of every page of a mapped tensor, so its pages are in this process's
    /// page tables before the first request needs them. Nothing for bytes read into memory.
    pub fn prefault(&self) {
        if self.is_mapped() {
            let touched = self.bytes().iter().step_by(4096).fold(0u8, |a, &b| a ^ b);
            std::hint::black_box(touched);
        }
    }

    /// Tells the kernel a mapped tensor's pages are not needed again (its weights were
    /// copied into another form): they leave this process's resident memory, and a later
    /// read would fetch them from the file again. Nothing for bytes read into memory.
    pub fn release(&self) {
        self.release_part(0, self.len);
    }

    /// [`Self::release`] for the bytes `[offset, offset + len)` of this tensor only.
    pub fn release_part(&self, offset: usize, len: usize) {
        if let FileBytes::Mapped(m) = &*self.file {
            let len = len.min(self.len.saturating_sub(offset));
            m.release(self.start + offset.min(self.len), len);
        }
    }

    /// Whether the bytes are the file's mapping (holding them holds no memory of its own).
    pub fn is_mapped(&self) -> bool {
        matches!(*self.file, FileBytes::Mapped(_))
    }
}

impl std::fmt::Debug for TensorData {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TensorData")
            .field("start", &self.start)
            .field("len", &self.len)
            .field("mapped", &self.is_mapped())
            .finish()
    }
}

/// A parsed GGUF file, mapped or held in memory.
pub struct GgufFile {
    pub version: u32,
    metadata: HashMap<String, MetaValue>,
    tensors: Vec<TensorInfo>,
    by_name: HashMap<String, usize>,
    bytes: Arc<FileBytes>,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("version", &self.version)
            .field("metadata_keys", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .field("bytes", &self.bytes.len())
            .finish()
    }
}

struct Cursor<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: u64) -> Result<&'a [u8]> {
        let remaining = (self.bytes.len() - self.pos) as u64;
        if n > remaining {
            return Err(GgufError::Truncated {
                offset: self.pos as u64,
                needed: n,
                len: self.bytes.len() as u64,
            });
        }
        let n = n as usize;
        let s = &self.bytes[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn remaining(&self) -> u64 {
        (self.bytes.len() - self.pos) as u64
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N]> {
        let s = self.take(N as u64)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    fn string(&mut self) -> Result<String> {
        let at = self.pos as u64;
        let len = self.u64()?;
        let bytes = self.take(len)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| GgufError::BadUtf8(at))
    }

    /// A count of items that each occupy at least `min_item_bytes`: rejected before any
    /// allocation if the rest of the file could not possibly hold them.
    fn count(&mut self, what: &'static str, min_item_bytes: u64) -> Result<u64> {
        let n = self.u64()?;
        let limit = self.remaining() / min_item_bytes.max(1);
        if n > limit {
            return Err(GgufError::Implausible {
                what,
                value: n,
                limit,
            });
        }
        Ok(n)
    }

    fn value(&mut self, ty: u32, depth: u32) -> Result<MetaValue> {
        Ok(match ty {
            0 => MetaValue::U8(self.array::<1>()?[0]),
            1 => MetaValue::I8(self.array::<1>()?[0] as i8),
            2 => MetaValue::U16(u16::from_le_bytes(self.array()?)),
            3 => MetaValue::I16(i16::from_le_bytes(self.array()?)),
            4 => MetaValue::U32(self.u32()?),
            5 => MetaValue::I32(i32::from_le_bytes(self.array()?)),
            6 => MetaValue::F32(f32::from_le_bytes(self.array()?)),
            7 => MetaValue::Bool(self.array::<1>()?[0] != 0),
            8 => MetaValue::String(self.string()?),
            9 => {
                if depth >= MAX_ARRAY_DEPTH {
                    return Err(GgufError::Implausible {
                        what: "array nesting depth",
                        value: depth as u64 + 1,
                        limit: MAX_ARRAY_DEPTH as u64,
                    });
                }
                let elem_ty = self.u32()?;
                let min = min_value_bytes(elem_ty).ok_or(GgufError::UnknownValueType(elem_ty))?;
                let n = self.count("array length", min)?;
                let mut items = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    items.push(self.value(elem_ty, depth + 1)?);
                }
                MetaValue::Array(items)
            }
            10 => MetaValue::U64(self.u64()?),
            11 => MetaValue::I64(i64::from_le_bytes(self.array()?)),
            12 => MetaValue::F64(f64::from_le_bytes(self.array()?)),
            other => return Err(GgufError::UnknownValueType(other)),
        })
    }
}

/// The fewest bytes a value of this type can occupy; bounds array lengths before allocation.
fn min_value_bytes(ty: u32) -> Option<u64> {
    Some(match ty {
        0 | 1 | 7 => 1,
        2 | 3 => 2,
        4..=6 => 4,
        8 => 8,
        9 => 12,
        10..=12 => 8,
        _ => return None,
    })
}

impl GgufFile {
    /// The file at `path`, mapped.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        Self::open_with(path, Load::Map)
    }

    pub fn open_with(path: impl AsRef<Path>, load: Load) -> Result<Self> {
        let path = path.as_ref();
        let io = |source| GgufError::Io {
            path: path.display().to_string(),
            source,
        };
        let bytes = match load {
            Load::Map => FileBytes::Mapped(Mapping::open(path).map_err(io)?),
            Load::Read => FileBytes::Read(std::fs::read(path).map_err(io)?),
        };
        Self::parse_bytes(bytes)
    }

    pub fn parse(bytes: Vec<u8>) -> Result<Self> {
        Self::parse_bytes(FileBytes::Read(bytes))
    }

    fn parse_bytes(bytes: FileBytes) -> Result<Self> {
        let mut c = Cursor {
            bytes: &bytes,
            pos: 0,
        };
        let magic = c.u32()?;
        if magic != MAGIC {
            return Err(GgufError::BadMagic(magic));
        }
        let version = c.u32()?;
        if !(2..=3).contains(&version) {
            return Err(GgufError::UnsupportedVersion(version));
        }
        // A tensor info takes at least 8 (name len) + 4 (dims) + 4 (type) + 8 (offset) bytes;
        // a metadata pair at least 8 (key len) + 4 (type) + 1 (value).
        let n_tensors = c.u64()?;
        let n_kv = c.count("metadata count", 13)?;
        if n_tensors > c.remaining() / 24 {
            return Err(GgufError::Implausible {
                what: "tensor count",
                value: n_tensors,
                limit: c.remaining() / 24,
            });
        }

        let mut metadata = HashMap::with_capacity(n_kv as usize);
        for _ in 0..n_kv {
            let key = c.string()?;
            let ty = c.u32()?;
            let value = c.value(ty, 0)?;
            if metadata.insert(key.clone(), value).is_some() {
                return Err(GgufError::Duplicate {
                    what: "metadata key",
                    name: key,
                });
            }
        }

        let mut raw = Vec::with_capacity(n_tensors as usize);
        for _ in 0..n_tensors {
            let name = c.string()?;
            let n_dims = c.u32()?;
            if n_dims == 0 || n_dims > MAX_DIMS {
                return Err(GgufError::BadTensor {
                    name,
                    reason: format!("{n_dims} dimensions (1 to {MAX_DIMS} supported)"),
                });
            }
            let mut dims = Vec::with_capacity(n_dims as usize);
            for _ in 0..n_dims {
                dims.push(c.u64()?);
            }
            let ty_id = c.u32()?;
            let offset = c.u64()?;
            let ty = GgmlType::from_id(ty_id).ok_or_else(|| GgufError::UnknownTensorType {
                name: name.clone(),
                ty: ty_id,
            })?;
            raw.push((name, dims, ty, offset));
        }

        let alignment = match metadata.get("general.alignment") {
            None => 32,
            Some(v) => match v.as_u64() {
                Some(a) if a.is_power_of_two() && a <= 1 << 20 => a,
                _ => {
                    return Err(GgufError::Metadata {
                        key: "general.alignment".into(),
                        reason: format!("{v:?} is not a power of two up to 1 MiB"),
                    })
                }
            },
        };
        let data_start = (c.pos as u64).div_ceil(alignment) * alignment;
        let file_len = bytes.len() as u64;

        let mut tensors = Vec::with_capacity(raw.len());
        let mut by_name = HashMap::with_capacity(raw.len());
        for (name, dims, ty, offset) in raw {
            let bad = |reason: String| GgufError::BadTensor {
                name: name.clone(),
                reason,
            };
            let elements = dims
                .iter()
                .try_fold(1u64, |acc, &d| acc.checked_mul(d))
                .ok_or_else(|| bad(format!("dimensions {dims:?} overflow")))?;
            if dims[0] % ty.block_elems() as u64 != 0 {
                return Err(bad(format!(
                    "row length {} is not a multiple of the {ty:?} block size {}",
                    dims[0],
                    ty.block_elems()
                )));
            }
            let len = ty
                .bytes_for(elements)
                .ok_or_else(|| bad(format!("size of {elements} elements overflows")))?;
            if offset % alignment != 0 {
                return Err(bad(format!("offset {offset} not aligned to {alignment}")));
            }
            let start = data_start
                .checked_add(offset)
                .filter(|s| s.checked_add(len).is_some_and(|end| end <= file_len))
                .ok_or_else(|| {
                    bad(format!(
                        "data [{offset}, +{len}) lies past the end of the file ({file_len} bytes, data from {data_start})"
                    ))
                })?;
            if by_name.insert(name.clone(), tensors.len()).is_some() {
                return Err(GgufError::Duplicate {
                    what: "tensor",
                    name,
                });
            }
            tensors.push(TensorInfo {
                name,
                dims,
                ty,
                start: start as usize,
                len: len as usize,
            });
        }

        Ok(Self {
            version,
            metadata,
            tensors,
            by_name,
            bytes: Arc::new(bytes),
        })
    }

    pub fn metadata(&self) -> &HashMap<String, MetaValue> {
        &self.metadata
    }

    pub fn get(&self, key: &str) -> Option<&MetaValue> {
        self.metadata.get(key)
    }

    fn missing(key: &str, want: &str) -> GgufError {
        GgufError::Metadata {
            key: key.into(),
            reason: format!("missing or not {want}"),
        }
    }

    pub fn get_u64(&self, key: &str) -> Result<u64> {
        self.get(key)
            .and_then(MetaValue::as_u64)
            .ok_or_else(|| Self::missing(key, "an unsigned integer"))
    }

    pub fn get_f64(&self, key: &str) -> Result<f64> {
        self.get(key)
            .and_then(MetaValue::as_f64)
            .ok_or_else(|| Self::missing(key, "a number"))
    }

    pub fn get_str(&self, key: &str) -> Result<&str> {
        self.get(key)
            .and_then(MetaValue::as_str)
            .ok_or_else(|| Self::missing(key, "a string"))
    }

    pub fn get_array(&self, key: &str) -> Result<&[MetaValue]> {
        self.get(key)
            .and_then(MetaValue::as_array)
            .ok_or_else(|| Self::missing(key, "an array"))
    }

    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.by_name.get(name).map(|&i| &self.tensors[i])
    }

    /// The raw bytes of a tensor; the range was validated when the file was parsed.
    pub fn tensor_bytes(&self, info: &TensorInfo) -> &[u8] {
        &self.bytes[info.start..info.start + info.len]
    }

    /// A tensor's bytes as a handle that can outlive this file.
    pub fn tensor_data(&self, info: &TensorInfo) -> TensorData {
        TensorData {
            file: Arc::clone(&self.bytes),
            start: info.start,
            len: info.len,
        }
    }

    /// Whether the file is mapped rather than read into memory.
    pub fn is_mapped(&self) -> bool {
        matches!(*self.bytes, FileBytes::Mapped(_))
    }

    /// Dequantizes a whole tensor to f32.
    pub fn tensor_f32(&self, info: &TensorInfo) -> Vec<f32> {
        let mut out = vec![0f32; info.elements() as usize];
        info.ty.dequantize(self.tensor_bytes(info), &mut out);
        out
    }
}
