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
    let text = weir_durable::read_text_capped(&index, weir_durable::SIDE_FILE_BYTES)
        .map_err(|e| ModelError::io(&index, e))?;
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
        let path =
            entry_in(dir, name).map_err(|why| ModelError::config(&index, "weight_map", why))?;
        if !files.contains(&path) {
            files.push(path);
        }
    }
    files.sort();
    Ok(files)
}

/// `dir/name` for a file a checkpoint names (a shard in its index, a side
/// file): `name` must be a plain file name, and where the file is a
/// symbolic link it must resolve inside `dir`, or, for a folder of a
/// HuggingFace hub cache (`…/snapshots/<revision>/`), inside that
/// repository's `blobs/`. A checkpoint cannot make weir read or copy a
/// file from elsewhere (`../../home/me/.ssh/id_ed25519`, say).
pub(crate) fn entry_in(dir: &Path, name: &str) -> Result<PathBuf, String> {
    let plain = {
        let mut parts = Path::new(name).components();
        matches!(
            (parts.next(), parts.next()),
            (Some(std::path::Component::Normal(_)), None)
        )
    };
    if !plain {
        return Err(format!(
            "`{name}` is not a plain file name inside the checkpoint folder"
        ));
    }
    let path = dir.join(name);
    let Ok(meta) = std::fs::symlink_metadata(&path) else {
        // Absent: the caller says what is missing.
        return Ok(path);
    };
    if !meta.file_type().is_symlink() {
        return Ok(path);
    }
    let outside = || {
        format!(
            "`{name}` is a link that leads out of the checkpoint folder ({})",
            dir.display()
        )
    };
    let target = std::fs::canonicalize(&path).map_err(|e| format!("`{name}`: {e}"))?;
    let home = std::fs::canonicalize(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let hub_blobs = home
        .parent()
        .filter(|snapshots| snapshots.file_name() == Some("snapshots".as_ref()))
        .and_then(Path::parent)
        .map(|repo| repo.join("blobs"));
    let inside = target.starts_with(&home)
        || hub_blobs.is_some_and(|blobs| target.parent() == Some(blobs.as_path()));
    if inside {
        Ok(path)
    } else {
        Err(outside())
    }
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
    let (mut f, n, entries) = read_header(file)?;
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

/// Opens a safetensors file and reads its header: the open file, the
/// header's length and its tensors, checked against the file's size.
fn read_header(file: &Path) -> Result<(File, u64, Vec<Entry>), ModelError> {
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
    Ok((f, n, entries))
}

/// Weights a config may describe beyond twice what the files hold before
/// [`check_config_fits`] refuses it.
const SLACK_WEIGHTS: u64 = 1 << 20;

/// Checks `config` (read from `dir/config.json`) against the tensors the
/// checkpoint's safetensors headers declare, before any weight is
/// allocated: a config that asks for far more than the files hold (a
/// `vocab_size` of 10¹², say, which would have libtorch reserve terabytes)
/// is refused with one line naming the file and the field that disagrees.
pub(crate) fn check_config_fits(
    dir: &Path,
    config: &crate::config::ModelConfig,
) -> Result<(), ModelError> {
    let mut shapes: std::collections::HashMap<String, Vec<i64>> = Default::default();
    let mut held: u64 = 0;
    for file in weight_files(dir)? {
        if !file.is_file() {
            return Err(ModelError::io(&file, "listed in the index but missing"));
        }
        for entry in read_header(&file)?.2 {
            held = held.saturating_add(entry.shape.iter().map(|&d| d as u64).product());
            shapes.insert(entry.name, entry.shape);
        }
    }
    let wanted = config.parameter_count();
    // A smaller disagreement (a tensor missing, one of another shape) is
    // named tensor by tensor while loading; this guards the allocation.
    if wanted as u64 <= held.saturating_mul(2).saturating_add(SLACK_WEIGHTS) {
        return Ok(());
    }
    let (h, v, layers) = (
        config.hidden_size,
        config.vocab_size,
        config.num_hidden_layers,
    );
    let last_layer = format!("model.layers.{}.", layers - 1);
    let shape = |name: &str| shapes.get(name).map(Vec::as_slice);
    let (field, why) = match (
        shape("model.embed_tokens.weight"),
        shape("model.layers.0.mlp.gate_proj.weight"),
    ) {
        (Some([rows, _]), _) if *rows != v => (
            "vocab_size",
            format!("{v}, but model.embed_tokens.weight has {rows} rows"),
        ),
        (Some([_, cols]), _) if *cols != h => (
            "hidden_size",
            format!("{h}, but model.embed_tokens.weight has {cols} columns"),
        ),
        (_, Some([rows, _])) if *rows != config.intermediate_size => (
            "intermediate_size",
            format!(
                "{}, but model.layers.0.mlp.gate_proj.weight has {rows} rows",
                config.intermediate_size
            ),
        ),
        _ if !shapes.keys().any(|name| name.starts_with(&last_layer)) => (
            "num_hidden_layers",
            format!(
                "{layers}, but the checkpoint has no tensor of layer {}",
                layers - 1
            ),
        ),
        _ => {
            return Err(ModelError::Input(format!(
                "{}: its sizes describe {wanted} weights and the checkpoint's files hold {held}",
                dir.join("config.json").display()
            )))
        }
    };
    Err(ModelError::config(&dir.join("config.json"), field, why))
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
        if let Some(d) = shape.iter().find(|&&d| d > i64::MAX as u64) {
            return Err(format!("tensor `{name}`: dimension {d} is too large").into());
        }
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    fn index(dir: &Path, names: &[&str]) {
        let map: serde_json::Map<String, Value> = names
            .iter()
            .enumerate()
            .map(|(i, n)| (format!("t{i}"), Value::from(*n)))
            .collect();
        let text = serde_json::json!({ "weight_map": map }).to_string();
        std::fs::write(dir.join("model.safetensors.index.json"), text).unwrap();
    }

    #[test]
    fn a_checkpoint_names_only_files_inside_its_folder() {
        let root = tempfile::tempdir().unwrap();
        let (dir, elsewhere) = (root.path().join("ckpt"), root.path().join("secret"));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(&elsewhere, b"private").unwrap();
        std::fs::write(dir.join("a.safetensors"), b"").unwrap();
        index(&dir, &["a.safetensors"]);
        assert_eq!(weight_files(&dir).unwrap(), vec![dir.join("a.safetensors")]);
        for name in ["../secret", "/etc/passwd", "sub/../a.safetensors", ""] {
            index(&dir, &["a.safetensors", name]);
            let err = weight_files(&dir).unwrap_err().to_string();
            assert!(
                err.contains("weight_map") && err.contains("not a plain file name"),
                "{name}: {err}"
            );
        }
        // A link out of the folder is refused, one inside it followed.
        symlink(&elsewhere, dir.join("b.safetensors")).unwrap();
        index(&dir, &["b.safetensors"]);
        let err = weight_files(&dir).unwrap_err().to_string();
        assert!(err.contains("leads out of the checkpoint folder"), "{err}");
        symlink("a.safetensors", dir.join("c.safetensors")).unwrap();
        index(&dir, &["c.safetensors"]);
        assert_eq!(weight_files(&dir).unwrap(), vec![dir.join("c.safetensors")]);
    }

    #[test]
    fn a_hub_cache_snapshot_may_link_into_its_blobs() {
        let root = tempfile::tempdir().unwrap();
        let repo = root.path().join("models--org--tiny");
        let snapshot = repo.join("snapshots/0123abcd");
        std::fs::create_dir_all(&snapshot).unwrap();
        std::fs::create_dir_all(repo.join("blobs")).unwrap();
        std::fs::write(repo.join("blobs/9f8e"), b"").unwrap();
        symlink("../../blobs/9f8e", snapshot.join("model-1.safetensors")).unwrap();
        index(&snapshot, &["model-1.safetensors"]);
        assert_eq!(
            weight_files(&snapshot).unwrap(),
            vec![snapshot.join("model-1.safetensors")]
        );
        // Not past the repository's blobs.
        std::fs::write(root.path().join("other"), b"").unwrap();
        symlink("../../../other", snapshot.join("model-2.safetensors")).unwrap();
        index(&snapshot, &["model-2.safetensors"]);
        assert!(weight_files(&snapshot).is_err());
    }
}
