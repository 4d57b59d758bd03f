//! The commands as a user runs them: `weir logprobs`, `weir generate`,
//! `weir score` on the fixture checkpoints, checked against the float64
//! transformers references; bad input lines are named and nothing is written.
//! `weir inspect` and `weir plot` on a run folder of known metrics and on a
//! `weir sim` run.
//! The binary's modules: `acceptance` (the demos), `models` (the model
//! commands), `report` (`inspect`, `plot`), `runs` (`config`, `run` in one
//! and two processes), `crash` (SIGKILL at random moments, then resume).

use std::path::{Path, PathBuf};
use std::process::Command;

use arrow::array::RecordBatch;
use serde_json::Value;
use weir::graph::parquet_log::read_parquet_file;

mod acceptance;
mod bad_input;
#[path = "../common/mod.rs"]
mod common;
mod crash;
mod log;
mod models;
mod report;
mod runs;
mod security;

pub(crate) fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/models")
}

pub(crate) fn reference(model: &str) -> Value {
    serde_json::from_str(
        &std::fs::read_to_string(fixtures().join(model).join("reference.json")).unwrap(),
    )
    .unwrap()
}

/// With `WEIR_TEST_DEVICE` (e.g. `cuda`, as `scripts/gpu-check.sh` sets
/// it), the model commands (`logprobs`, `generate`, `score`) run on that
/// device, held to the same references.
pub(crate) fn weir(args: &[&str], dir: &Path) -> std::process::Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_weir"));
    cmd.args(args).current_dir(dir);
    let model_command = matches!(args.first(), Some(&("logprobs" | "generate" | "score")));
    if let Ok(device) = std::env::var("WEIR_TEST_DEVICE") {
        if model_command && !args.contains(&"--device") {
            cmd.args(["--device", &device]);
        }
    }
    cmd.output().unwrap()
}

/// Writes `in.jsonl` with one `{"input_ids": …}` line per reference case.
pub(crate) fn write_input_ids(dir: &Path, cases: &[Value]) {
    let lines: Vec<String> = cases
        .iter()
        .map(|c| serde_json::json!({"input_ids": c["input_ids"]}).to_string())
        .collect();
    std::fs::write(dir.join("in.jsonl"), lines.join("\n")).unwrap();
}

pub(crate) fn read(path: &Path) -> RecordBatch {
    let batches = read_parquet_file(path).unwrap();
    arrow::compute::concat_batches(&batches[0].schema(), &batches).unwrap()
}

pub(crate) fn success(out: &std::process::Output) -> String {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout.clone()).unwrap()
}
