//! `Model`: a HuggingFace decoder checkpoint loaded for inference and training.
//!
//! # Examples
//! ```no_run
//! use weir_gpu::{Model, Device};
//!
//! let model = Model::load("checkpoints/tiny-llama".as_ref(), Device::Cpu, tch::Kind::Float).unwrap();
//! let ids = tch::Tensor::from_slice(&[1i64, 5, 9, 2]).view([1, 4]);
//! let logprobs = model.token_logprobs(&ids, None, 1.0).unwrap(); // [1, 3]
//! ```

use std::path::{Path, PathBuf};

use tch::nn::{self, Module};
use tch::{Kind, Tensor};

use crate::checkpoint::{check_config_fits, visit_tensors};
use crate::config::{Head, ModelConfig};
use crate::decoder::{linear, Decoder, Fill, KvCache, PackedLayout};
use crate::device::Device;
use crate::error::ModelError;

/// A decoder-only model with its head.
#[derive(Debug)]
pub struct Model {
    /// The configuration it was built from.
    pub config: ModelConfig,
    /// Where it was loaded from.
    pub source: PathBuf,
    pub(crate) vs: nn::VarStore,
    pub(crate) decoder: Decoder,
    lm_head: Option<nn::Linear>,
    score: Option<nn::Linear>,
    /// LoRA adapters, once attached ([`Model::add_lora`]).
    pub(crate) lora: Option<crate::adapter::Lora>,
    /// The weights this model shares with others ([`Model::load_shared`]).
    pub(crate) shared: Option<std::sync::Arc<crate::checkpoint::SharedWeights>>,
    /// Packed weights for the CPU generation kernels, made on first use.
    #[cfg(target_arch = "x86_64")]
    pub(crate) prepared: crate::cpu::prepared::Prepared,
    /// Where the weights are: here, or freed (see [`Held`]).
    pub(crate) held: Held,
}

/// Whether a [`Model`] holds its weights.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Held {
    /// In its parameters, as loaded or updated.
    Weights,
    /// Only in the CPU kernels' packing ([`Model::keep_only_cpu_packing`]).
    PackedOnly,
    /// Nowhere until the next snapshot arrives
    /// ([`Model::free_weights_until_snapshot`]); each parameter's name and shape.
    UntilSnapshot(Vec<(String, Vec<i64>)>),
}

impl Model {
    /// Loads `dir` (config.json + safetensors) onto `device`, computing in `kind`.
    /// A PEFT adapter folder (`adapter_config.json`, no `config.json`)
    /// loads as its base model with the adapters attached.
    pub fn load(dir: &Path, device: Device, kind: Kind) -> Result<Self, ModelError> {
        if dir.join(crate::adapter::ADAPTER_CONFIG).is_file() && !dir.join("config.json").is_file()
        {
            return Model::load_adapter_folder(dir, device, kind);
        }
        let config = ModelConfig::load(dir)?;
        check_config_fits(dir, &config)?;
        // Each parameter is made in `kind` and written once from its file:
        // the load holds the weights' bytes in `kind` plus one file tensor,
        // never a float32 copy of a bf16 model.
        let mut model = Model::filled(config, device, dir, Fill::Uninit, kind)?;
        model.load_weights(dir)?;
        // The file's tensors are freed: give their pages back.
        crate::device::release_freed_host_memory();
        Ok(model)
    }

    /// A critic: a value on every position. A sequence-classification
    /// checkpoint (a reward model) is loaded as it is; a causal LM gets a
    /// fresh one-output `score` head, initialised N(0, 1/(hidden + 1)) as
    /// OpenRLHF initialises its value head, from a fixed seed: the same
    /// head in every run, process and data-parallel rank.
    pub fn load_critic(dir: &Path, device: Device, kind: Kind) -> Result<Self, ModelError> {
        let mut config = ModelConfig::load(dir)?;
        if config.head == Head::SequenceClassification {
            if config.num_labels != 1 {
                return Err(ModelError::config(
                    &dir.join("config.json"),
                    "num_labels",
                    format!("a critic needs 1 label, found {}", config.num_labels),
                ));
            }
            return Model::load(dir, device, kind);
        }
        check_config_fits(dir, &config)?;
        config.head = Head::SequenceClassification;
        config.num_labels = 1;
        // The head is written here, every other parameter from the file.
        let mut model = Model::filled(config, device, dir, Fill::Uninit, kind)?;
        let std = 1.0 / (model.config.hidden_size as f64 + 1.0);
        if let Some(score) = &mut model.score {
            let values = seeded_normal(score.ws.numel(), std, 0x5eed);
            let _guard = tch::no_grad_guard();
            score
                .ws
                .copy_(&Tensor::from_slice(&values).view(score.ws.size().as_slice()));
        }
        model.load_weights_except(dir, &["score.weight"])?;
        Ok(model)
    }

    /// A model for `config` with zero weights (norms at one), to be loaded
    /// or initialised.
    pub fn new(config: ModelConfig, device: Device, source: &Path) -> Result<Self, ModelError> {
        Model::filled(config, device, source, Fill::Zeros, Kind::Float)
    }

    /// A model whose parameters are made in `kind`, the large ones filled
    /// as `fill` says.
    pub(crate) fn filled(
        config: ModelConfig,
        device: Device,
        source: &Path,
        fill: Fill,
        kind: Kind,
    ) -> Result<Self, ModelError> {
        let mut vs = nn::VarStore::new(device.to_tch()?);
        // Of an empty store: the kind its new variables are made in.
        vs.set_kind(kind);
        let root = vs.root();
        let decoder = Decoder::new(&root / "model", &config, fill);
        let lm_head = (config.head == Head::CausalLm && !config.tie_word_embeddings).then(|| {
            linear(
                &root / "lm_head",
                config.hidden_size,
                config.vocab_size,
                false,
                fill,
            )
        });
        let score = (config.head == Head::SequenceClassification).then(|| {
            linear(
                &root / "score",
                config.hidden_size,
                config.num_labels,
                false,
                fill,
            )
        });
        Ok(Model {
            config,
            source: source.to_path_buf(),
            vs,
            decoder,
            lm_head,
            score,
            lora: None,
            shared: None,
            #[cfg(target_arch = "x86_64")]
            prepared: Default::default(),
            held: Held::Weights,
        })
    }

    /// Fresh weights as transformers initialises a new model: every matrix
    /// and embedding from N(0, std²) (`initializer_range`), norms at 1,
    /// biases at 0; seeded, so the same seed gives the same model.
    pub fn init_weights(&mut self, std: f64, seed: i64) {
        tch::manual_seed(seed);
        let _guard = tch::no_grad_guard();
        let mut vars: Vec<(String, Tensor)> = self.vs.variables().into_iter().collect();
        vars.sort_by(|a, b| a.0.cmp(&b.0));
        for (name, mut t) in vars {
            if name.ends_with("norm.weight") {
                let _ = t.fill_(1.0);
            } else if name.ends_with(".bias") {
                let _ = t.zero_();
            } else {
                let _ = t.normal_(0.0, std);
            }
        }
    }

    /// Copies every parameter from the checkpoint in `dir`, checking names and shapes.
    pub fn load_weights(&mut self, dir: &Path) -> Result<(), ModelError> {
        self.load_weights_except(dir, &[])
    }

    fn load_weights_except(&mut self, dir: &Path, keep: &[&str]) -> Result<(), ModelError> {
        let mut vars: std::collections::BTreeMap<String, Tensor> = self
            .vs
            .variables()
            .into_iter()
            .filter(|(name, _)| !keep.contains(&name.as_str()))
            .collect();
        let _guard = tch::no_grad_guard();
        let mut unused = std::collections::BTreeSet::new();
        visit_tensors(dir, |name, tensor, file| {
            let Some(mut var) = vars.remove(name) else {
                // An output head beside tied embeddings or a score head, and
                // rotary buffers older transformers saved, are no mismatch.
                let benign = name == "lm_head.weight" || name.ends_with("rotary_emb.inv_freq");
                if !benign && !keep.contains(&name) {
                    unused.insert(name.to_string());
                }
                return Ok(());
            };
            if tensor.size() != var.size() {
                return Err(ModelError::ShapeMismatch {
                    path: file.display().to_string(),
                    name: name.to_string(),
                    expected: var.size(),
                    found: tensor.size(),
                });
            }
            var.f_copy_(&tensor.to_kind(var.kind()))?;
            Ok(())
        })?;
        if let Some(name) = vars.into_keys().next() {
            return Err(ModelError::MissingTensor {
                path: dir.display().to_string(),
                name,
            });
        }
        match unused.iter().next() {
            Some(first) => Err(ModelError::UnusedTensors {
                path: dir.display().to_string(),
                count: unused.len(),
                first: first.clone(),
            }),
            None => Ok(()),
        }
    }

    /// The parameters, by HuggingFace name.
    pub fn var_store(&self) -> &nn::VarStore {
        &self.vs
    }

    /// The parameters, mutably (for optimisers and dtype changes).
    pub fn var_store_mut(&mut self) -> &mut nn::VarStore {
        &mut self.vs
    }

    /// The compute dtype.
    pub fn kind(&self) -> Kind {
        self.decoder.embed.kind()
    }

    /// The device.
    pub fn device(&self) -> tch::Device {
        self.vs.device()
    }

    /// Final hidden states `[B, T, hidden]`. `attention_mask` `[B, T]` (1 =
    /// token, 0 = padding); `position_ids` default to `cumsum(mask) − 1`
    /// (padding slots 1), as transformers' generate does. Without a mask,
    /// attention is plain causal (SDPA's `is_causal`, no bias tensor, so a
    /// fused kernel may run) and positions are `0..T`: exact for rows with
    /// no padding or with padding only on the right, whose real tokens never
    /// see a later (padding) position.
    pub fn hidden_states(
        &self,
        input_ids: &Tensor,
        attention_mask: Option<&Tensor>,
        position_ids: Option<&Tensor>,
    ) -> Result<Tensor, ModelError> {
        let (ids, mask, positions) = self.inputs(input_ids, attention_mask, position_ids)?;
        Ok(self.decoder.forward(&ids, mask.as_ref(), &positions, None))
    }

    /// Final hidden states `[1, T, hidden]` of rows packed into `input_ids`
    /// `[1, T]` as `layout` lays them out ([`PackedLayout::rows`]: end to
    /// end, each attending within itself, its positions from 0; or with a
    /// group's shared prompt packed once): every row's states are those it
    /// has run alone, and no position is spent on padding.
    pub fn hidden_states_packed(
        &self,
        input_ids: &Tensor,
        layout: &PackedLayout,
    ) -> Result<Tensor, ModelError> {
        let (ids, positions) = self.packed_inputs(input_ids, layout)?;
        Ok(self.decoder.forward_packed(&ids, layout, &positions))
    }

    /// [`Model::backward_checkpointed_hidden`] over rows packed as
    /// [`Model::hidden_states_packed`] runs them.
    pub fn backward_checkpointed_hidden_packed<E: From<ModelError>>(
        &self,
        input_ids: &Tensor,
        layout: &PackedLayout,
        loss_of: impl FnOnce(&Tensor) -> Result<Tensor, E>,
    ) -> Result<Tensor, E> {
        let (ids, positions) = self.packed_inputs(input_ids, layout)?;
        self.decoder
            .backward_checkpointed_packed(&ids, layout, &positions, loss_of)
    }

    /// Checked packed ids and the layout's positions.
    fn packed_inputs(
        &self,
        input_ids: &Tensor,
        layout: &PackedLayout,
    ) -> Result<(Tensor, Tensor), ModelError> {
        self.check_weights_held()?;
        let ids = self.check_ids(input_ids)?;
        let total = layout.len() as i64;
        if ids.size() != [1, total] {
            return Err(ModelError::Input(format!(
                "packed ids of shape {:?} for a layout of {total} positions",
                ids.size()
            )));
        }
        layout.check().map_err(ModelError::Input)?;
        let positions = Tensor::from_slice(&layout.positions)
            .view([1, total])
            .to_device(self.device());
        Ok((ids, positions))
    }

    /// Checked ids, mask and positions on the model's device. Without a
    /// mask, attention is plain causal and positions count from 0.
    fn inputs(
        &self,
        input_ids: &Tensor,
        attention_mask: Option<&Tensor>,
        position_ids: Option<&Tensor>,
    ) -> Result<(Tensor, Option<Tensor>, Tensor), ModelError> {
        self.check_weights_held()?;
        let ids = self.check_ids(input_ids)?;
        let mask = match attention_mask {
            Some(m) if m.size() == ids.size() => {
                Some(m.to_device(self.device()).to_kind(Kind::Int64))
            }
            Some(m) => {
                return Err(ModelError::Input(format!(
                    "attention mask has shape {:?}, input ids {:?}",
                    m.size(),
                    ids.size()
                )))
            }
            None => None,
        };
        let positions = match (position_ids, &mask) {
            (Some(p), _) => p.to_device(self.device()).to_kind(Kind::Int64),
            (None, Some(mask)) => default_positions(mask),
            (None, None) => {
                let (b, t) = (ids.size()[0], ids.size()[1]);
                Tensor::arange(t, (Kind::Int64, ids.device()))
                    .view([1, t])
                    .expand([b, t], false)
            }
        };
        Ok((ids, mask, positions))
    }

    /// Gradient checkpointing for a causal LM: computes `loss_of(logits)`
    /// (logits `[B, T, vocab]` as [`Model::logits`] gives them) and
    /// backpropagates it into the parameters' gradients, keeping one hidden
    /// state per layer instead of every activation (see
    /// [`Decoder::backward_checkpointed`](crate::decoder::Decoder::backward_checkpointed)).
    /// Returns the loss, detached; gradients accumulate as with `backward`.
    pub fn backward_checkpointed<E: From<ModelError>>(
        &self,
        input_ids: &Tensor,
        attention_mask: Option<&Tensor>,
        loss_of: impl FnOnce(&Tensor) -> Result<Tensor, E>,
    ) -> Result<Tensor, E> {
        self.backward_checkpointed_hidden(input_ids, attention_mask, |hidden| {
            loss_of(&self.lm_logits(hidden)?)
        })
    }

    /// Gradient checkpointing as [`Model::backward_checkpointed`], with
    /// `loss_of` given the final hidden states `[B, T, hidden]` instead of
    /// the logits (for a head applied in chunks, see
    /// [`crate::logprobs::head_backward_chunked`]).
    pub fn backward_checkpointed_hidden<E: From<ModelError>>(
        &self,
        input_ids: &Tensor,
        attention_mask: Option<&Tensor>,
        loss_of: impl FnOnce(&Tensor) -> Result<Tensor, E>,
    ) -> Result<Tensor, E> {
        let (ids, mask, positions) = self.inputs(input_ids, attention_mask, None)?;
        self.decoder
            .backward_checkpointed(&ids, mask.as_ref(), &positions, loss_of)
    }

    /// The output head's weight `[vocab, hidden]` (the embedding when tied):
    /// `lm_logits(h) = h · Wᵀ`. It shares storage and gradient with the parameter.
    pub fn lm_weight(&self) -> Result<Tensor, ModelError> {
        self.check_weights_held()?;
        match (&self.lm_head, self.config.head) {
            (Some(head), _) => Ok(head.ws.shallow_clone()),
            (None, Head::CausalLm) => Ok(self.decoder.embed.shallow_clone()),
            (None, Head::SequenceClassification) => Err(ModelError::Input(format!(
                "{} has no LM head",
                self.config.architecture
            ))),
        }
    }

    /// Logits `[B, T, vocab]` of a causal LM.
    pub fn logits(
        &self,
        input_ids: &Tensor,
        attention_mask: Option<&Tensor>,
        position_ids: Option<&Tensor>,
    ) -> Result<Tensor, ModelError> {
        let hidden = self.hidden_states(input_ids, attention_mask, position_ids)?;
        self.lm_logits(&hidden)
    }

    /// `log p(token t | tokens < t)` for t = 1..T, `[B, T − 1]`, from logits divided by `temperature`.
    pub fn token_logprobs(
        &self,
        input_ids: &Tensor,
        attention_mask: Option<&Tensor>,
        temperature: f64,
    ) -> Result<Tensor, ModelError> {
        let logits = self.logits(input_ids, attention_mask, None)?;
        let t = logits.size()[1];
        let ids = input_ids.to_device(self.device()).to_kind(Kind::Int64);
        Ok(crate::logprobs::gather_logprobs(
            &logits.narrow(1, 0, t - 1),
            &ids.narrow(1, 1, t - 1),
            temperature,
        ))
    }

    /// Scores `[B, num_labels]` of a sequence-classification model, taken at
    /// each row's rightmost token that is not the padding id (as transformers
    /// pools) among those `attention_mask` keeps (all without one).
    pub fn scores(
        &self,
        input_ids: &Tensor,
        attention_mask: Option<&Tensor>,
    ) -> Result<Tensor, ModelError> {
        let hidden = self.hidden_states(input_ids, attention_mask, None)?;
        let kept = attention_mask.map(|m| m.to_device(hidden.device()).ne(0));
        self.pool_scores(&hidden, input_ids, kept)
    }

    /// [`Model::scores`] of right-padded rows of `lengths` real tokens each,
    /// run without an attention mask (a real token never attends to the
    /// padding on its right): each row is scored within its own length, so
    /// its score does not depend on the rows beside it, whether or not the
    /// checkpoint has a padding id.
    pub fn scores_of_rows(
        &self,
        input_ids: &Tensor,
        lengths: &[i64],
    ) -> Result<Tensor, ModelError> {
        let hidden = self.hidden_states(input_ids, None, None)?;
        let t = input_ids.size()[1];
        let device = hidden.device();
        let lengths = Tensor::from_slice(lengths).to_device(device).unsqueeze(1);
        let kept = Tensor::arange(t, (Kind::Int64, device))
            .unsqueeze(0)
            .lt_tensor(&lengths);
        self.pool_scores(&hidden, input_ids, Some(kept))
    }

    /// The score head at each row's rightmost position that `kept` keeps
    /// (all when `None`) and that does not hold the padding id.
    fn pool_scores(
        &self,
        hidden: &Tensor,
        input_ids: &Tensor,
        kept: Option<Tensor>,
    ) -> Result<Tensor, ModelError> {
        let score = self.score_head()?;
        let ids = input_ids.to_device(hidden.device()).to_kind(Kind::Int64);
        let t = ids.size()[1];
        let mut real = match kept {
            Some(kept) => kept,
            None => ids.ones_like().to_kind(Kind::Bool),
        };
        if let Some(pad) = self.config.pad_token_id {
            real = real.logical_and(&ids.ne(pad));
        }
        let last = (real.to_kind(Kind::Int64) * Tensor::arange(t, (Kind::Int64, ids.device())))
            .argmax(-1, false);
        let (b, h) = (ids.size()[0], self.config.hidden_size);
        let pooled = hidden
            .gather(1, &last.view([b, 1, 1]).expand([b, 1, h], false), false)
            .squeeze_dim(1);
        Ok(score.forward(&pooled))
    }

    /// Per-position scores `[B, T, num_labels]` (a critic's values).
    pub fn position_scores(
        &self,
        input_ids: &Tensor,
        attention_mask: Option<&Tensor>,
    ) -> Result<Tensor, ModelError> {
        let score = self.score_head()?;
        Ok(score.forward(&self.hidden_states(input_ids, attention_mask, None)?))
    }

    /// [`Model::position_scores`] of rows packed as [`Model::hidden_states_packed`] runs them: `[1, T, labels]`.
    pub fn position_scores_packed(
        &self,
        input_ids: &Tensor,
        layout: &PackedLayout,
    ) -> Result<Tensor, ModelError> {
        let score = self.score_head()?;
        Ok(score.forward(&self.hidden_states_packed(input_ids, layout)?))
    }

    fn score_head(&self) -> Result<&nn::Linear, ModelError> {
        self.score.as_ref().ok_or_else(|| {
            ModelError::Input(format!("{} has no score head", self.config.architecture))
        })
    }

    /// Logits for hidden states `[.., hidden]`.
    pub fn lm_logits(&self, hidden: &Tensor) -> Result<Tensor, ModelError> {
        match (&self.lm_head, self.config.head) {
            (Some(head), _) => Ok(head.forward(hidden)),
            (None, Head::CausalLm) => Ok(hidden.matmul(&self.decoder.embed.tr())),
            (None, Head::SequenceClassification) => Err(ModelError::Input(format!(
                "{} has no LM head",
                self.config.architecture
            ))),
        }
    }

    /// Runs new tokens through the decoder with a KV cache; returns hidden states of the new tokens.
    pub fn forward_cached(
        &self,
        input_ids: &Tensor,
        key_mask: &Tensor,
        position_ids: &Tensor,
        cache: &mut KvCache,
    ) -> Tensor {
        self.decoder
            .forward(input_ids, Some(key_mask), position_ids, Some(cache))
    }

    /// The CPU kernels' packed weights of this model.
    #[cfg(target_arch = "x86_64")]
    pub(crate) fn prepared_for_cpu(&self) -> &crate::cpu::prepared::Prepared {
        &self.prepared
    }

    /// Frees what the CPU kernels keep between calls (the packed weights,
    /// the KV-cache buffer) when the caller knows the weights change before
    /// the next call, so it does not sit beside the next phase's memory.
    /// A no-op elsewhere; the next call packs again.
    pub fn release_cpu_packing(&self) {
        #[cfg(target_arch = "x86_64")]
        self.prepared.release();
    }

    /// The model's rotary position tables.
    pub(crate) fn rope(&self) -> &crate::rope::Rope {
        self.decoder.rope()
    }

    /// An empty KV cache for this model.
    pub fn new_cache(&self) -> KvCache {
        KvCache::new(self.decoder.num_layers())
    }

    /// True when `Backend::Auto` runs this model on weir's CPU kernels: a
    /// float32 causal LM on an x86-64 CPU with AVX2 and FMA.
    pub fn runs_on_cpu_kernels(&self) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            self.device() == tch::Device::Cpu
                && self.kind() == Kind::Float
                && self.config.head == Head::CausalLm
                && crate::cpu::gemm::supported()
        }
        #[cfg(not(target_arch = "x86_64"))]
        false
    }

    /// Every prompt non-empty, and every id of `prompts` and `more` in the vocabulary.
    pub(crate) fn check_token_ids(
        &self,
        prompts: &[Vec<i64>],
        more: &[Vec<i64>],
    ) -> Result<(), ModelError> {
        if let Some(i) = prompts.iter().position(Vec::is_empty) {
            return Err(ModelError::Input(format!("prompt {i} is empty")));
        }
        let vocab = self.config.vocab_size;
        match prompts
            .iter()
            .chain(more)
            .flatten()
            .find(|&&id| id < 0 || id >= vocab)
        {
            Some(id) => Err(ModelError::Input(format!(
                "the token id {id} lies outside the vocabulary 0..{vocab}"
            ))),
            None => Ok(()),
        }
    }

    fn check_ids(&self, input_ids: &Tensor) -> Result<Tensor, ModelError> {
        if input_ids.dim() != 2 || input_ids.size()[1] == 0 {
            return Err(ModelError::Input(format!(
                "input ids must be [batch, length>0], got {:?}",
                input_ids.size()
            )));
        }
        // Ids on the host are checked there, before the copy to the device;
        // ids already on an accelerator are not (reading them back would
        // wait for the device on every forward): whoever made them there
        // checked them (`pack_for`) or sampled them from this vocabulary.
        if input_ids.device() == tch::Device::Cpu {
            let ids = input_ids.to_kind(Kind::Int64);
            let (min, max) = (ids.min().int64_value(&[]), ids.max().int64_value(&[]));
            if min < 0 || max >= self.config.vocab_size {
                return Err(ModelError::Input(format!(
                    "token ids must lie in 0..{}, found {}",
                    self.config.vocab_size,
                    if min < 0 { min } else { max }
                )));
            }
        }
        Ok(input_ids.to_device(self.device()).to_kind(Kind::Int64))
    }
}

/// `cumsum(mask) − 1`, with padding slots set to 1 (transformers' generate convention).
pub fn default_positions(mask: &Tensor) -> Tensor {
    let positions = mask.cumsum(1, Kind::Int64) - 1;
    positions.masked_fill(&mask.eq(0), 1)
}

/// Uniform draws in (0, 1] from `seed` (splitmix64): the same for the
/// same seed (libtorch's generator is global and shared between threads).
fn seeded_unit(seed: u64) -> impl FnMut() -> f64 {
    let mut state = seed;
    move || {
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        // In (0, 1]: a logarithm of it stays finite.
        ((z >> 11) as f64 + 1.0) / (1u64 << 53) as f64
    }
}

/// `n` draws from U(−bound, bound), the same for the same `seed`.
pub(crate) fn seeded_uniform(n: usize, bound: f64, seed: u64) -> Vec<f32> {
    let mut unit = seeded_unit(seed);
    (0..n)
        .map(|_| ((2.0 * unit() - 1.0) * bound) as f32)
        .collect()
}

/// `n` draws from N(0, std²), the same for the same `seed` (Box–Muller).
fn seeded_normal(n: usize, std: f64, seed: u64) -> Vec<f32> {
    let mut uniform = seeded_unit(seed);
    (0..n)
        .map(|_| {
            let (u, v) = (uniform(), uniform());
            ((-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos() * std) as f32
        })
        .collect()
}

#[cfg(test)]
mod tests {
    #[test]
    fn seeded_normal_draws_repeat_and_have_the_asked_spread() {
        let a = super::seeded_normal(20_000, 0.5, 7);
        assert_eq!(a, super::seeded_normal(20_000, 0.5, 7));
        assert_ne!(a, super::seeded_normal(20_000, 0.5, 8));
        let n = a.len() as f64;
        let mean = a.iter().map(|&x| x as f64).sum::<f64>() / n;
        let var = a.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n;
        assert!(mean.abs() < 0.02, "mean {mean}");
        assert!((var.sqrt() - 0.5).abs() < 0.02, "std {}", var.sqrt());
    }
}
