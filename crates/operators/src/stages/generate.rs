//! The actor's two generator stages. Each samples one response per row
//! (the source already expanded prompts × n), writes the response columns,
//! and loads new weights from the weights edge (safetensors snapshots).
//!
//! [`Generate`], batch by batch (the default): a batch is generated in one
//! call and leaves whole, and new weights load between calls.
//! [`StreamingGenerate`] (`generate.max_inflight` > 0, made by
//! [`Generate::streamed`]): the rows join a [`Streamer`]'s pool of
//! sequences that advances one token per pass across batches and steps; a
//! group's rows leave together as soon as its last sample ends, and new
//! weights are applied between two passes under `generate.on_new_weights`.
//! Each row records the version of every token.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use arrow::array::AsArray;
use arrow::array::{ArrayRef, Float32Array, Float64Array, RecordBatch, StringArray, UInt64Array};
use weir_gpu::{
    generate_on, Backend, Generation, Model, OnNewWeights, Request, SamplingParams, Streamer,
    Tokenizer,
};
use weir_graph::batch::with_column;
use weir_graph::weights_edge::now_unix_s;
use weir_graph::{
    PolicyVersion, RunSteps, Stage, StageError, StepContext, StepFill, WeightsPayload,
};

use crate::data::columns::{
    bool_list_array, float_list_array, token_list_array, token_lists, u32_list_array, u32s, u64s,
};
use crate::rollout::col;

#[path = "generate_stream.rs"]
mod stream;
pub(crate) use stream::GroupRows;
use stream::StreamState;
pub use stream::StreamingGenerate;

/// The actor's batch generator, and the sampling core of the streaming one.
pub struct Generate {
    model: Model,
    tokenizer: Tokenizer,
    params: SamplingParams,
    /// The long-tail workload's Pareto shape (`generate.long_tail`).
    tail: Option<f64>,
    /// Which runtime decodes (`generate.backend`).
    backend: Backend,
}

/// Settings of streaming generation, for rows and for episodes alike.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Streaming {
    /// Sequences in flight at most.
    pub max_inflight: usize,
    /// What in-flight sequences do when new weights arrive.
    pub on_new_weights: OnNewWeights,
}

impl Generate {
    /// Generates with `model` and `params` (n is taken from the rows: one response per row).
    pub fn new(model: Model, tokenizer: Tokenizer, params: SamplingParams) -> Self {
        Generate {
            model,
            tokenizer,
            params: SamplingParams { n: 1, ..params },
            tail: None,
            backend: Backend::Auto,
        }
    }

    /// Decodes with `backend` (`Backend::Torch`: libtorch ops even where
    /// weir's CPU kernels apply, i.e. the path a GPU runs). Call before
    /// [`Generate::streamed`].
    pub fn with_backend(mut self, backend: Backend) -> Self {
        self.backend = backend;
        self
    }

    /// A long-tail workload (`generate.long_tail`): each row gets its own
    /// token budget, drawn from a Pareto distribution of shape `alpha`
    /// between `max_new_tokens / 64` and `max_new_tokens` (seeded by the
    /// row's stream), and ignores eos ids, so response lengths spread over
    /// up to 64× within a step as reasoning traces do. Call before
    /// [`Generate::streamed`].
    pub fn with_long_tail(mut self, alpha: f64) -> Self {
        self.tail = Some(alpha);
        self
    }

    /// The sampling parameters of training rows: the long-tail workload ignores eos ids.
    fn workload_params(&self) -> SamplingParams {
        SamplingParams {
            ignore_eos: self.params.ignore_eos || self.tail.is_some(),
            ..self.params.clone()
        }
    }

    /// A row's token budget under the long-tail workload.
    fn budget(&self, stream: u64) -> Option<usize> {
        let alpha = self.tail?;
        let max = self.params.max_new_tokens;
        let low = max.div_ceil(64).max(1) as f64;
        // A uniform in (0, 1] from (seed, stream): splitmix64.
        let mut z = (self.params.seed ^ stream.wrapping_mul(0x9e37_79b9_7f4a_7c15))
            .wrapping_add(0x9e37_79b9_7f4a_7c15);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        let u = ((z >> 11) as f64 + 1.0) / (1u64 << 53) as f64;
        let length = (low * u.powf(-1.0 / alpha)).floor();
        Some((length as usize).clamp(low as usize, max))
    }

    /// A streaming generator instead: rows join a pool of
    /// `settings.max_inflight` sequences; the model holds policy `version`.
    /// A group that starts under version `v` may join any step up to
    /// `v + k` of the run's `steps` as it finishes ([`StepFill`]), never
    /// across a commit point.
    pub fn streamed(
        self,
        settings: Streaming,
        steps: RunSteps,
        version: PolicyVersion,
    ) -> Result<StreamingGenerate, StageError> {
        let streamer = Streamer::new(
            &self.model,
            self.workload_params(),
            settings.max_inflight,
            settings.on_new_weights,
            version_u32(version)?,
            self.backend,
        )?;
        let state = StreamState {
            streamer,
            fill: StepFill::for_run(steps),
            batches: BTreeMap::new(),
            next_batch: 0,
            held: None,
            figures: BTreeMap::new(),
            applies: Vec::new(),
            hold: stream::Hold::off(steps.last),
        };
        Ok(StreamingGenerate { core: self, state })
    }
}

/// `version` as the runtime's `u32`, refused past it.
pub(crate) fn version_u32(version: PolicyVersion) -> Result<u32, StageError> {
    u32::try_from(version)
        .map_err(|_| format!("generate: policy version {version} exceeds u32").into())
}

impl Generate {
    /// Samples with `params` from now on (n is still one response per row).
    pub fn set_params(&mut self, params: SamplingParams) {
        self.params = SamplingParams { n: 1, ..params };
    }
}

impl Generate {
    /// One generation per row: with the sampling parameters, or greedily
    /// for rows marked `greedy_baseline` (ReMax's baseline responses).
    fn generate_rows(
        &self,
        batch: &RecordBatch,
        prompts: &[Vec<i64>],
        streams: &[u64],
    ) -> Result<Vec<Generation>, StageError> {
        if batch.column_by_name(col::GREEDY_BASELINE).is_none() {
            return Ok(generate_on(
                &self.model,
                prompts,
                streams,
                &self.params,
                self.backend,
            )?);
        }
        let greedy = greedy_flags(batch)?;
        let greedy_params = SamplingParams {
            greedy: true,
            ..self.params.clone()
        };
        let mut out: Vec<Option<Generation>> = vec![None; prompts.len()];
        for (want, params) in [(false, &self.params), (true, &greedy_params)] {
            let idx: Vec<usize> = (0..prompts.len()).filter(|&i| greedy[i] == want).collect();
            if idx.is_empty() {
                continue;
            }
            let p: Vec<Vec<i64>> = idx.iter().map(|&i| prompts[i].clone()).collect();
            let s: Vec<u64> = idx.iter().map(|&i| streams[i]).collect();
            for (i, g) in
                idx.into_iter()
                    .zip(generate_on(&self.model, &p, &s, params, self.backend)?)
            {
                out[i] = Some(g);
            }
        }
        Ok(out.into_iter().flatten().collect())
    }
}

/// The response columns of `batch`'s rows: tokens, texts, behaviour
/// log-probs, per-token versions and recompute marks, the oldest token's
/// version as `policy_version`, finish reasons and seconds.
struct Responses<'a> {
    generations: Vec<&'a Generation>,
    versions: Vec<Vec<u32>>,
    recomputed: Vec<Vec<bool>>,
    /// A row without tokens is of this version.
    version: PolicyVersion,
    seconds: Vec<f32>,
    /// When each row started, seconds since the Unix epoch.
    started: Vec<f64>,
}

impl Generate {
    /// One request per row of `batch`, keyed `first_key + row`.
    fn requests(
        &self,
        batch: &RecordBatch,
        prompts: Vec<Vec<i64>>,
        streams: &[u64],
        first_key: u64,
    ) -> Result<Vec<Request>, StageError> {
        let greedy = greedy_flags(batch)?;
        Ok(prompts
            .into_iter()
            .zip(streams)
            .zip(greedy)
            .enumerate()
            .map(|(row, ((prompt, &stream), greedy))| Request {
                key: first_key + row as u64,
                prompt,
                stream,
                greedy,
                max_new_tokens: self.budget(stream),
            })
            .collect())
    }

    /// The long-tail workload batch by batch: the whole batch in one pool
    /// (no refill), each row to its own budget; it ends with its longest row.
    fn generate_with_budgets(
        &self,
        batch: &RecordBatch,
        prompts: &[Vec<i64>],
        streams: &[u64],
    ) -> Result<Vec<Generation>, StageError> {
        let requests = self.requests(batch, prompts.to_vec(), streams, 0)?;
        let pool = requests.len().max(1);
        let mut streamer = Streamer::new(
            &self.model,
            self.workload_params(),
            pool,
            OnNewWeights::Finish,
            0,
            self.backend,
        )?;
        streamer.submit(&self.model, requests)?;
        let mut out: Vec<Option<Generation>> = vec![None; prompts.len()];
        while !streamer.is_idle() {
            for f in streamer.advance(&self.model)? {
                out[f.key as usize] = Some(f.generation);
            }
        }
        Ok(out
            .into_iter()
            .map(|g| g.expect("every row ends"))
            .collect())
    }
}

/// `batch` with the response columns of `r`.
/// The response columns every generator writes, row by row.
pub(crate) struct ResponseColumns<'a> {
    pub texts: Vec<String>,
    pub tokens: Vec<Vec<i64>>,
    /// `behavior_logprobs`, built by the generator (an episode's hold nulls).
    pub logprobs: ArrayRef,
    /// `sum_pi_squared`, where the sampler recorded it.
    pub sum_pi_squared: Option<Vec<Vec<f64>>>,
    /// `policy_version`.
    pub versions: Vec<u64>,
    pub reasons: Vec<&'a str>,
    pub seconds: Vec<f32>,
    pub started: Vec<f64>,
}

/// `batch` with `columns` as its response, version, finish and timing columns.
pub(crate) fn with_response_columns(
    batch: RecordBatch,
    columns: ResponseColumns,
) -> Result<RecordBatch, StageError> {
    let mut b = with_column(
        &batch,
        col::RESPONSE,
        Arc::new(StringArray::from(columns.texts)) as ArrayRef,
    )?;
    b = with_column(&b, col::RESPONSE_TOKENS, token_list_array(&columns.tokens))?;
    b = with_column(&b, col::BEHAVIOR_LOGPROBS, columns.logprobs)?;
    if let Some(squares) = &columns.sum_pi_squared {
        b = with_column(&b, col::SUM_PI_SQUARED, float_list_array(squares))?;
    }
    let rows: [(&str, ArrayRef); 4] = [
        (
            col::POLICY_VERSION,
            Arc::new(UInt64Array::from(columns.versions)),
        ),
        (
            col::FINISH_REASON,
            Arc::new(StringArray::from(columns.reasons)),
        ),
        (
            col::GENERATE_S,
            Arc::new(Float32Array::from(columns.seconds)),
        ),
        (
            col::STARTED_UNIX_S,
            Arc::new(Float64Array::from(columns.started)),
        ),
    ];
    for (name, column) in rows {
        b = with_column(&b, name, column)?;
    }
    Ok(b)
}

fn with_responses(
    tokenizer: &Tokenizer,
    batch: RecordBatch,
    r: Responses,
) -> Result<RecordBatch, StageError> {
    {
        let out = &r.generations;
        let tokens: Vec<Vec<i64>> = out.iter().map(|g| g.tokens.clone()).collect();
        let logprobs: Vec<Vec<f64>> = out
            .iter()
            .map(|g| g.logprobs.iter().map(|x| f64::from(*x)).collect())
            .collect();
        let texts: Vec<String> = out
            .iter()
            .map(|g| tokenizer.decode(&g.tokens, true))
            .collect::<Result<_, _>>()?;
        // Recorded for every token of every row, or for none.
        let squares = out.iter().all(|g| g.sum_pi_squared.len() == g.tokens.len())
            && out.iter().any(|g| !g.sum_pi_squared.is_empty());
        let reasons: Vec<&str> = out.iter().map(|g| g.finish_reason.as_str()).collect();
        let oldest: Vec<u64> = r
            .versions
            .iter()
            .map(|v| v.iter().min().map_or(r.version, |&m| u64::from(m)))
            .collect();
        let mut b = with_response_columns(
            batch,
            ResponseColumns {
                texts,
                tokens,
                logprobs: float_list_array(&logprobs),
                sum_pi_squared: squares.then(|| {
                    out.iter()
                        .map(|g| g.sum_pi_squared.iter().map(|x| f64::from(*x)).collect())
                        .collect()
                }),
                versions: oldest,
                reasons,
                seconds: r.seconds,
                started: r.started,
            },
        )?;
        b = with_column(&b, col::TOKEN_VERSIONS, u32_list_array(&r.versions))?;
        b = with_column(&b, col::KV_RECOMPUTED, bool_list_array(&r.recomputed))?;
        Ok(b)
    }
}

impl Generate {
    /// Generates `batch` now, in one call, whatever the mode, with the
    /// sampling parameters alone (the evaluation: no long-tail budgets).
    pub fn generate_now(
        &self,
        ctx: &StepContext,
        batch: RecordBatch,
    ) -> Result<RecordBatch, StageError> {
        self.generate_batch(ctx, batch, false)
    }

    /// The batch-by-batch path (`workload`: with the long-tail budgets).
    fn generate_batch(
        &self,
        ctx: &StepContext,
        batch: RecordBatch,
        workload: bool,
    ) -> Result<RecordBatch, StageError> {
        let name = ctx.stage();
        let prompts = token_lists(&batch, col::PROMPT_TOKENS, name)?;
        let streams = row_streams(&batch, name)?;
        let (started, started_unix) = (Instant::now(), now_unix_s());
        let out = if workload && self.tail.is_some() {
            self.generate_with_budgets(&batch, &prompts, &streams)?
        } else {
            self.generate_rows(&batch, &prompts, &streams)?
        };
        let seconds = started.elapsed().as_secs_f64() as f32;
        let version = version_u32(ctx.version)?;
        let n = batch.num_rows();
        with_responses(
            &self.tokenizer,
            batch,
            Responses {
                versions: out.iter().map(|g| vec![version; g.tokens.len()]).collect(),
                recomputed: out.iter().map(|g| vec![false; g.tokens.len()]).collect(),
                generations: out.iter().collect(),
                version: ctx.version,
                seconds: vec![seconds; n],
                started: vec![started_unix; n],
            },
        )
    }

    /// Applies a snapshot to the model.
    fn apply(
        &mut self,
        version: PolicyVersion,
        weights: &WeightsPayload,
    ) -> Result<(), StageError> {
        apply_snapshot(&mut self.model, version, weights)
    }
}

/// Applies the weights edge's snapshot of `version` to a generator's `model`.
pub(crate) fn apply_snapshot(
    model: &mut Model,
    version: PolicyVersion,
    weights: &WeightsPayload,
) -> Result<(), StageError> {
    let got = model.apply_snapshot(weights.bytes())?;
    if got != version {
        return Err(format!("weights edge says version {version}, the snapshot says {got}").into());
    }
    Ok(())
}

/// A row's random stream depends only on its group and sample: reproducible under any batching.
pub(crate) fn row_streams(batch: &RecordBatch, name: &str) -> Result<Vec<u64>, StageError> {
    let groups = u64s(batch, col::GROUP_ID, name)?;
    let samples = u32s(batch, col::SAMPLE_IDX, name)?;
    Ok(groups
        .iter()
        .zip(&samples)
        .map(|(g, s)| (g << 16) ^ u64::from(*s))
        .collect())
}

/// Rows per-row greedy flags (ReMax's baseline rows), all false without the column.
fn greedy_flags(batch: &RecordBatch) -> Result<Vec<bool>, StageError> {
    match batch.column_by_name(col::GREEDY_BASELINE) {
        None => Ok(vec![false; batch.num_rows()]),
        Some(c) => Ok(c
            .as_boolean_opt()
            .ok_or_else(|| format!("generate: column `{}` is not bool", col::GREEDY_BASELINE))?
            .iter()
            .map(|v| v.unwrap_or(false))
            .collect()),
    }
}

impl Stage for Generate {
    fn process(
        &mut self,
        ctx: &mut StepContext,
        batch: RecordBatch,
    ) -> Result<Vec<RecordBatch>, StageError> {
        Ok(vec![self.generate_batch(ctx, batch, true)?])
    }

    fn end_step(&mut self, ctx: &mut StepContext) -> Result<Vec<RecordBatch>, StageError> {
        // The next step brings new weights (or this one's are stale by
        // then): the packing would only sit beside the learner's update,
        // and so would the weights, once no later step can use them.
        let freed = ctx.weights_retired() && self.model.free_weights_until_snapshot();
        if !freed {
            self.model.release_cpu_packing();
        }
        Ok(Vec::new())
    }

    fn load_weights(
        &mut self,
        version: PolicyVersion,
        weights: &WeightsPayload,
    ) -> Result<(), StageError> {
        self.apply(version, weights)
    }
}

/// A generator stage, batch ([`Generate`]) or streaming
/// ([`StreamingGenerate`]), and the batch generator at its core, which an
/// evaluation samples with between steps.
pub trait Generator: Stage {
    /// The batch generator this stage samples with.
    fn generate(&mut self) -> &mut Generate;
}

impl Generator for Generate {
    fn generate(&mut self) -> &mut Generate {
        self
    }
}
