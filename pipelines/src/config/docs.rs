//! What every config key means: the comments `weir config` prints, and
//! the configuration reference (`docs/configuration.md`, printed by
//! `weir config --reference`).

use super::{applies, RunConfig};
use crate::PipelineKind;

/// Every key with its meaning, in file order: what `weir config` prints as comments.
pub const DOCS: &[(&str, &str, &str)] = &[
    ("run", "steps", "Steps (policy updates) to run."),
    ("run", "max_staleness", "Bounded staleness k: rollouts may come from policies up to k versions old (0 = synchronous on-policy)."),
    ("run", "seed", "Seed of prompt shuffling and sampling."),
    ("run", "threads", "libtorch threads per worker."),
    ("run", "checkpoint_every", "Save a checkpoint every N steps (0: only after the last step)."),
    ("run", "max_shard_size", "Checkpoint weights larger than this are saved in shards with model.safetensors.index.json, as transformers saves them (\"5GB\", \"500MB\", \"2GiB\")."),
    ("run", "rows_per_file", "Rollout rows per Parquet file."),
    ("run", "device", "\"cpu\" or \"cuda\"."),
    ("placement", "workers", "Engine workers (threads; one per GPU on a GPU machine)."),
    ("placement", "rollout", "Workers that generate and score."),
    ("placement", "train", "Workers that run the reference, critic, advantage and learner (may equal rollout: colocation). Several workers (in one process or in several) train as data-parallel ranks of one learner, each on its share of every step's rows, their gradients summed before each optimizer step (whitening, the in-reward KL and GPG's α over the whole step); dynamic sampling needs one train worker."),
    ("placement", "weights_channel", "How the learner's weights cross to another process (once per process, while generation goes on): \"direct\" (a TCP connection of their own from the learner's process, straight into the receiving process's memory: the kernel's two copies; proves the cluster secret when there is one) or \"timely\" (in buckets on timely's own connections, for networks where only the hostfile's ports are open: two more copies)."),
    ("placement", "weights_port", "The port on which a learner's process serves its weights over the direct channel, on its hostfile host (0: any free port; the receivers learn it from the weights edge)."),
    ("placement", "weights_bucket_mib", "The largest piece, in MiB, in which the learner's weights cross to another process over timely's channel (the buckets travel while generation goes on)."),
    ("placement", "reference", "Where the reference model runs: \"train\" (with the learner) or \"rollout\" (beside the generator, to balance a learner-bound step)."),
    ("model", "path", "The actor's HuggingFace checkpoint folder (required)."),
    ("model", "dtype", "Compute dtype: \"f32\", \"bf16\" or \"f16\". Trainers of a half-precision model keep float32 master weights and AdamW moments (saved in optimizer.safetensors as master.*): the update lands on the master, the weights are it rounded."),
    ("model", "reference", "The frozen reference's checkpoint (empty: the actor's)."),
    ("model", "reward_model", "A reward model checkpoint, for reward.kind = \"model\"."),
    ("model", "critic", "The critic's initial checkpoint (ppo; empty: the reward model, else the actor with a fresh value head)."),
    ("data", "prompts", "\"arith\" (the built-in task, its 9,500 training pairs) or a .jsonl / .parquet prompt file."),
    ("data", "prompt_column", "The column with plain-text prompts."),
    ("data", "messages_column", "The column with chat messages (rendered with the chat template); empty: use prompt_column."),
    ("data", "label_column", "The column with the reference answer (rule rewards; SFT targets); a dotted name reads a nested field, e.g. verl's reward_model.ground_truth (columns of every kind may be dotted)."),
    ("data", "prompt_template", "A text in which {prompt} stands for each plain-text prompt, e.g. \"Question: {prompt}\\nAnswer:\" (empty: the prompt as is)."),
    ("data", "apply_chat_template", "Render plain-text prompts as a user message with the model's chat template and a generation prompt (message prompts always are)."),
    ("data", "system_prompt", "A system message put before every chat prompt (needs apply_chat_template or messages_column)."),
    ("data", "prompts_per_step", "Prompts per step (the SFT batch size)."),
    ("data", "samples_per_prompt", "Samples per prompt: the group size."),
    ("data", "skip_long_prompts", "Leave out prompts longer than the model's context leaves beside generate.max_new_tokens, with a warning counting them (verl's filter_overlong_prompts); false: such a prompt is an error naming its line."),
    ("data", "epochs", "Passes over the prompts (0: as many as the steps need)."),
    ("data", "chosen_column", "The preferred response's column (rm, dpo; \"arith\" makes pairs of the right and a wrong sum)."),
    ("data", "rejected_column", "The dispreferred response's column (rm, dpo)."),
    ("data", "margin_column", "A column with each pair's margin m (rm): the loss becomes −log σ(r_chosen − r_rejected − m), OpenRLHF's pairwise loss with margin; empty: none."),
    ("generate", "max_new_tokens", "Most new tokens per response."),
    ("generate", "temperature", "Sampling temperature."),
    ("generate", "top_p", "Nucleus sampling (1.0: off)."),
    ("generate", "top_k", "Top-k sampling (0: off)."),
    ("generate", "max_inflight", "Streaming generation: a pool of this many sequences advances token by token across batches and steps; a finished sequence's slot is refilled at once and a group's rows leave as soon as its last sample ends (0: each batch generated whole). At run.max_staleness = 0 no step starts before its weights, so it overlaps no steps and only caps the sequences decoded at once (a warning at the start says so)."),
    ("generate", "long_tail", "A long-tail workload for asynchronous experiments: each response gets its own token budget, drawn from a Pareto distribution of this shape between max_new_tokens / 64 and max_new_tokens, and eos ids are ignored, so lengths within a step spread as reasoning traces do (0: off; 1 is a heavy tail)."),
    ("generate", "ignore_eos", "Generate every response to max_new_tokens, past the tokenizer's end tokens (a throughput setting, like TRL's suppress_tokens of the eos id); evaluation still stops at the end tokens."),
    ("generate", "backend", "Which runtime decodes: \"auto\" (weir's CPU kernels for a float32 model on an AVX2 CPU, libtorch elsewhere) or \"torch\" (libtorch ops everywhere: on a CPU, the path a GPU runs; the same tokens within rounding)."),
    ("generate", "on_new_weights", "What a streaming generator's in-flight sequences do when new weights arrive: \"finish\" (on the weights they started with; nothing new starts meanwhile), \"keep\" (continue under the new weights over their KV cache), \"recompute\" (their prompt and tokens so far are run again under the new weights)."),
    ("reward", "kind", "\"rule\", \"model\" (model.reward_model), \"remote\" (an HTTP reward server), \"python\" (a function in reward.file) or \"terms\" (several, weighted: reward.terms)."),
    ("reward", "rule", "The rule reward: arith_exact_match, math (the final answer: last \\boxed{…}, #### x or last number; numbers, fractions, percentages, units), exact, contains."),
    ("reward", "url", "The reward server, e.g. http://10.0.0.7:5000/get_reward (OpenRLHF's protocol)."),
    ("reward", "timeout_s", "Seconds per request (remote, python) before it is retried."),
    ("reward", "attempts", "Attempts per request (remote; python: when a worker dies or times out)."),
    ("reward", "file", "The Python file of reward.kind = \"python\"."),
    ("reward", "function", "Its function: OpenRLHF's reward_func(queries, prompts, labels, **columns) returning rewards (or {\"rewards\", \"scores\", \"extra_logs\"}), or verl's per-sample compute_score(data_source, solution_str, ground_truth, extra_info)."),
    ("reward", "python", "The interpreter that runs it (python3, or a venv's bin/python)."),
    ("reward", "workers", "Long-lived worker processes of the Python reward; a step's rows are split over them."),
    ("reward", "terms", "reward.kind = \"terms\": rewards summed with weights, each logged as reward_<name>: [[reward.terms]] with rule = \"math\" | \"exact\" | \"contains\" | \"arith_exact_match\" | \"regex\" (pattern = full match of the completion) | \"length\" (−tokens/max_tokens), or file (+ function) of a Python reward; weight (1), name."),
    ("reward", "overlong_buffer", "DAPO's soft overlong punishment: the last N tokens below generate.max_new_tokens where a response's reward falls linearly, to −overlong_penalty_factor at the maximum (0: off; any reward kind)."),
    ("reward", "overlong_penalty_factor", "The overlong penalty at generate.max_new_tokens."),
    ("algorithm", "lr", "Peak learning rate. The defaults suit small models (the demo's); real checkpoints train at about 1e-6 (RL) or 1e-5 (SFT), and a run warns when a default meets a checkpoint past 50M weights."),
    ("algorithm", "warmup_steps", "Linear warm-up steps."),
    ("algorithm", "schedule", "\"constant\" or \"cosine\" (decays to min_lr_ratio · lr at the last step)."),
    ("algorithm", "min_lr_ratio", "The cosine floor as a fraction of lr."),
    ("algorithm", "weight_decay", "AdamW weight decay."),
    ("algorithm", "max_grad_norm", "Gradient-norm clip (0: off)."),
    ("algorithm", "micro_batch", "Rows per forward/backward pass (gradients accumulate over a step)."),
    ("algorithm", "micro_batch_tokens", "A token budget per forward/backward pass of the actor's learner: a mini-batch's rows are sorted by length and cut into micro-batches of at most micro_batch rows whose padded size (rows × longest prompt + response) stays within it, so long-tailed responses cost their own tokens rather than the longest row's width (verl's use_dynamic_bsz; 0: off, rows in order)."),
    ("algorithm", "logprob_chunk", "Response positions the output head runs on at a time in the log-prob passes (learner, reference, SFT) when a micro-batch holds more: at most this many × vocabulary logits exist at once, forward and backward (the gradient through the head is computed chunk by chunk); the same values and gradients. 0: all positions at once."),
    ("algorithm", "gradient_checkpointing", "Keep one hidden state per layer and recompute the rest in the backward pass (actor learner and SFT): less memory, one more forward pass, the same gradients."),
    ("algorithm", "ppo_epochs", "Optimizer passes over each step's rows."),
    ("algorithm", "mini_batches", "Optimizer steps per pass over a step's rows: the rows split into this many mini-batches, each normalised over its own rows (verl's ppo_mini_batch_size = rows / mini_batches); the critic takes the same ones."),
    ("algorithm", "clip_low", "ε_low: the ratio is clipped below at 1 − ε_low."),
    ("algorithm", "clip_high", "ε_high: clipped above at 1 + ε_high (> clip_low: DAPO's clip-higher)."),
    ("algorithm", "dual_clip", "Dual-clip c > 1 for negative advantages (0: off; under flavor = \"verl\", verl's c = 3, which verl always applies)."),
    ("algorithm", "kl_coef", "β of the KL to the reference: in the loss for grpo / dr_grpo / rloo, in the reward for ppo / reinforce_pp* / remax, measured there on the generator's log-probs (those of the distribution it sampled from: with generate.top_p < 1 or top_k, the truncated one's, as verl's rollout log-probs in bypass mode); 0 drops the reference."),
    ("algorithm", "kl_target", "ppo / reinforce_pp*: the KL the adaptive controller steers kl_coef towards after each step, β ← β·(1 + clip(KL/target − 1, ±0.2)·n/horizon) (0: fixed)."),
    ("algorithm", "kl_horizon", "Responses over which the adaptive KL controller spreads a full adjustment."),
    ("algorithm", "kl_estimator", "The KL estimator (verl's names): \"k1\" (log-ratio), \"k2\" or \"mse\" (half its square), \"k3\" (Schulman's unbiased, non-negative one), \"abs\"; with the KL in the loss also \"k1+\" and \"k3+\" (the value of k1 / k3, the gradient of k2). Default \"k3\" with the KL in the loss (grpo and the other group pipelines, as TRL and OpenRLHF's GRPO recipes), \"k1\" with it in the reward (ppo, reinforce_pp*, remax, as OpenRLHF and verl default: only k1's expectation under the policy has the KL's gradient there)."),
    ("algorithm", "entropy_coef", "Entropy bonus coefficient."),
    ("algorithm", "aggregation", "How the per-token loss becomes a scalar, normalised over the whole step (all micro-batches and data-parallel ranks): \"token-mean\" (Σ loss / tokens), \"seq-mean-token-mean\" (mean over responses of each one's token mean), \"seq-mean-token-sum\" (mean over responses of each one's token sum), \"seq-mean-token-sum-norm\" (Dr.GRPO: Σ loss / (responses · loss_scale_factor)) or \"token-sum\"."),
    ("algorithm", "loss_scale_factor", "T of \"seq-mean-token-sum-norm\": a constant replicates Dr.GRPO exactly (0: generate.max_new_tokens, the padded response length)."),
    ("algorithm", "policy_loss", "The policy objective: \"ppo\" (a clipped ratio per token), \"gspo\" (one ratio per response), \"cispo\" (the clipped ratio, without gradient, weights every token's −A·log π), \"sapo\" (a smooth sigmoid gate instead of the clip), \"gmpo\" (the geometric mean of the sign-clipped token ratios; averages per response), \"gpg\" (−A·log π), \"reinforce\" (−A·log π weighted by the truncated ratio π / π_behaviour, without gradient), \"clip_cov\" / \"kl_cov\" (PPO, or −A·r, with the gradient cut or a KL penalty on the few highest-covariance tokens). gspo and sapo need aggregation = \"seq-mean-token-mean\", as verl has them."),
    ("algorithm", "sapo_tau_pos", "SAPO's gate temperature τ for positive advantages."),
    ("algorithm", "sapo_tau_neg", "SAPO's gate temperature τ for other advantages."),
    ("algorithm", "clip_cov_ratio", "Clip-Cov: the fraction of tokens whose gradient is cut."),
    ("algorithm", "clip_cov_lb", "Clip-Cov: tokens qualify with a covariance (A − Ā)(log π − mean log π) above this bound…"),
    ("algorithm", "clip_cov_ub", "… and below this one."),
    ("algorithm", "kl_cov_ratio", "KL-Cov: the fraction of tokens (those of largest covariance) given the KL penalty."),
    ("algorithm", "kl_cov_coef", "KL-Cov: the penalty's coefficient on |log π − log π_old|."),
    ("algorithm", "reinforce_is_cap", "REINFORCE: its importance ratio π / π_behaviour is truncated at this value (verl's rollout_is_threshold)."),
    ("algorithm", "flavor", "\"openrlhf\" or \"verl\": whose semantics where the two differ (KL clamping, GAE and REINFORCE++ returns over masked tokens, whitening, GSPO's gradient, group edge cases, the score clip, the dual clip, how the critic's loss and the KL and entropy terms aggregate, the entropy's temperature)."),
    ("algorithm", "gamma", "Discount γ of ppo's GAE and reinforce_pp's returns."),
    ("algorithm", "lambda", "λ of ppo's GAE."),
    ("algorithm", "critic_lr", "The critic's learning rate (ppo), on the same schedule as the actor's (warm-up, decay)."),
    ("algorithm", "value_clip", "Value clipping (ppo; 0: off)."),
    ("algorithm", "beta", "β of the preference losses (dpo): the implicit reward is β · (log π − log π_ref)."),
    ("algorithm", "preference_loss", "\"dpo\", \"cdpo\" (with label_smoothing) or \"ipo\"."),
    ("algorithm", "label_smoothing", "ε of cDPO: the probability that a preference label is flipped."),
    ("algorithm", "correction", "Off-policy correction for stale rows, with ρ = π_old / π_behaviour per token: \"none\", \"tis\" (weight clamp(ρ)), \"icepop\" (weight ρ, 0 outside the bounds), \"seq-mask\" (weight ρ, responses whose geometric-mean ρ is outside dropped), \"seq-tis\" (each response weighted by its whole ratio Πρ, clamped), \"geo-rejection\" (verl's seq_mean_k1: responses whose mean K1, −mean log ρ, is outside [ln correction_low, ln correction_high] dropped, the rest weight 1; on the geometric-mean ρ that band is [1/correction_high, 1/correction_low]), \"k3-rejection\" (responses whose mean K3 of ρ exceeds correction_high dropped). Recorded as is_weight_mean/min/max and is_masked_fraction."),
    ("algorithm", "correction_low", "The correction's lower bound on ρ."),
    ("algorithm", "correction_high", "The correction's upper bound on ρ."),
    ("dynamic_sampling", "enabled", "Drop prompt groups whose scores all agree (DAPO; the score is the reward before reward.overlong_buffer's penalty, as verl's DAPO filters on acc)."),
    ("dynamic_sampling", "target_groups", "Groups per step for the learner (0: every informative group), at most data.prompts_per_step; oversample with a larger data.prompts_per_step. A step's surplus waits in a pool for later steps (within run.max_staleness); a step short of the target trains on the groups it has (groups_emitted says how many), unless max_extra_batches lets it wait."),
    ("dynamic_sampling", "max_extra_batches", "A step short of target_groups waits for the informative groups of up to this many later steps' prompts, in order, until it has the target, as verl generates more batches (max_num_gen_batches − 1); past them it trains on what it has. 0: no waiting. At most run.max_staleness (those steps are generated while it waits); a checkpoint step takes no later step's groups. Recorded as extra_steps."),
    ("curriculum", "enabled", "Skip prompts by their solve rate so far (maintained with differential dataflow)."),
    ("curriculum", "min_samples", "Samples a prompt needs before it is judged."),
    ("curriculum", "max_solve_rate", "Skip prompts solved at this rate or more."),
    ("curriculum", "min_solve_rate", "Skip prompts solved at this rate or less (negative: keep all)."),
    ("curriculum", "solve_threshold", "A sample counts as solved at this reward or more."),
    ("eval", "arith", "Greedy accuracy on the 500 arith evaluation pairs before and after (arith data only)."),
    ("eval", "batch", "Prompts per evaluation batch."),
    ("eval", "prompts", "Held-out prompts (JSONL or Parquet, read like data.prompts) the final policy is evaluated on with the run's reward: eval/reward (greedy), eval/mean_at_k and eval/pass_at_k in metrics.parquet and summary.json (empty: none)."),
    ("eval", "every", "Evaluate on eval.prompts every N steps during training: each rollout worker scores its share of the prompts with the policy its generator holds, before that step's rollouts (step 0: the starting policy); rows of stage eval in metrics.parquet, with the policy_version evaluated (0: only the final policy, at the end)."),
    ("eval", "best_checkpoint", "After the run, link checkpoints/best to the checkpoint whose policy had the best greedy eval reward (the earliest of equals) and describe it in checkpoints/best.json and summary.json; eval.every must be a multiple of run.checkpoint_every so that evaluated policies are saved."),
    ("eval", "k", "Responses sampled per eval prompt (as in training) for mean@k and pass@k, the share of prompts whose best response's reward is positive (1: greedy only)."),
    ("lora", "rank", "LoRA adapters of this rank on the actor (0: none, the whole model trains). Only the adapters train; the reference is the same frozen weights without them (one copy per device, shared by the roles there); the weights edge carries only the adapters; checkpoints are PEFT adapter folders (adapter_config.json, adapter_model.safetensors) that peft loads onto model.path and that weir merge turns into a plain checkpoint."),
    ("lora", "alpha", "The adapters' update is scaled by alpha / rank."),
    ("lora", "dropout", "Dropout on the adapters' input while the learner trains (needs algorithm.gradient_checkpointing = false)."),
    ("lora", "target_modules", "The projections that get adapters: any of q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj."),
];

/// The configuration reference in Markdown: every key by section, with its
/// default, the pipelines that read it and what it means; made from the
/// same table and defaults as `weir config PIPELINE`, so it cannot drift.
pub fn reference_page() -> String {
    let defaults: Vec<(PipelineKind, toml::Value)> = PipelineKind::ALL
        .iter()
        .map(|&kind| {
            let value = toml::Value::try_from(RunConfig::defaults_for(kind));
            (kind, value.expect("a config serialises"))
        })
        .collect();
    let mut out = String::from(
        "# Configuration reference\n\n\
         Every key of a run config, by section: its default, the pipelines that\n\
         read it, and what it means. `weir config PIPELINE` prints the keys one\n\
         pipeline reads as a commented TOML file; a key set where it would\n\
         change nothing is refused with one line naming it. This page is\n\
         `weir config --reference`, and a test holds it to that.\n",
    );
    let mut section = "";
    for (s, key, help) in DOCS {
        if *s != section {
            out.push_str(&format!(
                "\n## `[{s}]`\n\n| key | default | read by | meaning |\n|---|---|---|---|\n"
            ));
            section = s;
        }
        let readers: Vec<(PipelineKind, String)> = defaults
            .iter()
            .filter(|(kind, _)| applies(*kind, s, key))
            .map(|(kind, doc)| (*kind, doc[*s][*key].to_string()))
            .collect();
        let kinds: Vec<PipelineKind> = readers.iter().map(|(k, _)| *k).collect();
        let read_by = readers_cell(&kinds);
        out.push_str(&format!(
            "| `{key}` | {} | {read_by} | {} |\n",
            default_cell(&readers),
            help.replace('|', "\\|")
        ));
    }
    out
}

/// Who reads a key: `all`, `RL pipelines` (with any others named), or
/// the pipelines by name.
fn readers_cell(kinds: &[PipelineKind]) -> String {
    if kinds.len() == PipelineKind::ALL.len() {
        return "all".into();
    }
    let rl = PipelineKind::ALL.iter().filter(|k| k.is_rl());
    let all_rl = rl.clone().all(|k| kinds.contains(k));
    let mut names: Vec<&str> = Vec::new();
    if all_rl {
        names.push(RL_PIPELINES);
    }
    names.extend(
        kinds
            .iter()
            .filter(|k| !(all_rl && k.is_rl()))
            .map(|k| k.name()),
    );
    names.join(", ")
}

/// What [`readers_cell`] calls every RL pipeline.
pub(super) const RL_PIPELINES: &str = "RL pipelines";

/// A key's default as its readers have it: one value, or the value of each
/// group of pipelines where they differ (the largest group as `others`).
fn default_cell(readers: &[(PipelineKind, String)]) -> String {
    let mut groups: Vec<(&str, Vec<&str>)> = Vec::new();
    for (kind, value) in readers {
        match groups.iter_mut().find(|(v, _)| v == value) {
            Some((_, kinds)) => kinds.push(kind.name()),
            None => groups.push((value, vec![kind.name()])),
        }
    }
    let cell = match groups.len() {
        0 => String::new(),
        1 => format!("`{}`", groups[0].0),
        _ => {
            let largest = (0..groups.len())
                .max_by_key(|&i| (groups[i].1.len(), std::cmp::Reverse(i)))
                .expect("two groups or more");
            let (common, _) = groups.remove(largest);
            let mut parts: Vec<String> = groups
                .iter()
                .map(|(v, kinds)| format!("{}: `{v}`", kinds.join(", ")))
                .collect();
            parts.push(format!("others: `{common}`"));
            parts.join("; ")
        }
    };
    cell.replace('|', "\\|")
}
