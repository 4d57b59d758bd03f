//! The critic: `Critic` writes per-token values before the advantage
//! stage; `CriticLearner`, after it, fits the values to the returns with the
//! clipped value loss. They share one model per worker through a
//! [`PerWorker`] handle, so both must run on the same workers (`Local` edges).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use arrow::array::RecordBatch;

use tch::{Device, Kind, Tensor};
use weir_gpu::collective::GroupMember;
use weir_gpu::optim::{AdamWConfig, Optimizer};
use weir_gpu::Model;
use weir_graph::batch::with_column;
use weir_graph::{Stage, StageError, StepBuffer, StepContext, StepStage, WorkerInfo};

use crate::algorithms::{value_loss_in_step, Aggregation, Flavor};
use crate::checkpoint::Checkpointer;
use crate::data::columns::{float_list_array, float_lists, token_lists};
use crate::error::OperatorError;
use crate::rollout::col;
use crate::training::sequences::{checked_pad, pack_flat, pack_for};
use crate::training::train_step::{step_scale_counted, HeldModel, LrSchedule, TrainerCore};

type Maker<T> = Box<dyn Fn(&WorkerInfo) -> Result<T, StageError> + Send + Sync>;

/// One `T` per worker, made on first use and shared by the stages of a pipeline that ask for it.
pub struct PerWorker<T> {
    cells: Mutex<HashMap<usize, Arc<Mutex<T>>>>,
    make: Maker<T>,
}

impl<T: Send> PerWorker<T> {
    /// A handle that makes each worker's `T` with `make`.
    pub fn new(
        make: impl Fn(&WorkerInfo) -> Result<T, StageError> + Send + Sync + 'static,
    ) -> Arc<Self> {
        Arc::new(PerWorker {
            cells: Mutex::new(HashMap::new()),
            make: Box::new(make),
        })
    }

    /// This worker's `T`, made on first use.
    fn get(&self, worker: &WorkerInfo) -> Result<Arc<Mutex<T>>, StageError> {
        let mut cells = self
            .cells
            .lock()
            .map_err(|_| "a critic stage panicked while holding the model")?;
        if let Some(cell) = cells.get(&worker.index) {
            return Ok(cell.clone());
        }
        let cell = Arc::new(Mutex::new((self.make)(worker)?));
        cells.insert(worker.index, cell.clone());
        Ok(cell)
    }
}

/// Value of each response token `t`: the critic's output at the position
/// before it (the state in which token `t` was chosen), `[B, R]`, and the
/// mask of real tokens. With `packed`, the rows run as one sequence
/// without padding ([`pack_flat`]).
fn response_values(
    model: &Model,
    prompts: &[Vec<i64>],
    responses: &[Vec<i64>],
    packed: bool,
) -> Result<(Tensor, Tensor), StageError> {
    if packed {
        let pad = checked_pad(model, prompts, responses)?;
        let flat = pack_flat(prompts, responses, pad, model.device());
        let scores = model
            .position_scores_packed(&flat.ids, &flat.layout)?
            .select(2, 0)
            .to_kind(Kind::Float)
            .squeeze_dim(0);
        let (b, r) = (flat.index.size()[0], flat.index.size()[1]);
        let values = scores.index_select(0, &flat.index.view([-1])).view([b, r]);
        return Ok((values, flat.response_mask));
    }
    let packed = pack_for(model, prompts, responses)?;
    let scores = model
        .position_scores(&packed.ids, None)?
        .select(2, 0)
        .to_kind(Kind::Float);
    Ok((scores.gather(1, &packed.index, false), packed.response_mask))
}

fn rows_of(t: &Tensor, lengths: &[usize]) -> Result<Vec<Vec<f64>>, StageError> {
    let t = t.to_kind(Kind::Double);
    lengths
        .iter()
        .enumerate()
        .map(|(i, n)| {
            Vec::<f64>::try_from(t.get(i as i64).narrow(0, 0, *n as i64))
                .map_err(|e| e.to_string().into())
        })
        .collect()
}

/// Writes `values` with this worker's critic.
pub struct Critic {
    model: Arc<Mutex<Model>>,
    packed: bool,
}

impl Critic {
    /// The value stage on `worker`, making the worker's critic if needed.
    pub fn new(handle: &PerWorker<Model>, worker: &WorkerInfo) -> Result<Self, StageError> {
        Ok(Critic {
            model: handle.get(worker)?,
            packed: false,
        })
    }

    /// Runs a batch's rows as one sequence without padding (`algorithm.packing`).
    pub fn with_packing(mut self, packed: bool) -> Self {
        self.packed = packed;
        self
    }
}

impl Stage for Critic {
    fn process(
        &mut self,
        ctx: &mut StepContext,
        batch: RecordBatch,
    ) -> Result<Vec<RecordBatch>, StageError> {
        let prompts = token_lists(&batch, col::PROMPT_TOKENS, ctx.stage())?;
        let responses = token_lists(&batch, col::RESPONSE_TOKENS, ctx.stage())?;
        let _guard = tch::no_grad_guard();
        let model = self.model.hold()?;
        let (values, _) = response_values(&model, &prompts, &responses, self.packed)?;
        let lengths: Vec<usize> = responses.iter().map(Vec::len).collect();
        Ok(vec![with_column(
            &batch,
            col::VALUES,
            float_list_array(&rows_of(&values, &lengths)?),
        )?])
    }
}

/// Fits this worker's critic to the step's returns, on the trainers' core
/// with the model it shares with the [`Critic`] stage.
pub struct CriticLearner {
    core: TrainerCore<Arc<Mutex<Model>>>,
    clip: Option<f64>,
    held: StepBuffer,
    aggregation: Aggregation,
    flavor: Flavor,
    epochs: usize,
    mini_batches: usize,
    packed: bool,
    /// The last step's value loss.
    pub last_loss: f64,
}

impl CriticLearner {
    /// The critic's learner on `worker` (where a [`Critic`] stage must run too).
    pub fn new(
        handle: &PerWorker<Model>,
        worker: &WorkerInfo,
        adamw: AdamWConfig,
        clip: Option<f64>,
        max_grad_norm: Option<f64>,
    ) -> Result<Self, StageError> {
        let schedule = LrSchedule::Constant { warmup: 0 };
        Ok(CriticLearner {
            core: TrainerCore::new(handle.get(worker)?, adamw, schedule, max_grad_norm)?,
            clip,
            held: super::rows_in_order(),
            aggregation: Aggregation::TokenMean,
            flavor: Flavor::OpenRlhf,
            epochs: 1,
            mini_batches: 1,
            packed: false,
            last_loss: f64::NAN,
        })
    }

    /// One data-parallel rank of the critic's fit: each mini-batch's loss
    /// is normalised over every rank's rows and the gradients are summed
    /// before each optimizer step, so the ranks' critics stay equal (they
    /// start from rank 0's weights); rank 0 records and checkpoints. Every
    /// rank calls this together. Must run offloaded.
    pub fn with_data_parallel(mut self, member: GroupMember) -> Result<Self, StageError> {
        self.core.join_data_parallel(member)?;
        Ok(self)
    }

    /// Aggregates the value loss with `flavor`'s semantics
    /// ([`crate::algorithms::value_loss`]; the default: token mean, OpenRLHF):
    /// verl's critic aggregates as the actor does (`aggregation`, its
    /// `loss_agg_mode`); OpenRLHF's always takes a token mean (its `ValueLoss`).
    pub fn with_loss(mut self, aggregation: Aggregation, flavor: Flavor) -> Self {
        (self.aggregation, self.flavor) = (flavor.term_aggregation(aggregation), flavor);
        self
    }

    /// The learning-rate schedule over the critic's optimizer steps, on its
    /// own base rate (OpenRLHF schedules its critic as its actor, each with
    /// its own rate); the step count is the optimizer's, restored on resume.
    pub fn with_schedule(mut self, schedule: LrSchedule) -> Self {
        self.core.set_schedule(schedule);
        self
    }

    /// Optimizer steps over each step's rows (as the actor's `ppo_epochs`:
    /// OpenRLHF's `max_epochs` and verl's critic `ppo_epochs`); the value
    /// clip acts from the second on, once the values have moved from the
    /// old ones.
    pub fn with_epochs(mut self, epochs: usize) -> Self {
        self.epochs = epochs.max(1);
        self
    }

    /// Optimizer steps per pass: the step's rows in this many mini-batches,
    /// as the actor's learner takes them.
    pub fn with_mini_batches(mut self, mini_batches: usize) -> Self {
        self.mini_batches = mini_batches.max(1);
        self
    }

    /// Runs each mini-batch's rows as one sequence without padding (`algorithm.packing`).
    pub fn with_packing(mut self, packed: bool) -> Self {
        self.packed = packed;
        self
    }

    /// Saves the critic (and its optimizer) as the `critic` component of due checkpoints.
    pub fn with_checkpoints(mut self, checkpointer: Checkpointer) -> Self {
        self.core.save_as_component(checkpointer, "critic");
        self
    }

    /// The optimizer (to restore its state on resume).
    pub fn optimizer_mut(&mut self) -> &mut Optimizer {
        self.core.optimizer_mut()
    }
}

/// `rows` of floats as a `[rows, width]` tensor on `device`, zero-padded.
fn padded(rows: &[Vec<f64>], width: usize, device: Device) -> Tensor {
    let flat: Vec<f32> = rows
        .iter()
        .flat_map(|r| {
            r.iter()
                .map(|x| *x as f32)
                .chain(std::iter::repeat_n(0.0, width - r.len()))
        })
        .collect();
    Tensor::from_slice(&flat)
        .view([rows.len() as i64, width as i64])
        .to_device(device)
}

impl StepStage for CriticLearner {
    fn buffer(&mut self) -> &mut StepBuffer {
        &mut self.held
    }

    fn run_step(
        &mut self,
        ctx: &mut StepContext,
        rows: Option<RecordBatch>,
    ) -> Result<Vec<RecordBatch>, StageError> {
        if !self.core.runs(rows.is_some()) {
            return Ok(Vec::new());
        }
        // A rank with no rows still joins every mini-batch's sums.
        let (prompts, responses, old, returns) = match &rows {
            Some(batch) => (
                token_lists(batch, col::PROMPT_TOKENS, "critic learner")?,
                token_lists(batch, col::RESPONSE_TOKENS, "critic learner")?,
                float_lists(batch, col::VALUES, "critic learner")?,
                float_lists(batch, col::RETURNS, "critic learner")?,
            ),
            None => Default::default(),
        };
        // The value loss, like the policy's, sees generated tokens only.
        let lengths: Vec<usize> = responses.iter().map(Vec::len).collect();
        let generated = match &rows {
            Some(batch) => {
                crate::data::columns::generated_masks(batch, &lengths, "critic learner")?
            }
            None => Vec::new(),
        };
        let (n, minis) = (prompts.len(), self.mini_batches);
        let (clip, aggregation, flavor, packed) =
            (self.clip, self.aggregation, self.flavor, self.packed);
        let (mut loss_sum, mut clip_fraction) = (0.0, 0.0);
        for _epoch in 0..self.epochs {
            (loss_sum, clip_fraction) = (0.0, 0.0);
            for k in 0..minis {
                let (lo, hi) = (k * n / minis, (k + 1) * n / minis);
                let counted = crate::data::columns::generated_counts(&generated[lo..hi]);
                let scale = step_scale_counted(
                    self.core.member(),
                    counted.into_iter().zip(lengths[lo..hi].iter().copied()),
                    None,
                )?;
                if scale.sequences == 0.0 {
                    // Empty on every rank.
                    continue;
                }
                // [loss, clipped tokens], summed over the ranks.
                let mut stats = [0.0, 0.0];
                self.core
                    .step(&mut stats, |model, stats| {
                        if lo == hi {
                            return Ok(());
                        }
                        let (values, real) =
                            response_values(model, &prompts[lo..hi], &responses[lo..hi], packed)?;
                        let (width, device) = (values.size()[1] as usize, model.device());
                        let mask = real * padded(&generated[lo..hi], width, device);
                        let (loss, clipped) = value_loss_in_step(
                            &values,
                            &padded(&old[lo..hi], width, device),
                            &padded(&returns[lo..hi], width, device),
                            &mask,
                            clip,
                            aggregation,
                            flavor,
                            &scale,
                        );
                        loss.backward();
                        stats[0] += loss.double_value(&[]);
                        stats[1] += clipped;
                        Ok(())
                    })
                    .map_err(|e| OperatorError::step(ctx.step, format!("the critic's fit: {e}")))?;
                loss_sum += stats[0] / minis as f64;
                if scale.tokens > 0.0 {
                    clip_fraction += stats[1] / scale.tokens / minis as f64;
                }
            }
        }
        self.last_loss = loss_sum;
        if self.core.leads() {
            ctx.record("value_loss", self.last_loss);
            ctx.record("value_clip_fraction", clip_fraction);
            ctx.record("lr", self.core.optimizer().lr());
        }
        self.core.save_if_due(ctx.step, ctx.version)?;
        Ok(rows.into_iter().collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::columns::{token_kinds_array, token_list_array};
    use crate::rollout::TokenKind::{Generated, Observation};

    /// Packed (a shared prompt once, no padding), the critic's values are
    /// the padded pass's.
    #[test]
    fn packed_values_are_the_padded_ones() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/models/tiny-llama-rm");
        let model = Model::load_critic(&dir, weir_gpu::Device::Cpu, Kind::Double).unwrap();
        let prompts = vec![vec![1i64, 2, 3], vec![1, 2, 3], vec![4], vec![1, 2, 3]];
        let responses = vec![vec![5i64, 6], vec![7, 8, 9, 10, 11], vec![12], vec![]];
        let (padded, mask) = response_values(&model, &prompts, &responses, false).unwrap();
        let (packed, packed_mask) = response_values(&model, &prompts, &responses, true).unwrap();
        assert_eq!(mask, packed_mask);
        let d = ((&padded - &packed) * &mask).abs().max().double_value(&[]);
        assert!(d < 1e-6, "{d:e}");
        assert!(padded.abs().sum(Kind::Double).double_value(&[]) > 0.0);
    }

    /// The critic's value loss after one fit on two rows; row 0's middle
    /// token is an observation when `kinds`, and its return is `observed`.
    fn fit(observed: f64, kinds: bool) -> (f64, Vec<(String, Tensor)>) {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/models/tiny-llama-rm");
        let handle = PerWorker::new(move |_| {
            Ok(Model::load_critic(
                &dir,
                weir_gpu::Device::Cpu,
                Kind::Float,
            )?)
        });
        let worker = WorkerInfo::single();
        let adamw = AdamWConfig {
            lr: 1e-2,
            ..Default::default()
        };
        let mut learner = CriticLearner::new(&handle, &worker, adamw, Some(0.5), None).unwrap();
        let mut columns = vec![
            (col::PROMPT_TOKENS, token_list_array(&[vec![1, 2], vec![3]])),
            (
                col::RESPONSE_TOKENS,
                token_list_array(&[vec![5, 6, 7], vec![8, 9]]),
            ),
            (
                col::VALUES,
                float_list_array(&[vec![0.1, 0.2, 0.3], vec![0.0, 0.5]]),
            ),
            (
                col::RETURNS,
                float_list_array(&[vec![1.0, observed, 1.0], vec![0.5, 0.5]]),
            ),
        ];
        if kinds {
            let kinds = token_kinds_array(&[Some(vec![Generated, Observation, Generated]), None]);
            columns.push((col::TOKEN_KINDS, kinds));
        }
        let batch = RecordBatch::try_from_iter(columns).unwrap();
        let mut ctx = StepContext::detached(0, worker, 0);
        assert!(learner.process(&mut ctx, batch).unwrap().is_empty());
        learner.end_step(&mut ctx).unwrap();
        let model = handle.get(&worker).unwrap();
        let weights = model.lock().unwrap().named_tensors();
        (learner.last_loss, weights)
    }

    #[test]
    fn the_value_loss_sees_an_episodes_generated_tokens_only() {
        let (loss, weights) = fit(1.0, true);
        let (scrambled, scrambled_weights) = fit(-50.0, true);
        assert_eq!(loss, scrambled);
        for ((name, a), (_, b)) in weights.iter().zip(&scrambled_weights) {
            assert!(a.equal(b), "{name} moved with an observation's return");
        }
        // Without the kinds, that return is fitted like any other.
        let (every, _) = fit(-50.0, false);
        assert!((every - loss).abs() > 1e-3, "{every} vs {loss}");
    }
}
