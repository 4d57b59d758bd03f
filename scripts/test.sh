#!/usr/bin/env bash
# Runs every test of weir on a fresh machine: set-up (libtorch venv), then
# formatting and lints, then the whole workspace's unit, integration and doc
# tests.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
./scripts/setup.sh
# A one-off build gains nothing from incremental state, which would add
# gigabytes to target/.
export CARGO_INCREMENTAL=0
# What every change must keep: formatting and lints, then every test.
cargo fmt --all --check
cargo clippy --workspace --all-targets -- -D warnings
cargo test --workspace --all-targets
cargo test --workspace --doc
