//! Reading and writing the tensors of a HuggingFace checkpoint folder:
//! `model.safetensors`, or shards listed in `model.safetensors.index.json`.

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

/// Calls `visit(name, tensor, file)` for every tensor of the checkpoint in
/// `dir`, reading one file at a time and making each tensor only while
/// `visit` runs: loading holds the file's bytes and one tensor beside the
/// model, not a second copy of every weight.
pub fn visit_tensors(
    dir: &Path,
    mut visit: impl FnMut(&str, Tensor, &Path) -> Result<(), ModelError>,
) -> Result<(), ModelError> {
    for file in weight_files(dir)? {
        if !file.is_file() {
            return Err(ModelError::io(&file, "listed in the index but missing"));
        }
        let bytes = std::fs::read(&file).map_err(|e| ModelError::io(&file, e))?;
        let tensors = safetensors::SafeTensors::deserialize(&bytes)
            .map_err(|e| ModelError::io(&file, format!("not a safetensors file: {e:?}")))?;
        for (name, view) in tensors.tensors() {
            let tensor = Tensor::try_from(view).map_err(|e| ModelError::io(&file, e))?;
            visit(&name, tensor, &file)?;
        }
    }
    Ok(())
}
