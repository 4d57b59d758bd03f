//! Which keys a pipeline reads, and when a key's value has no effect: a
//! key that would change nothing is refused with one line instead of
//! being silently ignored, and `weir config` prints only the keys that
//! apply to the pipeline.

use super::docs::{applies, Key, KEYS};
use super::{
    Aggregation, ConfigError, CorrectionChoice, JudgeVerdict, OnUnparsed, PolicyLossChoice,
    PreferenceChoice, RewardKind, RunConfig, ScheduleChoice, Task, ToolSpec, WeightsChannelChoice,
};
use crate::PipelineKind;

/// The keys that `pipeline` reads but that `cfg`'s other values make
/// inert, each with the condition under which it would act.
fn inert(cfg: &RunConfig, pipeline: PipelineKind) -> Vec<(&'static str, &'static str, String)> {
    let mut found = Inert::default();
    weights_and_adapters(cfg, &mut found);
    prompts(cfg, &mut found);
    rewards(cfg, pipeline, &mut found);
    kl(cfg, pipeline, &mut found);
    distillation(cfg, pipeline, &mut found);
    policy_loss(cfg, pipeline, &mut found);
    prompt_selection(cfg, &mut found);
    agent(cfg, &mut found);
    found.0
}

/// Inert keys found so far, each with the condition under which it would act.
#[derive(Default)]
struct Inert(Vec<(&'static str, &'static str, String)>);

impl Inert {
    /// `keys` of `section` act only when `on`: otherwise they are inert, for `why`.
    fn unless(&mut self, on: bool, section: &'static str, keys: &[&'static str], why: &str) {
        if !on {
            for key in keys {
                self.0
                    .push((section, *key, format!("has no effect unless {why}")));
            }
        }
    }
}

/// How weights reach the generator, and the adapters.
fn weights_and_adapters(cfg: &RunConfig, found: &mut Inert) {
    found.unless(
        cfg.generate.max_inflight > 0 && cfg.run.max_staleness > 0,
        "generate",
        &["on_new_weights"],
        "generate.max_inflight > 0 and run.max_staleness > 0 (weights reach a generator mid-flight only then)",
    );
    let timely = cfg.placement.weights_channel == WeightsChannelChoice::Timely;
    found.unless(
        timely,
        "placement",
        &["weights_bucket_mib"],
        "placement.weights_channel = \"timely\"",
    );
    found.unless(
        !timely,
        "placement",
        &["weights_port"],
        "placement.weights_channel = \"direct\"",
    );
    found.unless(
        cfg.lora.rank > 0,
        "lora",
        &["alpha", "dropout", "target_modules"],
        "lora.rank > 0",
    );
}

/// How prompt files are read (`[data]`: the training set, or the eval set) and evaluated.
fn prompts(cfg: &RunConfig, found: &mut Inert) {
    found.unless(
        !cfg.data.rollouts.is_empty(),
        "data",
        &["rollouts_where", "replay_fraction", "rollout_advantages"],
        "data.rollouts names rollout logs",
    );
    // Prompt files are read as `[data]` says: the training set, or the eval set.
    let arith_data = cfg.data.prompts == Task::Arith;
    let no_file = arith_data && cfg.eval.prompts.is_none();
    found.unless(
        cfg.eval.prompts.is_some(),
        "eval",
        &["k", "every", "best_checkpoint"],
        "eval.prompts names a file",
    );
    found.unless(
        !no_file,
        "data",
        &[
            "prompt_template",
            "apply_chat_template",
            "system_prompt",
            "skip_long_prompts",
        ],
        "data.prompts or eval.prompts is a file (arith prompts have their own format)",
    );
    found.unless(
        no_file || cfg.data.messages_column.is_none(),
        "data",
        &["prompt_template", "apply_chat_template"],
        "the prompts are plain text (data.messages_column is empty)",
    );
    found.unless(
        no_file || cfg.data.apply_chat_template || cfg.data.messages_column.is_some(),
        "data",
        &["system_prompt"],
        "the prompts are chats (data.apply_chat_template, or data.messages_column)",
    );
    found.unless(
        !no_file,
        "data",
        &["prompt_column", "messages_column"],
        "data.prompts or eval.prompts is a prompt file",
    );
    found.unless(
        !arith_data,
        "data",
        &["chosen_column", "rejected_column", "margin_column"],
        "data.prompts is a prompt file (arith makes its own pairs)",
    );
    found.unless(
        (arith_data && cfg.eval.arith) || cfg.eval.prompts.is_some(),
        "eval",
        &["batch"],
        "an evaluation runs (eval.prompts, or eval.arith with data.prompts = \"arith\")",
    );
}

/// The reward's keys, each read by some kinds of reward only.
fn rewards(cfg: &RunConfig, pipeline: PipelineKind, found: &mut Inert) {
    let r = &cfg.reward;
    found.unless(
        r.overlong_buffer > 0,
        "reward",
        &["overlong_penalty_factor"],
        "reward.overlong_buffer > 0",
    );
    found.unless(
        r.kind == RewardKind::Rule,
        "reward",
        &["rule"],
        "reward.kind = \"rule\"",
    );
    found.unless(
        r.kind == RewardKind::Remote,
        "reward",
        &["url", "ca_file"],
        "reward.kind = \"remote\"",
    );
    let python_terms = r.kind == RewardKind::Terms && r.terms.iter().any(|t| t.file.is_some());
    let python = r.kind == RewardKind::Python || python_terms;
    found.unless(
        r.kind == RewardKind::Remote || python,
        "reward",
        &["timeout_s", "attempts"],
        "reward.kind = \"remote\" or a Python reward",
    );
    found.unless(
        r.kind == RewardKind::Python,
        "reward",
        &["file", "function"],
        "reward.kind = \"python\"",
    );
    found.unless(
        python,
        "reward",
        &["python", "workers"],
        "a Python reward (reward.kind = \"python\", or a term with a file)",
    );
    found.unless(
        r.kind == RewardKind::Terms,
        "reward",
        &["terms"],
        "reward.kind = \"terms\"",
    );
    let judge = cfg.uses_judge();
    found.unless(
        judge,
        "judge",
        &[
            "path",
            "template",
            "chat",
            "verdict",
            "pattern",
            "verdict_tokens",
            "max_new_tokens",
            "temperature",
            "on_unparsed",
            "unparsed_reward",
        ],
        "a judge scores (reward.kind = \"judge\", or a term with rule = \"judge\")",
    );
    let regex = cfg.judge.verdict == JudgeVerdict::Regex;
    found.unless(
        !judge || regex,
        "judge",
        &[
            "pattern",
            "max_new_tokens",
            "temperature",
            "on_unparsed",
            "unparsed_reward",
        ],
        "judge.verdict = \"regex\"",
    );
    found.unless(
        !judge || !regex,
        "judge",
        &["verdict_tokens"],
        "judge.verdict = \"probability\"",
    );
    found.unless(
        !judge || !regex || cfg.judge.on_unparsed == OnUnparsed::Reward,
        "judge",
        &["unparsed_reward"],
        "judge.on_unparsed = \"reward\"",
    );
    if pipeline.is_rl() && pipeline != PipelineKind::Ppo {
        found.unless(
            r.kind == RewardKind::Model,
            "model",
            &["reward_model"],
            "reward.kind = \"model\" (or in ppo, whose critic starts from it)",
        );
    }
}

/// The reference and the KL penalty, read only with a KL coefficient.
/// Distillation's top-k term: its keys act only when the teacher records its top k.
fn distillation(cfg: &RunConfig, pipeline: PipelineKind, found: &mut Inert) {
    if pipeline == PipelineKind::Distill {
        found.unless(
            cfg.teacher.top_k > 0,
            "algorithm",
            &["gkd_beta", "gkd_coef", "gkd_tail"],
            "teacher.top_k > 0",
        );
    }
}

fn kl(cfg: &RunConfig, pipeline: PipelineKind, found: &mut Inert) {
    let a = &cfg.algorithm;
    if pipeline.is_rl() {
        let kl = a.kl_coef > 0.0;
        found.unless(kl, "placement", &["reference"], "algorithm.kl_coef > 0");
        found.unless(kl, "model", &["reference"], "algorithm.kl_coef > 0");
        found.unless(kl, "algorithm", &["kl_estimator"], "algorithm.kl_coef > 0");
        found.unless(
            kl,
            "algorithm",
            &["kl_unbiased_gradient"],
            "algorithm.kl_coef > 0",
        );
        found.unless(kl, "algorithm", &["kl_target"], "algorithm.kl_coef > 0");
        found.unless(
            kl && a.kl_target > 0.0,
            "algorithm",
            &["kl_horizon"],
            "algorithm.kl_target > 0",
        );
    }
}

/// The policy loss's keys, each read by some losses, corrections or schedules only.
fn policy_loss(cfg: &RunConfig, pipeline: PipelineKind, found: &mut Inert) {
    let a = &cfg.algorithm;
    // These act on negative advantages only.
    found.unless(
        pipeline != PipelineKind::GrpoPassk,
        "algorithm",
        &["clip_low", "dual_clip", "sapo_tau_neg"],
        "advantages can be negative (pass@k's never are)",
    );
    let loss = a.policy_loss;
    use PolicyLossChoice as L;
    let clipping = matches!(
        loss,
        L::Ppo | L::Gspo | L::Cispo | L::Gmpo | L::ClipCov | L::DppoTv | L::DppoKl
    );
    found.unless(
        clipping,
        "algorithm",
        &["clip_low", "clip_high"],
        "algorithm.policy_loss clips (ppo, gspo, cispo, gmpo, clip_cov, dppo_tv, dppo_kl)",
    );
    found.unless(
        matches!(loss, L::Ppo | L::Gspo | L::DppoTv | L::DppoKl),
        "algorithm",
        &["dual_clip"],
        "algorithm.policy_loss is \"ppo\", \"gspo\" or DPPO's (whose ratio cap it is)",
    );
    found.unless(
        loss != L::Gmpo,
        "algorithm",
        &["aggregation"],
        "algorithm.policy_loss is not \"gmpo\" (which averages per response)",
    );
    found.unless(
        loss == L::Sapo,
        "algorithm",
        &["sapo_tau_pos", "sapo_tau_neg"],
        "algorithm.policy_loss = \"sapo\"",
    );
    found.unless(
        loss == L::ClipCov,
        "algorithm",
        &["clip_cov_ratio", "clip_cov_lb", "clip_cov_ub"],
        "algorithm.policy_loss = \"clip_cov\"",
    );
    found.unless(
        loss == L::Reinforce,
        "algorithm",
        &["reinforce_is_cap"],
        "algorithm.policy_loss = \"reinforce\"",
    );
    found.unless(
        loss == L::KlCov,
        "algorithm",
        &["kl_cov_ratio", "kl_cov_coef"],
        "algorithm.policy_loss = \"kl_cov\"",
    );
    found.unless(
        !a.gdpo,
        "reward",
        &[
            "overlong_buffer",
            "overlong_penalty_factor",
            "stop_properly_coef",
            "on_finish",
        ],
        "algorithm.gdpo is off (GDPO normalises each reward term's own score, not the shaped sum)",
    );
    found.unless(
        loss == L::Dro,
        "algorithm",
        &["dro_beta"],
        "algorithm.policy_loss = \"dro\"",
    );
    // A step's first optimizer step starts at the proximal policy: ratio 1, nothing to clip.
    found.unless(
        a.ppo_epochs > 1 || a.mini_batches > 1,
        "algorithm",
        &["clip_low", "clip_high", "dual_clip", "value_clip"],
        "algorithm.ppo_epochs > 1 or algorithm.mini_batches > 1 (a step's first optimizer step starts where the ratio is 1 and the values are the old ones)",
    );
    found.unless(
        a.correction != CorrectionChoice::None,
        "algorithm",
        &["correction_high"],
        "algorithm.correction is set",
    );
    found.unless(
        a.correction.has_low(),
        "algorithm",
        &["correction_low"],
        "algorithm.correction has a lower bound (all but \"k3-rejection\" and the gates)",
    );
    found.unless(
        matches!(
            a.correction,
            CorrectionChoice::Tis
                | CorrectionChoice::Icepop
                | CorrectionChoice::SeqTis
                | CorrectionChoice::SeqIcepop
        ),
        "algorithm",
        &["correction_batch_normalize"],
        "algorithm.correction weights by the ratio (tis, icepop, seq-tis, seq-icepop)",
    );
    found.unless(
        a.rejection.is_some(),
        "algorithm",
        &["rejection_threshold"],
        "algorithm.rejection names criteria",
    );
    found.unless(
        a.aggregation == Aggregation::SeqMeanTokenSumNorm,
        "algorithm",
        &["loss_scale_factor"],
        "algorithm.aggregation = \"seq-mean-token-sum-norm\"",
    );
    found.unless(
        a.preference_loss == PreferenceChoice::Cdpo,
        "algorithm",
        &["label_smoothing"],
        "algorithm.preference_loss = \"cdpo\"",
    );
    found.unless(
        a.schedule == ScheduleChoice::Cosine,
        "algorithm",
        &["min_lr_ratio"],
        "algorithm.schedule = \"cosine\"",
    );
}

/// `[agent]`: the keys of episodes, of tools and of a Python environment.
fn agent(cfg: &RunConfig, found: &mut Inert) {
    let a = &cfg.agent;
    found.unless(
        a.enabled(),
        "agent",
        &[
            "max_turns",
            "max_observation_tokens",
            "timeout_s",
            "on_error",
        ],
        "agent.tools or agent.environment names something (rollouts are episodes only then)",
    );
    found.unless(
        !a.tools.is_empty(),
        "agent",
        &["tool_format"],
        "agent.tools names a tool",
    );
    found.unless(
        a.environment_file().is_some(),
        "agent",
        &["environment_class"],
        "agent.environment names a .py file",
    );
    found.unless(
        a.environment_urls().is_some(),
        "agent",
        &["action_field", "observation_field"],
        "agent.environment names OpenEnv servers (http:// or https:// URLs)",
    );
    found.unless(
        a.environment_file().is_some() || a.tools.iter().any(|t| t.runs_python()),
        "agent",
        &["python"],
        "agent.tools has python or a Python function, or agent.environment names a .py file",
    );
    found.unless(
        a.tools.iter().any(ToolSpec::is_python_builtin),
        "agent",
        &["python_network"],
        "agent.tools has python",
    );
}

/// The curriculum and dynamic sampling, read only when enabled.
fn prompt_selection(cfg: &RunConfig, found: &mut Inert) {
    found.unless(
        cfg.curriculum.enabled,
        "curriculum",
        &[
            "min_samples",
            "max_solve_rate",
            "min_solve_rate",
            "solve_threshold",
        ],
        "curriculum.enabled",
    );
    found.unless(
        cfg.dynamic_sampling.enabled,
        "dynamic_sampling",
        &["target_groups"],
        "dynamic_sampling.enabled",
    );
    found.unless(
        cfg.dynamic_sampling.enabled && cfg.dynamic_sampling.target_groups > 0,
        "dynamic_sampling",
        &["max_extra_batches"],
        "dynamic_sampling.enabled and dynamic_sampling.target_groups > 0 (a step waits for its target)",
    );
}

impl RunConfig {
    /// Refuses a key set away from `pipeline`'s default where it changes
    /// nothing: a key the pipeline does not read, or one that the config's
    /// other values make inert.
    pub(super) fn check_scope(&self, pipeline: PipelineKind) -> Result<(), ConfigError> {
        let defaults =
            toml::Value::try_from(RunConfig::defaults_for(pipeline)).expect("a config serialises");
        let mine = toml::Value::try_from(self).expect("a config serialises");
        let set = |section: &str, key: &str| {
            let value = &mine[section][key];
            (value != &defaults[section][key]).then(|| value.to_string())
        };
        let refuse = |section: &str, key: &str, value: String, why: String| {
            Err(ConfigError {
                source_name: "config".into(),
                message: format!("`{section}.{key}` = {value}: {why}"),
            })
        };
        for &Key {
            section, name: key, ..
        } in KEYS
        {
            if applies(pipeline, section, key) {
                continue;
            }
            if let Some(value) = set(section, key) {
                return refuse(
                    section,
                    key,
                    value,
                    format!("the {} pipeline does not use this key", pipeline.name()),
                );
            }
        }
        for (section, key, why) in inert(self, pipeline) {
            if !applies(pipeline, section, key) {
                continue;
            }
            if let Some(value) = set(section, key) {
                return refuse(section, key, value, why);
            }
        }
        Ok(())
    }
}
