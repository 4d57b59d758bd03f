//! A progress bar fed by the engine's live metrics stream: step, reward,
//! KL, loss and samples/s as the learner finishes each step. Where stderr
//! is not a terminal (a log file, a batch job) the bar cannot redraw: each
//! finished step is one plain line there instead:
//! `grpo step 4 (5/24) reward 0.812 kl 0.003 loss -0.021 35.2 samples/s`.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use weir_graph::metrics::{names, MetricRow};
use weir_graph::MetricsObserver;

/// The trainer stages whose figures the bar shows.
const TRAINERS: &[&str] = &["learn", "sft", "rm", "dpo"];

#[derive(Default)]
struct State {
    /// Per step: the trainer's figures seen so far.
    steps: BTreeMap<u64, BTreeMap<String, f64>>,
    /// When the first step finished.
    started: Option<f64>,
    /// Rows of the steps finished since.
    rows: f64,
}

/// A bar over `total` steps starting at `first`; hidden when `visible` is false.
pub fn observer(
    title: &str,
    first: u64,
    total: u64,
    visible: bool,
) -> (MetricsObserver, ProgressBar) {
    use std::io::IsTerminal;
    let bar = ProgressBar::new(total);
    let terminal = std::io::stderr().is_terminal();
    bar.set_draw_target(if visible && terminal {
        ProgressDrawTarget::stderr()
    } else {
        ProgressDrawTarget::hidden()
    });
    let lines = visible && !terminal;
    let name = title.to_string();
    bar.set_style(
        ProgressStyle::with_template(
            "{prefix} [{bar:30}] {pos}/{len} {msg} ({elapsed}, eta {eta})",
        )
        .expect("a valid template")
        .progress_chars("=> "),
    );
    bar.set_prefix(title.to_string());
    bar.set_position(first);
    let state = Arc::new(Mutex::new(State::default()));
    let handle = bar.clone();
    let observe = move |rows: &[MetricRow]| {
        let mut s = state.lock().unwrap_or_else(|e| e.into_inner());
        // The KL of pipelines that put it in the reward comes from their advantage stage.
        let shown = |r: &&MetricRow| {
            TRAINERS.contains(&r.stage.as_str()) || (r.stage == "advantage" && r.metric == "kl")
        };
        for r in rows.iter().filter(shown) {
            s.steps
                .entry(r.step)
                .or_default()
                .insert(r.metric.clone(), r.value);
        }
        // A step is shown once its completion time arrived.
        let done: Vec<u64> = s
            .steps
            .iter()
            .filter(|(_, m)| m.contains_key(names::DONE_UNIX_S))
            .map(|(k, _)| *k)
            .collect();
        for step in done {
            let m = s.steps.remove(&step).unwrap_or_default();
            let at = m[names::DONE_UNIX_S];
            // Throughput counts the rows of steps that finished after the first one.
            let started = match s.started {
                Some(t) => {
                    s.rows += m.get(names::ROWS_IN).copied().unwrap_or(0.0);
                    t
                }
                None => *s.started.insert(at),
            };
            let mut figures = String::new();
            for (key, label) in [
                ("reward", "reward"),
                ("kl", "kl"),
                ("loss", "loss"),
                ("accuracy", "acc"),
                ("reward_margin", "margin"),
            ] {
                if let Some(v) = m.get(key) {
                    figures.push_str(&format!(" {label} {v:.3}"));
                }
            }
            if at > started {
                figures.push_str(&format!(" {:.1} samples/s", s.rows / (at - started)));
            }
            if lines {
                eprintln!("{name} step {step} ({}/{total}){figures}", step + 1);
            }
            handle.set_message(format!("step {step}{figures}"));
            handle.set_position((step + 1).max(handle.position()));
        }
    };
    (Arc::new(observe), bar)
}
