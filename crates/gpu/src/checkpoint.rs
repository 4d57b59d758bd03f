//! Reading and writing the tensors of a HuggingFace checkpoint folder:
//! `model.safetensors`, or shards listed in `model.safetensors.index.json`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::Value;
use tch::Tensor;

use crate::ModelError;

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

/// Every tensor of the checkpoint by name, with the file it came from.
pub fn read_tensors(dir: &Path) -> Result<BTreeMap<String, (Tensor, PathBuf)>, ModelError> {
    let mut out = BTreeMap::new();
    for file in weight_files(dir)? {
        if !file.is_file() {
            return Err(ModelError::io(&file, "listed in the index but missing"));
        }
        let tensors = Tensor::read_safetensors(&file).map_err(|e| ModelError::io(&file, e))?;
        for (name, tensor) in tensors {
            out.insert(name, (tensor, file.clone()));
        }
    }
    Ok(out)
}
