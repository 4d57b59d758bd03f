//! From a config to a run folder, and back from a crash.
//!
//! ```text
//! RUN_DIR/
//!   config.resolved.toml     the pipeline and every key, defaults filled in
//!   cluster.secret           processes all on this machine, no secret given: theirs
//!   rollouts/*.parquet       every rollout row (superseded/ keeps rows a resume replaced)
//!   superseded/              metrics files as they were before each resume
//!   metrics.parquet          the engine's and the stages' metrics, long format
//!   checkpoints/step-N/      actor/ (critic/) in HF layout + optimizer state, state.json
//!   checkpoints/best         with eval.best_checkpoint: a link to the best-evaluated step-N, best.json
//!   tensorboard/             TensorBoard event files, a step at a time
//!   eval.json                greedy arith accuracy before training (arith runs)
//!   summary.json             steps, throughput, staleness, rewards, accuracy before/after
//! ```
//!
//! Resuming reads the newest complete checkpoint: the step counter, the
//! policy version and the prompt cursor continue from it, the optimizer
//! state is restored, metric rows up to it are kept (the old file is copied
//! to `superseded/`), and rollout rows of later steps (which the resumed run
//! produces again) move to `rollouts/superseded/`. Without a checkpoint the
//! run starts again from step 0, with everything it wrote kept aside.
//!
//! A run may span several processes ([`Cluster`], see `placement.rs`).
//! Process 0 writes the resolved config, the metrics, the evaluation and the
//! summary, and sets a resumed folder in order; every process writes the
//! rollouts and checkpoints of its own workers.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde_json::{json, Value};
use weir_graph::metrics::MetricRow;
use weir_graph::parquet_log::write_parquet_atomically;
use weir_graph::{Placement, RunReport, RunSettings};
use weir_operators::checkpoint::{latest, CheckpointCommits};
use weir_operators::data::cursor::CursorLog;
use weir_operators::stages::prompt_stats::StatsView;

use crate::context::RunContext;
use crate::placement::Cluster;
use crate::resume::{
    check_resumable, keep_aside, prior_metrics, refuse_foreign_folder, resume_invariants,
    trim_rollouts,
};
use crate::roles::{ROLLOUT, TRAIN};
use crate::{preference, rl, sft, PipelineError, PipelineKind, RunConfig};

/// What to run.
#[derive(Clone, Debug)]
pub struct RunRequest {
    /// The pipeline.
    pub pipeline: PipelineKind,
    /// Its config.
    pub config: RunConfig,
    /// The run folder.
    pub run_dir: PathBuf,
    /// Continue the run in `run_dir` from its newest checkpoint.
    pub resume: bool,
    /// Draw progress bars on stderr.
    pub progress: bool,
    /// The processes of the run (one by default).
    pub cluster: Cluster,
}

/// What a run produced.
#[derive(Debug)]
pub struct RunOutcome {
    /// The run folder.
    pub run_dir: PathBuf,
    /// The engine's report of this segment (with earlier segments' metrics).
    pub report: RunReport,
    /// What `summary.json` holds.
    pub summary: Value,
    /// The final actor checkpoint (HF layout).
    pub final_actor: PathBuf,
    /// On `--resume`, one line on what the resume did.
    pub note: Option<String>,
}

pub use crate::resume::{resolved_config_text, RESOLVED};

/// Reads a run folder's resolved config (for `weir run --resume`).
pub fn read_resolved(run_dir: &Path) -> Result<(PipelineKind, RunConfig), PipelineError> {
    let path = run_dir.join(RESOLVED);
    let text = weir_durable::read_text_capped(&path, weir_durable::SIDE_FILE_BYTES)
        .map_err(|e| format!("{}: {e} (is this a weir run folder?)", path.display()))?;
    let mut table: toml::Table =
        toml::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
    let name = table
        .remove("pipeline")
        .and_then(|v| v.as_str().map(String::from))
        .ok_or_else(|| format!("{}: no `pipeline` key", path.display()))?;
    let kind = PipelineKind::parse(&name).map_err(|e| format!("{}: {e}", path.display()))?;
    let body = toml::to_string(&table).map_err(|e| e.to_string())?;
    Ok((
        kind,
        RunConfig::from_toml(&body, &path.display().to_string())?,
    ))
}

/// Runs (or resumes) a pipeline into its run folder: checks the request,
/// sets the folder in order (resume), trains, then evaluates and summarises.
pub fn run(req: &RunRequest) -> Result<RunOutcome, PipelineError> {
    check_request(req)?;
    // Read before the folder is touched: a log no row of passes is refused.
    let replay = crate::from_log::logged_groups(req.pipeline, &req.config)?;
    let mut segment = prepare(req)?;
    segment.ctx.replay = replay;
    let started = std::time::Instant::now();
    let report = if segment.complete {
        RunReport::from_metrics(std::mem::take(&mut segment.prior), 0, 0.0, 0)
    } else {
        train(req, &mut segment)?
    };
    finish(req, segment, report, started.elapsed().as_secs_f64())
}

/// Where a run (or a resumed segment of it) starts.
struct Segment {
    ctx: RunContext,
    /// Metric rows of earlier segments, up to the checkpoint resumed from.
    prior: Vec<MetricRow>,
    /// Every step is done already (a finished run resumed again).
    complete: bool,
    /// On `--resume`, the one line on what the resume did.
    note: Option<String>,
    /// The log's manifest being written (process 0): hashing a large
    /// checkpoint's weights takes a while, so it runs beside the training
    /// and the run waits for it at its end.
    manifest: Option<std::thread::JoinHandle<Result<(), String>>>,
}

/// Everything that can be checked before a folder is touched: the config,
/// the checkpoints it names, the data-parallel layout.
fn check_request(req: &RunRequest) -> Result<(), PipelineError> {
    let (kind, cfg) = (req.pipeline, &req.config);
    cfg.validate(kind)?;
    for (key, path) in [
        ("model.path", Some(&cfg.model.path)),
        ("model.reference", cfg.model.reference.as_ref()),
        ("model.reward_model", cfg.model.reward_model.as_ref()),
        ("model.critic", cfg.model.critic.as_ref()),
    ] {
        let Some(path) = path.filter(|p| !p.as_os_str().is_empty()) else {
            continue;
        };
        if !path.join("config.json").is_file() {
            return Err(format!(
                "`{key}` = {path:?}: no config.json there (not a HF checkpoint folder)"
            )
            .into());
        }
    }
    check_heads(kind, cfg)?;
    let policy = weir_gpu::ModelConfig::load(Path::new(&cfg.model.path))?;
    let warnings = [
        default_rate_warning(kind, cfg, policy.parameter_count()),
        truncated_sampling_warning(kind, cfg),
        synchronous_streaming_warning(kind, cfg),
    ];
    for warning in warnings.into_iter().flatten() {
        tracing::warn!("{warning}");
    }
    if kind.is_rl() {
        check_generation(cfg, &policy)?;
        crate::from_log::check_logs(cfg)?;
        crate::rewards::check_judge(cfg)?;
    }
    crate::placement::check_data_parallel(cfg)?;
    crate::placement::execution(cfg, &req.cluster)?;
    Ok(())
}

/// Sets the run folder in order: refuses a foreign or taken folder, finds
/// the checkpoint to resume from and checks the config still fits it,
/// writes the resolved config, keeps aside what the resumed steps replace.
fn prepare(req: &RunRequest) -> Result<Segment, PipelineError> {
    let (kind, cfg, dir, cluster) = (req.pipeline, &req.config, &req.run_dir, &req.cluster);
    let leader = cluster.is_leader();
    let resolved = dir.join(RESOLVED);
    let failed_start = resolved.exists() && crate::resume::holds_no_steps(dir);
    if failed_start && leader && !req.resume {
        tracing::info!(
            "{}: an earlier start of a run here stopped before its first step: starting afresh",
            dir.display()
        );
    }
    if leader && !req.resume && resolved.exists() && !failed_start {
        return Err(format!(
            "{} already holds a run: resume it with `weir run --resume {}`, or pick another --out",
            dir.display(),
            dir.display()
        )
        .into());
    }
    if leader && !req.resume && !failed_start {
        refuse_foreign_folder(dir)?;
    }
    let found = if req.resume {
        latest(&dir.join("checkpoints"))?
    } else {
        None
    };
    let invariants = resume_invariants(kind, cfg);
    if let Some((ck, state)) = &found {
        check_resumable(dir, ck, state, cfg, &invariants)?;
    }
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    if leader {
        write_text(&resolved, &resolved_config_text(kind, cfg))?;
    }
    tch::set_num_threads(cfg.run.threads as i32);

    let mut ctx = RunContext {
        run_dir: dir.clone(),
        actor: cfg.model.path.clone(),
        resumed_from: None,
        first_step: 0,
        version: 0,
        cursor: None,
        cursors: CursorLog::new(),
        stats: StatsView::new(),
        last_step: cfg.run.steps - 1,
        components: if kind == PipelineKind::Ppo {
            vec!["actor".into(), "critic".into()]
        } else {
            vec!["actor".into()]
        },
        commits: CheckpointCommits::new(crate::context::checkpointer(cfg, dir)),
        invariants,
        values: weir_operators::checkpoint::StepValues::new(),
        resumed_values: BTreeMap::new(),
        replay: None,
    };
    let mut prior = Vec::new();
    if let Some((ck, state)) = &found {
        ctx.actor = ck.join("actor");
        ctx.resumed_from = Some(ck.clone());
        ctx.first_step = state.step + 1;
        ctx.version = state.version;
        ctx.cursor = state.cursor;
        ctx.resumed_values = state.values.clone();
        if leader {
            prior = prior_metrics(&dir.join("metrics.parquet"), state.step)?;
        }
        tracing::info!(step = state.step, "resuming from {}", ck.display());
    }
    let complete = ctx.first_step > ctx.last_step;
    let note = req.resume.then(|| match &found {
        Some(_) if complete => format!(
            "{}: the run is already complete (step {}): nothing to train",
            dir.display(),
            ctx.last_step
        ),
        Some((ck, state)) => format!(
            "{}: resuming at step {} from {} (policy version {}); rows and metrics of later steps kept in superseded/",
            dir.display(),
            ctx.first_step,
            ck.display(),
            state.version
        ),
        None => format!(
            "{}: no complete checkpoint yet: starting again from step 0; what the run wrote is kept in superseded/",
            dir.display()
        ),
    });
    if leader && req.resume && !complete {
        // What the interrupted segment wrote after its checkpoint (or all of
        // it, without one) is produced again: keep the old copies aside.
        keep_aside(&dir.join("metrics.parquet"))?;
        trim_rollouts(&dir.join("rollouts"), found.as_ref().map(|(_, s)| s.step))?;
    }
    // What produced the rows, for the log's readers to check: once the
    // folder is in order (a resume's tidying removes half-written files).
    let manifest = leader.then(|| {
        let (cfg, dir) = (cfg.clone(), dir.clone());
        std::thread::spawn(move || {
            crate::manifest::Manifest::of(kind, &cfg)
                .and_then(|m| m.write(&dir))
                .map_err(|e| e.to_string())
        })
    });
    Ok(Segment {
        ctx,
        prior,
        complete,
        note,
        manifest,
    })
}

/// Builds the pipeline and runs the segment's steps through the engine.
fn train(req: &RunRequest, segment: &mut Segment) -> Result<RunReport, PipelineError> {
    let (kind, cfg, dir, cluster) = (req.pipeline, &req.config, &req.run_dir, &req.cluster);
    let p = &cfg.placement;
    let placement = Placement::new(p.workers)
        .assign(ROLLOUT, p.rollout.iter().copied())
        .assign(TRAIN, p.train.iter().copied());
    let placement = if p.judge.is_empty() {
        placement
    } else {
        placement.assign(crate::roles::JUDGE, p.judge.iter().copied())
    };
    let placement = match &p.teacher {
        crate::config::TeacherPlacement::Workers(w) => {
            placement.assign(crate::roles::TEACHER, w.iter().copied())
        }
        crate::config::TeacherPlacement::At(_) => placement,
    };
    let (observer, bar) = crate::progress::observer(
        kind.name(),
        segment.ctx.first_step,
        cfg.run.steps,
        req.progress && cluster.is_leader(),
    );
    // Every process must run this same config from the same checkpoint.
    let fingerprint = {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        (
            resolved_config_text(kind, cfg),
            segment.ctx.first_step,
            segment.ctx.version,
        )
            .hash(&mut h);
        h.finish()
    };
    let execution = crate::placement::execution(cfg, cluster)?;
    let secret = execution.cluster_secret(cluster.secret.clone(), dir)?;
    let settings = RunSettings::new(execution, placement)
        .fingerprint(fingerprint)
        .peer_timeout(cluster.peer_timeout)
        .connect_timeout(cluster.connect_timeout)
        .cluster_secret(secret)
        .weights_bucket_bytes(cfg.placement.weights_bucket_mib << 20)
        .max_weights_bytes(max_weights_bytes(cfg)?)
        .encrypt(cfg.placement.encrypt)
        .weights_channel(
            cfg.placement
                .weights_channel
                .channel(cfg.placement.weights_port),
        )
        .max_staleness(cfg.run.max_staleness)
        .steps(cfg.run.steps - segment.ctx.first_step)
        .resume_at(segment.ctx.first_step, segment.ctx.version)
        .metrics_path(dir.join("metrics.parquet"))
        .commits(cfg.run.checkpoint_every, {
            let commits = segment.ctx.commits.clone();
            let trimmed = Arc::new(std::sync::atomic::AtomicU64::new(0));
            Arc::new(move |at| {
                commits.commit(at)?;
                // Once per commit point and process (every worker calls
                // this): glibc keeps the pages of a model's large
                // short-lived buffers, so without it a long CPU run's
                // resident memory creeps up while what it uses stays flat.
                if trimmed.fetch_max(at + 1, std::sync::atomic::Ordering::SeqCst) <= at {
                    weir_gpu::device::release_freed_host_memory();
                }
                Ok(())
            })
        })
        .prior_metrics(std::mem::take(&mut segment.prior))
        .observe_steps({
            // The evaluation's rows as one figure per step, not a mean over workers.
            let events = weir_graph::tensorboard::step_observer(&dir.join("tensorboard"));
            Arc::new(move |step, rows: &[MetricRow]| {
                if rows.iter().any(|r| r.stage == crate::eval::STAGE) {
                    events(step, &crate::eval::folded(rows))
                } else {
                    events(step, rows)
                }
            })
        })
        .observe(observer);
    let local = cluster.local_workers(cfg.placement.workers);
    let hosts = |set: &[usize]| set.iter().any(|w| local.contains(w));
    if hosts(&cfg.placement.train) && !hosts(&cfg.placement.rollout) {
        // Checkpoints are written here, but the prompts are drawn elsewhere.
        segment.ctx.cursors = crate::placement::derived_cursors(
            kind,
            cfg,
            &segment.ctx,
            cluster,
            settings.run_steps(),
        )?;
    }
    let ctx = &segment.ctx;
    let pipeline = match kind {
        PipelineKind::Grpo => rl::grpo(cfg, ctx)?,
        PipelineKind::DrGrpo => rl::dr_grpo(cfg, ctx)?,
        PipelineKind::Rloo => rl::rloo(cfg, ctx)?,
        PipelineKind::Opo => rl::opo(cfg, ctx)?,
        PipelineKind::Otb => rl::otb(cfg, ctx)?,
        PipelineKind::GrpoPassk => rl::grpo_passk(cfg, ctx)?,
        PipelineKind::Gpg => rl::gpg(cfg, ctx)?,
        PipelineKind::ReinforcePp => rl::reinforce_pp(cfg, ctx)?,
        PipelineKind::ReinforcePpBaseline => rl::reinforce_pp_baseline(cfg, ctx)?,
        PipelineKind::Remax => rl::remax(cfg, ctx)?,
        PipelineKind::Distill => rl::distill(cfg, ctx)?,
        PipelineKind::Ppo => rl::ppo(cfg, ctx)?,
        PipelineKind::Sft => sft::sft(cfg, ctx)?,
        PipelineKind::Rm => preference::rm(cfg, ctx)?,
        PipelineKind::Dpo => preference::dpo(cfg, ctx)?,
    };
    let report = pipeline.run(&settings);
    bar.finish();
    Ok(report?)
}

/// After the steps: the final checkpoint must be there; process 0 measures
/// the arith accuracy (arith runs) and writes `summary.json`.
fn finish(
    req: &RunRequest,
    segment: Segment,
    report: RunReport,
    wall_s: f64,
) -> Result<RunOutcome, PipelineError> {
    let (kind, cfg, dir, cluster) = (req.pipeline, &req.config, &req.run_dir, &req.cluster);
    let Segment {
        ctx,
        complete,
        note,
        manifest,
        ..
    } = segment;
    if let Some(job) = manifest {
        let written = job
            .join()
            .unwrap_or_else(|_| Err("its thread panicked".into()));
        if let Err(e) = written {
            tracing::warn!(
                "{}: the rollout log's manifest was not written: {e}",
                dir.display()
            );
        }
    }
    let final_actor = dir
        .join("checkpoints")
        .join(format!("step-{}", ctx.last_step))
        .join("actor");
    let outcome = |report, summary| RunOutcome {
        run_dir: dir.clone(),
        report,
        summary,
        final_actor: final_actor.clone(),
        note,
    };
    if !cluster.is_leader() {
        let summary = json!({
            "pipeline": kind.name(),
            "process": cluster.process,
            "processes": cluster.processes,
        });
        return Ok(outcome(report, summary));
    }
    if !final_actor.is_dir() {
        let shared = if cluster.processes > 1 {
            " (with several processes, the run folder must be one that every process sees)"
        } else {
            ""
        };
        return Err(format!(
            "the run ended without its final checkpoint {}{shared}",
            final_actor.display()
        )
        .into());
    }
    // A finished run resumed again keeps the summary of its last segment.
    let kept = complete
        .then(|| std::fs::read_to_string(dir.join("summary.json")).ok())
        .flatten()
        .and_then(|text| serde_json::from_str::<Value>(&text).ok());
    if let Some(summary) = kept {
        return Ok(outcome(report, summary));
    }
    // The task's own measure of the starting and the final policy (arith: accuracy).
    let (before, after) = match cfg.data.prompts.accuracy(kind, cfg, dir, &final_actor)? {
        Some((before, after)) => (Some(before), Some(after)),
        None => (None, None),
    };
    let mut report = report;
    let held_out = if cfg.eval.prompts.is_none() {
        None
    } else {
        // The final policy (version last_step + 1) on the held-out prompts,
        // beside the run's metrics and the evaluations during training.
        // (A resumed segment's prior metrics stop at its checkpoint, so no
        // earlier final evaluation is among them.)
        let version = ctx.last_step + 1;
        let result = crate::eval::evaluate(cfg, &final_actor, version)?;
        let rows = result.metric_rows(version, 0);
        weir_graph::tensorboard::step_observer(&dir.join("tensorboard"))(version, &rows);
        report.metrics.extend(rows);
        let batch = weir_graph::metrics::rows_to_batch(&report.metrics)?;
        write_parquet_atomically(&dir.join("metrics.parquet"), &[batch])?;
        Some(result)
    };
    let mut summary = summarize(
        kind,
        cfg,
        &ctx,
        &report,
        wall_s,
        before,
        after,
        &final_actor,
    );
    if let Some(r) = held_out {
        summary["eval_prompts"] = r.prompts.into();
        summary["eval_reward"] = r.reward.into();
        summary["eval_mean_at_k"] = r.mean_at_k.into();
        summary["eval_pass_at_k"] = r.pass_at_k.into();
        let points = crate::eval::points(&report.metrics);
        summary["eval_history"] = points
            .iter()
            .map(|(step, p)| json!({"step": step, "policy_version": p.policy_version, "reward": p.reward, "mean_at_k": p.mean_at_k, "pass_at_k": p.pass_at_k}))
            .collect::<Vec<_>>()
            .into();
        if cfg.eval.best_checkpoint {
            let best = crate::eval::mark_best_checkpoint(&dir.join("checkpoints"), &points)?;
            summary["best_checkpoint"] = best
                .map(|(ck, step, p)| {
                    json!({"checkpoint": ck.display().to_string(), "eval_step": step, "policy_version": p.policy_version, "reward": p.reward})
                })
                .into();
        }
    }
    write_text(
        &dir.join("summary.json"),
        &serde_json::to_string_pretty(&summary).map_err(|e| e.to_string())?,
    )?;
    Ok(outcome(report, summary))
}

/// Refuses checkpoints of the wrong kind: the policy and the reference must
/// be causal LMs, a reward model must have a score head.
fn check_heads(kind: PipelineKind, cfg: &RunConfig) -> Result<(), PipelineError> {
    use weir_gpu::{Head, ModelConfig};
    let m = &cfg.model;
    let policy = kind != PipelineKind::Rm;
    let scorer = cfg.reward.kind == crate::config::RewardKind::Model || kind == PipelineKind::Rm;
    let mut wanted = vec![("model.reference", m.reference.as_ref(), Head::CausalLm)];
    if policy {
        wanted.push(("model.path", Some(&m.path), Head::CausalLm));
    }
    if scorer {
        wanted.push((
            "model.reward_model",
            m.reward_model.as_ref(),
            Head::SequenceClassification,
        ));
    }
    for (key, path, head) in wanted {
        let Some(path) = path else {
            continue;
        };
        let config = ModelConfig::load(path)?;
        if config.head != head {
            let need = match head {
                Head::CausalLm => "a causal LM (*ForCausalLM) is needed here",
                Head::SequenceClassification => {
                    "a reward model needs a score head (*ForSequenceClassification)"
                }
            };
            return Err(format!(
                "`{key}` = {path:?}: the checkpoint is a {}; {need}",
                config.architecture
            )
            .into());
        }
    }
    Ok(())
}

/// The default learning rates are sized for small models (weir's demo,
/// tests and fixtures); a large checkpoint trained at such a default would
/// most likely diverge: the warning for `cfg`'s learning rate on a
/// checkpoint of `weights` weights, past 50M weights and a rate above 1e-5
/// left at the pipeline's default.
fn default_rate_warning(kind: PipelineKind, cfg: &RunConfig, weights: i64) -> Option<String> {
    let lr = cfg.algorithm.lr;
    let default = lr == RunConfig::defaults_for(kind).algorithm.lr;
    (default && lr > 1e-5 && weights > 50_000_000).then(|| {
        format!(
            "`algorithm.lr` = {lr:e} is {}'s default, sized for small models; {} has {:.0}M \
             weights, which RLHF frameworks train at about 1e-6 (SFT about 1e-5): set algorithm.lr",
            kind.name(),
            cfg.model.path.display(),
            weights as f64 / 1e6
        )
    })
}

/// Off-policy corrections weigh each token by exp(old − behaviour): with
/// top-p or top-k the behaviour log-probs are the truncated distribution's,
/// so the weights of on-policy tokens are the kept mass, below 1 (as in
/// verl and OpenRLHF). Worth a line at the start.
fn truncated_sampling_warning(kind: PipelineKind, cfg: &RunConfig) -> Option<String> {
    let g = &cfg.generate;
    let truncated = g.top_p < 1.0 || g.top_k > 0;
    let correction = cfg.algorithm.correction != crate::config::CorrectionChoice::None;
    (kind.is_rl() && truncated && correction).then(|| {
        "generate.top_p < 1 or generate.top_k truncate the sampling distribution: \
         algorithm.correction's weights exp(old − behaviour) then fall below 1 on \
         on-policy tokens by the kept probability mass (verl and OpenRLHF do the same)"
            .to_string()
    })
}

/// At `run.max_staleness = 0` no step's rows start before its weights, so
/// streaming generation changes no row: the pool only caps how many
/// sequences decode at once. A user who set `generate.max_inflight` for
/// asynchrony should hear that at the start.
fn synchronous_streaming_warning(kind: PipelineKind, cfg: &RunConfig) -> Option<String> {
    let pool = cfg.generate.max_inflight;
    (kind.is_rl() && pool > 0 && cfg.run.max_staleness == 0).then(|| {
        format!(
            "generate.max_inflight = {pool} at run.max_staleness = 0: every step waits for its              weights, so streaming overlaps no steps; the pool only caps the sequences decoded              at once (set run.max_staleness > 0 for asynchrony)"
        )
    })
}

/// What generation needs of the policy's checkpoint (`config`): room for
/// the responses in its context, and a token that ends them (unless
/// `generate.ignore_eos` lets every response run to its budget).
fn check_generation(cfg: &RunConfig, config: &weir_gpu::ModelConfig) -> Result<(), PipelineError> {
    let path = Path::new(&cfg.model.path);
    let budget = cfg.generate.max_new_tokens;
    if let Some(context) = config.max_position_embeddings {
        if budget as i64 >= context {
            return Err(format!(
                "`generate.max_new_tokens` = {budget}: {}'s context is {context} positions \
                 (max_position_embeddings), which leaves no room for a prompt",
                path.join("config.json").display()
            )
            .into());
        }
    }
    let tokenizer = weir_gpu::Tokenizer::load(path)?;
    if tokenizer.eos_token_ids().is_empty() && !cfg.generate.ignore_eos {
        return Err(format!(
            "{}: no end-of-sequence token (tokenizer_config.json's `eos_token`, and \
             generation_config.json's and config.json's `eos_token_id` are unset or not in the \
             vocabulary), so every response would run to generate.max_new_tokens: set one, or \
             `generate.ignore_eos = true` if that is meant",
            path.display()
        )
        .into());
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn summarize(
    kind: PipelineKind,
    cfg: &RunConfig,
    ctx: &RunContext,
    report: &RunReport,
    wall_s: f64,
    before: Option<(f64, Vec<(String, String)>)>,
    after: Option<(f64, Vec<(String, String)>)>,
    final_actor: &Path,
) -> Value {
    let trainer = kind.trainer_stage();
    let series = |metric: &str| -> Vec<f64> {
        let mut by_step: std::collections::BTreeMap<u64, f64> = Default::default();
        for r in report
            .metrics
            .iter()
            .filter(|r| r.stage == trainer && r.metric == metric)
        {
            by_step.insert(r.step, r.value);
        }
        by_step.into_values().collect()
    };
    let mean = |v: &[f64]| (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64);
    let window = |v: &[f64], last: bool| {
        let n = (v.len() / 10).max(1).min(v.len());
        mean(if last { &v[v.len() - n..] } else { &v[..n] })
    };
    let rows: f64 = report.stages.get(trainer).map_or(0.0, |s| s.rows_in as f64);
    let segment_wall = report.wall_s.max(1e-9);
    let reward = series("reward");
    let loss = series("loss");
    json!({
        "pipeline": kind.name(),
        "steps": cfg.run.steps,
        "resumed_at_step": (ctx.first_step > 0).then_some(ctx.first_step),
        "wall_s": wall_s,
        "samples_per_s": rows_this_segment(report, trainer, ctx.first_step) / segment_wall,
        "rows_trained": rows,
        "max_staleness": cfg.run.max_staleness,
        "max_staleness_observed": report.max_staleness_observed(),
        "staleness_histogram": report.staleness_histogram,
        "reward_first": window(&reward, false),
        "reward_last": window(&reward, true),
        "loss_first": window(&loss, false),
        "loss_last": window(&loss, true),
        "eval_accuracy_before": before.as_ref().map(|b| b.0),
        "eval_accuracy_after": after.as_ref().map(|a| a.0),
        "eval_samples_after": after.map(|a| a.1),
        "final_checkpoint": final_actor.display().to_string(),
    })
}

fn rows_this_segment(report: &RunReport, trainer: &str, first_step: u64) -> f64 {
    report
        .metrics
        .iter()
        .filter(|r| r.stage == trainer && r.metric == "rows_in" && r.step >= first_step)
        .map(|r| r.value)
        .sum()
}

fn write_text(path: &Path, text: &str) -> Result<(), PipelineError> {
    Ok(weir_gpu::snapshot::write_atomically(path, text.as_bytes())?)
}

/// The most bytes a weights payload from another process may have: the
/// policy's weights at 8 bytes each (the widest dtype), twice over for
/// what its parameter count leaves out (biases, heads) and the header.
fn max_weights_bytes(cfg: &RunConfig) -> Result<u64, PipelineError> {
    let policy = weir_gpu::ModelConfig::load(Path::new(&cfg.model.path))?;
    Ok((policy.parameter_count().max(0) as u64)
        .saturating_mul(16)
        .saturating_add(64 << 20))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_default_rate_on_a_large_model_is_warned_of() {
        let grpo = RunConfig::defaults_for(PipelineKind::Grpo);
        let warning = default_rate_warning(PipelineKind::Grpo, &grpo, 494_000_000).unwrap();
        assert!(
            warning.contains("494M") && warning.contains("algorithm.lr"),
            "{warning}"
        );
        assert!(default_rate_warning(PipelineKind::Grpo, &grpo, 2_000_000).is_none());
        let mut set = grpo.clone();
        set.algorithm.lr = 2e-4;
        assert!(default_rate_warning(PipelineKind::Grpo, &set, 494_000_000).is_none());
        let dpo = RunConfig::defaults_for(PipelineKind::Dpo);
        assert!(default_rate_warning(PipelineKind::Dpo, &dpo, 494_000_000).is_none());
        let sft = RunConfig::defaults_for(PipelineKind::Sft);
        assert!(default_rate_warning(PipelineKind::Sft, &sft, 494_000_000).is_some());
    }

    #[test]
    fn corrections_over_truncated_sampling_are_warned_of() {
        let mut cfg = RunConfig::defaults_for(PipelineKind::Grpo);
        let warn = |cfg: &RunConfig| truncated_sampling_warning(PipelineKind::Grpo, cfg);
        cfg.algorithm.correction = crate::config::CorrectionChoice::Tis;
        assert!(warn(&cfg).is_none());
        cfg.generate.top_p = 0.9;
        assert!(warn(&cfg).is_some_and(|w| w.contains("algorithm.correction")));
        cfg.algorithm.correction = crate::config::CorrectionChoice::None;
        assert!(warn(&cfg).is_none());
    }

    #[test]
    fn a_streaming_pool_without_staleness_is_warned_of() {
        let mut cfg = RunConfig::defaults_for(PipelineKind::Grpo);
        let warn = |cfg: &RunConfig| synchronous_streaming_warning(PipelineKind::Grpo, cfg);
        cfg.run.max_staleness = 0;
        assert!(warn(&cfg).is_none());
        cfg.generate.max_inflight = 8;
        assert!(warn(&cfg).is_some_and(|w| w.contains("run.max_staleness")));
        cfg.run.max_staleness = 1;
        assert!(warn(&cfg).is_none());
    }
}
