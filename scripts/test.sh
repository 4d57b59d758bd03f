#!/usr/bin/env bash
# Runs every test of weir on a fresh machine: set-up (libtorch venv), then
# formatting and lints, then the whole workspace's unit, integration and doc
# tests.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
./scripts/setup.sh
# The readers of docs/rollout-log.md's example, which a test runs on a
# real run's log (the venv setup.sh made, or one of their own).
[ -x .venv/bin/python ] || python3 -m venv .venv
if ! .venv/bin/python -c 'import polars, duckdb' 2>/dev/null; then
  .venv/bin/pip install -q polars==2.1.0 duckdb==2.0.1
fi
# A one-off build gains nothing from incremental state, which would add
# gigabytes to target/.
export CARGO_INCREMENTAL=0
# What every change must keep: formatting and lints, then every test.
cargo fmt --all --check
cargo clippy --workspace --all-targets -- -D warnings
cargo test --workspace --all-targets
cargo test --workspace --doc
