//! The engine simulation: generate → score → advantage → learn with
//! synthetic stages that sleep for configurable costs and emit real rows.
//!
//! It is how the engine's guarantees are exercised end to end (the tests
//! run it in 1 thread, N threads and N processes) and how its overhead and
//! overlap are measured. Every rollout row goes to `OUT/rollouts/*.parquet`
//! and every metric to `OUT/metrics.parquet`.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use weir_graph::synthetic::{
    Cost, SyntheticAdvantage, SyntheticGenerate, SyntheticLearn, SyntheticPrompts, SyntheticScore,
    SyntheticStreamingGenerate,
};
use weir_graph::{
    roles, ParquetLog, Partition, Pipeline, Placement, RunReport, RunSettings, Stage,
    WeightsChannel,
};

fn parse_channel(text: &str) -> Result<WeightsChannel, String> {
    match text.split_once(':') {
        _ if text == "direct" => Ok(WeightsChannel::Direct { port: 0 }),
        _ if text == "timely" => Ok(WeightsChannel::Timely),
        Some(("direct", port)) => port
            .parse()
            .map(|port| WeightsChannel::Direct { port })
            .map_err(|_| format!("`{port}`: expected a port number")),
        _ => Err(format!(
            "`{text}`: expected `direct`, `direct:PORT` or `timely`"
        )),
    }
}

/// Flags of `weir sim` and of the `engine_sim` example.
#[derive(Clone, Debug, clap::Args)]
pub struct SimArgs {
    /// Steps to run.
    #[arg(long, default_value_t = 20)]
    pub steps: u64,
    /// Rows per step (prompts × samples).
    #[arg(long = "batch-rows", default_value_t = 64)]
    pub batch_rows: u64,
    /// k: generation may use weights up to k versions old; k + 1 steps in flight.
    #[arg(long = "max-staleness", default_value_t = 1)]
    pub max_staleness: u64,
    /// Worker threads per process.
    #[arg(long, default_value_t = 2)]
    pub workers: usize,
    /// The processes of the simulation.
    #[command(flatten)]
    pub cluster: crate::cluster::ClusterArgs,
    /// Generation cost per batch, milliseconds.
    #[arg(long = "gen-ms", default_value_t = 40)]
    pub gen_ms: u64,
    /// Training cost per step, milliseconds.
    #[arg(long = "train-ms", default_value_t = 20)]
    pub train_ms: u64,
    /// Scoring cost per batch, milliseconds.
    #[arg(long = "score-ms", default_value_t = 0)]
    pub score_ms: u64,
    /// Random extra cost per call, 0..=jitter milliseconds (seeded by --seed).
    #[arg(long = "jitter-ms", default_value_t = 0)]
    pub jitter_ms: u64,
    /// Seed of the jitter.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Rows per prompt group (kept on one worker by the advantage edge).
    #[arg(long = "group-size", default_value_t = 4)]
    pub group_size: u64,
    /// Size of the weights payload the learner publishes each step, bytes.
    #[arg(long = "weights-bytes", default_value_t = 4096)]
    pub weights_bytes: usize,
    /// The largest bucket a weights payload crosses to another process in, bytes.
    #[arg(long = "weights-bucket-bytes", default_value_t = 64 << 20)]
    pub weights_bucket_bytes: usize,
    /// How weights cross to another process: `direct` (a TCP connection of
    /// their own, on any free port, or `direct:PORT`) or `timely` (in
    /// buckets on timely's connections).
    #[arg(long = "weights-channel", default_value = "direct", value_parser = parse_channel)]
    pub weights_channel: WeightsChannel,
    /// Encrypt every byte between the processes (timely's sockets and the
    /// direct weights channel), as `placement.encrypt` does for a run.
    #[arg(long)]
    pub encrypt: bool,
    /// Roles to workers, e.g. `rollout=0-2;train=3` (default: training on the last worker, the rest generate).
    #[arg(long)]
    pub placement: Option<String>,
    /// Generation runs on an engine thread fed by a queue of this many
    /// batches, so scoring and weight loads on its worker are not blocked
    /// behind a long generate call; 0 runs it inline on the worker.
    #[arg(long = "generate-queue", default_value_t = 2)]
    pub generate_queue: usize,
    /// Streaming generation: a pool of this many sequences advanced one
    /// token per pass (`--gen-ms` a pass), rows of a group leaving at the
    /// step they fill (0: each batch generated whole, `--gen-ms` a batch).
    #[arg(long = "stream-slots", default_value_t = 0)]
    pub stream_slots: usize,
    /// Make scoring fail at this step (to exercise failure handling).
    #[arg(long = "fail-at-step")]
    pub fail_at_step: Option<u64>,
    /// Output folder.
    #[arg(long, default_value = "runs/engine_sim")]
    pub out: PathBuf,
}

impl SimArgs {
    /// The placement `--placement` names, or the default one over `workers`.
    pub fn placement(&self, workers: usize) -> anyhow::Result<Placement> {
        if let Some(text) = &self.placement {
            return Placement::parse(workers, text)
                .with_context(|| format!("--placement `{text}`"));
        }
        if workers == 1 {
            return Ok(Placement::colocated(1));
        }
        let train = workers - 1;
        Ok(Placement::new(workers)
            .assign(roles::ROLLOUT, 0..train)
            .assign(roles::REWARD, 0..train)
            .assign(roles::TRAIN, [train])
            .assign(roles::LOG, [train]))
    }

    fn cost(&self, ms: u64, salt: u64) -> Cost {
        Cost {
            base: Duration::from_millis(ms),
            jitter: Duration::from_millis(self.jitter_ms),
            seed: self.seed ^ salt,
        }
    }
}

/// The simulation pipeline for `args`.
pub fn sim_pipeline(args: &SimArgs) -> Pipeline {
    let (rows, group) = (args.batch_rows, args.group_size);
    let gen_cost = args.cost(args.gen_ms, 1);
    let score_cost = args.cost(args.score_ms, 2);
    let train_cost = args.cost(args.train_ms, 3);
    let (weights_bytes, fail_at) = (args.weights_bytes, args.fail_at_step);
    let (slots, k) = (args.stream_slots, args.max_staleness);
    let rollouts = args.out.join("rollouts");
    let mut pipeline = Pipeline::new("engine_sim")
        .source(roles::ROLLOUT, move |w| {
            Ok(SyntheticPrompts::new(rows)
                .group_size(group)
                .shard(w.rank, w.role_size))
        })
        .generate("generate", roles::ROLLOUT, Partition::Local, move |_| {
            Ok(if slots > 0 {
                Box::new(SyntheticStreamingGenerate::new(gen_cost, slots, k)) as Box<dyn Stage>
            } else {
                Box::new(SyntheticGenerate::new(gen_cost))
            })
        });
    if args.generate_queue > 0 {
        pipeline = pipeline.offload(args.generate_queue);
    }
    pipeline
        .stage("score", roles::REWARD, Partition::RoundRobin, move |_| {
            Ok(SyntheticScore::new(score_cost).fail_at(fail_at))
        })
        .stage(
            "advantage",
            roles::TRAIN,
            Partition::ByKey("group_id".into()),
            move |_| Ok(SyntheticAdvantage::new(group)),
        )
        .learn("learn", roles::TRAIN, Partition::RoundRobin, move |_| {
            Ok(SyntheticLearn::new(train_cost, weights_bytes))
        })
        .sink("rollout_log", roles::LOG, Partition::RoundRobin, move |w| {
            Ok(ParquetLog::new(&rollouts, w.index, 4096)?)
        })
}

/// Runs the simulation and returns its report.
pub fn run_sim(args: &SimArgs) -> anyhow::Result<RunReport> {
    if args.group_size == 0 || args.batch_rows == 0 {
        anyhow::bail!("--batch-rows and --group-size must be at least 1");
    }
    if args.stream_slots > 0 && args.generate_queue == 0 {
        anyhow::bail!("--stream-slots needs --generate-queue ≥ 1 (a streaming generator runs on an engine thread)");
    }
    if !args.batch_rows.is_multiple_of(args.group_size) {
        anyhow::bail!(
            "--batch-rows {} is not a multiple of --group-size {}",
            args.batch_rows,
            args.group_size
        );
    }
    let cluster = args.cluster.cluster()?;
    let execution = cluster.execution(args.workers)?;
    let placement = args.placement(execution.total_workers())?;
    let secret = execution.cluster_secret(cluster.secret.clone(), &args.out)?;
    let settings = RunSettings::new(execution, placement)
        .max_staleness(args.max_staleness)
        .steps(args.steps)
        .peer_timeout(cluster.peer_timeout)
        .connect_timeout(cluster.connect_timeout)
        .cluster_secret(secret)
        .weights_bucket_bytes(args.weights_bucket_bytes)
        .weights_channel(args.weights_channel)
        .encrypt(args.encrypt)
        .fingerprint(fingerprint(args))
        .metrics_path(args.out.join("metrics.parquet"));
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("creating {}", args.out.display()))?;
    Ok(sim_pipeline(args).run(&settings)?)
}

/// What every process of a simulation must share: its flags but the process id.
fn fingerprint(args: &SimArgs) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut shared = args.clone();
    shared.cluster.process_id = None;
    // Each machine may keep the secret in its own file.
    shared.cluster.cluster_secret_file = None;
    let mut h = std::collections::hash_map::DefaultHasher::new();
    format!("{shared:?}").hash(&mut h);
    h.finish()
}

/// Runs the simulation and prints its summary; the last line is `steps_per_s=<float>`.
pub fn main_with(args: &SimArgs) -> anyhow::Result<()> {
    let report = run_sim(args)?;
    if args.cluster.process()? == 0 {
        for (stage, t) in &report.stages {
            println!(
                "stage {stage:<10} workers={} busy_s={:.3} idle_s={:.3} batches_in={} rows_in={} rows_out={} queue_peak={}",
                t.workers, t.busy_s, t.idle_s, t.batches_in, t.rows_in, t.rows_out, t.queue_peak
            );
        }
        println!("staleness_histogram={:?}", report.staleness_histogram);
        println!("peak_in_flight_steps={}", report.peak_in_flight_steps);
        println!(
            "weights_transfer_s mean={:.6} max={:.6}",
            report.weights_transfer_s_mean, report.weights_transfer_s_max
        );
        println!("out={}", args.out.display());
    }
    println!("steps_per_s={:.4}", report.steps_per_s);
    Ok(())
}
