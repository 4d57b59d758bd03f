//! Weights as bytes: named tensors in safetensors layout, for saving a
//! checkpoint and for the weights edge (a version-tagged snapshot the
//! learner exports and generators apply, on the same or another device).

use std::collections::HashMap;
use std::path::Path;

use safetensors::tensor::{Dtype, SafeTensors};
use tch::{Kind, Tensor};

use crate::error::ModelError;
use crate::model::{Held, Model};

/// Metadata key holding a snapshot's policy version.
pub const VERSION_KEY: &str = "weir_policy_version";

/// The safetensors header of `tensors` (in `kind` if given) with
/// `metadata` (plus `format: pt`): its length prefix and JSON, padded so the
/// data starts 8-byte aligned as the safetensors writers pad it; and the
/// data's length.
fn safetensors_header(
    tensors: &[(String, Tensor)],
    kind: Option<Kind>,
    metadata: &HashMap<String, String>,
) -> Result<(Vec<u8>, usize), ModelError> {
    let mut header = serde_json::Map::new();
    let mut info: serde_json::Map<String, serde_json::Value> = metadata
        .iter()
        .map(|(k, v)| (k.clone(), v.clone().into()))
        .collect();
    info.insert("format".into(), "pt".into());
    header.insert("__metadata__".into(), info.into());
    let mut offset = 0usize;
    for (name, tensor) in tensors {
        let kind = kind.unwrap_or(tensor.kind());
        let dtype = Dtype::try_from(kind).map_err(|e| ModelError::Torch(e.to_string()))?;
        let bytes = tensor.numel() * kind.elt_size_in_bytes();
        header.insert(
            name.clone(),
            serde_json::json!({
                "dtype": dtype,
                "shape": tensor.size(),
                "data_offsets": [offset, offset + bytes],
            }),
        );
        offset += bytes;
    }
    let mut text = serde_json::Value::Object(header).to_string();
    while !(8 + text.len()).is_multiple_of(8) {
        text.push(' ');
    }
    let mut out = Vec::with_capacity(8 + text.len());
    out.extend_from_slice(&(text.len() as u64).to_le_bytes());
    out.extend_from_slice(text.as_bytes());
    Ok((out, offset))
}

/// Copies `tensor` (in `kind` if given) into `out`, which has its size in bytes.
fn copy_tensor_bytes(
    tensor: &Tensor,
    kind: Option<Kind>,
    out: &mut [u8],
) -> Result<(), ModelError> {
    let t = match kind {
        Some(k) if k != tensor.kind() => tensor.to_kind(k),
        _ => tensor.shallow_clone(),
    };
    t.f_copy_data_u8(out, t.numel())?;
    Ok(())
}

/// Serialises named tensors (in `kind` if given) with `metadata` (plus
/// `format: pt`) in safetensors layout: the header, then each tensor's
/// bytes copied once, straight from its device into the returned buffer
/// (no intermediate copy of the whole set).
pub fn to_safetensors(
    tensors: &[(String, Tensor)],
    kind: Option<Kind>,
    metadata: &HashMap<String, String>,
) -> Result<Vec<u8>, ModelError> {
    let (mut out, data) = safetensors_header(tensors, kind, metadata)?;
    let mut at = out.len();
    out.resize(at + data, 0);
    for (_, tensor) in tensors {
        let end = at + tensor.numel() * kind.unwrap_or(tensor.kind()).elt_size_in_bytes();
        copy_tensor_bytes(tensor, kind, &mut out[at..end])?;
        at = end;
    }
    Ok(out)
}

/// Writes what [`to_safetensors`] returns to `path` one tensor at a time,
/// so no more than the largest tensor is held in host memory beside the
/// tensors themselves (a checkpoint of the weights or of the optimizer's
/// moments would otherwise be a second copy of all of them). Written as
/// [`write_atomically`] writes.
pub fn save_safetensors(
    path: &Path,
    tensors: &[(String, Tensor)],
    kind: Option<Kind>,
    metadata: &HashMap<String, String>,
) -> Result<(), ModelError> {
    use std::io::Write;
    let (header, _) = safetensors_header(tensors, kind, metadata)?;
    let fill = |file: &mut std::fs::File| -> std::io::Result<()> {
        let mut file = std::io::BufWriter::new(file);
        file.write_all(&header)?;
        let mut buffer = Vec::new();
        for (_, tensor) in tensors {
            buffer.resize(
                tensor.numel() * kind.unwrap_or(tensor.kind()).elt_size_in_bytes(),
                0,
            );
            copy_tensor_bytes(tensor, kind, &mut buffer)
                .map_err(|e| std::io::Error::other(e.to_string()))?;
            file.write_all(&buffer)?;
        }
        file.flush()
    };
    // On disk before it takes its name: a power cut leaves the old file or the whole new one.
    weir_durable::write_with(path, fill).map_err(|e| ModelError::io(path, e))
}

/// Named tensors, sorted by name.
pub type NamedTensors = Vec<(String, Tensor)>;

/// Reads named tensors and metadata from safetensors bytes.
pub fn from_safetensors(
    bytes: &[u8],
) -> Result<(NamedTensors, HashMap<String, String>), ModelError> {
    from_safetensors_where(bytes, |_| true)
}

/// [`from_safetensors`] of the tensors whose names `keep` takes (the others
/// are never copied out of `bytes`).
pub fn from_safetensors_where(
    bytes: &[u8],
    keep: impl Fn(&str) -> bool,
) -> Result<(NamedTensors, HashMap<String, String>), ModelError> {
    let (_, meta) = SafeTensors::read_metadata(bytes)
        .map_err(|e| ModelError::Input(format!("not safetensors bytes: {e:?}")))?;
    let metadata = meta.metadata().clone().unwrap_or_default();
    let st = SafeTensors::deserialize(bytes)
        .map_err(|e| ModelError::Input(format!("not safetensors bytes: {e:?}")))?;
    let mut tensors = Vec::new();
    for (name, v) in st.tensors() {
        if keep(&name) {
            tensors.push((name, Tensor::try_from(v)?));
        }
    }
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    Ok((tensors, metadata))
}

/// Copies into each of `targets` the tensor `fetch` gives for its name
/// (converted to the target's dtype and device), checking that every one
/// is there with its shape; `origin` names the source in errors.
pub(crate) fn copy_into(
    targets: Vec<(String, Tensor)>,
    origin: &str,
    mut fetch: impl FnMut(&str) -> Result<Option<Tensor>, ModelError>,
) -> Result<(), ModelError> {
    let _guard = tch::no_grad_guard();
    for (name, mut var) in targets {
        let t = fetch(&name)?.ok_or_else(|| ModelError::MissingTensor {
            path: origin.to_string(),
            name: name.clone(),
        })?;
        if t.size() != var.size() {
            return Err(ModelError::ShapeMismatch {
                path: origin.to_string(),
                name,
                expected: var.size(),
                found: t.size(),
            });
        }
        var.f_copy_(&t.to_kind(var.kind()).to_device(var.device()))?;
    }
    Ok(())
}

impl Model {
    /// Every parameter by HuggingFace name, sorted.
    pub fn named_tensors(&self) -> Vec<(String, Tensor)> {
        let mut all: Vec<(String, Tensor)> = self.var_store().variables().into_iter().collect();
        all.sort_by(|a, b| a.0.cmp(&b.0));
        all
    }

    /// The weights as safetensors bytes tagged with `version` (for the
    /// weights edge); a LoRA model's hold only its adapters.
    pub fn export_snapshot(&self, version: u64) -> Result<Vec<u8>, ModelError> {
        self.check_weights_held()?;
        let metadata = HashMap::from([(VERSION_KEY.to_string(), version.to_string())]);
        to_safetensors(&self.snapshot_tensors(), None, &metadata)
    }

    /// Applies a snapshot from [`Model::export_snapshot`] (any device, any
    /// dtype: converted to this model's); returns its version. Each tensor
    /// is read out of the bytes and copied into place one at a time, so the
    /// transient memory is one tensor, not a second set of weights.
    pub fn apply_snapshot(&mut self, bytes: &[u8]) -> Result<u64, ModelError> {
        self.ready_for_snapshot()?;
        let (_, meta) = SafeTensors::read_metadata(bytes)
            .map_err(|e| ModelError::Input(format!("not safetensors bytes: {e:?}")))?;
        let version = meta
            .metadata()
            .as_ref()
            .and_then(|m| m.get(VERSION_KEY))
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| {
                ModelError::Input(format!("snapshot has no `{VERSION_KEY}` metadata"))
            })?;
        let st = SafeTensors::deserialize(bytes)
            .map_err(|e| ModelError::Input(format!("not safetensors bytes: {e:?}")))?;
        copy_into(self.snapshot_tensors(), "weights snapshot", |name| {
            st.tensor(name)
                .ok()
                .map(Tensor::try_from)
                .transpose()
                .map_err(Into::into)
        })?;
        self.held = Held::Weights;
        Ok(version)
    }

    /// Saves the model in HuggingFace layout to `dir`: `model.safetensors`
    /// (in `kind`, default the compute dtype), `config.json` (with the saved
    /// dtype), and the tokenizer and generation files of the source folder,
    /// so that transformers (and weir) load the folder.
    pub fn save(&self, dir: &Path, kind: Option<Kind>) -> Result<(), ModelError> {
        self.check_weights_held()?;
        self.save_sharded(dir, kind, DEFAULT_MAX_SHARD_BYTES)
    }

    /// [`Model::save`], with the weights in shards of at most
    /// `max_shard_bytes` each (a larger tensor gets a shard of its own):
    /// one shard is `model.safetensors`; several are
    /// `model-0000i-of-0000n.safetensors` with `model.safetensors.index.json`
    /// (`metadata.total_size`, `weight_map`), as transformers writes them.
    pub fn save_sharded(
        &self,
        dir: &Path,
        kind: Option<Kind>,
        max_shard_bytes: u64,
    ) -> Result<(), ModelError> {
        let kind = kind.unwrap_or_else(|| self.kind());
        if self.lora().is_some() {
            return self.save_adapters(dir, kind);
        }
        std::fs::create_dir_all(dir).map_err(|e| ModelError::io(dir, e))?;
        let element = kind.elt_size_in_bytes() as u64;
        let mut shards: Vec<Vec<(String, Tensor)>> = vec![Vec::new()];
        let mut sizes = vec![0u64];
        let mut total = 0u64;
        for (name, tensor) in self.named_tensors() {
            let bytes = tensor.numel() as u64 * element;
            total += bytes;
            let last = sizes.len() - 1;
            if sizes[last] > 0 && sizes[last] + bytes > max_shard_bytes {
                shards.push(Vec::new());
                sizes.push(0);
            }
            let last = sizes.len() - 1;
            sizes[last] += bytes;
            shards[last].push((name, tensor));
        }
        if shards.len() == 1 {
            save_safetensors(
                &dir.join("model.safetensors"),
                &shards[0],
                Some(kind),
                &HashMap::new(),
            )?;
        } else {
            let n = shards.len();
            let mut weight_map = serde_json::Map::new();
            for (i, shard) in shards.iter().enumerate() {
                let file = format!("model-{:05}-of-{n:05}.safetensors", i + 1);
                save_safetensors(&dir.join(&file), shard, Some(kind), &HashMap::new())?;
                for (name, _) in shard {
                    weight_map.insert(name.clone(), file.clone().into());
                }
            }
            let index = serde_json::json!({
                "metadata": {"total_size": total},
                "weight_map": weight_map,
            });
            write_atomically(
                &dir.join("model.safetensors.index.json"),
                index.to_string().as_bytes(),
            )?;
        }
        let dtype = match kind {
            Kind::BFloat16 => "bfloat16",
            Kind::Half => "float16",
            Kind::Double => "float64",
            _ => "float32",
        };
        let config_path = self.source.join("config.json");
        let text = weir_durable::read_text_capped(&config_path, weir_durable::SIDE_FILE_BYTES)
            .map_err(|e| ModelError::io(&config_path, e))?;
        let mut config: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| ModelError::Json {
                path: config_path.display().to_string(),
                message: e.to_string(),
            })?;
        let key = if config.get("dtype").is_some() {
            "dtype"
        } else {
            "torch_dtype"
        };
        config[key] = dtype.into();
        if self.config.head == crate::Head::SequenceClassification {
            // A critic made from a causal LM is saved as what it now is: a one-label classifier.
            config["architectures"] = serde_json::json!([self
                .config
                .architecture
                .replace("ForCausalLM", "ForSequenceClassification")]);
            config["num_labels"] = self.config.num_labels.into();
            config["id2label"] = (0..self.config.num_labels)
                .map(|i| (i.to_string(), serde_json::Value::from(format!("LABEL_{i}"))))
                .collect::<serde_json::Map<_, _>>()
                .into();
            config["label2id"] = (0..self.config.num_labels)
                .map(|i| (format!("LABEL_{i}"), serde_json::Value::from(i)))
                .collect::<serde_json::Map<_, _>>()
                .into();
        }
        let text = serde_json::to_string_pretty(&config).map_err(|e| ModelError::Json {
            path: config_path.display().to_string(),
            message: e.to_string(),
        })?;
        write_atomically(&dir.join("config.json"), text.as_bytes())?;
        self.copy_side_files(dir)
    }

    /// Copies the source folder's tokenizer and generation files into `dir`.
    pub(crate) fn copy_side_files(&self, dir: &Path) -> Result<(), ModelError> {
        for file in [
            "generation_config.json",
            "tokenizer.json",
            "tokenizer_config.json",
            "special_tokens_map.json",
            "chat_template.jinja",
            "chat_template.json",
            "additional_chat_templates",
            "tokenizer.model",
            "vocab.json",
            "merges.txt",
            "added_tokens.json",
        ] {
            let from = crate::checkpoint::entry_in(&self.source, file)
                .map_err(|why| ModelError::io(&self.source, why))?;
            if from != dir.join(file) {
                copy_entry(&from, &dir.join(file))?;
            }
        }
        Ok(())
    }
}

/// The shard size [`Model::save`] uses: transformers' default of 5 GB.
pub const DEFAULT_MAX_SHARD_BYTES: u64 = 5_000_000_000;

/// Bytes of a size such as `5GB`, `500MB`, `2GiB` or `1048576` (units of
/// 1000 for KB/MB/GB, 1024 for KiB/MiB/GiB, as transformers reads them).
pub fn parse_size(text: &str) -> Option<u64> {
    let t = text.trim();
    let digits = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (number, unit) = t.split_at(digits);
    let number: f64 = number.parse().ok()?;
    let scale = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "kib" => 1024.0,
        "mib" => 1024.0 * 1024.0,
        "gib" => 1024.0 * 1024.0 * 1024.0,
        _ => return None,
    };
    let bytes = number * scale;
    (bytes >= 1.0 && bytes.is_finite()).then_some(bytes as u64)
}

/// Copies a file, or a folder of files (one level), if `from` exists.
fn copy_entry(from: &Path, to: &Path) -> Result<(), ModelError> {
    if from.is_file() {
        weir_durable::copy(from, to).map_err(|e| ModelError::io(to, e))?;
    } else if from.is_dir() {
        std::fs::create_dir_all(to).map_err(|e| ModelError::io(to, e))?;
        for entry in std::fs::read_dir(from).map_err(|e| ModelError::io(from, e))? {
            let entry = entry.map_err(|e| ModelError::io(from, e))?;
            let name = entry.file_name();
            // A link inside the folder is followed only where it stays inside.
            let Ok(path) = crate::checkpoint::entry_in(from, &name.to_string_lossy()) else {
                continue;
            };
            if path.is_file() {
                let target = to.join(path.file_name().unwrap_or_default());
                weir_durable::copy(&path, &target).map_err(|e| ModelError::io(&target, e))?;
            }
        }
    }
    Ok(())
}

/// Writes `bytes` to `path` through an exclusive temporary file and a
/// rename ([`weir_durable::write`]): readers never see a half-written file,
/// a power cut leaves the old file or the new one, and a link planted at
/// the name or beside it is never written through.
pub fn write_atomically(path: &Path, bytes: &[u8]) -> Result<(), ModelError> {
    weir_durable::write(path, bytes).map_err(|e| ModelError::io(path, e))
}

/// Syncs `dir` to disk: the folder itself (its entries, renames included)
/// and, with `files`, every file and folder beneath it.
pub fn sync_tree(dir: &Path, files: bool) -> Result<(), ModelError> {
    if files {
        let entries = std::fs::read_dir(dir).map_err(|e| ModelError::io(dir, e))?;
        for entry in entries {
            let path = entry.map_err(|e| ModelError::io(dir, e))?.path();
            if path.is_dir() {
                sync_tree(&path, true)?;
            } else {
                std::fs::File::open(&path)
                    .and_then(|f| f.sync_all())
                    .map_err(|e| ModelError::io(&path, e))?;
            }
        }
    }
    weir_durable::sync_dir(dir).map_err(|e| ModelError::io(dir, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_written_tensor_by_tensor_holds_the_same_bytes() {
        let tensors = vec![
            (
                "a".to_string(),
                Tensor::from_slice(&[1.5f32, -2.0, 3.25]).view([3, 1]),
            ),
            ("b.weight".to_string(), Tensor::from_slice(&[7.0f64, 8.0])),
            ("c".to_string(), Tensor::from_slice::<f32>(&[])),
        ];
        let metadata = HashMap::from([("steps".to_string(), "4".to_string())]);
        let dir = tempfile::tempdir().unwrap();
        for kind in [None, Some(Kind::BFloat16)] {
            let path = dir.path().join("x.safetensors");
            save_safetensors(&path, &tensors, kind, &metadata).unwrap();
            let written = std::fs::read(&path).unwrap();
            assert_eq!(written, to_safetensors(&tensors, kind, &metadata).unwrap());
            let (back, meta) = from_safetensors(&written).unwrap();
            assert_eq!(meta["steps"], "4");
            assert_eq!(back.len(), 3);
            assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
        }
    }
}
