//! What every config key means: the comments `weir config` prints, and
//! the configuration reference (`docs/configuration.md`, printed by
//! `weir config --reference`).

use super::RunConfig;
use crate::PipelineKind;
use Readers::*;

/// A config key: its section and name, the pipelines that read it, and
/// what it means (what `weir config` prints above it).
#[derive(Clone, Copy, Debug)]
pub struct Key {
    /// The TOML section.
    pub section: &'static str,
    /// The key's name in it.
    pub name: &'static str,
    /// The pipelines that read it.
    pub readers: Readers,
    /// What it means.
    pub doc: &'static str,
}

const fn key(
    section: &'static str,
    name: &'static str,
    readers: Readers,
    doc: &'static str,
) -> Key {
    Key {
        section,
        name,
        readers,
        doc,
    }
}

/// Every key, in file order: a new key is a field of its section and a
/// line here.
pub const KEYS: &[Key] = &[
    key("run", "steps", All, "Steps (policy updates) to run."),
    key("run", "max_staleness", Rl, "Bounded staleness k: rollouts may come from policies up to k versions old (0 = synchronous on-policy)."),
    key("run", "seed", All, "Seed of prompt shuffling and sampling."),
    key("run", "threads", All, "libtorch threads per worker."),
    key("run", "checkpoint_every", All, "Save a checkpoint every N steps (0: only after the last step)."),
    key("run", "max_shard_size", All, "Checkpoint weights larger than this are saved in shards with model.safetensors.index.json, as transformers saves them (\"5GB\", \"500MB\", \"2GiB\")."),
    key("run", "rows_per_file", Rl, "Rollout rows per Parquet file."),
    key("run", "device", All, "\"cpu\" or \"cuda\"."),
    key("placement", "workers", All, "Engine workers (threads; one per GPU on a GPU machine)."),
    key("placement", "rollout", All, "Workers that generate and score."),
    key("placement", "train", All, "Workers that run the reference, critic, advantage and learner (may equal rollout: colocation). Several workers (in one process or in several) train as data-parallel ranks of one learner, each on its share of every step's rows, their gradients summed before each optimizer step (whitening, the in-reward KL and GPG's α over the whole step); dynamic sampling needs one train worker."),
    key("placement", "weights_channel", Rl, "How the learner's weights cross to another process (once per process, while generation goes on): \"direct\" (a TCP connection of their own from the learner's process, straight into the receiving process's memory: the kernel's two copies; proves the cluster secret when there is one) or \"timely\" (in buckets on timely's own connections, for networks where only the hostfile's ports are open: two more copies)."),
    key("placement", "weights_port", Rl, "The port on which a learner's process serves its weights over the direct channel, on its hostfile host (0: any free port; the receivers learn it from the weights edge)."),
    key("placement", "weights_bucket_mib", Rl, "The largest piece, in MiB, in which the learner's weights cross to another process over timely's channel (the buckets travel while generation goes on)."),
    key("placement", "encrypt", All, "Encrypt every byte the processes of a multi-process run exchange (rows and control on timely's connections, weights on the direct channel) with AES-256-GCM, under keys each connection derives from the cluster secret and an X25519 exchange of its own (see docs/security.md for what it costs); every process must set it alike. No effect in one process."),
    key("placement", "shard_optimizer", All, "Shard the trainers' optimizer state over the data-parallel ranks of placement.train (ZeRO stages 1 and 2): each rank keeps the AdamW moments (and float32 master weights) of its run of whole parameters only, about 1/N of them; the ranks' gradients are reduce-scattered (each keeps the sums of its own, the rest are freed), each updates its parameters, and they are all-gathered. The weights equal the unsharded ranks' to the bit. Checkpoints then hold one optimizer file per rank (optimizer-0000r-of-0000N.safetensors, written by rank 0 as each arrives) and resume on any rank count, sharded or not. Needs two or more train workers."),
    key("placement", "teacher", Distill, "Where the distillation teacher runs: \"train\" (with the learner, each train worker scoring a share of every batch), \"rollout\" (beside the generator) or a list of workers of its own (e.g. [2, 3]: each scores a share of every batch, by group; a GPU each on a GPU machine; in any process of a cluster)."),
    key("placement", "judge", Rl, "Workers of their own for the judge reward (reward.kind = \"judge\" or a judge term): the reward stages run there, each worker judging a share of every batch by group, while the rollout workers go on generating; empty: the reward stages run on the rollout workers, beside the generator."),
    key("placement", "reference", Rl, "Where the reference model runs: \"train\" (with the learner) or \"rollout\" (beside the generator, to balance a learner-bound step)."),
    key("model", "path", All, "The actor's HuggingFace checkpoint folder (required)."),
    key("model", "dtype", All, "Compute dtype: \"f32\", \"bf16\" or \"f16\". Trainers of a half-precision model keep float32 master weights and AdamW moments (saved in optimizer.safetensors as master.*): the update lands on the master, the weights are it rounded."),
    key("model", "reference", RlAndDpo, "The frozen reference's checkpoint (empty: the actor's). It scores the policy's token ids: its tokenizer must read every id of the policy's as the policy's does and its vocab_size reach the policy's."),
    key("model", "reward_model", RlAndRm, "A reward model checkpoint, for reward.kind = \"model\". Where its tokenizer reads every id of the policy's as the policy's does and its vocab_size reaches the policy's, it scores the policy's tokens; otherwise it reads each row as text: the prompt's conversation with the completion as the assistant's answer, rendered by its own chat template and tokenizer (PPO's critic may then not start from it: set model.critic)."),
    key("model", "critic", Ppo, "The critic's initial checkpoint (ppo; empty: the reward model, else the actor with a fresh value head). It reads the policy's token ids: its tokenizer must read every id of the policy's as the policy's does and its vocab_size reach the policy's."),
    key("judge", "path", Rl, "The judge's HuggingFace checkpoint folder (a causal LM; required when reward.kind = \"judge\" or a [[reward.terms]] entry has rule = \"judge\"). It runs in the reward stage (on the rollout workers, or on placement.judge's), through weir's own generator (batched; a step's judging overlaps the next batch's generation), in model.dtype on model.device."),
    key("judge", "template", Rl, "The judge's prompt, a minijinja template over `prompt` (the prompt as the file gives it: for prompts rendered through the policy's chat template, the conversation's one message besides the system's, or each as `role: content`, never the policy's markup), `response` (the completion, cut at its end-of-turn marker), `label` (data.label_column's value) and the prompt file's other columns by name; a name that is none of these is refused."),
    key("judge", "chat", Rl, "Give the rendered template to the judge as a user message through its tokenizer's chat template (with the generation prompt); false: the text is the judge's prompt as is."),
    key("judge", "verdict", Rl, "How the judge's answer becomes the reward: \"regex\" (the first group of judge.pattern in the generated text, read as a number) or \"probability\" (Σ p(token) over judge.verdict_tokens at the judge's first generated position: no generation, one forward pass)."),
    key("judge", "pattern", Rl, "verdict = \"regex\": the pattern (Rust regex syntax) whose first capture group, in its first match, is the reward; it must have a group."),
    key("judge", "verdict_tokens", Rl, "verdict = \"probability\": the tokens (text, e.g. [\"Yes\"]) whose summed probability is the reward; each must be exactly one token to the judge's tokenizer."),
    key("judge", "max_new_tokens", Rl, "verdict = \"regex\": tokens the judge generates at most (its own budget)."),
    key("judge", "temperature", Rl, "verdict = \"regex\": the judge's sampling temperature (0: greedy; sampled with the run's seed, a stream per row)."),
    key("judge", "on_unparsed", Rl, "verdict = \"regex\": an answer the pattern finds no number in stops the run with an error naming the row and the judge's text (\"error\"), or gets judge.unparsed_reward (\"reward\"); the share of such rows is the metric judge_unparsed."),
    key("judge", "unparsed_reward", Rl, "on_unparsed = \"reward\": the reward of an unparsed answer."),
    key("teacher", "path", Distill, "The distillation teacher's HuggingFace checkpoint folder (required by distill). It scores the student's (model.path's) token ids, so its tokenizer must read every id of the student's as the student's does (vocabulary and added tokens; ids of its own past them and the file's layout do not matter) and its config.json's vocab_size must reach the student's; the first id that differs is named."),
    key("teacher", "top_k", Distill, "The teacher also records its k most likely tokens and their log-probs at every response position (teacher_topk_ids, teacher_topk_logprobs in the rollout log, k per position; among the ids the student's vocabulary holds, where the teacher's pads further), and the learner adds algorithm.gkd_coef × GKD's divergence between the teacher and the student over those tokens (algorithm.gkd_beta, algorithm.gkd_tail), differentiated through the student's whole distribution; 0: no such term. The teacher then runs on libtorch (on the CPU too) and keeps its libtorch weights."),
    key("data", "prompts", All, "\"arith\" (the built-in task, its 9,500 training pairs) or a .jsonl / .parquet prompt file."),
    key("data", "prompt_column", All, "The column with plain-text prompts."),
    key("data", "messages_column", All, "The column with chat messages (rendered with the chat template); empty: use prompt_column."),
    key("data", "label_column", RlAndSft, "The column with the reference answer (rule rewards; SFT targets); a dotted name reads a nested field, e.g. verl's reward_model.ground_truth (columns of every kind may be dotted)."),
    key("data", "prompt_template", All, "A text in which {prompt} stands for each plain-text prompt, e.g. \"Question: {prompt}\\nAnswer:\" (empty: the prompt as is)."),
    key("data", "apply_chat_template", All, "Render plain-text prompts as a user message with the model's chat template and a generation prompt (message prompts always are)."),
    key("data", "system_prompt", All, "A system message put before every chat prompt (needs apply_chat_template or messages_column)."),
    key("data", "prompts_per_step", All, "Prompts per step (the SFT batch size)."),
    key("data", "samples_per_prompt", Rl, "Samples per prompt: the group size."),
    key("data", "skip_long_prompts", NotPreference, "Leave out prompts longer than the model's context leaves beside generate.max_new_tokens, with a warning counting them (verl's filter_overlong_prompts); false: such a prompt is an error naming its line."),
    key("data", "epochs", All, "Passes over the prompts (0: as many as the steps need)."),
    key("data", "rollouts", Agentic, "Rollout logs to train on instead of, or beside, fresh generation (training from logs): run folders, folders of rollout Parquet files, or files, e.g. [\"runs/grpo-a\"]. A step's groups are replaced by logged groups (data.replay_fraction of them), rows and rewards as logged, with source = \"log\" and their logged step and policy version; they are off-policy by any number of versions, so algorithm.correction must weigh them. Files are checked first (Parquet, the rollout schema, a version this weir reads; a manifest's tokenizer must be the policy's)."),
    key("data", "rollouts_where", Agentic, "A row filter on the logs' numeric columns, conditions joined by `and` (e.g. \"step >= 10 and reward > 0\"), pushed down to the Parquet row groups (empty: every row)."),
    key("data", "replay_fraction", Agentic, "The share of each step's groups replayed from data.rollouts (1: all; 0.5: every other group generated): group g replays when ⌊(g+1)·f⌋ > ⌊g·f⌋, the logged groups in turn, the same on a resume."),
    key("data", "rollout_advantages", Agentic, "Replayed rows' advantages: \"recompute\" (the pipeline's estimator over their logged rewards) or \"logged\" (as the log holds them)."),
    key("data", "chosen_column", Preference, "The preferred response's column (rm, dpo; \"arith\" makes pairs of the right and a wrong sum)."),
    key("data", "rejected_column", Preference, "The dispreferred response's column (rm, dpo)."),
    key("data", "margin_column", Rm, "A column with each pair's margin m (rm): the loss becomes −log σ(r_chosen − r_rejected − m), OpenRLHF's pairwise loss with margin; empty: none."),
    key("generate", "max_new_tokens", Rl, "Most new tokens per response."),
    key("generate", "temperature", Rl, "Sampling temperature."),
    key("generate", "top_p", Rl, "Nucleus sampling (1.0: off)."),
    key("generate", "top_k", Rl, "Top-k sampling (0: off)."),
    key("generate", "max_inflight", Rl, "Streaming generation: a pool of this many sequences advances token by token across batches and steps; a finished sequence's slot is refilled at once and a group's rows leave as soon as its last sample ends (0: each batch generated whole). With [agent], episodes stream so: one leaves the pool while its call is out and rejoins with its observation, each token's version recorded. At run.max_staleness = 0 no step starts before its weights, so it overlaps no steps and only caps the sequences decoded at once (a warning at the start says so)."),
    key("generate", "long_tail", Rl, "A long-tail workload for asynchronous experiments: each response gets its own token budget, drawn from a Pareto distribution of this shape between max_new_tokens / 64 and max_new_tokens, and eos ids are ignored, so lengths within a step spread as reasoning traces do (0: off; 1 is a heavy tail)."),
    key("generate", "ignore_eos", Rl, "Generate every response to max_new_tokens, past the tokenizer's end tokens (a throughput setting, like TRL's suppress_tokens of the eos id); evaluation still stops at the end tokens."),
    key("generate", "backend", Rl, "Which runtime decodes: \"auto\" (weir's CPU kernels for a float32 model on an AVX2 CPU, libtorch elsewhere) or \"torch\" (libtorch ops everywhere: on a CPU, the path a GPU runs; the same tokens within rounding)."),
    key("generate", "on_new_weights", Rl, "What a streaming generator's in-flight sequences do when new weights arrive: \"finish\" (on the weights they started with; nothing new starts meanwhile), \"keep\" (continue under the new weights over their KV cache), \"recompute\" (their prompt and tokens so far are run again under the new weights)."),
    key("reward", "kind", Rl, "\"rule\", \"model\" (model.reward_model), \"remote\" (an HTTP reward server), \"python\" (a function in reward.file), \"terms\" (several, weighted: reward.terms), \"judge\" (a generative judge's verdict: [judge]) or \"none\" (every row's reward 0: an environment's turn rewards, agent.environment, are the rewards)."),
    key("reward", "rule", Rl, "The rule reward: arith_exact_match, math (the final answer: last \\boxed{…}, #### x or last number; numbers, fractions, percentages, units), exact, contains."),
    key("reward", "url", Rl, "The reward server, e.g. http://10.0.0.7:5000/get_reward (OpenRLHF's protocol), or https://… (verified against the system's certificate authorities; SSL_CERT_FILE replaces them). Redirects are not followed; the proxy variables apply (HTTPS_PROXY, HTTP_PROXY, ALL_PROXY; NO_PROXY bypasses them) and the run logs the proxy it uses."),
    key("reward", "ca_file", Rl, "A PEM file of certificate authorities an https:// reward server may be signed by, beside the system's (a private CA)."),
    key("reward", "timeout_s", Rl, "Seconds per request (remote, python) before it is retried."),
    key("reward", "attempts", Rl, "Attempts per request (remote; python: when a worker dies or times out)."),
    key("reward", "file", Rl, "The Python file of reward.kind = \"python\"."),
    key("reward", "function", Rl, "Its function: OpenRLHF's reward_func(queries, prompts, labels, **columns) returning rewards (or {\"rewards\", \"scores\", \"extra_logs\"}), or verl's per-sample compute_score(data_source, solution_str, ground_truth, extra_info)."),
    key("reward", "python", Rl, "The interpreter that runs it (python3, or a venv's bin/python)."),
    key("reward", "workers", Rl, "Long-lived worker processes of the Python reward; a step's rows are split over them."),
    key("reward", "terms", Rl, "reward.kind = \"terms\": rewards summed with weights, each logged as reward_<name>: [[reward.terms]] with rule = \"math\" | \"exact\" | \"contains\" | \"arith_exact_match\" | \"regex\" (pattern = full match of the completion) | \"length\" (−tokens/max_tokens) | \"judge\" ([judge]'s verdict), or file (+ function) of a Python reward; weight (1), name."),
    key("reward", "overlong_buffer", Rl, "DAPO's soft overlong punishment: the last N tokens below generate.max_new_tokens where a response's reward falls linearly, to −overlong_penalty_factor at the maximum (0: off; any reward kind)."),
    key("reward", "overlong_penalty_factor", Rl, "The overlong penalty at generate.max_new_tokens."),
    key("reward", "stop_properly_coef", Rl, "ProRL's stop-properly penalty (OpenRLHF 0.11's reward.stop_properly_penalty_coef): a truncated response's reward (finish_reason length) is scaled by this coefficient when it is in [0, 1], or replaced by it when negative; 1.0 leaves rewards alone. Applied after the overlong penalty; stop_properly_truncated records the share of rows truncated."),
    key("reward", "on_finish", Rl, "Rewards that replace a row's by how it ended, a table from finish_reason (stop, length; for episodes also max_turns, tool_error, env_error, timeout) to the reward, e.g. {length = 0.0} to zero truncated responses; an episode's environment turn rewards are zeroed with it. Applied after every other reward shaping; finish_replaced records the share of rows replaced."),
    key("algorithm", "distill_coef", Distill, "The weight of on-policy distillation's per-token term in the advantage: coef · (log π_teacher − log π_student) of each sampled token (the student's behaviour log-prob), whose policy gradient lowers the reverse KL to the teacher on the student's samples; added to the task's advantage when algorithm.distill_task names one."),
    key("algorithm", "gkd_beta", Distill, "GKD's β of the top-k term (teacher.top_k > 0): 0 the forward KL(teacher ‖ student), 1 the reverse KL(student ‖ teacher), between them the generalized Jensen–Shannon divergence β·KL(teacher ‖ M) + (1 − β)·KL(student ‖ M), M = β·teacher + (1 − β)·student (TRL's GKDTrainer's beta)."),
    key("algorithm", "gkd_coef", Distill, "The weight of the top-k distillation term in the loss (teacher.top_k > 0), aggregated over generated tokens as the KL term is."),
    key("algorithm", "gkd_tail", Distill, "The probability mass outside the teacher's top k: \"add\" (one more outcome, any other token, on both sides: a proper divergence, never negative) or \"drop\" (sums over the k tokens only; with gkd_beta = 0 verl 0.9's forward_kl_topk). Either way each position's value is clamped at 0."),
    key("algorithm", "distill_task", Distill, "The task advantage distillation adds its term to: \"none\" (the term alone; the rewards are still computed and logged), \"grpo\", \"dr_grpo\" or \"rloo\" (that group estimator's advantage of the reward)."),
    key("algorithm", "lr", All, "Peak learning rate. The defaults suit small models (the demo's); real checkpoints train at about 1e-6 (RL) or 1e-5 (SFT), and a run warns when a default meets a checkpoint past 50M weights."),
    key("algorithm", "warmup_steps", All, "Linear warm-up steps."),
    key("algorithm", "schedule", All, "\"constant\" or \"cosine\" (decays to min_lr_ratio · lr at the last step)."),
    key("algorithm", "min_lr_ratio", All, "The cosine floor as a fraction of lr."),
    key("algorithm", "weight_decay", All, "AdamW weight decay."),
    key("algorithm", "max_grad_norm", All, "Gradient-norm clip (0: off)."),
    key("algorithm", "micro_batch", RlAndSft, "Rows per forward/backward pass (gradients accumulate over a step)."),
    key("algorithm", "micro_batch_tokens", Rl, "A token budget per forward/backward pass of the actor's learner: a mini-batch's rows are sorted by length and cut into micro-batches of at most micro_batch rows whose padded size (rows × longest prompt + response) stays within it, so long-tailed responses cost their own tokens rather than the longest row's width (verl's use_dynamic_bsz; 0: off, rows in order)."),
    key("algorithm", "logprob_chunk", RlAndSft, "Response positions the output head runs on at a time in the log-prob passes (learner, reference, SFT) when a micro-batch holds more: at most this many × vocabulary logits exist at once, forward and backward (the gradient through the head is computed chunk by chunk); the same values and gradients. 0: all positions at once."),
    key("algorithm", "packing", Rl, "Run each micro-batch of the actor's learner (and its proximal pass), each batch of the reference (where it runs on libtorch: weir's CPU kernels never pad) and each of the critic's passes as one sequence without padding (verl's remove-padding, OpenRLHF's packing_samples): rows end to end, attention within each row (rows of similar lengths share one attention call), a prompt that rows of the micro-batch share (a group's) packed once and attended to by each of their responses, the output head run at the real response positions only; with algorithm.micro_batch_tokens a micro-batch holds rows up to that many tokens in all (a longer row is an error naming the key). The same log-probs, values, losses and gradients."),
    key("algorithm", "gradient_checkpointing", RlAndSft, "Keep one hidden state per layer and recompute the rest in the backward pass (actor learner and SFT): less memory, one more forward pass, the same gradients."),
    key("algorithm", "ppo_epochs", Rl, "Optimizer passes over each step's rows."),
    key("algorithm", "mini_batches", Rl, "Optimizer steps per pass over a step's rows: the rows split into this many mini-batches, each normalised over its own rows (verl's ppo_mini_batch_size = rows / mini_batches); the critic takes the same ones."),
    key("algorithm", "clip_low", Rl, "ε_low: the ratio is clipped below at 1 − ε_low (dppo_tv / dppo_kl: the divergence a token with A ≤ 0 may move by)."),
    key("algorithm", "clip_high", Rl, "ε_high: clipped above at 1 + ε_high (> clip_low: DAPO's clip-higher; dppo_tv / dppo_kl: the divergence a token with A > 0 may move by)."),
    key("algorithm", "dual_clip", Rl, "Dual-clip c > 1 for negative advantages (0: off; under flavor = \"verl\", verl's c = 3, which verl always applies; dppo_tv / dppo_kl: the cap of the truncated ratio, verl's clip_ratio_c, default 3 under flavor = \"verl\", else 20)."),
    key("algorithm", "kl_coef", Rl, "β of the KL to the reference: in the loss for grpo / dr_grpo / rloo, in the reward for ppo / reinforce_pp* / remax, measured there on the generator's log-probs (those of the distribution it sampled from: with generate.top_p < 1 or top_k, the truncated one's, as verl's rollout log-probs in bypass mode); 0 drops the reference."),
    key("algorithm", "kl_target", InRewardKl, "ppo / reinforce_pp*: the KL the adaptive controller steers kl_coef towards after each step, β ← β·(1 + clip(KL/target − 1, ±0.2)·n/horizon) (0: fixed)."),
    key("algorithm", "kl_horizon", InRewardKl, "Responses over which the adaptive KL controller spreads a full adjustment."),
    key("algorithm", "kl_unbiased_gradient", Group, "OpenRLHF 0.11's unbiased_gradient for the KL loss term: the estimator's value, but the gradient of w·½(log π − log π_ref)² with w = min(π/π_old, 10) held constant — the importance-weighted reverse-KL gradient, the same for every estimator."),
    key("algorithm", "kl_estimator", Rl, "The KL estimator (verl's names): \"k1\" (log-ratio), \"k2\" or \"mse\" (half its square), \"k3\" (Schulman's unbiased, non-negative one), \"abs\"; with the KL in the loss also \"k1+\" and \"k3+\" (the value of k1 / k3, the gradient of k2). Default \"k3\" with the KL in the loss (grpo and the other group pipelines, as TRL and OpenRLHF's GRPO recipes), \"k1\" with it in the reward (ppo, reinforce_pp*, remax, as OpenRLHF and verl default: only k1's expectation under the policy has the KL's gradient there)."),
    key("algorithm", "entropy_coef", Rl, "Entropy bonus coefficient."),
    key("algorithm", "aggregation", Rl, "How the per-token loss becomes a scalar, normalised over the whole step (all micro-batches and data-parallel ranks): \"token-mean\" (Σ loss / tokens), \"seq-mean-token-mean\" (mean over responses of each one's token mean), \"seq-mean-token-sum\" (mean over responses of each one's token sum), \"seq-mean-token-sum-norm\" (Dr.GRPO: Σ loss / (responses · loss_scale_factor)) or \"token-sum\"."),
    key("algorithm", "loss_scale_factor", Rl, "T of \"seq-mean-token-sum-norm\": a constant replicates Dr.GRPO exactly (0: generate.max_new_tokens, the padded response length)."),
    key("algorithm", "policy_loss", Rl, "The policy objective: \"ppo\" (a clipped ratio per token), \"gspo\" (one ratio per response), \"cispo\" (the clipped ratio, without gradient, weights every token's −A·log π), \"sapo\" (a smooth sigmoid gate instead of the clip), \"gmpo\" (the geometric mean of the sign-clipped token ratios; averages per response), \"gpg\" (−A·log π), \"reinforce\" (−A·log π weighted by the truncated ratio π / π_behaviour, without gradient), \"clip_cov\" / \"kl_cov\" (PPO, or −A·r, with the gradient cut or a KL penalty on the few highest-covariance tokens), \"dppo_tv\" / \"dppo_kl\" (DPPO: −A·log π weighted by the truncated ratio without gradient, each token dropped once its probability has moved further than clip_low / clip_high in total variation or binary KL, in its advantage's direction), \"dro\" (−A·log π + ½β(log π − log π_old)², β = dro_beta). gspo and sapo need aggregation = \"seq-mean-token-mean\", as verl has them."),
    key("algorithm", "sapo_tau_pos", Rl, "SAPO's gate temperature τ for positive advantages."),
    key("algorithm", "sapo_tau_neg", Rl, "SAPO's gate temperature τ for other advantages."),
    key("algorithm", "clip_cov_ratio", Rl, "Clip-Cov: the fraction of tokens whose gradient is cut."),
    key("algorithm", "clip_cov_lb", Rl, "Clip-Cov: tokens qualify with a covariance (A − Ā)(log π − mean log π) above this bound…"),
    key("algorithm", "clip_cov_ub", Rl, "… and below this one."),
    key("algorithm", "kl_cov_ratio", Rl, "KL-Cov: the fraction of tokens (those of largest covariance) given the KL penalty."),
    key("algorithm", "kl_cov_coef", Rl, "KL-Cov: the penalty's coefficient on |log π − log π_old|."),
    key("algorithm", "dro_beta", Rl, "DRO: β of the quadratic penalty ½β(log π − log π_old)² (verl's policy_loss.dro_beta, which has no default; 0.05 is the value of verl's own test)."),
    key("algorithm", "gdpo", GrpoFamily, "GDPO (verl 0.9's gdpo estimator): each [[reward.terms]] term's own score normalised within its group on its own (grpo: by the std; dr_grpo: centred), summed with the terms' weights (an episode's environment rewards one more term of weight 1), then whitened over the whole step's generated tokens, under verl's semantics whatever algorithm.flavor: a term with a small spread is not drowned by a large one. Needs reward.kind = \"terms\"; the reward shaping keys (overlong, stop-properly, on_finish), which change only the summed reward, are refused."),
    key("algorithm", "reinforce_is_cap", Rl, "REINFORCE: its importance ratio π / π_behaviour is truncated at this value (verl's rollout_is_threshold)."),
    key("algorithm", "flavor", Rl, "\"openrlhf\" or \"verl\": whose semantics where the two differ (KL clamping, GAE and REINFORCE++ returns over masked tokens, whitening, GSPO's gradient, group edge cases, the score clip, the dual clip, how the critic's loss and the KL and entropy terms aggregate, the entropy's temperature)."),
    key("algorithm", "gamma", Returns, "Discount γ of ppo's GAE and reinforce_pp's returns."),
    key("algorithm", "lambda", Ppo, "λ of ppo's GAE."),
    key("algorithm", "critic_lr", Ppo, "The critic's learning rate (ppo), on the same schedule as the actor's (warm-up, decay)."),
    key("algorithm", "value_clip", Ppo, "Value clipping (ppo; 0: off)."),
    key("algorithm", "beta", Dpo, "β of the preference losses (dpo): the implicit reward is β · (log π − log π_ref)."),
    key("algorithm", "preference_loss", Dpo, "\"dpo\", \"cdpo\" (with label_smoothing) or \"ipo\"."),
    key("algorithm", "label_smoothing", Dpo, "ε of cDPO: the probability that a preference label is flipped."),
    key("algorithm", "correction", Rl, "Off-policy correction for stale rows, with ρ = π_old / π_behaviour per token: \"none\", \"tis\" (weight clamp(ρ)), \"icepop\" (weight ρ, 0 outside the bounds), \"seq-mask\" (weight ρ, responses whose geometric-mean ρ is outside dropped), \"seq-tis\" (each response weighted by its whole ratio Πρ, clamped), \"seq-icepop\" (each response weighted by Πρ, dropped where Πρ is outside the bounds: verl's sequence-level IcePop), \"geo-rejection\" (verl's seq_mean_k1: responses whose mean K1, −mean log ρ, is outside [ln correction_low, ln correction_high] dropped, the rest weight 1; on the geometric-mean ρ that band is [1/correction_high, 1/correction_low]), \"k3-rejection\" (responses whose mean K3 of ρ exceeds correction_high dropped), \"binary-kl\" / \"tv\" (OpenRLHF's divergence gates: with p, q the sampled token's behaviour and proximal probabilities, tokens whose binary KL p ln(p/q) + (1−p) ln((1−p)/(1−q)), or |p − q|, exceeds correction_high weigh 0, the rest ρ), \"seq-binary-kl\" / \"seq-tv\" (the same gate on each response's mean: FlashREINFORCE's trust region). Recorded as is_weight_mean/min/max and is_masked_fraction."),
    key("algorithm", "correction_low", Rl, "The correction's lower bound on ρ."),
    key("algorithm", "correction_high", Rl, "The correction's upper bound on ρ (on the divergence, for the gates)."),
    key("algorithm", "correction_batch_normalize", Rl, "Divide the correction's weights by their mean over the step's valid tokens (per response for seq-tis and seq-icepop) on every rank, as verl's rollout_is_batch_normalize (tis, icepop, seq-tis, seq-icepop); the learner's proximal pass then always runs, and the mean is recorded as is_weight_normalizer."),
    key("algorithm", "rejection", Rl, "verl 0.9's rejection sampling (rollout_rs), criteria joined by commas, every one of which a token must pass (with or without a correction; empty: off): \"token_k1\" (−log ρ in [ln low, ln high]), \"token_k2\" (½(log ρ)² ≤ high), \"token_k3\" (ρ − 1 − log ρ ≤ high), \"seq_sum_k1\" … \"seq_sum_k3\" (a response's sum), \"seq_mean_k1\" … \"seq_mean_k3\" (its mean), \"seq_max_k2\", \"seq_max_k3\" (its largest token); log ρ clamped to ±20."),
    key("algorithm", "rejection_threshold", Rl, "The rejection criteria's thresholds, verl's spelling: one shared by all or one per criterion, joined by commas; a K1 criterion takes \"low_high\" (bounds on ρ) or \"high\" (low = 1/high), the others one upper bound, e.g. \"0.5_2.0,0.01\" (default \"2.0\": K1 within [0.5, 2], K2 and K3 at most 2)."),
    key("dynamic_sampling", "enabled", Group, "Drop prompt groups whose scores all agree (DAPO; the score is the reward before reward.overlong_buffer's penalty, as verl's DAPO filters on acc)."),
    key("dynamic_sampling", "target_groups", Group, "Groups per step for the learner (0: every informative group), at most data.prompts_per_step; oversample with a larger data.prompts_per_step. A step's surplus waits in a pool for later steps (within run.max_staleness); a step short of the target trains on the groups it has (groups_emitted says how many), unless max_extra_batches lets it wait."),
    key("dynamic_sampling", "max_extra_batches", Group, "A step short of target_groups waits for the informative groups of up to this many later steps' prompts, in order, until it has the target, as verl generates more batches (max_num_gen_batches − 1); past them it trains on what it has. 0: no waiting. At most run.max_staleness (those steps are generated while it waits); a checkpoint step takes no later step's groups. Recorded as extra_steps."),
    key("curriculum", "enabled", Group, "Skip prompts by their solve rate so far (maintained with differential dataflow)."),
    key("curriculum", "min_samples", Group, "Samples a prompt needs before it is judged."),
    key("curriculum", "max_solve_rate", Group, "Skip prompts solved at this rate or more."),
    key("curriculum", "min_solve_rate", Group, "Skip prompts solved at this rate or less (negative: keep all)."),
    key("curriculum", "solve_threshold", Group, "A sample counts as solved at this reward or more."),
    key("eval", "arith", NotRm, "Greedy accuracy on the 500 arith evaluation pairs before and after (arith data only)."),
    key("eval", "batch", NotRm, "Prompts per evaluation batch."),
    key("eval", "prompts", NotRm, "Held-out prompts (JSONL or Parquet, read like data.prompts) the final policy is evaluated on with the run's reward: eval/reward (greedy), eval/mean_at_k and eval/pass_at_k in metrics.parquet and summary.json (empty: none)."),
    key("eval", "every", Rl, "Evaluate on eval.prompts every N steps during training: each rollout worker scores its share of the prompts with the policy its generator holds, before that step's rollouts (step 0: the starting policy); rows of stage eval in metrics.parquet, with the policy_version evaluated (0: only the final policy, at the end)."),
    key("eval", "best_checkpoint", Rl, "After the run, link checkpoints/best to the checkpoint whose policy had the best greedy eval reward (the earliest of equals) and describe it in checkpoints/best.json and summary.json; eval.every must be a multiple of run.checkpoint_every so that evaluated policies are saved."),
    key("eval", "k", NotRm, "Responses sampled per eval prompt (as in training) for mean@k and pass@k, the share of prompts whose best response's reward is positive (1: greedy only)."),
    key("lora", "rank", NotRm, "LoRA adapters of this rank on the actor (0: none, the whole model trains). Only the adapters train; the reference is the same frozen weights without them (one copy per device, shared by the roles there); the weights edge carries only the adapters; checkpoints are PEFT adapter folders (adapter_config.json, adapter_model.safetensors) that peft loads onto model.path and that weir merge turns into a plain checkpoint."),
    key("lora", "alpha", NotRm, "The adapters' update is scaled by alpha / rank."),
    key("lora", "dropout", NotRm, "Dropout on the adapters' input while the learner trains (needs algorithm.gradient_checkpointing = false)."),
    key("lora", "target_modules", NotRm, "The projections that get adapters: any of q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj."),
    key("agent", "tools", Agentic, "Multi-turn episodes with tools the model may call: built-ins by name, \"calculator\" (exact arithmetic on integers and decimals) and \"python\" (a fresh sandboxed interpreter per call: CPU, memory, process, output and wall-clock limits, every process it starts ends with it, off the network unless agent.python_network allows it; the file system is not isolated); {file, function}, a Python function whose schema comes from its signature and docstring (types from its annotations, each parameter's description from the Args: section), run by long-lived workers; {url, name, description, parameters}, an HTTP endpoint a call posts its arguments to (parameters: the arguments' JSON schema). Their schemas reach the chat template as `tools`, which must render them; each turn's calls are answered and the answers rendered by the template as tool messages. An episode is one row: generate.max_new_tokens bounds its whole response, observations included; the reward reads the model's last turn as response (tool_calls holds every call)."),
    key("agent", "tool_format", Agentic, "How the model writes tool calls: \"hermes\" (<tool_call>{json}</tool_call>: Hermes, Qwen2.5, Qwen3), \"llama3_json\" (Llama 3.1's bare JSON), \"qwen3_coder\" (Qwen3-Coder's XML). A call that cannot be read is an error observation and counts in tool_parse_failures."),
    key("agent", "environment", Agentic, "Multi-turn episodes with an environment that answers each turn: a Python file in OpenRLHF's agent format (a class with reset / step, sync or async, whose environment_feedback is appended as raw text and whose rewards are each turn's reward; its `from openrlhf.utils.agent import …` works without OpenRLHF), servers speaking OpenEnv's HTTP protocol (http:// or https:// URLs, comma-separated: each holds one episode at a time; requests bounded by timeout_s, a failed connection or 5xx tried 3 times, an answer outside the protocol fails the run naming the server), or the name of an environment the user's binary registered. Turn rewards sit on each turn's last generated token (env_rewards) and add to the reward."),
    key("agent", "environment_class", Agentic, "The class of the environment's Python file."),
    key("agent", "action_field", Agentic, "An OpenEnv server's action field that carries the model's turn: each step posts {\"action\": {action_field: the turn's text}}."),
    key("agent", "observation_field", Agentic, "The field of an OpenEnv server's observation the model reads next: text is appended raw, a list of {role, content} messages is rendered by the chat template (empty: the observation's only text field, else the whole observation as JSON text)."),
    key("agent", "max_turns", Agentic, "Turns of the model per episode at most (finish_reason max_turns when the last still called a tool or the environment went on)."),
    key("agent", "max_observation_tokens", Agentic, "Tokens of one tool output or environment observation (each message's content) past which it is cut, with a marker saying how many were left out (one that fits exactly is kept whole)."),
    key("agent", "timeout_s", Agentic, "Seconds a tool call (the python tool's wall clock) or an environment's reset or step may take; an environment past it is restarted and its episode ends as timeout."),
    key("agent", "on_error", Agentic, "A failed tool call or environment step: \"observe\" (its error is what the model reads next, and the episode goes on) or \"end\" (the episode ends: finish_reason tool_error, env_error or timeout). Counted either way, as tool_errors or env_errors."),
    key("agent", "max_concurrency", Agentic, "Tool calls and environment steps running at once, each on a thread of its own, while the other episodes of the batch go on decoding (an episode whose call is out leaves the decode pool and comes back with its observation); with agent.environment also the environment's instances (a Python file: one worker process each), so as many episodes hold one at once."),
    key("agent", "python", Agentic, "The interpreter of the python tool, of Python function tools and of a Python environment."),
    key("agent", "python_network", Agentic, "Whether the python tool's runs may reach the network: \"isolate\" (a network namespace of their own, only a loopback that is down; on a machine that gives weir none, the run is refused naming this key) or \"allow\" (on weir's network, never cut off; said once in the log). See docs/security.md."),
];

/// Which pipelines read a key (the [`KEYS`] table says it of each key).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Readers {
    /// Every pipeline.
    All,
    /// The RL pipelines.
    Rl,
    /// The RL pipelines and sft (micro-batches, the label).
    RlAndSft,
    /// The RL pipelines and dpo (a reference model).
    RlAndDpo,
    /// The RL pipelines and rm (a reward model).
    RlAndRm,
    /// The group pipelines (the DAPO filter, the curriculum).
    Group,
    /// ppo and reinforce_pp: discounted returns. REINFORCE++-baseline's
    /// return is undiscounted in both references (OpenRLHF sets γ = 1 for
    /// it; verl puts the centred total on every token).
    Returns,
    /// The pipelines that put the KL in the reward, which the adaptive
    /// controller moves: ppo, reinforce_pp(_baseline), remax.
    InRewardKl,
    /// ppo.
    Ppo,
    /// grpo and dr_grpo (GDPO's per-term normalisation).
    GrpoFamily,
    /// distill.
    Distill,
    /// dpo.
    Dpo,
    /// rm.
    Rm,
    /// rm and dpo: preference pairs.
    Preference,
    /// Every pipeline but rm and dpo (preference pairs carry their
    /// responses: no room to leave).
    NotPreference,
    /// The RL pipelines whose rows may be episodes: all but remax (whose
    /// greedy baseline rows are single responses) and distill (whose
    /// teacher scores single responses).
    Agentic,
    /// Every pipeline but rm: a reward model has no policy to evaluate, and
    /// trains its score head, which adapters do not reach.
    NotRm,
}

impl Readers {
    /// Whether `pipeline` is among them.
    pub fn read_by(self, pipeline: PipelineKind) -> bool {
        use PipelineKind::*;
        match self {
            Readers::All => true,
            Readers::Rl => pipeline.is_rl(),
            Readers::RlAndSft => pipeline.is_rl() || pipeline == Sft,
            Readers::RlAndDpo => pipeline.is_rl() || pipeline == Dpo,
            Readers::RlAndRm => pipeline.is_rl() || pipeline == Rm,
            Readers::Group => pipeline.is_group(),
            Readers::Returns => matches!(pipeline, Ppo | ReinforcePp),
            Readers::InRewardKl => {
                matches!(pipeline, Ppo | ReinforcePp | ReinforcePpBaseline | Remax)
            }
            Readers::Ppo => pipeline == Ppo,
            Readers::GrpoFamily => matches!(pipeline, Grpo | DrGrpo),
            Readers::Distill => pipeline == Distill,
            Readers::Dpo => pipeline == Dpo,
            Readers::Rm => pipeline == Rm,
            Readers::Preference => matches!(pipeline, Rm | Dpo),
            Readers::NotPreference => !matches!(pipeline, Rm | Dpo),
            Readers::NotRm => pipeline != Rm,
            Readers::Agentic => pipeline.is_rl() && !matches!(pipeline, Remax | Distill),
        }
    }
}

/// Whether `pipeline` reads `section.key` at all (false for a key that does not exist).
pub fn applies(pipeline: PipelineKind, section: &str, key: &str) -> bool {
    find(section, key).is_some_and(|k| k.readers.read_by(pipeline))
}

/// The key `section.name`, if there is one.
pub fn find(section: &str, name: &str) -> Option<&'static Key> {
    KEYS.iter().find(|k| k.section == section && k.name == name)
}

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
    for &Key {
        section: s,
        name: key,
        doc: help,
        ..
    } in KEYS
    {
        if s != section {
            out.push_str(&format!(
                "\n## `[{s}]`\n\n| key | default | read by | meaning |\n|---|---|---|---|\n"
            ));
            section = s;
        }
        let readers: Vec<(PipelineKind, String)> = defaults
            .iter()
            .filter(|(kind, _)| applies(*kind, s, key))
            .map(|(kind, doc)| (*kind, doc[s][key].to_string()))
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
