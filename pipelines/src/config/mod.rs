//! Typed run configs: TOML with `deny_unknown_fields`, a documented default
//! for every key (the [`KEYS`] table, which `weir config` prints), and
//! validation that names the key and the bad value.
//!
//! Each `[section]` has a file of its own (`run.rs`, `data.rs`, …,
//! `agent.rs`) holding its struct, its defaults, its rows of [`KEYS`] and
//! the checks that read it alone, so that a key is added in one file. Here
//! is the whole config: the sections, the pipelines' defaults, loading,
//! `--set` overrides and the commented TOML; `docs.rs` assembles the key
//! table, `validate.rs` runs the checks (and holds those that span
//! sections), `scope.rs` says which keys a pipeline reads.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::PipelineKind;

mod agent;
mod algorithm;
mod choices;
mod curriculum;
mod data;
mod docs;
mod dynamic_sampling;
mod eval;
mod generate;
mod judge;
mod lora;
mod model;
mod placement;
mod reward;
mod run;
mod scope;
mod teacher;
pub(crate) mod text;
mod validate;

pub use choices::{
    Aggregation, Backend, CorrectionChoice, DeviceChoice, DistillTask, Dtype, Flavor, GkdTail,
    JudgeVerdict, KlEstimator, OnError, OnNewWeights, OnUnparsed, PolicyLossChoice,
    PreferenceChoice, PythonNetwork, ReferencePlacement, RewardKind, RolloutAdvantages,
    ScheduleChoice, TeacherPlacement, ToolFormat, WeightsChannelChoice,
};

/// A whole run config.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RunConfig {
    /// Steps, staleness, seed, threads, checkpoints.
    pub run: RunSection,
    /// Which workers run which roles.
    pub placement: PlacementSection,
    /// Checkpoints of the roles.
    pub model: ModelSection,
    /// The prompt set.
    pub data: DataSection,
    /// Sampling.
    pub generate: GenerateSection,
    /// Where rewards come from.
    pub reward: RewardSection,
    /// Loss, optimizer, estimator settings.
    pub algorithm: AlgorithmSection,
    /// DAPO's dynamic sampling.
    pub dynamic_sampling: DynamicSamplingSection,
    /// Skipping prompts by their statistics.
    pub curriculum: CurriculumSection,
    /// Greedy evaluation on the arith task.
    pub eval: EvalSection,
    /// LoRA adapters for the actor.
    pub lora: LoraSection,
    /// Multi-turn episodes with tools and environments.
    pub agent: AgentSection,
    /// The teacher of on-policy distillation.
    pub teacher: TeacherSection,
    /// A generative judge's reward (`reward.kind = "judge"`, or a term).
    pub judge: JudgeSection,
}

pub use agent::{AgentSection, FunctionTool, HttpToolSpec, ToolSpec};
pub use algorithm::AlgorithmSection;
pub use curriculum::CurriculumSection;
pub use data::{DataSection, Task};
pub use docs::{applies, reference_page, Key, Readers, KEYS};
pub use dynamic_sampling::DynamicSamplingSection;
pub use eval::EvalSection;
pub use generate::GenerateSection;
pub use judge::JudgeSection;
pub use lora::LoraSection;
pub use model::ModelSection;
pub use placement::PlacementSection;
pub use reward::{RewardSection, RewardTerm};
pub use run::RunSection;
pub use teacher::TeacherSection;
pub(crate) use validate::unread_policy_ids;

/// A config error: the key and what is wrong with its value.
#[derive(Debug, thiserror::Error)]
#[error("{source_name}: {message}")]
pub struct ConfigError {
    /// The file (or `--set`).
    pub source_name: String,
    /// What is wrong.
    pub message: String,
}

impl RunConfig {
    /// Whether a `[judge]` scores the rows: `reward.kind = "judge"`, or a
    /// `[[reward.terms]]` entry with `rule = "judge"`.
    pub fn uses_judge(&self) -> bool {
        let r = &self.reward;
        r.kind == RewardKind::Judge
            || (r.kind == RewardKind::Terms
                && r.terms.iter().any(|t| t.rule.as_deref() == Some("judge")))
    }

    /// The code outside weir this config runs: a line per Python reward
    /// (its file, function and interpreter), what `--resume` shows first,
    /// since a run folder's config decides what runs.
    pub fn code_it_runs(&self) -> Vec<String> {
        let r = &self.reward;
        let line = |file: &PathBuf, function: &str| {
            format!(
                "Python {}:{function} with the interpreter `{}`",
                file.display(),
                r.python
            )
        };
        let mut lines = Vec::new();
        match r.kind {
            RewardKind::Python => lines.extend(r.file.iter().map(|f| line(f, &r.function))),
            RewardKind::Terms => lines.extend(
                r.terms
                    .iter()
                    .filter_map(|t| t.file.as_ref().map(|f| line(f, &t.function))),
            ),
            RewardKind::Rule
            | RewardKind::Model
            | RewardKind::Remote
            | RewardKind::None
            | RewardKind::Judge => {}
        }
        let a = &self.agent;
        if let Some(file) = a.environment_file() {
            lines.push(format!(
                "Python {file}:{} (agent.environment) with the interpreter `{}`",
                a.environment_class, a.python
            ));
        }
        for tool in &a.tools {
            match tool {
                agent::ToolSpec::Function(f) => lines.push(format!(
                    "Python {}:{} (agent.tools) with the interpreter `{}`",
                    f.file.display(),
                    f.function,
                    a.python
                )),
                agent::ToolSpec::Builtin(name) if name == "python" => lines.push(format!(
                    "the model's own Python code (agent.tools: python) with the interpreter `{}`{}",
                    a.python,
                    if a.python_network == PythonNetwork::Allow {
                        ", on the network (agent.python_network = \"allow\")"
                    } else {
                        ""
                    }
                )),
                agent::ToolSpec::Builtin(_) | agent::ToolSpec::Http(_) => {}
            }
        }
        lines
    }

    /// The defaults of `pipeline`.
    pub fn defaults_for(pipeline: PipelineKind) -> Self {
        let mut c = RunConfig::default();
        match pipeline {
            PipelineKind::Ppo => {
                c.algorithm.kl_coef = 0.01;
                c.algorithm.kl_estimator = KlEstimator::K1;
                c.data.samples_per_prompt = 1;
                c.data.prompts_per_step = 32;
                c.algorithm.lr = 1e-5;
            }
            // Dr.GRPO's length-unbiased loss: a constant normaliser, not each response's length.
            PipelineKind::DrGrpo => {
                c.algorithm.aggregation = Aggregation::SeqMeanTokenSumNorm;
            }
            // GPG trains with the plain policy gradient, as its paper and verl's recipe do.
            PipelineKind::Gpg => {
                c.algorithm.policy_loss = PolicyLossChoice::Gpg;
            }
            PipelineKind::ReinforcePp | PipelineKind::ReinforcePpBaseline => {
                c.algorithm.kl_coef = 0.01;
                c.algorithm.kl_estimator = KlEstimator::K1;
            }
            // verl's ReMax recipe: the KL in the reward, its estimator, its semantics.
            PipelineKind::Remax => {
                c.algorithm.kl_coef = 0.001;
                c.algorithm.kl_estimator = KlEstimator::K1;
                c.algorithm.flavor = Flavor::Verl;
            }
            PipelineKind::Sft | PipelineKind::Rm | PipelineKind::Dpo => {
                c.run.steps = 400;
                c.run.max_staleness = 0;
                c.placement = PlacementSection {
                    workers: 1,
                    rollout: vec![0],
                    train: vec![0],
                    ..PlacementSection::default()
                };
                c.data.prompts_per_step = 64;
                c.data.samples_per_prompt = 1;
                c.algorithm.lr = 1e-3;
                c.algorithm.warmup_steps = 100;
                c.algorithm.kl_coef = 0.0;
                if pipeline != PipelineKind::Sft {
                    c.run.steps = 200;
                    c.data.prompts_per_step = 32;
                    c.algorithm.lr = if pipeline == PipelineKind::Rm {
                        1e-4
                    } else {
                        1e-5
                    };
                    c.algorithm.warmup_steps = 10;
                }
            }
            // The group estimators and distillation keep the defaults above.
            PipelineKind::Distill
            | PipelineKind::Grpo
            | PipelineKind::Rloo
            | PipelineKind::Opo
            | PipelineKind::GrpoPassk
            | PipelineKind::Otb => {}
        }
        c
    }

    /// `pipeline`'s defaults, overlaid with the file's keys (if any), then with `--set` overrides.
    pub fn load(
        pipeline: PipelineKind,
        file: Option<(&str, &str)>,
        overrides: &[String],
    ) -> Result<Self, ConfigError> {
        let mut config = RunConfig::defaults_for(pipeline);
        if let Some((text, name)) = file {
            let err = |message: String| ConfigError {
                source_name: name.to_string(),
                message,
            };
            let user: toml::Table =
                toml::from_str(text).map_err(|e| err(e.to_string().trim().replace('\n', " ")))?;
            let mut doc = toml::Value::try_from(&config).map_err(|e| err(e.to_string()))?;
            for (section, value) in user {
                if section == "pipeline" {
                    // A file may say its pipeline (as config.resolved.toml does).
                    match value.as_str().map(PipelineKind::parse) {
                        Some(Ok(kind)) if kind == pipeline => continue,
                        Some(Ok(kind)) => {
                            return Err(err(format!(
                                "`pipeline` = {:?}, but the run is {:?}",
                                kind.name(),
                                pipeline.name()
                            )))
                        }
                        Some(Err(e)) => return Err(err(format!("`pipeline`: {e}"))),
                        None => return Err(err("`pipeline` must be a string".into())),
                    }
                }
                match (value, doc.get_mut(&section)) {
                    (toml::Value::Table(keys), Some(toml::Value::Table(base))) => {
                        base.extend(keys);
                    }
                    (_, Some(_)) => {
                        return Err(err(format!("`{section}` must be a table ([{section}])")))
                    }
                    (_, None) => return Err(err(format!("unknown section `{section}`"))),
                }
            }
            let merged = toml::to_string(&doc).map_err(|e| err(e.to_string()))?;
            config = RunConfig::from_toml(&merged, name)?;
        }
        config.with_overrides(overrides)
    }

    /// Parses TOML text (unknown keys, wrong types and values outside a
    /// key's choices are errors naming the key).
    pub fn from_toml(text: &str, source_name: &str) -> Result<Self, ConfigError> {
        toml::from_str(text).map_err(|e| {
            let key = e.span().and_then(|span| key_at(text, span.start));
            ConfigError {
                source_name: source_name.to_string(),
                message: match key {
                    Some(key) => format!("`{key}`: {}", e.message().trim()),
                    None => e.to_string().trim().replace('\n', " "),
                },
            }
        })
    }

    /// The pipeline a config file names with a top-level `pipeline = "…"`, if it does.
    pub fn pipeline_in(text: &str, source_name: &str) -> Result<Option<PipelineKind>, ConfigError> {
        let err = |message: String| ConfigError {
            source_name: source_name.to_string(),
            message,
        };
        let table: toml::Table =
            toml::from_str(text).map_err(|e| err(e.to_string().trim().replace('\n', " ")))?;
        match table.get("pipeline") {
            None => Ok(None),
            Some(v) => match v.as_str() {
                Some(name) => PipelineKind::parse(name)
                    .map(Some)
                    .map_err(|e| err(format!("`pipeline`: {e}"))),
                None => Err(err("`pipeline` must be a string".into())),
            },
        }
    }

    /// Applies `key=value` overrides (`section.key=value`, the value in TOML syntax; bare words are strings).
    pub fn with_overrides(self, overrides: &[String]) -> Result<Self, ConfigError> {
        let err = |message: String| ConfigError {
            source_name: "--set".into(),
            message,
        };
        let mut doc = toml::Value::try_from(&self).map_err(|e| err(e.to_string()))?;
        for item in overrides {
            let (key, raw) = item
                .split_once('=')
                .ok_or_else(|| err(format!("`{item}` is not key=value")))?;
            let (section, name) = key
                .trim()
                .split_once('.')
                .ok_or_else(|| err(format!("`{key}` is not section.key")))?;
            if docs::find(section, name).is_none() {
                return Err(err(format!("unknown key `{key}`")));
            }
            let raw = raw.trim();
            let value: toml::Value = toml::from_str::<toml::Table>(&format!("v = {raw}"))
                .ok()
                .and_then(|t| t.get("v").cloned())
                .unwrap_or_else(|| toml::Value::String(raw.to_string()));
            doc[section][name] = value;
        }
        let text = toml::to_string(&doc).map_err(|e| err(e.to_string()))?;
        RunConfig::from_toml(&text, "--set")
    }

    /// The config as TOML: the keys `pipeline` reads ([`applies`]), each
    /// preceded by its documentation.
    pub fn to_commented_toml(&self, pipeline: PipelineKind) -> String {
        let doc = toml::Value::try_from(self).expect("a config serialises");
        let mut out = format!(
            "# weir run {} --config THIS_FILE\n# Every key is optional; shown are the defaults.\n",
            pipeline.name()
        );
        let mut section = "";
        for key in KEYS.iter().filter(|k| k.readers.read_by(pipeline)) {
            let (s, help) = (key.section, key.doc);
            if s != section {
                out.push_str(&format!("\n[{s}]\n"));
                section = s;
            }
            let value = &doc[s][key.name];
            let key = key.name;
            out.push_str(&format!("# {help}\n{key} = {value}\n"));
        }
        out
    }
}

/// The `section.key` whose line holds byte `offset` of `text`, if that
/// line is a `key = value` line under a `[section]` header.
fn key_at(text: &str, offset: usize) -> Option<String> {
    let start = text[..offset.min(text.len())]
        .rfind('\n')
        .map_or(0, |i| i + 1);
    let line = text[start..].lines().next()?;
    let (key, _) = line.split_once('=')?;
    let section = text[..start]
        .lines()
        .rev()
        .find_map(|l| l.trim().strip_prefix('[')?.strip_suffix(']'))?;
    Some(format!("{}.{}", section.trim(), key.trim()))
}

#[cfg(test)]
mod tests;
