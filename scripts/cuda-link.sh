#!/usr/bin/env bash
# Links a release CUDA binary of oxrl on a machine with no GPU and no CUDA install, stripped and
# xz-compressed to carry to a GPU machine: target/cuda-release/oxrl-cuda.xz (checked to be under
# 60 MB). The compiler comes from scripts/cuda-env.sh; the libraries it links against from the
# pinned wheels in scripts/cuda-libraries.txt (unpacked once into .cuda-libs/), and libcuda.so.1 —
# which only a GPU driver provides — from a stub generated here that defines every driver
# function cudarc declares. On the GPU machine the real libraries are found by soname:
#   xz -d oxrl-cuda.xz && chmod +x oxrl-cuda && LD_LIBRARY_PATH=<cuBLAS, cuRAND, NVRTC, NCCL dirs> ./oxrl-cuda
# (scripts/gpu-check.sh finds them in the GPU machine's Python site-packages.)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
pins="$root/scripts/cuda-libraries.txt"
libs="$root/.cuda-libs"
bash "$root/scripts/unpack-wheels.sh" "$pins" "$libs"

bash "$root/scripts/cuda-env.sh" true # the compiler wheels (cudart and NVRTC are there)

# The linker asks for libNAME.so; the wheels ship libNAME.so.MAJOR.
link_dir="$libs/link"
rm -rf "$link_dir"
mkdir -p "$link_dir"
for lib in "$libs"/nvidia/*/lib/lib*.so.* "$root"/.cuda/nvidia/cu13/lib/lib*.so.*; do
    [ -e "$lib" ] || continue
    name="$(basename "$lib")"
    ln -sf "$lib" "$link_dir/${name%%.so.*}.so"
done

# libcuda: every cu* function in cudarc's driver bindings, as an empty function.
cudarc="$(cargo metadata --all-features --format-version 1 --manifest-path "$root/Cargo.toml" |
    python3 -c 'import json, sys; print(next(p["manifest_path"] for p in json.load(sys.stdin)["packages"] if p["name"] == "cudarc"))')"
bindings="$(dirname "$cudarc")/src/driver/sys/mod.rs"
grep -oE '^ +fn cu[A-Za-z0-9_]+\(' "$bindings" | sed -E 's/^ +fn (cu[A-Za-z0-9_]+)\(/void \1(void) {}/' |
    sort -u >"$link_dir/libcuda-stub.c"
cc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$link_dir/libcuda.so" "$link_dir/libcuda-stub.c"

export RUSTFLAGS="${RUSTFLAGS:-} -L native=$link_dir"
out="$root/target/cuda-release"
bash "$root/scripts/cuda-env.sh" cargo build --release --features cuda -p oxrl --target-dir "$out"
strip -o "$out/oxrl-cuda" "$out/release/oxrl"
xz -9 -T0 -c "$out/oxrl-cuda" >"$out/oxrl-cuda.xz"
size=$(stat -c %s "$out/oxrl-cuda.xz")
needs="$(readelf -d "$out/oxrl-cuda" | grep -oE '\[lib[^]]+\]' | tr -d '[]' | tr '\n' ' ')"
echo "cuda-link: $out/oxrl-cuda.xz ($((size / 1024 / 1024)) MB; needs $needs)"
if [ "$size" -ge $((60 * 1024 * 1024)) ]; then
    echo "cuda-link: the compressed binary is over 60 MB" >&2
    exit 1
fi
