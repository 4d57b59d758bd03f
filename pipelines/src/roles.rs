//! The pieces every pipeline shares: where a run stands ([`RunContext`]),
//! and a stage factory per role, built from the config.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tch::Kind;
use weir_gpu::collective::HostGroup;
use weir_gpu::optim::AdamWConfig;
use weir_gpu::{Device, Model, SamplingParams, Tokenizer};
use weir_graph::{ParquetLog, StageError, WorkerInfo};
use weir_operators::algorithms::{
    Flavor, ImportanceCorrection, PolicyLossConfig, PolicyObjective, RatioLevel,
};
use weir_operators::checkpoint::{
    load_optimizer, CheckpointCommits, CheckpointPlan, Checkpointer, StepValues,
};
use weir_operators::rewards::python::{PythonReward, PythonRewardConfig};
use weir_operators::rewards::terms::{RewardTerms, Term, TermKind};
use weir_operators::rewards::{arith, rule_reward, rules};
use weir_operators::stages::generate::Generate;
use weir_operators::stages::learner::{Learner, LearnerConfig, LrSchedule};
use weir_operators::stages::prompt_files::PromptFormat;
use weir_operators::stages::prompt_stats::{Curriculum, StatsView};
use weir_operators::stages::prompts::{Cursor, CursorLog, PromptColumn, PromptSource};
use weir_operators::stages::reference::RefLogprob;
use weir_operators::stages::remote_reward::{RemoteReward, RemoteRewardConfig};
use weir_operators::stages::reward::{RewardModel, RuleReward};

use crate::config::{CorrectionChoice, DeviceChoice, PolicyLossChoice, RewardKind, ScheduleChoice};
use crate::RunConfig;

/// Worker set of generation and scoring.
pub const ROLLOUT: &str = "rollout";
/// Worker set of the reference, critic, advantage and learner.
pub const TRAIN: &str = "train";

/// Queue length of the engine thread of every stage that holds a model
/// (`Pipeline::offload`): the calls are long, and the worker must stay free
/// to drive its other operators and to send the heartbeats that tell peer
/// processes it is alive. (Learners are always offloaded by the engine.)
pub const MODEL_QUEUE: usize = 1;

/// Where a run (or a resumed segment of one) starts, and what its stages share.
#[derive(Clone, Debug)]
pub struct RunContext {
    /// The run folder.
    pub run_dir: PathBuf,
    /// The actor's starting checkpoint (the config's, or a checkpoint's `actor/`).
    pub actor: PathBuf,
    /// The checkpoint folder resumed from (`actor/`, `critic/` with optimizer state), if any.
    pub resumed_from: Option<PathBuf>,
    /// The first step of this segment.
    pub first_step: u64,
    /// The policy version at `first_step`.
    pub version: u64,
    /// The prompt cursor at `first_step`.
    pub cursor: Option<Cursor>,
    /// Cursors as the source draws them (for checkpoints).
    pub cursors: CursorLog,
    /// Per-prompt statistics (curriculum).
    pub stats: StatsView,
    /// The last step of the run.
    pub last_step: u64,
    /// Components of a complete checkpoint.
    pub components: Vec<String>,
    /// Checkpoint states waiting for their commit point.
    pub commits: CheckpointCommits,
    /// Config values a resume must keep, stored in every checkpoint.
    pub invariants: std::collections::BTreeMap<String, String>,
    /// What stages carry from step to step, for checkpoints.
    pub values: StepValues,
    /// Those values as the checkpoint resumed from stored them.
    pub resumed_values: std::collections::BTreeMap<String, f64>,
}

impl RunContext {
    /// The checkpoint writer of this run.
    pub fn checkpointer(&self, cfg: &RunConfig) -> Checkpointer {
        checkpointer(cfg, &self.run_dir)
    }

    /// Restores `optimizer` from the `component` (`actor`, `critic`) of the
    /// checkpoint this segment resumed from; nothing on a fresh run.
    pub fn restore_optimizer(
        &self,
        component: &str,
        optimizer: &mut weir_gpu::optim::Optimizer,
    ) -> Result<(), StageError> {
        match &self.resumed_from {
            Some(dir) => load_optimizer(&dir.join(component), optimizer),
            None => Ok(()),
        }
    }

    /// What trainers save, when, with the run state.
    pub fn checkpoint_plan(&self, cfg: &RunConfig) -> CheckpointPlan {
        CheckpointPlan {
            checkpointer: self.checkpointer(cfg),
            cursors: Some(self.cursors.clone()),
            seed: cfg.run.seed,
            components: self.components.clone(),
            commits: Some(self.commits.clone()),
            invariants: self.invariants.clone(),
            values: Some(self.values.clone()),
        }
    }
}

/// How the generator samples: `[generate]` with the tokenizer's end tokens.
pub fn sampling(cfg: &RunConfig, tok: &Tokenizer) -> SamplingParams {
    let g = &cfg.generate;
    SamplingParams {
        max_new_tokens: g.max_new_tokens,
        temperature: g.temperature,
        top_p: (g.top_p < 1.0).then_some(g.top_p),
        top_k: (g.top_k > 0).then_some(g.top_k),
        eos_token_ids: tok.eos_token_ids().to_vec(),
        seed: cfg.run.seed,
        ..Default::default()
    }
}

/// The checkpoint writer of a run of `cfg` in `run_dir`.
pub fn checkpointer(cfg: &RunConfig, run_dir: &Path) -> Checkpointer {
    Checkpointer {
        root: run_dir.join("checkpoints"),
        every: cfg.run.checkpoint_every,
        last_step: Some(cfg.run.steps - 1),
        max_shard_bytes: weir_gpu::snapshot::parse_size(&cfg.run.max_shard_size)
            .unwrap_or(weir_gpu::snapshot::DEFAULT_MAX_SHARD_BYTES),
    }
}

/// The adaptive KL controller of the in-reward KL penalty, if
/// `algorithm.kl_target` sets one, and the coefficient to start from (a
/// resumed run goes on from the checkpoint's).
pub fn in_reward_kl(
    cfg: &RunConfig,
    ctx: &RunContext,
) -> (f64, Option<weir_operators::stages::advantage::AdaptiveKl>) {
    let a = &cfg.algorithm;
    if a.kl_coef <= 0.0 || a.kl_target <= 0.0 {
        return (a.kl_coef, None);
    }
    let start = ctx
        .resumed_values
        .get("kl_coef")
        .copied()
        .unwrap_or(a.kl_coef);
    let adaptive = weir_operators::stages::advantage::AdaptiveKl {
        target: a.kl_target,
        horizon: a.kl_horizon,
        values: Some(ctx.values.clone()),
    };
    (start, Some(adaptive))
}

/// The compute dtype named by `model.dtype`.
pub fn kind(cfg: &RunConfig) -> Kind {
    cfg.model.dtype.kind()
}

/// The device of `worker`: the CPU, or CUDA device `index mod count`.
pub fn device(cfg: &RunConfig, worker: &WorkerInfo) -> Result<Device, StageError> {
    if cfg.run.device == DeviceChoice::Cpu {
        return Ok(Device::Cpu);
    }
    let count = Device::cuda_count();
    if count == 0 {
        return Err("run.device = \"cuda\", but libtorch sees no CUDA device".into());
    }
    Ok(Device::Cuda(worker.index % count))
}

/// Loads `dir` on `worker`'s device in the config's dtype.
pub fn load(cfg: &RunConfig, dir: &Path, worker: &WorkerInfo) -> Result<Model, StageError> {
    Ok(Model::load(dir, device(cfg, worker)?, kind(cfg))?)
}

fn or_actor(path: &str, cfg: &RunConfig) -> PathBuf {
    PathBuf::from(if path.is_empty() {
        &cfg.model.path
    } else {
        path
    })
}

/// The prompt source: the arith task's training pairs or a prompt file, with the run's cursor.
pub fn prompts(
    cfg: &RunConfig,
    ctx: &RunContext,
    samples: usize,
) -> impl Fn(&WorkerInfo) -> Result<PromptSource, StageError> + Send + Sync + 'static {
    source(cfg, ctx, samples, false)
}

/// The preference-pair source: prompts with their chosen and rejected responses.
pub fn preference_pairs(
    cfg: &RunConfig,
    ctx: &RunContext,
) -> impl Fn(&WorkerInfo) -> Result<PromptSource, StageError> + Send + Sync + 'static {
    source(cfg, ctx, 1, true)
}

fn source(
    cfg: &RunConfig,
    ctx: &RunContext,
    samples: usize,
    pairs: bool,
) -> impl Fn(&WorkerInfo) -> Result<PromptSource, StageError> + Send + Sync + 'static {
    let (cfg, ctx) = (cfg.clone(), ctx.clone());
    move |w| {
        let tok = Tokenizer::load(Path::new(&cfg.model.path))?;
        let d = &cfg.data;
        let mut src = if d.prompts == "arith" && pairs {
            PromptSource::arith_preferences(
                &arith::train_pairs(cfg.run.seed),
                &tok,
                d.prompts_per_step,
                cfg.run.seed,
            )?
        } else if d.prompts == "arith" {
            PromptSource::arith(
                &arith::train_pairs(cfg.run.seed),
                &tok,
                d.prompts_per_step,
                samples,
                cfg.run.seed,
            )?
        } else {
            let column = if d.messages_column.is_empty() {
                PromptColumn::Text(d.prompt_column.clone())
            } else {
                PromptColumn::Messages(d.messages_column.clone())
            };
            let extra: Vec<String> = if pairs {
                [&d.chosen_column, &d.rejected_column, &d.margin_column]
                    .into_iter()
                    .filter(|c| !c.is_empty())
                    .cloned()
                    .collect()
            } else {
                [d.label_column.clone()]
                    .into_iter()
                    .filter(|c| !c.is_empty())
                    .chain(reward_columns(&cfg)?)
                    .collect()
            };
            // Room for the response in the model's context (pairs carry their own).
            let context = weir_gpu::config::ModelConfig::load(Path::new(&cfg.model.path))?
                .max_position_embeddings;
            let room = context
                .filter(|_| !pairs)
                .map(|c| (c.max(0) as usize).saturating_sub(cfg.generate.max_new_tokens));
            let format = PromptFormat {
                template: (!d.prompt_template.is_empty()).then(|| d.prompt_template.clone()),
                chat: d.apply_chat_template,
                system: (!d.system_prompt.is_empty()).then(|| d.system_prompt.clone()),
            };
            PromptSource::from_file(
                Path::new(&d.prompts),
                &column,
                &format,
                &extra,
                room,
                &tok,
                d.prompts_per_step,
                samples,
                cfg.run.seed,
            )?
        };
        if d.epochs > 0 {
            src = src.epochs(d.epochs);
        }
        if let Some(cursor) = ctx.cursor {
            src.restore(cursor);
        }
        if cfg.curriculum.enabled {
            src = src.curriculum(Curriculum {
                view: ctx.stats.clone(),
                min_samples: cfg.curriculum.min_samples,
                max_solve_rate: cfg.curriculum.max_solve_rate,
                min_solve_rate: cfg.curriculum.min_solve_rate,
                max_staleness: cfg.run.max_staleness,
            });
        }
        Ok(src
            .cursor_log(ctx.cursors.clone())
            .shard(w.rank, w.role_size))
    }
}

/// The actor's generator, starting from the run's actor checkpoint.
pub fn actor(
    cfg: &RunConfig,
    ctx: &RunContext,
) -> impl Fn(&WorkerInfo) -> Result<Generate, StageError> + Send + Sync + 'static {
    let (cfg, actor) = (cfg.clone(), ctx.actor.clone());
    move |w| {
        let model = load(&cfg, &actor, w)?;
        let tok = Tokenizer::load(Path::new(&cfg.model.path))?;
        let params = sampling(&cfg, &tok);
        Ok(Generate::new(model, tok, params))
    }
}

/// The reward stage the config names (boxed: rule, model or remote).
pub fn reward(
    cfg: &RunConfig,
) -> impl Fn(&WorkerInfo) -> Result<Box<dyn weir_graph::Stage>, StageError> + Send + Sync + 'static
{
    let cfg = cfg.clone();
    move |w| -> Result<Box<dyn weir_graph::Stage>, StageError> {
        Ok(match cfg.reward.kind {
            RewardKind::Model => Box::new(RewardModel::new(
                load(&cfg, Path::new(&cfg.model.reward_model), w)?,
                cfg.algorithm.micro_batch,
            )?),
            RewardKind::Remote => Box::new(RemoteReward::new(RemoteRewardConfig {
                url: cfg.reward.url.clone(),
                label_column: (!cfg.data.label_column.is_empty())
                    .then(|| cfg.data.label_column.clone()),
                timeout: Duration::from_secs_f64(cfg.reward.timeout_s.max(0.001)),
                attempts: cfg.reward.attempts,
                ..Default::default()
            })?),
            RewardKind::Python => Box::new(PythonReward::new(python_reward(
                &cfg,
                &cfg.reward.file,
                &cfg.reward.function,
            )?)?),
            RewardKind::Terms => {
                let mut terms = Vec::new();
                for t in &cfg.reward.terms {
                    let kind = match t.rule.as_str() {
                        "" => TermKind::Python(Box::new(PythonReward::new(python_reward(
                            &cfg,
                            &t.file,
                            &t.function,
                        )?)?)),
                        "regex" => TermKind::Regex(rules::full_match(&t.pattern)?),
                        "length" => TermKind::Length {
                            max: match t.max_tokens {
                                0 => cfg.generate.max_new_tokens,
                                n => n,
                            },
                        },
                        name => rule_term(name)?,
                    };
                    terms.push(Term {
                        name: t.label(),
                        weight: t.weight,
                        kind,
                    });
                }
                Box::new(RewardTerms::new(terms, &cfg.data.label_column)?)
            }
            RewardKind::Rule => match rule_reward(&cfg.reward.rule) {
                Some(rule) => Box::new(RuleReward::new(rule, &cfg.data.label_column)),
                // A reward the user's binary registered: one term of weight 1.
                None => Box::new(RewardTerms::new(
                    vec![Term {
                        name: cfg.reward.rule.clone(),
                        weight: 1.0,
                        kind: rule_term(&cfg.reward.rule)?,
                    }],
                    &cfg.data.label_column,
                )?),
            },
        })
    }
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

/// How to run the Python reward `function` of `file`.
fn python_reward(
    cfg: &RunConfig,
    file: &str,
    function: &str,
) -> Result<PythonRewardConfig, StageError> {
    Ok(PythonRewardConfig {
        file: PathBuf::from(file),
        function: function.to_string(),
        python: cfg.reward.python.clone(),
        workers: cfg.reward.workers,
        timeout: Duration::from_secs_f64(cfg.reward.timeout_s.max(0.001)),
        attempts: cfg.reward.attempts,
        label_column: (!cfg.data.label_column.is_empty()).then(|| cfg.data.label_column.clone()),
        columns: reward_columns(cfg)?,
    })
}

/// The prompt-file columns a Python reward receives besides the prompt and
/// the label: every other column all records have.
pub fn reward_columns(cfg: &RunConfig) -> Result<Vec<String>, StageError> {
    let d = &cfg.data;
    let python = match cfg.reward.kind {
        RewardKind::Python => true,
        RewardKind::Terms => cfg.reward.terms.iter().any(|t| !t.file.is_empty()),
        _ => false,
    };
    if !python || d.prompts == "arith" {
        return Ok(Vec::new());
    }
    let own = [&d.prompt_column, &d.messages_column, &d.label_column];
    Ok(
        weir_operators::stages::prompt_files::common_columns(Path::new(&d.prompts))?
            .into_iter()
            .filter(|c| !own.contains(&c))
            .collect(),
    )
}

/// The frozen reference.
pub fn reference(
    cfg: &RunConfig,
) -> impl Fn(&WorkerInfo) -> Result<RefLogprob, StageError> + Send + Sync + 'static {
    let cfg = cfg.clone();
    move |w| {
        let dir = or_actor(&cfg.model.reference, &cfg);
        Ok(RefLogprob::new(
            load(&cfg, &dir, w)?,
            cfg.generate.temperature,
        ))
    }
}

/// The learner settings of the config.
pub fn learner_config(cfg: &RunConfig, kl_in_loss: bool) -> LearnerConfig {
    let a = &cfg.algorithm;
    LearnerConfig {
        adamw: adamw(cfg, a.lr),
        max_grad_norm: (a.max_grad_norm > 0.0).then_some(a.max_grad_norm),
        micro_batch: a.micro_batch,
        policy: PolicyLossConfig {
            clip_low: a.clip_low,
            clip_high: a.clip_high,
            dual_clip: (a.dual_clip > 0.0).then_some(a.dual_clip),
            ratio_level: match a.policy_loss {
                PolicyLossChoice::Gspo => RatioLevel::Sequence,
                _ => RatioLevel::Token,
            },
            objective: objective(cfg),
            aggregation: a.aggregation.into(),
            flavor: flavor(cfg),
            correction: {
                let (low, high) = (a.correction_low, a.correction_high);
                match a.correction {
                    CorrectionChoice::Tis => Some(ImportanceCorrection::Tis { low, high }),
                    CorrectionChoice::Icepop => Some(ImportanceCorrection::IcePop { low, high }),
                    CorrectionChoice::SeqMask => {
                        Some(ImportanceCorrection::SequenceMask { low, high })
                    }
                    CorrectionChoice::SeqTis => {
                        Some(ImportanceCorrection::SequenceTis { low, high })
                    }
                    CorrectionChoice::GeoRejection => {
                        Some(ImportanceCorrection::GeometricRejection { low, high })
                    }
                    CorrectionChoice::K3Rejection => {
                        Some(ImportanceCorrection::K3Rejection { high })
                    }
                    CorrectionChoice::None => None,
                }
            },
            loss_scale_factor: Some(loss_scale_factor(cfg)),
        },
        temperature: cfg.generate.temperature,
        kl_coef: if kl_in_loss { a.kl_coef } else { 0.0 },
        kl_estimator: a.kl_estimator.into(),
        ppo_epochs: a.ppo_epochs,
        mini_batches: a.mini_batches,
        schedule: schedule(cfg),
        entropy_coef: a.entropy_coef,
        gradient_checkpointing: a.gradient_checkpointing,
    }
}

/// The policy objective `algorithm.policy_loss` names.
pub fn objective(cfg: &RunConfig) -> PolicyObjective {
    let a = &cfg.algorithm;
    match a.policy_loss {
        PolicyLossChoice::Ppo | PolicyLossChoice::Gspo => PolicyObjective::Clipped,
        PolicyLossChoice::Cispo => PolicyObjective::Cispo,
        PolicyLossChoice::Sapo => PolicyObjective::Sapo {
            tau_pos: a.sapo_tau_pos,
            tau_neg: a.sapo_tau_neg,
        },
        PolicyLossChoice::Gmpo => PolicyObjective::GeoMean,
        PolicyLossChoice::Gpg => PolicyObjective::PolicyGradient,
        PolicyLossChoice::Reinforce => PolicyObjective::Reinforce {
            cap: a.reinforce_is_cap,
        },
        PolicyLossChoice::ClipCov => PolicyObjective::ClipCov {
            ratio: a.clip_cov_ratio,
            lb: a.clip_cov_lb,
            ub: a.clip_cov_ub,
        },
        PolicyLossChoice::KlCov => PolicyObjective::KlCov {
            ratio: a.kl_cov_ratio,
            coef: a.kl_cov_coef,
        },
    }
}

/// OpenRLHF's or verl's semantics.
pub fn flavor(cfg: &RunConfig) -> Flavor {
    cfg.algorithm.flavor.into()
}

/// T of Dr.GRPO's `seq-mean-token-sum-norm`: the config's, or the padded
/// response length (`generate.max_new_tokens`, constant over the run, as
/// verl pads every response to its maximum length).
pub fn loss_scale_factor(cfg: &RunConfig) -> f64 {
    match cfg.algorithm.loss_scale_factor {
        t if t > 0.0 => t,
        _ => cfg.generate.max_new_tokens as f64,
    }
}

/// AdamW at `lr` with the config's weight decay.
pub fn adamw(cfg: &RunConfig, lr: f64) -> AdamWConfig {
    AdamWConfig {
        lr,
        weight_decay: cfg.algorithm.weight_decay,
        ..Default::default()
    }
}

/// The learning-rate schedule over the run's steps (in optimizer steps).
pub fn schedule(cfg: &RunConfig) -> LrSchedule {
    let a = &cfg.algorithm;
    match a.schedule {
        ScheduleChoice::Cosine => LrSchedule::Cosine {
            warmup: a.warmup_steps,
            total: cfg.run.steps * (a.ppo_epochs * a.mini_batches) as u64,
            min_ratio: a.min_lr_ratio,
        },
        ScheduleChoice::Constant => LrSchedule::Constant {
            warmup: a.warmup_steps,
        },
    }
}

/// With several train workers, the group their trainers join as data-parallel ranks.
pub fn data_parallel_group(cfg: &RunConfig) -> Option<Arc<HostGroup>> {
    let ranks = cfg.placement.train.len();
    (ranks > 1).then(|| HostGroup::new(ranks))
}

/// The actor's learner, restoring its optimizer on resume and saving checkpoints.
pub fn learner(
    cfg: &RunConfig,
    ctx: &RunContext,
    kl_in_loss: bool,
) -> impl Fn(&WorkerInfo) -> Result<Learner, StageError> + Send + Sync + 'static {
    let (cfg, ctx) = (cfg.clone(), ctx.clone());
    let group = data_parallel_group(&cfg);
    move |w| {
        let model = load(&cfg, &ctx.actor, w)?;
        let mut learner = Learner::new(model, learner_config(&cfg, kl_in_loss))?
            .with_checkpoints(ctx.checkpoint_plan(&cfg));
        if let Some(group) = &group {
            learner = learner.with_data_parallel(group.member(w.rank))?;
        }
        ctx.restore_optimizer("actor", learner.optimizer_mut())?;
        Ok(learner)
    }
}

/// The rollout log: every row, in rolling Parquet files under `rollouts/`.
pub fn rollout_log(
    cfg: &RunConfig,
    ctx: &RunContext,
) -> impl Fn(&WorkerInfo) -> Result<ParquetLog, StageError> + Send + Sync + 'static {
    let (dir, rows) = (ctx.run_dir.join("rollouts"), cfg.run.rows_per_file);
    move |w| Ok(ParquetLog::new(&dir, w.index, rows)?)
}
