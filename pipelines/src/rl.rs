//! The RL pipelines. Each reads as its dataflow: prompts → generate →
//! reward → (reference, critic, statistics, filter) → advantage → learner
//! → rollout log, with the learner's weights flowing back to `generate`.

use weir_graph::{Partition, Pipeline, Stage, StageError, WorkerInfo};
use weir_operators::data::from_log::{PassLogged, Replaying};
use weir_operators::rewards::finish::{FinishRewards, StopProperly};
use weir_operators::rewards::overlong::OverlongPenalty;
use weir_operators::rollout::col;
use weir_operators::stages::advantage::{
    GaeAdvantage, GroupAdvantage, GroupEstimator, ReinforceAdvantage, ReinforceBaseline,
};
use weir_operators::stages::critic::Critic;
use weir_operators::stages::distill::DistillAdvantage;
use weir_operators::stages::dynamic_sampling::{DynamicSampling, DynamicSamplingConfig};
use weir_operators::stages::prompt_stats::PromptStats;

use crate::config::{DistillTask, ReferencePlacement, RolloutAdvantages, TeacherPlacement};
use crate::context::RunContext;
use crate::roles::{self, ROLLOUT, TRAIN};
use crate::{PipelineError, PipelineKind, RunConfig};

/// GRPO: group-normalised outcome advantages, β·KL to the reference in the loss.
pub fn grpo(cfg: &RunConfig, ctx: &RunContext) -> Result<Pipeline, PipelineError> {
    Ok(group(cfg, ctx, PipelineKind::Grpo, GroupEstimator::Grpo))
}

/// Dr.GRPO: group-centred advantages without the std; its default loss
/// aggregation is `seq-mean-token-sum-norm`.
pub fn dr_grpo(cfg: &RunConfig, ctx: &RunContext) -> Result<Pipeline, PipelineError> {
    Ok(group(
        cfg,
        ctx,
        PipelineKind::DrGrpo,
        GroupEstimator::DrGrpo,
    ))
}

/// RLOO: each sample's baseline is the mean reward of the others in its group.
pub fn rloo(cfg: &RunConfig, ctx: &RunContext) -> Result<Pipeline, PipelineError> {
    Ok(group(cfg, ctx, PipelineKind::Rloo, GroupEstimator::Rloo))
}

/// OPO: each response's baseline is its group's length-weighted mean reward.
pub fn opo(cfg: &RunConfig, ctx: &RunContext) -> Result<Pipeline, PipelineError> {
    Ok(group(cfg, ctx, PipelineKind::Opo, GroupEstimator::Opo))
}

/// GRPO with pass@k advantages: only each group's best response learns,
/// by its margin over the second best.
pub fn grpo_passk(cfg: &RunConfig, ctx: &RunContext) -> Result<Pipeline, PipelineError> {
    Ok(group(
        cfg,
        ctx,
        PipelineKind::GrpoPassk,
        GroupEstimator::PassK,
    ))
}

/// GPG: `α (r − mean)` advantages; its default loss is the plain policy
/// gradient (`algorithm.policy_loss = "gpg"`).
pub fn gpg(cfg: &RunConfig, ctx: &RunContext) -> Result<Pipeline, PipelineError> {
    Ok(group(cfg, ctx, PipelineKind::Gpg, GroupEstimator::Gpg))
}

/// The optimal token baseline (verl 0.9's `optimal_token_baseline`, and its
/// multi-turn form for episodes): the generator records each token's
/// `Σ π²` ([`weir_operators::rollout::col::SUM_PI_SQUARED`]).
pub fn otb(cfg: &RunConfig, ctx: &RunContext) -> Result<Pipeline, PipelineError> {
    Ok(group(
        cfg,
        ctx,
        PipelineKind::Otb,
        GroupEstimator::OptimalTokenBaseline,
    ))
}

/// The group estimators' pipeline.
fn group(
    cfg: &RunConfig,
    ctx: &RunContext,
    kind: PipelineKind,
    estimator: GroupEstimator,
) -> Pipeline {
    let flavor = cfg.algorithm.flavor;
    let pipeline = rollouts(kind, cfg, ctx);
    let (pipeline, regroup) = statistics_and_filter(pipeline, cfg, ctx);
    // GDPO: the reward terms' weights.
    let gdpo = cfg.algorithm.gdpo.then(|| {
        cfg.reward
            .terms
            .iter()
            .map(|t| t.weight)
            .collect::<Vec<_>>()
    });
    // GPG's α and GDPO's whitening count the whole step: ranks sum their figures.
    let ranks = roles::data_parallel_group(cfg)
        .filter(|_| estimator == GroupEstimator::Gpg || gdpo.is_some());
    let offload = ranks.is_some();
    let advantage = move |w: &WorkerInfo| {
        let mut advantage = GroupAdvantage::new(estimator, flavor);
        if let Some(weights) = &gdpo {
            advantage = advantage.with_gdpo(weights.clone());
        }
        Ok(match &ranks {
            Some(group) => advantage.with_data_parallel(group.member(w, "advantage")?),
            None => advantage,
        })
    };
    let pipeline = pipeline.stage(
        "advantage",
        TRAIN,
        regroup,
        pass_logged(advantage, ctx, logged_advantages(cfg)),
    );
    let pipeline = if offload {
        // Ranks wait for each other: off the worker thread.
        pipeline.offload(roles::MODEL_QUEUE)
    } else {
        pipeline
    };
    pipeline
        .learn(
            "learn",
            TRAIN,
            Partition::Local,
            roles::learner(cfg, ctx, kind),
        )
        .sink("log", TRAIN, Partition::Local, roles::rollout_log(cfg, ctx))
}

/// On-policy distillation: the teacher scores every sampled token, and
/// each token's advantage is `distill_coef · (log π_teacher − log
/// π_student)`, added to a task's group advantage when
/// `algorithm.distill_task` names an estimator
/// ([`DistillAdvantage`]); β·KL to the reference, if any, in the loss.
pub fn distill(cfg: &RunConfig, ctx: &RunContext) -> Result<Pipeline, PipelineError> {
    let flavor = cfg.algorithm.flavor;
    let pipeline = rollouts(PipelineKind::Distill, cfg, ctx);
    let task = match cfg.algorithm.distill_task {
        DistillTask::None => None,
        DistillTask::Grpo => Some(GroupEstimator::Grpo),
        DistillTask::DrGrpo => Some(GroupEstimator::DrGrpo),
        DistillTask::Rloo => Some(GroupEstimator::Rloo),
    };
    // Whole groups reach one worker: the task's estimator needs them.
    let by_group = Partition::ByKey(col::GROUP_ID.into());
    // Rows trained from logs keep their logged advantages when asked to.
    let logged = logged_advantages(cfg);
    let pipeline = match task {
        Some(estimator) => pipeline.stage(
            "task_advantage",
            TRAIN,
            by_group,
            pass_logged(
                move |_: &WorkerInfo| Ok(GroupAdvantage::new(estimator, flavor)),
                ctx,
                logged,
            ),
        ),
        None => pipeline,
    };
    let coef = cfg.algorithm.distill_coef;
    let partition = if task.is_some() {
        Partition::Local
    } else {
        Partition::ByKey(col::GROUP_ID.into())
    };
    Ok(pipeline
        .stage(
            "advantage",
            TRAIN,
            partition,
            pass_logged(
                move |_: &WorkerInfo| Ok(DistillAdvantage::new(coef)),
                ctx,
                logged,
            ),
        )
        .learn(
            "learn",
            TRAIN,
            Partition::Local,
            roles::learner(cfg, ctx, PipelineKind::Distill),
        )
        .sink("log", TRAIN, Partition::Local, roles::rollout_log(cfg, ctx)))
}

/// REINFORCE++: the KL to the reference shaped into token rewards, returns whitened.
pub fn reinforce_pp(cfg: &RunConfig, ctx: &RunContext) -> Result<Pipeline, PipelineError> {
    Ok(reinforce(
        cfg,
        ctx,
        PipelineKind::ReinforcePp,
        ReinforceBaseline::None,
    ))
}

/// REINFORCE++-baseline: the group mean subtracted from the score first.
pub fn reinforce_pp_baseline(cfg: &RunConfig, ctx: &RunContext) -> Result<Pipeline, PipelineError> {
    Ok(reinforce(
        cfg,
        ctx,
        PipelineKind::ReinforcePpBaseline,
        ReinforceBaseline::GroupMean,
    ))
}

/// ReMax: one more, greedy, response per prompt; its reward is the
/// baseline subtracted from each sampled response's return (KL in the
/// reward, as verl's recipe has it). The greedy rows are scored and then
/// leave at the advantage stage.
pub fn remax(cfg: &RunConfig, ctx: &RunContext) -> Result<Pipeline, PipelineError> {
    Ok(reinforce(
        cfg,
        ctx,
        PipelineKind::Remax,
        ReinforceBaseline::Greedy,
    ))
}

fn reinforce(
    cfg: &RunConfig,
    ctx: &RunContext,
    kind: PipelineKind,
    baseline: ReinforceBaseline,
) -> Pipeline {
    let a = cfg.algorithm.clone();
    let flavor = cfg.algorithm.flavor;
    let (kl_coef, adaptive_kl) = roles::in_reward_kl(cfg, ctx);
    let greedy = baseline == ReinforceBaseline::Greedy;
    let group = roles::data_parallel_group(cfg);
    rollouts(kind, cfg, ctx)
        .stage(
            "advantage",
            TRAIN,
            Partition::ByKey(col::GROUP_ID.into()),
            pass_logged(
                move |w: &WorkerInfo| {
                    let mut advantage = ReinforceAdvantage::new(baseline, kl_coef);
                    advantage.adaptive_kl = adaptive_kl.clone();
                    advantage.gamma = a.gamma;
                    advantage.kl_estimator = a.kl_estimator;
                    advantage.flavor = flavor;
                    if greedy {
                        // verl's ReMax does not clip the score.
                        advantage.reward_clip = None;
                    }
                    if let Some(group) = &group {
                        advantage = advantage.with_data_parallel(group.member(w, "advantage")?);
                    }
                    Ok(advantage)
                },
                ctx,
                logged_advantages(cfg),
            ),
        )
        // Ranks wait for each other in their whitening: off the worker thread.
        .offload(roles::MODEL_QUEUE)
        .learn(
            "learn",
            TRAIN,
            Partition::Local,
            roles::learner(cfg, ctx, kind),
        )
        .sink("log", TRAIN, Partition::Local, roles::rollout_log(cfg, ctx))
}

/// PPO: a critic scores every token before GAE and is fitted after the policy update.
pub fn ppo(cfg: &RunConfig, ctx: &RunContext) -> Result<Pipeline, PipelineError> {
    let critic = roles::critic(cfg, ctx);
    let fit = critic.clone();
    let (a, flavor) = (cfg.algorithm.clone(), cfg.algorithm.flavor);
    let (kl_coef, adaptive_kl) = roles::in_reward_kl(cfg, ctx);
    let packing = cfg.algorithm.packing;
    let group = roles::data_parallel_group(cfg);
    Ok(rollouts(PipelineKind::Ppo, cfg, ctx)
        // By group, so that data-parallel ranks each get a share of every step.
        .stage(
            "critic",
            TRAIN,
            Partition::ByKey(col::GROUP_ID.into()),
            move |w| Ok(Critic::new(&critic, w)?.with_packing(packing)),
        )
        .offload(roles::MODEL_QUEUE)
        .stage(
            "advantage",
            TRAIN,
            Partition::Local,
            pass_logged(
                move |w: &WorkerInfo| {
                    let mut advantage = GaeAdvantage::new(kl_coef);
                    advantage.adaptive_kl = adaptive_kl.clone();
                    (advantage.gamma, advantage.lambda) = (a.gamma, a.lambda);
                    advantage.kl_estimator = a.kl_estimator;
                    advantage.flavor = flavor;
                    if let Some(group) = &group {
                        advantage = advantage.with_data_parallel(group.member(w, "advantage")?);
                    }
                    Ok(advantage)
                },
                ctx,
                logged_advantages(cfg),
            ),
        )
        // Ranks wait for each other in their whitening: off the worker thread.
        .offload(roles::MODEL_QUEUE)
        .learn(
            "learn",
            TRAIN,
            Partition::Local,
            roles::learner(cfg, ctx, PipelineKind::Ppo),
        )
        .stage(
            "critic_learn",
            TRAIN,
            Partition::Local,
            roles::critic_learner(cfg, ctx, fit),
        )
        .offload(roles::MODEL_QUEUE)
        .sink("log", TRAIN, Partition::Local, roles::rollout_log(cfg, ctx)))
}

/// `kind`'s prompts (with ReMax's greedy row per prompt), generation and
/// reward on the rollout workers, then the reference's (and distillation's
/// teacher's) log-probs where they are placed. A judge placed on workers of
/// its own (`placement.judge`) takes the reward stages there, last, each
/// judge worker a share of every batch by group, while the rollout workers
/// go on generating.
fn rollouts(kind: PipelineKind, cfg: &RunConfig, ctx: &RunContext) -> Pipeline {
    let (greedy, teacher) = (kind == PipelineKind::Remax, kind == PipelineKind::Distill);
    let pipeline = Pipeline::new(kind.name());
    let prompts = crate::prompts::prompts(cfg, ctx, cfg.data.samples_per_prompt);
    let pipeline = pipeline
        .source(ROLLOUT, move |w| {
            let source = prompts(w)?;
            Ok(if greedy {
                source.greedy_baseline()
            } else {
                source
            })
        })
        .generate(
            "generate",
            ROLLOUT,
            Partition::Local,
            replaying(roles::actor(cfg, ctx, kind == PipelineKind::Otb), ctx),
        )
        .offload(2);
    let judged_apart = !cfg.placement.judge.is_empty();
    let pipeline = if judged_apart {
        pipeline
    } else {
        rewards(pipeline, cfg, ctx, ROLLOUT, Partition::Local)
    };
    // The frozen scorers: the reference (for β·KL) and distillation's
    // teacher, each beside the generator (balancing a learner-bound step)
    // or on the train workers, by group: each of them scores a share of
    // every batch (whole batches in turn would leave all but one idle).
    // Those beside the generator come first: rows reach the train workers once.
    // A teacher on workers of its own is reached by group, as the train workers are.
    let by_group = || Partition::ByKey(col::GROUP_ID.into());
    let placed = |at: ReferencePlacement| match at {
        ReferencePlacement::Rollout => (ROLLOUT, Partition::Local),
        ReferencePlacement::Train => (TRAIN, by_group()),
    };
    let mut scorers = Vec::new();
    if cfg.algorithm.kl_coef > 0.0 {
        scorers.push(("reference", placed(cfg.placement.reference)));
    }
    if teacher {
        let at = match &cfg.placement.teacher {
            TeacherPlacement::At(at) => placed(*at),
            TeacherPlacement::Workers(_) => (roles::TEACHER, by_group()),
        };
        scorers.push(("teacher", at));
    }
    scorers.sort_by_key(|(_, (_, partition))| *partition != Partition::Local);
    let pipeline = scorers
        .into_iter()
        .fold(pipeline, |pipeline, (name, (role, partition))| {
            let pipeline = if name == "teacher" {
                pipeline.stage(name, role, partition, roles::teacher(cfg))
            } else {
                pipeline.stage(name, role, partition, roles::reference(cfg))
            };
            pipeline.offload(roles::MODEL_QUEUE)
        });
    if judged_apart {
        rewards(
            pipeline,
            cfg,
            ctx,
            roles::JUDGE,
            Partition::ByKey(col::GROUP_ID.into()),
        )
    } else {
        pipeline
    }
}

/// The reward stages on `role`, the first reached over `partition`: the
/// reward, then the overlong penalty, ProRL's stop-properly factor and the
/// finish-reason rewards when configured. Rows replayed from a log keep
/// their logged rewards.
fn rewards(
    pipeline: Pipeline,
    cfg: &RunConfig,
    ctx: &RunContext,
    role: &str,
    partition: Partition,
) -> Pipeline {
    let pipeline = pipeline
        .stage(
            "reward",
            role,
            partition,
            pass_logged(crate::rewards::reward(cfg), ctx, true),
        )
        .offload(roles::MODEL_QUEUE);
    let pipeline = if cfg.reward.overlong_buffer > 0 {
        let penalty = OverlongPenalty {
            max_len: cfg.generate.max_new_tokens,
            buffer: cfg.reward.overlong_buffer,
            factor: cfg.reward.overlong_penalty_factor,
        };
        pipeline.stage(
            "overlong",
            role,
            Partition::Local,
            pass_logged(move |_: &WorkerInfo| Ok(penalty), ctx, true),
        )
    } else {
        pipeline
    };
    let pipeline = if cfg.reward.stop_properly_coef != 1.0 {
        let penalty = StopProperly {
            coef: cfg.reward.stop_properly_coef,
        };
        pipeline.stage(
            "stop_properly",
            role,
            Partition::Local,
            pass_logged(move |_: &WorkerInfo| Ok(penalty), ctx, true),
        )
    } else {
        pipeline
    };
    if cfg.reward.on_finish.is_empty() {
        pipeline
    } else {
        let rules = FinishRewards {
            rules: cfg.reward.on_finish.clone(),
        };
        pipeline.stage(
            "on_finish",
            role,
            Partition::Local,
            pass_logged(move |_: &WorkerInfo| Ok(rules.clone()), ctx, true),
        )
    }
}

/// The actor's generator, replaying a share of each step's groups from
/// `data.rollouts` when the run trains from logs.
fn replaying<S: Stage + 'static>(
    actor: impl Fn(&WorkerInfo) -> Result<S, StageError> + Send + Sync + 'static,
    ctx: &RunContext,
) -> impl Fn(&WorkerInfo) -> Result<Box<dyn Stage>, StageError> + Send + Sync + 'static {
    let log = ctx.replay.clone();
    move |w| -> Result<Box<dyn Stage>, StageError> {
        let inner = actor(w)?;
        Ok(match &log {
            Some(log) => Box::new(Replaying::new(inner, log.clone())),
            None => Box::new(inner),
        })
    }
}

/// `stage`, which rows replayed from a log pass untouched when the run
/// trains from logs and `pass` (the reward stages: a replayed row keeps
/// its logged reward; the advantage stage with `data.rollout_advantages =
/// "logged"`).
fn pass_logged<S: Stage + 'static>(
    stage: impl Fn(&WorkerInfo) -> Result<S, StageError> + Send + Sync + 'static,
    ctx: &RunContext,
    pass: bool,
) -> impl Fn(&WorkerInfo) -> Result<Box<dyn Stage>, StageError> + Send + Sync + 'static {
    let replays = ctx.replay.is_some() && pass;
    move |w| -> Result<Box<dyn Stage>, StageError> {
        let inner = stage(w)?;
        Ok(if replays {
            Box::new(PassLogged::new(inner))
        } else {
            Box::new(inner)
        })
    }
}

/// Whether replayed rows keep their logged advantages.
fn logged_advantages(cfg: &RunConfig) -> bool {
    cfg.data.rollout_advantages == RolloutAdvantages::Logged
}

/// Per-prompt statistics (for the curriculum) and DAPO's filter, when on;
/// returns the partition that brings whole groups to the next stage.
fn statistics_and_filter(
    pipeline: Pipeline,
    cfg: &RunConfig,
    ctx: &RunContext,
) -> (Pipeline, Partition) {
    let by_group = Partition::ByKey(col::GROUP_ID.into());
    let mut pipeline = pipeline;
    let mut next = by_group.clone();
    if cfg.curriculum.enabled {
        let (view, threshold) = (ctx.stats.clone(), cfg.curriculum.solve_threshold);
        let checkpointer = ctx.checkpointer(cfg);
        let resumed = ctx
            .resumed_from
            .clone()
            .map(|dir| (dir, ctx.first_step.saturating_sub(1)));
        pipeline = pipeline.stage(
            "prompt_stats",
            TRAIN,
            Partition::ByKey(col::PROMPT_ID.into()),
            move |w| {
                // The stats go into checkpoints and come back on a resume.
                let stats = PromptStats::new(view.clone(), threshold)
                    .with_checkpoints(checkpointer.clone(), w);
                match &resumed {
                    Some((dir, step)) => stats.restored_from(dir, *step, w),
                    None => Ok(stats),
                }
            },
        );
        // Routed by prompt: each group is already on one worker.
        next = Partition::Local;
    }
    if cfg.dynamic_sampling.enabled {
        let filter = DynamicSamplingConfig {
            target_groups: (cfg.dynamic_sampling.target_groups > 0)
                .then_some(cfg.dynamic_sampling.target_groups),
            max_extra_steps: cfg.dynamic_sampling.max_extra_batches,
        };
        pipeline = pipeline.stage("dynamic_sampling", TRAIN, next, move |w| {
            Ok(DynamicSampling::new(filter, w.steps))
        });
        if filter.max_extra_steps > 0 && filter.target_groups.is_some() {
            // A step that waits for later steps' groups ends on an engine
            // thread, once they have come.
            pipeline = pipeline.offload(2);
        }
        next = Partition::Local;
    }
    (pipeline, next)
}
