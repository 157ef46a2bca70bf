#!/usr/bin/env bash
# The prepared check of the CUDA build on one GPU, in two halves:
#
#   bash scripts/gpu-check.sh prepare   # here, no GPU needed: links the binary
#                                       # (scripts/cuda-link.sh) and gathers it with the fixtures
#                                       # it needs into .gpu-check/ (ignored; about 15 MB)
#   bash scripts/gpu-check.sh run       # on the GPU machine, .gpu-check/ carried along
#
# With the workplace's device tool: run(command = "bash scripts/gpu-check.sh run",
# carry = [".gpu-check"], timeout_s = 540). `run` takes under 8 minutes on an H100/H200:
#   1. `score` of qwen3-tiny and qwen3-vl-tiny on CUDA within 1e-4 of the same binary on the CPU
#      (f32);
#   2. the grpo-step fixture replayed on CUDA: loss, pg_loss, kl and grad_norm within 1e-4
#      relative of the CPU replay, and every parameter after the step within 1e-4 of it (the
#      fixture's own tolerance against verl);
#   3. `generate` of qwen3-tiny, greedy, on CUDA (the pooled KV cache) gives the CPU's tokens;
#   4. `bench grpo-step --device cuda` on W1 (f32) and on Qwen3-0.6B's shape (random bf16
#      weights): seconds per phase, tokens/s, TFLOP/s against the GPU's measured matmul peak, and
#      the most GPU memory in use;
#   5. `bench generate --device cuda` on W1 with 256 sequences (the issue's decode target:
#      5,000 tokens/s on an H200) and on Qwen3-0.6B's shape in bf16;
#   6. `dist-check --device cuda` in a group of one: an NCCL communicator, a checked all-reduce.
# Each check prints PASS or FAIL with its figures; the whole report also goes to
# $OUT/gpu-check.txt when $OUT is set. The exit status is non-zero if any check failed.
# OXRL_GPU_CHECK_DEVICE=cpu rehearses `run` on a machine without a GPU (every "cuda" run on the
# CPU instead; the 0.6B bench then runs out of time).
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
kit="$root/.gpu-check"

prepare() {
    set -e
    local fixtures="$root/../shared/fixtures"
    [ -d "$fixtures" ] || { echo "gpu-check: no fixtures at $fixtures" >&2; exit 1; }
    bash "$root/scripts/cuda-link.sh"
    rm -rf "$kit"
    mkdir -p "$kit/fixtures"
    cp "$root/target/cuda-release/oxrl-cuda.xz" "$kit/"
    for f in qwen3-tiny qwen3-vl-tiny grpo-step; do
        cp -r "$fixtures/$f" "$kit/fixtures/"
    done
    chmod -R u+w "$kit"
    echo "gpu-check: $(du -sh "$kit" | cut -f1) in $kit; carry it and run: bash scripts/gpu-check.sh run"
}

failed=0
gpu="${OXRL_GPU_CHECK_DEVICE:-cuda}"
pass_or_fail() {
    local name="$1"
    shift
    if "$@"; then
        echo "PASS $name"
    else
        echo "FAIL $name"
        failed=1
    fi
}

# `worst |Δ|` of two `score` outputs, line by line; true when within $3.
scores_match() {
    python3 - "$1" "$2" "$3" <<'EOF'
import json, sys
a = [json.loads(l)["logprobs"] for l in open(sys.argv[1])]
b = [json.loads(l)["logprobs"] for l in open(sys.argv[2])]
assert len(a) == len(b) and all(len(x) == len(y) for x, y in zip(a, b)), "shapes differ"
worst = max(abs(p - q) for x, y in zip(a, b) for p, q in zip(x, y))
print(f"  max |Δ log-prob| vs cpu: {worst:.3g} (tolerance {sys.argv[3]})")
sys.exit(0 if worst <= float(sys.argv[3]) else 1)
EOF
}

# Greedy completions of two `generate` outputs have the same tokens.
generations_match() {
    python3 - "$1" "$2" <<'EOF'
import json, sys
a = [json.loads(l)["response_ids"] for l in open(sys.argv[1])]
b = [json.loads(l)["response_ids"] for l in open(sys.argv[2])]
same = sum(x == y for x, y in zip(a, b))
print(f"  {same} of {len(a)} greedy completions equal ({len(b)} on the second device)")
sys.exit(0 if a and len(a) == len(b) and same == len(a) else 1)
EOF
}

# Two replays' metrics (relative) and checkpoints (absolute, every parameter) agree.
replays_match() {
    python3 - "$1" "$2" <<'EOF'
import json, sys
from safetensors.numpy import load_file
cpu, cuda = sys.argv[1], sys.argv[2]
ok = True
m_cpu = json.loads(open(f"{cpu}/metrics.jsonl").readline())
m_cuda = json.loads(open(f"{cuda}/metrics.jsonl").readline())
for key in ["loss", "pg_loss", "kl", "grad_norm"]:
    rel = abs(m_cuda[key] - m_cpu[key]) / max(abs(m_cpu[key]), 1e-12)
    ok &= rel <= 1e-4
    print(f"  {key}: cpu {m_cpu[key]:.8g} device {m_cuda[key]:.8g} (relative {rel:.2g})")
w_cpu = load_file(f"{cpu}/checkpoint-1/model.safetensors")
w_cuda = load_file(f"{cuda}/checkpoint-1/model.safetensors")
ok &= w_cpu.keys() == w_cuda.keys()
worst = max(float(abs(w_cpu[k].astype("float64") - w_cuda[k]).max()) for k in w_cpu)
ok &= worst <= 1e-4
print(f"  {len(w_cpu)} parameters, max |Δ| after the step: {worst:.3g} (tolerance 1e-4)")
sys.exit(0 if ok else 1)
EOF
}

replay() {
    local device="$1" out="$2" f="$kit/fixtures/grpo-step"
    cat >"$out.toml" <<EOF
[model]
path = "$f/policy"
[reference]
path = "$f/ref"
[algorithm]
advantage = "grpo"
adv_eps = 1e-6
policy_loss = "ppo_clip"
clip_low = 0.2
clip_high = 0.28
kl_coef = 0.01
kl_estimator = "k3"
loss_agg = "token_mean"
old_logprobs = "rollout"
[trainer]
micro_batch_size = 12
lr = 1e-3
adam_betas = [0.9, 0.999]
adam_eps = 1e-8
weight_decay = 0.01
max_grad_norm = 1.0
EOF
    timeout 120 "$oxrl" train --config "$out.toml" --rollouts "$f/rollouts.jsonl" --max-steps 1 \
        --output-dir "$out" --device "$device" >/dev/null
}

run_checks() {
    [ -f "$kit/oxrl-cuda.xz" ] || { echo "gpu-check: no $kit/oxrl-cuda.xz: run 'prepare' first and carry .gpu-check" >&2; return 1; }
    local work
    work="$(mktemp -d)"
    oxrl="$work/oxrl"
    xz -dc "$kit/oxrl-cuda.xz" >"$oxrl" && chmod +x "$oxrl"
    # The CUDA libraries the binary links (cuBLAS, cuRAND, NVRTC, NCCL): the NVIDIA wheels in
    # this machine's Python environment.
    local libdirs
    libdirs="$(python3 -c 'import site; print("\n".join(site.getsitepackages()))' |
        while read -r s; do ls -d "$s"/nvidia/*/lib "$s"/nvidia/lib 2>/dev/null; done | tr '\n' ':')"
    export LD_LIBRARY_PATH="${libdirs}${LD_LIBRARY_PATH:-}"
    if ldd "$oxrl" | grep "not found"; then
        echo "FAIL libraries: the ones above are not on this machine"
        return 1
    fi
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader

    for model in qwen3-tiny qwen3-vl-tiny; do
        local m="$kit/fixtures/$model"
        for device in cpu "$gpu"; do
            timeout 120 "$oxrl" score --model "$m" --input "$m/cases.jsonl" --device "$device" \
                --output "$work/$model.$device.jsonl" || echo "  score on $device failed"
        done
        pass_or_fail "score $model ($gpu vs cpu, f32)" \
            scores_match "$work/$model.cpu.jsonl" "$work/$model.$gpu.jsonl" 1e-4
    done

    replay cpu "$work/replay-cpu" || echo "  the CPU replay failed"
    replay "$gpu" "$work/replay-gpu" || echo "  the $gpu replay failed"
    pass_or_fail "grpo-step replay ($gpu vs cpu)" replays_match "$work/replay-cpu" "$work/replay-gpu"

    local tiny="$kit/fixtures/qwen3-tiny"
    for device in cpu "$gpu"; do
        timeout 120 "$oxrl" generate --model "$tiny" --input "$tiny/cases.jsonl" --device "$device" \
            --temperature 0 --max-new-tokens 32 --ignore-eos --output "$work/greedy.$device.jsonl" ||
            echo "  generate on $device failed"
    done
    pass_or_fail "generate qwen3-tiny greedy ($gpu vs cpu)" \
        generations_match "$work/greedy.cpu.jsonl" "$work/greedy.$gpu.jsonl"

    # NCCL in a group of one (rank 0 serves the rendezvous store): a communicator on the GPU,
    # a checked all-reduce and its time.
    pass_or_fail "dist-check: NCCL, world size 1" \
        env RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29517 \
        timeout 60 "$oxrl" dist-check --device "$gpu" --megabytes 256

    pass_or_fail "bench grpo-step w1 f32" \
        timeout 150 "$oxrl" bench grpo-step --device "$gpu" --shape w1 --dtype f32
    pass_or_fail "bench grpo-step qwen3-0.6b bf16" \
        timeout 240 "$oxrl" bench grpo-step --device "$gpu" --shape qwen3-0.6b --dtype bf16
    pass_or_fail "bench generate w1 f32, 256 sequences" \
        timeout 90 "$oxrl" bench generate --device "$gpu" --shape w1 --prompts 32 --n 8 --new-tokens 128
    pass_or_fail "bench generate qwen3-0.6b bf16, 256 sequences" \
        timeout 90 "$oxrl" bench generate --device "$gpu" --shape qwen3-0.6b --dtype bf16 --prompts 32 --n 8 --new-tokens 128
    [ "$failed" = 0 ] && echo "gpu-check: every check passed" || echo "gpu-check: some checks FAILED"
    return "$failed"
}

case "${1:-}" in
prepare) prepare ;;
run)
    if [ -n "${OUT:-}" ]; then
        run_checks 2>&1 | tee "$OUT/gpu-check.txt"
        exit "${PIPESTATUS[0]}"
    fi
    run_checks
    ;;
*)
    echo "usage: bash scripts/gpu-check.sh prepare|run" >&2
    exit 2
    ;;
esac
