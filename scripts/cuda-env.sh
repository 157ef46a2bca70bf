#!/usr/bin/env bash
# Runs a command with a CUDA 13.0 compiler and no GPU: `scripts/cuda-env.sh cargo check
# --workspace --features cuda`. The compiler comes from the pinned, hash-checked wheels in
# scripts/cuda-compiler.txt, unpacked once into .cuda/ by unpack-wheels.sh (ignored; fetched
# again when the pins change). CUDA_COMPUTE_CAP (default 90: H100/H200) tells candle's kernel
# build which GPU to compile for, so it never asks nvidia-smi. OXRL_CUDA_DIR names the unpacked
# toolkit (NVRTC's library is in its lib/).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
pins="$root/scripts/cuda-compiler.txt"
cuda="$root/.cuda"
bash "$root/scripts/unpack-wheels.sh" "$pins" "$cuda"
export PATH="$cuda/nvidia/cu13/bin:$PATH"
export CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-90}"
export OXRL_CUDA_DIR="$cuda/nvidia/cu13"
exec "$@"
