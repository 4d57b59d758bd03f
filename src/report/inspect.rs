//! `weir inspect`: the terminal summary of a run folder, with sparklines,
//! staleness bars and figures formatted to four significant digits.

use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::path::Path;

use weir_graph::Step;

use super::RunMetrics;

/// Characters of a sparkline at most (longer series are averaged down).
pub(super) const SPARK_WIDTH: usize = 60;
/// Characters of the longest staleness bar.
const BAR_WIDTH: usize = 40;

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
    write_weights(&run, &mut out)?;
    write_stages(&run, &mut out)?;
    write_folder_extras(run_dir, &mut out)?;
    Ok(out)
}

/// The weights edge: versions loaded by the generators, their size, and
/// the medians of the transfer (send to whole in the generator's process)
/// and of the generator's pause to apply them.
fn write_weights(run: &RunMetrics, out: &mut String) -> std::fmt::Result {
    use weir_graph::metrics::names;
    let values = |metric: &str| -> Vec<f64> {
        let mut v: Vec<f64> = run
            .rows
            .iter()
            .filter(|r| r.metric == metric)
            .map(|r| r.value)
            .collect();
        v.sort_by(f64::total_cmp);
        v
    };
    let median = |v: &[f64]| v[v.len() / 2];
    let (transfer, load, bytes) = (
        values(names::WEIGHTS_TRANSFER_S),
        values(names::WEIGHTS_LOAD_S),
        values(names::WEIGHTS_BYTES),
    );
    if transfer.is_empty() {
        return Ok(());
    }
    write!(
        out,
        "\n{:<12} {} loads by the generators, median transfer {} s",
        "weights",
        transfer.len(),
        fmt_value(median(&transfer))
    )?;
    if !load.is_empty() {
        write!(out, ", median apply {} s", fmt_value(median(&load)))?;
    }
    if !bytes.is_empty() {
        write!(out, ", {} MB each", fmt_value(median(&bytes) / 1e6))?;
    }
    writeln!(out)
}

/// Steps, wall time and throughput.
fn write_progress(run: &RunMetrics, out: &mut String) -> std::fmt::Result {
    // (The final evaluation's rows sit one step past the last.)
    let steps: BTreeSet<Step> = run
        .rows
        .iter()
        .filter(|r| r.stage != weir_pipelines::eval::STAGE)
        .map(|r| r.step)
        .collect();
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
}
