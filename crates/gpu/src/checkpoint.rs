//! Reading and writing the tensors of a HuggingFace checkpoint folder:
//! `model.safetensors`, or shards listed in `model.safetensors.index.json`.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use serde_json::Value;
use tch::{Kind, Tensor};

use crate::error::ModelError;

/// The safetensors files of a checkpoint, in order.
pub fn weight_files(dir: &Path) -> Result<Vec<PathBuf>, ModelError> {
    let single = dir.join("model.safetensors");
    if single.is_file() {
        return Ok(vec![single]);
    }
    let index = dir.join("model.safetensors.index.json");
    if !index.is_file() {
        return Err(ModelError::io(
            dir,
            "no model.safetensors and no model.safetensors.index.json",
        ));
    }
    let text = std::fs::read_to_string(&index).map_err(|e| ModelError::io(&index, e))?;
    let value: Value = serde_json::from_str(&text).map_err(|e| ModelError::Json {
        path: index.display().to_string(),
        message: e.to_string(),
    })?;
    let map = value
        .get("weight_map")
        .and_then(Value::as_object)
        .ok_or_else(|| ModelError::config(&index, "weight_map", "missing or not an object"))?;
    let mut files: Vec<PathBuf> = Vec::new();
    for file in map.values() {
        let name = file.as_str().ok_or_else(|| {
            ModelError::config(&index, "weight_map", "a value is not a file name")
        })?;
        let path = dir.join(name);
        if !files.contains(&path) {
            files.push(path);
        }
    }
    files.sort();
    Ok(files)
}

/// Calls `visit(name, tensor, file)` for every tensor of the checkpoint in
/// `dir`, in file order. Each tensor is read from the file straight into
/// its own memory while `visit` runs: loading holds one tensor beside the
/// model, neither the file's bytes nor a second copy of every weight.
pub fn visit_tensors(
    dir: &Path,
    mut visit: impl FnMut(&str, Tensor, &Path) -> Result<(), ModelError>,
) -> Result<(), ModelError> {
    for file in weight_files(dir)? {
        if !file.is_file() {
            return Err(ModelError::io(&file, "listed in the index but missing"));
        }
        visit_file(&file, &mut visit)?;
    }
    Ok(())
}

/// The largest safetensors header weir reads (the format's own limit).
const MAX_HEADER_BYTES: u64 = 100 << 20;

/// One tensor's entry in a safetensors header.
struct Entry {
    name: String,
    kind: Kind,
    shape: Vec<i64>,
    /// Its bytes, from the start of the data section.
    range: std::ops::Range<u64>,
}

/// [`visit_tensors`] for one safetensors file: its header parsed and
/// checked, then each tensor read into place.
fn visit_file(
    file: &Path,
    visit: &mut impl FnMut(&str, Tensor, &Path) -> Result<(), ModelError>,
) -> Result<(), ModelError> {
    let bad = |why: String| ModelError::io(file, format!("not a safetensors file: {why}"));
    let mut f = File::open(file).map_err(|e| ModelError::io(file, e))?;
    let len = f.metadata().map_err(|e| ModelError::io(file, e))?.len();
    let mut word = [0u8; 8];
    f.read_exact(&mut word)
        .map_err(|_| bad(format!("{len} bytes, shorter than the header's length")))?;
    let n = u64::from_le_bytes(word);
    if n > MAX_HEADER_BYTES || 8 + n > len {
        return Err(bad(format!(
            "a header of {n} bytes in a file of {len} bytes"
        )));
    }
    let mut header = vec![0u8; n as usize];
    f.read_exact(&mut header)
        .map_err(|e| ModelError::io(file, e))?;
    let entries = parse_header(&header, len - 8 - n).map_err(|e| match e {
        HeaderError::Malformed(why) => bad(why),
        HeaderError::Dtype(why) => ModelError::io(file, why),
    })?;
    for entry in entries {
        let tensor = Tensor::empty(entry.shape.as_slice(), (entry.kind, tch::Device::Cpu));
        let bytes = entry.range.end - entry.range.start;
        if bytes > 0 {
            f.seek(SeekFrom::Start(8 + n + entry.range.start))
                .map_err(|e| ModelError::io(file, e))?;
            // SAFETY: `tensor` is a fresh contiguous CPU tensor of exactly
            // `bytes` bytes (checked against its shape and dtype), owned here.
            let place = unsafe {
                std::slice::from_raw_parts_mut(tensor.data_ptr() as *mut u8, bytes as usize)
            };
            f.read_exact(place).map_err(|e| {
                ModelError::io(file, format!("reading tensor `{}`: {e}", entry.name))
            })?;
        }
        visit(&entry.name, tensor, file)?;
    }
    Ok(())
}

/// The tensors of a safetensors header (JSON), in data order, each checked:
/// a dtype weir reads, a shape whose size is its byte range, a range inside
/// the `data_len` bytes of the data section.
fn parse_header(header: &[u8], data_len: u64) -> Result<Vec<Entry>, HeaderError> {
    let value: serde_json::Map<String, Value> =
        serde_json::from_slice(header).map_err(|e| format!("its header is not JSON: {e}"))?;
    let mut entries = Vec::new();
    for (name, info) in value {
        if name == "__metadata__" {
            continue;
        }
        let field = |key: &str| {
            info.get(key)
                .ok_or_else(|| format!("tensor `{name}` has no `{key}`"))
        };
        let dtype = field("dtype")?.as_str().unwrap_or_default().to_string();
        let kind = kind_of(&dtype).ok_or_else(|| {
            HeaderError::Dtype(format!(
                "tensor `{name}` has dtype `{dtype}`, which weir does not read (it reads \
                 F64, F32, F16, BF16 and integer tensors: dequantize the checkpoint first)"
            ))
        })?;
        let whole = |v: &Value| {
            v.as_array()
                .map(|a| a.iter().map(Value::as_u64).collect::<Option<Vec<u64>>>())
        };
        let shape = whole(field("shape")?)
            .flatten()
            .ok_or_else(|| format!("tensor `{name}`: `shape` is not a list of sizes"))?;
        let offsets = whole(field("data_offsets")?)
            .flatten()
            .filter(|o| o.len() == 2 && o[0] <= o[1])
            .ok_or_else(|| format!("tensor `{name}`: `data_offsets` is not [begin, end]"))?;
        let numel = shape
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
            .ok_or_else(|| format!("tensor `{name}`: shape {shape:?} overflows"))?;
        let bytes = offsets[1] - offsets[0];
        if numel.checked_mul(kind.elt_size_in_bytes() as u64) != Some(bytes) {
            return Err(format!(
                "tensor `{name}`: shape {shape:?} of {dtype} is not its {bytes} bytes"
            )
            .into());
        }
        if offsets[1] > data_len {
            return Err(format!(
                "tensor `{name}` ends at byte {} of a data section of {data_len}",
                offsets[1]
            )
            .into());
        }
        entries.push(Entry {
            name,
            kind,
            shape: shape.iter().map(|&d| d as i64).collect(),
            range: offsets[0]..offsets[1],
        });
    }
    entries.sort_by_key(|e| e.range.start);
    Ok(entries)
}

/// Why a safetensors header cannot be read.
enum HeaderError {
    /// It is not a well-formed header.
    Malformed(String),
    /// A well-formed header with a tensor of a dtype weir does not read.
    Dtype(String),
}

impl From<String> for HeaderError {
    fn from(why: String) -> Self {
        HeaderError::Malformed(why)
    }
}

/// The libtorch dtype of a safetensors dtype name.
fn kind_of(dtype: &str) -> Option<Kind> {
    Some(match dtype {
        "F64" => Kind::Double,
        "F32" => Kind::Float,
        "F16" => Kind::Half,
        "BF16" => Kind::BFloat16,
        "I64" => Kind::Int64,
        "I32" => Kind::Int,
        "I16" => Kind::Int16,
        "I8" => Kind::Int8,
        "U8" => Kind::Uint8,
        "BOOL" => Kind::Bool,
        _ => return None,
    })
}

/// One checkpoint's weights, loaded once and shared by the models of
/// [`Model::load_shared`](crate::Model::load_shared). Never written after loading.
#[derive(Debug)]
pub(crate) struct SharedWeights {
    /// The checkpoint folder (canonical), device and dtype they were loaded for.
    pub(crate) key: SharedKey,
    pub(crate) config: crate::config::ModelConfig,
    pub(crate) tensors: std::collections::HashMap<String, Tensor>,
}

// SAFETY: the tensors are written only while loading, before the value is
// shared; afterwards threads only read them and take shallow clones
// (libtorch's reference counts are atomic).
unsafe impl Sync for SharedWeights {}

/// What one [`SharedWeights`] was loaded for: the checkpoint folder
/// (canonical), the device and the dtype.
pub(crate) type SharedKey = (PathBuf, String, String);
