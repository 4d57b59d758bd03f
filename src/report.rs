//! `weir inspect` and `weir plot`: what a run folder says, as a terminal
//! summary and as PNG charts.
//!
//! Both read `RUN_DIR/metrics.parquet`, the long-format metrics stream of
//! [`weir_graph::metrics`], and take any metric being absent in their stride:
//! an SFT run records only `loss` and `grad_norm`, `weir sim` only the
//! engine's figures. No stage name is assumed: the learner is the stage that
//! records `loss`, or failing that the one that records `staleness`.
//!
//! Charts are drawn with `plotters` on its bitmap backend, with text set in a
//! font embedded in the binary, so `weir plot` needs no system font library
//! and no display.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use anyhow::{bail, Context};
use plotters::prelude::*;
use plotters::style::FontStyle;
use weir_graph::metrics::{batch_to_rows, names, MetricRow};
use weir_graph::parquet_log::{read_parquet_dir, read_parquet_file};
use weir_graph::Step;

/// Learner metrics, in the order `inspect` lists them.
const LEARNER_METRICS: [&str; 7] = [
    "reward",
    "kl",
    "entropy",
    "loss",
    "grad_norm",
    "clip_fraction",
    "response_length",
];

/// The per-step curves `plot` draws, each when recorded.
const PLOTTED: [&str; 4] = ["reward", "kl", "entropy", "loss"];

/// Metrics the engine writes for every stage; the rest are the stages' own.
const ENGINE_METRICS: [&str; 10] = [
    names::BUSY_S,
    names::BATCHES_IN,
    names::ROWS_IN,
    names::ROWS_OUT,
    names::QUEUE_PEAK,
    names::POLICY_VERSION,
    names::WEIGHTS_TRANSFER_S,
    names::STALENESS,
    names::DONE_UNIX_S,
    names::IN_FLIGHT_STEPS,
];

/// Characters of a sparkline at most (longer series are averaged down).
const SPARK_WIDTH: usize = 60;
/// Characters of the longest staleness bar.
const BAR_WIDTH: usize = 40;
/// Pixels of every chart.
const CHART_SIZE: (u32, u32) = (960, 540);
/// The family every chart's text is set in (plotters' default family).
const FONT_FAMILY: &str = "sans-serif";
/// DejaVu Sans cut down to the characters charts use; see assets/fonts/LICENSE-DejaVu.txt.
const FONT: &[u8] = include_bytes!("../assets/fonts/DejaVuSans-subset.ttf");

/// A terminal summary of the run in `run_dir`: steps, wall time, throughput,
/// each recorded learner metric (first, last, min, max and a sparkline), the
/// staleness histogram, per-stage busy and idle time, and `summary.json`'s
/// top-level scalars.
pub fn inspect(run_dir: &Path) -> anyhow::Result<String> {
    let run = RunMetrics::load(run_dir)?;
    let mut out = String::new();
    writeln!(out, "{:<12} {}", "run folder", run_dir.display())?;
    if run.rows.is_empty() {
        writeln!(out, "{:<12} none (metrics.parquet has no rows)", "steps")?;
        return Ok(out);
    }
    write_progress(&run, &mut out)?;
    write_curves(&run, &mut out)?;
    write_staleness(&run, &mut out)?;
    write_stages(&run, &mut out)?;
    write_folder_extras(run_dir, &mut out)?;
    Ok(out)
}

/// Steps, wall time and throughput.
fn write_progress(run: &RunMetrics, out: &mut String) -> std::fmt::Result {
    let steps: BTreeSet<Step> = run.rows.iter().map(|r| r.step).collect();
    let (first, last) = (steps.first(), steps.last());
    if let (Some(first), Some(last)) = (first, last) {
        writeln!(
            out,
            "{:<12} {first}..{last} ({} steps)",
            "steps",
            steps.len()
        )?;
    }
    match run.wall_s() {
        Some(wall) => writeln!(
            out,
            "{:<12} {} s (first to last step completion)",
            "wall time",
            fmt_value(wall)
        )?,
        None => writeln!(out, "{:<12} unknown (no done_unix_s)", "wall time")?,
    }
    match run.throughput().and_then(|t| t.overall().map(|o| (t, o))) {
        Some((t, (rows_per_s, steps_per_s))) => writeln!(
            out,
            "{:<12} {} rows/s, {} steps/s ({} of `{}`)",
            "throughput",
            fmt_value(rows_per_s),
            fmt_value(steps_per_s),
            t.metric,
            t.stage
        ),
        None => writeln!(
            out,
            "{:<12} unknown (needs rows and done_unix_s on two steps)",
            "throughput"
        ),
    }
}

/// First, last, min, max and a sparkline of every curve the stages recorded.
fn write_curves(run: &RunMetrics, out: &mut String) -> std::fmt::Result {
    let curves = run.curves();
    if curves.is_empty() {
        return Ok(());
    }
    let learner = run.learner().unwrap_or("none");
    writeln!(
        out,
        "\nper-step metrics (mean over workers; learner: `{learner}`)"
    )?;
    writeln!(
        out,
        "  {:<24} {:>11} {:>11} {:>11} {:>11}  trend",
        "metric", "first", "last", "min", "max"
    )?;
    for (name, series) in &curves {
        let values: Vec<f64> = series.values().copied().collect();
        let finite = values.iter().copied().filter(|v| v.is_finite());
        let min = finite.clone().fold(f64::INFINITY, f64::min);
        let max = finite.fold(f64::NEG_INFINITY, f64::max);
        writeln!(
            out,
            "  {:<24} {:>11} {:>11} {:>11} {:>11}  {}",
            name,
            fmt_value(values[0]),
            fmt_value(values[values.len() - 1]),
            fmt_value(min),
            fmt_value(max),
            sparkline(&values, SPARK_WIDTH)
        )?;
    }
    Ok(())
}

/// Rows the learner consumed at each staleness, with bars.
fn write_staleness(run: &RunMetrics, out: &mut String) -> std::fmt::Result {
    let histogram = run.staleness_histogram();
    if histogram.is_empty() {
        return Ok(());
    }
    writeln!(
        out,
        "\nstaleness (rows the learner consumed, by policy versions behind)"
    )?;
    let most = histogram.values().copied().max().unwrap_or(0).max(1);
    for (staleness, rows) in &histogram {
        writeln!(
            out,
            "  {staleness:>4} {rows:>10}  {}",
            bar(*rows as f64 / most as f64, BAR_WIDTH)
        )?;
    }
    Ok(())
}

/// Busy and idle seconds per stage, and the busy share of wall time × workers.
fn write_stages(run: &RunMetrics, out: &mut String) -> std::fmt::Result {
    let busy = run.busy_by_stage();
    if busy.is_empty() {
        return Ok(());
    }
    writeln!(
        out,
        "\nstages (busy: seconds inside the stage, summed over workers; share of wall × workers)"
    )?;
    writeln!(
        out,
        "  {:<20} {:>7} {:>11} {:>11} {:>7}",
        "stage", "workers", "busy_s", "idle_s", "busy"
    )?;
    let wall = run.wall_s();
    for (stage, (workers, busy_s)) in &busy {
        // The wall time starts at the first step's completion, so a busy
        // stage of a short run can show a little over 100%.
        let capacity = wall.map(|w| w * *workers as f64).filter(|c| *c > 0.0);
        let (idle, share) = match capacity {
            Some(c) => (
                fmt_value((c - busy_s).max(0.0)),
                format!("{:.1}%", 100.0 * busy_s / c),
            ),
            None => ("-".into(), "-".into()),
        };
        writeln!(
            out,
            "  {:<20} {:>7} {:>11} {:>11} {:>7}",
            stage,
            workers,
            fmt_value(*busy_s),
            idle,
            share
        )?;
    }
    Ok(())
}

/// Writes PNG charts of the run in `run_dir` to `RUN_DIR/plots/`: one per
/// recorded learner curve (`reward.png`, `kl.png`, `entropy.png`,
/// `loss.png`), `staleness.png` and `throughput.png` when their figures
/// exist. Returns the paths written.
pub fn plot(run_dir: &Path) -> anyhow::Result<Vec<PathBuf>> {
    let run = RunMetrics::load(run_dir)?;
    register_font()?;
    let dir = run_dir.join("plots");
    let name = run_dir
        .canonicalize()
        .ok()
        .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
        .unwrap_or_else(|| run_dir.display().to_string());
    let mut charts: Vec<(PathBuf, Chart)> = Vec::new();
    for metric in PLOTTED {
        if let Some((stage, series)) = run.series_of(metric) {
            charts.push((
                dir.join(format!("{metric}.png")),
                Chart::Line {
                    title: format!("{metric} per step ({stage}) — {name}"),
                    y_desc: format!("{metric} (mean over workers)"),
                    points: series.into_iter().collect(),
                    from_zero: false,
                },
            ));
        }
    }
    let histogram = run.staleness_histogram();
    if !histogram.is_empty() {
        charts.push((
            dir.join("staleness.png"),
            Chart::Histogram {
                title: format!("staleness of the rows learned from — {name}"),
                counts: histogram,
            },
        ));
    }
    if let Some(t) = run.throughput() {
        let points = t.rates();
        if !points.is_empty() {
            charts.push((
                dir.join("throughput.png"),
                Chart::Line {
                    title: format!("throughput ({} of {}) — {name}", t.metric, t.stage),
                    y_desc: "rows/s".into(),
                    points,
                    from_zero: true,
                },
            ));
        }
    }
    if charts.is_empty() {
        bail!(
            "{}: nothing to plot (no reward, kl, entropy, loss, staleness or done_unix_s metrics)",
            run.path.display()
        );
    }
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    for (path, chart) in &charts {
        chart
            .draw(path)
            .with_context(|| format!("drawing {}", path.display()))?;
    }
    Ok(charts.into_iter().map(|(path, _)| path).collect())
}

/// The metric rows of one run folder.
struct RunMetrics {
    /// Where they were read from.
    path: PathBuf,
    rows: Vec<MetricRow>,
}

/// How the rows of one step are folded into one figure.
#[derive(Clone, Copy)]
enum Fold {
    /// Over workers: a per-worker figure such as a loss.
    Mean,
    /// Over workers: a count such as rows.
    Sum,
    /// Over workers: a time such as `done_unix_s`.
    Max,
}

impl RunMetrics {
    fn load(run_dir: &Path) -> anyhow::Result<Self> {
        let meta = std::fs::metadata(run_dir)
            .with_context(|| format!("run folder {}", run_dir.display()))?;
        if !meta.is_dir() {
            bail!(
                "{} is not a folder (expected a weir run folder)",
                run_dir.display()
            );
        }
        let path = run_dir.join("metrics.parquet");
        let batches = if path.is_dir() {
            read_parquet_dir(&path)?
        } else if path.is_file() {
            read_parquet_file(&path)?
        } else {
            bail!(
                "{}: not found (is {} a weir run folder?)",
                path.display(),
                run_dir.display()
            );
        };
        let mut rows = Vec::new();
        for batch in &batches {
            rows.extend(batch_to_rows(batch).with_context(|| path.display().to_string())?);
        }
        Ok(RunMetrics { path, rows })
    }

    /// A stage's unlabelled `metric`, one figure per step; `stage: None` takes every stage.
    fn per_step(&self, stage: Option<&str>, metric: &str, fold: Fold) -> BTreeMap<Step, f64> {
        let mut acc: BTreeMap<Step, (f64, u32)> = BTreeMap::new();
        let rows = self.rows.iter().filter(|r| {
            r.metric == metric && r.label.is_none() && stage.is_none_or(|s| r.stage == s)
        });
        for row in rows {
            let (value, n) = acc.entry(row.step).or_insert((0.0, 0));
            *value = match (fold, *n) {
                (_, 0) => row.value,
                (Fold::Mean | Fold::Sum, _) => *value + row.value,
                (Fold::Max, _) => value.max(row.value),
            };
            *n += 1;
        }
        acc.into_iter()
            .map(|(step, (value, n))| match fold {
                Fold::Mean => (step, value / f64::from(n)),
                Fold::Sum | Fold::Max => (step, value),
            })
            .collect()
    }

    /// The first stage (in file order) that records `metric`.
    fn stage_with(&self, metric: &str) -> Option<&str> {
        self.rows
            .iter()
            .find(|r| r.metric == metric)
            .map(|r| r.stage.as_str())
    }

    /// The stage that records `loss`, or else the one that consumes rows by staleness.
    fn learner(&self) -> Option<&str> {
        self.stage_with("loss")
            .or_else(|| self.stage_with(names::STALENESS))
    }

    /// `metric` per step: the learner's if it records it, else the first stage's that does.
    fn series_of(&self, metric: &str) -> Option<(&str, BTreeMap<Step, f64>)> {
        let learner = self.learner();
        let stage = learner
            .filter(|l| {
                self.rows
                    .iter()
                    .any(|r| r.stage == *l && r.metric == metric)
            })
            .or_else(|| self.stage_with(metric))?;
        let series = self.per_step(Some(stage), metric, Fold::Mean);
        (!series.is_empty()).then_some((stage, series))
    }

    /// Every per-step curve the stages recorded themselves: the learner's
    /// (named by metric, known ones first), then other stages' as `stage/metric`.
    fn curves(&self) -> Vec<(String, BTreeMap<Step, f64>)> {
        let learner = self.learner();
        let mut own: BTreeSet<(&str, &str)> = BTreeSet::new();
        for r in &self.rows {
            if r.label.is_none() && !ENGINE_METRICS.contains(&r.metric.as_str()) {
                own.insert((r.stage.as_str(), r.metric.as_str()));
            }
        }
        let rank = |stage: &str, metric: &str| {
            let known = LEARNER_METRICS.iter().position(|m| *m == metric);
            (
                Some(stage) != learner,
                known.unwrap_or(LEARNER_METRICS.len()),
            )
        };
        let mut keys: Vec<(&str, &str)> = own.into_iter().collect();
        keys.sort_by_key(|(stage, metric)| (rank(stage, metric), *stage, *metric));
        keys.into_iter()
            .map(|(stage, metric)| {
                let name = if Some(stage) == learner {
                    metric.to_string()
                } else {
                    format!("{stage}/{metric}")
                };
                (name, self.per_step(Some(stage), metric, Fold::Mean))
            })
            .filter(|(_, series)| !series.is_empty())
            .collect()
    }

    /// Rows consumed at each staleness, over the run.
    fn staleness_histogram(&self) -> BTreeMap<u64, u64> {
        let mut histogram = BTreeMap::new();
        for r in self.rows.iter().filter(|r| r.metric == names::STALENESS) {
            if let Some(staleness) = r.label.as_deref().and_then(|l| l.parse::<u64>().ok()) {
                *histogram.entry(staleness).or_insert(0) += r.value.max(0.0) as u64;
            }
        }
        histogram
    }

    /// Seconds from the first stage's completion of a step to the last's,
    /// over the run (the start of the first step is not recorded).
    fn wall_s(&self) -> Option<f64> {
        let done = self
            .rows
            .iter()
            .filter(|r| r.metric == names::DONE_UNIX_S)
            .map(|r| r.value);
        let first = done.clone().reduce(f64::min)?;
        let last = done.reduce(f64::max)?;
        Some(last - first)
    }

    /// Per stage: the workers that ran it and its busy seconds summed over them.
    fn busy_by_stage(&self) -> BTreeMap<&str, (usize, f64)> {
        let mut workers: BTreeMap<&str, BTreeSet<u32>> = BTreeMap::new();
        let mut busy: BTreeMap<&str, f64> = BTreeMap::new();
        for r in &self.rows {
            workers.entry(&r.stage).or_default().insert(r.worker);
            if r.metric == names::BUSY_S {
                *busy.entry(&r.stage).or_default() += r.value;
            }
        }
        busy.into_iter()
            .map(|(stage, s)| (stage, (workers[stage].len(), s)))
            .collect()
    }

    /// Rows per step and when each step completed: the learner's `rows_in`,
    /// or with no learner the `rows_out` of the stage that finishes last.
    fn throughput(&self) -> Option<Throughput<'_>> {
        let has = |stage: &str, metric: &str| {
            self.rows
                .iter()
                .any(|r| r.stage == stage && r.metric == metric)
        };
        let (stage, metric) = match self.learner() {
            Some(learner) if has(learner, names::ROWS_IN) => (learner, names::ROWS_IN),
            _ => (self.last_stage()?, names::ROWS_OUT),
        };
        let rows = self.per_step(Some(stage), metric, Fold::Sum);
        let mut done = self.per_step(Some(stage), names::DONE_UNIX_S, Fold::Max);
        if done.is_empty() {
            done = self.per_step(None, names::DONE_UNIX_S, Fold::Max);
        }
        let steps = rows
            .into_iter()
            .filter_map(|(step, n)| done.get(&step).map(|t| (step, (n, *t))))
            .collect();
        Some(Throughput {
            stage,
            metric,
            steps,
        })
    }

    /// The stage with `rows_out` that completes its steps last (in file order without times).
    fn last_stage(&self) -> Option<&str> {
        let mut latest: BTreeMap<&str, f64> = BTreeMap::new();
        let mut order: Vec<&str> = Vec::new();
        for r in &self.rows {
            if r.metric == names::ROWS_OUT && !order.contains(&r.stage.as_str()) {
                order.push(&r.stage);
            }
            if r.metric == names::DONE_UNIX_S {
                let t = latest.entry(&r.stage).or_insert(f64::NEG_INFINITY);
                *t = t.max(r.value);
            }
        }
        order
            .iter()
            .max_by(|a, b| {
                let t = |s: &&str| latest.get(*s).copied().unwrap_or(f64::NEG_INFINITY);
                t(a).total_cmp(&t(b))
            })
            .copied()
    }
}

/// Rows and completion time of each step of the stage throughput is counted at.
struct Throughput<'a> {
    stage: &'a str,
    metric: &'static str,
    /// step → (rows, `done_unix_s`)
    steps: BTreeMap<Step, (f64, f64)>,
}

impl Throughput<'_> {
    /// Rows per second and steps per second from the first step's completion to the last's.
    fn overall(&self) -> Option<(f64, f64)> {
        let (_, (_, start)) = self.steps.first_key_value()?;
        let (_, (_, end)) = self.steps.last_key_value()?;
        let span = end - start;
        if self.steps.len() < 2 || span <= 0.0 {
            return None;
        }
        let rows: f64 = self.steps.values().skip(1).map(|(n, _)| n).sum();
        Some((rows / span, (self.steps.len() - 1) as f64 / span))
    }

    /// Per step after the first: its rows over the time since the previous step completed.
    fn rates(&self) -> Vec<(Step, f64)> {
        self.steps
            .iter()
            .zip(self.steps.iter().skip(1))
            .filter_map(|((_, (_, before)), (step, (rows, done)))| {
                let dt = done - before;
                (dt > 0.0).then_some((*step, rows / dt))
            })
            .collect()
    }
}

/// `summary.json`'s top-level scalars and what else the folder holds.
fn write_folder_extras(run_dir: &Path, out: &mut String) -> std::fmt::Result {
    let summary = run_dir.join("summary.json");
    if summary.is_file() {
        writeln!(out, "\nsummary.json")?;
        let parsed = std::fs::read_to_string(&summary)
            .map_err(|e| e.to_string())
            .and_then(|text| {
                serde_json::from_str::<serde_json::Value>(&text).map_err(|e| e.to_string())
            });
        match parsed {
            Ok(serde_json::Value::Object(fields)) => {
                for (key, value) in &fields {
                    let shown = match value {
                        serde_json::Value::Number(n) => match n.as_f64() {
                            Some(x) if !n.is_i64() && !n.is_u64() => fmt_value(x),
                            _ => n.to_string(),
                        },
                        serde_json::Value::String(s) => s.clone(),
                        serde_json::Value::Bool(b) => b.to_string(),
                        serde_json::Value::Null => "null".into(),
                        serde_json::Value::Array(_) | serde_json::Value::Object(_) => continue,
                    };
                    writeln!(out, "  {key} = {shown}")?;
                }
            }
            Ok(_) => {
                writeln!(out, "  (not a JSON object)")?;
            }
            Err(e) => {
                writeln!(out, "  (unreadable: {e})")?;
            }
        }
    }
    let rollouts = run_dir.join("rollouts");
    if rollouts.is_dir() {
        writeln!(out, "\n{:<12} {}", "rollouts", rollout_rows(&rollouts))?;
    }
    let config = run_dir.join("config.resolved.toml");
    if config.is_file() {
        writeln!(out, "{:<12} {}", "config", config.display())?;
    }
    Ok(())
}

/// "N rows in M files", from the Parquet footers alone.
fn rollout_rows(dir: &Path) -> String {
    use parquet::file::reader::{FileReader, SerializedFileReader};
    let Ok(entries) = std::fs::read_dir(dir) else {
        return format!("{} (unreadable)", dir.display());
    };
    let (mut files, mut rows, mut unreadable) = (0, 0i64, 0);
    for path in entries.filter_map(|e| e.ok().map(|e| e.path())) {
        if path.extension().is_none_or(|x| x != "parquet") {
            continue;
        }
        files += 1;
        match std::fs::File::open(&path)
            .map_err(|e| e.to_string())
            .and_then(|f| SerializedFileReader::new(f).map_err(|e| e.to_string()))
        {
            Ok(reader) => rows += reader.metadata().file_metadata().num_rows(),
            Err(_) => unreadable += 1,
        }
    }
    let text = format!("{rows} rows in {files} files ({})", dir.display());
    if unreadable > 0 {
        format!("{text}, {unreadable} unreadable")
    } else {
        text
    }
}

/// One chart to draw.
enum Chart {
    /// A curve over steps.
    Line {
        title: String,
        y_desc: String,
        points: Vec<(Step, f64)>,
        /// The y axis starts at zero (rates), rather than at the data.
        from_zero: bool,
    },
    /// Bars of rows by staleness.
    Histogram {
        title: String,
        counts: BTreeMap<u64, u64>,
    },
}

impl Chart {
    fn draw(&self, path: &Path) -> anyhow::Result<()> {
        let root = BitMapBackend::new(path, CHART_SIZE).into_drawing_area();
        root.fill(&WHITE).map_err(plot_error)?;
        match self {
            Chart::Line {
                title,
                y_desc,
                points,
                from_zero,
            } => {
                let first = points.first().map_or(0, |p| p.0);
                let last = points.last().map_or(0, |p| p.0);
                let xs = first..last.max(first + 1);
                let values = points.iter().map(|p| p.1);
                let mut ys = padded_range(values.chain(from_zero.then_some(0.0)), 0.05);
                if *from_zero {
                    ys.start = 0.0;
                }
                let mut chart = ChartBuilder::on(&root)
                    .caption(title, (FONT_FAMILY, 24))
                    .margin(16)
                    .x_label_area_size(48)
                    .y_label_area_size(80)
                    .build_cartesian_2d(xs, ys)
                    .map_err(plot_error)?;
                chart
                    .configure_mesh()
                    .x_desc("step")
                    .y_desc(y_desc.as_str())
                    .label_style((FONT_FAMILY, 15))
                    .axis_desc_style((FONT_FAMILY, 17))
                    .draw()
                    .map_err(plot_error)?;
                let colour = RGBColor(31, 119, 180);
                chart
                    .draw_series(LineSeries::new(
                        points.iter().copied().filter(|p| p.1.is_finite()),
                        colour.stroke_width(2),
                    ))
                    .map_err(plot_error)?;
                if points.len() <= SPARK_WIDTH {
                    chart
                        .draw_series(
                            points
                                .iter()
                                .filter(|p| p.1.is_finite())
                                .map(|p| Circle::new(*p, 3, colour.filled())),
                        )
                        .map_err(plot_error)?;
                }
            }
            Chart::Histogram { title, counts } => {
                let last = counts.keys().next_back().copied().unwrap_or(0);
                let most = counts.values().copied().max().unwrap_or(0);
                let mut chart = ChartBuilder::on(&root)
                    .caption(title, (FONT_FAMILY, 24))
                    .margin(16)
                    .x_label_area_size(48)
                    .y_label_area_size(80)
                    .build_cartesian_2d((0..last).into_segmented(), 0..most + most / 10 + 1)
                    .map_err(plot_error)?;
                chart
                    .configure_mesh()
                    .disable_x_mesh()
                    .x_desc("staleness (policy versions behind the learner)")
                    .y_desc("rows")
                    .label_style((FONT_FAMILY, 15))
                    .axis_desc_style((FONT_FAMILY, 17))
                    .draw()
                    .map_err(plot_error)?;
                chart
                    .draw_series(
                        Histogram::vertical(&chart)
                            .style(RGBColor(31, 119, 180).filled())
                            .margin(12)
                            .data(counts.iter().map(|(s, n)| (*s, *n))),
                    )
                    .map_err(plot_error)?;
            }
        }
        root.present().map_err(plot_error)?;
        Ok(())
    }
}

/// plotters' errors borrow nothing but are not all `Send + Sync`; keep their text.
fn plot_error(err: impl std::fmt::Display) -> anyhow::Error {
    anyhow::anyhow!("{err}")
}

/// Registers the embedded font under plotters' default family, once.
fn register_font() -> anyhow::Result<()> {
    static REGISTERED: OnceLock<bool> = OnceLock::new();
    let ok = *REGISTERED.get_or_init(|| {
        plotters::style::register_font(FONT_FAMILY, FontStyle::Normal, FONT).is_ok()
    });
    anyhow::ensure!(
        ok,
        "the embedded chart font (assets/fonts/DejaVuSans-subset.ttf) could not be parsed"
    );
    Ok(())
}

/// The span of the finite `values`, widened by `pad` of itself on each side
/// (or by one either side when it is a single value).
fn padded_range(values: impl Iterator<Item = f64>, pad: f64) -> std::ops::Range<f64> {
    let (lo, hi) = values
        .filter(|v| v.is_finite())
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
            (lo.min(v), hi.max(v))
        });
    if lo > hi {
        return 0.0..1.0;
    }
    if hi - lo <= f64::EPSILON * hi.abs().max(1.0) {
        let half = (hi.abs() * 0.1).max(1.0);
        return lo - half..hi + half;
    }
    let margin = (hi - lo) * pad;
    lo - margin..hi + margin
}

/// A sparkline of `values`, averaged down to at most `width` characters;
/// non-finite values show as spaces.
fn sparkline(values: &[f64], width: usize) -> String {
    const TICKS: [char; 8] = ['▁', '▂', '▃', '▄', '▅', '▆', '▇', '█'];
    let points: Vec<f64> = if values.len() > width {
        (0..width)
            .map(|i| {
                let bucket = &values[i * values.len() / width..(i + 1) * values.len() / width];
                bucket.iter().sum::<f64>() / bucket.len() as f64
            })
            .collect()
    } else {
        values.to_vec()
    };
    let finite = points.iter().copied().filter(|v| v.is_finite());
    let lo = finite.clone().fold(f64::INFINITY, f64::min);
    let hi = finite.fold(f64::NEG_INFINITY, f64::max);
    points
        .iter()
        .map(|v| {
            if !v.is_finite() {
                ' '
            } else if hi - lo <= 0.0 {
                TICKS[3]
            } else {
                TICKS[(((v - lo) / (hi - lo)) * 7.0).round() as usize]
            }
        })
        .collect()
}

/// A bar of `fraction` × `width` full blocks, at least one for any positive fraction.
fn bar(fraction: f64, width: usize) -> String {
    let n = (fraction * width as f64).round() as usize;
    "█".repeat(if fraction > 0.0 { n.max(1) } else { 0 })
}

/// A figure to four significant digits, trailing zeros dropped; scientific
/// when very large or very small.
fn fmt_value(x: f64) -> String {
    if !x.is_finite() {
        return x.to_string();
    }
    let magnitude = x.abs();
    if magnitude != 0.0 && !(1e-4..1e9).contains(&magnitude) {
        return format!("{x:.3e}");
    }
    let decimals = if magnitude == 0.0 {
        0
    } else {
        (3 - magnitude.log10().floor() as i32).clamp(0, 7) as usize
    };
    let text = format!("{x:.decimals$}");
    let text = if text.contains('.') {
        text.trim_end_matches('0').trim_end_matches('.')
    } else {
        &text
    };
    if text == "-0" {
        "0".into()
    } else {
        text.into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(step: Step, worker: u32, stage: &str, metric: &str, value: f64) -> MetricRow {
        MetricRow::new(step, worker, stage, metric, None, value)
    }

    #[test]
    fn sparkline_spans_the_ticks_and_is_averaged_down() {
        assert_eq!(
            sparkline(&[0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0], 60),
            "▁▂▃▄▅▆▇█"
        );
        assert_eq!(sparkline(&[2.0, 2.0], 60), "▄▄");
        assert_eq!(sparkline(&[0.0, f64::NAN, 1.0], 60), "▁ █");
        let long: Vec<f64> = (0..600).map(f64::from).collect();
        let line = sparkline(&long, 60);
        assert_eq!(line.chars().count(), 60);
        assert!(line.starts_with('▁') && line.ends_with('█'), "{line}");
    }

    #[test]
    fn values_are_short_and_exact_where_they_can_be() {
        assert_eq!(fmt_value(0.75), "0.75");
        assert_eq!(fmt_value(12.0), "12");
        assert_eq!(fmt_value(1796.2181), "1796");
        assert_eq!(fmt_value(112.2636), "112.3");
        assert_eq!(fmt_value(0.000_624_8), "0.0006248");
        assert_eq!(fmt_value(-0.00001), "-1.000e-5");
        assert_eq!(fmt_value(-0.0), "0");
        assert_eq!(bar(0.001, 40), "█");
        assert_eq!(bar(0.5, 40).chars().count(), 20);
    }

    #[test]
    fn learner_is_found_by_its_metrics_and_throughput_by_completion_times() {
        let mut rows = Vec::new();
        for step in 0..3u64 {
            for worker in 0..2 {
                rows.push(row(step, worker, "gen", names::ROWS_OUT, 10.0));
                rows.push(row(step, worker, "gen", names::BUSY_S, 1.0));
            }
            rows.push(row(step, 2, "train", "loss", 3.0 - step as f64));
            rows.push(row(step, 2, "train", names::ROWS_IN, 20.0));
            rows.push(row(
                step,
                2,
                "train",
                names::DONE_UNIX_S,
                100.0 + 2.0 * step as f64,
            ));
            rows.push(row(
                step,
                0,
                "gen",
                names::DONE_UNIX_S,
                99.0 + 2.0 * step as f64,
            ));
        }
        let run = RunMetrics {
            path: PathBuf::from("metrics.parquet"),
            rows,
        };
        assert_eq!(run.learner(), Some("train"));
        let t = run.throughput().unwrap();
        assert_eq!((t.stage, t.metric), ("train", names::ROWS_IN));
        assert_eq!(t.overall(), Some((10.0, 0.5)));
        assert_eq!(t.rates(), vec![(1, 10.0), (2, 10.0)]);
        assert_eq!(run.wall_s(), Some(5.0));
        assert_eq!(run.busy_by_stage()["gen"], (2, 6.0));
        let curves = run.curves();
        assert_eq!(curves.len(), 1);
        assert_eq!(curves[0].0, "loss");
        assert_eq!(
            curves[0].1.values().copied().collect::<Vec<_>>(),
            [3.0, 2.0, 1.0]
        );

        // Without a learner, rows are counted out of the stage that finishes last.
        let run = RunMetrics {
            rows: run.rows.into_iter().filter(|r| r.stage == "gen").collect(),
            ..run
        };
        let t = run.throughput().unwrap();
        assert_eq!((t.stage, t.metric), ("gen", names::ROWS_OUT));
        assert_eq!(t.overall(), Some((10.0, 0.5)));
    }
}
