//! The reward stage of a config: a rule, a reward model, a reward server,
//! a Python function, a reward the user's binary registered, or a weighted
//! sum of these.

use std::path::Path;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use weir_graph::{StageError, WorkerInfo};
use weir_operators::data::prompt_files::PromptRecords;
use weir_operators::rewards::judge::{Judge, JudgeConfig, JudgeReward, Verdict};
use weir_operators::rewards::model::RewardModel;
use weir_operators::rewards::python::{PythonReward, PythonRewardConfig};
use weir_operators::rewards::remote::{RemoteReward, RemoteRewardConfig};
use weir_operators::rewards::rule_stage::RuleReward;
use weir_operators::rewards::terms::{RewardTerms, Term, TermKind};
use weir_operators::rewards::{rule_reward, rules};

use crate::config::{JudgeVerdict, OnUnparsed, RewardKind, Task};
use crate::context::load;
use crate::RunConfig;

/// The prompt-file columns a reward receives (besides the prompt and the
/// label) and which of those and the label the file holds as typed JSON
/// values: read from the file once per run, whatever the workers.
#[derive(Clone, Debug, Default)]
struct FileColumns {
    columns: Vec<String>,
    typed: Vec<String>,
}

/// [`FileColumns`], read on first use and shared by the reward stages of a process.
#[derive(Clone, Default)]
struct FileColumnsOnce(Arc<OnceLock<Result<FileColumns, String>>>);

impl FileColumnsOnce {
    fn get(&self, cfg: &RunConfig) -> Result<FileColumns, StageError> {
        self.0
            .get_or_init(|| {
                let Task::File(path) = &cfg.data.prompts else {
                    return Ok(FileColumns::default());
                };
                let records = PromptRecords::read(path).map_err(|e| e.to_string())?;
                let columns = if file_column_rewards(cfg) {
                    other_columns(cfg, &records)
                } else {
                    Vec::new()
                };
                let named: Vec<String> = columns
                    .iter()
                    .chain(&cfg.data.label_column)
                    .cloned()
                    .collect();
                let typed = records.typed_columns(&named);
                Ok(FileColumns { columns, typed })
            })
            .clone()
            .map_err(StageError::from)
    }
}

/// The reward stage the config names (boxed: rule, model or remote).
pub fn reward(
    cfg: &RunConfig,
) -> impl Fn(&WorkerInfo) -> Result<Box<dyn weir_graph::Stage>, StageError> + Send + Sync + 'static
{
    let cfg = cfg.clone();
    let file_columns = FileColumnsOnce::default();
    // Whether the reward model reads text, and why: asked once per process.
    let reads_text: Arc<OnceLock<Result<Option<String>, String>>> = Arc::default();
    move |w| -> Result<Box<dyn weir_graph::Stage>, StageError> {
        Ok(match cfg.reward.kind {
            RewardKind::Model => {
                let dir = required(&cfg.model.reward_model, "model.reward_model")?;
                let stage = RewardModel::new(load(&cfg, dir, w)?, cfg.algorithm.micro_batch)?;
                let why = reads_text.get_or_init(|| {
                    let why = crate::config::unread_policy_ids(&cfg.model.path, dir, "the reward model");
                    if let Ok(Some(why)) = &why {
                        tracing::info!(
                            "model.reward_model reads each row as text, rendered with its own tokenizer and chat template: {why}"
                        );
                    }
                    why
                });
                match why.clone()? {
                    None => Box::new(stage),
                    Some(_) => Box::new(stage.reading_text(weir_gpu::Tokenizer::load(dir)?)),
                }
            }
            RewardKind::Remote => Box::new(RemoteReward::new(RemoteRewardConfig {
                url: required(&cfg.reward.url, "reward.url")?.clone(),
                label_column: cfg.data.label_column.clone(),
                label_typed: match &cfg.data.label_column {
                    Some(label) => file_columns.get(&cfg)?.typed.contains(label),
                    None => false,
                },
                timeout: Duration::from_secs_f64(cfg.reward.timeout_s),
                attempts: cfg.reward.attempts,
                ca_file: cfg.reward.ca_file.clone(),
                ..Default::default()
            })?),
            RewardKind::Python => Box::new(PythonReward::new(python_reward(
                &cfg,
                &file_columns.get(&cfg)?,
                required(&cfg.reward.file, "reward.file")?,
                &cfg.reward.function,
            )?)?),
            RewardKind::Terms => {
                let mut terms = Vec::new();
                for t in &cfg.reward.terms {
                    let kind = match (t.rule.as_deref(), &t.file) {
                        (None, file) => {
                            TermKind::Python(Box::new(PythonReward::new(python_reward(
                                &cfg,
                                &file_columns.get(&cfg)?,
                                required(file, "reward.terms.file")?,
                                &t.function,
                            )?)?))
                        }
                        (Some("regex"), _) => TermKind::Regex(rules::full_match(&t.pattern)?),
                        (Some("judge"), _) => {
                            TermKind::Judge(Box::new(judge(&cfg, w, &file_columns.get(&cfg)?)?))
                        }
                        (Some("length"), _) => TermKind::Length {
                            max: match t.max_tokens {
                                0 => cfg.generate.max_new_tokens,
                                n => n,
                            },
                        },
                        (Some(name), _) => rule_term(name)?,
                    };
                    terms.push(Term {
                        name: t.label(),
                        weight: t.weight,
                        kind,
                    });
                }
                Box::new(RewardTerms::new(terms, label(&cfg))?)
            }
            RewardKind::None => Box::new(weir_operators::rewards::finish::NoReward),
            RewardKind::Judge => Box::new(JudgeReward(judge(&cfg, w, &file_columns.get(&cfg)?)?)),
            RewardKind::Rule => match rule_reward(&cfg.reward.rule) {
                Some(rule) => Box::new(RuleReward::new(rule, label(&cfg))),
                // A reward the user's binary registered: one term of weight 1.
                None => Box::new(RewardTerms::new(
                    vec![Term {
                        name: cfg.reward.rule.clone(),
                        weight: 1.0,
                        kind: rule_term(&cfg.reward.rule)?,
                    }],
                    label(&cfg),
                )?),
            },
        })
    }
}

/// The `[judge]` of `cfg` on worker `w`, its template reading the
/// prompt file's `file_columns`.
fn judge(cfg: &RunConfig, w: &WorkerInfo, file_columns: &FileColumns) -> Result<Judge, StageError> {
    let j = &cfg.judge;
    let tokenizer = weir_gpu::Tokenizer::load(&j.path)?;
    let verdict = match j.verdict {
        JudgeVerdict::Regex => {
            Verdict::regex(&j.pattern).map_err(|e| format!("judge.pattern {e}"))?
        }
        JudgeVerdict::Probability => Verdict::probability(&tokenizer, &j.verdict_tokens)
            .map_err(|e| format!("judge.verdict_tokens: {e}"))?,
    };
    let greedy = j.temperature == 0.0;
    let params = weir_gpu::SamplingParams {
        max_new_tokens: j.max_new_tokens,
        greedy,
        temperature: if greedy { 1.0 } else { j.temperature },
        eos_token_ids: tokenizer.eos_token_ids().to_vec(),
        seed: cfg.run.seed,
        ..Default::default()
    };
    let model = load(cfg, &j.path, w)?;
    let config = JudgeConfig {
        template: j.template.clone(),
        chat: j.chat,
        verdict,
        params,
        backend: cfg.generate.backend,
        unparsed: (j.on_unparsed == OnUnparsed::Reward).then_some(j.unparsed_reward),
        label_column: cfg.data.label_column.clone(),
        columns: file_columns.columns.clone(),
        micro_batch: cfg.algorithm.micro_batch,
    };
    Ok(Judge::new(model, tokenizer, config)?)
}

/// Checks the `[judge]` a reward uses before anything is written: its
/// template against the prompt file's columns, its chat setting against
/// its tokenizer ([`weir_operators::rewards::judge::check`]).
pub fn check_judge(cfg: &RunConfig) -> Result<(), StageError> {
    if !cfg.uses_judge() {
        return Ok(());
    }
    let j = &cfg.judge;
    let tokenizer = weir_gpu::Tokenizer::load(&j.path)?;
    let columns = reward_columns(cfg)?;
    let has_label = cfg.data.label_column.is_some();
    weir_operators::rewards::judge::check(&j.template, &columns, has_label, j.chat, &tokenizer)
        .map_err(|e| {
            // The prompt's own column by name: the template reads it as `prompt`.
            let d = &cfg.data;
            let own = [Some(&d.prompt_column), d.messages_column.as_ref()];
            match own.into_iter().flatten().find(|c| e.contains(&format!("names `{c}`,"))) {
                Some(c) => format!(
                    "{e}; `{c}` is the prompt's own column: the template reads the prompt as `prompt`"
                ),
                None => e,
            }
        })?;
    Ok(())
}

/// A built-in rule, or a reward the user's binary registered, by name.
fn rule_term(name: &str) -> Result<TermKind, StageError> {
    if let Some(rule) = rule_reward(name) {
        return Ok(TermKind::Rule(rule));
    }
    let factory = weir_operators::rewards::registered(name)
        .ok_or_else(|| format!("unknown rule reward `{name}`"))?;
    Ok(TermKind::Custom(factory()?))
}

/// A value the config must set for the reward it names (validation has
/// checked it; this names the key if not).
fn required<'a, T>(value: &'a Option<T>, key: &str) -> Result<&'a T, StageError> {
    value
        .as_ref()
        .ok_or_else(|| format!("`{key}` is not set").into())
}

/// The column rules compare with, as the reward stages take it (`""`: none;
/// a term or rule that needs one then says so, naming `data.label_column`).
pub(crate) fn label(cfg: &RunConfig) -> &str {
    cfg.data.label_column.as_deref().unwrap_or("")
}

/// How to run the Python reward `function` of `file`.
fn python_reward(
    cfg: &RunConfig,
    file_columns: &FileColumns,
    file: &Path,
    function: &str,
) -> Result<PythonRewardConfig, StageError> {
    let FileColumns { columns, typed } = file_columns.clone();
    let label = cfg.data.label_column.clone();
    Ok(PythonRewardConfig {
        file: file.to_path_buf(),
        function: function.to_string(),
        python: cfg.reward.python.clone(),
        workers: cfg.reward.workers,
        timeout: Duration::from_secs_f64(cfg.reward.timeout_s),
        attempts: cfg.reward.attempts,
        label_column: label,
        columns,
        typed,
    })
}

/// The prompt-file columns a Python reward or a judge's template receives
/// besides the prompt and the label: every other column all records have.
pub fn reward_columns(cfg: &RunConfig) -> Result<Vec<String>, StageError> {
    let Task::File(path) = &cfg.data.prompts else {
        return Ok(Vec::new());
    };
    if !file_column_rewards(cfg) {
        return Ok(Vec::new());
    }
    let records = PromptRecords::read(path)?;
    Ok(other_columns(cfg, &records))
}

/// Whether the reward (or one of its terms) reads the prompt file's
/// other columns: a Python function, or a judge's template.
fn file_column_rewards(cfg: &RunConfig) -> bool {
    cfg.uses_judge()
        || match cfg.reward.kind {
            RewardKind::Python => true,
            RewardKind::Terms => cfg.reward.terms.iter().any(|t| t.file.is_some()),
            RewardKind::Rule
            | RewardKind::Model
            | RewardKind::Remote
            | RewardKind::None
            | RewardKind::Judge => false,
        }
}

/// The columns all `records` have but the prompt's and the label's.
fn other_columns(cfg: &RunConfig, records: &PromptRecords) -> Vec<String> {
    let d = &cfg.data;
    let own = [
        Some(&d.prompt_column),
        d.messages_column.as_ref(),
        d.label_column.as_ref(),
    ];
    records
        .common_columns()
        .into_iter()
        .filter(|c| !own.contains(&Some(c)))
        .collect()
}
