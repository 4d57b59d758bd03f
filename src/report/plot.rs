//! `weir plot`: PNG charts of a run folder, drawn with `plotters` on its
//! bitmap backend, with text set in a font embedded in the binary.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use anyhow::{bail, Context};
use plotters::prelude::*;
use plotters::style::FontStyle;
use weir_graph::Step;

use super::inspect::SPARK_WIDTH;
use super::RunMetrics;

/// The per-step curves `plot` draws, each when recorded.
const PLOTTED: [&str; 7] = [
    "reward",
    "kl",
    "teacher_kl",
    "gkd_divergence",
    "entropy",
    "loss",
    "row_latency_s",
];

/// A streaming generator's per-step figures, each drawn when recorded:
/// (metric, y axis, whether the axis starts at zero).
const GENERATOR: [(&str, &str, bool); 4] = [
    (
        "slot_occupancy",
        "sequences in flight / generate.max_inflight",
        true,
    ),
    ("inflight", "sequences in flight (mean over passes)", true),
    ("partial_ratio", "rows whose tokens span versions", true),
    ("weights_apply_s", "seconds per weights update", true),
];

/// Line colours, in the order of a chart's series (matplotlib's tab10).
const PALETTE: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
];

/// Pixels of every chart.
const CHART_SIZE: (u32, u32) = (960, 540);
/// The family every chart's text is set in (plotters' default family).
const FONT_FAMILY: &str = "sans-serif";
/// DejaVu Sans cut down to the characters charts use; see assets/fonts/LICENSE-DejaVu.txt.
const FONT: &[u8] = include_bytes!("../../assets/fonts/DejaVuSans-subset.ttf");

/// Writes PNG charts of the run in `run_dir` to `RUN_DIR/plots/`: one per
/// recorded learner curve (`reward.png`, `kl.png`, distillation's
/// `teacher_kl.png` and, over the teacher's top k, `gkd_divergence.png`, `entropy.png`,
/// `loss.png`, `row_latency_s.png`: from a row's start to its training), a
/// streaming generator's `generate_slot_occupancy.png`,
/// `generate_inflight.png`, `generate_partial_ratio.png` and
/// `generate_weights_apply_s.png`, the held-out evaluation (`eval_reward.png`,
/// `eval_pass_at_k.png`), `staleness.png`, `throughput.png` and `idle.png`
/// (each stage's idle share of its step time) when their figures exist.
/// Returns the paths written.
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
                    series: vec![(String::new(), series.into_iter().collect())],
                    from_zero: false,
                },
            ));
        }
    }
    for (metric, y_desc, from_zero) in GENERATOR {
        let series = run.per_step(Some("generate"), metric, super::Fold::Mean);
        if !series.is_empty() {
            charts.push((
                dir.join(format!("generate_{metric}.png")),
                Chart::Line {
                    title: format!("generator {metric} per step — {name}"),
                    y_desc: y_desc.into(),
                    series: vec![(String::new(), series.into_iter().collect())],
                    from_zero,
                },
            ));
        }
    }
    for metric in ["reward", "pass_at_k"] {
        let stage = weir_pipelines::eval::STAGE;
        let series = run.per_step(Some(stage), metric, super::Fold::Mean);
        if !series.is_empty() {
            charts.push((
                dir.join(format!("eval_{metric}.png")),
                Chart::Line {
                    title: format!("held-out {metric} by step ({stage}) — {name}"),
                    y_desc: format!("eval {metric}"),
                    series: vec![(String::new(), series.into_iter().collect())],
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
                    series: vec![(String::new(), points)],
                    from_zero: true,
                },
            ));
        }
    }
    let idle = run.idle_fractions();
    if !idle.is_empty() {
        charts.push((
            dir.join("idle.png"),
            Chart::Line {
                title: format!("idle share of each stage's step time — {name}"),
                y_desc: "1 − busy / (wall since its last step × workers)".into(),
                series: idle
                    .into_iter()
                    .map(|(stage, points)| (stage.to_string(), points))
                    .collect(),
                from_zero: true,
            },
        ));
    }
    if charts.is_empty() {
        bail!(
            "{}: nothing to plot (no reward, kl, entropy, loss, staleness or done_unix_s metrics)",
            run.path.display()
        );
    }
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    for (path, chart) in &charts {
        // Drawn to an exclusive temporary and renamed: never through a link.
        weir_durable::write_through_path(path, |temporary| {
            chart.draw(temporary).map_err(std::io::Error::other)
        })
        .with_context(|| format!("drawing {}", path.display()))?;
    }
    Ok(charts.into_iter().map(|(path, _)| path).collect())
}

/// One chart to draw.
enum Chart {
    /// Curves over steps, named in a legend when there are several.
    Line {
        title: String,
        y_desc: String,
        series: Vec<(String, Vec<(Step, f64)>)>,
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
                series,
                from_zero,
            } => {
                let steps = series.iter().flat_map(|(_, p)| p.iter().map(|p| p.0));
                let first = steps.clone().min().unwrap_or(0);
                let last = steps.max().unwrap_or(0);
                let xs = first..last.max(first + 1);
                let values = series.iter().flat_map(|(_, p)| p.iter().map(|p| p.1));
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
                for (i, (label, points)) in series.iter().enumerate() {
                    let colour = PALETTE[i % PALETTE.len()];
                    let line = chart
                        .draw_series(LineSeries::new(
                            points.iter().copied().filter(|p| p.1.is_finite()),
                            colour.stroke_width(2),
                        ))
                        .map_err(plot_error)?;
                    if series.len() > 1 {
                        line.label(label.as_str()).legend(move |(x, y)| {
                            PathElement::new(vec![(x, y), (x + 20, y)], colour.stroke_width(2))
                        });
                    }
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
                if series.len() > 1 {
                    chart
                        .configure_series_labels()
                        .background_style(WHITE.mix(0.85))
                        .border_style(BLACK)
                        .label_font((FONT_FAMILY, 15))
                        .draw()
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
