#!/usr/bin/env bash
# Runs a command with a CUDA 13.0 compiler and no GPU: `scripts/cuda-env.sh cargo check
# --workspace --features cuda`. The compiler comes from the pinned, hash-checked wheels in
# scripts/cuda-compiler.txt, unpacked once into .cuda/ by unpack-wheels.sh (ignored; fetched
# again when the pins change). CUDA_COMPUTE_CAP (default 90: H100/H200) tells candle's kernel
# build which GPU to compile for, so it never asks nvidia-smi. OXRL_CUDA_DIR names the unpacked
# toolkit (NVRTC's library is in its lib/).
#
# `scripts/cuda-env.sh --lint-only cargo clippy …` swaps nvcc for scripts/nvcc-lint-stub, which
# writes candle's kernels empty instead of compiling them (minutes of CI on 2 cores) — enough to
# type-check and lint the Rust; it then deletes candle-kernels' build outputs, so no later build
# links the empty kernels.
set -euo pipefail
lint_only=false
if [ "${1:-}" = "--lint-only" ]; then
    lint_only=true
    shift
fi
root="$(cd "$(dirname "$0")/.." && pwd)"
pins="$root/scripts/cuda-compiler.txt"
cuda="$root/.cuda"
bash "$root/scripts/unpack-wheels.sh" "$pins" "$cuda"
export PATH="$cuda/nvidia/cu13/bin:$PATH"
export CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-90}"
export OXRL_CUDA_DIR="$cuda/nvidia/cu13"
if ! $lint_only; then
    exec "$@"
fi
export OXRL_REAL_NVCC="$cuda/nvidia/cu13/bin/nvcc"
export NVCC="$root/scripts/nvcc-lint-stub"
forget_empty_kernels() {
    local target="${CARGO_TARGET_DIR:-$root/target}"
    rm -rf "$target"/*/build/candle-kernels-* "$target"/*/.fingerprint/candle-kernels-*
}
trap forget_empty_kernels EXIT
"$@"
