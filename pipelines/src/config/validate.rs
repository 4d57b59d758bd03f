//! Checks of values that parse but make no sense, each naming its key:
//! one check per section, in the order the sections are documented, then
//! which keys the pipeline reads (`scope.rs`).

use super::text::spelt;
use super::{
    Aggregation, ConfigError, CorrectionChoice, JudgeVerdict, KlEstimator, PolicyLossChoice,
    PreferenceChoice, RewardKind, RunConfig,
};
use crate::PipelineKind;

/// The error for `key` = `value`, saying `why` it makes no sense.
pub(super) fn bad(key: &str, value: String, why: &str) -> Result<(), ConfigError> {
    Err(ConfigError {
        source_name: "config".into(),
        message: format!("`{key}` = {value}: {why}"),
    })
}

impl RunConfig {
    /// Checks values that parse but make no sense, naming the key.
    pub fn validate(&self, pipeline: PipelineKind) -> Result<(), ConfigError> {
        self.check_run()?;
        self.check_teacher(pipeline)?;
        self.check_scorers(pipeline)?;
        self.check_judge()?;
        self.check_placement()?;
        self.check_data(pipeline)?;
        self.check_generate()?;
        self.check_reward(pipeline)?;
        self.check_eval(pipeline)?;
        self.check_lora()?;
        self.check_policy_loss()?;
        self.check_updates(pipeline)?;
        self.check_dynamic_sampling(pipeline)?;
        self.check_agent(pipeline)?;
        self.check_scope(pipeline)
    }

    /// `model.path` and `[run]`.
    fn check_run(&self) -> Result<(), ConfigError> {
        if self.model.path.as_os_str().is_empty() {
            return bad(
                "model.path",
                "\"\"".into(),
                "the actor's checkpoint folder is required",
            );
        }
        if self.run.steps == 0 {
            return bad("run.steps", "0".into(), "must be at least 1");
        }
        if self.run.threads == 0 {
            return bad("run.threads", "0".into(), "must be at least 1");
        }
        if weir_gpu::snapshot::parse_size(&self.run.max_shard_size).is_none() {
            return bad(
                "run.max_shard_size",
                format!("{:?}", self.run.max_shard_size),
                "a size such as \"5GB\", \"500MB\" or \"2GiB\"",
            );
        }
        Ok(())
    }

    /// `[teacher]`: distill's teacher is a checkpoint folder whose
    /// tokenizer is the student's.
    fn check_teacher(&self, pipeline: PipelineKind) -> Result<(), ConfigError> {
        if pipeline != PipelineKind::Distill {
            return Ok(());
        }
        let teacher = &self.teacher.path;
        let shown = format!("{:?}", teacher.display().to_string());
        if teacher.as_os_str().is_empty() {
            return bad(
                "teacher.path",
                shown,
                "distill needs the teacher's checkpoint folder",
            );
        }
        if !teacher.join("config.json").is_file() {
            return bad(
                "teacher.path",
                shown,
                "no config.json there: not a HuggingFace checkpoint folder",
            );
        }
        if !teacher.join("tokenizer.json").is_file() {
            return bad(
                "teacher.path",
                shown,
                "no tokenizer.json there to hold to the student's: the teacher scores the student's token ids",
            );
        }
        let a = &self.algorithm;
        if !(0.0..=1.0).contains(&a.gkd_beta) {
            return bad(
                "algorithm.gkd_beta",
                a.gkd_beta.to_string(),
                "GKD's β lies in [0, 1] (0 the forward KL, 1 the reverse KL)",
            );
        }
        if !a.gkd_coef.is_finite() {
            return bad(
                "algorithm.gkd_coef",
                a.gkd_coef.to_string(),
                "must be a finite number",
            );
        }
        let k = self.teacher.top_k;
        if k > 0 {
            let vocab = match weir_gpu::ModelConfig::load(teacher) {
                Ok(c) => c.vocab_size,
                Err(e) => return bad("teacher.path", shown, &e.to_string()),
            };
            // The top k are read among the ids both vocabularies hold.
            let student =
                weir_gpu::ModelConfig::load(&self.model.path).map_or(vocab, |c| c.vocab_size);
            if k as i64 > vocab.min(student) {
                return bad(
                    "teacher.top_k",
                    k.to_string(),
                    &format!(
                        "the teacher's vocabulary has {vocab} tokens, the student's {student}"
                    ),
                );
            }
        }
        Ok(())
    }

    /// The checkpoints that read the policy's token ids (the teacher, a
    /// reference, reward model or critic of their own) can score them
    /// ([`unread_policy_ids`]). A reward model that cannot reads each row
    /// as text with its own tokenizer instead (then the critic must not
    /// start from it). Folders that do not load are left to the checks
    /// that load them.
    fn check_scorers(&self, pipeline: PipelineKind) -> Result<(), ConfigError> {
        if matches!(pipeline, PipelineKind::Sft | PipelineKind::Rm) {
            return Ok(());
        }
        let m = &self.model;
        let mut scorers = vec![
            ("model.reference", "the reference", m.reference.as_ref()),
            (
                "model.reward_model",
                "the reward model",
                m.reward_model.as_ref(),
            ),
            ("model.critic", "the critic", m.critic.as_ref()),
        ];
        if pipeline == PipelineKind::Distill {
            scorers.push(("teacher.path", "the teacher", Some(&self.teacher.path)));
        }
        for (key, role, dir) in scorers {
            let Some(dir) = dir.filter(|d| **d != m.path) else {
                continue;
            };
            let shown = format!("{:?}", dir.display().to_string());
            let why = match unread_policy_ids(&m.path, dir, role) {
                Ok(None) => continue,
                Ok(Some(why)) => why,
                Err(e) => return bad(key, shown, &e),
            };
            if key != "model.reward_model" {
                return bad(
                    key,
                    shown,
                    &format!("{why} ({role} scores the policy's token ids)"),
                );
            }
            // A reward model reads text with its own tokenizer; a critic
            // started from it would score the policy's ids.
            if pipeline == PipelineKind::Ppo && m.critic.is_none() {
                return bad(
                    "model.critic",
                    "\"\"".into(),
                    &format!(
                        "the critic would start from model.reward_model ({shown}), which cannot read the policy's token ids ({why}); set model.critic to a checkpoint that does"
                    ),
                );
            }
        }
        Ok(())
    }

    /// `[judge]`, when a judge scores: a causal LM checkpoint folder, a
    /// template that compiles, a pattern with a group, verdict tokens of
    /// one token each, a chat template when asked for one. (The names the
    /// template reads are checked against the prompt file's columns when
    /// the judge starts.)
    fn check_judge(&self) -> Result<(), ConfigError> {
        use weir_operators::rewards::judge::Verdict;
        if !self.uses_judge() {
            return Ok(());
        }
        let j = &self.judge;
        let shown = format!("{:?}", j.path.display().to_string());
        if j.path.as_os_str().is_empty() {
            return bad(
                "judge.path",
                shown,
                "a judge reward needs the judge's checkpoint folder",
            );
        }
        if !j.path.join("config.json").is_file() {
            return bad(
                "judge.path",
                shown,
                "no config.json there: not a HuggingFace checkpoint folder",
            );
        }
        let tokenizer = match weir_gpu::Tokenizer::load(&j.path) {
            Ok(t) => t,
            Err(e) => return bad("judge.path", shown, &e.to_string()),
        };
        if j.chat && tokenizer.chat_template().is_none() {
            return bad(
                "judge.chat",
                "true".into(),
                "the judge's tokenizer has no chat template (false gives the judge the text as is)",
            );
        }
        if let Err(why) = weir_operators::rewards::judge::compile(&j.template) {
            return bad("judge.template", format!("{:?}", j.template), &why);
        }
        match j.verdict {
            JudgeVerdict::Regex => {
                if let Err(why) = Verdict::regex(&j.pattern) {
                    return bad("judge.pattern", format!("{:?}", j.pattern), &why);
                }
                if j.max_new_tokens == 0 {
                    return bad(
                        "judge.max_new_tokens",
                        "0".into(),
                        "the judge must answer: at least 1",
                    );
                }
                if j.temperature != 0.0 {
                    if let Some(why) = weir_gpu::temperature_error(j.temperature) {
                        return bad("judge.temperature", j.temperature.to_string(), why);
                    }
                }
            }
            JudgeVerdict::Probability => {
                if let Err(why) = Verdict::probability(&tokenizer, &j.verdict_tokens) {
                    return bad(
                        "judge.verdict_tokens",
                        format!("{:?}", j.verdict_tokens),
                        &why,
                    );
                }
            }
        }
        if !j.unparsed_reward.is_finite() {
            return bad(
                "judge.unparsed_reward",
                j.unparsed_reward.to_string(),
                "must be a finite number",
            );
        }
        Ok(())
    }

    /// `[placement]`.
    pub(super) fn check_placement(&self) -> Result<(), ConfigError> {
        let p = &self.placement;
        if p.weights_bucket_mib == 0 {
            return bad(
                "placement.weights_bucket_mib",
                "0".into(),
                "must be at least 1",
            );
        }
        if p.workers == 0 {
            return bad("placement.workers", "0".into(), "must be at least 1");
        }
        if p.shard_optimizer && p.train.len() < 2 {
            return bad(
                "placement.shard_optimizer",
                "true".into(),
                &format!(
                    "shards the optimizer state over data-parallel ranks, and placement.train = {:?} is one rank: name two or more train workers, or set it false",
                    p.train
                ),
            );
        }
        if !p.judge.is_empty() && !self.uses_judge() {
            return bad(
                "placement.judge",
                format!("{:?}", p.judge),
                "places a judge, and no reward uses one (reward.kind = \"judge\" or a judge term): leave it empty",
            );
        }
        let no_teacher = Vec::new();
        let teacher = match &p.teacher {
            super::TeacherPlacement::Workers(w) => w,
            super::TeacherPlacement::At(_) => &no_teacher,
        };
        if matches!(p.teacher, super::TeacherPlacement::Workers(_)) && teacher.is_empty() {
            return bad(
                "placement.teacher",
                "[]".into(),
                "names no worker: name some, or \"train\" or \"rollout\"",
            );
        }
        for (key, set) in [
            ("placement.rollout", &p.rollout),
            ("placement.train", &p.train),
            ("placement.judge", &p.judge),
            ("placement.teacher", teacher),
        ] {
            if set.is_empty() && (key == "placement.rollout" || key == "placement.train") {
                return bad(key, "[]".into(), "needs at least one worker");
            }
            if let Some(w) = set.iter().find(|w| **w >= p.workers) {
                return bad(
                    key,
                    format!("{set:?}"),
                    &format!("worker {w} ≥ placement.workers = {}", p.workers),
                );
            }
        }
        Ok(())
    }

    /// `[data]`.
    fn check_data(&self, pipeline: PipelineKind) -> Result<(), ConfigError> {
        if self.data.prompts_per_step == 0 {
            return bad("data.prompts_per_step", "0".into(), "must be at least 1");
        }
        if self.data.samples_per_prompt == 0 {
            return bad("data.samples_per_prompt", "0".into(), "must be at least 1");
        }
        if pipeline.is_group() && self.data.samples_per_prompt < 2 {
            return bad(
                "data.samples_per_prompt",
                self.data.samples_per_prompt.to_string(),
                "group estimators need at least 2 samples per prompt",
            );
        }
        self.check_rollouts(pipeline)?;
        let template = &self.data.prompt_template;
        if let Some(template) = template.as_ref().filter(|t| !t.contains("{prompt}")) {
            return bad(
                "data.prompt_template",
                format!("{template:?}"),
                "must contain {prompt}, where each prompt goes",
            );
        }
        Ok(())
    }

    /// Training from logs: a fraction in (0, 1], a filter that parses, an
    /// importance correction to weigh rows of other policies, and single
    /// responses (neither episodes nor ReMax's greedy rows are replayed).
    fn check_rollouts(&self, pipeline: PipelineKind) -> Result<(), ConfigError> {
        let d = &self.data;
        if !(d.replay_fraction > 0.0 && d.replay_fraction <= 1.0) {
            return bad(
                "data.replay_fraction",
                d.replay_fraction.to_string(),
                "must be in (0, 1]: the share of each step's groups replayed from data.rollouts",
            );
        }
        if let Some(filter) = &d.rollouts_where {
            if let Err(why) = weir_operators::rollout_log::RowFilter::parse(filter) {
                return bad("data.rollouts_where", format!("{filter:?}"), &why);
            }
        }
        if d.rollouts.is_empty() || !pipeline.is_rl() {
            return Ok(());
        }
        let value = format!("{:?}", d.rollouts);
        if self.algorithm.correction == CorrectionChoice::None && self.algorithm.rejection.is_none()
        {
            return bad(
                "data.rollouts",
                value,
                "logged rows were sampled by other policies, by any number of versions: set algorithm.correction (tis, icepop, seq-mask, seq-tis, seq-icepop, geo-rejection, k3-rejection, binary-kl, tv, …) or algorithm.rejection to weigh them",
            );
        }
        if pipeline == PipelineKind::Remax {
            return bad(
                "data.rollouts",
                value,
                "remax's baseline is a greedy response generated beside each group, which a log does not hold",
            );
        }
        if self.agent.enabled() {
            return bad(
                "data.rollouts",
                value,
                "episodes ([agent]) are not replayed from logs yet",
            );
        }
        Ok(())
    }

    /// `[generate]`.
    fn check_generate(&self) -> Result<(), ConfigError> {
        if self.generate.max_new_tokens == 0 {
            return bad("generate.max_new_tokens", "0".into(), "must be at least 1");
        }
        if let Some(why) = weir_gpu::temperature_error(self.generate.temperature) {
            return bad(
                "generate.temperature",
                self.generate.temperature.to_string(),
                why,
            );
        }
        if !(self.generate.long_tail.is_finite() && self.generate.long_tail >= 0.0) {
            return bad(
                "generate.long_tail",
                self.generate.long_tail.to_string(),
                "must be ≥ 0 (0: off)",
            );
        }
        if let Some(why) = weir_gpu::top_p_error(self.generate.top_p) {
            return bad("generate.top_p", self.generate.top_p.to_string(), why);
        }
        Ok(())
    }

    /// `[reward]` and the reward model it needs.
    fn check_reward(&self, pipeline: PipelineKind) -> Result<(), ConfigError> {
        self.check_reward_terms()?;
        let coef = self.reward.stop_properly_coef;
        if !coef.is_finite() || coef > 1.0 {
            return bad(
                "reward.stop_properly_coef",
                coef.to_string(),
                "a scale in [0, 1] for a truncated response's reward, or a negative reward to give it",
            );
        }
        if self.reward.kind == RewardKind::Rule
            && weir_operators::rewards::rule_reward(&self.reward.rule).is_none()
            && weir_operators::rewards::registered(&self.reward.rule).is_none()
        {
            return bad(
                "reward.rule",
                format!("{:?}", self.reward.rule),
                &format!("must be one of {:?}", known_rules()),
            );
        }
        if !(self.reward.timeout_s > 0.0 && self.reward.timeout_s <= 86_400.0) {
            return bad(
                "reward.timeout_s",
                self.reward.timeout_s.to_string(),
                "must be seconds in (0, 86400]",
            );
        }
        if self.reward.kind == RewardKind::Model && self.model.reward_model.is_none() {
            return bad(
                "model.reward_model",
                "\"\"".into(),
                "reward.kind = \"model\" needs a reward model",
            );
        }
        if self.reward.kind == RewardKind::Python {
            let file = &self.reward.file;
            if !file.as_ref().is_some_and(|f| f.is_file()) {
                return bad(
                    "reward.file",
                    spelt(file),
                    "reward.kind = \"python\" needs an existing .py file",
                );
            }
            if self.reward.workers == 0 {
                return bad("reward.workers", "0".into(), "must be ≥ 1");
            }
        }
        if self.reward.kind == RewardKind::Remote && self.reward.url.is_none() {
            return bad(
                "reward.url",
                "\"\"".into(),
                "reward.kind = \"remote\" needs a server URL",
            );
        }
        if let Some(ca_file) = &self.reward.ca_file {
            if !ca_file.is_file() {
                return bad(
                    "reward.ca_file",
                    spelt(&self.reward.ca_file),
                    "no such file",
                );
            }
            if !self
                .reward
                .url
                .as_deref()
                .is_some_and(|u| u.starts_with("https://"))
            {
                return bad(
                    "reward.ca_file",
                    spelt(&self.reward.ca_file),
                    "applies to an https:// reward.url only",
                );
            }
        }
        if self.reward.overlong_buffer >= self.generate.max_new_tokens && pipeline.is_rl() {
            return bad(
                "reward.overlong_buffer",
                self.reward.overlong_buffer.to_string(),
                &format!(
                    "must be below generate.max_new_tokens = {}",
                    self.generate.max_new_tokens
                ),
            );
        }
        Ok(())
    }

    /// `[[reward.terms]]`.
    fn check_reward_terms(&self) -> Result<(), ConfigError> {
        if self.algorithm.gdpo && self.reward.kind != RewardKind::Terms {
            return bad(
                "algorithm.gdpo",
                "true".into(),
                &format!(
                    "GDPO normalises each reward term on its own: it needs reward.kind = \"terms\" (not {:?})",
                    self.reward.kind
                ),
            );
        }
        if self.reward.kind == RewardKind::Terms {
            if self.reward.terms.is_empty() {
                return bad(
                    "reward.terms",
                    "[]".into(),
                    "reward.kind = \"terms\" needs at least one [[reward.terms]]",
                );
            }
            let mut names = std::collections::BTreeSet::new();
            for (i, t) in self.reward.terms.iter().enumerate() {
                let key = |k: &str| format!("reward.terms[{i}].{k}");
                if t.rule.is_none() == t.file.is_none() {
                    return bad(
                        &key("rule"),
                        spelt(&t.rule),
                        "give a term either a rule or a file",
                    );
                }
                let rule = t.rule.as_deref();
                let known = |r: &str| {
                    weir_operators::rewards::rule_reward(r).is_some()
                        || weir_operators::rewards::registered(r).is_some()
                        || matches!(r, "regex" | "length" | "judge")
                };
                if let Some(r) = rule.filter(|r| !known(r)) {
                    let mut rules = known_rules();
                    rules.extend(["regex", "length", "judge"].map(String::from));
                    return bad(
                        &key("rule"),
                        format!("{r:?}"),
                        &format!("must be one of {rules:?}"),
                    );
                }
                if rule == Some("regex") {
                    if let Err(e) = weir_operators::rewards::rules::full_match(&t.pattern) {
                        return bad(
                            &key("pattern"),
                            format!("{:?}", t.pattern),
                            &format!("not a regular expression: {e}"),
                        );
                    }
                } else if !t.pattern.is_empty() {
                    return bad(
                        &key("pattern"),
                        format!("{:?}", t.pattern),
                        "only the regex rule reads a pattern",
                    );
                }
                if t.max_tokens != 0 && rule != Some("length") {
                    return bad(
                        &key("max_tokens"),
                        t.max_tokens.to_string(),
                        "only the length rule reads max_tokens",
                    );
                }
                if t.file.as_ref().is_some_and(|f| !f.is_file()) {
                    return bad(&key("file"), spelt(&t.file), "no such file");
                }
                if !t.weight.is_finite() {
                    return bad(
                        &key("weight"),
                        t.weight.to_string(),
                        "must be a finite number",
                    );
                }
                if !names.insert(t.label()) {
                    return bad(
                        &key("name"),
                        format!("{:?}", t.label()),
                        "two terms share this name: name them",
                    );
                }
            }
        }
        Ok(())
    }

    /// `[eval]`.
    fn check_eval(&self, pipeline: PipelineKind) -> Result<(), ConfigError> {
        if let Some(eval) = &self.eval.prompts {
            if !eval.is_file() {
                return bad("eval.prompts", format!("{eval:?}"), "no such file");
            }
            if pipeline == PipelineKind::Rm {
                return bad(
                    "eval.prompts",
                    format!("{eval:?}"),
                    "a reward model has no policy to evaluate",
                );
            }
        }
        let (every, saves) = (self.eval.every, self.run.checkpoint_every);
        if self.eval.best_checkpoint && (saves == 0 || !every.is_multiple_of(saves)) {
            return bad(
                "eval.best_checkpoint",
                "true".into(),
                &format!(
                    "eval.every = {every} must be a multiple of run.checkpoint_every = {saves} (> 0), so that the evaluated policies are saved"
                ),
            );
        }
        if self.eval.k == 0 {
            return bad("eval.k", "0".into(), "must be ≥ 1");
        }
        if self.eval.batch == 0 {
            return bad("eval.batch", "0".into(), "must be at least 1");
        }
        Ok(())
    }

    /// `[lora]`.
    fn check_lora(&self) -> Result<(), ConfigError> {
        if self.lora.rank < 0 {
            return bad("lora.rank", self.lora.rank.to_string(), "must be ≥ 0");
        }
        if let Some(adapters) = self.lora.adapters() {
            if let Err((field, why)) = adapters.check() {
                let value = match field {
                    "rank" => self.lora.rank.to_string(),
                    "alpha" => self.lora.alpha.to_string(),
                    "dropout" => self.lora.dropout.to_string(),
                    _ => format!("{:?}", self.lora.target_modules),
                };
                return bad(&format!("lora.{field}"), value, &why);
            }
            if adapters.dropout > 0.0 && self.algorithm.gradient_checkpointing {
                return bad(
                    "lora.dropout",
                    adapters.dropout.to_string(),
                    "needs algorithm.gradient_checkpointing = false (a recomputed layer would draw other dropout masks)",
                );
            }
        }
        Ok(())
    }

    /// `[algorithm]`: the policy loss, its objective and corrections.
    fn check_policy_loss(&self) -> Result<(), ConfigError> {
        let a = &self.algorithm;
        if !(a.lr > 0.0 && a.lr.is_finite()) {
            return bad(
                "algorithm.lr",
                a.lr.to_string(),
                "must be a positive number",
            );
        }
        if !(a.loss_scale_factor >= 0.0 && a.loss_scale_factor.is_finite()) {
            return bad(
                "algorithm.loss_scale_factor",
                a.loss_scale_factor.to_string(),
                "must be ≥ 0 (0: generate.max_new_tokens)",
            );
        }
        if matches!(
            a.policy_loss,
            PolicyLossChoice::Gspo | PolicyLossChoice::Sapo
        ) && a.aggregation != Aggregation::SeqMeanTokenMean
        {
            return bad(
                "algorithm.aggregation",
                format!("{:?}", a.aggregation),
                &format!(
                    "algorithm.policy_loss = {:?} averages per response, as verl has it: set \"seq-mean-token-mean\"",
                    a.policy_loss
                ),
            );
        }
        for (key, value) in [
            ("algorithm.sapo_tau_pos", a.sapo_tau_pos),
            ("algorithm.sapo_tau_neg", a.sapo_tau_neg),
            ("algorithm.clip_cov_ratio", a.clip_cov_ratio),
            ("algorithm.kl_cov_ratio", a.kl_cov_ratio),
            ("algorithm.reinforce_is_cap", a.reinforce_is_cap),
            ("algorithm.dro_beta", a.dro_beta),
        ] {
            if !(value > 0.0 && value.is_finite()) {
                return bad(key, value.to_string(), "must be > 0");
            }
        }
        if a.policy_loss == PolicyLossChoice::Reinforce && a.correction != CorrectionChoice::None {
            return bad(
                "algorithm.correction",
                format!("{:?}", a.correction),
                "algorithm.policy_loss = \"reinforce\" carries its own importance ratio (algorithm.reinforce_is_cap): set correction = \"none\"",
            );
        }
        if a.clip_cov_lb >= a.clip_cov_ub {
            return bad(
                "algorithm.clip_cov_lb",
                a.clip_cov_lb.to_string(),
                &format!("must be below algorithm.clip_cov_ub = {}", a.clip_cov_ub),
            );
        }
        for (key, value) in [("algorithm.gamma", a.gamma), ("algorithm.lambda", a.lambda)] {
            if !(0.0..=1.0).contains(&value) {
                return bad(key, value.to_string(), "must be in [0, 1]");
            }
        }
        if let Some(options) = &a.rejection {
            let thresholds = a.rejection_threshold.as_str();
            if let Err(why) = weir_operators::algorithms::RejectionChain::parse(options, thresholds)
            {
                let key =
                    if why.contains("threshold") || why.contains("number") || why.contains("bound")
                    {
                        "algorithm.rejection_threshold"
                    } else {
                        "algorithm.rejection"
                    };
                let value = if key == "algorithm.rejection" {
                    options
                } else {
                    thresholds
                };
                return bad(key, format!("{value:?}"), &why);
            }
        }
        if a.correction != CorrectionChoice::None
            && !(a.correction_low >= 0.0 && a.correction_low <= a.correction_high)
        {
            return bad(
                "algorithm.correction_low",
                a.correction_low.to_string(),
                &format!(
                    "must be in [0, algorithm.correction_high = {}]",
                    a.correction_high
                ),
            );
        }
        Ok(())
    }

    /// `[algorithm]`: the updates (batches, epochs, clipping, KL, the
    /// preference losses).
    fn check_updates(&self, pipeline: PipelineKind) -> Result<(), ConfigError> {
        let a = &self.algorithm;
        if a.micro_batch == 0 {
            return bad("algorithm.micro_batch", "0".into(), "must be at least 1");
        }
        if a.ppo_epochs == 0 {
            return bad("algorithm.ppo_epochs", "0".into(), "must be at least 1");
        }
        let rows = self.data.prompts_per_step * self.data.samples_per_prompt;
        if pipeline.is_rl() && (a.mini_batches == 0 || a.mini_batches > rows) {
            return bad(
                "algorithm.mini_batches",
                a.mini_batches.to_string(),
                &format!("must be in 1..={rows} (the rows of a step: prompts_per_step × samples_per_prompt)"),
            );
        }
        if a.clip_low < 0.0 || a.clip_low >= 1.0 {
            return bad(
                "algorithm.clip_low",
                a.clip_low.to_string(),
                "must be in [0, 1)",
            );
        }
        if a.clip_high < 0.0 {
            return bad(
                "algorithm.clip_high",
                a.clip_high.to_string(),
                "must be ≥ 0",
            );
        }
        if a.dual_clip != 0.0 && a.dual_clip <= 1.0 {
            return bad(
                "algorithm.dual_clip",
                a.dual_clip.to_string(),
                "must be > 1 (or 0: off)",
            );
        }
        if a.kl_coef < 0.0 {
            return bad("algorithm.kl_coef", a.kl_coef.to_string(), "must be ≥ 0");
        }
        if !(a.kl_target >= 0.0 && a.kl_target.is_finite()) {
            return bad(
                "algorithm.kl_target",
                a.kl_target.to_string(),
                "must be ≥ 0",
            );
        }
        if !(a.kl_horizon > 0.0 && a.kl_horizon.is_finite()) {
            return bad(
                "algorithm.kl_horizon",
                a.kl_horizon.to_string(),
                "must be > 0",
            );
        }
        if a.beta.is_nan() || a.beta <= 0.0 {
            return bad("algorithm.beta", a.beta.to_string(), "must be > 0");
        }
        if matches!(a.kl_estimator, KlEstimator::K1Plus | KlEstimator::K3Plus)
            && !pipeline.is_group()
        {
            return bad(
                "algorithm.kl_estimator",
                format!("{:?}", a.kl_estimator),
                "a straight-through estimator differs from its plain one only in its gradient: it needs the KL in the loss (grpo, dr_grpo, rloo), not in the reward",
            );
        }
        if a.preference_loss == PreferenceChoice::Cdpo && a.label_smoothing == 0.0 {
            return bad(
                "algorithm.preference_loss",
                "\"cdpo\"".into(),
                "with algorithm.label_smoothing = 0, cDPO is DPO: set label_smoothing in (0, 0.5)",
            );
        }
        if !(0.0..0.5).contains(&a.label_smoothing) {
            return bad(
                "algorithm.label_smoothing",
                a.label_smoothing.to_string(),
                "must be in [0, 0.5)",
            );
        }
        Ok(())
    }

    /// `[dynamic_sampling]`.
    fn check_dynamic_sampling(&self, pipeline: PipelineKind) -> Result<(), ConfigError> {
        if self.dynamic_sampling.enabled && !pipeline.is_group() {
            return bad(
                "dynamic_sampling.enabled",
                "true".into(),
                "needs a group estimator (grpo, dr_grpo, rloo, opo, grpo_passk, gpg)",
            );
        }
        let (target, extra) = (
            self.dynamic_sampling.target_groups,
            self.dynamic_sampling.max_extra_batches,
        );
        if self.dynamic_sampling.enabled && extra > self.run.max_staleness {
            // The steps it waits for are generated before it trains only
            // as far as the bound lets generation run ahead.
            return bad(
                "dynamic_sampling.max_extra_batches",
                extra.to_string(),
                &format!(
                    "is more than run.max_staleness = {}: a step can wait only for the steps \
                     generated before it trains",
                    self.run.max_staleness
                ),
            );
        }
        let reach = self
            .data
            .prompts_per_step
            .saturating_mul(1 + extra as usize);
        if self.dynamic_sampling.enabled && target > reach {
            // The pool only keeps a step's surplus over the target: past the
            // prompts it may draw on, every step would fall short.
            return bad(
                "dynamic_sampling.target_groups",
                target.to_string(),
                &format!(
                    "is more than the {reach} prompts a step may draw on (data.prompts_per_step = \
                     {} × (1 + dynamic_sampling.max_extra_batches)); oversample with more prompts \
                     per step",
                    self.data.prompts_per_step
                ),
            );
        }
        Ok(())
    }
}

/// The built-in rule rewards and those the running binary registered.
fn known_rules() -> Vec<String> {
    let mut names: Vec<String> = weir_operators::rewards::RULE_REWARDS
        .iter()
        .map(|s| s.to_string())
        .collect();
    names.extend(weir_operators::rewards::registered_names());
    names
}

/// Why the checkpoint in `scorer` (`role`, e.g. "the reference") cannot
/// score the token ids of the policy in `policy`, in a sentence: its
/// vocabulary (`config.json`'s `vocab_size`, which may pad past the
/// tokenizer's) stops short of the policy's, or its tokenizer reads an id
/// of the policy's as another token ([`weir_gpu::Tokenizer::id_difference`]:
/// ids of its own past the policy's are fine). `None` when it can, or when
/// a folder does not load (the checks that load it name that); an error
/// when its tokenizer.json is there and does not load.
pub(crate) fn unread_policy_ids(
    policy: &std::path::Path,
    scorer: &std::path::Path,
    role: &str,
) -> Result<Option<String>, String> {
    use weir_gpu::{ModelConfig, Tokenizer};
    let (Ok(ours), Ok(theirs)) = (ModelConfig::load(policy), ModelConfig::load(scorer)) else {
        return Ok(None);
    };
    if theirs.vocab_size < ours.vocab_size {
        return Ok(Some(format!(
            "its config.json has vocab_size {}, the policy's ({}) {}: {role} could not score a sampled id past {}",
            theirs.vocab_size,
            policy.display(),
            ours.vocab_size,
            theirs.vocab_size - 1
        )));
    }
    let file = |dir: &std::path::Path| std::fs::read(dir.join("tokenizer.json")).ok();
    let theirs_file = file(scorer);
    if theirs_file.is_none() || theirs_file == file(policy) {
        return Ok(None);
    }
    let theirs =
        Tokenizer::load(scorer).map_err(|e| format!("its tokenizer does not load: {e}"))?;
    let Ok(ours) = Tokenizer::load(policy) else {
        return Ok(None);
    };
    Ok(ours.id_difference(
        &format!("the policy's tokenizer ({})", policy.display()),
        &theirs,
        &format!("{role}'s"),
    ))
}
