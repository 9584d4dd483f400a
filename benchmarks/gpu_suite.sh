#!/usr/bin/env bash
# The Triton engine on a GPU, one stage per device call (or several joined, as time allows):
#
#   benchmarks/gpu_suite.sh tests OUT_DIR   # the CUDA test module vs float64 (fp32, bf16, fp16)
#   benchmarks/gpu_suite.sh d128 OUT_DIR    # attention_gpu.py at D=128 (the issue's targets)
#   benchmarks/gpu_suite.sh d64 OUT_DIR     # attention_gpu.py at D=64
#   benchmarks/gpu_suite.sh weightings OUT_DIR
#                                           # attention_gpu.py at D=128, N=8k: each weighting
#                                           # beside the Triton softmax (dot, causal) and SDPA
#   benchmarks/gpu_suite.sh tiles OUT_DIR   # triton_tiling.py: candidate tile shapes, D=128, 64,
#                                           # beside FlexAttention (its kernel source kept) and
#                                           # a bare FA-2 forward
#   [BASELINE_SRC=DIR] benchmarks/gpu_suite.sh profile OUT_DIR
#                                           # triton_profile.py at D=128: device time per
#                                           # kernel against host time per call (qkv,
#                                           # FlexAttention, SDPA) and a bare FA-2 forward
#                                           # with the engine's extra steps one at a time;
#                                           # with BASELINE_SRC, qkv's rows on that src first
#   BASELINE_SRC=DIR benchmarks/gpu_suite.sh ab OUT_DIR
#                                           # triton_tiling.py at D=128 on the src in DIR (an
#                                           # older commit's, unpacked with git archive before
#                                           # the call), then on this tree's, in one run
#
# Stages may be joined with commas (tests,d128). Each writes its log and tables under OUT_DIR,
# and the benchmarks write their figures there as JSON (benchmarks/results.py:
# gpu-<date>-<device>.json from attention_gpu.py, gpu-tiling-... and gpu-profile-...), to be
# copied into benchmarks/results/ when the run comes back (QKV_RESULTS_DIR overrides OUT_DIR).
# Without a GPU (any machine, a clean checkout) the tests skip with their reason and the
# benchmark runs its --smoke mode in Triton's interpreter, so the script itself is checked.
# Environment: PYTHON (default python3), WORKERS (pytest-xdist workers, default 12),
# TESTS_TIMEOUT / BENCH_BUDGET (seconds; defaults fit a 10-minute call).
set -uo pipefail

stages=${1:?usage: gpu_suite.sh tests|d128|d64|weightings|tiles|profile|ab[,...] OUT_DIR}
out=${2:?usage: gpu_suite.sh tests|d128|d64|weightings|tiles|profile|ab[,...] OUT_DIR}
root=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-python3}
mkdir -p "$out"
cd "$root" || exit 1
export PYTHONPATH="$root/src:$root${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export QKV_RESULTS_DIR=${QKV_RESULTS_DIR:-$out}

if "$py" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())'; then
    gpu=1
else
    gpu=0
    export TRITON_INTERPRET=1
fi

run_tests() {
    local errors
    errors=$(mktemp -d)
    local xdist=()
    if [ "$gpu" = 1 ] && "$py" -c 'import xdist' 2>/dev/null; then
        xdist=(-n "${WORKERS:-12}")
    fi
    QKV_GPU_RESULTS=$errors timeout "${TESTS_TIMEOUT:-240}" "$py" -m pytest -q -p no:cacheprovider \
        "${xdist[@]}" tests/core/test_triton_cuda.py 2>&1 | tee "$out/cuda_tests.log"
    local status=${PIPESTATUS[0]}
    "$py" - "$errors" "$out/cuda_errors.json" <<'EOF'
import glob, json, sys
merged = {}
for path in glob.glob(f"{sys.argv[1]}/*.json"):
    merged.update(json.load(open(path)))
json.dump(merged, open(sys.argv[2], "w"), indent=1, sort_keys=True)
worst = {}
for name, r in merged.items():
    dtype = name.rsplit("/", 1)[1] if "/" in name else "fp32"
    out = r.get("out", 0.0)
    grads = max(r.get("grads") or r.get("errors") or [0.0])
    best = worst.setdefault(dtype, [0.0, "", 0.0, ""])
    if out > best[0]:
        best[0:2] = out, name
    if grads > best[2]:
        best[2:4] = grads, name
print(f"\nerrors vs float64 ({len(merged)} results):")
for dtype, (out, on, grads, gn) in sorted(worst.items()):
    print(f"  {dtype}: worst out {out:.2e} ({on}); worst gradient {grads:.2e} ({gn})")
EOF
    rm -rf "$errors"
    return "$status"
}

run_bench() {  # $1 = head dim
    local args=(--d "$1")
    if [ "$gpu" = 0 ]; then
        args=(--smoke)
    elif [ "$1" = 128 ]; then
        args+=(--n 8192 1024)
    else
        args+=(--n 1024 4096 16384)
    fi
    "$py" benchmarks/attention_gpu.py "${args[@]}" --budget-s "${BENCH_BUDGET:-420}" 2>&1 \
        | tee "$out/bench_d$1.md"
    return "${PIPESTATUS[0]}"
}

run_weightings() {
    local args=(--d 128 --n 8192 --no-flex)
    if [ "$gpu" = 0 ]; then
        args=(--smoke)
    fi
    "$py" benchmarks/attention_gpu.py "${args[@]}" --weightings \
        --budget-s "${BENCH_BUDGET:-420}" 2>&1 | tee "$out/bench_weightings.md"
    return "${PIPESTATUS[0]}"
}

run_tiles() {
    if [ "$gpu" = 0 ]; then
        echo "tiles: needs a GPU (CUDA events); skipped"
        return 0
    fi
    { "$py" benchmarks/triton_tiling.py --d 128 --n 8192 --heads 16 \
        --flex-source "$out/flex_kernels_d128.py" \
        && "$py" benchmarks/triton_tiling.py --d 64 --n 8192 --heads 32; } 2>&1 \
        | tee "$out/tiles.md"
    return "${PIPESTATUS[0]}"
}

run_profile() {
    if [ "$gpu" = 0 ]; then
        echo "profile: needs a GPU (CUDA events, the profiler); skipped"
        return 0
    fi
    local failed=0
    : > "$out/profile.md"
    if [ -n "${BASELINE_SRC:-}" ]; then
        echo "### src: $BASELINE_SRC (qkv only)" | tee -a "$out/profile.md"
        PYTHONPATH="$BASELINE_SRC:$root" "$py" benchmarks/triton_profile.py --parts qkv \
            2>&1 | tee -a "$out/profile.md" || failed=1
    fi
    echo "### src: $root/src" | tee -a "$out/profile.md"
    "$py" benchmarks/triton_profile.py 2>&1 | tee -a "$out/profile.md" || failed=1
    return "$failed"
}

run_ab() {
    local base=${BASELINE_SRC:?ab: set BASELINE_SRC to the src folder of an older commit}
    if [ "$gpu" = 0 ]; then
        echo "ab: needs a GPU (CUDA events); skipped"
        return 0
    fi
    local failed=0
    : > "$out/ab.md"
    for src in "$base" "$root/src"; do
        echo "### src: $src" | tee -a "$out/ab.md"
        PYTHONPATH="$src:$root" "$py" benchmarks/triton_tiling.py --d 128 --n 8192 --heads 16 \
            2>&1 | tee -a "$out/ab.md" || failed=1
    done
    return "$failed"
}

status=0
IFS=, read -ra wanted <<< "$stages"
for stage in "${wanted[@]}"; do
    echo "== $stage ($(date -u +%H:%M:%S), gpu=$gpu)"
    case $stage in
        tests) run_tests || status=1 ;;
        d128) run_bench 128 || status=1 ;;
        d64) run_bench 64 || status=1 ;;
        weightings) run_weightings || status=1 ;;
        tiles) run_tiles || status=1 ;;
        ab) run_ab || status=1 ;;
        profile) run_profile || status=1 ;;
        *) echo "unknown stage '$stage': expected tests, d128, d64, weightings, tiles, profile" \
                "or ab" >&2; exit 2 ;;
    esac
done
exit "$status"
