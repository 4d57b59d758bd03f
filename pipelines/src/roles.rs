//! A stage factory per role, built from the config: the actor's generator,
//! the reference, the learner and its settings, the rollout log. Where a
//! run stands is `context.rs`; the prompt sources `prompts.rs`; the reward
//! stages `rewards.rs`.

use std::path::Path;
use std::sync::Arc;

use weir_gpu::collective::{GroupMember, HostGroup, HostReduce};
use weir_gpu::optim::AdamWConfig;
use weir_gpu::{SamplingParams, Tokenizer};
use weir_graph::{ParquetLog, Stage, StageError, WorkerInfo};
use weir_operators::agent::environment::Environment;
use weir_operators::agent::episode::Budgets;
use weir_operators::agent::http_env::{HttpEnvConfig, HttpEnvironment};
use weir_operators::agent::python_env::{PythonEnvConfig, PythonEnvironment};
use weir_operators::agent::python_tool::PythonLimits;
use weir_operators::agent::stage::EpisodeGenerate;
use weir_operators::agent::tools::{Calculator, Python, Tool};
use weir_operators::agent::user_tools::{HttpTool, PythonFunctionTool};
use weir_operators::algorithms::{
    GateDivergence, GkdLoss, ImportanceCorrection, PolicyLossConfig, PolicyObjective, RatioLevel,
    RejectionChain,
};
use weir_operators::stages::critic::{CriticLearner, PerWorker};
use weir_operators::stages::generate::{Generate, Generator, Streaming};
use weir_operators::stages::learner::{Learner, LearnerConfig, LrSchedule};
use weir_operators::stages::reference::RefLogprob;

use crate::config::{CorrectionChoice, PolicyLossChoice, ScheduleChoice, ToolSpec};
use crate::context::{load_frozen, load_policy, RunContext};
use crate::{PipelineKind, RunConfig};

/// Worker set of generation and scoring.
pub const ROLLOUT: &str = "rollout";
/// Worker set of the reference, critic, advantage and learner.
pub const TRAIN: &str = "train";
/// Worker set of a judge reward placed apart (`placement.judge`).
pub const JUDGE: &str = "judge";
/// Worker set of a distillation teacher placed apart (`placement.teacher = [..]`).
pub const TEACHER: &str = "teacher";

/// Queue length of the engine thread of every stage that holds a model
/// (`Pipeline::offload`): the calls are long, and the worker must stay free
/// to drive its other operators and to send the heartbeats that tell peer
/// processes it is alive. (Learners are always offloaded by the engine.)
pub const MODEL_QUEUE: usize = 1;

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

/// The actor's generator, starting from the run's actor checkpoint; with
/// `eval.every`, one that evaluates the policy it holds every so many
/// steps; recording each token's `Σ π²` when `sum_pi_squared`.
pub fn actor(
    cfg: &RunConfig,
    ctx: &RunContext,
    sum_pi_squared: bool,
) -> impl Fn(&WorkerInfo) -> Result<Box<dyn Stage>, StageError> + Send + Sync + 'static {
    let (cfg, actor, version) = (cfg.clone(), ctx.actor.clone(), ctx.version);
    move |w| -> Result<Box<dyn Stage>, StageError> {
        let model = load_policy(&cfg, &actor, w)?;
        let tok = Tokenizer::load(Path::new(&cfg.model.path))?;
        let params = SamplingParams {
            sum_pi_squared,
            ..cfg.generate.sampling(&tok, cfg.run.seed)
        };
        let streaming = Streaming {
            max_inflight: cfg.generate.max_inflight,
            on_new_weights: cfg.generate.on_new_weights,
        };
        if cfg.agent.enabled() {
            let stage = episodes(&cfg, model, tok, params)?;
            if streaming.max_inflight > 0 {
                return Ok(Box::new(stage.streamed(streaming, w.steps, version)?));
            }
            return Ok(Box::new(stage));
        }
        let mut generate =
            Generate::new(model, tok, params.clone()).with_backend(cfg.generate.backend);
        if cfg.generate.long_tail > 0.0 {
            generate = generate.with_long_tail(cfg.generate.long_tail);
        }
        if streaming.max_inflight > 0 {
            let mut streamed = generate.streamed(streaming, w.steps, version)?;
            if let Some(tokens) = cfg.generate.hold_for_weights_at {
                streamed = streamed.holding_for_weights_at(tokens);
            }
            return evaluating(streamed, &cfg, w, params);
        }
        evaluating(generate, &cfg, w, params)
    }
}

/// The actor's episode generator of `[agent]`: its tools, its environment,
/// the budgets (`generate.max_new_tokens` for a whole episode's response).
fn episodes(
    cfg: &RunConfig,
    model: weir_gpu::Model,
    tok: Tokenizer,
    params: SamplingParams,
) -> Result<EpisodeGenerate, StageError> {
    let a = &cfg.agent;
    let timeout = std::time::Duration::from_secs_f64(a.timeout_s);
    let tools = a
        .tools
        .iter()
        .enumerate()
        .map(|(i, spec)| -> Result<Box<dyn Tool>, StageError> {
            let key = format!("agent.tools[{i}]");
            Ok(match spec {
                ToolSpec::Builtin(name) if name == "calculator" => Box::new(Calculator),
                ToolSpec::Builtin(name) if name == "python" => Box::new(Python {
                    interpreter: a.python.clone(),
                    limits: PythonLimits {
                        wall: timeout,
                        ..PythonLimits::default()
                    },
                    network: a.python_network,
                }),
                ToolSpec::Builtin(other) => {
                    return Err(format!("{key}: no built-in tool {other:?}").into())
                }
                ToolSpec::Function(f) => Box::new(
                    PythonFunctionTool::new(
                        f.file.clone(),
                        f.function.clone(),
                        a.python.clone(),
                        timeout,
                    )
                    .map_err(|e| format!("{key}: {e}"))?,
                ),
                ToolSpec::Http(h) => Box::new(
                    HttpTool::new(
                        &h.url,
                        &h.name,
                        &h.description,
                        h.parameters.clone(),
                        timeout,
                    )
                    .map_err(|e| format!("{key}: {e}"))?,
                ),
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    let budgets = Budgets {
        max_turns: a.max_turns,
        max_tokens: cfg.generate.max_new_tokens,
        max_observation_tokens: a.max_observation_tokens,
    };
    let mut stage =
        EpisodeGenerate::new(model, tok, params, tools, a.tool_format.parser(), budgets)?
            .with_on_error(a.on_error)
            .with_backend(cfg.generate.backend);
    if let Some(name) = &a.environment {
        // One instance per episode under way: as many as calls may run at
        // once, or, of OpenEnv servers (one episode each), one per URL.
        let mut environments: Vec<Box<dyn Environment>> = Vec::new();
        for url in a.environment_urls().unwrap_or_default() {
            environments.push(Box::new(HttpEnvironment::new(HttpEnvConfig {
                url: url.to_string(),
                timeout,
                attempts: 3,
                action_field: a.action_field.clone(),
                observation_field: (!a.observation_field.is_empty())
                    .then(|| a.observation_field.clone()),
            })?));
        }
        let instances = if environments.is_empty() {
            a.max_concurrency
        } else {
            0
        };
        match a.environment_file() {
            // Each starts its worker process when it first holds an episode.
            Some(file) if instances > 0 => {
                let python = PythonEnvironment::instances(
                    PythonEnvConfig {
                        file: file.into(),
                        class: a.environment_class.clone(),
                        python: a.python.clone(),
                        timeout,
                        label_column: cfg.data.label_column.clone(),
                    },
                    instances,
                )?;
                environments.extend(
                    python
                        .into_iter()
                        .map(|e| Box::new(e) as Box<dyn Environment>),
                );
            }
            Some(_) => {}
            None => {
                for _ in 0..instances {
                    let factory =
                        weir_operators::agent::environment::registered(name).ok_or_else(|| {
                            format!("agent.environment: no environment {name:?} is registered")
                        })?;
                    environments
                        .push(factory().map_err(|e| format!("agent.environment {name:?}: {e}"))?);
                }
            }
        }
        stage = stage.with_environments(environments);
    }
    Ok(stage)
}

/// `generate`, evaluating the policy it holds every `eval.every` steps when
/// the config asks for it.
fn evaluating<G: Generator + 'static>(
    generate: G,
    cfg: &RunConfig,
    w: &WorkerInfo,
    params: SamplingParams,
) -> Result<Box<dyn Stage>, StageError> {
    if cfg.eval.every == 0 || cfg.eval.prompts.is_none() {
        return Ok(Box::new(generate));
    }
    let evaluation = crate::eval::Evaluation::new(cfg, w)?;
    Ok(Box::new(crate::eval::EvaluatingGenerator::new(
        generate,
        evaluation,
        params,
        cfg.eval.every,
    )))
}

/// PPO's critic, one model per worker shared by the stage that scores
/// (`Critic`) and the one that fits it (`CriticLearner`): from the resumed
/// checkpoint's `critic/`, else `model.critic`, else the reward model, else
/// the actor with a fresh value head.
pub fn critic(cfg: &RunConfig, ctx: &RunContext) -> Arc<PerWorker<weir_gpu::Model>> {
    let m = &cfg.model;
    let dir = match &ctx.resumed_from {
        Some(ck) => ck.join("critic"),
        None => m
            .critic
            .as_ref()
            .or(m.reward_model.as_ref())
            .unwrap_or(&m.path)
            .clone(),
    };
    let cfg = cfg.clone();
    PerWorker::new(move |w| {
        Ok(weir_gpu::Model::load_critic(
            &dir,
            crate::context::device(&cfg, w)?,
            crate::context::kind(&cfg),
        )?)
    })
}

/// The critic's fit after the policy update: its own AdamW (`critic_lr`),
/// value clipping, the policy's aggregation, epochs and mini-batches,
/// saved with the checkpoints, its optimizer restored on a resume.
pub fn critic_learner(
    cfg: &RunConfig,
    ctx: &RunContext,
    critic: Arc<PerWorker<weir_gpu::Model>>,
) -> impl Fn(&WorkerInfo) -> Result<CriticLearner, StageError> + Send + Sync + 'static {
    let (cfg, ctx, checkpoints) = (cfg.clone(), ctx.clone(), ctx.checkpointer(cfg));
    let group = data_parallel_group(&cfg);
    move |w| {
        let a = &cfg.algorithm;
        let mut learner = CriticLearner::new(
            &critic,
            w,
            adamw(&cfg, a.critic_lr),
            (a.value_clip > 0.0).then_some(a.value_clip),
            (a.max_grad_norm > 0.0).then_some(a.max_grad_norm),
        )?
        .with_loss(a.aggregation, cfg.algorithm.flavor)
        .with_schedule(schedule(&cfg))
        .with_epochs(a.ppo_epochs)
        .with_mini_batches(a.mini_batches)
        .with_packing(a.packing)
        .with_checkpoints(checkpoints.clone());
        if let Some(group) = &group {
            learner = learner.with_data_parallel(group.member(w, "critic_learn")?)?;
        }
        ctx.restore_optimizer("critic", learner.optimizer_mut())?;
        Ok(learner)
    }
}

/// The frozen reference.
pub fn reference(
    cfg: &RunConfig,
) -> impl Fn(&WorkerInfo) -> Result<RefLogprob, StageError> + Send + Sync + 'static {
    let cfg = cfg.clone();
    move |w| {
        let dir = cfg.model.reference_dir();
        let mut model = load_frozen(&cfg, dir, w)?;
        // On the CPU kernels the reference's packing alone holds its weights.
        model.keep_only_cpu_packing()?;
        Ok(RefLogprob::new(model, cfg.generate.temperature)
            .with_logprob_chunk(cfg.algorithm.logprob_chunk)
            .with_packing(cfg.algorithm.packing))
    }
}

/// The distillation teacher: a frozen model writing `teacher_logprobs`,
/// placed and batched as the reference is.
pub fn teacher(
    cfg: &RunConfig,
) -> impl Fn(&WorkerInfo) -> Result<RefLogprob, StageError> + Send + Sync + 'static {
    let cfg = cfg.clone();
    move |w| {
        let mut model = load_frozen(&cfg, &cfg.teacher.path, w)?;
        let top_k = cfg.teacher.top_k;
        // The top k among the ids the student has a logit for.
        let student = weir_gpu::ModelConfig::load(&cfg.model.path)?.vocab_size;
        let below = (student < model.config.vocab_size).then_some(student);
        if top_k == 0 {
            // Its top k is read on libtorch: it keeps those weights then.
            model.keep_only_cpu_packing()?;
        }
        Ok(RefLogprob::new(model, cfg.generate.temperature)
            .with_logprob_chunk(cfg.algorithm.logprob_chunk)
            .with_packing(cfg.algorithm.packing)
            .with_top_k(top_k, below)
            .writing(weir_operators::rollout::col::TEACHER_LOGPROBS))
    }
}

/// The learner settings of the config.
pub fn learner_config(cfg: &RunConfig, kl_in_loss: bool) -> LearnerConfig {
    let a = &cfg.algorithm;
    LearnerConfig {
        adamw: adamw(cfg, a.lr),
        max_grad_norm: (a.max_grad_norm > 0.0).then_some(a.max_grad_norm),
        micro_batch: a.micro_batch,
        micro_batch_tokens: a.micro_batch_tokens,
        policy: PolicyLossConfig {
            clip_low: a.clip_low,
            clip_high: a.clip_high,
            dual_clip: (a.dual_clip > 0.0)
                .then_some(a.dual_clip)
                .or(cfg.algorithm.flavor.default_dual_clip()),
            ratio_level: match a.policy_loss {
                PolicyLossChoice::Gspo => RatioLevel::Sequence,
                PolicyLossChoice::Ppo
                | PolicyLossChoice::Cispo
                | PolicyLossChoice::Sapo
                | PolicyLossChoice::Gmpo
                | PolicyLossChoice::Gpg
                | PolicyLossChoice::Reinforce
                | PolicyLossChoice::ClipCov
                | PolicyLossChoice::KlCov
                | PolicyLossChoice::DppoTv
                | PolicyLossChoice::DppoKl
                | PolicyLossChoice::Dro => RatioLevel::Token,
            },
            objective: objective(cfg),
            aggregation: a.aggregation,
            flavor: cfg.algorithm.flavor,
            correction: {
                let (low, high) = (a.correction_low, a.correction_high);
                let gate = |divergence| ImportanceCorrection::DivergenceGate {
                    divergence,
                    sequence: matches!(
                        a.correction,
                        CorrectionChoice::SeqBinaryKl | CorrectionChoice::SeqTv
                    ),
                    high,
                };
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
                    CorrectionChoice::SeqIcepop => {
                        Some(ImportanceCorrection::SequenceIcePop { low, high })
                    }
                    CorrectionChoice::BinaryKl | CorrectionChoice::SeqBinaryKl => {
                        Some(gate(GateDivergence::BinaryKl))
                    }
                    CorrectionChoice::Tv | CorrectionChoice::SeqTv => {
                        Some(gate(GateDivergence::Tv))
                    }
                    CorrectionChoice::None => None,
                }
            },
            loss_scale_factor: Some(loss_scale_factor(cfg)),
            // The learner measures it each step, when weights are normalised.
            weight_normalizer: 1.0,
            // Checked when the config was read.
            rejection: a
                .rejection
                .as_deref()
                .map(|options| {
                    RejectionChain::parse(options, &a.rejection_threshold)
                        .expect("validated with the config")
                })
                .unwrap_or_default(),
        },
        normalize_weights: a.correction_batch_normalize,
        temperature: cfg.generate.temperature,
        kl_coef: if kl_in_loss { a.kl_coef } else { 0.0 },
        kl_estimator: a.kl_estimator,
        kl_unbiased_gradient: a.kl_unbiased_gradient,
        ppo_epochs: a.ppo_epochs,
        mini_batches: a.mini_batches,
        schedule: schedule(cfg),
        entropy_coef: a.entropy_coef,
        gradient_checkpointing: a.gradient_checkpointing,
        packing: a.packing,
        logprob_chunk: a.logprob_chunk,
        // Distill's teacher records its top k only there.
        gkd: (cfg.teacher.top_k > 0).then(|| GkdLoss {
            k: cfg.teacher.top_k,
            beta: a.gkd_beta,
            coef: a.gkd_coef,
            tail: a.gkd_tail.tail(),
        }),
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
        PolicyLossChoice::Dro => PolicyObjective::Dro { beta: a.dro_beta },
        PolicyLossChoice::DppoTv | PolicyLossChoice::DppoKl => PolicyObjective::Dppo {
            divergence: if a.policy_loss == PolicyLossChoice::DppoTv {
                GateDivergence::Tv
            } else {
                GateDivergence::BinaryKl
            },
            // verl's clip_ratio_c: the config's dual clip, else the
            // flavor's default, else its function's fallback.
            cap: if a.dual_clip > 0.0 {
                a.dual_clip
            } else {
                a.flavor.default_dual_clip().unwrap_or(20.0)
            },
        },
    }
}

/// T of Dr.GRPO's `seq-mean-token-sum-norm`: the config's, or the padded
/// response length (`generate.max_new_tokens`, constant over the run, as
/// verl pads every response to its maximum length).
pub fn loss_scale_factor(cfg: &RunConfig) -> f64 {
    let t = cfg.algorithm.loss_scale_factor;
    if t > 0.0 {
        t
    } else {
        cfg.generate.max_new_tokens as f64
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
pub fn data_parallel_group(cfg: &RunConfig) -> Option<DataParallel> {
    let workers = cfg.placement.train.clone();
    (workers.len() > 1).then(|| DataParallel {
        host: HostGroup::new(workers.len()),
        workers,
        shard_optimizer: cfg.placement.shard_optimizer,
    })
}

/// The data-parallel ranks of the train workers: ranks that share a process
/// sum through a [`HostGroup`] (on their devices); ranks in several
/// processes sum over the engine's own channels (`weir_graph::collective`,
/// through host memory), with the same bits.
#[derive(Clone, Debug)]
pub struct DataParallel {
    workers: Vec<usize>,
    host: Arc<HostGroup>,
    /// Trainers shard their optimizer state over the ranks (`placement.shard_optimizer`).
    shard_optimizer: bool,
}

impl DataParallel {
    /// Worker `w`'s rank of the group named `name` (a trainer's stage name:
    /// groups of different trainers on the same workers stay apart).
    pub fn member(&self, w: &WorkerInfo, name: &str) -> Result<GroupMember, StageError> {
        let one_process = weir_graph::collective::local_workers(w)
            .is_none_or(|local| self.workers.iter().all(|x| local.contains(x)));
        let member = if one_process {
            self.host.member(w.rank)
        } else {
            let handle = weir_graph::collective::join(w, name, &self.workers)?;
            GroupMember::over(Box::new(ClusterRank(handle)))
        };
        Ok(member.sharding_optimizer(self.shard_optimizer))
    }
}

/// A rank whose group spans processes: the engine's all-reduce.
#[derive(Debug)]
struct ClusterRank(weir_graph::collective::GroupHandle);

impl HostReduce for ClusterRank {
    fn rank(&self) -> usize {
        self.0.rank()
    }

    fn size(&self) -> usize {
        self.0.size()
    }

    fn all_reduce(
        &self,
        values: Vec<f32>,
        scalars: Vec<f64>,
    ) -> Result<(Vec<f32>, Vec<f64>), String> {
        self.0.all_reduce(values, scalars)
    }

    fn reduce_scatter(
        &self,
        values: Vec<f32>,
        bounds: &[usize],
        scalars: Vec<f64>,
    ) -> Result<(Vec<f32>, Vec<f64>), String> {
        self.0.reduce_scatter(values, bounds, scalars)
    }

    fn all_gather(&self, chunk: Vec<f32>, bounds: &[usize]) -> Result<Vec<f32>, String> {
        self.0.all_gather(chunk, bounds)
    }
}

/// The actor's learner, restoring its optimizer on resume and saving checkpoints.
pub fn learner(
    cfg: &RunConfig,
    ctx: &RunContext,
    kind: PipelineKind,
) -> impl Fn(&WorkerInfo) -> Result<Learner, StageError> + Send + Sync + 'static {
    let (cfg, ctx) = (cfg.clone(), ctx.clone());
    let group = data_parallel_group(&cfg);
    move |w| {
        let model = load_policy(&cfg, &ctx.actor, w)?;
        let mut learner = Learner::new(model, learner_config(&cfg, kind.kl_in_loss()))?
            .with_checkpoints(ctx.checkpoint_plan(&cfg));
        if let Some(group) = &group {
            learner = learner.with_data_parallel(group.member(w, "learn")?)?;
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
    move |w| {
        use weir_operators::rollout::{SCHEMA_VERSION, SCHEMA_VERSION_KEY};
        Ok(ParquetLog::new(&dir, w.index, rows)?
            .with_metadata(SCHEMA_VERSION_KEY, SCHEMA_VERSION)
            .with_metadata("weir.version", env!("CARGO_PKG_VERSION")))
    }
}
