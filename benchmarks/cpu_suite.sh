#!/usr/bin/env bash
# The CPU figures of docs/performance.md on this machine's CPU, in one call: what decides
# whether the vendor-gated paths (the flash engine, oneDNN's products) are enabled on a CPU
# kind, whether the few-row products (decoding's) beat MKL there, and the targets they are
# held to. The switches run both ways, whatever this CPU's default is.
#
#   benchmarks/cpu_suite.sh [STAGES]     # attention,flash,linear,generate,profile (default: all)
#
#   attention  attention_cpu.py --vs-sdpa: every variant and weighting, forward+backward,
#              against SDPA at N=4096 (the L1, ALiBi, softcap and weighting targets)
#   flash      attention_flash_cpu.py with QKV_FLASH=1: the flash engine's inference forward
#              against SDPA (float32 and bf16 products), where it would run
#   linear     linear_cpu.py: 1 to 32 rows by SmolLM2's weights in F.linear (MKL), oneDNN and
#              qkv's few-row loop, then 1,024 rows (a prompt's products: whether oneDNN's
#              pay there), then 1 to 16 rows by the same weights in bf16
#   generate   generate_cpu.py, SmolLM2 fp32 against transformers (time to first token of 1,024
#              tokens, decoding at batch 1 and 8): with QKV_FLASH, QKV_ONEDNN_LINEAR,
#              QKV_FEW_ROWS_LINEAR and QKV_ROW_OPS all 0 (the operations transformers runs),
#              with only the few-row loop and row operations on, then with all four on
#   profile    decode_profile_cpu.py: where a batch-1 token's time goes, with this CPU's defaults
#
# Each benchmark prints its table and adds its rows to benchmarks/results/<name>-<date>-
# <machine>.json (benchmarks/results.py; the command recorded names the switches). On 2 cores
# the five stages take about 10 minutes on a Zen 4 (the bf16 products 1.5, the profile 12 s)
# and 5 on a Zen 5 (the 1,024-row products 36 s). Environment: PYTHON (default: .venv's, else
# python3), ROUNDS (generate's rounds, default 4), REPEAT (attention's rounds, default 3).
set -uo pipefail

stages=${1:-attention,flash,linear,generate,profile}
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root" || exit 1
if [ -n "${PYTHON:-}" ]; then
    py=$PYTHON
elif [ -x .venv/bin/python ]; then
    py=.venv/bin/python
else
    py=python3
fi
export PYTHONPATH="$root/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

for stage in ${stages//,/ }; do
    case $stage in
        attention|flash|linear|generate|profile) ;;
        *) echo "cpu_suite.sh: unknown stage '$stage' (expected attention, flash, linear," \
                "generate or profile)" >&2
           exit 2 ;;
    esac
done

"$py" - <<'EOF'
import sys
sys.path.insert(0, "benchmarks")
import torch
from qkv.engines.cpu.build import cpuinfo_line
from results import cpu_name
flags = cpuinfo_line("flags").partition(":")[2].split()
wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
print(f"CPU: {cpu_name()}; {' '.join(f for f in wanted if f in flags) or 'no AVX2'}; "
      f"torch {torch.__version__}, capability {torch.backends.cpu.get_cpu_capability()}")
EOF

status=0
run() {
    echo
    echo "== $*"
    env "$@" || status=1
}
for stage in ${stages//,/ }; do
    case $stage in
        attention)
            run "$py" benchmarks/attention_cpu.py --vs-sdpa --no-table --n 4096 \
                --repeat "${REPEAT:-3}" ;;
        flash)
            run QKV_FLASH=1 "$py" benchmarks/attention_flash_cpu.py --rounds 5 ;;
        linear)
            run "$py" benchmarks/linear_cpu.py --rounds 3
            run "$py" benchmarks/linear_cpu.py --rows 1024 --rounds 3
            run "$py" benchmarks/linear_cpu.py --dtype bf16 --rows 1,2,4,8,16 --rounds 3 ;;
        generate)
            for switches in "0 0 0" "0 0 1" "1 1 1"; do
                read -r flash onednn few <<<"$switches"
                run QKV_FLASH=$flash QKV_ONEDNN_LINEAR=$onednn QKV_FEW_ROWS_LINEAR=$few \
                    QKV_ROW_OPS=$few "$py" benchmarks/generate_cpu.py --batches 1,8 --new 32 \
                    --rounds "${ROUNDS:-4}" --systems "qkv fp32,HF fp32" --no-memory
            done ;;
        profile)
            run "$py" benchmarks/decode_profile_cpu.py ;;
    esac
done
exit $status
