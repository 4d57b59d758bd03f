//! Engine benchmarks (criterion, plus derived figures printed at the end):
//! - steps/s of an empty cyclic pipeline (source → generate → learn with the
//!   weights edge), on 1 worker and on 2 workers (generate and learn apart);
//! - per-hop overhead: a chain of 9 pass-through stages against a chain of 1,
//!   (t9 − t1) / 8 per step;
//! - the overlap check: the engine simulation with G = 40 ms generation and
//!   T = 20 ms training on separate workers, steps/s at k = 1 over k = 0,
//!   against the target 0.9 × (G + T) / max(G, T) = 1.35.
//!
//! `cargo bench --bench engine`. Under `cargo test` (no `--bench`) each part runs once, briefly.

use std::time::{Duration, Instant};

use arrow::array::{ArrayRef, RecordBatch, UInt64Array};
use criterion::{criterion_group, Criterion};
use weir::graph::{
    Execution, Partition, Pipeline, Placement, PolicyVersion, RunSettings, Source, SourceContext,
    Stage, StageError, StepContext, WeightsPayload,
};

/// One row per step.
struct OneRow;

impl Source for OneRow {
    fn next_step(&mut self, ctx: &SourceContext) -> Result<Option<Vec<RecordBatch>>, StageError> {
        let rows = RecordBatch::try_from_iter([(
            "row_id",
            std::sync::Arc::new(UInt64Array::from(vec![ctx.step])) as ArrayRef,
        )])?;
        Ok(Some(vec![rows]))
    }
}

/// Passes batches through; as a learner, publishes a 64-byte payload per step.
struct PassThrough;

impl Stage for PassThrough {
    fn process(
        &mut self,
        _ctx: &mut StepContext,
        batch: RecordBatch,
    ) -> Result<Vec<RecordBatch>, StageError> {
        Ok(vec![batch])
    }

    fn end_step(&mut self, ctx: &mut StepContext) -> Result<Vec<RecordBatch>, StageError> {
        if ctx.may_publish() {
            ctx.publish_weights(WeightsPayload::from(vec![0u8; 64]))?;
        }
        Ok(Vec::new())
    }

    fn load_weights(
        &mut self,
        _version: PolicyVersion,
        _weights: &WeightsPayload,
    ) -> Result<(), StageError> {
        Ok(())
    }
}

fn cycle() -> Pipeline {
    Pipeline::new("empty_cycle")
        .source("rollout", |_| Ok(OneRow))
        .generate("generate", "rollout", Partition::RoundRobin, |_| {
            Ok(PassThrough)
        })
        .learn("learn", "train", Partition::RoundRobin, |_| Ok(PassThrough))
}

fn chain(stages: usize) -> Pipeline {
    let mut p = Pipeline::new("chain").source("rollout", |_| Ok(OneRow));
    for i in 0..stages {
        p = p.stage(&format!("s{i}"), "rollout", Partition::RoundRobin, |_| {
            Ok(PassThrough)
        });
    }
    p
}

fn settings(workers: usize, steps: u64, k: u64) -> RunSettings {
    let placement = if workers == 1 {
        Placement::colocated(1)
    } else {
        Placement::new(workers)
            .assign("rollout", [0])
            .assign("train", [workers - 1])
    };
    RunSettings::new(Execution::Threads(workers), placement)
        .max_staleness(k)
        .steps(steps)
}

/// Wall time of `steps` steps, start-up included (amortised over many steps).
fn time_run(pipeline: &Pipeline, workers: usize, steps: u64, k: u64) -> Duration {
    let started = Instant::now();
    let report = pipeline
        .run(&settings(workers, steps, k))
        .expect("benchmark pipeline runs");
    assert_eq!(report.steps, steps);
    started.elapsed()
}

fn bench_engine(c: &mut Criterion) {
    let mut group = c.benchmark_group("engine");
    group
        .sample_size(10)
        .measurement_time(Duration::from_secs(5));
    for workers in [1usize, 2] {
        group.bench_function(format!("empty_cycle_step/{workers}_workers/k0"), |b| {
            b.iter_custom(|iters| time_run(&cycle(), workers, iters.max(1), 0));
        });
    }
    for stages in [1usize, 9] {
        group.bench_function(format!("chain_step/{stages}_stages"), |b| {
            b.iter_custom(|iters| time_run(&chain(stages), 1, iters.max(1), 0));
        });
    }
    group.finish();
}

criterion_group!(benches, bench_engine);

/// Median of `n` runs' per-step seconds.
fn per_step(n: usize, f: impl Fn() -> (Duration, u64)) -> f64 {
    let mut v: Vec<f64> = (0..n)
        .map(|_| {
            let (d, steps) = f();
            d.as_secs_f64() / steps as f64
        })
        .collect();
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn sim_steps_per_s(k: u64, queue: usize, steps: u64) -> f64 {
    let out = tempfile::tempdir().expect("temp folder");
    let args = weir::sim::SimArgs {
        steps,
        batch_rows: 64,
        max_staleness: k,
        workers: 2,
        cluster: weir::cluster::ClusterArgs {
            peer_timeout_s: 30.0,
            ..Default::default()
        },
        gen_ms: 40,
        train_ms: 20,
        score_ms: 0,
        jitter_ms: 0,
        seed: 0,
        group_size: 4,
        weights_bytes: 4096,
        weights_bucket_bytes: 64 << 20,
        weights_channel: weir::graph::WeightsChannel::default(),
        encrypt: false,
        placement: None,
        generate_queue: queue,
        stream_slots: 0,
        fail_at_step: None,
        out: out.path().to_path_buf(),
    };
    weir::sim::run_sim(&args)
        .expect("simulation runs")
        .steps_per_s
}

fn derived_figures(full: bool) {
    let (runs, steps) = if full { (5, 2000) } else { (1, 20) };
    println!("\n== derived figures (median of {runs} runs of {steps} steps) ==");
    for workers in [1usize, 2] {
        let t = per_step(runs, || (time_run(&cycle(), workers, steps, 0), steps));
        println!(
            "empty cyclic pipeline, {workers} worker(s), k=0: {:.0} steps/s ({:.1} µs/step)",
            1.0 / t,
            t * 1e6
        );
    }
    let t1 = per_step(runs, || (time_run(&chain(1), 1, steps, 0), steps));
    let t9 = per_step(runs, || (time_run(&chain(9), 1, steps, 0), steps));
    println!(
        "per-hop overhead, 1 worker: {:.2} µs  ((t9 − t1) / 8 with t1 = {:.1} µs, t9 = {:.1} µs)",
        (t9 - t1) / 8.0 * 1e6,
        t1 * 1e6,
        t9 * 1e6
    );

    let sim_steps = if full { 40 } else { 6 };
    let target = 0.9 * (40.0 + 20.0) / 40.0;
    for (queue, label) in [
        (2usize, "generation on an engine thread (default)"),
        (0, "generation inline on its worker"),
    ] {
        let k0 = sim_steps_per_s(0, queue, sim_steps);
        let k1 = sim_steps_per_s(1, queue, sim_steps);
        println!(
            "overlap, G=40 ms T=20 ms on separate workers, {label}: k=0 {k0:.2} steps/s, k=1 {k1:.2} steps/s, ratio {:.3} (target ≥ {target:.2})",
            k1 / k0
        );
    }
}

fn main() {
    let full = std::env::args().any(|a| a == "--bench");
    benches();
    Criterion::default().configure_from_args().final_summary();
    derived_figures(full);
}
