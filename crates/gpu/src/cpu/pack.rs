//! From a [`Model`] to the kernels' packed weights: the packing a call
//! runs on (kept between calls while the parameters hold still, see
//! `prepared`), and the packing that alone holds a frozen model's weights
//! once it freed its own ([`Model::keep_only_cpu_packing`]).

use std::collections::HashMap;
use std::sync::Arc;

use tch::{Kind, Tensor};

use super::engine::CpuModel;
use super::prepared::Stamp;
use crate::checkpoint::SharedKey;
use crate::error::ModelError;
use crate::model::Model;

/// The packing of `model`'s current weights.
pub(crate) fn packed(model: &Model) -> Result<Arc<CpuModel>, ModelError> {
    let stamp = || -> Result<Stamp, ModelError> {
        model.check_weights_held()?;
        Ok(model
            .named_tensors()
            .iter()
            .chain(&model.adapter_tensors())
            .map(|(_, t)| (t.data_ptr() as usize, t.internal_version()))
            .collect())
    };
    model.prepared_for_cpu().model(stamp, || pack(model, false))
}

/// Packs `model`'s weights for good, freeing each of its tensors once
/// packed (a model that holds its weights alone), so that packing needs one
/// tensor beside the model rather than a second copy of it; or takes the
/// packing another model of the same shared weights (`shared`) made.
pub(crate) fn pin_consuming(model: &Model, shared: Option<SharedKey>) -> Result<(), ModelError> {
    model
        .prepared_for_cpu()
        .pin_consuming(shared, || pack(model, true))
}

/// Copies and packs the weights of a causal LM; with `consume`, empties
/// each of its tensors once read (afterwards, or after an error, the
/// model's own tensors are empty).
fn pack(model: &Model, consume: bool) -> Result<CpuModel, ModelError> {
    let tensors: HashMap<String, Tensor> = model.named_tensors().into_iter().collect();
    let lora = model.lora().is_some();
    let get = |name: &str| -> Result<Vec<f32>, ModelError> {
        let t = tensors
            .get(name)
            .ok_or_else(|| ModelError::Input(format!("the model has no tensor `{name}`")))?;
        // A LoRA model runs on its weights with the adapters folded in,
        // merged one tensor at a time.
        let t = if lora {
            model.merged_tensor(name, t)
        } else {
            t.shallow_clone()
        };
        let values = Vec::<f32>::try_from(&t.detach().to_kind(Kind::Float).contiguous().view(-1))
            .map_err(|e| ModelError::Torch(e.to_string()))?;
        if consume {
            // The parameter itself (every handle of it sees the empty data).
            let mut param = tensors[name].shallow_clone();
            param.set_data(&Tensor::empty([0], (param.kind(), param.device())));
        }
        Ok(values)
    };
    CpuModel::pack(&model.config, &get)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::gemm;

    #[test]
    fn a_packing_is_kept_only_while_the_weights_hold_still() {
        if !gemm::supported() {
            return;
        }
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/models/tiny-llama");
        let model = Model::load(&dir, crate::Device::Cpu, Kind::Float).unwrap();
        let prepared = model.prepared_for_cpu();
        let step = || {
            let _guard = tch::no_grad_guard();
            for (_, mut t) in model.named_tensors() {
                let _ = t.g_mul_scalar_(1.0001);
            }
        };
        packed(&model).unwrap();
        assert!(prepared.holds_packing(), "the first packing is kept");
        packed(&model).unwrap();
        step();
        packed(&model).unwrap();
        assert!(
            prepared.holds_packing(),
            "the last packing was reused: keep the new one"
        );
        step();
        packed(&model).unwrap();
        assert!(
            !prepared.holds_packing(),
            "changed before any reuse: dropped after use"
        );
        step();
        packed(&model).unwrap();
        assert!(!prepared.holds_packing(), "still changing every call");
        let kept = packed(&model).unwrap();
        assert!(
            prepared.holds_packing(),
            "the same weights twice: kept again"
        );
        assert!(Arc::ptr_eq(&kept, &packed(&model).unwrap()));
        model.release_cpu_packing();
        assert!(!prepared.holds_packing(), "released on request");
        assert!(!Arc::ptr_eq(&kept, &packed(&model).unwrap()));
    }
}
