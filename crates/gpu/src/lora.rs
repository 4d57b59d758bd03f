//! LoRA: low-rank adapters on a decoder's projections, trained while the
//! checkpoint's weights stay frozen.
//!
//! An adapted projection computes `W·x + (α / r)·B·A·dropout(x)` with
//! `A [r, in]` (Kaiming-uniform, bound `1/√in`, as PEFT initialises it,
//! from a fixed seed) and `B [out, r]` (zeros, so a fresh adapter changes
//! nothing). The adapters live in their own store under PEFT's names
//! (`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`), so:
//! - only they train ([`Model::trainable_tensors`]);
//! - a weights snapshot carries only them ([`Model::export_snapshot`]);
//! - a LoRA model saves as a PEFT adapter folder (`adapter_config.json`,
//!   `adapter_model.safetensors`) that `peft` loads onto the base model,
//!   and [`Model::load`] reads such a folder back (base and adapters);
//! - [`Model::merge_lora`] folds them into the weights for a plain
//!   HuggingFace checkpoint.
//!
//! Models whose weights never change (frozen bases, references) can share
//! one copy of a checkpoint per device: [`Model::load_shared`].

use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};

use tch::{nn, Kind, Tensor};

use crate::adapter::{add_var, delta, peft_name, Adapter, Lora};
pub use crate::adapter::{LoraConfig, ADAPTER_CONFIG, ADAPTER_WEIGHTS, TARGET_MODULES};
use crate::checkpoint::{SharedKey, SharedWeights};
use crate::config::Head;
use crate::device::Device;
use crate::error::ModelError;
use crate::model::Model;

impl Model {
    /// Attaches fresh adapters (`B = 0`: the model computes what it did)
    /// to the projections `config` targets, and freezes every other
    /// parameter. `A` is drawn from `seed`, so every process and rank that
    /// attaches with the same seed holds the same adapters.
    pub fn add_lora(&mut self, config: &LoraConfig, seed: u64) -> Result<(), ModelError> {
        config
            .check()
            .map_err(|(field, why)| ModelError::Input(format!("lora: {field} {why}")))?;
        if self.lora.is_some() {
            return Err(ModelError::Input("the model already has adapters".into()));
        }
        if self.config.head != Head::CausalLm {
            return Err(ModelError::Input(format!(
                "lora: {} is not a causal LM",
                self.config.architecture
            )));
        }
        let (kind, device) = (self.kind(), self.device());
        let vs = nn::VarStore::new(device);
        let training = Arc::new(AtomicBool::new(false));
        let mut by_weight = HashMap::new();
        let mut stream = seed;
        for (module, proj) in self.decoder.projections_mut() {
            let short = module.rsplit('.').next().unwrap_or_default();
            if !config.target_modules.iter().any(|t| t == short) {
                continue;
            }
            let (outputs, inputs) = (proj.base.ws.size()[0], proj.base.ws.size()[1]);
            let bound = 1.0 / (inputs as f64).sqrt();
            stream = stream.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let values =
                crate::model::seeded_uniform((config.rank * inputs) as usize, bound, stream);
            let a = Tensor::from_slice(&values)
                .view([config.rank, inputs])
                .to_kind(kind)
                .to_device(device);
            let b = Tensor::zeros([outputs, config.rank], (kind, device));
            let a = add_var(&vs, &peft_name(&module, "A"), a);
            let b = add_var(&vs, &peft_name(&module, "B"), b);
            by_weight.insert(
                format!("model.{module}.weight"),
                (a.shallow_clone(), b.shallow_clone()),
            );
            proj.adapter = Some(Adapter {
                a,
                b,
                scale: config.scale(),
                dropout: config.dropout,
                training: training.clone(),
            });
        }
        self.vs.freeze();
        self.lora = Some(Lora {
            config: config.clone(),
            vs,
            by_weight,
            training,
        });
        Ok(())
    }

    /// The adapters' shape, if the model has adapters.
    pub fn lora(&self) -> Option<&LoraConfig> {
        self.lora.as_ref().map(|l| &l.config)
    }

    /// The adapters by PEFT name, sorted (empty without adapters).
    pub fn adapter_tensors(&self) -> Vec<(String, Tensor)> {
        let mut all: Vec<(String, Tensor)> = self
            .lora
            .as_ref()
            .map(|l| l.vs.variables().into_iter().collect())
            .unwrap_or_default();
        all.sort_by(|a, b| a.0.cmp(&b.0));
        all
    }

    /// What an optimizer updates, by name, sorted: the adapters of a LoRA
    /// model, else every parameter that requires a gradient.
    pub fn trainable_tensors(&self) -> Vec<(String, Tensor)> {
        if self.lora.is_some() {
            return self.adapter_tensors();
        }
        self.named_tensors()
            .into_iter()
            .filter(|(_, t)| t.requires_grad())
            .collect()
    }

    /// What a weights snapshot carries: the adapters of a LoRA model (the
    /// frozen weights never change), else every parameter.
    pub fn snapshot_tensors(&self) -> Vec<(String, Tensor)> {
        if self.lora.is_some() {
            self.adapter_tensors()
        } else {
            self.named_tensors()
        }
    }

    /// Adapter dropout on until the guard drops: wrap a training forward
    /// pass in it (the log-prob passes run without dropout).
    pub fn training(&self) -> TrainingGuard<'_> {
        if let Some(lora) = &self.lora {
            lora.training.store(true, Ordering::Relaxed);
        }
        TrainingGuard(self)
    }

    /// Every parameter by name with the adapters folded in (`W + scale·B·A`
    /// as new tensors; the model is unchanged): the weights that compute
    /// what this model computes without adapters.
    pub fn merged_tensors(&self) -> Vec<(String, Tensor)> {
        self.named_tensors()
            .into_iter()
            .map(|(name, t)| {
                let merged = self.merged_tensor(&name, &t);
                (name, merged)
            })
            .collect()
    }

    /// Parameter `name` (whose value is `t`) with its adapter folded in, or
    /// `t` itself when no adapter sits on it; one tensor at a time, so a
    /// caller that packs weights one by one never holds a merged copy of
    /// them all.
    pub fn merged_tensor(&self, name: &str, t: &Tensor) -> Tensor {
        let _guard = tch::no_grad_guard();
        let adapter = self
            .lora
            .as_ref()
            .and_then(|l| Some((l.by_weight.get(name)?, l.config.scale())));
        match adapter {
            Some(((a, b), scale)) => t + delta(a, b, scale).to_kind(t.kind()),
            None => t.shallow_clone(),
        }
    }

    /// Folds the adapters into the weights and drops them: the model is a
    /// plain checkpoint again (all of it trainable), computing the same.
    pub fn merge_lora(&mut self) -> Result<(), ModelError> {
        if self.lora.is_none() {
            return Err(ModelError::Input(
                "the model has no adapters to merge".into(),
            ));
        }
        if self.shared.is_some() {
            return Err(ModelError::Input(
                "the model's weights are shared with other models: load it alone to merge".into(),
            ));
        }
        {
            let _guard = tch::no_grad_guard();
            for (_, proj) in self.decoder.projections_mut() {
                if let Some(adapter) = proj.adapter.take() {
                    let update = delta(&adapter.a, &adapter.b, adapter.scale);
                    let _ = proj.base.ws.f_add_(&update.to_kind(proj.base.ws.kind()))?;
                }
            }
        }
        self.lora = None;
        self.vs.unfreeze();
        Ok(())
    }

    /// Loads the adapter weights of PEFT folder `dir` into this model's
    /// adapters (attached with the folder's config).
    pub fn load_adapter_weights(&self, dir: &Path) -> Result<(), ModelError> {
        let path = dir.join(ADAPTER_WEIGHTS);
        let bytes = std::fs::read(&path).map_err(|e| ModelError::io(&path, e))?;
        let (tensors, _) = crate::snapshot::from_safetensors(&bytes)
            .map_err(|e| ModelError::Input(format!("{}: {e}", path.display())))?;
        // PEFT may save names with the adapter's name (`lora_A.default.weight`).
        let mut incoming: HashMap<String, Tensor> = tensors
            .into_iter()
            .map(|(n, t)| (n.replace(".default.weight", ".weight"), t))
            .collect();
        crate::snapshot::copy_into(
            self.adapter_tensors(),
            &path.display().to_string(),
            |name| Ok(incoming.remove(name)),
        )
    }

    /// A PEFT adapter folder: its base model (from `base_model_name_or_path`)
    /// with the folder's adapters.
    pub(crate) fn load_adapter_folder(
        dir: &Path,
        device: Device,
        kind: Kind,
    ) -> Result<Self, ModelError> {
        let (config, base) = LoraConfig::read_peft(dir)?;
        let mut model = Model::load(&base, device, kind).map_err(|e| match e {
            ModelError::Io { path, message } => ModelError::Input(format!(
                "{}: base model `{path}`: {message}",
                dir.join(ADAPTER_CONFIG).display()
            )),
            other => other,
        })?;
        model.add_lora(&config, 0)?;
        model.load_adapter_weights(dir)?;
        Ok(model)
    }

    /// Saves the adapters as a PEFT folder: `adapter_config.json` (the base
    /// is this model's source), `adapter_model.safetensors` (in `kind`),
    /// and the source's tokenizer and generation files.
    pub(crate) fn save_adapters(&self, dir: &Path, kind: Kind) -> Result<(), ModelError> {
        let lora = self.lora.as_ref().expect("called on a LoRA model");
        std::fs::create_dir_all(dir).map_err(|e| ModelError::io(dir, e))?;
        let base = std::fs::canonicalize(&self.source).unwrap_or_else(|_| self.source.clone());
        let config = serde_json::to_string_pretty(&lora.config.to_peft_json(&base))
            .expect("JSON values serialise");
        crate::snapshot::write_atomically(&dir.join(ADAPTER_CONFIG), config.as_bytes())?;
        crate::snapshot::save_safetensors(
            &dir.join(ADAPTER_WEIGHTS),
            &self.adapter_tensors(),
            Some(kind),
            &HashMap::new(),
        )?;
        self.copy_side_files(dir)
    }

    /// `dir`'s checkpoint on `device` in `kind`, its weights shared with
    /// every other model loaded this way from the same folder, device and
    /// dtype while one of them lives (one copy, not one per role). The
    /// weights are frozen: such a model is a reference or the frozen base
    /// of a LoRA model, never trained itself.
    pub fn load_shared(dir: &Path, device: Device, kind: Kind) -> Result<Self, ModelError> {
        let (base, loaded) = SharedWeights::get(dir, device, kind)?;
        // The model that loaded the weights holds them already; another
        // gets handles to them in place of its placeholders.
        let mut model = match loaded {
            Some(model) if model.lora.is_none() => model,
            _ => {
                // No placeholders: every parameter gets the shared data.
                let model = Model::filled(
                    base.config.clone(),
                    device,
                    dir,
                    crate::decoder::Fill::Unset,
                    kind,
                )?;
                let _guard = tch::no_grad_guard();
                for (name, mut var) in model.vs.variables() {
                    let shared =
                        base.tensors
                            .get(&name)
                            .ok_or_else(|| ModelError::MissingTensor {
                                path: dir.display().to_string(),
                                name: name.clone(),
                            })?;
                    var.set_data(shared);
                }
                model
            }
        };
        model.vs.freeze();
        model.shared = Some(base);
        // The placeholder tensors `set_data` replaced are freed.
        crate::device::release_freed_host_memory();
        Ok(model)
    }
}

/// Adapter dropout is on while this lives ([`Model::training`]).
#[must_use = "dropout is on only while the guard lives"]
pub struct TrainingGuard<'a>(&'a Model);

impl Drop for TrainingGuard<'_> {
    fn drop(&mut self) {
        if let Some(lora) = &self.0.lora {
            lora.training.store(false, Ordering::Relaxed);
        }
    }
}

fn shared_registry() -> &'static Mutex<HashMap<SharedKey, Weak<SharedWeights>>> {
    static REGISTRY: std::sync::OnceLock<Mutex<HashMap<SharedKey, Weak<SharedWeights>>>> =
        std::sync::OnceLock::new();
    REGISTRY.get_or_init(Default::default)
}

impl SharedWeights {
    /// The weights of `dir` on `device` in `kind`, and the model that
    /// loaded them when this call did (its tensors are the shared ones).
    fn get(
        dir: &Path,
        device: Device,
        kind: Kind,
    ) -> Result<(Arc<Self>, Option<Model>), ModelError> {
        let canonical = std::fs::canonicalize(dir).map_err(|e| ModelError::io(dir, e))?;
        let key = (canonical, format!("{device:?}"), format!("{kind:?}"));
        // Held while loading: two roles asking at once load once.
        let mut registry = shared_registry().lock().unwrap_or_else(|e| e.into_inner());
        registry.retain(|_, weak| weak.strong_count() > 0);
        if let Some(found) = registry.get(&key).and_then(Weak::upgrade) {
            return Ok((found, None));
        }
        let model = Model::load(dir, device, kind)?;
        let tensors = model
            .named_tensors()
            .into_iter()
            .map(|(name, t)| (name, t.detach()))
            .collect();
        let shared = Arc::new(SharedWeights {
            key: key.clone(),
            config: model.config.clone(),
            tensors,
        });
        registry.insert(key, Arc::downgrade(&shared));
        Ok((shared, Some(model)))
    }
}
