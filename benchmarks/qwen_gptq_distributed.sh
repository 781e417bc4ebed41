#!/usr/bin/env bash
# Qwen2.5-Coder-1.5B-Instruct (scripts/qwen_coder_1_5b.sh builds it) quantized four ways on this
# machine, each alone: round-to-nearest at group 128, and GPTQ at group 128 with one process and
# with two (torchrun, gloo). Then a small verify of each against bf16 and a generate sample.
# Every quantization_report.json records time, world size and peak RSS (per rank for GPTQ).
# Benchmark only, not CI: about 3 GB of source, tens of minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
SRC=${SRC:-models/qwen2.5-coder-1.5b-bf16}
OUT=${OUT:-models/qwen-gptq}
NSAMPLES=${NSAMPLES:-16}
SEQLEN=${SEQLEN:-256}
WINDOWS=${WINDOWS:-4}
mkdir -p "$OUT"
GPTQ=(--method gptq --group-size 128 --nsamples "$NSAMPLES" --seqlen "$SEQLEN" --overwrite)

/usr/bin/time -f "rtn-g128: %e s wall, %M KiB max RSS" \
    .venv/bin/int4q quantize --model "$SRC" --out "$OUT/rtn-g128" --group-size 128 --overwrite --no-progress
/usr/bin/time -f "gptq-1proc: %e s wall, %M KiB max RSS" \
    .venv/bin/int4q quantize --model "$SRC" --out "$OUT/gptq-1proc" "${GPTQ[@]}"
/usr/bin/time -f "gptq-2proc: %e s wall (torchrun and both ranks)" \
    env OMP_NUM_THREADS=1 .venv/bin/torchrun --nproc-per-node 2 --master-addr 127.0.0.1 --master-port 29531 \
    -m quantizer quantize --model "$SRC" --out "$OUT/gptq-2proc" "${GPTQ[@]}"

for d in rtn-g128 gptq-1proc gptq-2proc; do
    .venv/bin/python - "$OUT/$d/quantization_report.json" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))["summary"]
print(sys.argv[1], {k: s.get(k) for k in ("seconds", "peak_rss_mb", "world_size", "windows_per_rank",
                                          "calibration_peak_rss_mb_per_rank", "whole_model_bits_per_weight")})
PY
    .venv/bin/int4q verify "$OUT/$d" --reference "$SRC" --max-windows "$WINDOWS" --ctx 512 --greedy-tokens 0 \
        --json "$OUT/$d/verify_report.json" | grep -E "KLD|perplexity|PASS|FAIL" || true
done
.venv/bin/int4q generate "$OUT/gptq-2proc" --chat --prompt "Write a Python function that reverses a string." \
    --max-new-tokens 64 --stats
