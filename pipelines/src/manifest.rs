//! The rollout log's manifest, `rollouts/manifest.json`: what produced the
//! rows — the schema version, weir's version, the pipeline, hashes of the
//! policy's weights, tokenizer and chat template, of the resolved config,
//! and the sampler's parameters and seed. A replay refuses a log whose
//! model differs from the one it would load, and training from a log
//! refuses one whose tokenizer differs (its token ids would mean other
//! text), each with one line naming what differs.

use std::io::Read;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use weir_operators::rollout::SCHEMA_VERSION;
use weir_operators::rollout_log::MANIFEST;

use crate::{PipelineError, PipelineKind, RunConfig};

/// What a checkpoint folder is, as hashes.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelHashes {
    /// The folder the run read.
    pub path: PathBuf,
    /// SHA-256 over its `*.safetensors` files, in name order (each name, then its bytes).
    pub weights_sha256: String,
    /// SHA-256 of its `tokenizer.json`.
    pub tokenizer_sha256: String,
    /// SHA-256 of its chat template's text (empty: it has none).
    pub chat_template_sha256: String,
}

impl ModelHashes {
    /// Hashes the checkpoint folder `dir`.
    pub fn of(dir: &Path) -> Result<Self, PipelineError> {
        let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
            .map_err(|e| format!("{}: {e}", dir.display()))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
            .collect();
        files.sort();
        let mut weights = Sha256::new();
        for file in &files {
            weights.update(file.file_name().unwrap_or_default().as_encoded_bytes());
            hash_file(&mut weights, file)?;
        }
        let template = weir_gpu::Tokenizer::load(dir)?
            .chat_template()
            .map(|t| hex(&Sha256::digest(t.as_bytes())))
            .unwrap_or_default();
        Ok(ModelHashes {
            path: dir.to_path_buf(),
            weights_sha256: hex(&weights.finalize()),
            tokenizer_sha256: ModelHashes::tokenizer_sha256(dir)?,
            chat_template_sha256: template,
        })
    }

    /// SHA-256 of `dir/tokenizer.json` (without hashing the weights).
    pub fn tokenizer_sha256(dir: &Path) -> Result<String, PipelineError> {
        let mut tokenizer = Sha256::new();
        hash_file(&mut tokenizer, &dir.join("tokenizer.json"))?;
        Ok(hex(&tokenizer.finalize()))
    }

    /// The first way `other` differs from `self` (`None`: the same model).
    pub fn difference(&self, other: &ModelHashes) -> Option<String> {
        let pairs = [
            ("weights", &self.weights_sha256, &other.weights_sha256),
            (
                "tokenizer.json",
                &self.tokenizer_sha256,
                &other.tokenizer_sha256,
            ),
            (
                "chat template",
                &self.chat_template_sha256,
                &other.chat_template_sha256,
            ),
        ];
        pairs
            .into_iter()
            .find(|(_, a, b)| a != b)
            .map(|(what, a, b)| {
                format!(
                    "its {what} (sha256 {}) differ from {}'s (sha256 {})",
                    short(a),
                    other.path.display(),
                    short(b)
                )
            })
    }
}

/// The sampler a log's rows were drawn with.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Sampler {
    /// `generate.temperature`.
    pub temperature: f64,
    /// `generate.top_p`.
    pub top_p: f64,
    /// `generate.top_k` (0: off).
    pub top_k: usize,
    /// `generate.max_new_tokens`.
    pub max_new_tokens: usize,
    /// `generate.ignore_eos`.
    pub ignore_eos: bool,
    /// `run.seed`: with the prompt id and the sample, each sequence's random stream.
    pub seed: u64,
}

/// `rollouts/manifest.json`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// The rollout schema's version.
    pub schema_version: String,
    /// The weir that wrote the log.
    pub weir_version: String,
    /// The pipeline.
    pub pipeline: String,
    /// The policy the run started from (`model.path`).
    pub policy: ModelHashes,
    /// SHA-256 of the resolved config (`config.resolved.toml`).
    pub config_sha256: String,
    /// The sampler.
    pub sampler: Sampler,
}

impl Manifest {
    /// The manifest of a run of `kind` with `cfg`.
    pub fn of(kind: PipelineKind, cfg: &RunConfig) -> Result<Self, PipelineError> {
        let g = &cfg.generate;
        let resolved = crate::resume::resolved_config_text(kind, cfg);
        Ok(Manifest {
            schema_version: SCHEMA_VERSION.to_string(),
            weir_version: env!("CARGO_PKG_VERSION").to_string(),
            pipeline: kind.name().to_string(),
            policy: ModelHashes::of(&cfg.model.path)?,
            config_sha256: hex(&Sha256::digest(resolved.as_bytes())),
            sampler: Sampler {
                temperature: g.temperature,
                top_p: g.top_p,
                top_k: g.top_k,
                max_new_tokens: g.max_new_tokens,
                ignore_eos: g.ignore_eos,
                seed: cfg.run.seed,
            },
        })
    }

    /// Writes it into `run_dir/rollouts/`.
    pub fn write(&self, run_dir: &Path) -> Result<(), PipelineError> {
        let path = run_dir.join("rollouts").join(MANIFEST);
        std::fs::create_dir_all(run_dir.join("rollouts"))
            .map_err(|e| format!("{}: {e}", run_dir.display()))?;
        let text = serde_json::to_string_pretty(self).map_err(|e| e.to_string())?;
        Ok(weir_gpu::snapshot::write_atomically(
            &path,
            text.as_bytes(),
        )?)
    }

    /// The manifest of the log `source` (a run folder, its `rollouts/`, or
    /// a file in it), if it has one.
    pub fn find(source: &Path) -> Result<Option<(PathBuf, Self)>, PipelineError> {
        let candidates = [
            source.join("rollouts").join(MANIFEST),
            source.join(MANIFEST),
            source
                .parent()
                .map(|p| p.join(MANIFEST))
                .unwrap_or_default(),
        ];
        let Some(path) = candidates.into_iter().find(|p| p.is_file()) else {
            return Ok(None);
        };
        let text = weir_durable::read_text_capped(&path, weir_durable::SIDE_FILE_BYTES)
            .map_err(|e| format!("{}: {e}", path.display()))?;
        let manifest: Manifest =
            serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
        let ours: u64 = SCHEMA_VERSION.parse().unwrap_or(0);
        if manifest
            .schema_version
            .parse::<u64>()
            .map_or(true, |v| v > ours)
        {
            return Err(format!(
                "{}: rollout schema version {}, but this weir reads versions up to {SCHEMA_VERSION}",
                path.display(),
                manifest.schema_version
            )
            .into());
        }
        Ok(Some((path, manifest)))
    }
}

fn hash_file(hasher: &mut Sha256, path: &Path) -> Result<(), PipelineError> {
    let mut file = std::fs::File::open(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file
            .read(&mut buf)
            .map_err(|e| format!("{}: {e}", path.display()))?;
        if n == 0 {
            return Ok(());
        }
        hasher.update(&buf[..n]);
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A hash's first 12 digits, as a message shows it.
fn short(hash: &str) -> &str {
    &hash[..hash.len().min(12)]
}
