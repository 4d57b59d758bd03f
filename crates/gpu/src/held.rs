//! Where a [`Model`]'s weights are: in its parameters, only in the CPU
//! kernels' packing (a reference), or nowhere until the next snapshot (a
//! generator between two versions); and the one-line refusal of whatever
//! needs weights a model freed.

use tch::Tensor;

use crate::error::ModelError;
use crate::model::{Held, Model};

impl Model {
    /// Keeps this frozen model's weights only in the CPU kernels' packing
    /// and frees its own copy of them (its share of [`Model::load_shared`]'s
    /// weights): a reference, whose every pass runs on the kernels, then
    /// holds its weights once instead of twice. Models loaded shared from
    /// one checkpoint, device and dtype share one packing (several workers'
    /// references in one process hold the weights once). Returns whether it did: not
    /// where the kernels do not run this model (a GPU, another dtype) or it
    /// has adapters. Afterwards only the kernels' passes work; a libtorch
    /// pass, a snapshot or a save of it is an error.
    pub fn keep_only_cpu_packing(&mut self) -> Result<bool, ModelError> {
        #[cfg(target_arch = "x86_64")]
        {
            if self.held == Held::PackedOnly {
                return Ok(true);
            }
            self.check_weights_held()?;
            if !self.runs_on_cpu_kernels() || self.lora.is_some() {
                return Ok(false);
            }
            // Packed tensor by tensor, each freed once packed (unless other
            // models share it: their handles keep it), so packing needs one
            // tensor beside the model rather than a second copy of it; or
            // the packing of another model of the same shared weights.
            let shared = self.shared.take().map(|shared| shared.key.clone());
            crate::cpu::pack::pin_consuming(self, shared)?;
            self.drop_parameter_data();
            self.held = Held::PackedOnly;
            crate::device::release_freed_host_memory();
            Ok(true)
        }
        #[cfg(not(target_arch = "x86_64"))]
        Ok(false)
    }

    /// Frees the weights until [`Model::apply_snapshot`] brings new ones:
    /// a generator whose next step needs a newer version than it holds
    /// (`StepContext::weights_retired`), so that its copy does not sit
    /// beside the learner's update. Returns whether it did: not for a model
    /// whose snapshots carry only adapters (its base stays), one that shares
    /// its weights, or one already freed. Until the next snapshot every pass,
    /// save and export is an error.
    pub fn free_weights_until_snapshot(&mut self) -> bool {
        if self.held != Held::Weights || self.lora.is_some() || self.shared.is_some() {
            return false;
        }
        self.release_cpu_packing();
        let shapes = self.drop_parameter_data();
        self.held = Held::UntilSnapshot(shapes);
        crate::device::release_freed_host_memory();
        true
    }

    /// Replaces every parameter's data with an empty tensor of its dtype on
    /// its device (its handles elsewhere see the same); returns each one's
    /// name and former shape.
    fn drop_parameter_data(&mut self) -> Vec<(String, Vec<i64>)> {
        let _guard = tch::no_grad_guard();
        let mut shapes = Vec::new();
        for (name, mut var) in self.vs.variables() {
            shapes.push((name, var.size()));
            let empty = Tensor::empty([0], (var.kind(), var.device()));
            var.set_data(&empty);
        }
        shapes
    }

    /// Readies the parameters for a snapshot: weights freed until one
    /// ([`Model::free_weights_until_snapshot`]) get their shapes back,
    /// uninitialised (the snapshot fills each one); a model kept only
    /// packed refuses it.
    pub(crate) fn ready_for_snapshot(&mut self) -> Result<(), ModelError> {
        let Held::UntilSnapshot(shapes) = &self.held else {
            return self.check_weights_held();
        };
        let _guard = tch::no_grad_guard();
        let mut vars = self.vs.variables();
        for (name, shape) in shapes {
            if let Some(var) = vars.get_mut(name) {
                let fresh = Tensor::empty(shape.as_slice(), (var.kind(), var.device()));
                var.set_data(&fresh);
            }
        }
        Ok(())
    }

    /// An error once the weights were freed ([`Model::keep_only_cpu_packing`],
    /// [`Model::free_weights_until_snapshot`]).
    pub(crate) fn check_weights_held(&self) -> Result<(), ModelError> {
        let source = self.source.display();
        match self.held {
            Held::Weights => Ok(()),
            Held::PackedOnly => Err(ModelError::Input(format!(
                "{source}: this copy of the model keeps its weights only packed for the CPU kernels; \
                 it cannot run on libtorch, be saved or exchange snapshots"
            ))),
            Held::UntilSnapshot(_) => Err(ModelError::Input(format!(
                "{source}: this generator freed its weights until the learner's next version, \
                 and none arrived (a learner must publish weights at every step)"
            ))),
        }
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use tch::Kind;

    use crate::device::Device;
    use crate::generate::response_logprobs_on_cpu_kernels;
    use crate::model::Model;

    /// Two workers' references of one checkpoint in one process: the second
    /// adopts the first's packing (one copy of the weights) and scores
    /// alike; once neither lives, a later one loads and packs again.
    #[test]
    fn references_of_one_checkpoint_share_one_packing() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/models/tiny-llama");
        let load = || Model::load_shared(&dir, Device::Cpu, Kind::Float).unwrap();
        let (mut first, mut second) = (load(), load());
        if !first.runs_on_cpu_kernels() {
            return;
        }
        let prompts = vec![vec![1i64, 286, 202, 305], vec![302, 592]];
        let responses = vec![vec![5i64, 6, 7], vec![8, 9]];
        let before = response_logprobs_on_cpu_kernels(&first, &prompts, &responses, 1.0).unwrap();
        assert!(first.keep_only_cpu_packing().unwrap());
        assert!(second.keep_only_cpu_packing().unwrap());
        let packing = |m: &Model| crate::cpu::pack::packed(m).unwrap();
        assert!(std::sync::Arc::ptr_eq(&packing(&first), &packing(&second)));
        for model in [&first, &second] {
            assert!(model.named_tensors().iter().all(|(_, t)| t.numel() == 0));
            let after = response_logprobs_on_cpu_kernels(model, &prompts, &responses, 1.0).unwrap();
            assert_eq!(after, before);
        }
        drop((first, second));
        let mut later = load();
        assert!(later.named_tensors().iter().all(|(_, t)| t.numel() > 0));
        assert!(later.keep_only_cpu_packing().unwrap());
        let again = response_logprobs_on_cpu_kernels(&later, &prompts, &responses, 1.0).unwrap();
        assert_eq!(again, before);
    }
}
