//! The episode generator stage: one episode per row (the source already
//! expanded prompts × n), its turns sampled by the actor and answered by
//! the tools, written as the rollout's response columns.
//!
//! A batch's episodes run together in an episode pool
//! ([`super::pool`]): their turns decode in one pool of sequences, and an
//! episode whose call is out leaves it while the others go on. What the
//! columns hold:
//! - `response_tokens`: the whole trajectory, generated, boundary and
//!   observation tokens in order; `token_kinds` says which is which, and
//!   `token_turns` the turn of each;
//! - `behavior_logprobs`: each generated token's log-prob, null on the
//!   others (never a value a loss could read);
//! - `response`: what a reward reads: the model's last turn (its answer),
//!   decoded without special tokens — never a tool's or the environment's
//!   words, so no reward scores them as the model's; its earlier turns'
//!   calls are in `tool_calls`;
//! - `finish_reason`: `stop`, `length`, `max_turns`, `tool_error`,
//!   `env_error` or `timeout`;
//! - `tool_calls`: the episode's calls as JSON (turn, tool, arguments,
//!   output, ok), so the log reads back without the tools;
//! - with an environment, `env_rewards` (each turn's reward on its last
//!   generated token) and `env_error` (what it said when it failed).
//!
//! The row's conversation is its `prompt` as one user message. With tools,
//! the stage renders it again with the tools' schemas handed to the chat
//! template (`tools`), so the model sees them as its family expects, and
//! writes those tokens as the row's `prompt_tokens` (what the learner and
//! the reference read is what the model saw).

use std::sync::Arc;
use std::time::Instant;

use arrow::array::{ArrayRef, RecordBatch, StringArray};
use serde_json::json;
use weir_gpu::{Backend, Model, SamplingParams, Tokenizer};
use weir_graph::batch::with_column;
use weir_graph::weights_edge::now_unix_s;
use weir_graph::{PolicyVersion, Stage, StageError, StepContext, WeightsPayload};

use super::environment::Environment;
use super::episode::{Budgets, Episode, EpisodeRunner, OnError};
use super::pool::{run_episodes, EpisodeInput, PoolSettings, Schedule};
use super::tool_calls::ToolCallParser;
use super::tools::Tool;
use crate::data::columns::{
    float_list_array, token_kinds_array, token_list_array, token_lists, u32_list_array,
};
use crate::rollout::{col, TokenKind};

/// The column with each episode's tool calls (JSON text).
pub const TOOL_CALLS: &str = "tool_calls";
/// The column with what the environment said when it failed (null when it did not).
pub const ENV_ERROR: &str = "env_error";

/// The actor's episode generator.
pub struct EpisodeGenerate {
    pub(super) model: Model,
    tokenizer: Tokenizer,
    pub(super) params: SamplingParams,
    pub(super) backend: Backend,
    pub(super) tools: Arc<Vec<Box<dyn Tool>>>,
    parser: Box<dyn ToolCallParser>,
    end_of_turn: String,
    budgets: Budgets,
    on_error: OnError,
    /// Environment instances, one per episode under way (none: tools);
    /// a streaming generator's pool holds them.
    pub(super) environments: Vec<Box<dyn Environment>>,
    /// Whether an environment answers the turns.
    with_environment: bool,
    pub(super) max_concurrency: usize,
    pub(super) call_deadline: Option<std::time::Duration>,
    pub(super) schedule: Schedule,
}

impl EpisodeGenerate {
    /// Episodes of `model`'s turns (sampled with `params`, whose
    /// `eos_token_ids` end a turn; the first is the template's end-of-turn
    /// token), calling `tools` in `parser`'s format, within `budgets`.
    pub fn new(
        model: Model,
        tokenizer: Tokenizer,
        params: SamplingParams,
        tools: Vec<Box<dyn Tool>>,
        parser: Box<dyn ToolCallParser>,
        budgets: Budgets,
    ) -> Result<Self, StageError> {
        let end = params.eos_token_ids.first().ok_or(
            "episodes need an end-of-turn token: the sampling parameters have no eos_token_ids",
        )?;
        let end_of_turn = tokenizer.decode(&[*end], false)?;
        let schemas = (!tools.is_empty()).then(|| super::tools::schemas(&tools));
        let folder = tokenizer_folder(&tokenizer);
        if let Some(schemas) = &schemas {
            super::observe::check_shows_tools(&tokenizer, schemas)
                .map_err(|e| format!("{folder}: {e}"))?;
        }
        super::observe::check_stable(&tokenizer, &end_of_turn, schemas.as_deref())
            .map_err(|e| format!("{folder}: {e}"))?;
        Ok(EpisodeGenerate {
            model,
            tokenizer,
            params: SamplingParams { n: 1, ..params },
            backend: Backend::Auto,
            tools: Arc::new(tools),
            parser,
            end_of_turn,
            budgets,
            on_error: OnError::default(),
            environments: Vec::new(),
            with_environment: false,
            max_concurrency: 8,
            call_deadline: None,
            schedule: Schedule::default(),
        })
    }

    /// Each turn answered by an environment (reset with the row's columns
    /// as JSON) instead of the tools; its turn rewards go to `env_rewards`.
    /// Each of `environments` serves one episode at a time: as many
    /// episodes run at once as there are instances.
    pub fn with_environments(mut self, environments: Vec<Box<dyn Environment>>) -> Self {
        self.with_environment = !environments.is_empty();
        self.environments = environments;
        self
    }

    /// At most `calls` tool calls or environment steps at once.
    pub fn with_max_concurrency(mut self, calls: usize) -> Self {
        self.max_concurrency = calls.max(1);
        self
    }

    /// Gives up on a call out longer than `deadline` (a backstop for tools
    /// and environments that do not time themselves out): its episode goes
    /// on as after a timeout, and the run never waits on it.
    pub fn with_call_deadline(mut self, deadline: std::time::Duration) -> Self {
        self.call_deadline = Some(deadline);
        self
    }

    /// When episodes' turns start (streaming, or in lockstep rounds).
    pub fn with_schedule(mut self, schedule: Schedule) -> Self {
        self.schedule = schedule;
        self
    }

    /// What a failed tool call or environment step does to its episode.
    pub fn with_on_error(mut self, on_error: OnError) -> Self {
        self.on_error = on_error;
        self
    }

    /// Samples on `backend`.
    pub fn with_backend(mut self, backend: Backend) -> Self {
        self.backend = backend;
        self
    }

    /// The episode runner of this generator's settings.
    pub(super) fn runner(&self) -> EpisodeRunner<'_> {
        EpisodeRunner {
            tokenizer: &self.tokenizer,
            parser: self.parser.as_ref(),
            tools: &self.tools,
            end_of_turn: self.end_of_turn.clone(),
            budgets: self.budgets,
            on_error: self.on_error,
        }
    }

    /// `batch` (stage `stage`'s input) with its prompts rendered again
    /// with the tools' schemas when there are tools, and its rows as
    /// episodes to run.
    pub(super) fn inputs(
        &self,
        stage: &str,
        batch: RecordBatch,
    ) -> Result<(RecordBatch, Vec<EpisodeInput>), StageError> {
        let mut prompts = token_lists(&batch, col::PROMPT_TOKENS, stage)?;
        let mut conversations = crate::data::columns::row_conversations(&batch, stage)?;
        let batch = if self.tools.is_empty() {
            batch
        } else {
            let schemas = super::tools::schemas(&self.tools);
            for (prompt, conversation) in prompts.iter_mut().zip(&conversations) {
                *prompt = self
                    .tokenizer
                    .encode_conversation(conversation, Some(&schemas), true)?;
            }
            with_column(&batch, col::PROMPT_TOKENS, token_list_array(&prompts))?
        };
        let streams = crate::stages::generate::row_streams(&batch, stage)?;
        let with_rows = self.with_environment;
        let inputs = prompts
            .into_iter()
            .enumerate()
            .map(|(i, prompt)| {
                Ok(EpisodeInput {
                    messages: std::mem::take(&mut conversations[i]),
                    prompt,
                    stream: streams[i],
                    row: if with_rows {
                        row_json(&batch, i)?
                    } else {
                        serde_json::Value::Null
                    },
                })
            })
            .collect::<Result<Vec<_>, StageError>>()?;
        Ok((batch, inputs))
    }

    fn episodes(
        &mut self,
        ctx: &mut StepContext,
        batch: RecordBatch,
    ) -> Result<RecordBatch, StageError> {
        let (batch, inputs) = self.inputs(ctx.stage(), batch)?;
        let (clock, unix) = (Instant::now(), now_unix_s());
        let settings = PoolSettings {
            max_concurrency: self.max_concurrency,
            call_deadline: self.call_deadline,
            schedule: self.schedule,
            backend: self.backend,
        };
        let mut environments = std::mem::take(&mut self.environments);
        let episodes = run_episodes(
            &self.runner(),
            &self.model,
            &self.params,
            &inputs,
            self.tools.clone(),
            &mut environments,
            settings,
        );
        self.environments = environments;
        let episodes = episodes?;
        let seconds = vec![clock.elapsed().as_secs_f32(); episodes.len()];
        let started = vec![unix; episodes.len()];
        for (name, value) in episode_metrics(&episodes) {
            ctx.record(name, value);
        }
        let versions = vec![ctx.version; episodes.len()];
        self.with_episodes(batch, &episodes, versions, seconds, started)
    }

    /// `batch` with `episodes` as its response columns (their rows'
    /// prompts as the episodes rewrote them), `versions` their policy versions.
    pub(super) fn with_episodes(
        &self,
        batch: RecordBatch,
        episodes: &[Episode],
        versions: Vec<PolicyVersion>,
        seconds: Vec<f32>,
        started: Vec<f64>,
    ) -> Result<RecordBatch, StageError> {
        let batch = if episodes.iter().any(|e| e.prompt.is_some()) {
            // Prompts an environment's reset rewrote: what the model saw.
            let mut prompts = token_lists(&batch, col::PROMPT_TOKENS, "generate")?;
            for (prompt, episode) in prompts.iter_mut().zip(episodes) {
                if let Some(rewritten) = &episode.prompt {
                    prompt.clone_from(rewritten);
                }
            }
            with_column(&batch, col::PROMPT_TOKENS, token_list_array(&prompts))?
        } else {
            batch
        };
        let mut texts = Vec::with_capacity(episodes.len());
        for episode in episodes {
            let last = episode.generated_by_turn().pop().unwrap_or_default();
            let ids: Vec<i64> = last.iter().map(|&i| episode.tokens[i]).collect();
            texts.push(self.tokenizer.decode(&ids, true)?);
        }
        let calls: Vec<String> = episodes
            .iter()
            .map(|e| {
                let calls: Vec<_> = e
                    .calls
                    .iter()
                    .map(|c| {
                        json!({"turn": c.turn, "tool": c.tool, "arguments": c.arguments,
                               "output": c.output, "ok": c.ok, "seconds": c.seconds})
                    })
                    .collect();
                serde_json::Value::Array(calls).to_string()
            })
            .collect();
        let mut b = crate::stages::generate::with_response_columns(
            batch,
            crate::stages::generate::ResponseColumns {
                texts,
                tokens: episodes.iter().map(|e| e.tokens.clone()).collect(),
                logprobs: nullable_logprobs(episodes),
                sum_pi_squared: self.params.sum_pi_squared.then(|| {
                    episodes
                        .iter()
                        .map(|e| e.sum_pi_squared.iter().map(|x| f64::from(*x)).collect())
                        .collect()
                }),
                versions,
                reasons: episodes.iter().map(|e| e.finish.name()).collect(),
                seconds,
                started,
            },
        )?;
        let kinds: Vec<Option<Vec<TokenKind>>> =
            episodes.iter().map(|e| Some(e.kinds.clone())).collect();
        b = with_column(&b, col::TOKEN_KINDS, token_kinds_array(&kinds))?;
        let turns: Vec<Vec<u32>> = episodes.iter().map(|e| e.turns.clone()).collect();
        b = with_column(&b, col::TOKEN_TURNS, u32_list_array(&turns))?;
        b = with_column(
            &b,
            TOOL_CALLS,
            Arc::new(StringArray::from(calls)) as ArrayRef,
        )?;
        if self.with_environment {
            let rewards: Vec<Vec<f64>> = episodes.iter().map(turn_rewards_on_tokens).collect();
            b = with_column(&b, col::ENV_REWARDS, float_list_array(&rewards))?;
            let errors: StringArray = episodes.iter().map(|e| e.env_error.as_deref()).collect();
            b = with_column(&b, ENV_ERROR, Arc::new(errors) as ArrayRef)?;
        }
        Ok(b)
    }
}

/// What a batch of episodes did, as metrics: turns and tool calls per
/// episode, calls that could not be read, calls that failed and episodes
/// whose environment failed, the share
/// of response tokens the model did not write, the tools' latency (median
/// and 99th percentile) and the seconds episodes spent waiting on tools.
pub(super) fn episode_metrics(episodes: &[Episode]) -> Vec<(&'static str, f64)> {
    if episodes.is_empty() {
        return Vec::new();
    }
    let n = episodes.len() as f64;
    let calls: Vec<_> = episodes.iter().flat_map(|e| &e.calls).collect();
    let unread = calls.iter().filter(|c| c.tool.is_empty()).count();
    let failed = calls.iter().filter(|c| !c.ok).count();
    let (tokens, written) = episodes
        .iter()
        .fold((0, 0), |(t, w), e| (t + e.tokens.len(), w + e.counts().0));
    let mut latency: Vec<f64> = calls.iter().map(|c| c.seconds).collect();
    latency.sort_by(f64::total_cmp);
    let at = |q: f64| {
        latency
            .get(((latency.len() as f64 - 1.0) * q).round() as usize)
            .copied()
            .unwrap_or(0.0)
    };
    vec![
        (
            "turns",
            episodes.iter().map(|e| e.turns_taken as f64).sum::<f64>() / n,
        ),
        ("tool_calls", calls.len() as f64 / n),
        ("tool_parse_failures", unread as f64),
        ("tool_errors", failed as f64),
        (
            "env_errors",
            episodes.iter().filter(|e| e.env_error.is_some()).count() as f64,
        ),
        (
            "observation_share",
            if tokens == 0 {
                0.0
            } else {
                (tokens - written) as f64 / tokens as f64
            },
        ),
        ("tool_latency_p50_s", at(0.5)),
        ("tool_latency_p99_s", at(0.99)),
        ("tool_wait_s", latency.iter().sum()),
        (
            "env_reward",
            episodes
                .iter()
                .map(|e| e.turn_rewards.iter().sum::<f64>())
                .sum::<f64>()
                / n,
        ),
    ]
}

/// An episode's turn rewards as per-token values: each on its turn's last
/// generated token, 0 elsewhere.
fn turn_rewards_on_tokens(episode: &Episode) -> Vec<f64> {
    let mut out = vec![0.0; episode.tokens.len()];
    for (positions, reward) in episode
        .generated_by_turn()
        .iter()
        .zip(&episode.turn_rewards)
    {
        if let Some(&last) = positions.last() {
            out[last] += reward;
        }
    }
    out
}

/// Row `i` of `batch` as a JSON object of its columns (what an
/// environment is reset with).
fn row_json(batch: &RecordBatch, i: usize) -> Result<serde_json::Value, StageError> {
    let mut writer = arrow::json::LineDelimitedWriter::new(Vec::new());
    writer.write(&batch.slice(i, 1))?;
    writer.finish()?;
    Ok(serde_json::from_slice(&writer.into_inner())?)
}

/// Each generated token's log-prob, null on the others.
fn nullable_logprobs(episodes: &[Episode]) -> ArrayRef {
    use arrow::array::{Float32Builder, ListBuilder};
    use arrow::datatypes::{DataType, Field};
    let mut b = ListBuilder::new(Float32Builder::new()).with_field(Arc::new(Field::new(
        "item",
        DataType::Float32,
        true,
    )));
    for e in episodes {
        for lp in &e.logprobs {
            b.values().append_option(*lp);
        }
        b.append(true);
    }
    Arc::new(b.finish())
}

fn tokenizer_folder(tokenizer: &Tokenizer) -> String {
    tokenizer.dir().display().to_string()
}

impl Stage for EpisodeGenerate {
    fn process(
        &mut self,
        ctx: &mut StepContext,
        batch: RecordBatch,
    ) -> Result<Vec<RecordBatch>, StageError> {
        Ok(vec![self.episodes(ctx, batch)?])
    }

    fn load_weights(
        &mut self,
        version: PolicyVersion,
        weights: &WeightsPayload,
    ) -> Result<(), StageError> {
        crate::stages::generate::apply_snapshot(&mut self.model, version, weights)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agent::observe::tests::{tokenizer_with, CHATML_TOOLS};
    use crate::agent::tool_calls::Hermes;
    use crate::agent::tools::{schemas, Calculator};
    use arrow::array::{Array, AsArray, UInt32Array, UInt64Array};
    use weir_graph::WorkerInfo;

    #[test]
    fn with_tools_the_prompt_is_rendered_with_their_schemas_and_written_back() {
        let models =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/models");
        let model = Model::load(
            &models.join("arith-sft"),
            weir_gpu::Device::Cpu,
            tch::Kind::Float,
        )
        .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let tokenizer = tokenizer_with(CHATML_TOOLS, dir.path());
        let end = tokenizer.encode("<|im_end|>", false).unwrap();
        let params = SamplingParams {
            max_new_tokens: 8,
            eos_token_ids: end,
            seed: 1,
            ..Default::default()
        };
        let tools: Vec<Box<dyn Tool>> = vec![Box::new(Calculator)];
        let want = tokenizer
            .encode_conversation(
                &[json!({"role": "user", "content": "3+4="})],
                Some(&schemas(&tools)),
                true,
            )
            .unwrap();
        let budgets = Budgets {
            max_turns: 2,
            max_tokens: 32,
            max_observation_tokens: 8,
        };
        let mut stage =
            EpisodeGenerate::new(model, tokenizer, params, tools, Box::new(Hermes), budgets)
                .unwrap();
        let batch = RecordBatch::try_from_iter([
            (col::PROMPT_TOKENS, token_list_array(&[vec![1, 2, 3]])),
            (
                col::PROMPT,
                Arc::new(StringArray::from(vec!["3+4="])) as ArrayRef,
            ),
            (
                col::GROUP_ID,
                Arc::new(UInt64Array::from(vec![0u64])) as ArrayRef,
            ),
            (
                col::SAMPLE_IDX,
                Arc::new(UInt32Array::from(vec![0u32])) as ArrayRef,
            ),
        ])
        .unwrap();
        let mut ctx = StepContext::detached(0, WorkerInfo::single(), 0);
        let out = stage.process(&mut ctx, batch).unwrap().remove(0);
        let prompts = token_lists(&out, col::PROMPT_TOKENS, "t").unwrap();
        assert_eq!(prompts.len(), 1);
        assert_eq!(prompts[0], want);
        let text = stage.tokenizer.decode(&want, false).unwrap();
        assert!(
            text.contains("You may call these tools") && text.contains("calculator"),
            "{text}"
        );
        // The response columns are there, aligned.
        let tokens = token_lists(&out, col::RESPONSE_TOKENS, "t").unwrap();
        let kinds = out
            .column_by_name(col::TOKEN_KINDS)
            .unwrap()
            .as_list::<i32>();
        assert_eq!(kinds.value(0).len(), tokens[0].len());
        let lp = out
            .column_by_name(col::BEHAVIOR_LOGPROBS)
            .unwrap()
            .as_list::<i32>();
        assert_eq!(lp.value(0).len(), tokens[0].len());
        assert!(ctx.recorded().iter().any(|(name, _)| name == "turns"));
    }

    /// Answers every turn with "again" and 0.25, twice; then done. Checks
    /// it was reset with the row's columns.
    struct Again {
        steps: usize,
    }

    impl Environment for Again {
        fn reset(
            &mut self,
            row: &serde_json::Value,
            _prompt: &str,
        ) -> Result<Option<String>, super::super::environment::EnvFault> {
            assert_eq!(row[col::PROMPT], "3+4=");
            self.steps = 0;
            Ok(None)
        }

        fn step(
            &mut self,
            _action: &str,
        ) -> Result<super::super::environment::EnvStep, super::super::environment::EnvFault>
        {
            self.steps += 1;
            Ok(super::super::environment::EnvStep {
                observation: super::super::environment::Observation::Text(" again\n".into()),
                reward: 0.25,
                done: self.steps == 2,
            })
        }
    }

    #[test]
    fn an_environments_turn_rewards_sit_on_each_turns_last_generated_token() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/models/arith-sft");
        let model = Model::load(&dir, weir_gpu::Device::Cpu, tch::Kind::Float).unwrap();
        let tokenizer = Tokenizer::load(&dir).unwrap();
        let params = SamplingParams {
            max_new_tokens: 8,
            eos_token_ids: tokenizer.eos_token_ids().to_vec(),
            seed: 1,
            ..Default::default()
        };
        let budgets = Budgets {
            max_turns: 4,
            max_tokens: 64,
            max_observation_tokens: 8,
        };
        let mut stage = EpisodeGenerate::new(
            model,
            tokenizer,
            params,
            Vec::new(),
            Box::new(Hermes),
            budgets,
        )
        .unwrap()
        .with_environments(vec![Box::new(Again { steps: 0 })]);
        let prompt = stage
            .tokenizer
            .encode_conversation(&[json!({"role": "user", "content": "3+4="})], None, true)
            .unwrap();
        let batch = RecordBatch::try_from_iter([
            (
                col::PROMPT_TOKENS,
                token_list_array(&[prompt.clone(), prompt]),
            ),
            (
                col::PROMPT,
                Arc::new(StringArray::from(vec!["3+4=", "3+4="])) as ArrayRef,
            ),
            (
                col::GROUP_ID,
                Arc::new(UInt64Array::from(vec![0u64, 0])) as ArrayRef,
            ),
            (
                col::SAMPLE_IDX,
                Arc::new(UInt32Array::from(vec![0u32, 1])) as ArrayRef,
            ),
        ])
        .unwrap();
        let mut ctx = StepContext::detached(0, WorkerInfo::single(), 0);
        let out = stage.process(&mut ctx, batch).unwrap().remove(0);
        let rewards = crate::data::columns::float_lists(&out, col::ENV_REWARDS, "t").unwrap();
        let kinds = out
            .column_by_name(col::TOKEN_KINDS)
            .unwrap()
            .as_list::<i32>();
        let reasons = out
            .column_by_name(col::FINISH_REASON)
            .unwrap()
            .as_string::<i32>();
        assert!((0..out.num_rows()).any(|row| reasons.value(row) == "stop"));
        // What a reward reads is the model's last turn, never the
        // environment's words (verl#6392 scored tool output as the model's).
        let responses = out
            .column_by_name(col::RESPONSE)
            .unwrap()
            .as_string::<i32>();
        let tokens = token_lists(&out, col::RESPONSE_TOKENS, "t").unwrap();
        for (row, row_tokens) in tokens.iter().enumerate() {
            let k = kinds.value(row);
            let k = k.as_primitive::<arrow::datatypes::UInt8Type>().values();
            let last_turn: Vec<i64> = (0..k.len())
                .rev()
                .take_while(|&i| k[i] == TokenKind::Generated as u8)
                .map(|i| row_tokens[i])
                .collect::<Vec<_>>()
                .into_iter()
                .rev()
                .collect();
            let want = stage.tokenizer.decode(&last_turn, true).unwrap();
            assert_eq!(responses.value(row), want);
            assert!(!responses.value(row).contains("again"), "row {row}");
        }
        for (row, r) in rewards.iter().enumerate() {
            let k = kinds.value(row);
            let k = k
                .as_primitive::<arrow::datatypes::UInt8Type>()
                .values()
                .to_vec();
            // Each placed reward sits on a generated token followed by an
            // observation or the end: the last of its turn.
            let placed: Vec<usize> = (0..r.len()).filter(|&i| r[i] != 0.0).collect();
            for &i in &placed {
                assert_eq!(k[i], TokenKind::Generated as u8);
                assert!(i + 1 == k.len() || k[i + 1] == TokenKind::Observation as u8);
                assert_eq!(r[i], 0.25);
            }
            // Two turns when neither was cut by its budget.
            if reasons.value(row) == "stop" {
                assert_eq!(placed.len(), 2, "row {row}: {r:?}");
            }
        }
    }
}
