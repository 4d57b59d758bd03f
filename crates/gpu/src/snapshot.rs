//! Weights as bytes: named tensors in safetensors layout, for saving a
//! checkpoint and for the weights edge (a version-tagged snapshot the
//! learner exports and generators apply, on the same or another device).

use std::borrow::Cow;
use std::collections::HashMap;
use std::path::Path;

use safetensors::tensor::{Dtype, SafeTensors, View};
use tch::{Kind, Tensor};

use crate::model::Model;
use crate::ModelError;

/// Metadata key holding a snapshot's policy version.
pub const VERSION_KEY: &str = "weir_policy_version";

struct OwnedView {
    dtype: Dtype,
    shape: Vec<usize>,
    data: Vec<u8>,
}

impl View for OwnedView {
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(&self.data)
    }
    fn data_len(&self) -> usize {
        self.data.len()
    }
}

fn view(tensor: &Tensor) -> Result<OwnedView, ModelError> {
    let dtype = Dtype::try_from(tensor.kind()).map_err(|e| ModelError::Torch(e.to_string()))?;
    let cpu = tensor.to_device(tch::Device::Cpu).contiguous();
    let numel = cpu.numel();
    let mut data = vec![0u8; numel * cpu.kind().elt_size_in_bytes()];
    cpu.f_copy_data_u8(&mut data, numel)?;
    Ok(OwnedView {
        dtype,
        shape: cpu.size().iter().map(|&d| d as usize).collect(),
        data,
    })
}

/// Serialises named tensors (in `kind` if given) with `metadata` (plus `format: pt`).
pub fn to_safetensors(
    tensors: &[(String, Tensor)],
    kind: Option<Kind>,
    metadata: &HashMap<String, String>,
) -> Result<Vec<u8>, ModelError> {
    let mut views = Vec::with_capacity(tensors.len());
    for (name, tensor) in tensors {
        let t = match kind {
            Some(k) => tensor.to_kind(k),
            None => tensor.shallow_clone(),
        };
        views.push((name.clone(), view(&t)?));
    }
    let mut info = metadata.clone();
    info.insert("format".into(), "pt".into());
    safetensors::tensor::serialize(views, &Some(info))
        .map_err(|e| ModelError::Torch(format!("safetensors: {e:?}")))
}

/// Named tensors, sorted by name.
pub type NamedTensors = Vec<(String, Tensor)>;

/// Reads named tensors and metadata from safetensors bytes.
pub fn from_safetensors(
    bytes: &[u8],
) -> Result<(NamedTensors, HashMap<String, String>), ModelError> {
    let (_, meta) = SafeTensors::read_metadata(bytes)
        .map_err(|e| ModelError::Input(format!("not safetensors bytes: {e:?}")))?;
    let metadata = meta.metadata().clone().unwrap_or_default();
    let st = SafeTensors::deserialize(bytes)
        .map_err(|e| ModelError::Input(format!("not safetensors bytes: {e:?}")))?;
    let mut tensors = Vec::new();
    for (name, v) in st.tensors() {
        tensors.push((name, Tensor::try_from(v)?));
    }
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    Ok((tensors, metadata))
}

impl Model {
    /// Every parameter by HuggingFace name, sorted.
    pub fn named_tensors(&self) -> Vec<(String, Tensor)> {
        let mut all: Vec<(String, Tensor)> = self.var_store().variables().into_iter().collect();
        all.sort_by(|a, b| a.0.cmp(&b.0));
        all
    }

    /// The weights as safetensors bytes tagged with `version` (for the weights edge).
    pub fn export_snapshot(&self, version: u64) -> Result<Vec<u8>, ModelError> {
        let metadata = HashMap::from([(VERSION_KEY.to_string(), version.to_string())]);
        to_safetensors(&self.named_tensors(), None, &metadata)
    }

    /// Applies a snapshot from [`Model::export_snapshot`] (any device, any
    /// dtype: converted to this model's); returns its version.
    pub fn apply_snapshot(&mut self, bytes: &[u8]) -> Result<u64, ModelError> {
        let (tensors, metadata) = from_safetensors(bytes)?;
        let version = metadata
            .get(VERSION_KEY)
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| {
                ModelError::Input(format!("snapshot has no `{VERSION_KEY}` metadata"))
            })?;
        let incoming: HashMap<String, Tensor> = tensors.into_iter().collect();
        let _guard = tch::no_grad_guard();
        for (name, mut var) in self.var_store().variables() {
            let t = incoming
                .get(&name)
                .ok_or_else(|| ModelError::MissingTensor {
                    path: "weights snapshot".into(),
                    name: name.clone(),
                })?;
            if t.size() != var.size() {
                return Err(ModelError::ShapeMismatch {
                    path: "weights snapshot".into(),
                    name,
                    expected: var.size(),
                    found: t.size(),
                });
            }
            var.f_copy_(&t.to_kind(var.kind()).to_device(var.device()))?;
        }
        Ok(version)
    }

    /// Saves the model in HuggingFace layout to `dir`: `model.safetensors`
    /// (in `kind`, default the compute dtype), `config.json` (with the saved
    /// dtype), and the tokenizer and generation files of the source folder,
    /// so that transformers (and weir) load the folder.
    pub fn save(&self, dir: &Path, kind: Option<Kind>) -> Result<(), ModelError> {
        std::fs::create_dir_all(dir).map_err(|e| ModelError::io(dir, e))?;
        let kind = kind.unwrap_or_else(|| self.kind());
        let bytes = to_safetensors(&self.named_tensors(), Some(kind), &HashMap::new())?;
        write_atomically(&dir.join("model.safetensors"), &bytes)?;
        let dtype = match kind {
            Kind::BFloat16 => "bfloat16",
            Kind::Half => "float16",
            Kind::Double => "float64",
            _ => "float32",
        };
        let config_path = self.source.join("config.json");
        let text =
            std::fs::read_to_string(&config_path).map_err(|e| ModelError::io(&config_path, e))?;
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
            let from = self.source.join(file);
            if from != dir.join(file) {
                copy_entry(&from, &dir.join(file))?;
            }
        }
        Ok(())
    }
}

/// Copies a file, or a folder of files (one level), if `from` exists.
fn copy_entry(from: &Path, to: &Path) -> Result<(), ModelError> {
    if from.is_file() {
        std::fs::copy(from, to).map_err(|e| ModelError::io(from, e))?;
    } else if from.is_dir() {
        std::fs::create_dir_all(to).map_err(|e| ModelError::io(to, e))?;
        for entry in std::fs::read_dir(from).map_err(|e| ModelError::io(from, e))? {
            let path = entry.map_err(|e| ModelError::io(from, e))?.path();
            if path.is_file() {
                let target = to.join(path.file_name().unwrap_or_default());
                std::fs::copy(&path, &target).map_err(|e| ModelError::io(&path, e))?;
            }
        }
    }
    Ok(())
}

/// Writes `bytes` to `path` through a temporary file and a rename, so
/// readers never see a half-written file.
pub fn write_atomically(path: &Path, bytes: &[u8]) -> Result<(), ModelError> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, bytes).map_err(|e| ModelError::io(&tmp, e))?;
    std::fs::rename(&tmp, path).map_err(|e| ModelError::io(path, e))
}
