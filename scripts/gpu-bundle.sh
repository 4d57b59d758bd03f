#!/usr/bin/env bash
# Builds here, for scripts/gpu-check.sh on a CUDA machine that has neither
# a Rust toolchain nor a network (a machine lent for a few minutes), what
# the checks run: the weir binary, the test binaries of the parity and NCCL
# checks and the generation bench, force-linked against libtorch_cuda
# (TCH_LINK_CUDA=1, see build/libtorch_rpath.rs) and stripped, with the
# in .gpu/bundle.tar.xz (.gpu/ is ignored; the fixtures come with the checkout).
# It builds in a target folder of its own (target/gpu-bundle), so the
# usual build here is not relinked; the first time takes ~12 minutes on
# two cores. WEIR_GPU_BUNDLE_CUDA=0 makes a bundle without the CUDA link
# from the usual build (for a rehearsal on this machine, whose minimal
# libtorch cannot load libtorch_cuda).
#
# There, with .gpu/ copied beside the checkout, `./scripts/gpu-check.sh`
# finds the bundle when `cargo` is missing (or WEIR_GPU_BUNDLE=1), takes
# libtorch from that machine's python3 torch (it must be the same version,
# 2.11, as scripts/setup.sh installs here), and runs the same checks
# without building. Rehearse it here with
# `WEIR_GPU_BUNDLE=1 WEIR_GPU_CHECK_DEVICE=cpu ./scripts/gpu-check.sh`.
#
#   ./scripts/gpu-bundle.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
./scripts/setup.sh >/dev/null

if [ "${WEIR_GPU_BUNDLE_CUDA:-1}" != 0 ]; then
  export TCH_LINK_CUDA=1 CARGO_TARGET_DIR=target/gpu-bundle
fi
# The artefacts' paths, from cargo's own report of what it built.
executables() {
  python3 -c '
import json, sys
want = sys.argv[1]
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == want:
        print(m["executable"])
' "$1"
}
weir="$(cargo build --release --bin weir --message-format=json | executables weir)"
cli="$(cargo test --release --no-run --test cli --message-format=json | executables cli)"
gpu="$(cargo test --release --no-run -p weir-gpu --lib --message-format=json | executables weir_gpu)"
generation="$(cargo bench --no-run --bench generation --message-format=json | executables generation)"
for b in "$weir" "$cli" "$gpu" "$generation"; do
  [ -x "$b" ] || { echo "gpu-bundle: a binary is missing ($b)"; exit 1; }
done
if [ -n "${TCH_LINK_CUDA:-}" ] && ! readelf -d "$weir" | grep -q 'libtorch_cuda.so'; then
  echo "gpu-bundle: $weir does not link libtorch_cuda (is .venv/torch/lib/libtorch_cuda.so there?)"
  exit 1
fi

stage=.gpu/stage
rm -rf "$stage"
mkdir -p "$stage/bin"
strip -o "$stage/bin/weir" "$weir"
strip -o "$stage/bin/cli" "$cli"
strip -o "$stage/bin/gpu-lib" "$gpu"
strip -o "$stage/bin/generation" "$generation"
# The test binaries find the weir binary and the fixtures (tests/fixtures in
# the checkout) by the paths they were built at; gpu-check.sh puts both there.
pwd >"$stage/BUILD_ROOT"
echo "$weir" >"$stage/WEIR_BIN"
git rev-parse HEAD >"$stage/COMMIT"
tar -C "$stage" -cf - . | xz -T0 -6 >.gpu/bundle.tar.xz
rm -rf "$stage"
echo "gpu-bundle: .gpu/bundle.tar.xz ($(du -h .gpu/bundle.tar.xz | cut -f1), commit $(git rev-parse --short HEAD)); carry .gpu to the CUDA machine and run ./scripts/gpu-check.sh there"
